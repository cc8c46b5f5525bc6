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

// y[m, n] = sum_k x[m, k] * w[n, k] for MB input rows against R weight rows at a time. More weight rows
// in flight keep more cache lines in transit, which a single core needs to approach memory bandwidth.
template <int MB, int R>
static void block(const uint16_t* x, int64_t rows, const uint16_t* w, int64_t K, int64_t n0, int64_t n1,
                  uint16_t* y, int64_t N) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m512 acc[MB][R];
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    const uint16_t* wr = w + n * K;
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh b[R];
      for (int r = 0; r < R; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(wr + r * K + k) + 1024, _MM_HINT_T0);
        b[r] = (__m512bh)_mm512_loadu_si512(wr + r * K + k);
      }
      for (int m = 0; m < MB; ++m) {
        if (m >= rows) break;
        __m512bh a = (__m512bh)_mm512_loadu_si512(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], a, b[r]);
      }
    }
    for (int m = 0; m < rows; ++m)
      for (int r = 0; r < R; ++r) y[m * N + n + r] = to_bf16(hsum(acc[m][r]));
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
  // Split the weight rows across threads; each thread streams its rows once per pass over the inputs.
  at::parallel_for(0, (N + 7) / 8, 8, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * 8, n1 = std::min(N, g1 * 8);
    if (M <= 2) {
      block<2, 8>(xp, M, wp, K, n0, n1, yp, N);
      return;
    }
    for (int64_t m0 = 0; m0 < M; m0 += 4)
      block<4, 4>(xp + m0 * K, std::min<int64_t>(4, M - m0), wp, K, n0, n1, yp + m0 * N, N);
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
            name="tokenmill_cpu_gemv_v2", cpp_sources=_SOURCE, functions=["gemv_bf16"],
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
