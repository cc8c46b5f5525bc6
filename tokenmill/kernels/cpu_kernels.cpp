// CPU kernels for the decode step (AVX-512), built on first use by tokenmill/kernels/cpu.py.
//
// - gemv_bf16: y = x W^T for a few rows of x. Decoding reads every weight once per step, so the step is
//   bound by memory bandwidth; each thread streams its share of W once per pass over the rows.
// - paged_decode_attention: single-query attention read straight from the paged KV cache through each
//   request's block table (no gather into a copy). The cache holds values in the activations' type, or
//   8-bit codes (int8, fp8 e4m3) with a scale per token and KV head, read in place.
// - FusedDecoderF32 / FusedDecoderBF16: a whole decode step of a decoder as model/description.py
//   describes it (norms, projections, rotary of all or the leading dims of each head, cache write,
//   attention, SwiGLU or GeGLU, residuals; Gemma's
//   extra norms, per-layer rope tables and softcaps) in one call, so that the hundreds of small per-layer
//   tensor operations cost no Python dispatch. Activations, residual stream and KV cache
//   are in the model's dtype (bf16 values rounded where the eager model rounds them); each weight matrix
//   is dense in that dtype or in a GGUF block format (quant.h), part by part.
//
// Every entry point releases the GIL: the server's event loop keeps running while a step computes.

#include <torch/extension.h>
#include <c10/util/Float8_e4m3fn.h>
#include <ATen/Parallel.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <limits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <atomic>
#include <functional>
#include <optional>
#include <string>
#include <chrono>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "quant_product.h"  // and simd.h: the AVX-512 intrinsics, native or through SIMDe
#include "shm_group.h"

#ifndef __AVX512BF16__
// CPUs with AVX-512 but without its BF16 extension (Skylake-SP to Ice Lake, Zen 3): the two BF16
// instructions the kernels use, done with AVX-512F. Same results (a product of two bf16 values is exact in
// float32, so two fused multiply-adds round as the instruction does), a few times slower; such CPUs run
// models in float32 by default, where neither is used.
static inline __m256bh emulated_cvtneps_pbh(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));  // to nearest even
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));  // NaN stays NaN (quiet)
  return (__m256bh)_mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
static inline __m512 emulated_dpbf16_ps(__m512 acc, __m512bh a, __m512bh b) {
  const __m512i ai = (__m512i)a, bi = (__m512i)b, high = _mm512_set1_epi32((int)0xffff0000u);
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(ai, high)),
                        _mm512_castsi512_ps(_mm512_and_si512(bi, high)), acc);  // the odd elements, then the even
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(ai, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(bi, 16)),
                         acc);
}
#define _mm512_cvtneps_pbh emulated_cvtneps_pbh
#define _mm512_dpbf16_ps emulated_dpbf16_ps
#endif

namespace {

using bf16 = c10::BFloat16;

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return (uint16_t)(u >> 16);
}

inline float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}


inline const uint16_t* bits(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
inline uint16_t* bits_mut(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// 16 bf16 values as float32, and back with round-to-nearest-even (vcvtneps2bf16).
inline __m512 load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline void store_bf16(uint16_t* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v)); }
inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// ---------------------------------------------------------------------------------------------- GEMV

// A thread's weight rows are adjacent in memory, so what it reads is one contiguous stream; asking for
// that stream ahead of the reads keeps enough cache lines in flight for one core to approach the memory
// bandwidth, which the hardware prefetcher alone does not on short (576-element) rows. The distances
// were chosen by sweeping them on the model's shapes, at both of the speeds this machine's memory shows.
constexpr int64_t kPrefetchL2Bytes = 16384;  // several input rows: far into L2, and near into L1
constexpr int64_t kPrefetchL1Bytes = 2048;
constexpr int64_t kPrefetchRowBytes = 4096;  // one input row: into L1
// One input row against a large output layer of short block-format rows (Gemma 3's 640-wide Q8_0 one: 680
// bytes a row, 178 MB): its rows are also asked for kPrefetchL2Bytes ahead into L2, a line in every
// kHeadStride bytes (the L2's own prefetchers fill in the rest). With such short rows a thread spends much
// of each row on its fixed costs (the row's sum, its result) and keeps too few lines in flight from the L1
// walk alone. Gemma 3 270M's greedy decode: 0.87-0.89x the time (benchmarks/kernel_ab.py). Elsewhere it did
// not pay: rows of 2048 values come near the memory's speed without it; an output layer the caches keep
// much of between steps (the default model's, 30 MB) lost 2-4% to the extra instructions, its whole
// step 3%; walking the layers' short rows likewise made the default model's step slower still.
constexpr int64_t kHeadRowBytes = 1024, kHeadStride = 256, kHeadMinBytes = int64_t(64) << 20;

// A span of weight bytes one thread reads front to back.
struct Segment {
  const char* begin;
  const char* end;
};

// Walks the weight bytes a thread will read (one or more segments, in the order it reads them) a fixed
// distance ahead of its reads, asking for one cache line per call. Over several segments, the slices
// of consecutive matrices in a decode step, the stream runs on across the end of one matrix and the
// start of the next instead of starting cold at each.
template <int Locality, int Stride = 64>  // __builtin_prefetch's: 3 into L1 (T0), 2 into L2 (T1); a line per Stride bytes
class Lookahead {
 public:
  Lookahead() = default;
  // wrap: past the last segment, the walk goes on from the first.
  Lookahead(const Segment* segs, int64_t count, bool wrap = false) : segs_(segs), count_(count), wrap_(wrap) {
    if (count > 0) p_ = segs[0].begin, end_ = segs[0].end;
  }
  // Moves `bytes` ahead of the reads, prefetching those bytes or leaving them to the hardware.
  void advance(int64_t bytes, bool fetch) {
    for (int64_t i = 0; i < bytes; i += Stride) {
      if (fetch)
        line();
      else
        step();
    }
  }
  inline void line() {
    if (step_to_next()) __builtin_prefetch(p_, 0, Locality), p_ += Stride;
  }
  // As many lines as `bytes` of the stream hold (what is left over counts towards the next call): for
  // reads that do not come in whole lines, the rows of a block-quantized matrix.
  inline void bytes(int64_t n) {
    for (owed_ += n; owed_ >= Stride; owed_ -= Stride) line();
  }

 private:
  inline void step() {
    if (step_to_next()) p_ += Stride;
  }
  inline bool step_to_next() {
    if (p_ < end_) return true;
    if (i_ + 1 >= count_) {
      if (!wrap_ || count_ == 0) return false;
      i_ = -1;
    }
    ++i_;
    p_ = segs_[i_].begin;
    end_ = segs_[i_].end;
    return p_ < end_;
  }
  const Segment* segs_ = nullptr;
  int64_t count_ = 0, i_ = 0;
  bool wrap_ = false;
  const char* p_ = nullptr;
  const char* end_ = nullptr;
  int64_t owed_ = 0;
};

using NearAhead = Lookahead<3>;
using FarAhead = Lookahead<2>;
using HeadAhead = Lookahead<2, kHeadStride>;

// ------------------------------------------------------------------------------------ activation types

// The decoder's activations are float32 (float) or bfloat16 (its bits, uint16_t): the model's dtype.
// bf16 values are rounded where the eager model rounds them; float32 ones need no rounding.
template <typename T>
constexpr bool kIsFloat = std::is_same_v<T, float>;
inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return from_bf16(v); }
template <typename T>
inline T from_float(float v) {
  if constexpr (kIsFloat<T>) return v;
  else return to_bf16(v);
}
template <typename T>
inline float rounded(float v) { return to_float(from_float<T>(v)); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return load_bf16(p); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) { store_bf16(p, v); }
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (kIsFloat<T>) return v;
  else return round_bf16(v);
}

// ---------------------------------------------------------------------------------------------- dense GEMV

// Where a GEMV leaves its result y [M, N]: stored, or (accumulate) added to the values already there,
// after rounding as a separate linear layer followed by a residual add would.
template <typename T>
inline void put(T* y, float v, const T* bias, int64_t n, bool accumulate) {
  if (bias) v += to_float(bias[n]);
  *y = accumulate ? from_float<T>(to_float(*y) + rounded<T>(v)) : from_float<T>(v);
}

// One cache line of a dense dot product into acc: 32 bf16 products (vdpbf16ps) or 16 float32 ones.
inline __m512 mac_line(__m512 acc, const uint16_t* x, const uint16_t* w) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x), (__m512bh)_mm512_loadu_si512(w));
}
inline __m512 mac_line(__m512 acc, const float* x, const float* w) {
  return _mm512_fmadd_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(w), acc);
}
template <typename T>
constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line

// y[n] = x . w[n, :] (+ bias[n]) for one input row and weight rows [n0, n1): each weight row is read
// front to back, so the thread's reads are a single stream. A row's products are summed as gemv_block
// sums them (one accumulator, line after line): a row's result must not depend on how many input rows
// share its step (a verify step's rows are each what a one-row decode step of that position computes).
// The dot-product latency of one accumulator is hidden by the next rows' independent chains (out of
// order) and by the memory time of a row. `ahead` walks the stream kPrefetchRowBytes ahead.
template <typename T>
void gemv_one_row(const T* x, const T* w, int64_t K, int64_t n0, int64_t n1, const T* bias, T* y, bool accumulate,
                  NearAhead& ahead) {
  constexpr int64_t E = kLine<T>;
  for (int64_t n = n0; n < n1; ++n) {
    const T* wr = w + n * K;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += E) {
      ahead.line();
      acc = mac_line(acc, x + k, wr + k);
    }
    put(y + n, _mm512_reduce_add_ps(acc), bias, n, accumulate);
  }
}

// y[m, n] = x[m, :] . w[n, :] (+ bias[n]) for MB input rows against R weight rows at a time, for
// weight rows [n0, n1); `far` and `near` walk the stream kPrefetchL2Bytes and kPrefetchL1Bytes ahead.
template <int MB, int R, typename T>
void gemv_block(const T* x, int64_t rows, const T* w, int64_t K, int64_t n0, int64_t n1, const T* bias, T* y,
                int64_t N, bool accumulate, FarAhead& far, NearAhead& near) {
  constexpr int64_t E = kLine<T>;
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m512 acc[MB][R];
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    const T* wr = w + n * K;
    for (int64_t k = 0; k < K; k += E) {
      for (int r = 0; r < R; ++r) far.line(), near.line();
      for (int m = 0; m < MB; ++m) {
        if (m >= rows) break;
        for (int r = 0; r < R; ++r) acc[m][r] = mac_line(acc[m][r], x + m * K + k, wr + r * K + k);
      }
    }
    for (int m = 0; m < rows; ++m)
      for (int r = 0; r < R; ++r) put(y + m * N + n + r, _mm512_reduce_add_ps(acc[m][r]), bias, n + r, accumulate);
  }
  for (; n < n1; ++n) {  // a last partial group of weight rows
    for (int64_t k = 0; k < K; k += E) far.line(), near.line();
    for (int m = 0; m < rows; ++m) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += E) acc = mac_line(acc, x + m * K + k, w + n * K + k);
      put(y + m * N + n, _mm512_reduce_add_ps(acc), bias, n, accumulate);
    }
  }
}

constexpr int64_t kMaxGemvRows = 8;  // input rows of one pass over the weights (gemv_block's accumulators)
// A decode step's requests in one parallel region (FusedDecoder's team_rows): past kMaxGemvRows, each tile
// of weight rows is passed over by every group of input rows while it is in cache (gemv_rows; quant_rows
// takes block formats kRowGroup rows at a time the same way). Past this, the step goes product by product
// (forward_batched), each spread over the threads as a prompt chunk's, through torch's GEMM where dense:
// at 32 rows the two took about the same time on 2 cores (Zen 4), the team less at 24 and below.
constexpr int64_t kMaxTeamRows = 32;
// The most requests a step runs in one parallel region: kMaxTeamRows (each weight still read once a step),
// kMaxGemvRows with a mixture of experts (its tokens' expert groups in one region measured up to 8).
constexpr int64_t team_rows_for(bool moe) { return moe ? kMaxGemvRows : kMaxTeamRows; }
constexpr int64_t kGemvTileBytes = 16384;  // the weight rows every group of input rows passes over in turn

// Weight rows [n0, n1) of y [M, N] = x [M, K] w [N, K]^T (+ bias), M <= kMaxTeamRows, K a multiple of a
// cache line's elements, with the thread's weight stream walked by `far` and `near` (only `near` for one row).
// Each (input row, weight row) sum is the same however many input rows there are (one accumulator, line
// after line).
template <typename T>
void gemv_rows(const T* x, int64_t M, const T* w, int64_t K, int64_t N, int64_t n0, int64_t n1, const T* bias, T* y,
               bool accumulate, FarAhead& far, NearAhead& near) {
  if (M == 1) {
    gemv_one_row(x, w, K, n0, n1, bias, y, accumulate, near);
  } else if (M == 2) {
    gemv_block<2, 4>(x, M, w, K, n0, n1, bias, y, N, accumulate, far, near);
  } else if (M <= 4) {
    gemv_block<4, 4>(x, M, w, K, n0, n1, bias, y, N, accumulate, far, near);
  } else if (M <= kMaxGemvRows) {
    gemv_block<8, 2>(x, M, w, K, n0, n1, bias, y, N, accumulate, far, near);
  } else {
    // Tiles of weight rows, each read from memory by the first group of input rows (which walks the stream)
    // and from cache by the others; groups of even size (9 rows: 5 and 4; 17: 6, 6 and 5), as each pass
    // over a tile costs its loads whatever rows it carries.
    const int64_t tile = std::max<int64_t>(2, kGemvTileBytes / (K * (int64_t)sizeof(T)) / 2 * 2);
    const int64_t groups = (M + kMaxGemvRows - 1) / kMaxGemvRows, per = (M + groups - 1) / groups;
    FarAhead no_far;
    NearAhead no_near;
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
      const int64_t t1 = std::min(n1, t0 + tile);
      for (int64_t m0 = 0; m0 < M; m0 += per)
        gemv_block<8, 2>(x + m0 * K, std::min(per, M - m0), w, K, t0, t1, bias, y + m0 * N, N, accumulate,
                         m0 ? no_far : far, m0 ? no_near : near);
    }
  }
}

// The same over all of W, threads taking contiguous ranges of weight rows (multiples of 8 rows, so
// groups never straddle), each its own stream.
template <typename T>
void gemv(const T* x, int64_t M, const T* w, int64_t K, int64_t N, const T* bias, T* y) {
  at::parallel_for(0, (N + 7) / 8, 16, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * 8, n1 = std::min(N, g1 * 8);
    const Segment seg{reinterpret_cast<const char*>(w + n0 * K), reinterpret_cast<const char*>(w + n1 * K)};
    FarAhead far(&seg, 1);
    NearAhead near(&seg, 1);
    // The first bytes are left to the hardware; the walks start their distance in.
    far.advance(kPrefetchL2Bytes, false);
    near.advance(M == 1 ? kPrefetchRowBytes : kPrefetchL1Bytes, false);
    gemv_rows(x, M, w, K, N, n0, n1, bias, y, false, far, near);
  });
}

// x [M, K] @ w^T (+ bias) in bf16: the kernel for a few rows, torch's GEMM for more.
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (M > kMaxGemvRows || K % 32 != 0) return tmq::gemm_linear(x, w, bias);
  auto y = torch::empty({M, N}, x.options());
  gemv(bits(x), M, bits(w), K, N, bias ? bits(*bias) : nullptr, bits_mut(y));
  return y;
}

// ------------------------------------------------------------------------------------ paged attention

inline __m512 load16(const bf16* p) { return load_bf16(reinterpret_cast<const uint16_t*>(p)); }

// exp(x) in float32: 2^(x log2 e) split into 2^n (scalef) and 2^f, f in [0, 1), by its Taylor series
// to degree 7 (relative error below 2e-7 on that range); inputs are clamped to [-87, 88], so very
// negative ones give ~0 and very positive ones stay finite.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
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

// tanh(x) in float32: an odd polynomial (Taylor, to degree 9) where |x| < 1/4, where 1 - 2 / (exp(2x) + 1)
// would lose digits to cancellation; that form elsewhere (relative error below 1e-6 throughout).
inline __m512 tanh_ps(__m512 x) {
  const __m512 ax = _mm512_abs_ps(x), x2 = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(62.f / 2835.f);
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-17.f / 315.f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(2.f / 15.f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-1.f / 3.f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, x2), x, x);
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = exp_ps(_mm512_add_ps(ax, ax));
  const __m512 big = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
  const __m512 signed_big = _mm512_castsi512_ps(_mm512_or_si512(
      _mm512_castps_si512(big), _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN))));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.25f), _CMP_LT_OQ), signed_big, small);
}

// r[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once: pairs are interleaved and added level by
// level (within 128-bit lanes, then across them), 45 instructions where 16 separate horizontal sums
// take over 120.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 s[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: [a, b, c, d], each that lane's sum
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // lanes: [abcd of lanes 0+1, of 2+3, efgh of 0+1, of 2+3]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// fn(t, slot) for tokens [t0, t1) of a request whose block table row is `table`: token t lives in cache
// slot table[t / bs] * bs + t % bs. Walked block by block (a division per token would cost more than
// the attention arithmetic).
template <typename F>
inline void for_each_slot(const int64_t* table, int64_t bs, int64_t t0, int64_t t1, const F& fn) {
  for (int64_t t = t0; t < t1;) {
    const int64_t end = std::min(t1, (t / bs + 1) * bs);
    for (int64_t slot = table[t / bs] * bs + t % bs; t < end; ++t, ++slot) fn(t, slot);
  }
}

// ------------------------------------------------------------------------------- KV cache formats

// How the KV cache holds a value: in the activations' type (kPlain), or as an 8-bit code with a
// bfloat16 scale per cache slot and KV head, value = code * scale. The codes are int8 (kInt8) or fp8
// e4m3 (kFp8); an e4m3 code widened bit for bit into a half float is its value / 256, so the kernels
// read it with the half-float conversion and fold the 256 into the scale.
enum class KVCode : int { kPlain = 0, kInt8 = 1, kFp8 = 2 };

template <KVCode C>
constexpr float kCodeUnit = C == KVCode::kFp8 ? 256.f : 1.f;

// 16 codes as floats (before their scale).
template <KVCode C>
inline __m512 load_codes16(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (C == KVCode::kInt8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  } else {
    const __m256i w = _mm256_cvtepu8_epi16(b);
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                      _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
    return _mm512_cvtph_ps(h);
  }
}

// The largest magnitude a code holds: 127 (int8), 448 (e4m3).
inline float code_max(KVCode c) { return c == KVCode::kFp8 ? 448.f : 127.f; }

// Writes rows x [rows, D] of one token as codes [rows, D] and one bfloat16 scale per row:
// scale = bf16(max |x| / code_max), code = x / scale clamped to the code's range and rounded (to nearest
// even; e4m3 by c10's conversion). The same operations, in the same order, as KVCache.quantize in Python.
template <typename T>
void quantize_kv_rows(const T* x, int64_t rows, int64_t D, KVCode c, uint8_t* codes, uint16_t* scales) {
  const float qmax = code_max(c);
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * D;
    float amax = 0.f;
    bool finite = true;
    for (int64_t d = 0; d < D; ++d) {
      const float a = std::fabs(to_float(xr[d]));
      finite = finite && std::isfinite(a);
      amax = std::max(amax, a);
    }
    // A row holding NaN or infinity keeps no codes, and a NaN scale: it reads back as NaN.
    const uint16_t sb = finite ? to_bf16(amax / qmax) : to_bf16(std::numeric_limits<float>::quiet_NaN());
    const float s = from_bf16(sb);
    scales[r] = sb;
    uint8_t* out = codes + r * D;
    for (int64_t d = 0; d < D; ++d) {
      const float v = s > 0.f ? to_float(xr[d]) / s : 0.f;
      if (c == KVCode::kInt8) {
        out[d] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(std::min(127.f, std::max(-127.f, v)))));
      } else {
        out[d] = c10::Float8_e4m3fn(std::min(448.f, std::max(-448.f, v))).x;
      }
    }
  }
}

// One side (K or V) of a layer's cache as the attention kernels read it.
struct KVSide {
  const void* data;        // [slots, KV heads, head_dim]: values in the activations' type, or codes
  const uint16_t* scales;  // [slots, KV heads] bfloat16; nullptr for kPlain
};

struct KVLayer {
  KVSide k, v;
  KVCode code;
  int64_t value_bytes(int64_t T_bytes) const { return code == KVCode::kPlain ? T_bytes : 1; }
};

