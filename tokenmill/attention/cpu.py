"""Attention on the CPU (and any device torch's SDPA runs on) over a paged KV cache."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tokenmill.attention import kv_format
from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.kernels import cpu as cpu_kernels


class TorchSDPABackend(AttentionBackend):
    """Decodes in one batched SDPA call over gathered blocks; each prompt chunk in its own causal call.

    The caches are tensors in the model's dtype or 8-bit kv_format.KVCache pairs. Attention always sees
    the values the cache holds: with an 8-bit cache, a prompt chunk attends over its own K/V as read back,
    so its numbers do not depend on how the prompt was split into chunks. (Read back into the model's
    dtype: a bfloat16 model rounds code * scale to bfloat16 here, where the CPU decode kernels keep it in
    float32.)"""

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale, sliding_window, softcap=None,
                sinks=None):
        # Write every new token first: requests in this batch may read blocks others write now.
        k = kv_format.write(k_cache, meta.slot_mapping, k)
        v = kv_format.write(v_cache, meta.slot_mapping, v)
        nd = meta.num_decodes
        if nd == 0 and meta.num_reqs == 1:  # one prompt chunk: its output as it comes, not copied
            return self._prefill(q, k, v, k_cache, v_cache, meta.block_tables[0], meta.seq_lens[0], meta.block_size,
                                 scale, sliding_window, softcap, sinks)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale, sliding_window, softcap, sinks)
        for r in range(nd, meta.num_reqs):
            s, e = meta.query_start_loc[r], meta.query_start_loc[r + 1]
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], k_cache, v_cache, meta.block_tables[r],
                                     meta.seq_lens[r], meta.block_size, scale, sliding_window, softcap, sinks)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta, scale, window, softcap=None, sinks=None):
        kernels = cpu_kernels.load() if q.device.type == "cpu" else None
        if kernels is not None and q.dtype in (torch.float32, torch.bfloat16) and cpu_kernels.head_dim_ok(q.shape[-1]):
            kd, vd, ks, vs = kv_format.kernel_args(k_cache, v_cache)
            return kernels.paged_decode_attention(q, kd, vd, meta.decode_block_tables, meta.decode_seq_lens,
                                                  meta.block_size, scale, window or 0, ks, vs, softcap=softcap or 0.0,
                                                  sinks=None if sinks is None else sinks.detach().float())
        # Portable path: gather each request's keys and values, then two batched matmuls.
        # Built once per step and reused by every layer; the mask once per distinct window.
        bt, bs = meta.decode_block_tables, meta.block_size
        if "decode_slots" not in meta.cache:
            slots = bt.unsqueeze(-1) * bs + torch.arange(bs, device=bt.device)
            meta.cache["decode_slots"] = slots.reshape(bt.shape[0], -1)
        slots = meta.cache["decode_slots"]
        mask_key = ("decode_masked", window)
        if mask_key not in meta.cache:
            pos = torch.arange(slots.shape[1], device=bt.device)
            lens = meta.decode_seq_lens.unsqueeze(1)
            masked = pos >= lens
            if window is not None:
                masked |= pos < lens - window
            meta.cache[mask_key] = masked[:, None, None, :]
        b, h, d = q.shape
        keys = kv_format.read(k_cache, slots, q.dtype)  # [B, L, KVH, D]
        values = kv_format.read(v_cache, slots, q.dtype)
        kvh = keys.shape[2]
        qg = q.view(b, kvh, h // kvh, d)  # query heads grouped by the KV head they share
        scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).float() * scale  # [B, KVH, G, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores.masked_fill_(meta.cache[mask_key], float("-inf"))
        if sinks is not None:
            scores = _with_sinks(scores, sinks.view(1, kvh, h // kvh, 1))
        probs = scores.softmax(dim=-1)
        probs = (probs if sinks is None else probs[..., :-1]).to(values.dtype)
        return torch.matmul(probs, values.transpose(1, 2)).reshape(b, h, d)

    @staticmethod
    def _prefill(q, k, v, k_cache, v_cache, block_table, seq_len, bs, scale, window, softcap=None, sinks=None):
        n = q.shape[0]
        kernels = cpu_kernels.load() if PROMPT_KERNEL and q.device.type == "cpu" else None
        if (kernels is not None and q.dtype == torch.bfloat16 and softcap is None and sinks is None
                and cpu_kernels.head_dim_ok(q.shape[-1])):
            # bfloat16 prompt rows: the kernel, over the chunk's own keys and values or the cache's (each
            # row computed alike either way, so a prompt's rows do not depend on what the cache held).
            if seq_len > n:
                k, v = _read_context(k_cache, v_cache, block_table, torch.arange(seq_len, device=q.device), bs, q.dtype)
            return kernels.prefill_attention(q, k, v, scale, window or 0)
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if seq_len == n and (window is None or n <= window) and softcap is None and sinks is None:
            # No earlier context: attend over this chunk's own K/V, causal. Zero rows added at the end change
            # nothing before them (causal), and their own outputs are dropped.
            pad = _padding(n, q.dtype)
            kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            if pad:
                qh, kh, vh = (F.pad(t, (0, 0, 0, pad)) for t in (qh, kh, vh))
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
            return o[:, :, :n].squeeze(0).transpose(0, 1)
        pos = torch.arange(seq_len, device=q.device)
        keys, values = (t.transpose(0, 1).unsqueeze(0)
                        for t in _read_context(k_cache, v_cache, block_table, pos, bs, q.dtype))
        qpos = torch.arange(seq_len - n, seq_len, device=q.device).unsqueeze(1)
        mask = pos.unsqueeze(0) <= qpos
        if window is not None:
            mask &= pos.unsqueeze(0) > qpos - window
        if softcap is not None or sinks is not None:
            o = _eager_attention(qh, keys, values, mask, scale, softcap, sinks)
        else:
            pad_q, pad_k = _padding(n, q.dtype), _padding(seq_len, q.dtype)
            if pad_q or pad_k:  # masked out: added keys for every query, everything for added queries but key 0
                qh, keys, values = F.pad(qh, (0, 0, 0, pad_q)), F.pad(keys, (0, 0, 0, pad_k)), F.pad(values, (0, 0, 0, pad_k))
                mask = F.pad(mask, (0, pad_k, 0, pad_q))
                mask[n:, 0] = True
            o = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)[:, :, :n]
        return o.squeeze(0).transpose(0, 1)


def _read_context(k_cache, v_cache, block_table, pos, bs: int, dtype: torch.dtype):
    """A request's keys and values at positions pos, read from the paged cache: [len(pos), KVH, D] each."""
    slots = block_table[pos // bs] * bs + pos % bs
    return kv_format.read(k_cache, slots, dtype), kv_format.read(v_cache, slots, dtype)


# bfloat16 prompt rows attend through the kernels' prefill_attention where they run
# (TOKENMILL_PROMPT_ATTENTION=torch keeps torch's scaled_dot_product_attention): first tokens 1.6-1.9x sooner
# on prompts of 736-2000 tokens, as accurate against float64, and a row's result the same bits whatever its
# chunk, so a prompt's greedy answer does not depend on how the scheduler split it (docs/benchmarks.md,
# "Prompt attention in bf16 pair products"); on CPUs with AMX, on its tiles, 1.4-1.8x torch's rate there
# ("Prompt attention and a chunk's element-wise operations on AMX").
PROMPT_KERNEL = os.environ.get("TOKENMILL_PROMPT_ATTENTION", "kernel") != "torch"

# Sequence lengths torch's bfloat16/half attention meets on the CPU: a multiple of this. Its flash attention
# compiles (and keeps) matrix kernels for each new tail of a length, 1 MiB a length on the first 200 lengths
# measured; float32 goes through MKL, which compiles nothing.
ATTENTION_LENGTH_STEP = 32


def _padding(n: int, dtype: torch.dtype) -> int:
    """Rows to add to a length of n for the attention above (0 for float32)."""
    return -n % ATTENTION_LENGTH_STEP if dtype in (torch.bfloat16, torch.float16) else 0


def _eager_attention(q, k, v, mask, scale: float, cap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention that SDPA cannot do: logits soft-capped, cap * tanh(logits / cap) (Gemma), or a sink logit
    per head in the softmax's denominator (gpt-oss). q [1, H, n, D]; k, v [1, KVH, L, D]; mask [n, L], True
    where a query attends. In the order of the references' eager attention: scaled logits and their cap in
    the model dtype, the softmax in float32."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = _with_sinks(scores, sinks.view(1, -1, 1, 1))
    probs = scores.softmax(dim=-1, dtype=torch.float32)
    return torch.matmul((probs if sinks is None else probs[..., :-1]).to(q.dtype), v)


def _with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """scores [..., L] with one more logit, each head's sink (sinks broadcast to scores[..., :1])."""
    return torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
