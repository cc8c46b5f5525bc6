"""A draft model's proposals: a smaller model (or the target's own weights, quantized) decodes a few
tokens greedily ahead of each request, on its own KV cache, batched across requests."""

from __future__ import annotations

import logging

from tokenmill.attention.backend import new_backend
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import ScheduledRequest, SchedulerOutput
from tokenmill.model.loader import load_model
from tokenmill.runner import ModelRunner, kv_bytes_per_block
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")


class DraftModelProposer:
    """Each target request has a shadow request in the draft's KV cache holding the tokens the draft has
    computed. A proposal first brings the shadow level with the request (its new tokens; tokens the
    draft computed for proposals that were rejected are recomputed), which gives the first proposed
    token, then decodes the rest, for all requests together. Where the draft has a fused decoder and every
    shadow owes one token (the target's latest), the rest of the proposal is one call of it, decode steps
    back to back; otherwise (a prompt to catch up, no fused decoder) it goes one engine step at a time.
    The last proposal's keys and values are left to the next catch-up: where every proposal was accepted
    it owes that proposal and the target's next token, two decode rows of one step (see _step), so a
    proposal of k tokens costs the draft k passes over its weights, not k + 1. Proposals are the draft's
    greedy choices: each is certain (q one-hot), which is what the target's verification assumes."""

    def __init__(self, cfg, engine) -> None:
        self.engine = engine
        if cfg.method == "self":
            name, quantization = engine.config.model, cfg.quantization
        else:
            name, quantization = cfg.model, "auto"
        try:
            loaded = load_model(name, engine.dtype, engine.device, new_backend(engine.device),
                                max_positions=engine.max_model_len, quantization=quantization)
        except ValueError as e:
            raise ValueError(f"the speculative draft ({cfg.method}) could not be loaded: {e}") from e
        self.model = loaded.model
        check_same_vocabulary(engine.tokenizer, loaded.tokenizer)
        self.vocab_size = min(engine.vocab_size, self.model.config.vocab_size)
        bs = engine.config.block_size
        self.greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        self.shadows: dict[str, Request] = {}
        # Drafting for itself, the target's own keys and values serve the draft (see _propose_in_place), where
        # its cache has the draft's layout (not a tensor-parallel shard's, nor 8-bit) and bursts run.
        target = engine.runner
        cfg_d = self.model.config
        self.in_place = (cfg.method == "self" and engine.config.kv_cache_dtype == "auto" and target.supports_bursts
                         and len(target.kv_caches) == cfg_d.num_layers
                         and all(tuple(t.shape[1:]) == (cfg_d.num_kv_heads, cfg_d.head_dim)
                                 for kv in target.kv_caches for t in kv))
        num_blocks = 1 if self.in_place else engine.num_blocks  # else as many tokens as the target's cache holds
        self.runner = ModelRunner(self.model, num_blocks, bs, engine.device, engine.dtype, engine.config.seed,
                                  max_model_len=engine.max_model_len, kv_cache_dtype=engine.config.kv_cache_dtype)
        if self.in_place:
            self.runner.kv_caches, self.runner.scratch_slot = target.kv_caches, target.scratch_slot
            self.runner.max_blocks = target.max_blocks
            logger.info("speculative draft: %s, on the target's own KV cache", type(self.model).__name__)
            return
        self.kv = KVCacheManager(num_blocks, bs, enable_caching=False)  # shadows hold unverified tokens
        logger.info("speculative draft: %s (%.1f MiB of KV cache)", type(self.model).__name__,
                    num_blocks * kv_bytes_per_block(self.model, bs, engine.dtype, engine.config.kv_cache_dtype) / 2**20)

    def propose(self, wanted: list) -> list[list[int]]:
        if self.in_place:
            return self._propose_in_place(wanted)
        self._forget_finished()
        shadows, ks = [], []
        for req, k in wanted:
            shadow = self._sync(req)
            if self.kv.allocate_slots(shadow, shadow.num_tokens - shadow.num_computed_tokens + k - 1):
                shadows.append(shadow)
                ks.append(k)
        drafts: dict[str, list[int]] = {s.request_id: [] for s in shadows}
        active = list(zip(shadows, ks))
        while active:
            if all(s.num_tokens - s.num_computed_tokens == 1 for s, _ in active) and self._burst(active, drafts):
                break
            active = self._step(active, drafts)
        result = []
        for req, _ in wanted:
            shadow = self.shadows.get(req.request_id)
            result.append(drafts.get(shadow.request_id, []) if shadow is not None else [])
        return result

    def _propose_in_place(self, wanted: list) -> list[list[int]]:
        """The target's own weights, quantized, drafting for it: the two compute the same keys and values
        up to rounding, so the draft reads the target's cache as it is (its prompt and every accepted token,
        computed by the target) and writes its proposals' keys and values into the target's next slots,
        which the verify step then overwrites with the target's own. So the draft never computes a prompt
        or catches up: a proposal of k tokens is k passes of the draft's fused decoder, one burst for all
        requests, and the draft holds no cache of its own. Each request's blocks are extended first to hold
        the burst's slots (the verify step needs them anyway; those past what it keeps go back after it)."""
        if not wanted:
            return []
        steps = max(k for _, k in wanted)
        kv = self.engine.kv_manager
        shadows = {}
        for req, _ in wanted:
            if kv.allocate_slots(req, steps, register=False):  # the verify step registers its blocks
                # The request as the draft sees it: its tokens and blocks, chosen greedily.
                shadows[req.request_id] = Request(req.request_id, req.prompt_token_ids, self.greedy, req.max_tokens,
                                                  output_token_ids=list(req.output_token_ids),
                                                  num_computed_tokens=req.num_computed_tokens, block_ids=req.block_ids)
        outs = None
        if shadows:
            sched = SchedulerOutput(scheduled=[ScheduledRequest(s, 1, True) for s in shadows.values()])
            outs = self.runner.execute_burst(sched, steps, lambda: False)
            if outs is None:  # no fused decoder for this batch: the same steps one engine step at a time
                outs = []
                for _ in range(steps):
                    out = self.runner.execute(sched)
                    for s in shadows.values():
                        s.num_computed_tokens += 1
                        s.output_token_ids.append(out.sampled[s.request_id])
                    outs.append(out)
        result = []
        for req, k in wanted:
            drafts = []
            for out in (outs or [])[:k] if req.request_id in shadows else ():
                token = out.sampled[req.request_id]
                if token >= self.vocab_size:  # a token the target's vocabulary lacks ends the proposal
                    break
                drafts.append(token)
            result.append(drafts)
        return result

    def _step(self, active: list, drafts: dict[str, list[int]]) -> list:
        """One step of the draft for every shadow: its tokens not yet computed (a catch-up, or the latest
        proposal), whose last one's logits give its next proposal. Returns the shadows that want more.

        A shadow past its prompt that owes two tokens (its last proposal, all accepted, and the target's
        next token) runs them as decode rows, the second as a proposal of the draft's own to verify: the
        fused decoder's path, not a prompt chunk's. Its logits after the second are kept only where the
        draft's choice after the first was that token (nearly always, for a draft the target agrees
        with); otherwise the second is computed again as a one-row step."""
        items = []
        for s, _ in active:
            owed = s.num_tokens - s.num_computed_tokens
            two_rows = owed == 2 and s.num_computed_tokens >= s.num_prompt_tokens
            items.append(ScheduledRequest(s, owed, True, [s.output_token_ids[-1]] if two_rows else []))
        out = self.runner.execute(SchedulerOutput(scheduled=items))
        still = []
        for item, (s, k) in zip(items, active):
            s.num_computed_tokens = s.num_tokens
            if item.spec_token_ids:
                after = out.spec_sampled.get(s.request_id)
                if not after:  # its logits were not kept: the target's token again, alone
                    s.num_computed_tokens -= 1
                    still.append((s, k))
                    continue
                token = after[0]
            else:
                token = out.sampled[s.request_id]
            if token >= self.vocab_size:  # a token the target's vocabulary lacks ends the proposal
                continue
            drafts[s.request_id].append(token)
            s.output_token_ids.append(token)  # the draft computes it in the next step
            if len(drafts[s.request_id]) < k:
                still.append((s, k))
        return still

    def _burst(self, active: list, drafts: dict[str, list[int]]) -> bool:
        """The rest of every shadow's proposals at once, each shadow owing one token, in one call of the
        draft's fused decoder (decode steps back to back, each step's greedy token the next step's input): a
        proposal costs no pass through the engine's Python. The last proposal's keys and values are not
        computed here (the next catch-up computes them). False (nothing done) where the draft has no fused
        decoder, or too few free blocks for the steps."""
        steps = max(k - len(drafts[s.request_id]) for s, k in active)
        if not self.runner.supports_bursts or not all(self.kv.allocate_slots(s, steps) for s, _ in active):
            return False
        sched = SchedulerOutput(scheduled=[ScheduledRequest(s, 1, True) for s, _ in active])
        outs = self.runner.execute_burst(sched, steps, lambda: False)
        if outs is None:
            return False
        for s, k in active:
            mine = drafts[s.request_id]
            before = s.num_tokens  # the owed token's step is the burst's first
            for out in outs[:k - len(mine)]:
                token = out.sampled[s.request_id]
                if token >= self.vocab_size:  # a token the target's vocabulary lacks ends the proposal
                    break
                mine.append(token)
                s.output_token_ids.append(token)
            # Step i computed the keys and values of the token before its output: all kept tokens but a
            # last one that the final step produced.
            s.num_computed_tokens = min(before - 1 + len(outs), s.num_tokens)
        return True

    def _sync(self, req: Request) -> Request:
        """The request's shadow, its tokens set to the request's; computed tokens past their common prefix
        (proposals that were rejected) are forgotten and their blocks freed."""
        shadow = self.shadows.get(req.request_id)
        if shadow is None:
            shadow = Request(req.request_id, req.prompt_token_ids, self.greedy, max_tokens=req.max_tokens)
            self.shadows[req.request_id] = shadow
        target = req.output_token_ids
        same = 0
        limit = min(len(shadow.output_token_ids), len(target))
        while same < limit and shadow.output_token_ids[same] == target[same]:
            same += 1
        shadow.output_token_ids = list(target)
        computed = min(shadow.num_computed_tokens, shadow.num_prompt_tokens + same, shadow.num_tokens - 1)
        shadow.num_computed_tokens = computed
        self.kv.trim(shadow, computed)
        return shadow

    def _forget_finished(self) -> None:
        """Free the shadows of requests that finished or went back to the queue (preempted)."""
        running = {r.request_id for r in self.engine.scheduler.running}
        for rid in [rid for rid in self.shadows if rid not in running]:
            self.kv.free(self.shadows.pop(rid))


def check_same_vocabulary(target_tokenizer, draft_tokenizer) -> None:
    """The draft's token ids must mean what the target's mean."""
    a, b = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if a != b:
        only = len(set(a.items()) ^ set(b.items()))
        raise ValueError(f"the speculative draft's tokenizer differs from the target's ({len(b)} tokens against "
                         f"{len(a)}, {only} entries not shared): a draft must share the target's vocabulary")