// Attention of one request's query heads over a range of its tokens, read through its block table,
// for head_dim = 16 DV (a compile-time size, so a row and its accumulators stay in registers), from a
// cache of format C (codes are read in place: a key row converted and scaled once for the query heads that
// share it, a value row's scale joined to each softmax weight).
// A part covers the query heads of KV heads [kh0, kh1) and tokens [t0, t1). For each query head it
// leaves, in float32, the largest score m, l = sum exp(score - m) and acc = sum exp(score - m) V;
// parts over different token ranges combine exactly (see merge below). The cache rows come from
// scattered blocks and each is used once, so they are prefetched a number of tokens ahead of use.
template <typename T, KVCode C, int DV>
void attend_part(const T* q, const KVLayer& kv, const int64_t* bt, int64_t b, int64_t kh0, int64_t kh1,
                 int64_t t0, int64_t t1, int64_t H, int64_t KVH, int64_t nb, int64_t bs, float scale, float softcap,
                 float* m_out, float* l_out, float* acc_out, std::vector<float>& scores,
                 std::vector<int64_t>& heads, std::vector<float>& keys) {
  constexpr int64_t D = DV * 16;
  constexpr bool kCoded = C != KVCode::kPlain;
  using E = std::conditional_t<kCoded, uint8_t, T>;  // a cache element
  const E* kc = static_cast<const E*>(kv.k.data);
  const E* vc = static_cast<const E*>(kv.v.data);
  const int64_t G = H / KVH, NH = (kh1 - kh0) * G, n = t1 - t0;
  scores.resize(NH * std::max<int64_t>(n, 1));
  // The part's rows of a token are adjacent in its cache slot: heads[t - t0] = slot * KVH + kh0, the
  // first of them (and the index of its scale).
  heads.resize(std::max<int64_t>(n, 1));
  for_each_slot(bt + b * nb, bs, t0, t1, [&](int64_t t, int64_t slot) { heads[t - t0] = slot * KVH + kh0; });
  auto rows = [&](const E* cache, int64_t t) { return cache + heads[t - t0] * D; };
  auto token_scale = [&](const uint16_t* scales, int64_t t, int64_t kh) {
    return from_bf16(scales[heads[t - t0] + kh]) * kCodeUnit<C>;
  };
  const int64_t row_bytes = (kh1 - kh0) * D * (int64_t)sizeof(E);
  constexpr int64_t kAhead = 16;  // tokens
  auto prefetch = [&](const E* cache, int64_t t, auto locality) {
    if (t >= t1) return;
    const char* p = reinterpret_cast<const char*>(rows(cache, t));
    for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(p + o, 0, decltype(locality)::value);
  };
  using L1 = std::integral_constant<int, 3>;
  using L2 = std::integral_constant<int, 2>;
  for (int64_t t = t0; t < std::min(t1, t0 + kAhead); ++t) prefetch(kc, t, L1{});

  // Scores, 16 tokens at a time: a vector of partial products per token, their lanes summed for all
  // 16 together. bf16 rows are multiplied as bf16 pairs (vdpbf16ps: exact products, float32 sums);
  // float32 rows with FMAs. Code rows are first converted to float32 and scaled, once per KV head
  // (into `keys`, 16 tokens' rows of the part), and then taken as float32 rows by each query head that
  // shares them. The V rows of those tokens are asked into L2 on the way.
  const __m512 sc = _mm512_set1_ps(scale);
  constexpr int PAIRS = (DV + 1) / 2;  // 32-element pieces of a bf16 row, the last half empty for odd DV
  constexpr __mmask32 kLastPiece = DV % 2 ? 0xFFFFu : 0xFFFFFFFFu;
  auto piece = [](const T* p, int j) {
    const __mmask32 mask = j == PAIRS - 1 ? kLastPiece : 0xFFFFFFFFu;
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p + j * 32);
  };
  const int64_t KHn = kh1 - kh0, krow = KHn * D;  // a token's rows in `keys`
  if constexpr (kCoded) keys.resize(16 * krow);
  for (int64_t ta = t0; ta < t1; ta += 16) {
    const int64_t cnt = std::min<int64_t>(16, t1 - ta);
    for (int64_t i = 0; i < cnt; ++i) {
      prefetch(kc, ta + i + kAhead, L1{});
      prefetch(vc, ta + i, L2{});
    }
    if constexpr (kCoded) {
      if (ta + kAhead < t1) {  // the scales of the next 16 tokens (a line holds 32 slots' of one head group)
        __builtin_prefetch(kv.k.scales + heads[ta + kAhead - t0], 0, 3);
        __builtin_prefetch(kv.v.scales + heads[ta + kAhead - t0], 0, 3);
      }
      for (int64_t i = 0; i < cnt; ++i)
        for (int64_t kh = 0; kh < KHn; ++kh) {
          const uint8_t* k = rows(kc, ta + i) + kh * D;
          float* out = keys.data() + i * krow + kh * D;
          const __m512 f = _mm512_set1_ps(token_scale(kv.k.scales, ta + i, kh));
          for (int j = 0; j < DV; ++j) _mm512_storeu_ps(out + j * 16, _mm512_mul_ps(load_codes16<C>(k + j * 16), f));
        }
    }
    for (int64_t h = 0; h < NH; ++h) {
      const T* qrow = q + (b * H + kh0 * G + h) * D;
      const int64_t off = h / G * D;  // the KV head's row within the part's rows
      __m512 part[16];
      if constexpr (kCoded) {
        __m512 qh[DV];
        for (int j = 0; j < DV; ++j) qh[j] = load16(qrow + j * 16);
        for (int64_t i = 0; i < 16; ++i) {
          __m512 s = _mm512_setzero_ps();
          if (i < cnt) {
            const float* k = keys.data() + i * krow + off;
            for (int j = 0; j < DV; ++j) s = _mm512_fmadd_ps(qh[j], _mm512_loadu_ps(k + j * 16), s);
          }
          part[i] = s;
        }
      } else if constexpr (std::is_same_v<T, bf16>) {
        __m512bh qh[PAIRS];
        for (int j = 0; j < PAIRS; ++j) qh[j] = piece(qrow, j);
        for (int64_t i = 0; i < 16; ++i) {
          __m512 s = _mm512_setzero_ps();
          if (i < cnt) {
            const T* k = rows(kc, ta + i) + off;
            for (int j = 0; j < PAIRS; ++j) s = _mm512_dpbf16_ps(s, qh[j], piece(k, j));
          }
          part[i] = s;
        }
      } else {
        __m512 qh[DV];
        for (int j = 0; j < DV; ++j) qh[j] = load16(qrow + j * 16);
        for (int64_t i = 0; i < 16; ++i) {
          __m512 s = _mm512_setzero_ps();
          if (i < cnt) {
            const T* k = rows(kc, ta + i) + off;
            for (int j = 0; j < DV; ++j) s = _mm512_fmadd_ps(qh[j], load16(k + j * 16), s);
          }
          part[i] = s;
        }
      }
      __m512 logits = _mm512_mul_ps(sum_lanes16(part), sc);
      if (softcap > 0.f)
        logits = _mm512_mul_ps(tanh_ps(_mm512_div_ps(logits, _mm512_set1_ps(softcap))), _mm512_set1_ps(softcap));
      _mm512_mask_storeu_ps(scores.data() + h * n + (ta - t0), (__mmask16)((1u << cnt) - 1), logits);
    }
  }
  for (int64_t h = 0; h < NH; ++h) {  // exp(score - max) in float32
    float* row = scores.data() + h * n;
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(row + j));
    float mx = _mm512_reduce_max_ps(vmx);
    for (; j < n; ++j) mx = std::max(mx, row[j]);
    vmx = _mm512_set1_ps(mx);
    __m512 vsum = _mm512_setzero_ps();
    for (j = 0; j + 16 <= n; j += 16) {
      const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + j), vmx));
      _mm512_storeu_ps(row + j, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    float sum = _mm512_reduce_add_ps(vsum);
    for (; j < n; ++j) { row[j] = std::exp(row[j] - mx); sum += row[j]; }
    m_out[h] = mx;
    l_out[h] = sum;
  }
  // acc = sum p V: each V row is converted once and used by up to GB of the query heads sharing it,
  // their accumulators held in registers (a code row's scale joins each head's weight p).
  constexpr int GB = DV <= 4 ? 12 / DV : 1;
  for (int64_t t = t0; t < std::min(t1, t0 + kAhead); ++t) prefetch(vc, t, L1{});
  for (int64_t kh = 0; kh < kh1 - kh0; ++kh)
    for (int64_t g0 = 0; g0 < G; g0 += GB) {
      const int64_t gc = std::min<int64_t>(GB, G - g0);
      const float* p = scores.data() + (kh * G + g0) * n - t0;  // p[g * n + t]: head g0 + g, token t
      __m512 a[GB][DV];
      for (int g = 0; g < GB; ++g)
        for (int j = 0; j < DV; ++j) a[g][j] = _mm512_setzero_ps();
      for (int64_t t = t0; t < t1; ++t) {
        prefetch(vc, t + kAhead, L1{});
        const E* v = rows(vc, t) + kh * D;
        __m512 r[DV];
        float vs = 1.f;
        if constexpr (kCoded) {
          for (int j = 0; j < DV; ++j) r[j] = load_codes16<C>(v + j * 16);
          vs = token_scale(kv.v.scales, t, kh);
        } else {
          for (int j = 0; j < DV; ++j) r[j] = load16(v + j * 16);
        }
        for (int g = 0; g < GB; ++g) {
          if (g >= gc) break;
          const __m512 pg = _mm512_set1_ps(kCoded ? p[g * n + t] * vs : p[g * n + t]);
          for (int j = 0; j < DV; ++j) a[g][j] = _mm512_fmadd_ps(pg, r[j], a[g][j]);
        }
      }
      for (int g = 0; g < gc; ++g)
        for (int j = 0; j < DV; ++j) _mm512_storeu_ps(acc_out + (kh * G + g0 + g) * D + j * 16, a[g][j]);
    }
}

// The head sizes the attention kernels are built for (a row and its accumulators are held in registers,
// 16 floats each): multiples of 16 up to 128, and 256 (Gemma's).
inline bool head_dim_ok(int64_t D) { return D % 16 == 0 && D >= 16 && (D <= 128 || D == 256); }
constexpr const char* kHeadDims = "head_dim must be a multiple of 16 up to 128, or 256";

// out[b, h, :] = softmax(q[b, h] . K[t] * scale) V over each request's tokens (the last `window` ones
// when window > 0); with softcap > 0 the logits become softcap * tanh(logits / softcap) first. Work is split into parts of (request, KV heads, token range). A part takes all of a
// request's KV heads over a range of its tokens: a token's K (and V) rows of every head are adjacent in
// its slot, so a part reads each block front to back, a stream the hardware prefetches (parts of one
// head each read every third row piece, and mostly wait for memory). Each request's tokens are split
// into one range per planned thread, while ranges stay kMinChunk tokens or longer; where that leaves
// fewer parts than threads (one short request), parts go per KV head as well. Parts are then merged
// per query head: with M the largest m, out = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c.
// A request's ranges depend on its own context length alone, never on the other requests of the step
// (a per-head split sums each head over those same ranges): its numbers are the same in any batch, so a
// step that verifies several of a request's positions as rows of their own computes each as a step of
// that position alone would. The plan depends only on the context lengths and the window, so a decode
// step makes it once for all its layers of one window.
struct AttentionPlan {
  int64_t B, H, KVH, D, G, nb, bs, window, head_groups, heads_per_group, parts, per_part;
  float scale, softcap;
  const int64_t* bt;
  const int64_t* lens;
  std::vector<int64_t> chunks, first;  // per request: its token ranges, and the index of its first part
  std::vector<float> m, l, acc;  // per part and query head: the largest score, exp-sum and V-sum

  AttentionPlan(const int64_t* block_tables, const int64_t* seq_lens, int64_t B_, int64_t H_, int64_t KVH_,
                int64_t D_, int64_t nb_, int64_t bs_, float scale_, int64_t window_, int64_t threads,
                float softcap_ = 0.f)
      : B(B_), H(H_), KVH(KVH_), D(D_), G(H_ / KVH_), nb(nb_), bs(bs_), window(window_), scale(scale_),
        softcap(softcap_), bt(block_tables), lens(seq_lens) {
    constexpr int64_t kMinChunk = 32;  // tokens: shorter ranges cost more in merging than they save
    chunks.resize(B);
    first.resize(B + 1);
    int64_t total = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t len = window > 0 ? std::min(lens[b], window) : lens[b];
      chunks[b] = std::max<int64_t>(1, std::min<int64_t>(threads, len / kMinChunk));
      total += chunks[b];
    }
    // Fewer parts than threads: the ranges split further, per KV head (never into fewer ranges: those
    // would change the request's sums).
    const bool per_head = total < threads;
    head_groups = per_head ? KVH : 1;
    heads_per_group = per_head ? 1 : KVH;
    first[0] = 0;
    for (int64_t b = 0; b < B; ++b) first[b + 1] = first[b] + head_groups * chunks[b];
    parts = first[B];
    per_part = heads_per_group * G;
    m.resize(parts * per_part);
    l.resize(parts * per_part);
    acc.resize(parts * per_part * D);
  }

  struct Scratch {
    std::vector<float> scores;
    std::vector<int64_t> heads;
    std::vector<float> keys;  // code rows converted to float32 (attend_part)
  };

  // Part i: request b's KV heads [kh0, kh1) over its tokens [t0, t1).
  struct Part {
    int64_t b, kh0, kh1, t0, t1;
  };
  Part part(int64_t i) const {
    const int64_t b = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1;
    const int64_t n = chunks[b], kg = (i - first[b]) / n, c = (i - first[b]) % n;
    const int64_t len = lens[b], start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    return {b, kg * heads_per_group, (kg + 1) * heads_per_group, start + (len - start) * c / n,
            start + (len - start) * (c + 1) / n};
  }

  template <typename T>
  void run_part(int64_t i, const T* q, const KVLayer& kv, Scratch& s) {
    switch (kv.code) {
      case KVCode::kPlain: return run_part_as<T, KVCode::kPlain>(i, q, kv, s);
      case KVCode::kInt8: return run_part_as<T, KVCode::kInt8>(i, q, kv, s);
      case KVCode::kFp8: return run_part_as<T, KVCode::kFp8>(i, q, kv, s);
    }
  }

  template <typename T, KVCode C>
  void run_part_as(int64_t i, const T* q, const KVLayer& kv, Scratch& s) {
    const auto [b, kh0, kh1, t0, t1] = part(i);
    float *mo = &m[i * per_part], *lo = &l[i * per_part], *ao = &acc[i * per_part * D];
    switch (D / 16) {  // head_dim_ok(D)
#define TOKENMILL_PART(DV)                                                                                   \
  case DV:                                                                                                   \
    return attend_part<T, C, DV>(q, kv, bt, b, kh0, kh1, t0, t1, H, KVH, nb, bs, scale, softcap, mo, lo, ao, \
                                 s.scores, s.heads, s.keys);
      TOKENMILL_PART(1) TOKENMILL_PART(2) TOKENMILL_PART(3) TOKENMILL_PART(4)
      TOKENMILL_PART(5) TOKENMILL_PART(6) TOKENMILL_PART(7) TOKENMILL_PART(8)
      TOKENMILL_PART(16)
#undef TOKENMILL_PART
    }
  }

  // Asks for part i's K and V rows into L2 ahead of run_part (they come from scattered blocks, and
  // run_part alone would mostly wait for them).
  template <typename T>
  void prefetch_part(int64_t i, const KVLayer& kv) const {
    const Part p = part(i);
    const int64_t value = kv.value_bytes(sizeof(T)), bytes = (p.kh1 - p.kh0) * D * value;
    const char* kc = static_cast<const char*>(kv.k.data);
    const char* vc = static_cast<const char*>(kv.v.data);
    for_each_slot(bt + p.b * nb, bs, p.t0, p.t1, [&](int64_t t, int64_t slot) {
      const int64_t off = (slot * KVH + p.kh0) * D * value;
      for (int64_t o = 0; o < bytes; o += 64) {
        __builtin_prefetch(kc + off + o, 0, 2);
        __builtin_prefetch(vc + off + o, 0, 2);
      }
      if (kv.code != KVCode::kPlain && (t == p.t0 || t % bs == 0)) {  // each block's scales
        __builtin_prefetch(kv.k.scales + slot * KVH, 0, 2);
        __builtin_prefetch(kv.v.scales + slot * KVH, 0, 2);
      }
    });
  }

  // The merge group of part i: its request's KV-head group, whose parts (one per token range, group_parts
  // of them) together give the query heads [h0, h0 + per_part) of that request, h0 = (g % head_groups) *
  // per_part. Groups are numbered b * head_groups + kg, below B * KVH.
  int64_t group_of(int64_t i) const {
    const int64_t b = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1;
    return b * head_groups + (i - first[b]) / chunks[b];
  }
  int64_t group_parts(int64_t g) const { return chunks[g / head_groups]; }

  // merge() for every query head of group g.
  template <typename T>
  void merge_group(int64_t g, T* out, float* o, const float* sinks = nullptr) const {
    const int64_t b = g / head_groups, h0 = (g % head_groups) * per_part;
    for (int64_t h = h0; h < h0 + per_part; ++h) merge<T>(b * H + h, out, o, sinks);
  }

  // out[j] for query head j = b * H + h, from its parts. sinks (or nullptr): a logit per query head that
  // joins the softmax's denominator and takes its share of the probability to no value (gpt-oss).
  template <typename T>
  void merge(int64_t j, T* out, float* o, const float* sinks = nullptr) const {
    const int64_t b = j / H, h = j % H, kg = (h / G) / heads_per_group, hh = h - kg * per_part;
    const int64_t n = chunks[b], p0 = first[b] + kg * n;
    float M = sinks ? sinks[h] : -INFINITY;
    for (int64_t c = 0; c < n; ++c) M = std::max(M, m[(p0 + c) * per_part + hh]);
    float denom = sinks ? std::exp(sinks[h] - M) : 0.f;
    std::fill(o, o + D, 0.f);
    for (int64_t c = 0; c < n; ++c) {
      const int64_t k = (p0 + c) * per_part + hh;
      if (l[k] == 0.f) continue;  // an empty token range
      const float w = std::exp(m[k] - M);
      denom += w * l[k];
      for (int64_t d = 0; d < D; ++d) o[d] += w * acc[k * D + d];
    }
    const float inv = 1.f / denom;
    for (int64_t d = 0; d < D; ++d) out[j * D + d] = static_cast<T>(o[d] * inv);
  }
};

// The thread count attention splits are planned for. How a request's tokens split over threads
// changes the rounding of the merged result, so the split is made for the whole team (set once with
// set_plan_threads), not for however many threads run a step: a step's numbers must not depend on
// whether another process happened to hold a core. 0 until set: torch's thread count.
inline std::atomic<int64_t> g_plan_threads{0};

inline int64_t plan_threads() {
  const int64_t n = g_plan_threads.load(std::memory_order_relaxed);
  return n > 0 ? n : at::get_num_threads();
}

void set_plan_threads(int64_t n) { g_plan_threads.store(std::max<int64_t>(0, n)); }

template <typename T>
void decode_attention(const T* q, const KVLayer& kv, const int64_t* bt, const int64_t* lens, T* out, int64_t B,
                      int64_t H, int64_t KVH, int64_t D, int64_t nb, int64_t bs, float scale, int64_t window,
                      float softcap, const float* sinks) {
  AttentionPlan plan(bt, lens, B, H, KVH, D, nb, bs, scale, window, plan_threads(), softcap);
  at::parallel_for(0, plan.parts, 1, [&](int64_t i0, int64_t i1) {
    AttentionPlan::Scratch s;
    for (int64_t i = i0; i < i1; ++i) plan.run_part<T>(i, q, kv, s);
  });
  at::parallel_for(0, B * H, 16, [&](int64_t j0, int64_t j1) {
    std::vector<float> o(D);
    for (int64_t j = j0; j < j1; ++j) plan.merge<T>(j, out, o.data(), sinks);
  });
}

// ------------------------------------------------------------------------------- element-wise pieces

// y = w * round(x / rms(x)) over rows of length n (a multiple of 16), as the eager model computes it:
// the normalisation in float32, rounded to the activation type, then scaled by the weight and rounded again.
// With an offset (Gemma's 1), or in_float (gpt-oss): y = round(x / rms(x) * (offset + w)), the scale applied
// in float32 as its reference applies it. y may be x.
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t n, float eps, float offset = 0.f,
                   bool in_float = false) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 v = load16(xr + i);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / n + eps));
    if (offset != 0.f || in_float) {
      const __m512 off = _mm512_set1_ps(offset);
      for (int64_t i = 0; i < n; i += 16)
        store16(y + r * n + i, _mm512_mul_ps(_mm512_mul_ps(load16(xr + i), inv), _mm512_add_ps(off, load16(w + i))));
      continue;
    }
    for (int64_t i = 0; i < n; i += 16)
      store16(y + r * n + i, _mm512_mul_ps(load16(w + i), round16<T>(_mm512_mul_ps(load16(xr + i), inv))));
  }
}

// x[i] = round(x[i] + d[i]): the residual stream (n a multiple of 16).
template <typename T>
void add_into(T* x, const T* d, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) store16(x + i, _mm512_add_ps(load16(x + i), load16(d + i)));
}

// out = round(round(silu(gate)) * up) over n values, n a multiple of 16.
template <typename T>
void silu_mul(const T* gate, const T* up, T* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 g = load16(gate + i), u = load16(up + i);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    store16(out + i, _mm512_mul_ps(round16<T>(silu), u));
  }
}

// out = round(round(gelu_tanh(gate)) * up) over n values, n a multiple of 16: GeGLU. gelu_tanh(g) =
// g (1 + tanh(u)) / 2 = g / (1 + exp(-2u)), u = sqrt(2 / pi) (g + 0.044715 g^3).
template <typename T>
void gelu_tanh_mul(const T* gate, const T* up, T* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f), k = _mm512_set1_ps(-2.f * 0.7978845608028654f), c = _mm512_set1_ps(0.044715f);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 g = load16(gate + i), u = load16(up + i);
    const __m512 inner = _mm512_mul_ps(k, _mm512_fmadd_ps(_mm512_mul_ps(c, g), _mm512_mul_ps(g, g), g));
    const __m512 gelu = _mm512_div_ps(g, _mm512_add_ps(one, exp_ps(inner)));
    store16(out + i, _mm512_mul_ps(round16<T>(gelu), u));
  }
}

// gpt-oss's clamped SwiGLU over n values (a multiple of 16): g = min(gate, limit), u = clamp(up, -limit,
// limit), out = (u + 1) * g * sigmoid(alpha g), rounded after each operation as the eager model rounds.
template <typename T>
void clamped_swiglu_mul(const T* gate, const T* up, T* out, int64_t n, float alpha, float limit) {
  const __m512 one = _mm512_set1_ps(1.f), a = _mm512_set1_ps(alpha), hi = _mm512_set1_ps(limit),
               lo = _mm512_set1_ps(-limit);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 g = _mm512_min_ps(load16(gate + i), hi), u = _mm512_max_ps(_mm512_min_ps(load16(up + i), hi), lo);
    const __m512 ga = round16<T>(_mm512_mul_ps(g, a));
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), ga));
    const __m512 sig = round16<T>(_mm512_div_ps(one, _mm512_add_ps(one, e)));
    const __m512 glu = round16<T>(_mm512_mul_ps(g, sig));
    store16(out + i, _mm512_mul_ps(round16<T>(_mm512_add_ps(u, one)), glu));
  }
}

// The gated MLP's activation (description.py's `activation`), with the clamped SwiGLU's alpha and limit.
enum class Activation : int { kSilu = 0, kGeluTanh = 1, kClampedSwiglu = 2 };
struct GateAct {
  Activation kind;
  float alpha, limit;
};

template <typename T>
inline void gate_mul(const GateAct& a, const T* gate, const T* up, T* out, int64_t n) {
  if (a.kind == Activation::kGeluTanh) gelu_tanh_mul(gate, up, out, n);
  else if (a.kind == Activation::kClampedSwiglu) clamped_swiglu_mul(gate, up, out, n, a.alpha, a.limit);
  else silu_mul(gate, up, out, n);
}

// y = round(round(tanh(round(y / cap))) * cap) over n values in place (logit softcapping, rounded at each
// step as the eager model's three operations round).
template <typename T>
void softcap_rows(T* y, int64_t n, float cap) {
  const __m512 c = _mm512_set1_ps(cap);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    store16(y + i, _mm512_mul_ps(round16<T>(tanh_ps(round16<T>(_mm512_div_ps(load16(y + i), c)))), c));
  if (i < n) {  // the tail, through a full vector
    alignas(64) T tail[16] = {};
    std::memcpy(tail, y + i, (n - i) * sizeof(T));
    softcap_rows(tail, 16, cap);
    std::memcpy(y + i, tail, (n - i) * sizeof(T));
  }
}

// Non-interleaved rotary embedding of the first R dims of one head in place (the rest are left as they are:
// partial rotary); cos and sin hold R values (both halves).
template <typename T>
void rotate(T* v, const T* cos, const T* sin, int64_t R) {
  const int64_t half = R / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = to_float(v[i]), b = to_float(v[i + half]);
    v[i] = from_float<T>(a * to_float(cos[i]) - b * to_float(sin[i]));
    v[i + half] = from_float<T>(b * to_float(cos[i + half]) + a * to_float(sin[i + half]));
  }
}

// ------------------------------------------------------------------------------------------ argmax

// The index of a row's largest value (the first, on ties; the first NaN where the row has one), as
// torch.argmax gives it: each of 16 lanes keeps its own best in order, then the lanes are compared.
template <typename T>
int64_t argmax_row(const T* row, int64_t N) {
  auto at = [&](int64_t i) -> float {
    if constexpr (std::is_same_v<T, float>) return row[i];
    else return from_bf16(reinterpret_cast<const uint16_t*>(row)[i]);
  };
  const __m512i none = _mm512_set1_epi32(-1), step = _mm512_set1_epi32(16);
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_i = none, idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= N; i += 16, idx = _mm512_add_epi32(idx, step)) {
    const __m512 v = load16(row + i);
    // Greater, or equal to a lane's -inf start that no value has taken yet (a row of -inf).
    const __mmask16 take = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ) |
                           (_mm512_cmp_ps_mask(v, best, _CMP_EQ_OQ) & _mm512_cmpeq_epi32_mask(best_i, none));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_mask_mov_ps(best, take, v);
    best_i = _mm512_mask_mov_epi32(best_i, take, idx);
  }
  alignas(64) float lane_v[16];
  alignas(64) int32_t lane_i[16];
  _mm512_store_ps(lane_v, best);
  _mm512_store_si512(lane_i, best_i);
  float bv = -INFINITY;
  int64_t bi = -1;
  for (int l = 0; l < 16; ++l)
    if (lane_i[l] >= 0 && (bi < 0 || lane_v[l] > bv || (lane_v[l] == bv && lane_i[l] < bi))) bv = lane_v[l], bi = lane_i[l];
  for (; i < N; ++i) {
    if (std::isnan(at(i))) nan = 1;
    if (bi < 0 || at(i) > bv) bv = at(i), bi = i;
  }
  if (nan)
    for (int64_t j = 0; j < N; ++j)
      if (std::isnan(at(j))) return j;
  return bi;
}

// ------------------------------------------------------------------------------------------ sampling

// One token drawn from softmax(row / temperature) under top-k, top-p and min-p, by inverting the kept
// tokens' cumulative weights at u in [0, 1); the argmax where temperature is 0. The same definitions as
// the sampler's torch path (tokenmill/sample/sampler.py): a NaN logit is -inf and +inf the largest float
// after the division; top-k keeps the k largest (of equal ones, the first), renormalised among them;
// top-p keeps tokens, largest first, while the probability ranked above them stays under top_p (the
// first always); min-p keeps tokens of at least min_p times the largest one's probability. A token of
// weight 0 (a -inf logit) is never drawn. -1 where no logit is finite (the caller's fallback).
//
// Two passes over the row give the weights w = exp(y - max) and their sum; truncation then looks only at
// the tokens above the first of a few thresholds on w (e^-1, e^-2, ... e^-64, all) that holds top_k
// tokens or top_p of the mass, where the definitions' cut must fall, and select the kept ones among
// those in linear time (nth_element for top-k, a quickselect on the weight for top-p), never sorting them.
class RowSampler {
 public:
  template <typename T>
  int64_t draw(const T* row, int64_t V, float temperature, int64_t top_k, float top_p, float min_p, double u) {
    if (!(temperature > 0.f)) return argmax_row(row, V);
    w_.resize(V);
    float* w = w_.data();
    const float m = scaled(row, V, temperature, w);
    if (m == -INFINITY) return -1;
    const double total = weigh(w, V, m);
    const bool by_k = top_k > 0 && top_k < V;
    if (!by_k && !(top_p < 1.f)) return draw_all(w, V, min_p, u);
    for (int level = first_level(w, V, by_k ? top_k : 0, by_k ? 0.0 : top_p * total); ; ++level) {
      gather(w, V, level);
      if (by_k && (int64_t)cand_.size() > top_k) {  // the k first by rank: largest, equal ones by index
        std::nth_element(cand_.begin(), cand_.begin() + top_k, cand_.end(), [](const auto& a, const auto& b) {
          return a.first > b.first || (a.first == b.first && a.second < b.second);
        });
        cand_.resize(top_k);
      }
      size_t keep = cand_.size();
      if (top_p < 1.f) {
        double set_total = total;
        if (by_k) {  // top-k renormalises among its k
          set_total = 0.0;
          for (const auto& c : cand_) set_total += c.first;
        }
        const double need = (double)top_p * set_total;
        double before = 0.0;
        keep = nucleus(need, before);
        // The nucleus did not close among these: it reaches tokens below this threshold.
        if (keep == cand_.size() && !by_k && level < kLevels && before < need) continue;
      }
      double kept = 0.0;  // the kept tokens (in no particular order) of weight >= min_p
      for (size_t j = 0; j < keep; ++j) kept += cand_[j].first >= min_p ? cand_[j].first : 0.0;
      const double target = u * kept;
      double cum = 0.0;
      int64_t last = cand_[0].second;
      for (size_t j = 0; j < keep; ++j) {
        if (!(cand_[j].first >= min_p)) continue;
        last = cand_[j].second;
        cum += cand_[j].first;
        if (cum > target) return last;
      }
      return last;  // u * kept rounded up to kept
    }
  }

