"""The sampler: per-request logits processing and token choice for a whole batch at once."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.engine.request import Request
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.outputs import Logprob
from tokenmill.structured.backend import allocate_bitmask, apply_bitmask

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
        if r.num_output_tokens < sp.min_tokens and r.grammar is None:  # a grammar decides where output ends
            banned = sp.ending_token_ids
            if banned:
                logits[i, torch.tensor(banned, device=logits.device)] = _NEG_INF


def _nucleus(row: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The token ids one row keeps under top-k and top-p, and their logits.

    Only the highest logits are ranked (torch.topk), not the whole vocabulary: the nucleus ends among the
    first k where the probability ranked above a token reaches top_p; where it has not ended within them,
    k grows. Under top-k the probabilities are those of the k tokens alone, renormalised. A nucleus that
    spans a large part of the row is found from the sorted values alone (no sorted ids), and keeps every
    token whose logit equals the last one kept."""
    vocab = row.shape[-1]
    k = min(top_k, vocab) if top_k > 0 else min(256, vocab)
    while True:
        if k == vocab and top_k <= 0:
            values = _sorted_descending(row)
            probs = (values - row.logsumexp(dim=-1)).exp()
            kept = int(((probs.cumsum(dim=-1) - probs) < top_p).sum())
            ids = (row >= values[max(kept, 1) - 1]).nonzero().squeeze(1)
            return ids, row[ids]
        values, ids = row.topk(k)  # descending
        if top_p >= 1:
            return ids, values
        probs = values.softmax(dim=-1) if top_k > 0 else (values - row.logsumexp(dim=-1)).exp()
        # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
        keep = (probs.cumsum(dim=-1) - probs) < top_p
        keep[0] = True
        if top_k > 0 or not bool(keep.all()):
            return ids[keep], values[keep]
        # The nucleus goes on past these k: rank 16 times as many, or more where their share of the mass
        # suggests it (four times over, lower ranks carrying less each), or the whole row once that is a
        # large part of it.
        k = max(16 * k, int(4 * k * top_p / max(float(probs.sum()), 1e-9)))
        k = vocab if 4 * k > vocab else k


def _sorted_descending(row: torch.Tensor) -> torch.Tensor:
    """A 1-D row's values, largest first (numpy's sort of values alone is ~3x torch's sort on the CPU,
    which orders ids as well)."""
    if row.device.type == "cpu" and row.dtype == torch.float32:
        return torch.from_numpy(np.ascontiguousarray(np.sort(row.numpy())[::-1]))
    return row.sort(descending=True).values


