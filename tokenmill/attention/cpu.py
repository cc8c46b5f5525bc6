"""Attention on the CPU (and any device torch's SDPA runs on) over a paged KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata


class TorchSDPABackend(AttentionBackend):
    """Decodes in one batched SDPA call over gathered blocks; each prompt chunk in its own causal call."""

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale, sliding_window):
        # Write every new token first: requests in this batch may read blocks others write now.
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale, sliding_window)
        for r in range(nd, meta.num_reqs):
            s, e = meta.query_start_loc[r], meta.query_start_loc[r + 1]
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], k_cache, v_cache, meta.block_tables[r],
                                     meta.seq_lens[r], meta.block_size, scale, sliding_window)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta, scale, window):
        keys = k_cache[meta.decode_slots].transpose(1, 2)  # [B, KVH, L, D]
        values = v_cache[meta.decode_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask,
                                           scale=scale, enable_gqa=True)
        return o.squeeze(2)

    @staticmethod
    def _prefill(q, k, v, k_cache, v_cache, block_table, seq_len, bs, scale, window):
        n = q.shape[0]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if seq_len == n and (window is None or n <= window):
            # No earlier context: attend over this chunk's own K/V, causal.
            o = F.scaled_dot_product_attention(qh, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                               is_causal=True, scale=scale, enable_gqa=True)
            return o.squeeze(0).transpose(0, 1)
        pos = torch.arange(seq_len, device=q.device)
        slots = block_table[pos // bs] * bs + pos % bs
        keys = k_cache[slots].transpose(0, 1).unsqueeze(0)
        values = v_cache[slots].transpose(0, 1).unsqueeze(0)
        qpos = torch.arange(seq_len - n, seq_len, device=q.device).unsqueeze(1)
        mask = pos.unsqueeze(0) <= qpos
        if window is not None:
            mask &= pos.unsqueeze(0) > qpos - window
        o = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)