 private:
  static constexpr int kLevels = 7;  // thresholds e^-1 .. e^-64, then every token of positive weight
  static float level_floor(int level) {
    static const float floors[kLevels] = {0.36787944f, 0.13533528f, 0.01831564f, 3.3546263e-4f,
                                          1.1253517e-7f, 1.2664166e-14f, 1.6038109e-28f};
    return level < kLevels ? floors[level] : std::numeric_limits<float>::denorm_min();
  }

  // w[i] = row[i] / temperature (NaN: -inf, +inf: the largest float); returns their maximum.
  template <typename T>
  static float scaled(const T* row, int64_t V, float temperature, float* w) {
    const __m512 t = _mm512_set1_ps(temperature), big = _mm512_set1_ps(FLT_MAX), ninf = _mm512_set1_ps(-INFINITY);
    __m512 vmax = ninf;
    int64_t i = 0;
    for (; i + 16 <= V; i += 16) {
      __m512 y = _mm512_div_ps(load16(row + i), t);
      y = _mm512_mask_mov_ps(_mm512_min_ps(y, big), _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), ninf);
      _mm512_storeu_ps(w + i, y);
      vmax = _mm512_max_ps(vmax, y);
    }
    float m = _mm512_reduce_max_ps(vmax);
    for (; i < V; ++i) {
      float y = to_float(row[i]) / temperature;
      y = std::isnan(y) ? -INFINITY : std::min(y, FLT_MAX);
      w[i] = y;
      m = std::max(m, y);
    }
    return m;
  }

  // w[i] = exp(w[i] - m), 0 for -inf; returns their sum, in the order chunk_sum adds them.
  static double weigh(float* w, int64_t V, float m) {
    const __m512 vm = _mm512_set1_ps(m), ninf = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= V; i += 16) {
      const __m512 y = _mm512_loadu_ps(w + i);
      const __mmask16 finite = _mm512_cmp_ps_mask(y, ninf, _CMP_NEQ_OQ);
      _mm512_storeu_ps(w + i, _mm512_maskz_mov_ps(finite, exp_ps(_mm512_sub_ps(y, vm))));
    }
    for (; i < V; ++i) w[i] = w[i] == -INFINITY ? 0.f : std::exp(w[i] - m);
    double total = 0.0;
    for (int64_t c = 0; c < V; c += kChunk) total += chunk_sum(w, c, std::min(V, c + kChunk), 0.f);
    return total;
  }

  static constexpr int64_t kChunk = 256;
  // The sum of w[i] >= floor over [a, b): 16 lanes, then across them.
  static float chunk_sum(const float* w, int64_t a, int64_t b, float floor) {
    const __m512 f = _mm512_set1_ps(floor);
    __m512 acc = _mm512_setzero_ps();
    int64_t i = a;
    for (; i + 16 <= b; i += 16) {
      const __m512 v = _mm512_loadu_ps(w + i);
      acc = _mm512_mask_add_ps(acc, _mm512_cmp_ps_mask(v, f, _CMP_GE_OQ), acc, v);
    }
    float s = _mm512_reduce_add_ps(acc);
    for (; i < b; ++i) s += w[i] >= floor ? w[i] : 0.f;
    return s;
  }

  // No top-k or top-p: tokens of weight >= min_p (all, where it is 0), drawn in vocabulary order. The
  // chunk holding the target is found from chunk sums made as the total's were, then walked token by token.
  static int64_t draw_all(const float* w, int64_t V, float min_p, double u) {
    double kept = 0.0;
    for (int64_t c = 0; c < V; c += kChunk) kept += chunk_sum(w, c, std::min(V, c + kChunk), min_p);
    const double target = u * kept;
    double cum = 0.0;
    int64_t last = -1;
    for (int64_t c = 0; c < V; c += kChunk) {
      const int64_t e = std::min(V, c + kChunk);
      const float s = chunk_sum(w, c, e, min_p);
      if (cum + s <= target && e < V) {
        cum += s;
        continue;
      }
      for (int64_t i = c; i < e; ++i) {
        if (!(w[i] >= min_p) || w[i] == 0.f) continue;
        last = i;
        cum += w[i];
        if (cum > target) return i;
      }
      if (last >= 0) return last;  // the chunk's token-by-token sum rounded below its vector sum
    }
    return last;
  }

  // The first threshold level holding at least k tokens (k > 0), or at least `mass` of weight.
  static int first_level(const float* w, int64_t V, int64_t k, double mass) {
    int64_t count[kLevels] = {};
    double sum[kLevels] = {};
    __m512 lv[kLevels];
    for (int l = 0; l < kLevels; ++l) lv[l] = _mm512_set1_ps(level_floor(l));
    for (int64_t c = 0; c < V; c += kChunk) {
      const int64_t e = std::min(V, c + kChunk);
      __m512 acc[kLevels];
      for (int l = 0; l < kLevels; ++l) acc[l] = _mm512_setzero_ps();
      int64_t i = c;
      for (; i + 16 <= e; i += 16) {
        const __m512 v = _mm512_loadu_ps(w + i);
        for (int l = 0; l < kLevels; ++l) {
          const __mmask16 in = _mm512_cmp_ps_mask(v, lv[l], _CMP_GE_OQ);
          count[l] += __builtin_popcount(in);
          acc[l] = _mm512_mask_add_ps(acc[l], in, acc[l], v);
        }
      }
      for (int l = 0; l < kLevels; ++l) {
        float s = _mm512_reduce_add_ps(acc[l]);
        for (int64_t j = i; j < e; ++j)
          if (w[j] >= level_floor(l)) s += w[j], ++count[l];
        sum[l] += s;
      }
    }
    for (int l = 0; l < kLevels; ++l)
      if (k > 0 ? count[l] >= k : sum[l] >= mass) return l;
    return kLevels;
  }

  // cand_: the tokens of weight >= the level's floor (and > 0), in vocabulary order.
  void gather(const float* w, int64_t V, int level) {
    const float floor = level_floor(level);
    cand_.clear();
    for (int64_t i = 0; i < V; ++i)
      if (w[i] >= floor) cand_.emplace_back(w[i], (int32_t)i);
  }

  // Moves to the front of cand_ the tokens top-p keeps, those whose weight ranked above them (largest
  // first, equal ones by index) is under `need`, and returns how many; `before` is their weight. A
  // selection rather than a sort: each round splits the undecided tokens around one weight, keeps the
  // larger ones whole where they stay under `need` and drops the smaller ones where they do not.
  size_t nucleus(double need, double& before) {
    size_t lo = 0, hi = cand_.size();  // [0, lo) kept, [lo, hi) undecided, [hi, end) dropped
    before = 0.0;
    while (lo < hi && before < need) {
      const float pivot = cand_[lo + (hi - lo) / 2].first;
      const auto first = cand_.begin() + lo, last = cand_.begin() + hi;
      const auto larger = std::partition(first, last, [pivot](const auto& c) { return c.first > pivot; });
      const auto equal = std::partition(larger, last, [pivot](const auto& c) { return c.first == pivot; });
      double above = 0.0;
      for (auto it = first; it != larger; ++it) above += it->first;
      if (larger != first && before + above >= need) {  // the cut falls among the larger ones
        hi = larger - cand_.begin();
        continue;
      }
      before += above;  // the larger ones all kept; then the equal ones by index while under need
      std::sort(larger, equal, [](const auto& a, const auto& b) { return a.second < b.second; });
      lo = larger - cand_.begin();
      const size_t end = equal - cand_.begin();
      while (lo < end && before < need) before += cand_[lo++].first;
    }
    return lo;
  }

  std::vector<float> w_;
  std::vector<std::pair<float, int32_t>> cand_;
};

// ------------------------------------------------------------------------------------------- team

// Waits until `n` threads have arrived. Spinning costs well under a microsecond where a parallel region
// per operation costs several, which adds up over the 150-200 phases of a decode step. A thread that has
// spun for 0.1 ms (far longer than threads in step drift apart) sleeps on a futex instead: the thread
// it waits for has lost its core (to the server's event loop, or a kernel thread), and an idle core
// lets the scheduler move it there.
class SpinBarrier {
 public:
  // Cycles the calling thread has spent waiting here (see TeamClock), and its waits.
  static inline thread_local uint64_t waited = 0, waits = 0;

  void wait(int n) {
    if (n <= 1) return;
    const uint64_t t0 = __rdtsc();
    wait_for(n);
    waited += __rdtsc() - t0;
    ++waits;
  }

 private:
  void wait_for(int n) {
    const int gen = generation_.load();
    if (arrived_.fetch_add(1) == n - 1) {
      arrived_.store(0);
      generation_.store(gen + 1);
      if (sleepers_.load() > 0) futex(FUTEX_WAKE_PRIVATE, INT_MAX);
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    for (int spins = 1;; ++spins) {
      if (generation_.load(std::memory_order_acquire) != gen) return;
      _mm_pause();
      if (spins % 1024 == 0 && std::chrono::steady_clock::now() - start > kSpinTime) break;
    }
    while (generation_.load() == gen) {
      sleepers_.fetch_add(1);
      futex(FUTEX_WAIT_PRIVATE, gen);  // returns at once if the generation has moved on
      sleepers_.fetch_sub(1);
    }
  }

  static constexpr std::chrono::microseconds kSpinTime{100};
  void futex(int op, int value) {
    syscall(SYS_futex, reinterpret_cast<int*>(&generation_), op, value, nullptr, nullptr, 0);
  }
  std::atomic<int> arrived_{0}, generation_{0}, sleepers_{0};
  static_assert(sizeof(std::atomic<int>) == sizeof(int), "the futex word is the atomic's int");
};

// The threads a team asks for: torch's intra-op thread count, but no more than the CPUs this process
// may run on (a thread per core waiting at barriers for a descheduled one would crawl).
inline int64_t team_size() {
  int64_t cpus = at::get_num_threads();
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = std::min<int64_t>(cpus, CPU_COUNT(&set));
  return std::max<int64_t>(1, cpus);
}

// How long a team's region took and how much of it each thread spent waiting at barriers: a thread
// that waits most of the time waits for another that has lost its core (another process runs there).
struct TeamClock {
  uint64_t cycles = 0;
  std::vector<uint64_t> waited;
  int threads = 0;
  int64_t barriers = 0;  // the region's barrier waits (every thread waits at each)
  // The share of the region the most-waiting thread spent waiting.
  double lag() const {
    uint64_t most = 0;
    for (uint64_t w : waited) most = std::max(most, w);
    return cycles ? (double)most / (double)cycles : 0.0;
  }
};

// Runs body(worker, workers, barrier) on every thread of one parallel region of team_size() threads.
// The region may have fewer threads than asked for (one, inside another region): each thread counts
// itself in, and all wait until every index of the region is taken before starting, so `workers` is
// the true number of threads. Returns the region's TeamClock.
template <typename F>
TeamClock run_team(int64_t want, const F& body) {
  std::atomic<int64_t> taken{0};
  std::atomic<int> joined{0};
  SpinBarrier barrier;
  TeamClock clock;
  clock.waited.assign(want, 0);
  const uint64_t start = __rdtsc();
  at::parallel_for(0, want, 1, [&](int64_t i0, int64_t i1) {
    const int me = joined.fetch_add(1);
    taken.fetch_add(i1 - i0);
    while (taken.load() < want) std::this_thread::yield();
    const uint64_t before = SpinBarrier::waited, waits_before = SpinBarrier::waits;
    body(me, joined.load(), barrier);
    clock.waited[me] = SpinBarrier::waited - before;
    if (me == 0) clock.threads = joined.load(), clock.barriers = (int64_t)(SpinBarrier::waits - waits_before);
  });
  clock.cycles = __rdtsc() - start;
  return clock;
}

// Rows [begin, end) of N that worker w of n takes: equal shares, cut at multiples of 16 rows.
inline std::pair<int64_t, int64_t> share(int64_t N, int w, int n) {
  auto cut = [&](int i) { return i == n ? N : N * i / n / 16 * 16; };
  return {cut(w), cut(w + 1)};
}

// Rows [begin, end) of a projection of `heads` heads of D rows each (qkv) that worker w of n takes: whole
// heads, so that the thread that computes a head's rows can also norm, rotate and store it.
inline std::pair<int64_t, int64_t> head_share(int64_t heads, int64_t D, int w, int n) {
  return {heads * w / n * D, heads * (w + 1) / n * D};
}

// ---------------------------------------------------------------------------------- weight matrices

c10::optional<torch::Tensor> opt(const c10::optional<torch::Tensor>& t) {
  if (t && t->defined()) return t->contiguous();
  return c10::nullopt;
}

// GGML type ids of the dense formats; every other id a matrix part may have is a block format (quant.h).
constexpr int64_t kDenseF32 = 0, kDenseBF16 = 30;

// A matrix [N, K] as the decoder reads it: row ranges (parts) one after another, each dense in the
// activation type or in a GGUF block format (merged projections whose parts a file stores in different
// formats, as Q4_K_M files do). The tensors are the model's own, not copies.
struct MatrixPart {
  int64_t type, r0, r1, row_bytes;  // rows [r0, r1) of the matrix
  const char* data;
  bool dense() const { return type == kDenseF32 || type == kDenseBF16; }
};
struct Matrix {
  std::vector<MatrixPart> parts;
  std::vector<torch::Tensor> tensors;
  int64_t N = 0, K = 0;
  bool quantized = false;  // some part is in a block format: its input is quantized first
  bool per256 = false;     // some part is in a K format: its input is also rounded with one scale per 256
};
using PartList = std::vector<std::pair<torch::Tensor, int64_t>>;  // (tensor, GGML type) per row range

template <typename T>
Matrix make_matrix(const PartList& list, int64_t K, const char* name) {
  TORCH_CHECK(!list.empty(), name, ": no parts");
  Matrix m;
  m.K = K;
  for (const auto& [t, type] : list) {
    MatrixPart p{type, m.N, m.N, 0, nullptr};
    TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.device().is_cpu(), name, ": parts must be contiguous 2-D CPU tensors");
    if (type == kDenseF32 || type == kDenseBF16) {
      const auto want = kIsFloat<T> ? torch::kFloat : torch::kBFloat16;
      TORCH_CHECK(type == (kIsFloat<T> ? kDenseF32 : kDenseBF16) && t.scalar_type() == want && t.size(1) == K, name,
                  ": a dense part must be [rows, ", K, "] in the decoder's dtype");
      p.row_bytes = K * (int64_t)sizeof(T);
    } else {
      tmq::Format f;
      TORCH_CHECK(tmq::kernel_format_of((int)type, f), name, ": quantized type ", type, " has no kernel");
      TORCH_CHECK(!tmq::is_tiled((int)type) || t.size(0) % tmq::kTileRows == 0, name, ": a tiled part has whole tiles of rows");
      TORCH_CHECK(K % f.block == 0 && t.scalar_type() == torch::kUInt8 && t.size(1) == K / f.block * f.bytes, name,
                  ": a type ", type, " part must be uint8 [rows, ", K / f.block * f.bytes, "]");
      p.row_bytes = t.size(1);
      m.quantized = true;
      m.per256 |= tmq::wants_per256(tmq::base_type((int)type)) && K % tmq::QKK == 0;
    }
    p.r1 = m.N += t.size(0);
    p.data = reinterpret_cast<const char*>(t.data_ptr());
    m.parts.push_back(p);
    m.tensors.push_back(t);
  }
  return m;
}

// Activation rows quantized to int8 in blocks of 32 (tmq::QRow), the input of the block formats' kernels;
// with per256, also with one scale per 256 values for the matrix's K-format parts (tmq::wants_per256).
// Each part so takes its input rounded as the module-by-module product (quant_product.h) rounds it.
struct QInput {
  struct Rounding {
    std::vector<int8_t> q, reordered;  // per256: the K formats' quad order (QRow::q4); else groups (QRow::qt)
    std::vector<float> d, s;
    std::vector<int16_t> sums16;
    void set(const float* x, int64_t m, int64_t M, int64_t K, bool per256) {
      const int64_t nb = K / tmq::QK;
      if (m == 0)
        q.resize(M * K), reordered.resize(M * K), d.resize(M * nb), s.resize(M * nb),
            sums16.resize(per256 ? M * K / 16 : 0);
      tmq::quantize_activation_row(x, K, q.data() + m * K, d.data() + m * nb, s.data() + m * nb, per256,
                                   per256 ? sums16.data() + m * K / 16 : nullptr);
      if (per256)
        tmq::quad_order(q.data() + m * K, K, reordered.data() + m * K);
      else
        tmq::group_order(q.data() + m * K, K, reordered.data() + m * K);
    }
  };
  Rounding r32, r256;
  std::vector<float> f;
  std::vector<tmq::QRow> rows, rows256;
  template <typename T>
  void set(const T* x, int64_t M, int64_t K, bool per256) {
    const int64_t nb = K / tmq::QK;
    rows.resize(M), rows256.resize(per256 ? M : 0);
    if constexpr (!kIsFloat<T>) f.resize(K);
    for (int64_t m = 0; m < M; ++m) {
      const float* xr;
      if constexpr (kIsFloat<T>) {
        xr = x + m * K;
      } else {
        for (int64_t k = 0; k < K; ++k) f[k] = from_bf16(x[m * K + k]);
        xr = f.data();
      }
      r32.set(xr, m, M, K, false);
      rows[m] = {r32.q.data() + m * K, r32.d.data() + m * nb, r32.s.data() + m * nb};
      rows[m].qt = r32.reordered.data() + m * K;
      if (per256) {
        r256.set(xr, m, M, K, true);
        rows256[m] = {r256.q.data() + m * K, r256.d.data() + m * nb, r256.s.data() + m * nb,
                      r256.reordered.data() + m * K, r256.sums16.data() + m * K / 16};
        rows[m].per256 = &rows256[m];
      }
    }
  }
};

// The walks ahead of a thread's weight stream: started their distance ahead, those first bytes asked
// for now. With `wrap`, the walk goes on from the stream's end to its start (the next step of a burst).
// head_rows: the thread's rows of a large output layer of short block-format rows (see kHeadRowBytes),
// which one input row also walks into L2 while in_head; none otherwise.
struct Walks {
  FarAhead far;
  NearAhead near;
  std::vector<Segment> head_rows;
  HeadAhead head;
  bool in_head = false;
  Walks(const std::vector<Segment>& stream, int64_t B, bool wrap, std::vector<Segment> head_share = {})
      : far(stream.data(), stream.size(), wrap), near(stream.data(), stream.size(), wrap),
        head_rows(B == 1 ? std::move(head_share) : std::vector<Segment>()),
        head(head_rows.data(), head_rows.size(), true) {
    if (B == 1) {
      near.advance(kPrefetchRowBytes, true);
      head.advance(kPrefetchL2Bytes, true);
    } else {
      far.advance(kPrefetchL2Bytes, true);
      near.advance(kPrefetchL1Bytes, true);
    }
  }
  Walks(const Walks&) = delete;  // (head walks head_rows)
  // The stream moves on by `bytes` (read by M input rows: one row walks `near` only, as the dense GEMV
  // does, and in an output layer of short rows `head` too).
  void read(int64_t bytes, int64_t M) {
    if (M > 1) far.bytes(bytes);
    else if (in_head) head.bytes(bytes);
    near.bytes(bytes);
  }
};

// Rows [n0, n1) of y [M, N] = x W^T (+ bias) for a block-format part: each weight row once, against up to
// kRowGroup quantized input rows at a time; two weight rows at a time where the format pairs them
// (tmq::pairs_rows: their products share the inputs' loads, and are those of each row alone).
template <typename T>
void quant_rows(const MatrixPart& p, const tmq::QRow* xq, int64_t M, int64_t K, int64_t n0, int64_t n1, const T* bias,
                T* y, int64_t N, bool accumulate, Walks& walks) {
  constexpr int G = tmq::kRowGroup;
  float out[2 * G];
  const uint8_t* w = reinterpret_cast<const uint8_t*>(p.data);
  if (tmq::is_tiled((int)p.type)) {  // tiles of 16 rows (quant_tiles.h)
    tmq::tiled_rows((int)p.type, w, p.row_bytes, xq, M, K, n0, n1,
                    [&](int64_t m, int64_t n, float v) { put(y + m * N + n, v, bias, n, accumulate); },
                    [&](int64_t bytes) { walks.read(bytes, M); });
    return;
  }
  int64_t n = n0;
  if (tmq::pairs_rows((int)p.type)) {
    for (; n + 1 < n1; n += 2) {
      walks.read(2 * p.row_bytes, M);
      for (int64_t m0 = 0; m0 < M; m0 += G) {
        const int g = (int)std::min<int64_t>(G, M - m0);
        tmq::dot_rows2((int)p.type, w + n * p.row_bytes, w + (n + 1) * p.row_bytes, xq + m0, g, K, out);
        for (int r = 0; r < g; ++r) {
          put(y + (m0 + r) * N + n, out[r], bias, n, accumulate);
          put(y + (m0 + r) * N + n + 1, out[G + r], bias, n + 1, accumulate);
        }
      }
    }
  }
  for (; n < n1; ++n) {
    walks.read(p.row_bytes, M);
    for (int64_t m0 = 0; m0 < M; m0 += G) {
      const int g = (int)std::min<int64_t>(G, M - m0);
      tmq::dot_rows((int)p.type, w + n * p.row_bytes, xq + m0, g, K, out);
      for (int r = 0; r < g; ++r) put(y + (m0 + r) * N + n, out[r], bias, n, accumulate);
    }
  }
}

// Rows [n0, n1) of y [M, N] = x [M, K] W^T (+ bias), M <= kMaxTeamRows, on one thread whose weight stream
// `walks` follows; xq: x's M rows quantized, where W has block-format parts.
template <typename T>
void matrix_rows(const Matrix& W, const T* x, const tmq::QRow* xq, int64_t M, int64_t n0, int64_t n1, const T* bias,
                 T* y, bool accumulate, Walks& walks) {
  for (const MatrixPart& p : W.parts) {
    const int64_t a = std::max(n0, p.r0), b = std::min(n1, p.r1);
    if (a >= b) continue;
    const T* pb = bias ? bias + p.r0 : nullptr;
    if (p.dense())
      gemv_rows(x, M, reinterpret_cast<const T*>(p.data), W.K, W.N, a - p.r0, b - p.r0, pb, y + p.r0, accumulate,
                walks.far, walks.near);
    else
      quant_rows(p, xq, M, W.K, a - p.r0, b - p.r0, pb, y + p.r0, W.N, accumulate, walks);
  }
}
template <typename T>
void matrix_rows(const Matrix& W, const T* x, const QInput& xq, int64_t M, int64_t n0, int64_t n1, const T* bias,
                 T* y, bool accumulate, Walks& walks) {
  matrix_rows(W, x, xq.rows.data(), M, n0, n1, bias, y, accumulate, walks);
}

// The bytes of rows [n0, n1) of W, part by part, in the order matrix_rows reads them.
void matrix_segments(const Matrix& W, int64_t n0, int64_t n1, std::vector<Segment>& out) {
  for (const MatrixPart& p : W.parts) {
    const int64_t a = std::max(n0, p.r0), b = std::min(n1, p.r1);
    if (a < b) out.push_back({p.data + (a - p.r0) * p.row_bytes, p.data + (b - p.r0) * p.row_bytes});
  }
}

// y [M, N] = x [M, K] W^T (+ bias) for any M, over all threads: dense parts through torch's GEMM, block
// formats through tmq::block_product (quant_product.h).
template <typename T>
torch::Tensor matrix_product(const Matrix& W, const torch::Tensor& x, const c10::optional<torch::Tensor>& bias) {
  if (W.parts.size() == 1 && W.parts[0].dense()) return tmq::gemm_linear(x, W.tensors[0], bias);
  auto y = torch::empty({x.size(0), W.N}, x.options());
  const torch::Tensor xc = x.contiguous();
  for (size_t i = 0; i < W.parts.size(); ++i) {
    const MatrixPart& p = W.parts[i];
    auto cols = y.narrow(1, p.r0, p.r1 - p.r0);
    if (p.dense())
      cols.copy_(tmq::gemm_linear(x, W.tensors[i]));
    else
      tmq::block_product((int)p.type, reinterpret_cast<const uint8_t*>(p.data), p.row_bytes, p.r1 - p.r0, xc, cols);
  }
  if (bias) y.add_(*bias);
  return y;
}

// Row `id` of W (the embedding) into y [K] in the activation type.
template <typename T>
void matrix_row(const Matrix& W, int64_t id, T* y) {
  for (const MatrixPart& p : W.parts) {
    if (id < p.r0 || id >= p.r1) continue;
    const char* row = p.data + (id - p.r0) * p.row_bytes;
    if (p.dense()) {
      std::memcpy(y, row, W.K * sizeof(T));
    } else {
      std::vector<float> f(W.K);
      std::vector<uint8_t> buf;
      tmq::dequantize_row(tmq::base_type((int)p.type),
                          tmq::row_layout((int)p.type, reinterpret_cast<const uint8_t*>(p.data), p.row_bytes, id - p.r0,
                                          W.K, buf),
                          f.data(), W.K);
      for (int64_t k = 0; k < W.K; ++k) y[k] = from_float<T>(f[k]);
    }
    return;
  }
}

