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


def _average(values: dict, counts: dict, key, value: float, decay: float) -> None:
    """values[key]: the mean of its first samples, then a moving average (a new sample's weight 1 - decay)."""
    n = counts.get(key, 0) + 1
    new = max(1 / n, 1 - decay)
    values[key] = (1 - new) * values.get(key, 0.0) + new * value
    counts[key] = n


class StepCost:
    """What a decode step costs by its query rows: the line t = a + b rows through the recent wall times of
    steps that only decode (each request its last token and its proposals), the proposing included, and a
    burst's steps at their share of its time. A time is kept per row count (the mean of its first steps,
    then a moving average); the line is fitted through them, weighted by how often each was seen. None
    until MIN_SAMPLES steps have been seen at the row count without proposals and at another one.

    And whether proposing pays at all, by the number of decoding requests (proposing_pays): the tokens a
    second that steps with proposals and steps without them actually gave, each step's proposing
    included. The row line prices a proposal's verify row; it cannot see a draft model's passes, which
    cost the same however few of their tokens are kept, nor a step's fixed costs that proposals add."""

    DECAY = 0.9  # the weight of a row count's earlier times against a new one, once it has 10
    MIN_SAMPLES = 3  # steps of a row count before its time counts
    RETRY = 64  # steps of the better way at a batch size before the other is timed again

    def __init__(self) -> None:
        self.times: dict[int, float] = {}
        self.counts: dict[int, int] = {}
        self.rates: dict[tuple[int, bool], float] = {}  # (decoding requests, with proposals) -> tokens a second
        self.rate_counts: dict[tuple[int, bool], int] = {}
        self.since: dict[int, int] = {}  # steps of the better way since the other was last timed

    def record(self, rows: int, seconds: float) -> None:
        _average(self.times, self.counts, rows, seconds, self.DECAY)

    def record_yield(self, batch: int, proposed: bool, tokens: int, seconds: float, steps: int = 1) -> None:
        """A decode step of `batch` requests, with proposals or without, made `tokens` in `seconds`; a burst
        of `steps` plain steps counts as that many."""
        key = (batch, proposed)
        _average(self.rates, self.rate_counts, key, tokens / seconds, self.DECAY)
        self.rate_counts[key] += steps - 1
        if self.rate_counts.get((batch, not proposed), 0) >= self.MIN_SAMPLES:
            self.since[batch] = self.since.get(batch, 0) + steps

    def _verdict(self, batch: int) -> bool | None:
        """Whether proposals gave more tokens a second at this batch size; None until both ways are timed."""
        if min(self.rate_counts.get((batch, p), 0) for p in (False, True)) < self.MIN_SAMPLES:
            return None
        return self.rates[(batch, True)] >= self.rates[(batch, False)]

    def _judged(self) -> dict[int, bool]:
        """The verdict of every batch size timed both ways."""
        return {b: v for b in {b for b, _ in self.rates} if (v := self._verdict(b)) is not None}

    def plain_is_better(self, batch: int) -> bool:
        """Whether steps without proposals have been found to make more tokens a second at this batch size
        (or at fewer requests), as opposed to being timed."""
        better = self._verdict(batch)
        if better is not None:
            return not better
        return any(b <= batch and not v for b, v in self._judged().items())

    def proposing_pays(self, batch: int, decode_only: bool = True) -> bool:
        """Whether the next step of `batch` decoding requests gets proposals (decode_only: whether it will
        hold nothing else, the only steps timed here). Where steps of this many requests have not been
        timed both ways, MIN_SAMPLES decode-only steps are timed without proposals, then MIN_SAMPLES with;
        then the way that gave more tokens a second goes on, and every RETRY steps the other is timed again
        (acceptance, contexts and the memory's speed move). A batch size not yet judged takes the verdict of
        a judged one where it follows from it: proposals that lost at fewer requests lose at more (each
        request's rows cost more in a fuller step), and proposals that paid at more requests pay at fewer.
        Otherwise, and in steps that also run prompts, proposals are made."""
        better = self._verdict(batch)
        if better is None:
            if self.plain_is_better(batch):
                return False
            if any(b >= batch and v for b, v in self._judged().items()):
                return True
            # plain steps timed first, then steps with proposals
            return not decode_only or self.rate_counts.get((batch, False), 0) >= self.MIN_SAMPLES
        if self.since.get(batch, 0) >= self.RETRY:
            self.since[batch] = 0
            self.rate_counts[(batch, not better)] = 0  # timed afresh (its first samples' mean)
            return not better
        return better

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
