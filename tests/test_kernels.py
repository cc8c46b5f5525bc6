"""The bf16 decode kernel against a float32 matmul reference."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import cpu as cpu_kernels

kernel = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernel is None, reason="needs AVX-512 BF16 and a C++ compiler")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n,k", [(960, 576), (49152, 576), (576, 1536), (7, 64), (4, 32)])
def test_gemv_matches_float32_reference(rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    ref = x.float() @ w.float().t()  # exact products of the same bf16 inputs, fp32 sums
    out = kernel.gemv_bf16(x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # Only the final rounding to bf16 (and summation order) may differ: 2^-8 relative.
    assert torch.allclose(out.float(), ref, rtol=2 ** -7, atol=1e-3 * k ** 0.5)


def test_linear_dispatch_and_bias():
    x = torch.randn(2, 64).bfloat16()
    w = torch.randn(16, 64).bfloat16()
    b = torch.randn(16).bfloat16()
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert torch.allclose(cpu_kernels.linear(x, w, b).float(), ref, rtol=2 ** -6, atol=0.05)
    # More rows than the kernel takes, or K not a multiple of 32: torch's GEMM, the same answer.
    big = torch.randn(kernel.max_gemv_rows + 1, 64).bfloat16()
    for xs, ws in ((big, w), (x[:, :48], w[:, :48])):
        assert torch.allclose(kernel.gemv_bf16(xs, ws).float(), xs.float() @ ws.float().t(), rtol=2 ** -6, atol=0.05)
    assert torch.allclose(cpu_kernels.linear(big, w).float(), big.float() @ w.float().t(), rtol=2 ** -6, atol=0.05)


def _paged_case(dtype, window):
    g = torch.Generator().manual_seed(7)
    b, h, kvh, d, bs, blocks = 5, 9, 3, 64, 4, 48
    k_cache = torch.randn(blocks * bs, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks * bs, kvh, d, generator=g).to(dtype)
    q = torch.randn(b, h, d, generator=g).to(dtype)
    lens = torch.tensor([1, 7, 16, 29, 33])
    perm = torch.randperm(blocks, generator=g)
    width = 9
    bt = perm[: b * width].reshape(b, width)  # scattered, non-contiguous blocks
    return q, k_cache, v_cache, bt, lens, bs, window


def _random_requests(lens, h, kvh, d, bs, dtype, seed):
    """Random queries and caches for requests of the given context lengths, their blocks scattered."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // bs) for n in lens)
    blocks = len(lens) * width
    k_cache = torch.randn(blocks * bs, kvh, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks * bs, kvh, d, generator=g).to(dtype)
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    bt = torch.randperm(blocks, generator=g).reshape(len(lens), width)
    return q, k_cache, v_cache, bt, torch.tensor(lens)


def _dense_reference(q, k_cache, v_cache, bt, lens, bs, window, scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        n = int(lens[i])
        pos = torch.arange(n)
        slots = bt[i][pos // bs] * bs + pos % bs
        keys, values = k_cache[slots].double(), v_cache[slots].double()  # [n, KVH, D]
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), keys) * scale
        if window:
            scores[:, : max(0, n - window)] = float("-inf")
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("batch", [1, 5])  # one short request splits its KV heads across cores; five do not
def test_paged_decode_attention_kernel_and_fallback(dtype, window, batch, monkeypatch):
    from tokenmill.attention.backend import AttentionMetadata
    from tokenmill.attention.cpu import TorchSDPABackend

    q, kc, vc, bt, lens, bs, window = _paged_case(dtype, window)
    q, bt, lens = q[-batch:], bt[-batch:], lens[-batch:]
    scale = 64 ** -0.5
    ref = _dense_reference(q, kc, vc, bt, lens, bs, window, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    out = kernel.paged_decode_attention(q, kc, vc, bt, lens, bs, scale, window or 0)
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol)
    # The portable path (used where the kernels cannot be built) agrees too.
    meta = AttentionMetadata(slot_mapping=torch.tensor([], dtype=torch.long), query_start_loc=[], seq_lens=[],
                             num_decodes=q.shape[0], decode_block_tables=bt, decode_seq_lens=lens,
                             block_tables=[], block_size=bs)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    fallback = TorchSDPABackend._decode(q, kc, vc, meta, scale, window)
    assert torch.allclose(fallback.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("lens", [[300], [1, 300], [5, 400], [200, 65, 130]])
@pytest.mark.parametrize("kvh", [1, 2])
def test_paged_decode_attention_splits_long_contexts(dtype, window, lens, kvh):
    """Few requests with long contexts: each request's tokens are split into ranges, all KV heads in each
    (some ranges empty, for the one-token request), that threads compute apart and the kernel merges."""
    d, bs = 64, 16
    q, k_cache, v_cache, bt, lens_t = _random_requests(lens, 6, kvh, d, bs, dtype, seed=len(lens))
    scale = d ** -0.5
    ref = _dense_reference(q, k_cache, v_cache, bt, lens_t, bs, window, scale)
    out = kernel.paged_decode_attention(q, k_cache, v_cache, bt, lens_t, bs, scale, window or 0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 48, 80, 128])  # odd multiples of 16 leave half of the last bf16 pair empty
@pytest.mark.parametrize("h,kvh", [(7, 1), (8, 2), (4, 4)])  # query heads per KV head above, at and below a group
def test_paged_decode_attention_head_shapes(dtype, d, h, kvh):
    bs = 16
    q, k_cache, v_cache, bt, lens_t = _random_requests([37, 3, 70], h, kvh, d, bs, dtype, seed=d + h)
    scale = d ** -0.5
    ref = _dense_reference(q, k_cache, v_cache, bt, lens_t, bs, None, scale)
    for rows in ([0], [0, 1, 2]):  # one request (heads split across threads) and three
        out = kernel.paged_decode_attention(q[rows], k_cache, v_cache, bt[rows], lens_t[rows], bs, scale, 0)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(out.double(), ref[rows], atol=tol, rtol=tol)


def test_argmax_matches_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 49157, generator=g)  # a length that leaves a tail after the 16-wide steps
    x[1, 40000] = x[1, 7] = x[1].max() + 1  # ties: the first wins
    x[2] = float("-inf")
    x[3, 49156] = 1e9  # the largest in the tail
    x[4, 12345] = float("nan")  # NaN wins, as in torch
    x[5] = torch.round(x[5])  # many ties
    assert torch.equal(kernel.argmax_rows(x), x.argmax(dim=-1))
    xb = x.bfloat16()  # rounding makes more ties
    assert torch.equal(kernel.argmax_rows(xb), xb.float().argmax(dim=-1))
    for n in (1, 15, 16, 17):
        y = torch.randn(3, n, generator=g)
        assert torch.equal(kernel.argmax_rows(y), y.argmax(dim=-1))