// ---------------------------------------------------------------------------------- tensor parallel

// A tensor-parallel group of ranks on this host: its shared buffer, kept mapped while anyone holds the
// group, and the ShmGroup working in it (shm_group.h).
struct TPGroup {
  torch::Tensor buffer;
  tp::ShmGroup group;
  TPGroup(torch::Tensor buf, int64_t rank, int64_t world, int64_t capacity, int64_t msg_capacity)
      : buffer(checked(buf, rank, world, capacity, msg_capacity)),
        group(buf.data_ptr<uint8_t>(), rank, world, capacity, msg_capacity) {}
  static torch::Tensor checked(const torch::Tensor& buf, int64_t rank, int64_t world, int64_t capacity,
                               int64_t msg_capacity) {
    TORCH_CHECK(rank >= 0 && rank < world, "rank must be in [0, world)");
    TORCH_CHECK(world >= 1 && capacity >= 64 && msg_capacity >= 0, "world, capacity or message capacity out of range");
    TORCH_CHECK(buf.scalar_type() == torch::kByte && buf.is_contiguous() &&
                buf.numel() >= tp::ShmGroup::bytes(world, capacity, msg_capacity) &&
                reinterpret_cast<uintptr_t>(buf.data_ptr()) % 64 == 0,
                "buffer: contiguous uint8, 64-byte aligned, of ShmGroup.bytes(world, capacity, msg_capacity) bytes");
    return buf;
  }
  template <typename T>
  void all_reduce(T* x, int64_t n) {
    group.all_reduce(x, n, [](T v) { return to_float(v); }, [](float v) { return from_float<T>(v); });
  }
  void check() const {
    TORCH_CHECK(!group.broken(), "a tensor-parallel rank has stopped (died, or the group was closed): this rank's "
                "results are void");
  }
};

// ---------------------------------------------------------------------------------- fused decoder

// A layer's mixture of experts, in place of its dense MLP (model/moe.py): each token's top_k experts by the
// router's softmax, their outputs weighted and summed, and Qwen2-MoE's shared expert on every token, gated
// by sigmoid(x . shared_gate).
struct MoEWeights {
  Matrix router;                      // [experts, hidden]
  std::vector<Matrix> gate_up, down;  // per expert: [2I, hidden] (its gate rows, then its up rows), [hidden, I]
  int64_t I = 0, top_k = 0;
  bool renormalize = false;       // the top k weights rescaled to sum to 1
  bool weights_in_float = false;  // the weights scale the experts' outputs in float32, else rounded to T first
  bool softmax_after_topk = false;  // gpt-oss: the top k logits, then a softmax over those k alone
  // gpt-oss's biases (undefined where none): the router's [experts], the experts' [experts, 2I] and
  // [experts, hidden], in the activations' type.
  torch::Tensor router_bias, gate_up_bias, down_bias;
  Matrix shared_gate_up, shared_down, shared_gate;  // shared_gate.N == 0: no shared expert
  int64_t shared_I = 0;
  bool quantized_input = false;  // a matrix that reads the normed input is in a block format
  bool per256_input = false;     // and one of those wants one input scale per 256 (Matrix::per256)
  int64_t experts() const { return (int64_t)gate_up.size(); }
  bool shared() const { return shared_gate.N > 0; }
};

// A step's routing: its tokens' (expert, weight) pairs grouped by expert, tokens in order within an expert,
// as moe.py's Experts.forward orders them (its products, and its sum over a token's experts, go in this order).
struct Routing {
  std::vector<int64_t> start;  // [experts + 1]: expert e's pairs are [start[e], start[e + 1])
  std::vector<int64_t> token;  // [pairs] the pair's token
  std::vector<float> weight;   // [pairs] its weight, rounded as the eager model rounds it
  std::vector<int64_t> of_token;  // [tokens, top_k] each token's pairs, in pair order
  std::vector<float> probs;
  std::vector<int64_t> chosen, order;
  std::vector<uint8_t> taken;
  int64_t pairs() const { return (int64_t)token.size(); }

  // logits [B, experts] (the router's output, in T): a float32 softmax over each row, its top k (the first
  // index of equal values first), renormalised where asked; or (softmax_after_topk) the top k logits, then
  // a float32 softmax over them.
  template <typename T>
  void route(const MoEWeights& M, const T* logits, int64_t B) {
    const int64_t E = M.experts(), k = M.top_k;
    probs.resize(E), chosen.resize(B * k), start.assign(E + 1, 0);
    std::vector<float> picked(B * k);
    for (int64_t b = 0; b < B; ++b) {
      float top = -INFINITY, sum = 0.f;
      if (M.softmax_after_topk) {  // choose by the logits; picked then holds exp(logit - top) until normalised
        for (int64_t e = 0; e < E; ++e) probs[e] = to_float(logits[b * E + e]);
      } else {
        for (int64_t e = 0; e < E; ++e) top = std::max(top, to_float(logits[b * E + e]));
        for (int64_t e = 0; e < E; ++e) sum += probs[e] = std::exp(to_float(logits[b * E + e]) - top);
        for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
      }
      float total = 0.f;
      taken.assign(E, 0);
      for (int64_t j = 0; j < k; ++j) {
        int64_t best = 0;
        while (taken[best]) ++best;
        for (int64_t e = best + 1; e < E; ++e)
          if (!taken[e] && probs[e] > probs[best]) best = e;  // NaN never wins: the first untaken then
        chosen[b * k + j] = best;
        taken[best] = 1;
        total += picked[b * k + j] = probs[best];
      }
      if (M.softmax_after_topk) {  // the first pick is the largest logit
        total = 0.f;
        for (int64_t j = 0; j < k; ++j)
          total += picked[b * k + j] = std::exp(probs[chosen[b * k + j]] - probs[chosen[b * k]]);
        for (int64_t j = 0; j < k; ++j) picked[b * k + j] /= total;
      }
      for (int64_t j = 0; j < k; ++j) {
        float w = M.renormalize && !M.softmax_after_topk ? picked[b * k + j] / total : picked[b * k + j];
        picked[b * k + j] = M.weights_in_float ? w : rounded<T>(w);
      }
      for (int64_t j = 0; j < k; ++j) ++start[chosen[b * k + j] + 1];
    }
    for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
    token.resize(B * k), weight.resize(B * k), of_token.resize(B * k);
    order.assign(start.begin(), start.end() - 1);  // the next free pair of each expert
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < k; ++j) {
        const int64_t p = order[chosen[b * k + j]]++;
        token[p] = b, weight[p] = picked[b * k + j];
      }
    std::vector<int64_t> filled(B, 0);
    for (int64_t p = 0; p < B * k; ++p) of_token[token[p] * k + filled[token[p]]++] = p;
  }
};

// Columns [c0, c1) of token b's mixture-of-experts output, added to its residual row x: the sum over its
// pairs (in pair order) of weight * the expert's output (out [pairs, hidden]), plus the shared expert's
// output (shared [B, hidden]) times sigmoid(its gate g[b]), rounded where the eager model rounds (each
// weighted output, each partial sum, the gate, its product, the residual add).
// add=false: x := the experts' sum alone (a tensor-parallel shard's part, summed over the group before it joins
// the residual).
template <typename T>
void add_experts(const MoEWeights& M, const Routing& r, const T* out, const T* shared, const T* g, int64_t b,
                 int64_t hidden, int64_t c0, int64_t c1, T* x, bool add = true) {
  const int64_t k = M.top_k;
  const float gate = M.shared() ? rounded<T>(1.f / (1.f + std::exp(-to_float(g[b])))) : 0.f;
  for (int64_t c = c0; c < c1; ++c) {
    float acc = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = r.of_token[b * k + j];
      const float v = rounded<T>(to_float(out[p * hidden + c]) * r.weight[p]);
      acc = j == 0 ? v : rounded<T>(acc + v);
    }
    if (M.shared()) acc = rounded<T>(acc + rounded<T>(gate * to_float(shared[b * hidden + c])));
    x[b * hidden + c] = from_float<T>(add ? to_float(x[b * hidden + c]) + acc : acc);
  }
}

// One decoder layer's weights, its slice of the KV cache, its attention window and its rotary table.
template <typename T>
struct LayerWeights {
  torch::Tensor input_norm, post_norm, k_cache, v_cache;  // post_norm: the norm of the MLP's input
  Matrix qkv, o, gate_up, down;
  c10::optional<torch::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias, q_norm, k_norm;
  int64_t window;  // the last `window` tokens; 0: all of them
  torch::Tensor k_scale, v_scale;  // [slots, KV heads] bfloat16 where the cache holds 8-bit codes
  KVCode code;
  // Gemma's sandwich norms: of the attention output and of the MLP output, before each joins the residual.
  c10::optional<torch::Tensor> attn_out_norm, ffn_out_norm;
  int64_t rope;  // the index of the layer's rotary table
  std::shared_ptr<MoEWeights> moe = nullptr;  // a mixture of experts in place of gate_up and down
  torch::Tensor sinks;  // gpt-oss: a float32 logit per query head in each softmax's denominator (or undefined)

  const float* sink_data() const { return sinks.defined() ? sinks.data_ptr<float>() : nullptr; }

  KVLayer kv() const {
    auto scales = [](const torch::Tensor& t) {
      return t.defined() ? reinterpret_cast<const uint16_t*>(t.data_ptr()) : nullptr;
    };
    return {{k_cache.data_ptr(), scales(k_scale)}, {v_cache.data_ptr(), scales(v_scale)}, code};
  }
};

// The format of a layer's cache tensors: the activations' type `plain` with no scales, or 8-bit codes
// (int8 or float8_e4m3fn) [slots, KV heads, head_dim] with bfloat16 scales [slots, KV heads].
KVCode kv_code(const torch::Tensor& k, const torch::Tensor& v, const c10::optional<torch::Tensor>& k_scale,
               const c10::optional<torch::Tensor>& v_scale, torch::ScalarType plain) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.is_contiguous() && v.is_contiguous() &&
              v.scalar_type() == k.scalar_type(), "k_cache, v_cache: contiguous [slots, KV heads, head_dim], one dtype");
  const bool scaled = k_scale && k_scale->defined();
  TORCH_CHECK(scaled == (v_scale && v_scale->defined()), "k_scale and v_scale go together");
  if (k.scalar_type() == plain) {
    TORCH_CHECK(!scaled, "a cache in the activations' dtype takes no scales");
    return KVCode::kPlain;
  }
  TORCH_CHECK(k.scalar_type() == torch::kChar || k.scalar_type() == torch::kFloat8_e4m3fn,
              "the KV cache holds the activations' dtype, int8 or float8_e4m3fn codes");
  TORCH_CHECK(scaled, "an 8-bit KV cache needs its scales");
  for (const auto* s : {&*k_scale, &*v_scale})
    TORCH_CHECK(s->scalar_type() == torch::kBFloat16 && s->is_contiguous() && s->dim() == 2 &&
                s->size(0) == k.size(0) && s->size(1) == k.size(1), "KV scales: contiguous bfloat16 [slots, KV heads]");
  return k.scalar_type() == torch::kChar ? KVCode::kInt8 : KVCode::kFp8;
}

// Refuses block tables that would take attention outside the cache: each request's context, `grow`
// tokens longer than seq_lens says (the last step of a burst), must be covered by its row of the table,
// and the blocks it covers must lie among the cache's `blocks`. The kernels index the cache by these
// numbers unchecked, so a bookkeeping error elsewhere would otherwise read or write foreign memory.
void check_block_tables(const int64_t* bt, const int64_t* lens, int64_t B, int64_t nb, int64_t bs, int64_t blocks,
                        int64_t grow) {
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens[b], last = len + grow;
    TORCH_CHECK(len >= 1, "request ", b, ": sequence length ", len, " is below 1");
    TORCH_CHECK(last <= nb * bs, "request ", b, ": sequence length ", last, " is not covered by its block table (",
                nb, " blocks of ", bs, " tokens)");
    for (int64_t j = 0; j < (last + bs - 1) / bs; ++j) {
      const int64_t id = bt[b * nb + j];
      TORCH_CHECK(id >= 0 && id < blocks, "request ", b, ": block id ", id, " at block table column ", j,
                  " is outside the KV cache (", blocks, " blocks)");
    }
  }
}

inline int64_t* longs(const torch::Tensor& t) { return t.data_ptr<int64_t>(); }
inline float* floats(const torch::Tensor& t) { return t.data_ptr<float>(); }

// The decoder for activations of type T: float (float32 models) or uint16_t (bf16 models' bits).
template <typename T>
class FusedDecoder {
  using Attn = std::conditional_t<kIsFloat<T>, float, bf16>;  // the attention kernels' name for T
  static const Attn* attn_ptr(const T* p) { return reinterpret_cast<const Attn*>(p); }
  static Attn* attn_ptr(T* p) { return reinterpret_cast<Attn*>(p); }
  static const T* data(const torch::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }
  static T* data_mut(torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }
  static const T* data(const c10::optional<torch::Tensor>& t) { return t ? data(*t) : nullptr; }

 public:
  static constexpr auto kDtype = kIsFloat<T> ? torch::kFloat : torch::kBFloat16;

