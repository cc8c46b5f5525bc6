"""CPU kernels for the decode step, compiled on first use (torch caches the build per machine).

- gemv_bf16: decoding a token reads every weight once, so a decode step is bound by memory bandwidth;
  torch's bf16 GEMM reaches well under half of this machine's bandwidth when the batch has one or a few
  rows. This kernel streams each weight row once per pass over up to a few input rows, accumulating
  with the `vdpbf16ps` instruction.
- paged_decode_attention: single-query attention read straight from the paged KV cache through each
  request's block table, so the keys and values are read once and never gathered into a copy.

They are written here because no maintained library ships such kernels for torch on the CPU. Where
they cannot be built (no compiler, no AVX-512 BF16) the engine keeps its torch code paths.
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
#include <cmath>
#include <cstring>
#include <vector>

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

// Load 16 values as float32.
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x) for x <= 0 in float32: 2^(x log2 e) split into 2^n (scalef) and 2^f, f in [0, 1), by its
// Taylor series to degree 7 (relative error below 2e-7 on that range); inputs below -87 give 0.
static inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// out[b, h, :] = softmax(q[b, h] . K[t] * scale) V over the request's tokens t, read through its block table.
// A task covers KV heads [kh0, kh1) of one request; walking tokens in order and, per token, those heads
// in order reads each key and value record front to back. With few requests the heads are split into
// separate tasks so that every core has work.
template <typename T>
static void attend(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* lens, T* out,
                   int64_t b, int64_t kh0, int64_t kh1, int64_t H, int64_t KVH, int64_t D, int64_t nb, int64_t bs,
                   float scale, int64_t window, std::vector<float>& scores, std::vector<__m512>& qv,
                   std::vector<__m512>& acc) {
  const int64_t G = H / KVH, DV = D / 16, NH = (kh1 - kh0) * G, len = lens[b];
  const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0, n = len - start;
  scores.resize(NH * n);
  qv.resize(NH * DV);
  acc.assign(NH * DV, _mm512_setzero_ps());
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t h = 0; h < NH; ++h)
    for (int64_t j = 0; j < DV; ++j) qv[h * DV + j] = _mm512_mul_ps(load16(q + (b * H + kh0 * G + h) * D + j * 16), sc);
  // Token t of request b lives in cache slot block_table[t / bs] * bs + t % bs; load one head's row of it.
  auto load_head = [&](const T* cache, int64_t t, int64_t kh, __m512* row) {
    const T* p = cache + ((bt[b * nb + t / bs] * bs + t % bs) * KVH + kh) * D;
    for (int64_t j = 0; j < DV; ++j) row[j] = load16(p + j * 16);
  };
  for (int64_t t = start; t < len; ++t) {
    for (int64_t kh = kh0; kh < kh1; ++kh) {
      __m512 kv[8];
      load_head(kc, t, kh, kv);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = (kh - kh0) * G + g;
        __m512 s = _mm512_mul_ps(qv[h * DV], kv[0]);
        for (int64_t j = 1; j < DV; ++j) s = _mm512_fmadd_ps(qv[h * DV + j], kv[j], s);
        scores[h * n + (t - start)] = _mm512_reduce_add_ps(s);
      }
    }
  }
  for (int64_t h = 0; h < NH; ++h) {  // softmax in float32
    float* row = scores.data() + h * n;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, row[j]);
    const __m512 vmx = _mm512_set1_ps(mx);
    __m512 vsum = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(row + j), vmx));
      _mm512_storeu_ps(row + j, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    float sum = _mm512_reduce_add_ps(vsum);
    for (; j < n; ++j) { row[j] = std::exp(row[j] - mx); sum += row[j]; }
    const float inv = 1.f / sum;
    for (j = 0; j < n; ++j) row[j] *= inv;
  }
  for (int64_t t = start; t < len; ++t) {
    for (int64_t kh = kh0; kh < kh1; ++kh) {
      __m512 vv[8];
      load_head(vc, t, kh, vv);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = (kh - kh0) * G + g;
        const __m512 p = _mm512_set1_ps(scores[h * n + (t - start)]);
        for (int64_t j = 0; j < DV; ++j) acc[h * DV + j] = _mm512_fmadd_ps(p, vv[j], acc[h * DV + j]);
      }
    }
  }
  float tmp[16];
  for (int64_t h = 0; h < NH; ++h)
    for (int64_t j = 0; j < DV; ++j) {
      _mm512_storeu_ps(tmp, acc[h * DV + j]);
      T* o = out + (b * H + kh0 * G + h) * D + j * 16;
      for (int d = 0; d < 16; ++d) o[d] = static_cast<T>(tmp[d]);
    }
}

template <typename T>
static void decode_attention_impl(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* lens,
                                  T* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t nb, int64_t bs,
                                  float scale, int64_t window) {
  const bool per_head = B < 2 * at::get_num_threads();
  const int64_t tasks = per_head ? B * KVH : B;
  at::parallel_for(0, tasks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    std::vector<__m512> qv, acc;
    for (int64_t i = i0; i < i1; ++i) {
      if (per_head)
        attend<T>(q, kc, vc, bt, lens, out, i / KVH, i % KVH, i % KVH + 1, H, KVH, D, nb, bs, scale, window,
                  scores, qv, acc);
      else
        attend<T>(q, kc, vc, bt, lens, out, i, 0, KVH, H, KVH, D, nb, bs, scale, window, scores, qv, acc);
    }
  });
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, int64_t block_size,
                                     double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the cache must share a dtype");
  q = q.contiguous();
  auto bt = block_tables.to(torch::kLong).contiguous();
  auto lens = seq_lens.to(torch::kLong).contiguous();
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1), nb = bt.size(1);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(2) == D, "head counts do not match");
  TORCH_CHECK(D % 16 == 0 && D <= 128, "head_dim must be a multiple of 16, at most 128");
  if (q.scalar_type() == torch::kFloat) {
    decode_attention_impl<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                                 bt.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                                 B, H, KVH, D, nb, block_size, (float)scale, window);
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kBFloat16, "float32 or bfloat16 expected");
    decode_attention_impl<c10::BFloat16>(
        q.data_ptr<c10::BFloat16>(), k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(),
        bt.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<c10::BFloat16>(),
        B, H, KVH, D, nb, block_size, (float)scale, window);
  }
  return out;
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
        logger.info("CPU lacks AVX-512 BF16: decode uses torch's own kernels")
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        _module = load_inline(
            name="tokenmill_cpu_kernels_v5", cpp_sources=_SOURCE, functions=["gemv_bf16", "paged_decode_attention"],
            extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-fopenmp"],
            extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no headers: the torch path still works
        logger.warning("could not build the CPU decode kernels (%s); using torch's own", str(e).splitlines()[0])
        _module = None
    return _module


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the kernel when the batch is small bf16 on the CPU."""
    if (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.dim() == 2 and x.device.type == "cpu"
            and x.shape[0] <= MAX_ROWS and x.shape[1] % 32 == 0 and _module is not None):
        y = _module.gemv_bf16(x, weight)
        return y + bias if bias is not None else y
    return torch.nn.functional.linear(x, weight, bias)
