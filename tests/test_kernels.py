"""The bf16 decode kernel against a float32 matmul reference."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import cpu_gemv

kernel = cpu_gemv.load()
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
    assert torch.allclose(cpu_gemv.linear(x, w, b).float(), ref, rtol=2 ** -6, atol=0.05)
    big = torch.randn(cpu_gemv.MAX_ROWS + 1, 64).bfloat16()  # falls back to torch, same answer
    assert torch.allclose(cpu_gemv.linear(big, w).float(), big.float() @ w.float().t(), rtol=2 ** -6, atol=0.05)