  // embed, head: the token embedding [vocab, hidden] and the output layer [vocab', hidden] (the same
  // parts where they are tied), as matrix parts; cos, sin [positions, rotary_dim] float32: the rotary
  // tables (rounded to T as the eager model rounds them), table 0 of those add_rope adds (for layers that
  // differ in rope; add_layer's `rope`); the first rotary_dim (even, at most head_dim) dims of each head rotate. The rest is the architecture's description (model/description.py):
  // norms scale by (norm_offset + w); the MLP's activation (Activation); embeddings are multiplied by
  // embed_scale (already in T's precision); attention and output logits are soft-capped where their cap > 0.
  FusedDecoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps,
               double scale, int64_t block_size, torch::Tensor final_norm, const PartList& embed,
               const PartList& head, torch::Tensor cos, torch::Tensor sin, double norm_offset, int64_t activation,
               double embed_scale, double attn_softcap, double final_softcap, bool norm_in_float, double glu_alpha,
               double glu_limit)
      : H_(num_heads), KVH_(num_kv_heads), D_(head_dim), I_(intermediate), eps_((float)eps),
        scale_((float)scale), bs_(block_size), final_norm_(final_norm.contiguous()),
        norm_offset_((float)norm_offset), norm_in_float_(norm_in_float),
        act_{static_cast<Activation>(activation), (float)glu_alpha, (float)glu_limit}, embed_scale_((float)embed_scale),
        attn_softcap_((float)attn_softcap), final_softcap_((float)final_softcap) {
    TORCH_CHECK(activation >= 0 && activation <= 2, "activation: 0 (silu), 1 (gelu_tanh) or 2 (clamped_swiglu)");
    TORCH_CHECK(activation != 2 || glu_limit > 0, "the clamped SwiGLU needs a positive limit");
    TORCH_CHECK(attn_softcap >= 0 && final_softcap >= 0, "softcaps: 0 (none) or positive");
    TORCH_CHECK(head_dim_ok(D_), kHeadDims);
    TORCH_CHECK(H_ % KVH_ == 0, "heads must be a multiple of KV heads");
    TORCH_CHECK(bs_ >= 1, "block_size must be at least 1");
    R_ = cos.dim() == 2 ? cos.size(1) : 0;
    TORCH_CHECK(R_ > 0 && R_ <= D_ && R_ % 2 == 0, "cos, sin: [positions, rotary_dim], rotary_dim even and at most head_dim");
    TORCH_CHECK(final_norm_.dim() == 1 && final_norm_.scalar_type() == kDtype, "final_norm: [hidden] in the decoder's dtype");
    hidden_ = final_norm_.size(0);
    embed_ = make_matrix<T>(embed, hidden_, "embed");
    head_ = make_matrix<T>(head, hidden_, "head");
    TORCH_CHECK(head_.N <= embed_.N, "the output layer has more rows than the embedding");
    add_rope(cos, sin);
  }

  // Adds a rotary table (cos, sin: float32 [positions, rotary_dim], as many positions as table 0); returns
  // its index, for add_layer's `rope`.
  int64_t add_rope(torch::Tensor cos, torch::Tensor sin) {
    cos = cos.contiguous(), sin = sin.contiguous();
    TORCH_CHECK(cos.scalar_type() == torch::kFloat && cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(1) == R_,
                "cos, sin: float32 [positions, rotary_dim]");
    TORCH_CHECK(cos_.empty() || cos.size(0) == positions(), "every rotary table covers the same positions");
    cos_.push_back(cos);
    sin_.push_back(sin);
    return (int64_t)cos_.size() - 1;
  }

  void add_layer(torch::Tensor input_norm, const PartList& qkv, c10::optional<torch::Tensor> qkv_bias,
                 c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm, const PartList& o,
                 c10::optional<torch::Tensor> o_bias, torch::Tensor post_norm, const PartList& gate_up,
                 c10::optional<torch::Tensor> gate_up_bias, const PartList& down,
                 c10::optional<torch::Tensor> down_bias, torch::Tensor k_cache, torch::Tensor v_cache,
                 int64_t window, c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale,
                 c10::optional<torch::Tensor> attn_out_norm, c10::optional<torch::Tensor> ffn_out_norm, int64_t rope,
                 c10::optional<torch::Tensor> sinks) {
    const int64_t QS = H_ * D_, QKV = QS + 2 * KVH_ * D_;
    for (const auto* t : {&input_norm, &post_norm})
      TORCH_CHECK(t->scalar_type() == kDtype && t->is_contiguous(), "norms: contiguous, in the decoder's dtype");
    const KVCode code = kv_code(k_cache, v_cache, k_scale, v_scale, kDtype);
    for (const auto* t : {&qkv_bias, &o_bias, &gate_up_bias, &down_bias, &q_norm, &k_norm, &attn_out_norm, &ffn_out_norm})
      TORCH_CHECK(!*t || !(*t)->defined() || (*t)->scalar_type() == kDtype, "biases and norms: the decoder's dtype");
    TORCH_CHECK(opt(attn_out_norm).has_value() == opt(ffn_out_norm).has_value(),
                "attn_out_norm and ffn_out_norm go together");
    TORCH_CHECK(rope >= 0 && rope < (int64_t)cos_.size(), "rope: the index of one of the ", cos_.size(), " rotary tables");
    TORCH_CHECK(gate_up.empty() == down.empty(), "gate_up and down: both given, or both empty (set_experts follows)");
    const bool sparse = gate_up.empty();
    LayerWeights<T> L{input_norm, post_norm, k_cache, v_cache, make_matrix<T>(qkv, hidden_, "qkv"),
                      make_matrix<T>(o, QS, "o"), sparse ? Matrix() : make_matrix<T>(gate_up, hidden_, "gate_up"),
                      sparse ? Matrix() : make_matrix<T>(down, I_, "down"), opt(qkv_bias), opt(o_bias), opt(gate_up_bias),
                      opt(down_bias), opt(q_norm), opt(k_norm), window,
                      code == KVCode::kPlain ? torch::Tensor() : *k_scale,
                      code == KVCode::kPlain ? torch::Tensor() : *v_scale, code, opt(attn_out_norm),
                      opt(ffn_out_norm), rope};
    TORCH_CHECK(L.qkv.N == QKV && k_cache.size(1) == KVH_ && k_cache.size(2) == D_,
                "layer shapes do not match the decoder's heads");
    TORCH_CHECK(L.o.N == hidden_ && (sparse || (L.gate_up.N == 2 * I_ && L.down.N == hidden_)),
                "layer shapes do not match the decoder's sizes");
    TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
    if (opt(sinks)) {
      L.sinks = sinks->to(torch::kFloat).contiguous();
      TORCH_CHECK(L.sinks.dim() == 1 && L.sinks.size(0) == H_, "sinks: one value per query head");
    }
    cache_slots_ = layers_.empty() ? k_cache.size(0) : std::min(cache_slots_, k_cache.size(0));
    layers_.push_back(std::move(L));
    streams_.clear();
  }

  // The last layer's feed-forward as a mixture of experts (that layer added with empty gate_up and down):
  // router [experts, hidden]; per expert its gate_up [2I, hidden] (gate rows, then up rows) and down
  // [hidden, I]; each token's top_k experts by the router's softmax, renormalised where asked, the weights
  // applied in float32 or rounded to the activations' type first; and optionally a shared expert (its
  // gate_up [2 shared_I, hidden], down [hidden, shared_I], and gate [1, hidden]; all three or none).
  void set_experts(const PartList& router, const std::vector<PartList>& gate_up, const std::vector<PartList>& down,
                   int64_t intermediate, int64_t top_k, bool renormalize, bool weights_in_float,
                   const PartList& shared_gate_up, const PartList& shared_down, const PartList& shared_gate,
                   int64_t shared_intermediate, bool softmax_after_topk, c10::optional<torch::Tensor> router_bias,
                   c10::optional<torch::Tensor> gate_up_bias, c10::optional<torch::Tensor> down_bias) {
    TORCH_CHECK(!layers_.empty() && layers_.back().gate_up.N == 0 && !layers_.back().moe,
                "set_experts follows an add_layer given no gate_up and down");
    LayerWeights<T>& L = layers_.back();
    TORCH_CHECK(!L.ffn_out_norm, "experts after sandwich norms are not supported");
    const int64_t E = (int64_t)gate_up.size();
    TORCH_CHECK(E >= 1 && (int64_t)down.size() == E, "gate_up and down: one part list per expert");
    TORCH_CHECK(top_k >= 1 && top_k <= E, "top_k must be in [1, experts]");
    TORCH_CHECK(intermediate > 0 && intermediate % 32 == 0, "the experts' intermediate size must be a multiple of 32");
    auto moe = std::make_shared<MoEWeights>();
    moe->router = make_matrix<T>(router, hidden_, "router");
    TORCH_CHECK(moe->router.N == E, "router: one row per expert");
    for (int64_t e = 0; e < E; ++e) {
      moe->gate_up.push_back(make_matrix<T>(gate_up[e], hidden_, "expert gate_up"));
      moe->down.push_back(make_matrix<T>(down[e], intermediate, "expert down"));
      TORCH_CHECK(moe->gate_up[e].N == 2 * intermediate && moe->down[e].N == hidden_, "expert ", e, ": shapes do not "
                  "match [2 * intermediate, hidden] and [hidden, intermediate]");
    }
    moe->I = intermediate, moe->top_k = top_k, moe->renormalize = renormalize;
    moe->weights_in_float = weights_in_float, moe->softmax_after_topk = softmax_after_topk;
    auto bias = [&](const c10::optional<torch::Tensor>& t, std::vector<int64_t> shape, const char* what) {
      if (!opt(t)) return torch::Tensor();
      TORCH_CHECK(t->scalar_type() == kDtype && t->sizes() == c10::IntArrayRef(shape), what,
                  ": the expected shape, in the decoder's dtype");
      return t->contiguous();
    };
    moe->router_bias = bias(router_bias, {E}, "router_bias");
    moe->gate_up_bias = bias(gate_up_bias, {E, 2 * intermediate}, "gate_up_bias");
    moe->down_bias = bias(down_bias, {E, hidden_}, "down_bias");
    TORCH_CHECK(moe->gate_up_bias.defined() == moe->down_bias.defined(), "gate_up_bias and down_bias go together");
    TORCH_CHECK(shared_gate_up.empty() == shared_down.empty() && shared_down.empty() == shared_gate.empty(),
                "shared_gate_up, shared_down and shared_gate: all three, or none");
    if (!shared_gate.empty()) {
      TORCH_CHECK(shared_intermediate > 0 && shared_intermediate % 32 == 0,
                  "the shared expert's intermediate size must be a multiple of 32");
      moe->shared_gate_up = make_matrix<T>(shared_gate_up, hidden_, "shared_gate_up");
      moe->shared_down = make_matrix<T>(shared_down, shared_intermediate, "shared_down");
      moe->shared_gate = make_matrix<T>(shared_gate, hidden_, "shared_gate");
      TORCH_CHECK(moe->shared_gate_up.N == 2 * shared_intermediate && moe->shared_down.N == hidden_ &&
                  moe->shared_gate.N == 1, "shared expert: shapes do not match");
      moe->shared_I = shared_intermediate;
    }
    moe->quantized_input = moe->router.quantized || moe->shared_gate.quantized || moe->shared_gate_up.quantized ||
                           std::any_of(moe->gate_up.begin(), moe->gate_up.end(), [](const Matrix& m) { return m.quantized; });
    moe->per256_input = moe->router.per256 || moe->shared_gate.per256 || moe->shared_gate_up.per256 ||
                        std::any_of(moe->gate_up.begin(), moe->gate_up.end(), [](const Matrix& m) { return m.per256; });
    L.moe = std::move(moe);
    streams_.clear();
  }

  // input_ids, positions [B]: each request's new token and its position; slots [B] the cache slot of
  // each new token; block_tables [B, nb]; seq_lens [B] context lengths including the new token.
  // Returns the final-normed hidden states [B, hidden].
  torch::Tensor forward(torch::Tensor input_ids, torch::Tensor positions, torch::Tensor slots,
                        torch::Tensor block_tables, torch::Tensor seq_lens) {
    StepInputs in = prepare(input_ids, positions, slots, block_tables, seq_lens);
    const Step& s = in.step;
    auto out = torch::empty_like(in.x);
    if (runs_in_team(s.B)) {
      const int threads = team_threads();
      TeamBuffers buf(*this, s.B, threads);
      StepPlans plan = attention_plan(s);
      team(threads, [&](int w, int n, SpinBarrier& barrier) {
        Walks walks(streams_[n][w], s.B, false);
        ThreadState ts(D_);
        const T* x = team_layers(s, plan, buf, data_mut(in.x), w, n, barrier, walks, ts);
        for (int64_t b = w; b < s.B; b += n)
          rms_norm_rows(x + b * hidden_, data(final_norm_), data_mut(out) + b * hidden_, 1, hidden_, eps_,
                        norm_offset_);
      });
    } else {
      forward_batched(s, in.x, out);
    }
    if (group_) group_->check();
    return out;
  }

  // After each step of a burst: called with the step's index and its tokens [B]; returns true to end the
  // burst there. It must not throw (the decoder's team would wait at a barrier for ever).
  using StepHook = std::function<bool(int64_t step, const int64_t* tokens, int64_t B)>;

  // Greedy decoding, up to `steps` steps in one call (slots [steps, B]: the cache slot of each step's new
  // token). Each step runs forward and takes, for every request, the largest of its logits (as logits()
  // computes them for the sampler) as its next input. The call ends early after a step in which every
  // request has produced one of its stop_ids, once interrupt() has been called (from any thread; the
  // step running completes), or once after_step asks it to. Returns the tokens [steps done, B].
  torch::Tensor decode_greedy(torch::Tensor input_ids, torch::Tensor positions, torch::Tensor slots,
                              torch::Tensor block_tables, torch::Tensor seq_lens,
                              std::vector<std::vector<int64_t>> stop_ids, const StepHook& after_step = nullptr) {
    return decode_steps(input_ids, positions, slots, block_tables, seq_lens, std::move(stop_ids), nullptr,
                        after_step);
  }

  // decode_greedy, with request b's token of step j drawn from the step's logits as sample_rows draws it
  // from the rows logits() gives: temperature[b], top_k[b], top_p[b], min_p[b] and the uniform number
  // u[j, b]; at temperature 0, or where no logit is finite, the largest logit. Not in a tensor-parallel
  // group (a draw needs the whole row).
  torch::Tensor decode_sampled(torch::Tensor input_ids, torch::Tensor positions, torch::Tensor slots,
                               torch::Tensor block_tables, torch::Tensor seq_lens,
                               std::vector<std::vector<int64_t>> stop_ids, torch::Tensor temperature,
                               torch::Tensor top_k, torch::Tensor top_p, torch::Tensor min_p, torch::Tensor u,
                               const StepHook& after_step = nullptr) {
    TORCH_CHECK(!group_, "decode_sampled draws from whole rows: not in a tensor-parallel group");
    const int64_t B = input_ids.size(0);
    auto t = temperature.to(torch::kFloat).contiguous(), k = top_k.to(torch::kLong).contiguous();
    auto p = top_p.to(torch::kFloat).contiguous(), mp = min_p.to(torch::kFloat).contiguous();
    auto uu = u.to(torch::kDouble).contiguous();
    TORCH_CHECK(t.numel() == B && k.numel() == B && p.numel() == B && mp.numel() == B,
                "temperature, top_k, top_p, min_p: one per request");
    TORCH_CHECK(uu.dim() == 2 && uu.size(0) == slots.size(0) && uu.size(1) == B, "u: [steps, batch]");
    const Draws draws{t.data_ptr<float>(), p.data_ptr<float>(), mp.data_ptr<float>(), k.data_ptr<int64_t>(),
                      uu.data_ptr<double>()};
    return decode_steps(input_ids, positions, slots, block_tables, seq_lens, std::move(stop_ids), &draws,
                        after_step);
  }

  // forward, then the output layer: logits [B, vocab] = hidden x head^T (as a separate linear layer
  // computes them), for a few requests in one parallel region, each thread's weight stream running on
  // from its rows of the layers into its share of the head's rows.
  torch::Tensor logits(torch::Tensor input_ids, torch::Tensor positions, torch::Tensor slots,
                       torch::Tensor block_tables, torch::Tensor seq_lens) {
    if (!runs_in_team(input_ids.size(0))) {
      auto logits = matrix_product<T>(head_, forward(input_ids, positions, slots, block_tables, seq_lens), c10::nullopt);
      if (final_softcap_ > 0.f) softcap_rows(data_mut(logits), logits.numel(), final_softcap_);
      return whole_vocab(logits);
    }
    StepInputs in = prepare(input_ids, positions, slots, block_tables, seq_lens);
    const Step& s = in.step;
    auto out = torch::empty({s.B, head_.N}, in.x.options());
    const int threads = team_threads();
    TeamBuffers buf(*this, s.B, threads);
    StepPlans plan = attention_plan(s);
    team(threads, [&](int w, int n, SpinBarrier& barrier) {
      const auto stream = stream_with_head(w, n);
      Walks walks(stream, s.B, false, short_head_rows(w, n));
      ThreadState ts(D_);
      const T* x = team_layers(s, plan, buf, data_mut(in.x), w, n, barrier, walks, ts);
      team_logits(x, s.B, w, n, buf, data_mut(out), walks, ts);
    });
    return whole_vocab(out);
  }

  // Makes this decoder one shard of a tensor-parallel group: its matrices are the rank's slices (heads,
  // intermediate rows; the embedding and output layer rows [vocab_start, vocab_start + their rows) of a
  // vocabulary of vocab_total, cut in slices of ceil(vocab_total / world) rows), and row-parallel
  // projections (o, down) and the embedding are summed over the group.
  void set_group(std::shared_ptr<TPGroup> group, int64_t vocab_start, int64_t vocab_total) {
    const int64_t world = group->group.world(), slice = (vocab_total + world - 1) / world;
    TORCH_CHECK(vocab_total < (int64_t(1) << 24), "a sharded vocabulary has fewer than 2^24 rows");
    TORCH_CHECK(vocab_start == group->group.rank() * slice && embed_.N == std::min(slice, vocab_total - vocab_start)
                && head_.N == embed_.N, "the embedding and output layer must hold the rank's slice of ",
                slice, " rows of the vocabulary");
    group_ = std::move(group);
    vocab_start_ = vocab_start;
    vocab_total_ = vocab_total;
  }

  // Ends a running decode_greedy after its current step; clear_interrupt() before the next. (In a
  // tensor-parallel group, rank 0's call ends every rank's burst at the same step.)
  void interrupt() { interrupted_.store(true); }
  void clear_interrupt() { interrupted_.store(false); }

 private:
  std::atomic<bool> interrupted_{false};
  std::shared_ptr<TPGroup> group_;  // none: the whole model
  int64_t vocab_start_ = 0, vocab_total_ = 0;
  int64_t vocab() const { return group_ ? vocab_total_ : embed_.N; }

  // A request's greedy choice: its index in the whole vocabulary (-1: none yet) and its logit.
  struct Best {
    int64_t index;
    float value;
  };

  // Each request's greedy token over the whole vocabulary: best[b] holds this shard's choice and becomes
  // the group's (the first NaN in rank order, else the largest logit, the lowest index on ties, as
  // argmax_row does in one row). Returns rank 0's `interrupted`, so a burst ends at the same step on every
  // rank; a broken group ends it at once (with token 0; the caller's check() then fails the call).
  bool group_best(std::vector<Best>& best, bool interrupted) {
    if (!group_) return interrupted;
    const int64_t B = best.size(), world = group_->group.world(), n = 2 * B + 1;
    std::vector<float> mine(n), all(world * n);
    for (int64_t b = 0; b < B; ++b) mine[2 * b] = best[b].value, mine[2 * b + 1] = (float)best[b].index;
    mine[2 * B] = interrupted ? 1.f : 0.f;
    group_->group.all_gather(mine.data(), n, all.data());
    if (group_->group.broken()) {
      for (auto& c : best) c = {0, 0.f};
      return true;
    }
    for (int64_t b = 0; b < B; ++b) {
      Best pick{-1, 0.f};
      for (int64_t r = 0; r < world; ++r) {
        const float v = all[r * n + 2 * b];
        const int64_t i = (int64_t)all[r * n + 2 * b + 1];
        if (i < 0) continue;
        if (std::isnan(v)) {
          pick = {i, v};
          break;
        }
        if (pick.index < 0 || v > pick.value) pick = {i, v};
      }
      best[b] = pick;
    }
    return all[2 * B] != 0.f;
  }

  // The logits of the whole vocabulary [B, vocab] from this shard's [B, its rows]: every rank's slice,
  // gathered (no group: local as it is).
  torch::Tensor whole_vocab(const torch::Tensor& local) {
    if (!group_) return local;
    const int64_t B = local.size(0), world = group_->group.world(), slice = (vocab_total_ + world - 1) / world;
    auto mine = torch::zeros({B, slice}, torch::kFloat);
    mine.narrow(1, 0, local.size(1)).copy_(local);
    auto all = torch::empty({world, B, slice}, torch::kFloat);
    group_->group.all_gather(mine.data_ptr<float>(), B * slice, all.data_ptr<float>());
    group_->check();
    return all.permute({1, 0, 2}).reshape({B, world * slice}).narrow(1, 0, vocab_total_).to(kDtype);
  }

  // The inputs of one decode step, as raw views of tensors the caller keeps.
  struct Step {
    int64_t B;
    const int64_t* slot;  // [B]
    const int64_t* bt;    // [B, nb]
    int64_t nb;
    const int64_t* lens;  // [B]
    T* cos;               // [tables, B, rotary_dim], filled by begin_step
    T* sin;
  };

  // A step's inputs: the caller's tensors as contiguous int64, the residual stream x [B, hidden] started
  // from the tokens' embeddings, the rotary rows of their positions, and a Step viewing them.
  struct StepInputs {
    torch::Tensor ids, pos, slot, bt, lens, x, cos, sin;
    Step step;
  };
  StepInputs prepare(const torch::Tensor& input_ids, const torch::Tensor& positions, const torch::Tensor& slots,
                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens) const {
    StepInputs in;
    in.ids = input_ids.to(torch::kLong).contiguous();
    in.pos = positions.to(torch::kLong).contiguous();
    in.slot = slots.to(torch::kLong).contiguous();
    in.bt = block_tables.to(torch::kLong).contiguous();
    in.lens = seq_lens.to(torch::kLong).contiguous();
    const int64_t B = in.ids.size(0);
    TORCH_CHECK(in.pos.size(0) == B && in.slot.size(0) == B && in.bt.size(0) == B && in.lens.size(0) == B,
                "batch mismatch");
    TORCH_CHECK(in.bt.dim() == 2, "block_tables: [batch, blocks]");
    check_bounds(in.slot, in.bt, in.lens, 0);
    const auto opts = torch::TensorOptions().dtype(kDtype);
    in.x = torch::empty({B, hidden_}, opts);
    in.cos = torch::empty({(int64_t)cos_.size(), B, R_}, opts);
    in.sin = torch::empty({(int64_t)cos_.size(), B, R_}, opts);
    in.step = {B, longs(in.slot), longs(in.bt), in.bt.size(1),
               longs(in.lens), data_mut(in.cos), data_mut(in.sin)};
    begin_step(in.step, longs(in.ids), longs(in.pos), data_mut(in.x));
    return in;
  }

  // x = the embeddings of the step's tokens (scaled where the model scales them); the step's rotary rows
  // for their positions, from each table.
  // A shard holds the embedding rows of its slice of the vocabulary: the others are zero here and come from
  // their ranks in one sum (exact: one rank's row plus zeros).
  void begin_step(const Step& s, const int64_t* ids, const int64_t* pos, T* x) const {
    const int64_t tables = cos_.size();
    for (int64_t b = 0; b < s.B; ++b) {
      const int64_t id = ids[b], p = pos[b];
      TORCH_CHECK(id >= 0 && id < vocab(), "token id ", id, " is out of range [0, ", vocab(), ")");
      TORCH_CHECK(p >= 0 && p < positions(), "position beyond the rotary table");
      T* xb = x + b * hidden_;
      if (id >= vocab_start_ && id < vocab_start_ + embed_.N) matrix_row(embed_, id - vocab_start_, xb);
      else std::fill(xb, xb + hidden_, from_float<T>(0.f));
      for (int64_t r = 0; r < tables; ++r) {
        const float* cos_row = floats(cos_[r]) + p * R_;
        const float* sin_row = floats(sin_[r]) + p * R_;
        for (int64_t d = 0; d < R_; ++d) {
          s.cos[(r * s.B + b) * R_ + d] = from_float<T>(cos_row[d]);
          s.sin[(r * s.B + b) * R_ + d] = from_float<T>(sin_row[d]);
        }
      }
    }
    if (group_) group_->all_reduce(x, s.B * hidden_);
    if (embed_scale_ != 1.f)
      for (int64_t k = 0; k < s.B * hidden_; ++k) x[k] = from_float<T>(to_float(x[k]) * embed_scale_);
  }

  // A burst's draws (decode_sampled): request b's token of step j is RowSampler::draw of its row with
  // temperature[b], top_k[b], top_p[b], min_p[b] and u[j * B + b]; -1 where the largest logit is the
  // token (temperature 0, or no finite logit).
  struct Draws {
    const float *temperature, *top_p, *min_p;
    const int64_t* top_k;
    const double* u;
    int64_t draw(RowSampler& sampler, const T* row, int64_t V, int64_t b, int64_t B, int64_t step) const {
      if (!(temperature[b] > 0.f)) return -1;
      return sampler.draw(row, V, temperature[b], top_k[b], top_p[b], min_p[b], u[step * B + b]);
    }
  };

  // decode_greedy and decode_sampled (draws: null for greedy).
  torch::Tensor decode_steps(torch::Tensor input_ids, torch::Tensor positions, torch::Tensor slots,
                             torch::Tensor block_tables, torch::Tensor seq_lens,
                             std::vector<std::vector<int64_t>> stop_ids, const Draws* draws,
                             const StepHook& after_step) {
    const int64_t B = input_ids.size(0), steps = slots.size(0);
    TORCH_CHECK(slots.dim() == 2 && slots.size(1) == B && (int64_t)stop_ids.size() == B, "slots: [steps, batch]");
    Burst burst{input_ids.to(torch::kLong).clone(), positions.to(torch::kLong).clone(),
                seq_lens.to(torch::kLong).clone(), slots.to(torch::kLong).contiguous(),
                torch::empty({steps, B}, torch::kLong), std::move(stop_ids), std::vector<bool>(B, false)};
    TORCH_CHECK(burst.ids.size(0) == B && burst.pos.size(0) == B && burst.lens.size(0) == B &&
                block_tables.size(0) == B, "batch mismatch");
    check_bounds(burst.slots, block_tables, burst.lens, std::max<int64_t>(steps - 1, 0));
    int64_t done = 0;
    if (runs_in_team(B)) {
      done = greedy_team(burst, block_tables, steps, draws, after_step);
    } else {
      std::vector<Best> best(B);
      RowSampler sampler;
      while (done < steps) {
        auto logits = matrix_product<T>(head_, forward(burst.ids, burst.pos, burst.slots[done], block_tables,
                                                       burst.lens), c10::nullopt);
        if (final_softcap_ > 0.f) softcap_rows(data_mut(logits), logits.numel(), final_softcap_);
        const T* rows = data(logits);
        const int64_t V = logits.size(1);
        for (int64_t b = 0; b < B; ++b) {
          const int64_t i = argmax_row(rows + b * V, V);
          best[b] = {vocab_start_ + i, to_float(rows[b * V + i])};
          const int64_t drawn = draws ? draws->draw(sampler, rows + b * V, V, b, B, done) : -1;
          if (drawn >= 0) best[b].index = drawn;
        }
        const bool stop = group_best(best, interrupted_.load());
        for (int64_t b = 0; b < B; ++b) burst.take(done, b, best[b].index);
        const bool more = burst.go_on(++done, steps, stop);
        if ((after_step && after_step(done - 1, longs(burst.tokens) + (done - 1) * B, B)) || !more) break;
      }
    }
    if (group_) group_->check();
    return burst.tokens.slice(0, 0, done);
  }

  // A burst's state: each request's next input, position and context length, advanced step by step.
  struct Burst {
    torch::Tensor ids, pos, lens, slots, tokens;
    std::vector<std::vector<int64_t>> stop_ids;
    std::vector<bool> stopped;
    // Request b's token of step `step`: recorded, and its next input.
    void take(int64_t step, int64_t b, int64_t t) {
      const int64_t B = ids.size(0);
      longs(tokens)[step * B + b] = longs(ids)[b] = t;
      ++longs(pos)[b];
      ++longs(lens)[b];
      stopped[b] = stopped[b] || std::find(stop_ids[b].begin(), stop_ids[b].end(), t) != stop_ids[b].end();
    }
    // Whether another step follows `done` of `steps`.
    bool go_on(int64_t done, int64_t steps, bool interrupted) const {
      return done < steps && !interrupted && !std::all_of(stopped.begin(), stopped.end(), [](bool x) { return x; });
    }
  };

  // Whether a batch of B requests runs in one parallel region (the GEMV kernel's shapes), up to team_rows().
  bool runs_in_team(int64_t B) const {
    return B <= team_rows() && hidden_ % 32 == 0 && (H_ * D_) % 32 == 0 && I_ % 32 == 0;
  }

  // The threads a parallel region asks for, with their weight streams planned: the team, or one thread
  // while the team is known to lag (see team()).
  int team_threads() {
    int threads = (int)team_size();
    ++calls_;
    if (threads > 1 && solo_left_ > 0) --solo_left_, ++solo_calls_, threads = 1;
    plan_streams(threads);
    return threads;
  }

  // Runs body on a team of `threads` (run_team). Where one thread spent most of the region waiting at
  // barriers in kLagRun calls in a row, another process holds a team thread's core, and every one of a
  // step's 150-200 barriers waits for the scheduler to give that thread its core back. The next
  // kSoloCalls calls then run on one thread, which has no barrier to wait at and which the OS runs on
  // whichever core is free (decode is bound by memory bandwidth, so one core keeps well over half of two
  // cores' speed); after them the whole team is tried again. One lagging call alone is no sign: a
  // virtual machine's CPU paused for a few milliseconds, an interrupt, gives one now and then on a quiet
  // machine, and kSoloCalls calls on one thread would cost far more than the pause did.
  // The time thread 0 spends in the group's sums (the others wait for it at a barrier) is another rank's
  // pace, and the time it spends in a burst's after_step the caller's, not a sign that this rank's team
  // lost a core: both are taken out of the lag.
  template <typename F>
  void team(int threads, const F& body) {
    group_cycles_ = 0;
    TeamClock clock = run_team(threads, body);
    if (group_cycles_) {
      clock.cycles -= std::min(clock.cycles, group_cycles_);
      for (auto& w : clock.waited) w -= std::min(w, group_cycles_);
    }
    if (threads > 1) note_lag(clock.lag());
    last_team_ = {clock.threads, clock.barriers};
  }
  uint64_t group_cycles_ = 0;  // this region's, by thread 0 (group sums and after_step)
  std::pair<int, int64_t> last_team_{0, 0};

 public:
  int64_t team_rows() const {
    return team_rows_for(std::any_of(layers_.begin(), layers_.end(), [](const auto& L) { return (bool)L.moe; }));
  }

  // (calls, calls run on one thread for lag, calls whose team lagged, the last team's lag share)
  std::tuple<int64_t, int64_t, int64_t, double> team_stats() const { return {calls_, solo_calls_, lagged_, last_lag_}; }
  // (threads, barrier waits) of the last call that ran in a team ((0, 0) before the first)
  std::pair<int, int64_t> last_team() const { return last_team_; }
  // The next `calls` calls run on one thread, as after a lagging team; adaptive=false: a lagging team
  // does not switch (to compare the two on equal terms). The count of lagging calls in a row starts afresh.
  void run_solo(int64_t calls, bool adaptive) { solo_left_ = (int)calls, adaptive_ = adaptive, lag_run_ = 0; }
  // What a team call whose most-waiting thread waited `lag` of its time does to the calls after it.
  void note_lag(double lag) {
    last_lag_ = lag;
    if (lag <= kLagShare) {
      lag_run_ = 0;
      return;
    }
    ++lagged_;
    if (++lag_run_ >= kLagRun && adaptive_) solo_left_ = kSoloCalls, lag_run_ = 0;
  }
  int64_t solo_left() const { return solo_left_; }

 private:
  static constexpr double kLagShare = 0.5;
  static constexpr int kLagRun = 2;
  static constexpr int kSoloCalls = 64;
  int solo_left_ = 0, lag_run_ = 0;
  bool adaptive_ = true;
  int64_t calls_ = 0, solo_calls_ = 0, lagged_ = 0;
  double last_lag_ = 0.0;

  // The attention plans of a step: one per distinct window among the layers, and the one each layer uses.
  struct StepPlans {
    std::vector<AttentionPlan> plans;
    std::vector<size_t> of_layer;
    AttentionPlan& operator[](size_t layer) { return plans[of_layer[layer]]; }
  };

  // How the attention of the step's requests splits over the threads, per layer. A window that no
  // request's context exceeds selects every token, as no window does, so the two share a plan.
  // The split is made for the whole team even when fewer threads run the step (see team() and
  // plan_threads()).
  StepPlans attention_plan(const Step& s) const {
    const int64_t threads = plan_threads();
    int64_t longest = 0;
    for (int64_t b = 0; b < s.B; ++b) longest = std::max(longest, s.lens[b]);
    StepPlans p;
    std::vector<int64_t> windows;
    for (const auto& L : layers_) {
      const int64_t window = L.window < longest ? L.window : 0;
      size_t i = std::find(windows.begin(), windows.end(), window) - windows.begin();
      if (i == windows.size()) {
        windows.push_back(window);
        p.plans.emplace_back(s.bt, s.lens, s.B, H_, KVH_, D_, s.nb, bs_, scale_, window, threads, attn_softcap_);
      }
      p.of_layer.push_back(i);
    }
    return p;
  }

  // Refuses a step, or a burst whose lengths grow by `grow` tokens after its first step, whose slots
  // (every entry of `slots`) or block tables lie outside the KV cache (see check_block_tables).
  void check_bounds(const torch::Tensor& slots, const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                    int64_t grow) const {
    TORCH_CHECK(!layers_.empty(), "the decoder has no layers");
    for (const auto& L : layers_) TORCH_CHECK(L.gate_up.N || L.moe, "a layer has neither an MLP nor experts");
    const auto slot = slots.to(torch::kLong).contiguous();
    const auto bt = block_tables.to(torch::kLong).contiguous();
    const auto lens = seq_lens.to(torch::kLong).contiguous();
    const int64_t* sp = longs(slot);
    for (int64_t i = 0; i < slot.numel(); ++i)
      TORCH_CHECK(sp[i] >= 0 && sp[i] < cache_slots_, "cache slot ", sp[i], " is outside the KV cache (",
                  cache_slots_, " slots)");
    check_block_tables(longs(bt), longs(lens), lens.size(0), bt.size(1), bs_,
                       cache_slots_ / bs_, grow);
  }

  // Request b's new q, k, v (one row of the qkv projection): q/k norms where the model has them, rotary
  // on q and k, q copied out for attention, k and v written to the cache slot of the new token.
  void place_token(const LayerWeights<T>& L, const Step& s, int64_t b, T* row, T* q) {
    place_heads(L, s, b, 0, H_ + 2 * KVH_, row, q);
  }

  // place_token for heads [h0, h1) of the row alone (the row's heads: H of q, then KVH of k, then KVH of v),
  // each head on its own.
  void place_heads(const LayerWeights<T>& L, const Step& s, int64_t b, int64_t h0, int64_t h1, T* row, T* q) {
    const T* cb = s.cos + (L.rope * s.B + b) * R_;
    const T* sb = s.sin + (L.rope * s.B + b) * R_;
    const int64_t slot = s.slot[b];
    for (int64_t hd = h0; hd < h1; ++hd) {
      T* v = row + hd * D_;
      const bool is_q = hd < H_, is_k = !is_q && hd < H_ + KVH_;
      if (is_q || is_k) {
        if (L.q_norm) rms_norm_rows(v, data(is_q ? *L.q_norm : *L.k_norm), v, 1, D_, eps_, norm_offset_, norm_in_float_);
        rotate(v, cb, sb, R_);
      }
      if (is_q) {
        std::memcpy(q + b * H_ * D_ + hd * D_, v, D_ * sizeof(T));
        continue;
      }
      const int64_t kh = hd - H_ - (is_k ? 0 : KVH_);
      const torch::Tensor& cache = is_k ? L.k_cache : L.v_cache;
      const int64_t at = slot * KVH_ * D_ + kh * D_;
      if (L.code == KVCode::kPlain) {
        std::memcpy(reinterpret_cast<T*>(cache.data_ptr()) + at, v, D_ * sizeof(T));
      } else {
        uint16_t* scales = reinterpret_cast<uint16_t*>((is_k ? L.k_scale : L.v_scale).data_ptr());
        quantize_kv_rows(v, 1, D_, L.code, reinterpret_cast<uint8_t*>(cache.data_ptr()) + at, scales + slot * KVH_ + kh);
      }
    }
  }

  // The step's intermediate results, shared by the threads of a team.
  struct TeamBuffers {
    std::vector<T> qkv, q, attn, gu, act;
    std::vector<T> normed;  // each thread's own copy of the normed input
    std::vector<T> branch;  // an attention or MLP output to be normed before the residual add (sandwich norms)
    // Mixture-of-experts layers: per (token, expert) pair its gate and up rows, activation and output; the
    // shared expert's per token.
    std::vector<T> pairs_gu, pairs_act, pairs_out, shared_gu, shared_act, shared_out;
    // Per merge group of the attention plans (AttentionPlan::group_of), how many of its parts are done: the
    // thread that finishes the last one merges the group (and sets it back to 0 for the next layer).
    std::unique_ptr<std::atomic<int>[]> parts_done;
    TeamBuffers(const FusedDecoder& d, int64_t B, int threads)
        : qkv(B * (d.H_ + 2 * d.KVH_) * d.D_), q(B * d.H_ * d.D_), attn(B * d.H_ * d.D_), gu(B * 2 * d.I_),
          act(B * d.I_), normed(threads * B * d.hidden_), branch(B * d.hidden_),
          parts_done(new std::atomic<int>[B * d.KVH_]) {
      for (int64_t g = 0; g < B * d.KVH_; ++g) parts_done[g].store(0);
      int64_t pairs = 0, I = 0, shared_I = 0;
      for (const auto& L : d.layers_)
        if (L.moe) pairs = std::max(pairs, B * L.moe->top_k), I = std::max(I, L.moe->I),
                   shared_I = std::max(shared_I, L.moe->shared_I);
      if (!pairs) return;
      pairs_gu.resize(pairs * 2 * I), pairs_act.resize(pairs * I), pairs_out.resize(pairs * d.hidden_);
      shared_gu.resize(B * 2 * shared_I), shared_act.resize(B * shared_I), shared_out.resize(B * d.hidden_);
    }
  };

  // What a thread of a team keeps for itself.
  struct ThreadState {
    AttentionPlan::Scratch scratch;
    std::vector<float> merged;
    std::vector<T> resid, branch_row;  // a whole copy of the residual stream [B, hidden]; one normed branch row
    QInput xq;  // the input of the projection running, quantized, where its matrix has block-format parts
    // Mixture-of-experts layers: the step's routing (each thread its own), the router's and the shared
    // expert gate's outputs, each pair's input row (dense and quantized), the weight reads planned.
    Routing routing;
    std::vector<T> router, gate, gathered;
    std::vector<tmq::QRow> pair_rows;
    std::vector<Segment> segs;
    explicit ThreadState(int64_t D) : merged(D) {}
  };

  // Whether a team of n places the new token's heads with the qkv rows each thread computed: where the
  // heads split evenly over the threads. Else a thread's share of whole heads would be a head's rows longer
  // than another's (the default model's 15 heads on 2 threads: a step ~1% slower), and the heads are placed
  // in a phase of their own, after a barrier, one thread per request.
  bool heads_with_rows(int n) const { return (H_ + 2 * KVH_) % n == 0; }
  std::pair<int64_t, int64_t> qkv_share(int w, int n) const {
    return heads_with_rows(n) ? head_share(H_ + 2 * KVH_, D_, w, n) : share(H_ * D_ + 2 * KVH_ * D_, w, n);
  }

  // A step of a few requests runs in one parallel region. Each thread computes a fixed share of every
  // projection's rows, so its weight reads for the whole step are one stream (its slices of each matrix
  // in turn) walked ahead of it across matrix boundaries; phases that need other threads' results
  // (the whole qkv row, all heads' attention, the full residual) wait at a barrier: five a layer, six
  // where the heads do not split evenly (heads_with_rows). The small pieces between projections run on
  // every thread or with the rows they follow: each thread norms, rotates and stores the heads of the qkv
  // rows it computed (whole heads: head_share), the thread that finishes a request's last attention part
  // merges its parts, and every thread quantizes a projection's input for itself. A branch normed before
  // it joins the residual (sandwich norms, or a tensor-parallel sum) is added by every thread to a whole
  // copy of the residual of its own (ThreadState::resid), which it reads from then on; a projection that
  // adds into the residual in place writes its own columns of the shared xp. This is thread w of n's part
  // of the decoder layers, on the residual stream xp [B, hidden]; returns the final residual as this
  // thread may read it (xp, or its own copy).
  const T* team_layers(const Step& s, StepPlans& plans, TeamBuffers& buf, T* xp, int w, int n, SpinBarrier& barrier,
                       Walks& walks, ThreadState& ts) {
    const int64_t B = s.B, hidden = hidden_, QS = H_ * D_, KVS = KVH_ * D_, QKV = QS + 2 * KVS;
    const Attn* qh = attn_ptr(buf.q.data());
    Attn* attn_h = attn_ptr(buf.attn.data());
    T* h = buf.normed.data() + w * B * hidden;
    const auto [r0, r1] = qkv_share(w, n);
    const bool own_heads = heads_with_rows(n);
    const auto [o0, o1] = share(hidden, w, n);
    const auto [i0, i1] = share(I_, w, n);
    T *qkv = buf.qkv.data(), *gu = buf.gu.data(), *act = buf.act.data();
    auto input = [&](const Matrix& W, const T* x) {
      if (W.quantized) ts.xq.set(x, B, W.K, W.per256);
    };
    const T* resid = xp;  // the residual as this thread reads it: xp (whole after a barrier) or ts.resid
    // Before a projection adds into xp's own columns: those columns as this thread's copy has them.
    auto to_shared = [&] {
      if (resid == xp) return;
      for (int64_t b = 0; b < B; ++b)
        std::memcpy(xp + b * hidden + o0, resid + b * hidden + o0, (o1 - o0) * sizeof(T));
      resid = xp;
    };
    // The whole branch (after a barrier), normed by `norm` where there is one, added to the residual in
    // this thread's own copy.
    auto add_branch = [&](const c10::optional<torch::Tensor>& norm) {
      ts.resid.resize(B * hidden), ts.branch_row.resize(hidden);
      for (int64_t b = 0; b < B; ++b) {
        const T* row = buf.branch.data() + b * hidden;
        if (norm) {
          rms_norm_rows(row, data(*norm), ts.branch_row.data(), 1, hidden, eps_, norm_offset_, norm_in_float_);
          row = ts.branch_row.data();
        }
        T* out = ts.resid.data() + b * hidden;
        if (resid != ts.resid.data()) std::memcpy(out, resid + b * hidden, hidden * sizeof(T));
        add_into(out, row, hidden);
      }
      resid = ts.resid.data();
    };
    for (size_t li = 0; li < layers_.size(); ++li) {
      const LayerWeights<T>& L = layers_[li];
      AttentionPlan& plan = plans[li];
      const KVLayer kv = L.kv();
      rms_norm_rows(resid, data(L.input_norm), h, B, hidden, eps_, norm_offset_, norm_in_float_);
      input(L.qkv, h);
      matrix_rows(L.qkv, h, ts.xq, B, r0, r1, data(L.qkv_bias), qkv, false, walks);
      if (own_heads)
        for (int64_t b = 0; b < B; ++b) place_heads(L, s, b, r0 / D_, r1 / D_, qkv + b * QKV, buf.q.data());
      for (int64_t i = w; i < plan.parts; i += n) plan.prefetch_part<Attn>(i, kv);
      barrier.wait(n);
      if (!own_heads) {
        for (int64_t b = w; b < B; b += n) place_token(L, s, b, qkv + b * QKV, buf.q.data());
        barrier.wait(n);
      }
      for (int64_t i = w; i < plan.parts; i += n) {
        plan.run_part<Attn>(i, qh, kv, ts.scratch);
        const int64_t g = plan.group_of(i);
        if (buf.parts_done[g].fetch_add(1, std::memory_order_acq_rel) == plan.group_parts(g) - 1) {
          buf.parts_done[g].store(0, std::memory_order_relaxed);
          plan.merge_group<Attn>(g, attn_h, ts.merged.data(), L.sink_data());
        }
      }
      barrier.wait(n);
      input(L.o, buf.attn.data());
      if (L.attn_out_norm || group_) {  // the whole output row first (summed over the shards), then it joins the residual
        matrix_rows(L.o, buf.attn.data(), ts.xq, B, o0, o1, data(L.o_bias), buf.branch.data(), false, walks);
        barrier.wait(n);
        sum_shards(buf.branch.data(), B, w, n, barrier);
        add_branch(L.attn_out_norm);
      } else {
        to_shared();
        matrix_rows(L.o, buf.attn.data(), ts.xq, B, o0, o1, data(L.o_bias), xp, true, walks);
        barrier.wait(n);
      }
      rms_norm_rows(resid, data(L.post_norm), h, B, hidden, eps_, norm_offset_, norm_in_float_);
      if (L.moe && group_) {  // this shard's part of every expert, summed over the group, then the residual's
        team_experts(*L.moe, B, h, buf.branch.data(), w, n, barrier, buf, ts, false);
        barrier.wait(n);
        sum_shards(buf.branch.data(), B, w, n, barrier);
        add_branch(c10::nullopt);
        continue;
      }
      if (L.moe) {
        if (resid != xp) barrier.wait(n);  // every thread past add_branch's reads of xp before any writes to it
        to_shared();
        team_experts(*L.moe, B, h, xp, w, n, barrier, buf, ts);
        barrier.wait(n);
        continue;
      }
      input(L.gate_up, h);
      gated_rows(L.gate_up, h, ts.xq.rows.data(), B, I_, i0, i1, data(L.gate_up_bias), gu, act, walks);
      barrier.wait(n);
      input(L.down, act);
      if (L.ffn_out_norm || group_) {
        matrix_rows(L.down, act, ts.xq, B, o0, o1, data(L.down_bias), buf.branch.data(), false, walks);
        barrier.wait(n);
        sum_shards(buf.branch.data(), B, w, n, barrier);
        add_branch(L.ffn_out_norm);
      } else {
        to_shared();
        matrix_rows(L.down, act, ts.xq, B, o0, o1, data(L.down_bias), xp, true, walks);
        barrier.wait(n);
      }
    }
    return resid;
  }

  // A gated MLP's rows [i0, i1) for M input rows x (xq: quantized, where W has block-format parts): this
  // thread's gate rows and the matching up rows of W [2I, K] (gate rows, then up rows) into gu [M, 2I], then
  // act(gate) * up on them into act [M, I], with no other thread's rows needed.
  void gated_rows(const Matrix& W, const T* x, const tmq::QRow* xq, int64_t M, int64_t I, int64_t i0, int64_t i1,
                  const T* bias, T* gu, T* act, Walks& walks) const {
    matrix_rows(W, x, xq, M, i0, i1, bias, gu, false, walks);
    matrix_rows(W, x, xq, M, I + i0, I + i1, bias, gu, false, walks);
    for (int64_t m = 0; m < M; ++m)
      gate_mul(act_, gu + m * 2 * I + i0, gu + m * 2 * I + I + i0, act + m * I + i0, i1 - i0);
  }

  // Thread w of n's part of a mixture-of-experts feed-forward of h [B, hidden] (the thread's copy of the
  // normed input) into the residual stream xp. Every thread routes the step itself: the router is a small
  // matrix, and the same inputs give every thread the same choice, so no barrier is needed. Then the thread
  // computes its share of the rows of each chosen expert's gate and up for all of that expert's tokens at
  // once (each expert's weights read once a step, whatever the batch), and, after one barrier, its columns
  // of those experts' down projections, which it weighs and adds to the same columns of the residual rows.
  // Its weight reads follow walks of their own, planned once the step has routed.
  void team_experts(const MoEWeights& M, int64_t B, const T* h, T* xp, int w, int n, SpinBarrier& barrier,
                    TeamBuffers& buf, ThreadState& ts, bool add = true) {
    const int64_t E = M.experts(), I = M.I, SI = M.shared_I, H = hidden_;
    Routing& r = ts.routing;
    std::vector<Segment>& segs = ts.segs;
    if (M.quantized_input) ts.xq.set(h, B, H, M.per256_input);
    segs.clear();
    matrix_segments(M.router, 0, E, segs);
    if (M.shared()) matrix_segments(M.shared_gate, 0, 1, segs);
    ts.router.resize(B * E), ts.gate.resize(B);
    {
      Walks walks(segs, B, false);
      matrix_rows(M.router, h, ts.xq, B, 0, E, bias_of(M.router_bias), ts.router.data(), false, walks);
      if (M.shared())
        matrix_rows(M.shared_gate, h, ts.xq, B, 0, 1, static_cast<const T*>(nullptr), ts.gate.data(), false, walks);
    }
    r.route<T>(M, ts.router.data(), B);
    const int64_t P = r.pairs();
    auto active = [&](int64_t e) { return r.start[e + 1] > r.start[e]; };
    ts.gathered.resize(P * H), ts.pair_rows.resize(P);
    for (int64_t p = 0; p < P; ++p) {
      std::memcpy(ts.gathered.data() + p * H, h + r.token[p] * H, H * sizeof(T));
      if (M.quantized_input) ts.pair_rows[p] = ts.xq.rows[r.token[p]];
    }
    const auto [i0, i1] = share(I, w, n);
    const auto [s0, s1] = share(SI, w, n);
    segs.clear();
    for (int64_t e = 0; e < E; ++e)
      if (active(e)) matrix_segments(M.gate_up[e], i0, i1, segs), matrix_segments(M.gate_up[e], I + i0, I + i1, segs);
    if (M.shared())
      matrix_segments(M.shared_gate_up, s0, s1, segs), matrix_segments(M.shared_gate_up, SI + s0, SI + s1, segs);
    T *gu = buf.pairs_gu.data(), *act = buf.pairs_act.data();
    {
      Walks walks(segs, B, false);
      for (int64_t e = 0; e < E; ++e) {
        if (!active(e)) continue;
        const int64_t p0 = r.start[e], m = r.start[e + 1] - p0;
        gated_rows(M.gate_up[e], ts.gathered.data() + p0 * H, ts.pair_rows.data() + p0, m, I, i0, i1,
                   bias_of(M.gate_up_bias, e), gu + p0 * 2 * I, act + p0 * I, walks);
      }
      if (M.shared())
        gated_rows(M.shared_gate_up, h, ts.xq.rows.data(), B, SI, s0, s1, nullptr, buf.shared_gu.data(),
                   buf.shared_act.data(), walks);
    }
    barrier.wait(n);
    const auto [o0, o1] = share(H, w, n);
    segs.clear();
    bool quantized = false, per256 = false;
    for (int64_t e = 0; e < E; ++e)
      if (active(e)) {
        matrix_segments(M.down[e], o0, o1, segs);
        quantized |= M.down[e].quantized, per256 |= M.down[e].per256;
      }
    if (M.shared()) matrix_segments(M.shared_down, o0, o1, segs);
    T* out = buf.pairs_out.data();
    {
      Walks walks(segs, B, false);
      if (quantized) ts.xq.set(act, P, I, per256);
      for (int64_t e = 0; e < E; ++e) {
        if (!active(e)) continue;
        const int64_t p0 = r.start[e], m = r.start[e + 1] - p0;
        matrix_rows(M.down[e], act + p0 * I, ts.xq.rows.data() + p0, m, o0, o1, bias_of(M.down_bias, e),
                    out + p0 * H, false, walks);
      }
      if (M.shared()) {
        if (M.shared_down.quantized) ts.xq.set(buf.shared_act.data(), B, SI, M.shared_down.per256);
        matrix_rows(M.shared_down, buf.shared_act.data(), ts.xq, B, o0, o1, static_cast<const T*>(nullptr),
                    buf.shared_out.data(), false, walks);
      }
    }
    for (int64_t b = 0; b < B; ++b)
      add_experts<T>(M, r, out, buf.shared_out.data(), ts.gate.data(), b, H, o0, o1, xp, add);
  }

  // Thread w of n's weight stream for a step that ends in the output layer: its rows of the decoder
  // layers (see plan_streams), then its share of the head's rows (those team_logits gives it).
  std::vector<Segment> stream_with_head(int w, int n) const {
    std::vector<Segment> stream = streams_[n][w];
    const auto [v0, v1] = share(head_.N, w, n);
    matrix_segments(head_, v0, v1, stream);
    return stream;
  }

  // Thread w of n's rows of the output layer where it is large and its rows short block-format ones
  // (kHeadRowBytes).
  std::vector<Segment> short_head_rows(int w, int n) const {
    std::vector<Segment> rows;
    int64_t bytes = 0;
    for (const MatrixPart& p : head_.parts) {
      if (p.dense() || p.row_bytes > kHeadRowBytes) return rows;
      bytes += (p.r1 - p.r0) * p.row_bytes;
    }
    if (bytes < kHeadMinBytes) return rows;
    const auto [v0, v1] = share(head_.N, w, n);
    matrix_segments(head_, v0, v1, rows);
    return rows;
  }

  // Thread w of n's share of the logits [B, vocab] of the residual stream x: the final norm (each
  // thread its own copy), then its rows of the head. Returns those rows [v0, v1).
  std::pair<int64_t, int64_t> team_logits(const T* x, int64_t B, int w, int n, TeamBuffers& buf, T* logits,
                                          Walks& walks, ThreadState& ts) {
    T* h = buf.normed.data() + w * B * hidden_;
    rms_norm_rows(x, data(final_norm_), h, B, hidden_, eps_, norm_offset_, norm_in_float_);
    if (head_.quantized) ts.xq.set(h, B, hidden_, head_.per256);
    const auto [v0, v1] = share(head_.N, w, n);
    walks.in_head = true;
    matrix_rows(head_, h, ts.xq, B, v0, v1, static_cast<const T*>(nullptr), logits, false, walks);
    walks.in_head = false;
    if (final_softcap_ > 0.f)
      for (int64_t b = 0; b < B; ++b) softcap_rows(logits + b * head_.N + v0, v1 - v0, final_softcap_);
    return {v0, v1};
  }

  // A burst of greedy steps of a few requests in one parallel region: each thread's stream runs on from
  // its share of the decoder layers to its share of the output layer's rows and back to the layers of
  // the next step, so neither the output layer nor a new step starts cold or waits for a new region.
  // Each thread takes the largest logit of its rows (rounded as logits() leaves them; first index on
  // ties, the first NaN if any, as argmax_row), and one thread combines them in row order, which gives
  // the whole row's argmax. With draws, the threads then draw the sampled requests' rows, a row each in
  // turn, and a drawn token takes the argmax's place. after_step runs on that one thread, the others
  // waiting. Returns the number of steps done.
  int64_t greedy_team(Burst& burst, const torch::Tensor& block_tables, int64_t steps, const Draws* draws,
                      const StepHook& after_step) {
    const int64_t B = burst.ids.size(0), V = head_.N;
    if (steps == 0) return 0;
    StepInputs in = prepare(burst.ids, burst.pos, burst.slots[0], block_tables, burst.lens);  // the first step's
    Step& s = in.step;
    s.lens = longs(burst.lens);  // the lengths take() advances
    const int64_t* all_slots = longs(burst.slots);
    T* x = data_mut(in.x);
    const int threads = team_threads();
    TeamBuffers buf(*this, B, threads);
    std::vector<T> logits(B * V);
    std::vector<Best> best(threads * B), picks(B);  // each thread's, over its rows (index -1: an empty share)
    std::vector<int64_t> drawn(draws ? B : 0);  // each sampled request's token (-1: the largest logit)
    // Inside the region nothing may throw (the other threads would wait at a barrier for ever): the
    // positions of every step must lie in the rotary table (every token chosen is a row of the
    // embedding: the constructor checked the head has no more rows).
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(longs(burst.pos)[b] + steps <= positions(), "position beyond the rotary table");
    StepPlans plan = attention_plan(s);
    int64_t done = 0;
    bool more = true;
    auto next_step = [&] {  // on one thread, while the others wait
      s.slot = all_slots + done * B;
      begin_step(s, longs(burst.ids), longs(burst.pos), x);
      plan = attention_plan(s);
    };
    team(threads, [&](int w, int n, SpinBarrier& barrier) {
      const auto stream = stream_with_head(w, n);
      Walks walks(stream, B, true, short_head_rows(w, n));
      ThreadState ts(D_);
      while (more) {
        const T* last = team_layers(s, plan, buf, x, w, n, barrier, walks, ts);
        const auto [v0, v1] = team_logits(last, B, w, n, buf, logits.data(), walks, ts);
        for (int64_t b = 0; b < B; ++b) {
          const T* row = logits.data() + b * V;
          const int64_t i = v1 > v0 ? v0 + argmax_row(row + v0, v1 - v0) : -1;
          best[w * B + b] = {i, i >= 0 ? to_float(row[i]) : 0.f};
        }
        barrier.wait(n);
        if (draws) {  // the requests' rows drawn by the threads in turn, whole (the logits are all written)
          static thread_local RowSampler sampler;
          for (int64_t b = w; b < B; b += n) drawn[b] = draws->draw(sampler, logits.data() + b * V, V, b, B, done);
          barrier.wait(n);
        }
        if (w == 0) {
          for (int64_t b = 0; b < B; ++b) {
            int64_t pick = -1;
            float top = 0.f;
            for (int t = 0; t < n; ++t) {
              const Best& c = best[t * B + b];
              if (c.index < 0) continue;
              if (std::isnan(c.value)) {  // the first NaN of the row
                pick = c.index, top = c.value;
                break;
              }
              if (pick < 0 || c.value > top) pick = c.index, top = c.value;
            }
            picks[b] = {vocab_start_ + (draws && drawn[b] >= 0 ? drawn[b] : pick), top};
          }
          const uint64_t t0 = __rdtsc();
          const bool stop = group_best(picks, interrupted_.load());
          group_cycles_ += group_ ? __rdtsc() - t0 : 0;
          for (int64_t b = 0; b < B; ++b) burst.take(done, b, picks[b].index);
          more = burst.go_on(++done, steps, stop);
          if (after_step) {  // the others wait for it: its time is the caller's, not a sign of a lost core
            const uint64_t t1 = __rdtsc();
            if (after_step(done - 1, longs(burst.tokens) + (done - 1) * B, B)) more = false;
            group_cycles_ += __rdtsc() - t1;
          }
          if (more) next_step();
        }
        barrier.wait(n);
      }
    });
    return done;
  }

  // The weight bytes thread w of n reads in a step, in order: its rows of qkv, o, gate, up and down of
  // each layer (the shares team_layers gives it). Made once per thread count.
  void plan_streams(int threads) {
    if ((int)streams_.size() > threads) return;
    streams_.assign(threads + 1, {});
    for (int n = 1; n <= threads; ++n) {
      streams_[n].resize(n);
      for (int w = 0; w < n; ++w) {
        auto& segs = streams_[n][w];
        const auto [r0, r1] = qkv_share(w, n);
        const auto [o0, o1] = share(hidden_, w, n);
        const auto [i0, i1] = share(I_, w, n);
        for (const auto& L : layers_) {
          matrix_segments(L.qkv, r0, r1, segs);
          matrix_segments(L.o, o0, o1, segs);
          if (L.moe) continue;  // which experts a step reads is known only once it has routed: see team_experts
          matrix_segments(L.gate_up, i0, i1, segs);
          matrix_segments(L.gate_up, I_ + i0, I_ + i1, segs);
          matrix_segments(L.down, o0, o1, segs);
        }
      }
    }
  }

  // Larger batches: operation by operation, projections through matrix_product (torch's GEMM for dense
  // weights).
  void forward_batched(const Step& s, torch::Tensor& x, torch::Tensor& out) {
    const int64_t B = s.B, hidden = hidden_, QS = H_ * D_, KVS = KVH_ * D_;
    auto h = torch::empty_like(x);
    auto q = torch::empty({B, H_, D_}, x.options());
    auto attn = torch::empty({B, QS}, x.options());
    auto act = torch::empty({B, I_}, x.options());
    T* xp = data_mut(x);
    for (auto& L : layers_) {
      rms_norm_rows(xp, data(L.input_norm), data_mut(h), B, hidden, eps_, norm_offset_, norm_in_float_);
      auto qkv = matrix_product<T>(L.qkv, h, L.qkv_bias);
      for (int64_t b = 0; b < B; ++b) place_token(L, s, b, data_mut(qkv) + b * (QS + 2 * KVS), data_mut(q));
      decode_attention<Attn>(attn_ptr(data(q)), L.kv(), s.bt, s.lens, attn_ptr(data_mut(attn)),
                             B, H_, KVH_, D_, s.nb, bs_, scale_, L.window, attn_softcap_, L.sink_data());
      auto o = matrix_product<T>(L.o, attn, L.o_bias);
      if (group_) group_->all_reduce(data_mut(o), B * hidden);
      if (L.attn_out_norm)
        rms_norm_rows(data(o), data(*L.attn_out_norm), data_mut(o), B, hidden, eps_, norm_offset_, norm_in_float_);
      add_into(xp, data(o), B * hidden);
      rms_norm_rows(xp, data(L.post_norm), data_mut(h), B, hidden, eps_, norm_offset_, norm_in_float_);
      if (L.moe) {
        experts_batched(*L.moe, h, xp, B);
        continue;
      }
      auto gu = matrix_product<T>(L.gate_up, h, L.gate_up_bias);
      for (int64_t b = 0; b < B; ++b)
        gate_mul(act_, data(gu) + b * 2 * I_, data(gu) + b * 2 * I_ + I_, data_mut(act) + b * I_, I_);
      auto d = matrix_product<T>(L.down, act, L.down_bias);
      if (group_) group_->all_reduce(data_mut(d), B * hidden);
      if (L.ffn_out_norm)
        rms_norm_rows(data(d), data(*L.ffn_out_norm), data_mut(d), B, hidden, eps_, norm_offset_, norm_in_float_);
      add_into(xp, data(d), B * hidden);
    }
    rms_norm_rows(xp, data(final_norm_), data_mut(out), B, hidden, eps_, norm_offset_, norm_in_float_);
  }

  // A mixture-of-experts feed-forward of h [B, hidden] into the residual stream xp, for a batch too large
  // for one parallel region: each chosen expert's tokens gathered and multiplied at once, as moe.py's
  // Experts computes them.
  void experts_batched(const MoEWeights& M, const torch::Tensor& h, T* xp, int64_t B) {
    const int64_t H = hidden_;
    Routing r;
    const auto logits = product(M.router, h, row_of(M.router_bias));
    const T* routed = data(logits);
    std::vector<T> first;
    if (group_) {  // rank 0's logits route every rank: a product on another thread count may round a near-tie apart
      const int64_t n = B * M.experts(), world = group_->group.world();
      std::vector<float> mine(n), all(n * world);
      for (int64_t i = 0; i < n; ++i) mine[i] = to_float(routed[i]);
      group_->group.all_gather(mine.data(), n, all.data());
      group_->check();
      first.resize(n);
      for (int64_t i = 0; i < n; ++i) first[i] = from_float<T>(all[i]);
      routed = first.data();
    }
    r.route<T>(M, routed, B);
    // down(act(gate(x)) * up(x)) of one expert, gate_up [2I, hidden] holding its gate rows, then its up rows.
    auto mlp = [&](const Matrix& gate_up, const Matrix& down, const torch::Tensor& x, int64_t I,
                   c10::optional<torch::Tensor> gate_up_bias = c10::nullopt,
                   c10::optional<torch::Tensor> down_bias = c10::nullopt) {
      const auto gu = product(gate_up, x, gate_up_bias);
      auto act = torch::empty({x.size(0), I}, x.options());
      for (int64_t i = 0; i < x.size(0); ++i)
        gate_mul(act_, data(gu) + i * 2 * I, data(gu) + i * 2 * I + I, data_mut(act) + i * I, I);
      return product(down, act, down_bias);
    };
    auto out = torch::empty({r.pairs(), H}, h.options());
    for (int64_t e = 0; e < M.experts(); ++e) {
      const int64_t p0 = r.start[e], m = r.start[e + 1] - p0;
      if (!m) continue;
      const auto tokens = torch::from_blob(r.token.data() + p0, {m}, torch::kLong);
      out.narrow(0, p0, m).copy_(mlp(M.gate_up[e], M.down[e], h.index_select(0, tokens), M.I,
                                     row_of(M.gate_up_bias, e), row_of(M.down_bias, e)));
    }
    torch::Tensor shared, gate;
    if (M.shared()) {
      shared = mlp(M.shared_gate_up, M.shared_down, h, M.shared_I);
      gate = product(M.shared_gate, h);
    }
    // A tensor-parallel shard's part is summed over the group before it joins the residual.
    auto part = group_ ? torch::empty({B, H}, h.options()) : torch::Tensor();
    for (int64_t b = 0; b < B; ++b)
      add_experts<T>(M, r, data(out), M.shared() ? data(shared) : nullptr, M.shared() ? data(gate) : nullptr, b, H,
                     0, H, group_ ? data_mut(part) : xp, !group_);
    if (group_) {
      group_->all_reduce(data_mut(part), B * H);
      add_into(xp, data(part), B * H);
    }
  }

  // x W^T as a separate linear layer computes it: a dense bfloat16 matrix through linear_bf16 (the GEMV
  // kernel for a few rows, as kernels/cpu.py's linear), anything else through matrix_product.
  static torch::Tensor product(const Matrix& W, const torch::Tensor& x,
                               const c10::optional<torch::Tensor>& bias = c10::nullopt) {
    if (!kIsFloat<T> && W.parts.size() == 1 && W.parts[0].dense())
      return linear_bf16(x.contiguous(), W.tensors[0], bias);
    return matrix_product<T>(W, x, bias);
  }

  // Row e of a stacked bias (the whole tensor where e < 0), as a pointer or a tensor; none where undefined.
  static const T* bias_of(const torch::Tensor& t, int64_t e = -1) {
    return t.defined() ? data(t) + (e < 0 ? 0 : e * t.size(1)) : nullptr;
  }
  static c10::optional<torch::Tensor> row_of(const torch::Tensor& t, int64_t e = -1) {
    if (!t.defined()) return c10::nullopt;
    return e < 0 ? t : t[e];
  }

  // A shard's rows [B, hidden] of a row-parallel projection (o, down) := their sum over the group, by
  // thread 0 while the team waits (the sum is a few KiB: splitting it would cost more barriers than it saves).
  void sum_shards(T* rows, int64_t B, int w, int n, SpinBarrier& barrier) {
    if (!group_) return;
    if (w == 0) {
      const uint64_t t0 = __rdtsc();
      group_->all_reduce(rows, B * hidden_);
      group_cycles_ += __rdtsc() - t0;
    }
    barrier.wait(n);
  }

  int64_t H_, KVH_, D_, I_, hidden_ = 0;
  float eps_, scale_;
  int64_t bs_;
  int64_t cache_slots_ = 0;  // the fewest slots of any layer's cache
  torch::Tensor final_norm_;
  std::vector<torch::Tensor> cos_, sin_;  // the rotary tables, each [positions, rotary_dim]
  int64_t R_;  // rotary_dim: the leading dims of each head that rotate
  int64_t positions() const { return cos_[0].size(0); }
  float norm_offset_;
  bool norm_in_float_;
  GateAct act_;
  float embed_scale_, attn_softcap_, final_softcap_;
  Matrix embed_, head_;
  std::vector<LayerWeights<T>> layers_;
  std::vector<std::vector<std::vector<Segment>>> streams_;  // [threads][thread]: see plan_streams
};

}  // namespace

