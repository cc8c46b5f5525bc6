"""The sampler: per-request logits processing and token choice for a whole batch at once."""

from __future__ import annotations

import torch

from tokenmill.engine.request import Request
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.outputs import Logprob

_NEG_INF = float("-inf")


def apply_penalties(logits: torch.Tensor, reqs: list[Request], vocab_size: int) -> None:
    """Repetition (prompt and output tokens), presence and frequency (output tokens) penalties, in place."""
    rows = [i for i, r in enumerate(reqs) if r.sampling_params.needs_penalties]
    if not rows:
        return
    dev = logits.device
    sub = logits[rows]
    out_counts = torch.zeros(len(rows), vocab_size, device=dev)
    seen = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=dev)
    for j, i in enumerate(rows):
        r = reqs[i]
        if r.output_token_ids:
            ids = torch.tensor(r.output_token_ids, device=dev)
            out_counts[j].index_add_(0, ids, torch.ones(len(ids), device=dev))
        seen[j, torch.tensor(r.prompt_token_ids, device=dev)] = True
    seen |= out_counts > 0
    params = [reqs[i].sampling_params for i in rows]
    rep = torch.tensor([p.repetition_penalty for p in params], device=dev).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], device=dev).unsqueeze(1)
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev).unsqueeze(1)
    penalised = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalised, sub)
    sub = sub - freq * out_counts - pres * (out_counts > 0).float()
    logits[rows] = sub


def apply_bias_and_min_tokens(logits: torch.Tensor, reqs: list[Request]) -> None:
    for i, r in enumerate(reqs):
        sp = r.sampling_params
        if sp.logit_bias:
            ids = torch.tensor(list(sp.logit_bias.keys()), device=logits.device)
            logits[i, ids] += torch.tensor(list(sp.logit_bias.values()), device=logits.device)
        if r.num_output_tokens < sp.min_tokens:
            banned = sp.ending_token_ids
            if banned:
                logits[i, torch.tensor(banned, device=logits.device)] = _NEG_INF


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens outside top-k, outside the top-p nucleus, or below min_p x the top probability.

    logits are already divided by the temperature; top_k 0 means no limit.
    """
    vocab = logits.shape[-1]
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
        remove = ranks >= k
        sorted_logits = sorted_logits.masked_fill(remove, _NEG_INF)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
        remove |= ((probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        remove[:, 0] = False
        logits = logits.scatter(1, order, sorted_logits.masked_fill(remove, _NEG_INF))
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, _NEG_INF)
    return logits


def needs_processing(r: Request) -> bool:
    """False for plain greedy choice: the largest logit as it is, nothing else asked of the logits."""
    sp = r.sampling_params
    return (not sp.greedy or sp.logprobs is not None or bool(sp.logit_bias) or sp.needs_penalties
            or r.num_output_tokens < sp.min_tokens)


class Sampler:
    """Chooses one token per row; seeded requests draw from their own generator."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[dict | None]]:
        if not any(needs_processing(r) for r in reqs):  # plain greedy: the largest logit, as it is
            return cpu_kernels.argmax(logits).tolist(), [None] * len(reqs)
        logits = logits.float()
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in reqs):
            raw_logprobs = logits.log_softmax(dim=-1)
        logits = logits.clone()
        apply_bias_and_min_tokens(logits, reqs)
        apply_penalties(logits, reqs, self.vocab_size)

        tokens = cpu_kernels.argmax(logits)
        random_rows = [i for i, r in enumerate(reqs) if not r.sampling_params.greedy]
        if random_rows:
            sub = logits[random_rows]
            params = [reqs[i].sampling_params for i in random_rows]
            temp = torch.tensor([p.temperature for p in params], device=sub.device).unsqueeze(1)
            sub = filter_logits(
                sub / temp,
                torch.tensor([p.top_k for p in params], device=sub.device),
                torch.tensor([p.top_p for p in params], device=sub.device),
                torch.tensor([p.min_p for p in params], device=sub.device),
            )
            tokens[random_rows] = self._draw(sub.softmax(dim=-1), [reqs[i] for i in random_rows])

        token_list = tokens.tolist()
        logprobs: list[dict | None] = [None] * len(reqs)
        if raw_logprobs is not None:
            for i, r in enumerate(reqs):
                k = r.sampling_params.logprobs
                if k is not None:
                    logprobs[i] = token_logprobs(raw_logprobs[i], token_list[i], k)
        return token_list, logprobs

    def _draw(self, probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """One token per row of probs [rows, vocab], drawn by inverting the row's cumulative distribution
        with one uniform number from the request's own generator (or the sampler's). The running sums are
        float64, so they keep their precision over a large vocabulary; u in [0, 1) times the total stays
        below it, and a token of probability 0 spans no interval, so it is never drawn. (One number per
        row where an exponential race needs one per token: ~0.09 ms instead of ~1 ms for 49k tokens.)"""
        cdf = probs.double().cumsum(dim=-1)
        u = torch.cat([torch.rand(1, dtype=torch.float64, generator=r.generator or self.generator) for r in reqs])
        return torch.searchsorted(cdf, u.to(cdf.device).unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)


def token_logprobs(row: torch.Tensor, token: int, k: int) -> dict[int, Logprob]:
    """The chosen token's logprob and rank, plus the top k (ranked 1..k)."""
    chosen = row[token]
    out = {token: Logprob(float(chosen), int((row > chosen).sum()) + 1)}
    if k > 0:
        values, ids = row.topk(k)
        for rank, (v, t) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            out.setdefault(t, Logprob(v, rank))
    return out
