"""Proposers of speculative tokens and the per-request rule for how many to propose."""

from __future__ import annotations

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
    PAUSE_BELOW over the recent ones) gets none for PAUSE_STEPS steps, then is tried again with one, so
    that speculation costs a badly predicted request little."""

    limit: int  # the configured num_speculative_tokens
    k: int = 0
    rate: float = 1.0  # running acceptance rate of this request's drafts
    paused: int = 0  # steps left with no proposal

    PAUSE_BELOW = 0.25
    PAUSE_STEPS = 16
    DECAY = 0.7

    def __post_init__(self) -> None:
        self.k = self.limit

    def want(self) -> int:
        """Tokens to propose this step (0: none)."""
        if self.paused:
            self.paused -= 1
            return 0
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        self.rate = self.DECAY * self.rate + (1 - self.DECAY) * accepted / proposed
        if accepted == proposed:
            self.k = min(self.limit, self.k + 1)
        else:
            self.k = max(1, accepted + 1)
        if self.rate < self.PAUSE_BELOW:
            self.paused, self.k, self.rate = self.PAUSE_STEPS, 1, 0.5


class NgramProposer:
    """Prompt lookup: a request's next tokens guessed from where its latest tokens occurred before, in
    its prompt or its output. Costs microseconds; wins where the output quotes its input."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, wanted: list) -> list[list[int]]:
        """wanted: (request, k) pairs; returns up to k tokens for each."""
        return [ngram_lookup(req.all_token_ids, k, self.lookup_min, self.lookup_max) for req, k in wanted]


def make_proposer(cfg, engine):
    if cfg.method == "ngram":
        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    from tokenmill.spec.draft import DraftModelProposer

    return DraftModelProposer(cfg, engine)