// ------------------------------------------------------------------------------------- entry points

// x [M, K] @ w^T (+ bias) in bf16: the GEMV kernel for up to kMaxGemvRows rows (module attribute
// max_gemv_rows) with K a multiple of 32, torch's GEMM for anything else.
torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && w.dtype() == torch::kBFloat16, "bf16 tensors expected");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shapes do not match");
  return linear_bf16(x.contiguous(), w.contiguous(), opt(bias));
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, int64_t block_size,
                                     double scale, int64_t window, c10::optional<torch::Tensor> k_scale,
                                     c10::optional<torch::Tensor> v_scale, double softcap,
                                     c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kBFloat16, "float32 or bfloat16 expected");
  const KVCode code = kv_code(k_cache, v_cache, k_scale, v_scale, q.scalar_type());
  q = q.contiguous();
  auto bt = block_tables.to(torch::kLong).contiguous();
  auto lens = seq_lens.to(torch::kLong).contiguous();
  auto out = torch::empty_like(q);
  TORCH_CHECK(bt.dim() == 2 && bt.size(0) == q.size(0) && lens.dim() == 1 && lens.size(0) == q.size(0),
              "block_tables [batch, blocks] and seq_lens [batch] must match q's batch");
  TORCH_CHECK(block_size >= 1 && window >= 0, "block_size must be at least 1, window 0 (none) or positive");
  TORCH_CHECK(softcap >= 0, "softcap must be 0 (none) or positive");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1), nb = bt.size(1);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(2) == D, "head counts do not match");
  TORCH_CHECK(head_dim_ok(D), kHeadDims);
  check_block_tables(bt.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), B, nb, block_size, k_cache.size(0) / block_size,
                     0);
  auto scales = [&](const c10::optional<torch::Tensor>& t) {
    return code == KVCode::kPlain ? nullptr : reinterpret_cast<const uint16_t*>(t->data_ptr());
  };
  const KVLayer kv{{k_cache.data_ptr(), scales(k_scale)}, {v_cache.data_ptr(), scales(v_scale)}, code};
  torch::Tensor sink;
  if (sinks) {
    sink = sinks->to(torch::kFloat).contiguous();
    TORCH_CHECK(sink.dim() == 1 && sink.size(0) == H, "sinks: one float per query head");
  }
  const float* sink_data = sinks ? sink.data_ptr<float>() : nullptr;
  if (q.scalar_type() == torch::kFloat) {
    decode_attention<float>(q.data_ptr<float>(), kv, bt.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                            out.data_ptr<float>(), B, H, KVH, D, nb, block_size, (float)scale, window, (float)softcap,
                            sink_data);
  } else {
    decode_attention<bf16>(q.data_ptr<bf16>(), kv, bt.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                           out.data_ptr<bf16>(), B, H, KVH, D, nb, block_size, (float)scale, window, (float)softcap,
                           sink_data);
  }
  return out;
}