def _nucleus_sorted(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """top-k and top-p for all rows at once by sorting each whole row: a few large kernels, the better
    choice on a GPU, where a loop over rows would wait on the device at every step."""
    vocab = logits.shape[-1]
    dev = logits.device
    k_limit = torch.tensor([k if k > 0 else vocab for k in top_k], device=dev).unsqueeze(1)
    p_limit = torch.tensor(top_p, device=dev).unsqueeze(1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    remove = torch.arange(vocab, device=dev).unsqueeze(0) >= k_limit
    sorted_logits = sorted_logits.masked_fill(remove, _NEG_INF)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
    remove |= ((probs.cumsum(dim=-1) - probs) >= p_limit) & (p_limit < 1)
    remove[:, 0] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(remove, _NEG_INF))


def filter_logits(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Mask tokens outside top-k, outside the top-p nucleus, or below min_p x the top probability.

    logits [rows, vocab] are already divided by the temperature; per row, top_k 0 means no limit. On
    the CPU each row that needs it ranks only its highest logits (_nucleus); elsewhere whole rows are
    sorted together.
    """
    rows = {i for i in range(logits.shape[0]) if top_k[i] > 0 or top_p[i] < 1}
    if rows and logits.device.type != "cpu":
        logits = _nucleus_sorted(logits, top_k, top_p)
    elif rows:
        logits = logits.clone()
        for i in rows:
            ids, values = _nucleus(logits[i], top_k[i], top_p[i])
            logits[i] = _NEG_INF
            logits[i, ids] = values
    if any(m > 0 for m in min_p):
        probs = logits.softmax(dim=-1)
        threshold = torch.tensor(min_p, device=logits.device).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, _NEG_INF)
    return logits


def shapes_logits(r: Request) -> bool:
    """Whether the request asks anything of its logits besides temperature, top-k/p and min-p: logprobs,
    a bias, penalties, min_tokens still to reach, or a grammar."""
    sp = r.sampling_params
    return (sp.logprobs is not None or bool(sp.logit_bias) or sp.needs_penalties
            or r.num_output_tokens < sp.min_tokens or r.grammar is not None)


def needs_processing(r: Request) -> bool:
    """False for plain greedy choice: the largest logit as it is, nothing else asked of the logits."""
    return not r.sampling_params.greedy or shapes_logits(r)


class Sampler:
    """Chooses one token per row; seeded requests draw from their own generator."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[dict | None]]:
        if not any(needs_processing(r) for r in reqs):  # plain greedy: the largest logit, as it is
            return cpu_kernels.argmax(logits).tolist(), [None] * len(reqs)
        kernel = cpu_kernels.sampler_kernel(logits)
        if kernel is not None and not any(shapes_logits(r) for r in reqs):
            # Temperature, top-k/p and min-p alone: every row in one call of the kernel, as the logits are.
            return self._kernel_draw(kernel, logits, reqs, range(len(reqs))).tolist(), [None] * len(reqs)
        logits = logits.float()
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in reqs):
            raw_logprobs = logits.log_softmax(dim=-1)
        logits = logits.clone()
        constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if constrained:  # tokens the request's grammar does not allow next: -inf, before anything else
            bitmask = allocate_bitmask(len(reqs), logits.shape[-1])
            for i in constrained:
                reqs[i].grammar.fill(bitmask, i)
            apply_bitmask(logits, bitmask, constrained)
        apply_bias_and_min_tokens(logits, reqs)
        apply_penalties(logits, reqs, self.vocab_size)

        tokens = cpu_kernels.argmax(logits)
        random_rows = [i for i, r in enumerate(reqs) if not r.sampling_params.greedy]
        if random_rows and kernel is not None:
            tokens[random_rows] = self._kernel_draw(kernel, logits[random_rows], reqs, random_rows)
        elif random_rows:
            sub = logits[random_rows]
            params = [reqs[i].sampling_params for i in random_rows]
            temp = torch.tensor([p.temperature for p in params], device=sub.device).unsqueeze(1)
            # A tiny repetition penalty or temperature can overflow logits to inf, and inf - inf is NaN in
            # the softmax: an infinite logit becomes the largest float (the tokens there share the mass),
            # a NaN one is never drawn.
            sub = torch.nan_to_num(sub / temp, nan=_NEG_INF, posinf=torch.finfo(sub.dtype).max)
            tokens[random_rows] = self._sample(sub, params, [reqs[i] for i in random_rows], tokens[random_rows])

        token_list = tokens.tolist()
        logprobs: list[dict | None] = [None] * len(reqs)
        if raw_logprobs is not None:
            for i, r in enumerate(reqs):
                k = r.sampling_params.logprobs
                if k is not None:
                    logprobs[i] = token_logprobs(raw_logprobs[i], token_list[i], k)
        return token_list, logprobs

    def _kernel_draw(self, kernel, rows: torch.Tensor, reqs: list[Request], which) -> torch.Tensor:
        """One token per row of logits (those of reqs[j] for j in `which`, before the temperature) by the CPU
        kernel: greedy rows their argmax, the others drawn with one uniform number each from the request's
        own generator (or the sampler's); a row with no finite logit its argmax, as on the torch path."""
        params = [reqs[j].sampling_params for j in which]
        u = [0.0 if p.greedy else float(torch.rand(1, dtype=torch.float64,
                                                      generator=reqs[j].generator or self.generator))
             for j, p in zip(which, params)]
        drawn = kernel.sample_rows(rows, torch.tensor([0.0 if p.greedy else p.temperature for p in params]),
                                   torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params]),
                                   torch.tensor([p.min_p for p in params]), torch.tensor(u, dtype=torch.float64))
        if bool((drawn < 0).any()):
            drawn = torch.where(drawn >= 0, drawn, cpu_kernels.argmax(rows))
        return drawn

    def _sample(self, sub: torch.Tensor, params: list, reqs: list[Request], fallback: torch.Tensor) -> torch.Tensor:
        """One token per row of temperature-scaled logits, under each row's top-k, top-p and min-p."""
        out = fallback.clone()
        truncating = [j for j, p in enumerate(params) if p.top_k > 0 or p.top_p < 1 or p.min_p > 0]
        undecided = self._sample_candidates(sub, truncating, params, reqs, out) if (
            truncating and sub.device.type == "cpu") else truncating
        rest = sorted(set(range(len(params))) - set(truncating) | set(undecided))
        if rest:
            s, p = sub[rest], [params[j] for j in rest]
            s = filter_logits(s, [q.top_k for q in p], [q.top_p for q in p], [q.min_p for q in p])
            out[rest] = self._draw(s.softmax(dim=-1), [reqs[j] for j in rest], fallback[rest])
        return out

    def _sample_candidates(self, sub: torch.Tensor, rows: list[int], params: list, reqs: list[Request],
                           out: torch.Tensor) -> list[int]:
        """Draw rows under top-k / top-p / min-p from their highest logits alone, ranked once for the batch
        (torch.topk), instead of masking and normalising every row over the whole vocabulary (~2 ms a row
        of 49k tokens here). top-p needs a row's whole probability mass: where the mass beyond the ranked
        tokens, at most (tokens left) x (the last ranked one's weight), is under 1e-7 of theirs (float32's
        resolution) it is left out, else it comes from one softmax of those rows. Rows whose kept set may
        reach past the ranked tokens are returned, for the whole-row path."""
        vocab = sub.shape[-1]
        k = min(vocab, max([256] + [params[j].top_k for j in rows]))
        logits = sub[rows]
        values, ids = logits.topk(k, dim=-1)
        top_k = torch.tensor([params[j].top_k or k for j in rows]).unsqueeze(1)
        top_p = torch.tensor([params[j].top_p for j in rows], dtype=torch.float32).unsqueeze(1)
        min_p = torch.tensor([params[j].min_p for j in rows], dtype=torch.float32).unsqueeze(1)
        ranked_only = torch.tensor([params[j].top_k > 0 for j in rows])  # top-k renormalises among the k
        finite = torch.isfinite(values[:, 0])
        weights = torch.where(torch.arange(k).unsqueeze(0) < top_k, (values - values[:, :1]).exp(), 0.0)
        weights = torch.where(finite.unsqueeze(1), weights, 0.0)
        mass = weights.sum(dim=1)
        if k < vocab:
            beyond = (vocab - k) * weights[:, -1]
            exact = ~ranked_only & (top_p.squeeze(1) < 1) & (beyond > 1e-7 * mass) & finite
            if bool(exact.any()):
                rows_exact = exact.nonzero().squeeze(1)
                p_top = logits[rows_exact].softmax(dim=-1).gather(1, ids[rows_exact, :1]).squeeze(1)
                mass[rows_exact] = 1.0 / p_top  # the top token's weight is 1
        probs = weights / mass.clamp_min(1e-30).unsqueeze(1)
        before = probs.cumsum(dim=1) - probs
        keep = (before < top_p) | (top_p >= 1)
        keep[:, 0] = True
        keep &= probs >= min_p * probs[:, :1]
        # A token past the ranked ones would be kept if the nucleus has not closed within them and its
        # weight (at most the last ranked one's) passes min-p.
        open_ended = ~ranked_only & ((top_p.squeeze(1) >= 1) | (probs.sum(dim=1) < top_p.squeeze(1))) & (
            weights[:, -1] >= min_p.squeeze(1)) & finite if k < vocab else torch.zeros(len(rows), dtype=torch.bool)
        cdf = (probs * keep).double().cumsum(dim=1)
        u = torch.cat([torch.rand(1, dtype=torch.float64, generator=reqs[j].generator or self.generator)
                       for j in rows])
        pick = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).clamp_(max=k - 1)
        drawn = ids.gather(1, pick).squeeze(1)
        settled = finite & ~open_ended
        index = torch.tensor(rows)
        out[index[settled]] = drawn[settled]
        return [j for j, o in zip(rows, open_ended.tolist()) if o]

    def _draw(self, probs: torch.Tensor, reqs: list[Request], fallback: torch.Tensor) -> torch.Tensor:
        """One token per row of probs [rows, vocab], drawn by inverting the row's cumulative distribution
        with one uniform number from the request's own generator (or the sampler's). The running sums are
        float64, so they keep their precision over a large vocabulary; u in [0, 1) times the total stays
        below it, and a token of probability 0 spans no interval, so it is never drawn. (One number per
        row where an exponential race needs one per token: ~0.09 ms instead of ~1 ms for 49k tokens.)
        A row with no probability to draw from (every logit NaN or -inf) takes its `fallback` token."""
        cdf = probs.double().cumsum(dim=-1)
        u = torch.cat([torch.rand(1, dtype=torch.float64, generator=r.generator or self.generator) for r in reqs])
        drawn = torch.searchsorted(cdf, u.to(cdf.device).unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
        return torch.where(cdf[:, -1] > 0, drawn, fallback)


def token_logprobs(row: torch.Tensor, token: int, k: int) -> dict[int, Logprob]:
    """The chosen token's logprob and rank, plus the top k (ranked 1..k)."""
    chosen = row[token]
    out = {token: Logprob(float(chosen), int((row > chosen).sum()) + 1)}
    if k > 0:
        values, ids = row.topk(k)
        for rank, (v, t) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            out.setdefault(t, Logprob(v, rank))
    return out
