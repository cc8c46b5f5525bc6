"""Proposers of speculative tokens and the per-request rule for how many to propose."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_lookup(tokens: list[int] | np.ndarray, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n tokens, for
    the longest n in [lookup_min, lookup_max] that occurs earlier; [] where none does."""
    a = np.asarray(tokens, dtype=np.int64)
    length = len(a)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        # Windows that start at i with a token after them (i + n <= length - 1), the suffix itself excluded.
        windows = sliding_window_view(a[:length - 1], n)
        hits = np.flatnonzero((windows == a[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return a[start:start + k].tolist()
    return []


@dataclass(slots=True)
class AdaptiveDraft:
    """How many tokens to propose for one request: grows while drafts are accepted whole, falls to one
    more than the accepted run when they are not. A request whose drafts keep failing (acceptance below
    PAUSE_BELOW over the recent ones) gets none for its next PAUSE_TOKENS tokens, then is tried again with
    one, so that speculation costs a badly predicted request little. The pause counts the request's
    tokens, not engine steps: steps without proposals may run as bursts of several tokens each.

    `done` below is the request's output tokens so far (num_output_tokens)."""

    limit: int  # the configured num_speculative_tokens
    k: int = 0
    rate: float = 1.0  # running acceptance rate of this request's drafts
    paused_until: int = 0  # no proposal while done is below this
    idle_from: int | None = None  # done when plan_drafts began to give this request none, in a row
    # Decayed counts of proposed tokens accepted after their predecessors were (hits) and of the first
    # rejected one of each draft (misses): their ratio is the chance that a proposal's next token is
    # accepted, given the ones before it were. Proposals tend to hold or fail whole (a quoted passage),
    # so this is higher than the share of all proposed tokens accepted, and what a further token gains.
    hits: float = 1.0
    misses: float = 0.0

    PAUSE_BELOW = 0.25
    PAUSE_TOKENS = 16
    DECAY = 0.7

    def __post_init__(self) -> None:
        self.k = self.limit

    def want(self, done: int) -> int:
        """Tokens to propose this step (0: none)."""
        return 0 if done < self.paused_until else self.k

    def passed_over(self, done: int) -> None:
        """The step's cost left this request without proposals (plan_drafts): once that has lasted
        PAUSE_TOKENS tokens, an acceptance (and running rate) below 0.5 is taken as 0.5 again, so that the
        request is tried anew rather than judged for ever on its old drafts."""
        if self.idle_from is None:
            self.idle_from = done
        elif done - self.idle_from >= self.PAUSE_TOKENS:
            self.idle_from, self.rate = None, max(self.rate, 0.5)
            if self.acceptance < 0.5:
                self.hits = self.misses = 1.0

    @property
    def acceptance(self) -> float:
        """The chance that a proposed token is accepted, given the ones before it were (hits, misses)."""
        return self.hits / (self.hits + self.misses)

    def update(self, proposed: int, accepted: int, done: int) -> None:
        self.idle_from = None
        self.rate = self.DECAY * self.rate + (1 - self.DECAY) * accepted / proposed
        self.hits = self.DECAY * self.hits + accepted
        self.misses = self.DECAY * self.misses + (accepted < proposed)
        if accepted == proposed:
            self.k = min(self.limit, self.k + 1)
        else:
            self.k = max(1, accepted + 1)
        if self.rate < self.PAUSE_BELOW:
            self.paused_until, self.k, self.rate = done + self.PAUSE_TOKENS, 1, 0.5


class StepCost:
    """What a decode step costs by its query rows: the line t = a + b rows through the recent wall times of
    steps that only decode (each request its last token and its proposals), the proposing included, and a
    burst's steps at their share of its time. A time is kept per row count (the mean of its first steps,
    then a moving average); the line is fitted through them, weighted by how often each was seen. None
    until MIN_SAMPLES steps have been seen at the row count without proposals and at another one."""

    DECAY = 0.9  # the weight of a row count's earlier times against a new one, once it has 10
    MIN_SAMPLES = 3  # steps of a row count before its time counts

    def __init__(self) -> None:
        self.times: dict[int, float] = {}
        self.counts: dict[int, int] = {}

    def record(self, rows: int, seconds: float) -> None:
        n = self.counts.get(rows, 0) + 1
        new = max(1 / n, 1 - self.DECAY)
        self.times[rows] = (1 - new) * self.times.get(rows, 0.0) + new * seconds
        self.counts[rows] = n

    def line(self, base: int) -> tuple[float, float] | None:
        """(a, b), both >= 0, or None while too few steps have been seen at `base` rows (the step's decoding
        requests, no proposals) or at any other row count."""
        seen = [(r, self.times[r], min(n, 32)) for r, n in self.counts.items() if n >= self.MIN_SAMPLES]
        if len(seen) < 2 or self.counts.get(base, 0) < self.MIN_SAMPLES:
            return None
        w = sum(n for _, _, n in seen)
        mr = sum(r * n for r, _, n in seen) / w
        mt = sum(t * n for _, t, n in seen) / w
        var = sum(n * (r - mr) ** 2 for r, _, n in seen)
        b = max(0.0, sum(n * (r - mr) * (t - mt) for r, t, n in seen) / var)
        a = mt - b * mr
        if a <= 0:  # the fit would make a step with no rows free or better: proportional to rows instead
            b, a = mt / mr, 0.0
        return a, b


def plan_drafts(rates: list[float], caps: list[int], line: tuple[float, float] | None, others: int = 0) -> list[int]:
    """How many tokens to propose for each of a step's decoding requests, given each one's acceptance
    (AdaptiveDraft.acceptance) and the most it may take (caps), so that the step's expected tokens per
    second is greatest. A request whose proposed tokens are each accepted with probability p (given the
    ones before) gains p^j from its j-th proposed token; the step yields one token per request plus those
    gains, and costs a + b rows. Proposals go one at a time to the request that gains most from its next
    one, while that raises tokens per second (the gains only fall, so the first that does not ends it).
    others: the step's other decoding rows (a token each, no proposals). Without a cost line: the caps."""
    if line is None:
        return list(caps)
    a, b = line
    ks = [0] * len(caps)
    rows = len(caps) + others
    tokens = float(rows)
    heap = [(-p, i) for i, (p, cap) in enumerate(zip(rates, caps)) if cap > 0 and p > 0]
    heapq.heapify(heap)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        gain = -neg_gain
        # (tokens + gain) / (a + b (rows + 1)) > tokens / (a + b rows), without dividing
        if (tokens + gain) * (a + b * rows) <= tokens * (a + b * (rows + 1)):
            break
        ks[i] += 1
        rows += 1
        tokens += gain
        if ks[i] < caps[i]:
            heapq.heappush(heap, (-gain * rates[i], i))
    return ks


class NgramProposer:
    """Prompt lookup: a request's next tokens guessed from where its latest tokens occurred before, in
    its prompt or its output. Costs microseconds; wins where the output quotes its input."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, wanted: list) -> list[list[int]]:
        """wanted: (request, k) pairs; returns up to k tokens for each."""
        return [ngram_lookup(req.all_token_ids, k, self.lookup_min, self.lookup_max) for req, k in wanted]

    def finds(self, tokens: list[int]) -> bool:
        """Whether a lookup after these tokens would propose something."""
        return bool(ngram_lookup(tokens, 1, self.lookup_min, self.lookup_max))


def make_proposer(cfg, engine):
    if cfg.method == "ngram":
        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    from tokenmill.spec.draft import DraftModelProposer

    return DraftModelProposer(cfg, engine)
