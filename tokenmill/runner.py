"""ModelRunner: owns the model and the KV cache tensors; turns a SchedulerOutput into one forward pass."""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch

from tokenmill.attention import kv_format
from tokenmill.attention.backend import AttentionMetadata
from tokenmill.decode_graphs import DecodeGraphs
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import ModelOutput, ScheduledRequest, SchedulerOutput
from tokenmill.kernels import cpu as cpu_kernels
from tokenmill.kernels import quant
from tokenmill.model.arena import huge_page_buffer
from tokenmill.sample.sampler import Sampler, needs_processing, shapes_logits, token_logprobs


def _decode_like(s: ScheduledRequest) -> bool:
    """A single-token query past the prompt, or a decode with proposed tokens: each of its tokens is a query
    row of the batched decode path (one row per position, causal among themselves through their context
    lengths). A one-token chunk of a prompt (its last token, where the prefix cache held the rest) is a
    prompt chunk as any other: the same rows of a prompt are computed the same way whatever the cache held."""
    return bool(s.spec_token_ids) or (s.num_new_tokens == 1 and not in_prompt(s))


def in_prompt(s: ScheduledRequest) -> bool:
    """Whether the chunk lies wholly inside its request's prompt (its rows are a prompt's: quant.py)."""
    return not s.spec_token_ids and s.request.num_computed_tokens + s.num_new_tokens <= s.request.num_prompt_tokens


def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    cfg = model.config
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * kv_format.bytes_per_row(kv_cache_dtype, cfg.head_dim,
                                                                                         dtype)


