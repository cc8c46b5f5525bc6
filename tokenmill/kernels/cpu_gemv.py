"""A bfloat16 matrix-vector kernel for CPUs with AVX-512 BF16, compiled on first use.

Decoding a token reads every weight once, so a decode step is bound by memory bandwidth; torch's bf16
GEMM reaches only about 40% of this machine's bandwidth when the batch has one or a few rows. This
kernel streams each weight row once for up to four input rows at a time, accumulating with the
`vdpbf16ps` instruction, and gets close to the memory limit. It is written here because no maintained
library ships such a kernel for torch on the CPU. Where it cannot be built (no compiler, no AVX-512
BF16) the engine keeps torch's own matmul.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("tokenmill")

MAX_ROWS = 8  # larger batches are compute-heavy enough for torch's GEMM

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>

static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

static inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return (uint16_t)(u >> 16);
}

// y[m, n] = sum_k x[m, k] * w[n, k] for up to 4 rows m, 4 weight rows per inner block.
static void block(const uint16_t* x, int64_t rows, const uint16_t* w, int64_t K, int64_t n0, int64_t n1,
                  uint16_t* y, int64_t N) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    __m512 acc[4][4];
    for (int m = 0; m < 4; ++m)
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
    const uint16_t* w0 = w + (n + 0) * K;
    const uint16_t* w1 = w + (n + 1) * K;
    const uint16_t* w2 = w + (n + 2) * K;
    const uint16_t* w3 = w + (n + 3) * K;
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + k);
      __m512bh b1 = (__m512bh)_mm512_loadu_si512(w1 + k);
      __m512bh b2 = (__m512bh)_mm512_loadu_si512(w2 + k);
      __m512bh b3 = (__m512bh)_mm512_loadu_si512(w3 + k);
      for (int m = 0; m < rows; ++m) {
        __m512bh a = (__m512bh)_mm512_loadu_si512(x + m * K + k);
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);
        acc[m][2] = _mm512_dpbf16_ps(acc[m][2], a, b2);
        acc[m][3] = _mm512_dpbf16_ps(acc[m][3], a, b3);
      }
    }
    for (int m = 0; m < rows; ++m)
      for (int r = 0; r < 4; ++r) y[m * N + n + r] = to_bf16(hsum(acc[m][r]));
  }
  for (; n < n1; ++n) {  // a last partial group of weight rows
    for (int m = 0; m < rows; ++m) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x + m * K + k),
                               (__m512bh)_mm512_loadu_si512(w + n * K + k));
      y[m * N + n] = to_bf16(hsum(acc));
    }
  }
}

torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && w.dtype() == torch::kBFloat16, "bf16 tensors expected");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shapes do not match");
  TORCH_CHECK(x.size(1) % 32 == 0, "K must be a multiple of 32");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  // Split the weight rows (in groups of 4) across threads; each thread streams its rows once per 4 inputs.
  at::parallel_for(0, (N + 3) / 4, 16, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * 4, n1 = std::min(N, g1 * 4);
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t rows = std::min<int64_t>(4, M - m0);
      block(xp + m0 * K, rows, wp, K, n0, n1, yp + m0 * N, N);
    }
  });
  return y;
}
"""

_module = None
_tried = False


def _cpu_supports() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_bf16" in f.read()
    except OSError:
        return False


def load() -> object | None:
    """The compiled kernel module, or None where it cannot be used (reason logged once)."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS"):
        return None
    if not _cpu_supports():
        logger.info("CPU lacks AVX-512 BF16: using torch's matmul for decode")
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        _module = load_inline(
            name="tokenmill_cpu_gemv", cpp_sources=_SOURCE, functions=["gemv_bf16"],
            extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp"],
            extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no headers: the torch path still works
        logger.warning("could not build the bf16 decode kernel (%s); using torch's matmul", str(e).splitlines()[0])
        _module = None
    return _module


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the kernel when the batch is small bf16 on the CPU."""
    if (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.dim() == 2 and x.device.type == "cpu"
            and x.shape[0] <= MAX_ROWS and x.shape[1] % 32 == 0 and _module is not None):
        y = _module.gemv_bf16(x, weight)
        return y + bias if bias is not None else y
    return torch.nn.functional.linear(x, weight, bias)
