"""Paged attention in Triton: one kernel for every row of a mixed batch, reading the paged KV cache in place.

A step's rows are laid out request after request (decodes, speculative verify rows, prompt chunks alike).
Each program takes a tile of up to BLOCK_Q consecutive query tokens of one request, times the G query heads
that share one KV head (so a single decode token still fills a tile's rows with its G heads), and walks that
request's keys and values through its block table: no gather into a dense copy, no per-request launch, no
per-request Python. A query token at position p attends to keys at positions (p - window, p]; the keys
written this step are already in the cache, so a prompt chunk reads its cached prefix and itself alike.

Where a step has few tiles for the GPU's multiprocessors (small-batch decode over long contexts), each tile's
key range is split in `num_splits` parts computed by separate programs (flash-decoding), whose partial
softmax sums a second kernel combines.

Soft-capped logits (cap * tanh(logit / cap)), per-head sink logits (which join the softmax's denominator
and add no value) and 8-bit caches (codes times a scale per slot and KV head, kv_format.KVCache) are
handled in the same loop. Scores, the running maximum and sums are float32; the products take the model's
dtype (exact float32 products for float32 models, no TF32).

Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported) runs these kernels on CPU tensors,
which is how the tests check them where no GPU is present.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.attention import kv_format
from tokenmill.attention.backend import AttentionBackend, AttentionMetadata

BLOCK_N = 64  # keys per inner-loop tile
MAX_SPLITS = 16
TILE_ROWS = 64  # query rows (tokens x heads of a group) a prompt tile aims for


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, sinks_ptr, out_ptr, ws_acc_ptr, ws_ml_ptr,
        tables_ptr, seq_lens_ptr, q_start_ptr, prog_req_ptr, prog_tok_ptr,
        stride_qt, stride_qh, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, stride_s_slot,
        stride_ot, stride_oh, stride_table,
        scale, softcap, window, block_size, num_heads,
        G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(prog_req_ptr + pid)
    t0 = tl.load(prog_tok_ptr + pid)
    q_first = tl.load(q_start_ptr + req)
    n = tl.load(q_start_ptr + req + 1) - q_first
    ctx = tl.load(seq_lens_ptr + req)

    offs_m = tl.arange(0, BLOCK_M)
    tok = t0 + offs_m // G  # query token within the request
    head = kvh * G + offs_m % G
    row_ok = (offs_m < BLOCK_Q * G) & (tok < n)
    pos = ctx - n + tok  # the query's position in its sequence
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(q_ptr + (q_first + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    dot_q = q.to(tl.float32) if UPCAST else q

    # The tile's keys: up to its last query's position; with a window, from its first query's window on.
    t_last = tl.minimum(t0 + BLOCK_Q, n) - 1
    hi = ctx - n + t_last + 1
    lo = hi * 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - n + t0 - window + 1, 0)
    per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), NUM_SPLITS) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(hi, start + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j in range(start, end, BLOCK_N):
        offs_n = j + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        block = tl.load(tables_ptr + req * stride_table + offs_n // block_size, mask=n_ok, other=0)
        slot = block.to(tl.int64) * block_size + offs_n % block_size
        kt = tl.load(k_ptr + slot[None, :] * stride_k_slot + kvh * stride_k_head + offs_d[:, None],
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        if HAS_SCALES:  # codes, exact in any float type (through float32: the interpreter's direct casts are wrong)
            kt = kt.to(tl.float32)
        kt = kt.to(q.dtype)
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(dot_q, kt, input_precision=PRECISION)
        if HAS_SCALES:
            k_scale = tl.load(ks_ptr + slot * stride_s_slot + kvh, mask=n_ok, other=0.0).to(tl.float32)
            s = s * k_scale[None, :]
        s = s * scale
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        ok = n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            ok = ok & (offs_n[None, :] > pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_ptr + slot[:, None] * stride_v_slot + kvh * stride_v_head + offs_d[None, :],
                     mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if HAS_SCALES:
            v_scale = tl.load(vs_ptr + slot * stride_s_slot + kvh, mask=n_ok, other=0.0).to(tl.float32)
            p = p * v_scale[None, :]
        p = p.to(q.dtype)
        if HAS_SCALES:
            vt = vt.to(tl.float32)
        vt = vt.to(q.dtype)
        if UPCAST:
            p, vt = p.to(tl.float32), vt.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision=PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0)
            m_f = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - m_f)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp(sink - m_f)
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + (q_first + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Partial results per (token, head, split): the running maximum, the sum and the unnormalised output.
        row = ((q_first + tok) * num_heads + head) * NUM_SPLITS + split
        tl.store(ws_ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(ws_ml_ptr + row * 2 + 1, l_i, mask=row_ok)
        tl.store(ws_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _combine_splits_kernel(ws_acc_ptr, ws_ml_ptr, sinks_ptr, out_ptr, stride_ot, stride_oh, num_heads,
                           D: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < NUM_SPLITS
    row = (tok * num_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(ws_ml_ptr + row * 2, mask=s_ok, other=float("-inf"))
    l_part = tl.load(ws_ml_ptr + row * 2 + 1, mask=s_ok, other=0.0)
    m_all = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head)
        m_all = tl.maximum(m_all, sink)
    w = tl.exp(m - m_all)  # a split with no keys: m = -inf, weight 0
    total = tl.sum(l_part * w, 0)
    if HAS_SINKS:
        total += tl.exp(sink - m_all)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.load(ws_acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / total
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=offs_d < D)


def _pow2_at_least(n: int, low: int = 1) -> int:
    return max(low, triton.next_power_of_2(max(n, 1)))


class _Plan:
    """A step's request tables and the programs' tiles, built on the first layer and reused by the others."""

    __slots__ = ("tables", "seq_lens", "q_start", "prog_req", "prog_tok", "block_q", "max_context")

    def __init__(self, meta: AttentionMetadata, group: int, device: torch.device) -> None:
        r, nd = meta.num_reqs, meta.num_decodes
        long = dict(dtype=torch.long, device=device)
        if nd == r and meta.decode_block_tables is not None:
            # Decode only: the decode tensors as they are (a CUDA graph's buffers, read on every replay).
            self.tables, self.seq_lens = meta.decode_block_tables, meta.decode_seq_lens
            self.q_start = torch.arange(r + 1, **long)
            self.prog_req = torch.arange(r, **long)
            self.prog_tok = torch.zeros(r, **long)
            self.block_q = 1
        else:
            qsl = meta.query_start_loc
            counts = [qsl[i + 1] - qsl[i] for i in range(r)]
            widths = [len(t) for t in meta.block_tables[nd:]]
            width = max(widths + [meta.decode_block_tables.shape[1] if nd else 0])
            self.tables = torch.zeros(r, max(width, 1), **long)
            if nd:
                self.tables[:nd, :meta.decode_block_tables.shape[1]] = meta.decode_block_tables
            for i, t in enumerate(meta.block_tables[nd:], start=nd):
                self.tables[i, :len(t)] = t
            self.seq_lens = torch.tensor(meta.seq_lens, **long)
            self.q_start = torch.tensor(qsl, **long)
            self.block_q = min(_pow2_at_least(max(counts)), max(1, TILE_ROWS // group))
            req, tok = [], []
            for i, c in enumerate(counts):
                for t in range(0, c, self.block_q):
                    req.append(i)
                    tok.append(t)
            self.prog_req = torch.tensor(req, **long)
            self.prog_tok = torch.tensor(tok, **long)
        self.max_context = self.tables.shape[1] * meta.block_size


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: any figure that makes small decode steps split


def num_splits_for(programs: int, max_context: int, multiprocessors: int) -> int:
    """Key-range splits per tile: enough programs to fill the multiprocessors twice over, each split at
    least two key tiles long, at most MAX_SPLITS."""
    if programs >= multiprocessors:
        return 1
    return max(1, min(MAX_SPLITS, triton.cdiv(2 * multiprocessors, programs), max_context // (2 * BLOCK_N)))


def paged_attention(q: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None, softcap: float | None = None, sinks: torch.Tensor | None = None,
                    num_splits: int | None = None) -> torch.Tensor:
    """Attention of q [T, H, D] (rows as meta lays them out) over the paged caches ([slots, KVH, D] tensors
    or 8-bit kv_format.KVCache pairs), which already hold this step's keys and values. Returns [T, H, D]."""
    t, h, d = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    kd, vd, ks, vs = kv_format.kernel_args(k_cache, v_cache)
    kv_heads = kd.shape[1]
    group = h // kv_heads
    plan = meta.cache.get("triton_plan")
    if plan is None:
        plan = meta.cache["triton_plan"] = _Plan(meta, group, q.device)
    programs = plan.prog_req.shape[0]
    if num_splits is None:
        num_splits = num_splits_for(programs * kv_heads, plan.max_context, _multiprocessors(q.device))
    block_d = _pow2_at_least(d, 16)
    block_m = _pow2_at_least(plan.block_q * group, 16)
    out = torch.empty_like(q)
    if num_splits > 1:
        ws_acc = torch.empty(t * h * num_splits, block_d, dtype=torch.float32, device=q.device)
        ws_ml = torch.empty(t * h * num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        ws_acc = ws_ml = out  # not read
    sinks_f = sinks.detach().float().contiguous() if sinks is not None else out
    scales = ks is not None
    # Triton's interpreter multiplies bfloat16 tiles wrongly: there the rounded bfloat16 operands are
    # multiplied in float32, as a GPU's bfloat16 products are (exact products, float32 sums).
    upcast = q.device.type == "cpu" and q.dtype == torch.bfloat16
    _paged_attention_kernel[(programs, kv_heads, num_splits)](
        q, kd, vd, ks if scales else kd, vs if scales else vd, sinks_f, out, ws_acc, ws_ml,
        plan.tables, plan.seq_lens, plan.q_start, plan.prog_req, plan.prog_tok,
        q.stride(0), q.stride(1), kd.stride(0), kd.stride(1), vd.stride(0), vd.stride(1),
        ks.stride(0) if scales else 0,
        out.stride(0), out.stride(1), plan.tables.stride(0),
        float(scale), float(softcap or 1.0), int(sliding_window or 0), meta.block_size, h,
        G=group, D=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_Q=plan.block_q, BLOCK_N=BLOCK_N,
        NUM_SPLITS=num_splits, HAS_SCALES=scales, HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None,
        PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32", UPCAST=upcast)
    if num_splits > 1:
        _combine_splits_kernel[(t, h)](
            ws_acc, ws_ml, sinks_f, out, out.stride(0), out.stride(1), h, D=d, BLOCK_D=block_d,
            NUM_SPLITS=num_splits, BLOCK_S=_pow2_at_least(num_splits, 2), HAS_SINKS=sinks is not None)
    return out


class TritonPagedBackend(AttentionBackend):
    """Writes the step's keys and values into the paged cache, then one paged_attention call for all rows."""

    def __init__(self, num_splits: int | None = None) -> None:
        self.num_splits = num_splits  # None: chosen per step from the tiles and the multiprocessors

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale, sliding_window, softcap=None,
                sinks=None):
        kv_format.write(k_cache, meta.slot_mapping, k)
        kv_format.write(v_cache, meta.slot_mapping, v)
        return paged_attention(q, k_cache, v_cache, meta, scale, sliding_window, softcap, sinks, self.num_splits)