def _new_cache_tensor(device: torch.device):
    """new(shape, dtype): a zeroed cache tensor. On the CPU, a buffer advised to use huge pages: decode
    attention reads rows from blocks scattered over a gigabyte, and with 4 KiB pages nearly every block
    costs a TLB miss."""
    if device.type != "cpu":
        return lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device)
    return lambda shape, dtype: huge_page_buffer(math.prod(shape) * dtype.itemsize).zero_().view(dtype).view(shape)


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 seed: int, decode_graphs: bool = False, max_model_len: int | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        # Steps run on the whole team of threads while the CPUs are free, on one while another process holds one.
        self.governor = None
        if device.type == "cpu" and cpu_kernels.fit_threads() > 1:
            self.governor = cpu_kernels.ThreadGovernor(torch.get_num_threads())
        cfg = model.config
        # One (K, V) pair per layer, each a flat array of slots; slot = block_id * block_size + offset.
        # One block more than the pool hands out: the scratch block that padded decode rows write to.
        # In the model's dtype, or 8-bit codes and their scales (kv_format).
        new_tensor = _new_cache_tensor(device)

        def new_cache():
            return kv_format.new_cache(kv_cache_dtype, (num_blocks + 1) * block_size, cfg.num_kv_heads, cfg.head_dim,
                                       dtype, new_tensor)
        self.kv_caches = [(new_cache(), new_cache()) for _ in range(cfg.num_layers)]
        self.scratch_slot = num_blocks * block_size
        self.max_blocks = -(-(max_model_len or num_blocks * block_size) // block_size)
        self.decode_graphs = self.new_decode_graphs(capture=True) if decode_graphs else None
        self.sampler = Sampler(cfg.vocab_size, seed)
        self._burst = None  # the fused decoder while it runs a burst of decode steps
        # Bursts need the model's fused CPU decoder; cleared the first time the model has none to give.
        self.supports_bursts = hasattr(model, "_fused_decoder") and device.type == "cpu" and dtype == torch.bfloat16
        # A whole model's decoder (not one tensor-parallel shard) also draws sampled tokens in a burst and
        # hands each step's tokens over as soon as they are chosen.
        self.whole_bursts = self.supports_bursts and getattr(model, "_tp", None) is None

    def bursts_choose(self, req: Request) -> bool:
        """Whether a burst of decode steps chooses this request's tokens: plain greedy ones; or, by the
        sampler kernel in a whole decoder, those drawn under temperature, top-k/p and min-p alone."""
        if not needs_processing(req):
            return True
        return self.whole_bursts and cpu_kernels.SAMPLE_KERNEL and not shapes_logits(req)

    def execute_burst(self, sched: SchedulerOutput, steps: int, interrupted: Callable[[], bool],
                      on_step: Callable[[ModelOutput], bool] | None = None) -> list[ModelOutput] | None:
        with self.governor or contextlib.nullcontext():
            return self._execute_burst(sched, steps, interrupted, on_step)

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        with self.governor or contextlib.nullcontext():
            return self._execute(sched)

    def one_thread_stats(self) -> dict:
        """How often a core taken by another process sent work to one thread: steps the governor held there
        and its holds, and the fused decoder's calls that its own switch ran there. {} on one thread."""
        if self.governor is None:
            return {}
        fused = self.model.built_fused_decoder() if hasattr(self.model, "built_fused_decoder") else None
        return {"cpu_steps_on_one_thread": self.governor.solo_steps, "cpu_one_thread_holds": self.governor.switches,
                "cpu_decode_calls_on_one_thread": fused.team_stats()[1] if fused is not None else 0}

    @torch.inference_mode()
    def _execute_burst(self, sched: SchedulerOutput, steps: int, interrupted: Callable[[], bool],
                       on_step: Callable[[ModelOutput], bool] | None) -> list[ModelOutput] | None:
        """Up to `steps` decode steps of a batch of single-token (decode) requests whose tokens a burst
        chooses (bursts_choose) in one call of the fused decoder; every request's blocks must already hold
        the slots of all the steps. Returns each step's sampled tokens, or None (nothing run) where the
        fused decoder does not run this batch, a request's token is still its prompt's, or interrupted()
        already holds. The burst ends early when every request has produced a stop token, after the step
        running when interrupt() is called, or once on_step (given each step's tokens as soon as they are
        chosen; a whole decoder's bursts only) returns True."""
        items = sched.scheduled
        if not self.supports_bursts or any(in_prompt(s) for s in items):
            return None
        input_ids, positions, meta, _ = self._prepare(items)
        fused = self.model._fused_decoder(self.kv_caches, meta)
        if fused is None:  # no kernels on this CPU, or a shape they do not take
            self.supports_bursts = False
            return None
        slots = torch.tensor([[self._slot(s.request, s.request.num_computed_tokens + j) for s in items]
                              for j in range(steps)], dtype=torch.long)
        stop_ids = [s.request.sampling_params.ending_token_ids for s in items]
        ids = [s.request.request_id for s in items]
        args = (input_ids, positions, slots, meta.decode_block_tables, meta.decode_seq_lens, stop_ids)
        hook = {} if on_step is None else {"on_step": lambda _, row: on_step(ModelOutput(sampled=dict(zip(ids, row))))}
        reqs = [s.request for s in items]
        fused.clear_interrupt()
        self._burst = fused  # from here on interrupt() reaches it; before, interrupted() tells
        try:
            if interrupted():
                return None
            if all(r.sampling_params.greedy for r in reqs):
                tokens = fused.decode_greedy(*args, **hook)
            else:
                u, rewind = self._burst_draws(reqs, steps)
                params = [r.sampling_params for r in reqs]
                tokens = fused.decode_sampled(
                    *args, torch.tensor([0.0 if p.greedy else p.temperature for p in params]),
                    torch.tensor([p.top_k for p in params]), torch.tensor([p.top_p for p in params]),
                    torch.tensor([p.min_p for p in params]), u, **hook)
                rewind(len(tokens))
        finally:
            self._burst = None
        return [ModelOutput(sampled=dict(zip(ids, row))) for row in tokens.tolist()]

    def _burst_draws(self, reqs: list[Request], steps: int) -> tuple[torch.Tensor, Callable[[int], None]]:
        """The uniform numbers a burst's sampled requests draw with, [steps, batch], taken from the
        generators as `steps` plain steps would take them (the sampler's kernel path: one a step from a
        seeded request's own generator; from the sampler's, for the others in batch order); and rewind(done),
        which leaves every generator as if only the first `done` steps had drawn."""
        u = torch.zeros(steps, len(reqs), dtype=torch.float64)
        taken = []  # (generator, its state before, numbers a step)
        shared = []
        for b, r in enumerate(reqs):
            if r.sampling_params.greedy:
                continue
            if r.generator is None:
                shared.append(b)
                continue
            taken.append((r.generator, r.generator.get_state(), 1))
            u[:, b] = torch.rand(steps, dtype=torch.float64, generator=r.generator)
        if shared:
            g = self.sampler.generator
            taken.append((g, g.get_state(), len(shared)))
            u[:, shared] = torch.rand(steps, len(shared), dtype=torch.float64, generator=g)

        def rewind(done: int) -> None:
            if done < steps:
                for g, state, per_step in taken:
                    g.set_state(state)
                    if done:
                        torch.rand(done * per_step, dtype=torch.float64, generator=g)
        return u, rewind

    def interrupt(self) -> None:
        """End a running burst after its current step (any thread)."""
        fused = self._burst
        if fused is not None:
            fused.interrupt()

    def new_decode_graphs(self, capture: bool) -> DecodeGraphs:
        """Decode steps replayed from CUDA graphs (capture=False: the same padded buffers, run eagerly)."""
        return DecodeGraphs(self.model, self.kv_caches, self.block_size, self.max_blocks, self.scratch_slot,
                            self.device, capture)

    @torch.inference_mode()
    def _execute(self, sched: SchedulerOutput) -> ModelOutput:
        # Decode rows first: the attention backend batches them in one call; prompt rows last.
        items = sorted(sched.scheduled, key=lambda s: (not _decode_like(s), in_prompt(s)))
        input_ids, positions, meta, starts = self._prepare(items)
        out = ModelOutput()
        decode_only = meta.num_decodes == meta.num_reqs
        # A decode-only step in which every request samples and none wants prompt logprobs needs only the
        # logits, which the fused CPU decoder computes in the same call as the layers.
        if (decode_only and self.decode_graphs is None and hasattr(self.model, "decode_logits")
                and all(s.samples and s.request.sampling_params.prompt_logprobs is None for s in items)):
            logits = self.model.decode_logits(input_ids, positions, self.kv_caches, meta)
            if logits is not None:
                return self._choose(out, logits, items, [start + s.num_new_tokens - 1 - len(s.spec_token_ids)
                                                         for s, start in zip(items, starts)])
        hidden = None
        if self.decode_graphs is not None and decode_only:
            hidden = self.decode_graphs.forward(input_ids, positions, meta.slot_mapping, meta.decode_block_tables,
                                                meta.decode_seq_lens)
        if hidden is None:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)

        sample_rows, sampling, sample_starts = [], [], []
        for s, start in zip(items, starts):
            if s.samples:
                sample_starts.append(len(sample_rows))
                first = start + s.num_new_tokens - 1 - len(s.spec_token_ids)
                sample_rows.extend(range(first, start + s.num_new_tokens))
                sampling.append(s)
            if s.request.sampling_params.prompt_logprobs is not None and not s.spec_token_ids:
                out.prompt_logprobs[s.request.request_id] = self._prompt_logprobs(s, hidden[start:start + s.num_new_tokens])
        if sampling:
            self._choose(out, self.model.compute_logits(hidden[sample_rows]), sampling, sample_starts)
        return out

    def _choose(self, out: ModelOutput, logits: torch.Tensor, items: list[ScheduledRequest],
                rows: list[int]) -> ModelOutput:
        """Each request's next token from its rows of logits, into out: row rows[i] for a request without
        proposals; rows[i] and the one after it per proposal for a request verifying them."""
        plain = [i for i, s in enumerate(items) if not s.spec_token_ids]
        if plain:
            picked = logits if len(plain) == logits.shape[0] else logits[[rows[i] for i in plain]]
            self._sample(out, picked, [items[i].request for i in plain])
        if len(plain) < len(items):
            self._verify(out, logits, [(s, r) for s, r in zip(items, rows) if s.spec_token_ids])
        return out

    def _verify(self, out: ModelOutput, logits: torch.Tensor, spec: list[tuple[ScheduledRequest, int]]) -> None:
        """The tokens each verifying request keeps: row j of its logits (the target after its last token
        and the first j proposals) chooses a token as a plain step would; while it equals proposal j + 1
        the next row chooses too. The request keeps every choice up to the first that differs from its
        proposal, or the one after the last proposal.

        This is rejection sampling for proposals that are certain (q one-hot): proposal d is kept with
        probability p(d), and on rejection the token comes from p with d removed, renormalised, which
        is what drawing from p and comparing gives. Each row draws from the distribution a plain step at
        that position would draw from: while rows are chosen, the request shows the accepted proposals
        as its output (penalties, min_tokens), and a seeded request draws one number per chosen row from
        its own generator, as plain steps do."""
        if not any(needs_processing(s.request) for s, _ in spec):  # greedy: every row's argmax at once
            rows = [r for s, start in spec for r in range(start, start + s.num_new_tokens)]
            best = iter(cpu_kernels.argmax(logits[rows]).tolist())
            for s, _ in spec:
                row = [next(best) for _ in range(s.num_new_tokens)]
                kept = 1
                while kept < len(row) and row[kept - 1] == s.spec_token_ids[kept - 1]:
                    kept += 1
                out.sampled[s.request.request_id] = row[0]
                out.spec_sampled[s.request.request_id] = row[1:kept]
            return
        chosen: dict[str, list[tuple[int, dict | None]]] = {s.request.request_id: [] for s, _ in spec}
        shown = dict.fromkeys(chosen, 0)
        active = list(spec)
        try:
            for j in range(max(s.num_new_tokens for s, _ in spec)):
                tokens, lps = self.sampler(logits[[start + j for _, start in active]], [s.request for s, _ in active])
                still = []
                for (s, start), tok, lp in zip(active, tokens, lps):
                    chosen[s.request.request_id].append((tok, lp))
                    if j < len(s.spec_token_ids) and tok == s.spec_token_ids[j]:
                        s.request.output_token_ids.append(tok)  # shown while the next row is chosen
                        shown[s.request.request_id] += 1
                        still.append((s, start))
                active = still
                if not active:
                    break
        finally:
            for s, _ in spec:  # the scheduler appends the kept tokens for good
                del s.request.output_token_ids[len(s.request.output_token_ids) - shown[s.request.request_id]:]
        for s, _ in spec:
            rid = s.request.request_id
            (first, lp0), *rest = chosen[rid]
            out.sampled[rid] = first
            out.spec_sampled[rid] = [t for t, _ in rest]
            if lp0 is not None:
                out.logprobs[rid] = lp0
                out.spec_logprobs[rid] = [lp for _, lp in rest]

    def _sample(self, out: ModelOutput, logits: torch.Tensor, reqs: list[Request]) -> ModelOutput:
        """Each request's token (and logprobs) from its row of logits, into out."""
        tokens, logprobs = self.sampler(logits, reqs)
        for req, tok, lp in zip(reqs, tokens, logprobs):
            out.sampled[req.request_id] = tok
            if lp is not None:
                out.logprobs[req.request_id] = lp
        return out

    def _slot(self, req: Request, position: int) -> int:
        """The flat cache slot of a request's token at position."""
        bs = self.block_size
        return req.block_ids[position // bs] * bs + position % bs

    def _prepare(self, items: list[ScheduledRequest]):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        starts, seq_lens, query_start, request_lens = [], [], [0], []
        # A single-token query past the prompt (decode) takes the batched path; so does each token of a
        # decode with proposals, as a row of its own whose context ends at its position.
        decode_tables: list[list[int]] = []
        for s in items:
            req = s.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            starts.append(len(ids))
            ids.extend(req.token_ids(start, end - len(s.spec_token_ids)) + s.spec_token_ids)
            slots.extend(self._slot(req, p) for p in range(start, end))
            pos.extend(range(start, end))
            request_lens.extend([req.num_tokens] * (end - start))
            if _decode_like(s):
                seq_lens.extend(range(start + 1, end + 1))
                query_start.extend(range(query_start[-1] + 1, len(ids) + 1))
                decode_tables.extend([req.block_ids] * s.num_new_tokens)
            else:
                seq_lens.append(end)
                query_start.append(len(ids))
        num_decodes = len(decode_tables)
        dev = self.device
        decode_bt = decode_lens = None
        if num_decodes:
            width = max(map(len, decode_tables))
            decode_bt = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long, device=dev)
            decode_lens = torch.tensor(seq_lens[:num_decodes], dtype=torch.long, device=dev)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=query_start,
            seq_lens=seq_lens,
            num_decodes=num_decodes,
            decode_block_tables=decode_bt,
            decode_seq_lens=decode_lens,
            block_tables=[None] * num_decodes + [torch.tensor(s.request.block_ids, dtype=torch.long, device=dev)
                                                 for s in items if not _decode_like(s)],
            block_size=bs,
            request_lens=torch.tensor(request_lens, dtype=torch.long, device=dev),
            num_prompt_rows=sum(s.num_new_tokens for s in items if in_prompt(s)),
        )
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                meta, starts)

    def _prompt_logprobs(self, s: ScheduledRequest, hidden: torch.Tensor) -> list:
        """Logprobs of prompt tokens predicted by this chunk's positions (None for the very first token)."""
        req: Request = s.request
        start = req.num_computed_tokens
        out = [None] if start == 0 else []
        # Position p predicts token p + 1; only tokens inside the prompt count.
        n = min(s.num_new_tokens, req.num_prompt_tokens - 1 - start)
        if n <= 0:
            return out
        with quant.prompt_rows(n, 0):  # a prompt's rows, whatever their count (quant.py)
            logprobs = self.model.compute_logits(hidden[:n]).float().log_softmax(dim=-1)
        k = req.sampling_params.prompt_logprobs
        targets = req.prompt_token_ids[start + 1:start + 1 + n]
        out.extend(token_logprobs(logprobs[i], t, k) for i, t in enumerate(targets))
        return out