// ---------------------------------------------------------------------------------- prompt attention

// Causal attention of a prompt chunk's n query rows q [n, H, D] (positions L - n .. L - 1) over the keys
// and values k, v [L, KVH, D] of positions 0 .. L - 1 (a cached prefix, then the chunk), all bfloat16,
// query head h reading KV head h / (H / KVH); window > 0 keeps each row's last `window` positions.
//
// Keys and values are laid out once per KV head for bf16 pair products (vdpbf16ps: exact products,
// float32 sums): keys by groups of 16, each pair of dimensions one vector of 16 keys; values by pairs of
// keys, 16 dimensions a vector. Then for each group of 4 rows (a position's query heads, position after
// position) the blocks of 64 keys up to its rows: scores in float32, an online softmax, the probabilities
// rounded to bfloat16 (as the references round them before their product with the values) and the values
// summed into float32 outputs, a slab of 64 dimensions at a time.
//
// A row's arithmetic depends only on its query, its position and the keys and values up to it: key blocks
// are aligned to absolute positions and taken in order from the first, and a block with none of a row's
// keys changes nothing for it. So a row's output is the same in whichever chunk of the prompt it is
// computed, with its prefix read from the cache or computed in the same call.
constexpr int64_t kPromptKeys = 64;      // keys a block
constexpr int64_t kPromptPositions = 8;  // query positions a task

// The block of query positions that a prompt's i-th task takes, of `blocks`: later positions cost more, so
// tasks alternate between the cheapest and the dearest block left, and the even split of at::parallel_for
// gives each thread a like share.
inline int64_t cheap_then_dear(int64_t i, int64_t blocks) { return i % 2 == 0 ? i / 2 : blocks - 1 - i / 2; }

// The scores of R query rows against a block of 16 * KB keys (kb: the block's keys in pair layout, P pairs
// of dimensions), into s. Written with constant trip counts so that the accumulators stay in registers.
template <int R, int KB>
inline void prompt_scores(const uint32_t* const (&qr)[R], const uint16_t* kb, int64_t D, int64_t P, __m512 (&s)[R][KB]) {
  __m512 acc[R][KB];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int h = 0; h < KB; ++h) acc[r][h] = _mm512_setzero_ps();
  for (int64_t e = 0; e < P; ++e) {
    __m512bh kv[KB];
#pragma GCC unroll 8
    for (int h = 0; h < KB; ++h) kv[h] = (__m512bh)_mm512_loadu_si512(kb + 16 * h * D + e * 32);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh qe = (__m512bh)_mm512_set1_epi32((int)qr[r][e]);
#pragma GCC unroll 8
      for (int h = 0; h < KB; ++h) acc[r][h] = _mm512_dpbf16_ps(acc[r][h], qe, kv[h]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int h = 0; h < KB; ++h) s[r][h] = acc[r][h];
}

// o[r][d0 .. d0 + 16 NV) := o * alpha[r] + the block's probabilities p[r] (bfloat16, by pairs of keys) times
// its values (vb: the block's first key's values, pairs of keys by dimension, from d0), `pairs` pairs.
template <int R, int NV>
inline void prompt_values(float* o, int64_t D, int64_t d0, const float (&alpha)[R], const uint16_t (*p)[kPromptKeys],
                          const uint16_t* vb, int64_t pairs) {
  __m512 acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int w = 0; w < NV; ++w)
      acc[r][w] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d0 + 16 * w), _mm512_set1_ps(alpha[r]));
  for (int64_t j = 0; j < pairs; ++j) {
    const uint16_t* vr = vb + 2 * j * D;  // keys 2j and 2j + 1 of the block
    __m512bh pr[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) pr[r] = (__m512bh)_mm512_set1_epi32((int)reinterpret_cast<const uint32_t*>(p[r])[j]);
#pragma GCC unroll 8
    for (int w = 0; w < NV; ++w) {
      const __m512bh vv = (__m512bh)_mm512_loadu_si512(vr + 32 * w);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][w] = _mm512_dpbf16_ps(acc[r][w], pr[r], vv);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int w = 0; w < NV; ++w) _mm512_storeu_ps(o + r * D + d0 + 16 * w, acc[r][w]);
}

void prompt_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t n, int64_t L,
                      int64_t H, int64_t KVH, int64_t D, float scale, int64_t window) {
  const int64_t g = H / KVH, Lp = (L + kPromptKeys - 1) / kPromptKeys * kPromptKeys, first = L - n, P = D / 2;
  // kp [KVH][Lp / 16][D / 2][16 keys][2]; vp [KVH][Lp / 2][D][2 keys]; zeros past L.
  std::vector<uint16_t> kp(KVH * Lp * D, 0), vp(KVH * Lp * D, 0);
  at::parallel_for(0, KVH * (Lp / 16), 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t c = b / (Lp / 16), j0 = b % (Lp / 16) * 16;
      uint16_t* kb = kp.data() + (c * Lp + j0) * D;
      for (int64_t j = j0; j < std::min(j0 + 16, L); ++j) {
        const uint16_t* kr = k + (j * KVH + c) * D;
        const uint16_t* vr = v + (j * KVH + c) * D;
        uint16_t* vo = vp.data() + (c * Lp + j / 2 * 2) * D + j % 2;
        for (int64_t d = 0; d < D; ++d) {
          kb[(d / 2 * 16 + (j - j0)) * 2 + d % 2] = kr[d];
          vo[2 * d] = vr[d];
        }
      }
    }
  });
  const int64_t blocks = (n + kPromptPositions - 1) / kPromptPositions, tasks = KVH * blocks;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    constexpr int R = 4;
    std::vector<float> o(R * D);
    alignas(64) uint16_t p[R][kPromptKeys];
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c = t % KVH, pb = cheap_then_dear(t / KVH, blocks);
      const uint16_t* kc = kp.data() + c * Lp * D;
      const uint16_t* vc = vp.data() + c * Lp * D;
      const int64_t r0 = pb * kPromptPositions, rows = (std::min(n, r0 + kPromptPositions) - r0) * g;
      for (int64_t a = 0; a < rows; a += R) {
        const int nr = (int)std::min<int64_t>(R, rows - a);
        int64_t pos[R], row[R];
        const uint32_t* qr[R];
        float m[R];
        __m512 l[R];
        for (int r = 0; r < R; ++r) {
          const int64_t x = a + std::min(r, nr - 1);  // a short group repeats its last row, unused
          row[r] = (r0 + x / g) * H + c * g + x % g;
          pos[r] = first + r0 + x / g;
          qr[r] = reinterpret_cast<const uint32_t*>(q + row[r] * D);
          m[r] = -std::numeric_limits<float>::infinity();
          l[r] = _mm512_setzero_ps();
        }
        std::fill(o.begin(), o.end(), 0.f);
        const int64_t top = pos[R - 1], bottom = pos[0];  // rows go position after position
        const int64_t from = window > 0 ? std::max<int64_t>(0, bottom - window + 1) / kPromptKeys * kPromptKeys : 0;
        for (int64_t j0 = from; j0 <= top; j0 += kPromptKeys) {
          constexpr int KB = kPromptKeys / 16;  // vectors of 16 keys a block
          __m512 s[R][KB];
          prompt_scores<R, KB>(qr, kc + j0 * D, D, P, s);
          bool any = false;
          float alpha[R];
          for (int r = 0; r < R; ++r) {
            // Keys j0 + lane that the row reads: at or before its position, inside its window.
            const __m512i lo = _mm512_set1_epi32(window > 0 ? (int)(pos[r] - window + 1) : 0);
            const __m512i hi = _mm512_set1_epi32((int)pos[r]);
            __mmask16 keep[KB];
            __mmask16 kept = 0;
            for (int h = 0; h < KB; ++h) {
              const __m512i key = _mm512_add_epi32(lanes, _mm512_set1_epi32((int)(j0 + 16 * h)));
              keep[h] = _mm512_cmple_epi32_mask(key, hi) & _mm512_cmpge_epi32_mask(key, lo);
              kept |= keep[h];
            }
            if (!kept) {  // none of this row's keys: nothing changes for it
              alpha[r] = 1.f;
              for (int h = 0; h < KB; ++h) _mm256_store_si256((__m256i*)(p[r] + 16 * h), _mm256_setzero_si256());
              continue;
            }
            any = true;
            const __m512 sc = _mm512_set1_ps(scale);
            __m512 x[KB];
            __m512 top_x = ninf;
            for (int h = 0; h < KB; ++h) {
              x[h] = _mm512_mask_blend_ps(keep[h], ninf, _mm512_mul_ps(s[r][h], sc));
              top_x = _mm512_max_ps(top_x, x[h]);
            }
            const float mn = std::max(m[r], _mm512_reduce_max_ps(top_x));
            alpha[r] = std::exp(m[r] - mn);  // 0 at the row's first block (m = -inf)
            m[r] = mn;
            const __m512 mv = _mm512_set1_ps(mn);
            __m512 sum = _mm512_setzero_ps();
            for (int h = 0; h < KB; ++h) {
              const __m512 eh = _mm512_maskz_mov_ps(keep[h], exp_ps(_mm512_sub_ps(x[h], mv)));
              sum = _mm512_add_ps(sum, eh);
              _mm256_store_si256((__m256i*)(p[r] + 16 * h), (__m256i)_mm512_cvtneps_pbh(eh));
            }
            // The denominator stays a vector of partial sums until the row's last block.
            l[r] = _mm512_fmadd_ps(l[r], _mm512_set1_ps(alpha[r]), sum);
          }
          if (!any) continue;
          const int64_t pairs = (std::min(kPromptKeys, top + 1 - j0) + 1) / 2;
          for (int64_t d0 = 0; d0 < D; d0 += 64) {  // a slab of up to 64 dimensions
            const uint16_t* vb = vc + j0 * D + 2 * d0;
            switch (std::min<int64_t>(4, (D - d0) / 16)) {
              case 1: prompt_values<R, 1>(o.data(), D, d0, alpha, p, vb, pairs); break;
              case 2: prompt_values<R, 2>(o.data(), D, d0, alpha, p, vb, pairs); break;
              default: prompt_values<R, 4>(o.data(), D, d0, alpha, p, vb, pairs); break;
            }
          }
        }
        for (int r = 0; r < nr; ++r) {
          const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(l[r]));
          uint16_t* y = out + row[r] * D;
          for (int64_t d = 0; d < D; d += 16) store_bf16(y + d, _mm512_mul_ps(_mm512_loadu_ps(o.data() + r * D + d), inv));
        }
      }
    }
  });
}

#ifdef TM_PAIRS_AMX
#define TM_PROMPT_AMX 1
// Whether bfloat16 prompt attention takes the tiles where it can (set_prompt_amx; the tests compare both).
inline std::atomic<bool> prompt_amx{true};
// prompt_attention on AMX's bfloat16 tiles (tdpbf16ps), for head sizes a multiple of 64, where the CPU has
// them. Transposed, so that a task's 16 query rows are the tiles' columns and every step of the softmax is
// a vector operation over them (no sums across lanes):
//   scores^T [16 keys, 16 rows] = K [16 keys, 32 dims] x Q^T [32 dims, 16 rows], per 32 dims: the keys are
//   A tiles read where they lie (16 rows of 64 bytes, a KV head's row stride apart), the queries one B tile
//   per 32 dims (pairs of dimensions by row), packed once per task;
//   out^T [16 dims, 16 rows] += V^T [16 dims, 32 keys] x P^T [32 keys, 16 rows]: the values transposed once
//   per call (keys along a row), the probabilities rounded to bfloat16 and paired by keys.
// Rows are 16 positions of one query head; key blocks of 64 aligned to absolute positions, taken in order
// from the first, each row's online softmax in its own lane, its running output in float32 (scaled by the
// block's correction, then the block's tile sums added). Every value of a row depends on its query, its
// position and the keys and values up to it, so a prompt's rows keep their bits whatever its chunks, as
// prompt_attention's do; the sums run in the tile unit's order, not prompt_attention's.
void prompt_attention_amx(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out, int64_t n,
                          int64_t L, int64_t H, int64_t KVH, int64_t D, float scale, int64_t window) {
  constexpr int64_t KB = kPromptKeys;  // keys a block: four tiles of 16
  const int64_t g = H / KVH, Lp = (L + KB - 1) / KB * KB, first = L - n, words = D / 2;
  // vt [KVH][D][Lp]: each KV head's values, a dimension a row, zeros past L. 16 keys at a time: their words
  // (two adjacent dimensions of a key) transposed, then each row of words split into its two dimensions.
  thread_local std::vector<uint16_t> vt_buf;
  uint16_t* vt = tmq::line_aligned(vt_buf, KVH * D * Lp);
  at::parallel_for(0, KVH * (Lp / 16), 4, [&](int64_t b0, int64_t b1) {
    alignas(64) static const uint16_t kSplit[32] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                                    1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    const __m512i split = _mm512_load_si512(kSplit);
    alignas(64) uint32_t w[256];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t c = b / (Lp / 16), j0 = b % (Lp / 16) * 16;
      uint16_t* o = vt + c * D * Lp + j0;
      const int count = (int)std::max<int64_t>(0, std::min<int64_t>(16, L - j0));
      for (int64_t w0 = 0; w0 < D / 2; w0 += 16) {
        tmq::transpose_words((const uint8_t*)(v + (j0 * KVH + c) * D + 2 * w0), KVH * D * 2, count, 16, w);
        for (int64_t t = 0; t < 16; ++t) {
          const __m512i d2 = _mm512_permutexvar_epi16(split, _mm512_load_si512(w + 16 * t));
          _mm256_store_si256((__m256i*)(o + (2 * (w0 + t)) * Lp), _mm512_castsi512_si256(d2));
          _mm256_store_si256((__m256i*)(o + (2 * (w0 + t) + 1) * Lp), _mm512_extracti64x4_epi64(d2, 1));
        }
      }
    }
  });
  const int64_t blocks = (n + 15) / 16, tasks = H * blocks;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<uint32_t> qt_buf, pt_buf;
    thread_local std::vector<uint16_t> tail_buf;
    thread_local std::vector<float> s_buf, o_buf;
    uint32_t* qt = tmq::line_aligned(qt_buf, words * 16);  // [D / 32][16 pairs][16 rows]
    uint32_t* pt = tmq::line_aligned(pt_buf, KB / 2 * 16);  // [2][16 pairs of keys][16 rows]
    uint16_t* tail = tmq::line_aligned(tail_buf, KB * D);   // the last block's keys, zeros past L
    float* sc = tmq::line_aligned(s_buf, KB * 16);          // [64 keys][16 rows]
    float* ot = tmq::line_aligned(o_buf, (D + 64) * 16);    // [D][16 rows], then a slab's tile sums
    float* slab = ot + D * 16;
    tmq::configure_bf16_tiles();  // eight tiles of 16 rows x 64 bytes, as the pair products'
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t % H, pb = cheap_then_dear(t / H, blocks);
      const int64_t c = h / g, r0 = pb * 16, rows = std::min<int64_t>(16, n - r0);
      const int64_t bottom = first + r0, top = bottom + rows - 1;
      for (int64_t w0 = 0; w0 < words; w0 += 16)
        tmq::transpose_words((const uint8_t*)(q + (r0 * H + h) * D + 2 * w0), H * D * 2, (int)rows, 16, qt + 16 * w0);
      const __m512i pos = _mm512_add_epi32(lane, _mm512_set1_epi32((int)bottom));
      const __m512i lo = _mm512_sub_epi32(pos, _mm512_set1_epi32(window > 0 ? (int)window - 1 : INT_MAX / 2));
      __m512 m = ninf, l = _mm512_setzero_ps();
      std::fill(ot, ot + D * 16, 0.f);
      const int64_t from = window > 0 ? std::max<int64_t>(0, bottom - window + 1) / KB * KB : 0;
      for (int64_t j0 = from; j0 <= top; j0 += KB) {
        const uint16_t* kb = k + (j0 * KVH + c) * D;
        int64_t kstride = KVH * D * 2;
        if (j0 + KB > L) {  // the last block: its keys copied, zeros after them (tiles read 64 rows)
          std::fill(tail, tail + KB * D, 0);
          for (int64_t j = j0; j < L; ++j) std::memcpy(tail + (j - j0) * D, k + (j * KVH + c) * D, D * 2);
          kb = tail, kstride = D * 2;
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t e = 0; e < D / 32; ++e) {
          _tile_loadd(4, qt + 256 * e, 64);
          _tile_loadd(5, (const char*)kb + 64 * e, kstride);
          _tile_dpbf16ps(0, 5, 4);
          _tile_loadd(5, (const char*)kb + 16 * kstride + 64 * e, kstride);
          _tile_dpbf16ps(1, 5, 4);
          _tile_loadd(5, (const char*)kb + 32 * kstride + 64 * e, kstride);
          _tile_dpbf16ps(2, 5, 4);
          _tile_loadd(5, (const char*)kb + 48 * kstride + 64 * e, kstride);
          _tile_dpbf16ps(3, 5, 4);
        }
        _tile_stored(0, sc, 64);
        _tile_stored(1, sc + 256, 64);
        _tile_stored(2, sc + 512, 64);
        _tile_stored(3, sc + 768, 64);
        // The block's scores of each row (lane), kept where the key is at or before the row's position and
        // inside its window; the block's largest, the running largest, the correction of what came before.
        __mmask16 keep[KB];
        __m512 top_x = ninf;
        for (int64_t j = 0; j < KB; ++j) {
          const __m512i key = _mm512_set1_epi32((int)(j0 + j));
          keep[j] = _mm512_cmpge_epi32_mask(pos, key) & _mm512_cmpge_epi32_mask(key, lo);
          const __m512 x = _mm512_mask_mul_ps(ninf, keep[j], _mm512_load_ps(sc + 16 * j), _mm512_set1_ps(scale));
          _mm512_store_ps(sc + 16 * j, x);
          top_x = _mm512_max_ps(top_x, x);
        }
        const __m512 mn = _mm512_max_ps(m, top_x);
        const __mmask16 seen = _mm512_cmp_ps_mask(mn, ninf, _CMP_NEQ_OQ);
        // exp(m - mn): 0 where the row had no keys before (m = -inf), 1 where it has none yet (mn = -inf)
        const __m512 alpha = _mm512_mask_blend_ps(
            seen, _mm512_set1_ps(1.f),
            _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m, ninf, _CMP_NEQ_OQ), exp_ps(_mm512_sub_ps(m, mn))));
        m = mn;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < KB; j += 2) {
          const __m512 e0 = _mm512_maskz_mov_ps(keep[j], exp_ps(_mm512_sub_ps(_mm512_load_ps(sc + 16 * j), mn)));
          const __m512 e1 = _mm512_maskz_mov_ps(keep[j + 1], exp_ps(_mm512_sub_ps(_mm512_load_ps(sc + 16 * j + 16), mn)));
          sum = _mm512_add_ps(_mm512_add_ps(sum, e0), e1);
          // keys j, j + 1 of each row as one word: a row of the B tile
          const __m512i p0 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e0));
          const __m512i p1 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e1));
          _mm512_store_si512((void*)(pt + 8 * j), _mm512_or_si512(p0, _mm512_slli_epi32(p1, 16)));
        }
        l = _mm512_fmadd_ps(l, alpha, sum);
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
          const uint16_t* va = vt + (c * D + d0) * Lp + j0;
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t half = 0; half < 2; ++half) {
            _tile_loadd(4, pt + 256 * half, 64);
            _tile_loadd(5, va + 32 * half, Lp * 2);
            _tile_dpbf16ps(0, 5, 4);
            _tile_loadd(5, va + 16 * Lp + 32 * half, Lp * 2);
            _tile_dpbf16ps(1, 5, 4);
            _tile_loadd(5, va + 32 * Lp + 32 * half, Lp * 2);
            _tile_dpbf16ps(2, 5, 4);
            _tile_loadd(5, va + 48 * Lp + 32 * half, Lp * 2);
            _tile_dpbf16ps(3, 5, 4);
          }
          _tile_stored(0, slab, 64);
          _tile_stored(1, slab + 256, 64);
          _tile_stored(2, slab + 512, 64);
          _tile_stored(3, slab + 768, 64);
          float* o = ot + d0 * 16;
          for (int64_t d = 0; d < 64; ++d)
            _mm512_store_ps(o + 16 * d, _mm512_fmadd_ps(_mm512_load_ps(o + 16 * d), alpha, _mm512_load_ps(slab + 16 * d)));
        }
      }
      // out [row, d] = ot [d, row] / l [row]: 16 dimensions at a time, transposed back.
      alignas(64) float inv[16], back[256];
      _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), l));
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        tmq::transpose_words((const uint8_t*)(ot + d0 * 16), 64, 16, 16, (uint32_t*)back);
        for (int64_t r = 0; r < rows; ++r)
          store_bf16(out + ((r0 + r) * H + h) * D + d0, _mm512_mul_ps(_mm512_load_ps(back + 16 * r), _mm512_set1_ps(inv[r])));
      }
    }
    _tile_release();
  });
  if (vt_buf.size() > (size_t)(8 << 20)) std::vector<uint16_t>().swap(vt_buf);  // (a long context's: not kept)
}
#endif

torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes(), "q [n, H, D], k and v [L, KVH, D] expected");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k.scalar_type() == torch::kBFloat16 &&
                  v.scalar_type() == torch::kBFloat16, "q, k and v: bfloat16");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), L = k.size(0), KVH = k.size(1);
  TORCH_CHECK(k.size(2) == D && KVH > 0 && H % KVH == 0, "head counts or sizes do not match");
  TORCH_CHECK(n >= 1 && n <= L && L < INT_MAX / 2, "need 1 <= n <= L (the queries are the last n positions)");
  TORCH_CHECK(head_dim_ok(D), kHeadDims);
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
  q = q.contiguous(), k = k.contiguous(), v = v.contiguous();
  auto out = torch::empty_like(q);
#ifdef TM_PROMPT_AMX
  if (D % 64 == 0 && tmq::amx_usable() && prompt_amx.load()) {
    prompt_attention_amx(bits(q), bits(k), bits(v), bits_mut(out), n, L, H, KVH, D, (float)scale, window);
    return out;
  }
#endif
  prompt_attention(bits(q), bits(k), bits(v), bits_mut(out), n, L, H, KVH, D, (float)scale, window);
  return out;
}

// ------------------------------------------------------------------- element-wise ops of whole chunks

// The module-by-module path (prompt chunks, steps larger than the fused decoder takes) runs the layers'
// small operations through these where its activations are bfloat16: the same roundings as the eager
// torch operations they replace (each operation computed in float32 and rounded to bfloat16), in one pass
// over the rows and split over the threads. torch's own bfloat16 element-wise kernels took a quarter of a
// 700-token prompt's time on the default model.

// Rows of a chunk a thread takes at a time: about 16K values.
inline int64_t row_grain(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)); }

// RMSNorm over the last dimension of x (contiguous, bfloat16, a multiple of 16): rms_norm_rows's rule.
torch::Tensor rms_norm_bf16(torch::Tensor x, torch::Tensor w, double eps, double offset, bool in_float) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16, "x and w: bfloat16");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.dim() >= 1, "x and w: contiguous");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  TORCH_CHECK(n % 16 == 0 && w.numel() == n, "the normalised size: a multiple of 16, and w's");
  auto y = torch::empty_like(x);
  const uint16_t* xp = bits(x);
  const uint16_t* wp = bits(w);
  uint16_t* yp = bits_mut(y);
  at::parallel_for(0, rows, row_grain(n), [&](int64_t r0, int64_t r1) {
    rms_norm_rows(xp + r0 * n, wp, yp + r0 * n, r1 - r0, n, (float)eps, (float)offset, in_float);
  });
  return y;
}

// act(gate) * up from a merged projection's rows gu [T, 2I] (gate the first I values, up the rest; I a
// multiple of 16): gate_mul's rule for `activation` (0 silu, 1 gelu_tanh, 2 clamped SwiGLU).
torch::Tensor glu_bf16(torch::Tensor gu, int64_t activation, double alpha, double limit) {
  TORCH_CHECK(gu.scalar_type() == torch::kBFloat16 && gu.dim() == 2 && gu.is_contiguous(), "gu: [T, 2I] bfloat16");
  TORCH_CHECK(activation >= 0 && activation <= 2, "activation: 0 (silu), 1 (gelu_tanh) or 2 (clamped_swiglu)");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  TORCH_CHECK(gu.size(1) == 2 * I && I % 16 == 0, "gu's rows: gate and up, each a multiple of 16");
  auto out = torch::empty({T, I}, gu.options());
  const GateAct act{static_cast<Activation>(activation), (float)alpha, (float)limit};
  const uint16_t* g = bits(gu);
  uint16_t* o = bits_mut(out);
  at::parallel_for(0, T, row_grain(2 * I), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) gate_mul(act, g + t * 2 * I, g + t * 2 * I + I, o + t * I, I);
  });
  return out;
}

// Rotary embedding of x [T, heads, D] (any strides, each head's D values adjacent) by cos, sin [T, 1, R]
// (contiguous; R even, at most D): the first R dims of each head become x cos + rotate_half(x) sin, each
// product and the sum rounded to bfloat16 as the eager operations round them; the rest are copied.
// Returns a contiguous [T, heads, D].
torch::Tensor rotary_bf16(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && cos.scalar_type() == torch::kBFloat16 &&
                  sin.scalar_type() == torch::kBFloat16, "x, cos and sin: bfloat16");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x: [T, heads, D], each head's values adjacent");
  const int64_t T = x.size(0), NH = x.size(1), D = x.size(2), R = cos.size(-1), half = R / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * R && sin.numel() == T * R,
              "cos and sin: [T, 1, R] contiguous");
  TORCH_CHECK(R % 2 == 0 && R <= D, "R: even, at most D");
  auto out = torch::empty({T, NH, D}, x.options());
  const uint16_t* xp = bits(x);
  const uint16_t* cp = bits(cos);
  const uint16_t* sp = bits(sin);
  uint16_t* op = bits_mut(out);
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, T, row_grain(NH * D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* c = cp + t * R;
      const uint16_t* s = sp + t * R;
      for (int64_t h = 0; h < NH; ++h) {
        const uint16_t* v = xp + t * s0 + h * s1;
        uint16_t* y = op + (t * NH + h) * D;
        int64_t i = 0;
        for (; i + 16 <= half; i += 16) {
          const __m512 a = load_bf16(v + i), b = load_bf16(v + half + i);
          const __m512 lo = _mm512_add_ps(round_bf16(_mm512_mul_ps(a, load_bf16(c + i))),
                                          round_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), b),
                                                                   load_bf16(s + i))));
          const __m512 hi = _mm512_add_ps(round_bf16(_mm512_mul_ps(b, load_bf16(c + half + i))),
                                          round_bf16(_mm512_mul_ps(a, load_bf16(s + half + i))));
          store_bf16(y + i, lo);
          store_bf16(y + half + i, hi);
        }
        for (; i < half; ++i) {
          const float a = from_bf16(v[i]), b = from_bf16(v[half + i]);
          y[i] = to_bf16(rounded<uint16_t>(a * from_bf16(c[i])) + rounded<uint16_t>(-b * from_bf16(s[i])));
          y[half + i] = to_bf16(rounded<uint16_t>(b * from_bf16(c[half + i])) + rounded<uint16_t>(a * from_bf16(s[half + i])));
        }
        if (R < D) std::memcpy(y + R, v + R, (D - R) * sizeof(uint16_t));
      }
    }
  });
  return out;
}

// Codes and scales of rows x [rows, KV heads, head_dim] (float32 or bfloat16) as the decoder writes them
// to an 8-bit cache (code: "int8" or "fp8"): the reference the Python writer is held to.
std::vector<torch::Tensor> quantize_kv(torch::Tensor x, const std::string& code) {
  TORCH_CHECK(code == "int8" || code == "fp8", "code must be int8 or fp8");
  TORCH_CHECK(x.dim() == 3 && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "x: float32 or bfloat16 [rows, KV heads, head_dim]");
  x = x.contiguous();
  const KVCode c = code == "int8" ? KVCode::kInt8 : KVCode::kFp8;
  const int64_t R = x.size(0) * x.size(1), D = x.size(2);
  auto codes = torch::empty(x.sizes(), x.options().dtype(c == KVCode::kInt8 ? torch::kChar : torch::kFloat8_e4m3fn));
  auto scales = torch::empty({x.size(0), x.size(1)}, x.options().dtype(torch::kBFloat16));
  auto* cp = reinterpret_cast<uint8_t*>(codes.data_ptr());
  auto* sp = reinterpret_cast<uint16_t*>(scales.data_ptr());
  if (x.scalar_type() == torch::kFloat) quantize_kv_rows(x.data_ptr<float>(), R, D, c, cp, sp);
  else quantize_kv_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), R, D, c, cp, sp);
  return {codes, scales};
}

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "float32 or bfloat16 [rows, n] expected");
  x = x.contiguous();
  const int64_t R = x.size(0), N = x.size(1);
  TORCH_CHECK(N > 0 && N < (int64_t(1) << 31), "row length out of range");
  auto out = torch::empty({R}, torch::kLong);
  for (int64_t r = 0; r < R; ++r)
    out.data_ptr<int64_t>()[r] = x.scalar_type() == torch::kFloat ? argmax_row(x.data_ptr<float>() + r * N, N)
                                                                  : argmax_row(x.data_ptr<bf16>() + r * N, N);
  return out;
}

// sample_rows(logits [R, V] float32 or bfloat16, temperature, top_k, top_p, min_p, u [R]): RowSampler::draw
// for each row (the rows in parallel).
torch::Tensor sample_rows(torch::Tensor x, torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                          torch::Tensor min_p, torch::Tensor u) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "float32 or bfloat16 [rows, n] expected");
  x = x.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t(1) << 31), "row length out of range");
  auto t = temperature.to(torch::kFloat).contiguous(), k = top_k.to(torch::kLong).contiguous();
  auto p = top_p.to(torch::kFloat).contiguous(), mp = min_p.to(torch::kFloat).contiguous();
  auto uu = u.to(torch::kDouble).contiguous();
  TORCH_CHECK(t.numel() == R && k.numel() == R && p.numel() == R && mp.numel() == R && uu.numel() == R,
              "a parameter per row expected");
  auto out = torch::empty({R}, torch::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, R, std::max<int64_t>(1, 65536 / V), [&](int64_t r0, int64_t r1) {
    static thread_local RowSampler sampler;  // its buffers kept from call to call
    for (int64_t r = r0; r < r1; ++r) {
      const float tr = t.data_ptr<float>()[r], pr = p.data_ptr<float>()[r], mr = mp.data_ptr<float>()[r];
      const int64_t kr = k.data_ptr<int64_t>()[r];
      const double ur = uu.data_ptr<double>()[r];
      o[r] = x.scalar_type() == torch::kFloat ? sampler.draw(x.data_ptr<float>() + r * V, V, tr, kr, pr, mr, ur)
                                              : sampler.draw(x.data_ptr<bf16>() + r * V, V, tr, kr, pr, mr, ur);
    }
  });
  return out;
}

// A burst's after_step calling on_step(step, tokens) in Python, with the interpreter's lock taken for the
// call. An exception there ends the burst; the binding raises it once the call is over.
class PyStepHook {
 public:
  explicit PyStepHook(pybind11::object fn) : fn_(std::move(fn)) {}
  ~PyStepHook() {
    pybind11::gil_scoped_acquire gil;
    error_.reset();
    fn_ = pybind11::object();
  }

  template <typename D>
  typename D::StepHook hook() {
    if (fn_.is_none()) return nullptr;
    return [this](int64_t step, const int64_t* tokens, int64_t B) {
      pybind11::gil_scoped_acquire gil;
      try {
        pybind11::list row(B);
        for (int64_t b = 0; b < B; ++b) row[b] = pybind11::int_(tokens[b]);
        return pybind11::bool_(fn_(step, row)).cast<bool>();
      } catch (pybind11::error_already_set& e) {
        error_ = e;
      } catch (const std::exception& e) {
        message_ = e.what();
      }
      return true;
    };
  }

  // After the call, the interpreter's lock held: the exception on_step raised, if it did.
  void raise() {
    if (error_) {
      pybind11::error_already_set e = *error_;
      error_.reset();
      throw e;
    }
    if (!message_.empty()) throw std::runtime_error("on_step: " + message_);
  }

 private:
  pybind11::object fn_;
  std::optional<pybind11::error_already_set> error_;
  std::string message_;
};

template <typename T>
void bind_decoder(pybind11::module& m, const char* name) {
  namespace py = pybind11;
  using release = py::call_guard<py::gil_scoped_release>;
  using D = FusedDecoder<T>;
  py::class_<D>(m, name)
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, double, int64_t, torch::Tensor, const PartList&,
                    const PartList&, torch::Tensor, torch::Tensor, double, int64_t, double, double, double, bool,
                    double, double>(),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"),
           py::arg("scale"), py::arg("block_size"), py::arg("final_norm"), py::arg("embed"), py::arg("head"),
           py::arg("cos"), py::arg("sin"), py::arg("norm_offset") = 0.0, py::arg("activation") = 0,
           py::arg("embed_scale") = 1.0, py::arg("attn_softcap") = 0.0, py::arg("final_softcap") = 0.0,
           py::arg("norm_in_float") = false, py::arg("glu_alpha") = 1.0, py::arg("glu_limit") = 0.0)
      .def("add_layer", &D::add_layer, py::arg("input_norm"), py::arg("qkv"), py::arg("qkv_bias"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("o"), py::arg("o_bias"), py::arg("post_norm"), py::arg("gate_up"),
           py::arg("gate_up_bias"), py::arg("down"), py::arg("down_bias"), py::arg("k_cache"), py::arg("v_cache"),
           py::arg("window"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
           py::arg("attn_out_norm") = py::none(), py::arg("ffn_out_norm") = py::none(), py::arg("rope") = 0,
           py::arg("sinks") = py::none())
      .def("add_rope", &D::add_rope, py::arg("cos"), py::arg("sin"))
      .def("set_experts", &D::set_experts, py::arg("router"), py::arg("gate_up"), py::arg("down"),
           py::arg("intermediate"), py::arg("top_k"), py::arg("renormalize"), py::arg("weights_in_float"),
           py::arg("shared_gate_up") = PartList(), py::arg("shared_down") = PartList(),
           py::arg("shared_gate") = PartList(), py::arg("shared_intermediate") = 0,
           py::arg("softmax_after_topk") = false, py::arg("router_bias") = py::none(),
           py::arg("gate_up_bias") = py::none(), py::arg("down_bias") = py::none())
      .def("forward", &D::forward, release())
      .def("decode_greedy", [](D& d, torch::Tensor input_ids, torch::Tensor positions, torch::Tensor slots,
                               torch::Tensor block_tables, torch::Tensor seq_lens,
                               std::vector<std::vector<int64_t>> stop_ids, py::object on_step) {
             PyStepHook hook(on_step);
             torch::Tensor out;
             {
               py::gil_scoped_release nogil;
               out = d.decode_greedy(input_ids, positions, slots, block_tables, seq_lens, std::move(stop_ids),
                                     hook.hook<D>());
             }
             hook.raise();
             return out;
           }, py::arg("input_ids"), py::arg("positions"), py::arg("slots"), py::arg("block_tables"),
           py::arg("seq_lens"), py::arg("stop_ids"), py::arg("on_step") = py::none())
      .def("decode_sampled", [](D& d, torch::Tensor input_ids, torch::Tensor positions, torch::Tensor slots,
                                torch::Tensor block_tables, torch::Tensor seq_lens,
                                std::vector<std::vector<int64_t>> stop_ids, torch::Tensor temperature,
                                torch::Tensor top_k, torch::Tensor top_p, torch::Tensor min_p, torch::Tensor u,
                                py::object on_step) {
             PyStepHook hook(on_step);
             torch::Tensor out;
             {
               py::gil_scoped_release nogil;
               out = d.decode_sampled(input_ids, positions, slots, block_tables, seq_lens, std::move(stop_ids),
                                      temperature, top_k, top_p, min_p, u, hook.hook<D>());
             }
             hook.raise();
             return out;
           }, py::arg("input_ids"), py::arg("positions"), py::arg("slots"), py::arg("block_tables"),
           py::arg("seq_lens"), py::arg("stop_ids"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
           py::arg("min_p"), py::arg("u"), py::arg("on_step") = py::none())
      .def("logits", &D::logits, release())
      .def("interrupt", &D::interrupt)
      .def("clear_interrupt", &D::clear_interrupt)
      .def("team_stats", &D::team_stats)
      .def("team_rows", &D::team_rows)
      .def("last_team", &D::last_team)
      .def("run_solo", &D::run_solo, pybind11::arg("calls"), pybind11::arg("adaptive") = true)
      .def("note_lag", &D::note_lag)
      .def("solo_left", &D::solo_left)
      .def("set_group", &D::set_group, py::arg("group"), py::arg("vocab_start"), py::arg("vocab_total"));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("gemv_bf16", &gemv_bf16, py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), release());
  m.attr("max_gemv_rows") = py::int_(kMaxGemvRows);
  m.def("max_team_rows", &team_rows_for, py::arg("moe"));
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("block_size"), py::arg("scale"), py::arg("window"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(), py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none(), release());
  m.def("prefill_attention", &prefill_attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"),
        py::arg("window") = 0, release());
  m.def("quantize_kv", &quantize_kv, release());
#ifdef TM_PROMPT_AMX
  m.def("set_prompt_amx", [](bool on) { prompt_amx.store(on); }, "bfloat16 prompt attention on AMX's tiles (where the CPU has them)");
  m.attr("prompt_amx") = tmq::amx_usable();
#else
  m.def("set_prompt_amx", [](bool) {});
  m.attr("prompt_amx") = false;
#endif
  m.def("rms_norm_bf16", &rms_norm_bf16, py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("offset") = 0.0,
        py::arg("in_float") = false, release());
  m.def("glu_bf16", &glu_bf16, py::arg("gu"), py::arg("activation"), py::arg("alpha") = 1.0, py::arg("limit") = 0.0,
        release());
  m.def("rotary_bf16", &rotary_bf16, py::arg("x"), py::arg("cos"), py::arg("sin"), release());
  m.def("argmax_rows", &argmax_rows, release());
  m.def("sample_rows", &sample_rows, release());
  m.def("set_plan_threads", &set_plan_threads);
  m.def("set_float_rows", [](int64_t n) { tmq::float_rows.store(std::max<int64_t>(0, n)); },
        "input rows from which block-format products dequantize + GEMM (quant_product.h); 0: the defaults");
  py::class_<TPGroup, std::shared_ptr<TPGroup>>(m, "ShmGroup")
      .def(py::init<torch::Tensor, int64_t, int64_t, int64_t, int64_t>(), py::arg("buffer"), py::arg("rank"),
           py::arg("world"), py::arg("capacity"), py::arg("msg_capacity"))
      .def("watch_parent", [](TPGroup& g, int32_t pid) { g.group.watch_parent(pid); }, py::arg("pid"),
           "count the group as broken once this process's parent is no longer pid")
      .def_static("bytes", &tp::ShmGroup::bytes, py::arg("world"), py::arg("capacity"), py::arg("msg_capacity"))
      .def("all_reduce", [](TPGroup& g, torch::Tensor x) {
             TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "all_reduce: a contiguous CPU tensor");
             if (x.scalar_type() == torch::kFloat) g.all_reduce(x.data_ptr<float>(), x.numel());
             else if (x.scalar_type() == torch::kBFloat16) g.all_reduce(reinterpret_cast<uint16_t*>(x.data_ptr()), x.numel());
             else TORCH_CHECK(false, "all_reduce: float32 or bfloat16");
             g.check();
           }, py::arg("x"), release())
      .def("all_gather", [](TPGroup& g, torch::Tensor x) {
             TORCH_CHECK(x.is_contiguous() && x.scalar_type() == torch::kFloat, "all_gather: a contiguous float32 tensor");
             auto out = torch::empty({g.group.world(), x.numel()}, torch::kFloat);
             g.group.all_gather(x.data_ptr<float>(), x.numel(), out.data_ptr<float>());
             g.check();
             return out;
           }, py::arg("x"), release())
      .def("send", [](TPGroup& g, const py::bytes& b) {
             std::string data = b;
             TORCH_CHECK((int64_t)data.size() <= g.group.max_message(), "a step description of ", data.size(),
                         " bytes exceeds the group's message area of ", g.group.max_message());
             bool ok;
             {
               py::gil_scoped_release nogil;
               ok = g.group.send(reinterpret_cast<const uint8_t*>(data.data()), data.size());
             }
             g.check();
             return ok;
           }, py::arg("data"))
      .def("recv", [](TPGroup& g) -> py::object {
             bool ok;
             std::string data;
             {
               py::gil_scoped_release nogil;
               data = g.group.recv(&ok);
             }
             if (!ok) return py::none();
             return py::bytes(data);
           })
      .def("broken", [](const TPGroup& g) { return g.group.broken(); })
      .def("stats", [](const TPGroup& g, int64_t rank) {
             TORCH_CHECK(rank >= 0 && rank < g.group.world(), "rank out of range");
             return g.group.stats(rank);
           }, py::arg("rank"), "rank's (collectives run, seconds in them, seconds of that waiting for the others)")
      .def("mark_broken", [](TPGroup& g) { g.group.mark_broken(); })
      .def_property_readonly("rank", [](const TPGroup& g) { return g.group.rank(); })
      .def_property_readonly("world", [](const TPGroup& g) { return g.group.world(); });
  bind_decoder<float>(m, "FusedDecoderF32");
  bind_decoder<uint16_t>(m, "FusedDecoderBF16");
#ifdef __AVX512BF16__
  m.attr("native_bf16") = true;
#else
  m.attr("native_bf16") = false;
#endif
}
