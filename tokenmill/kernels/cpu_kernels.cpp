// CPU kernels for the decode step (AVX-512 BF16), built on first use by tokenmill/kernels/cpu.py.
//
// - gemv_bf16: y = x W^T for a few rows of x. Decoding reads every weight once per step, so the step is
//   bound by memory bandwidth; each thread streams its share of W once per pass over the rows.
// - paged_decode_attention: single-query attention read straight from the paged KV cache through each
//   request's block table (no gather into a copy).
// - FusedDecoder: a whole decode step of a Llama-family decoder (norms, projections, rotary, cache
//   write, attention, SwiGLU, residuals) in one call, so that the hundreds of small per-layer tensor
//   operations cost no Python dispatch. Rounding to bfloat16 happens where the eager model rounds.
//
// Every entry point releases the GIL: the server's event loop keeps running while a step computes.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <atomic>
#include <chrono>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

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

// A span of weight bytes one thread reads front to back.
struct Segment {
  const char* begin;
  const char* end;
};

// Walks the weight bytes a thread will read (one or more segments, in the order it reads them) a fixed
// distance ahead of its reads, asking for one cache line per call. Over several segments, the slices
// of consecutive matrices in a decode step, the stream runs on across the end of one matrix and the
// start of the next instead of starting cold at each.
template <int Locality>  // __builtin_prefetch's: 3 into L1 (T0), 2 into L2 (T1)
class Lookahead {
 public:
  Lookahead() = default;
  // wrap: past the last segment, the walk goes on from the first.
  Lookahead(const Segment* segs, int64_t count, bool wrap = false) : segs_(segs), count_(count), wrap_(wrap) {
    if (count > 0) p_ = segs[0].begin, end_ = segs[0].end;
  }
  // Moves `bytes` ahead of the reads, prefetching those bytes or leaving them to the hardware.
  void advance(int64_t bytes, bool fetch) {
    for (int64_t i = 0; i < bytes; i += 64) {
      if (fetch)
        line();
      else
        step();
    }
  }
  inline void line() {
    if (step_to_next()) __builtin_prefetch(p_, 0, Locality), p_ += 64;
  }

 private:
  inline void step() {
    if (step_to_next()) p_ += 64;
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
};

using NearAhead = Lookahead<3>;
using FarAhead = Lookahead<2>;

// Where a GEMV leaves its result y [M, N]: stored, or (accumulate) added to the bf16 values already there,
// after rounding to bf16 as a separate linear layer followed by a residual add would.
inline void put(uint16_t* y, float v, const uint16_t* bias, int64_t n, bool accumulate) {
  if (bias) v += from_bf16(bias[n]);
  *y = accumulate ? to_bf16(from_bf16(*y) + from_bf16(to_bf16(v))) : to_bf16(v);
}

// y[n] = x . w[n, :] (+ bias[n]) for one input row and weight rows [n0, n1): each weight row is read
// front to back, so the thread's reads are a single stream; two accumulators hide the dot-product
// latency. `ahead` walks the stream kPrefetchRowBytes ahead.
void gemv_one_row(const uint16_t* x, const uint16_t* w, int64_t K, int64_t n0, int64_t n1, const uint16_t* bias,
                  uint16_t* y, bool accumulate, NearAhead& ahead) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = w + n * K;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      ahead.line();
      ahead.line();
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(wr + k));
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(x + k + 32), (__m512bh)_mm512_loadu_si512(wr + k + 32));
    }
    for (; k < K; k += 32) {
      ahead.line();
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(wr + k));
    }
    put(y + n, _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)), bias, n, accumulate);
  }
}

// y[m, n] = x[m, :] . w[n, :] (+ bias[n]) for MB input rows against R weight rows at a time, for
// weight rows [n0, n1); `far` and `near` walk the stream kPrefetchL2Bytes and kPrefetchL1Bytes ahead.
template <int MB, int R>
void gemv_block(const uint16_t* x, int64_t rows, const uint16_t* w, int64_t K, int64_t n0, int64_t n1,
                const uint16_t* bias, uint16_t* y, int64_t N, bool accumulate, FarAhead& far, NearAhead& near) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m512 acc[MB][R];
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    const uint16_t* wr = w + n * K;
    for (int64_t k = 0; k < K; k += 32) {
      for (int r = 0; r < R; ++r) far.line(), near.line();
      __m512bh b[R];
      for (int r = 0; r < R; ++r) b[r] = (__m512bh)_mm512_loadu_si512(wr + r * K + k);
      for (int m = 0; m < MB; ++m) {
        if (m >= rows) break;
        const __m512bh a = (__m512bh)_mm512_loadu_si512(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], a, b[r]);
      }
    }
    for (int m = 0; m < rows; ++m)
      for (int r = 0; r < R; ++r) put(y + m * N + n + r, _mm512_reduce_add_ps(acc[m][r]), bias, n + r, accumulate);
  }
  for (; n < n1; ++n) {  // a last partial group of weight rows
    for (int64_t k = 0; k < K; k += 32) far.line(), near.line();
    for (int m = 0; m < rows; ++m) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x + m * K + k),
                               (__m512bh)_mm512_loadu_si512(w + n * K + k));
      put(y + m * N + n, _mm512_reduce_add_ps(acc), bias, n, accumulate);
    }
  }
}

constexpr int64_t kMaxGemvRows = 8;  // more rows re-read the weights: torch's GEMM is better there

// Weight rows [n0, n1) of y [M, N] = x [M, K] w [N, K]^T (+ bias), M <= kMaxGemvRows, K a multiple of 32,
// with the thread's weight stream walked by `far` and `near` (only `near` for one row).
void gemv_rows(const uint16_t* x, int64_t M, const uint16_t* w, int64_t K, int64_t N, int64_t n0, int64_t n1,
               const uint16_t* bias, uint16_t* y, bool accumulate, FarAhead& far, NearAhead& near) {
  if (M == 1) {
    gemv_one_row(x, w, K, n0, n1, bias, y, accumulate, near);
  } else if (M == 2) {
    gemv_block<2, 4>(x, M, w, K, n0, n1, bias, y, N, accumulate, far, near);
  } else if (M <= 4) {
    gemv_block<4, 4>(x, M, w, K, n0, n1, bias, y, N, accumulate, far, near);
  } else {
    gemv_block<8, 2>(x, M, w, K, n0, n1, bias, y, N, accumulate, far, near);
  }
}

// The same over all of W, threads taking contiguous ranges of weight rows (multiples of 8 rows, so
// groups never straddle), each its own stream.
void gemv(const uint16_t* x, int64_t M, const uint16_t* w, int64_t K, int64_t N, const uint16_t* bias,
          uint16_t* y) {
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
  if (M > kMaxGemvRows || K % 32 != 0) return at::linear(x, w, bias);
  auto y = torch::empty({M, N}, x.options());
  gemv(bits(x), M, bits(w), K, N, bias ? bits(*bias) : nullptr, bits_mut(y));
  return y;
}

// ------------------------------------------------------------------------------------ paged attention

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
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

// Attention of one request's query heads over a range of its tokens, read through its block table,
// for head_dim = 16 DV (a compile-time size, so a row and its accumulators stay in registers).
// A part covers the query heads of KV heads [kh0, kh1) and tokens [t0, t1). For each query head it
// leaves, in float32, the largest score m, l = sum exp(score - m) and acc = sum exp(score - m) V;
// parts over different token ranges combine exactly (see merge below). The cache rows come from
// scattered blocks and each is used once, so they are prefetched a number of tokens ahead of use.
template <typename T, int DV>
void attend_part(const T* q, const T* kc, const T* vc, const int64_t* bt, int64_t b, int64_t kh0, int64_t kh1,
                 int64_t t0, int64_t t1, int64_t H, int64_t KVH, int64_t nb, int64_t bs, float scale,
                 float* m_out, float* l_out, float* acc_out, std::vector<float>& scores,
                 std::vector<int64_t>& offsets) {
  constexpr int64_t D = DV * 16;
  const int64_t G = H / KVH, NH = (kh1 - kh0) * G, n = t1 - t0;
  scores.resize(NH * std::max<int64_t>(n, 1));
  // The part's rows of a token are adjacent in its cache slot; their offsets are worked out once.
  offsets.resize(std::max<int64_t>(n, 1));
  for_each_slot(bt + b * nb, bs, t0, t1, [&](int64_t t, int64_t slot) { offsets[t - t0] = (slot * KVH + kh0) * D; });
  auto rows = [&](const T* cache, int64_t t) { return cache + offsets[t - t0]; };
  const int64_t row_bytes = (kh1 - kh0) * D * (int64_t)sizeof(T);
  constexpr int64_t kAhead = 16;  // tokens
  auto prefetch = [&](const T* cache, int64_t t, auto locality) {
    if (t >= t1) return;
    const char* p = reinterpret_cast<const char*>(rows(cache, t));
    for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(p + o, 0, decltype(locality)::value);
  };
  using L1 = std::integral_constant<int, 3>;
  using L2 = std::integral_constant<int, 2>;
  for (int64_t t = t0; t < std::min(t1, t0 + kAhead); ++t) prefetch(kc, t, L1{});

  // Scores, 16 tokens at a time: a vector of partial products per token, their lanes summed for all
  // 16 together. bf16 rows are multiplied as bf16 pairs (vdpbf16ps: exact products, float32 sums);
  // float32 rows with FMAs. The V rows of those tokens are asked into L2 on the way.
  const __m512 sc = _mm512_set1_ps(scale);
  constexpr int PAIRS = (DV + 1) / 2;  // 32-element pieces of a bf16 row, the last half empty for odd DV
  constexpr __mmask32 kLastPiece = DV % 2 ? 0xFFFFu : 0xFFFFFFFFu;
  auto piece = [](const T* p, int j) {
    const __mmask32 mask = j == PAIRS - 1 ? kLastPiece : 0xFFFFFFFFu;
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p + j * 32);
  };
  for (int64_t ta = t0; ta < t1; ta += 16) {
    const int64_t cnt = std::min<int64_t>(16, t1 - ta);
    for (int64_t i = 0; i < cnt; ++i) {
      prefetch(kc, ta + i + kAhead, L1{});
      prefetch(vc, ta + i, L2{});
    }
    for (int64_t h = 0; h < NH; ++h) {
      const T* qrow = q + (b * H + kh0 * G + h) * D;
      const int64_t off = h / G * D;  // the KV head's row within the part's rows
      __m512 part[16];
      if constexpr (std::is_same_v<T, bf16>) {
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
      _mm512_mask_storeu_ps(scores.data() + h * n + (ta - t0), (__mmask16)((1u << cnt) - 1),
                            _mm512_mul_ps(sum_lanes16(part), sc));
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
  // their accumulators held in registers.
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
        const T* v = rows(vc, t) + kh * D;
        __m512 r[DV];
        for (int j = 0; j < DV; ++j) r[j] = load16(v + j * 16);
        for (int g = 0; g < GB; ++g) {
          if (g >= gc) break;
          const __m512 pg = _mm512_set1_ps(p[g * n + t]);
          for (int j = 0; j < DV; ++j) a[g][j] = _mm512_fmadd_ps(pg, r[j], a[g][j]);
        }
      }
      for (int g = 0; g < gc; ++g)
        for (int j = 0; j < DV; ++j) _mm512_storeu_ps(acc_out + (kh * G + g0 + g) * D + j * 16, a[g][j]);
    }
}

// out[b, h, :] = softmax(q[b, h] . K[t] * scale) V over each request's tokens (the last `window` ones
// when window > 0). Work is split into parts of (request, KV heads, token range). A part takes all of a
// request's KV heads over a range of its tokens: a token's K (and V) rows of every head are adjacent in
// its slot, so a part reads each block front to back, a stream the hardware prefetches (parts of one
// head each read every third row piece, and mostly wait for memory). Each request's tokens are split
// into as many ranges as it takes for the parts to come out even over the threads, while ranges stay
// kMinChunk tokens or longer; where that still leaves fewer parts than threads (one short request),
// parts go per KV head instead. Parts are then merged per query head: with M the largest m,
// out = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c. The plan depends only on the context lengths
// and the window, so a decode step makes it once for all its layers of one window.
struct AttentionPlan {
  int64_t B, H, KVH, D, G, nb, bs, window, head_groups, heads_per_group, chunks = 1, parts, per_part;
  float scale;
  const int64_t* bt;
  const int64_t* lens;
  std::vector<float> m, l, acc;  // per part and query head: the largest score, exp-sum and V-sum

  AttentionPlan(const int64_t* block_tables, const int64_t* seq_lens, int64_t B_, int64_t H_, int64_t KVH_,
                int64_t D_, int64_t nb_, int64_t bs_, float scale_, int64_t window_, int64_t threads)
      : B(B_), H(H_), KVH(KVH_), D(D_), G(H_ / KVH_), nb(nb_), bs(bs_), window(window_), scale(scale_),
        bt(block_tables), lens(seq_lens) {
    int64_t longest = 0;
    for (int64_t b = 0; b < B; ++b) longest = std::max(longest, lens[b]);
    constexpr int64_t kMinChunk = 32;  // tokens: shorter ranges cost more in merging than they save
    // A part per thread for one request (each thread's tokens one range: fewer, longer parts run faster);
    // a few requests each split in two or more, so that unequal lengths even out; among the counts
    // possible, the largest that divides evenly over the threads.
    const int64_t most = B >= 2 * threads ? 1 : std::max<int64_t>(2, threads / B);
    for (int64_t c = 2; threads > 1 && c <= most && longest / c >= kMinChunk; ++c)
      if (B * c % threads == 0 || B * chunks % threads != 0) chunks = c;
    const bool per_head = B * chunks < threads;
    if (per_head) chunks = 1;
    head_groups = per_head ? KVH : 1;
    heads_per_group = per_head ? 1 : KVH;
    parts = B * head_groups * chunks;
    per_part = heads_per_group * G;
    m.resize(parts * per_part);
    l.resize(parts * per_part);
    acc.resize(parts * per_part * D);
  }

  struct Scratch {
    std::vector<float> scores;
    std::vector<int64_t> offsets;
  };

  // Part i: request b's KV heads [kh0, kh1) over its tokens [t0, t1).
  struct Part {
    int64_t b, kh0, kh1, t0, t1;
  };
  Part part(int64_t i) const {
    const int64_t b = i / (head_groups * chunks), kg = i / chunks % head_groups, c = i % chunks;
    const int64_t len = lens[b], start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    return {b, kg * heads_per_group, (kg + 1) * heads_per_group, start + (len - start) * c / chunks,
            start + (len - start) * (c + 1) / chunks};
  }

  template <typename T>
  void run_part(int64_t i, const T* q, const T* kc, const T* vc, Scratch& s) {
    const auto [b, kh0, kh1, t0, t1] = part(i);
    float *mo = &m[i * per_part], *lo = &l[i * per_part], *ao = &acc[i * per_part * D];
    switch (D / 16) {  // head_dim is a multiple of 16, at most 128
#define TOKENMILL_PART(DV)                                                                                   \
  case DV:                                                                                                   \
    return attend_part<T, DV>(q, kc, vc, bt, b, kh0, kh1, t0, t1, H, KVH, nb, bs, scale, mo, lo, ao, s.scores, \
                              s.offsets);
      TOKENMILL_PART(1) TOKENMILL_PART(2) TOKENMILL_PART(3) TOKENMILL_PART(4)
      TOKENMILL_PART(5) TOKENMILL_PART(6) TOKENMILL_PART(7) TOKENMILL_PART(8)
#undef TOKENMILL_PART
    }
  }

  // Asks for part i's K and V rows into L2 ahead of run_part (they come from scattered blocks, and
  // run_part alone would mostly wait for them).
  template <typename T>
  void prefetch_part(int64_t i, const T* kc, const T* vc) const {
    const Part p = part(i);
    const int64_t bytes = (p.kh1 - p.kh0) * D * (int64_t)sizeof(T);
    for_each_slot(bt + p.b * nb, bs, p.t0, p.t1, [&](int64_t, int64_t slot) {
      const int64_t off = (slot * KVH + p.kh0) * D;
      for (int64_t o = 0; o < bytes; o += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(kc + off) + o, 0, 2);
        __builtin_prefetch(reinterpret_cast<const char*>(vc + off) + o, 0, 2);
      }
    });
  }

  // out[j] for query head j = b * H + h, from its parts.
  template <typename T>
  void merge(int64_t j, T* out, float* o) const {
    const int64_t b = j / H, h = j % H, kg = (h / G) / heads_per_group, hh = h - kg * per_part;
    const int64_t first = (b * head_groups + kg) * chunks;
    float M = -INFINITY;
    for (int64_t c = 0; c < chunks; ++c) M = std::max(M, m[(first + c) * per_part + hh]);
    float denom = 0.f;
    std::fill(o, o + D, 0.f);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k = (first + c) * per_part + hh;
      if (l[k] == 0.f) continue;  // an empty token range
      const float w = std::exp(m[k] - M);
      denom += w * l[k];
      for (int64_t d = 0; d < D; ++d) o[d] += w * acc[k * D + d];
    }
    const float inv = 1.f / denom;
    for (int64_t d = 0; d < D; ++d) out[j * D + d] = static_cast<T>(o[d] * inv);
  }
};

template <typename T>
void decode_attention(const T* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* lens, T* out,
                      int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t nb, int64_t bs, float scale,
                      int64_t window) {
  AttentionPlan plan(bt, lens, B, H, KVH, D, nb, bs, scale, window, at::get_num_threads());
  at::parallel_for(0, plan.parts, 1, [&](int64_t i0, int64_t i1) {
    AttentionPlan::Scratch s;
    for (int64_t i = i0; i < i1; ++i) plan.run_part<T>(i, q, kc, vc, s);
  });
  at::parallel_for(0, B * H, 16, [&](int64_t j0, int64_t j1) {
    std::vector<float> o(D);
    for (int64_t j = j0; j < j1; ++j) plan.merge<T>(j, out, o.data());
  });
}

// ------------------------------------------------------------------------------- element-wise pieces

// y = w * bf16(x / rms(x)) over rows of length n (a multiple of 16), as the eager model computes it:
// the normalisation in float32, rounded to bf16, then scaled by the bf16 weight and rounded again.
void rms_norm_rows(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* xr = x + r * n;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 v = load_bf16(xr + i);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / n + eps));
    for (int64_t i = 0; i < n; i += 16)
      store_bf16(y + r * n + i, _mm512_mul_ps(load_bf16(w + i), round_bf16(_mm512_mul_ps(load_bf16(xr + i), inv))));
  }
}

// x[i] = bf16(x[i] + d[i]): the residual stream (n a multiple of 16).
void add_into(uint16_t* x, const uint16_t* d, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) store_bf16(x + i, _mm512_add_ps(load_bf16(x + i), load_bf16(d + i)));
}

// out = bf16(bf16(silu(gate)) * up) over n values, n a multiple of 16.
void silu_mul(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 g = load_bf16(gate + i), u = load_bf16(up + i);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    store_bf16(out + i, _mm512_mul_ps(round_bf16(silu), u));
  }
}

// Non-interleaved rotary embedding of one head in place; cos and sin hold D values (both halves).
void rotate(uint16_t* v, const uint16_t* cos, const uint16_t* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = from_bf16(v[i]), b = from_bf16(v[i + half]);
    v[i] = to_bf16(a * from_bf16(cos[i]) - b * from_bf16(sin[i]));
    v[i + half] = to_bf16(b * from_bf16(cos[i + half]) + a * from_bf16(sin[i + half]));
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

// ------------------------------------------------------------------------------------------- team

// Waits until `n` threads have arrived. Spinning costs well under a microsecond where a parallel region
// per operation costs several, which adds up over the ~200 phases of a decode step. A thread that has
// spun for 0.1 ms (far longer than threads in step drift apart) sleeps on a futex instead: the thread
// it waits for has lost its core (to the server's event loop, or a kernel thread), and an idle core
// lets the scheduler move it there.
class SpinBarrier {
 public:
  void wait(int n) {
    if (n <= 1) return;
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

 private:
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

// Runs body(worker, workers, barrier) on every thread of one parallel region of team_size() threads.
// The region may have fewer threads than asked for (one, inside another region): each thread counts
// itself in, and all wait until every index of the region is taken before starting, so `workers` is
// the true number of threads.
template <typename F>
void run_team(int64_t want, const F& body) {
  std::atomic<int64_t> taken{0};
  std::atomic<int> joined{0};
  SpinBarrier barrier;
  at::parallel_for(0, want, 1, [&](int64_t i0, int64_t i1) {
    const int me = joined.fetch_add(1);
    taken.fetch_add(i1 - i0);
    while (taken.load() < want) std::this_thread::yield();
    body(me, joined.load(), barrier);
  });
}

// Rows [begin, end) of N that worker w of n takes: equal shares, cut at multiples of 16 rows.
inline std::pair<int64_t, int64_t> share(int64_t N, int w, int n) {
  auto cut = [&](int i) { return i == n ? N : N * i / n / 16 * 16; };
  return {cut(w), cut(w + 1)};
}

// ---------------------------------------------------------------------------------- fused decoder

c10::optional<torch::Tensor> opt(const c10::optional<torch::Tensor>& t) {
  if (t && t->defined()) return t->contiguous();
  return c10::nullopt;
}

// One decoder layer's weights (bf16, contiguous), its slice of the KV cache and its attention window.
struct LayerWeights {
  torch::Tensor input_norm, qkv, o, post_norm, gate_up, down, k_cache, v_cache;
  c10::optional<torch::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias, q_norm, k_norm;
  int64_t window;  // the last `window` tokens; 0: all of them
};

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

class FusedDecoder {
 public:
  // embed [vocab, hidden] bf16: the token embedding; cos, sin [positions, head_dim] float32: the rotary
  // tables (rounded to bf16 as the eager model rounds them).
  FusedDecoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps,
               double scale, int64_t block_size, torch::Tensor final_norm, torch::Tensor embed,
               torch::Tensor cos, torch::Tensor sin)
      : H_(num_heads), KVH_(num_kv_heads), D_(head_dim), I_(intermediate), eps_((float)eps),
        scale_((float)scale), bs_(block_size), final_norm_(final_norm.contiguous()),
        embed_(embed.contiguous()), cos_(cos.contiguous()), sin_(sin.contiguous()) {
    TORCH_CHECK(D_ % 16 == 0 && D_ <= 128, "head_dim must be a multiple of 16, at most 128");
    TORCH_CHECK(H_ % KVH_ == 0, "heads must be a multiple of KV heads");
    TORCH_CHECK(bs_ >= 1, "block_size must be at least 1");
    TORCH_CHECK(embed_.scalar_type() == torch::kBFloat16 && embed_.dim() == 2, "embed: bf16 [vocab, hidden]");
    TORCH_CHECK(cos_.scalar_type() == torch::kFloat && cos_.sizes() == sin_.sizes() && cos_.size(1) == D_,
                "cos, sin: float32 [positions, head_dim]");
  }

  void add_layer(torch::Tensor input_norm, torch::Tensor qkv, c10::optional<torch::Tensor> qkv_bias,
                 c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm, torch::Tensor o,
                 c10::optional<torch::Tensor> o_bias, torch::Tensor post_norm, torch::Tensor gate_up,
                 c10::optional<torch::Tensor> gate_up_bias, torch::Tensor down,
                 c10::optional<torch::Tensor> down_bias, torch::Tensor k_cache, torch::Tensor v_cache,
                 int64_t window) {
    for (const auto* t : {&input_norm, &qkv, &o, &post_norm, &gate_up, &down, &k_cache, &v_cache})
      TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->is_contiguous(), "bf16 contiguous tensors expected");
    TORCH_CHECK(qkv.size(0) == (H_ + 2 * KVH_) * D_ && k_cache.size(1) == KVH_ && k_cache.size(2) == D_,
                "layer shapes do not match the decoder's heads");
    TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), "k_cache, v_cache: [slots, KV heads, head_dim]");
    TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
    cache_slots_ = layers_.empty() ? k_cache.size(0) : std::min(cache_slots_, k_cache.size(0));
    layers_.push_back({input_norm, qkv, o, post_norm, gate_up, down, k_cache, v_cache, opt(qkv_bias),
                       opt(o_bias), opt(gate_up_bias), opt(down_bias), opt(q_norm), opt(k_norm), window});
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
      StepPlans plan = attention_plan(s, threads);
      run_team(threads, [&](int w, int n, SpinBarrier& barrier) {
        Walks walks(streams_[n][w], s.B, false);
        ThreadState ts(D_);
        team_layers(s, plan, buf, bits_mut(in.x), w, n, barrier, walks, ts);
        for (int64_t b = w; b < s.B; b += n)
          rms_norm_rows(bits(in.x) + b * s.hidden, bits(final_norm_), bits_mut(out) + b * s.hidden, 1, s.hidden, eps_);
      });
    } else {
      forward_batched(s, in.x, out);
    }
    return out;
  }

  // Greedy decoding, up to `steps` steps in one call (slots [steps, B]: the cache slot of each step's new
  // token). Each step runs forward and takes, for every request, the largest of its logits (hidden x
  // lm_head^T [vocab, hidden] in bf16, as linear_bf16 and argmax_rows compute them for the sampler) as
  // its next input. The call ends early after a step in which every request has produced one of its
  // stop_ids, or once interrupt() has been called (from any thread; the step running completes).
  // Returns the tokens [steps done, B].
  torch::Tensor decode_greedy(torch::Tensor input_ids, torch::Tensor positions, torch::Tensor slots,
                              torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor lm_head,
                              std::vector<std::vector<int64_t>> stop_ids) {
    const int64_t B = input_ids.size(0), steps = slots.size(0);
    TORCH_CHECK(slots.dim() == 2 && slots.size(1) == B && (int64_t)stop_ids.size() == B, "slots: [steps, batch]");
    TORCH_CHECK(lm_head.scalar_type() == torch::kBFloat16 && lm_head.dim() == 2 && lm_head.size(1) == embed_.size(1),
                "lm_head: bf16 [vocab, hidden]");
    Burst burst{input_ids.to(torch::kLong).clone(), positions.to(torch::kLong).clone(),
                seq_lens.to(torch::kLong).clone(), slots.to(torch::kLong).contiguous(), lm_head.contiguous(),
                torch::empty({steps, B}, torch::kLong), std::move(stop_ids), std::vector<bool>(B, false)};
    TORCH_CHECK(burst.ids.size(0) == B && burst.pos.size(0) == B && burst.lens.size(0) == B &&
                block_tables.size(0) == B, "batch mismatch");
    check_bounds(burst.slots, block_tables, burst.lens, std::max<int64_t>(steps - 1, 0));
    int64_t done = 0;
    if (runs_in_team(B)) {
      done = greedy_team(burst, block_tables, steps);
    } else {
      while (done < steps) {
        const auto logits = linear_bf16(forward(burst.ids, burst.pos, burst.slots[done], block_tables, burst.lens),
                                        burst.lm_head, c10::nullopt);
        const bf16* rows = logits.data_ptr<bf16>();
        const int64_t V = logits.size(1);
        for (int64_t b = 0; b < B; ++b) burst.take(done, b, argmax_row(rows + b * V, V));
        if (!burst.go_on(++done, steps, interrupted_.load())) break;
      }
    }
    return burst.tokens.slice(0, 0, done);
  }

  // forward, then the output layer: logits [B, vocab] = hidden x lm_head^T in bf16 (as linear_bf16
  // computes them), for a few requests in one parallel region, each thread's weight stream running on
  // from its rows of the layers into its share of lm_head's rows.
  torch::Tensor logits(torch::Tensor input_ids, torch::Tensor positions, torch::Tensor slots,
                       torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor lm_head) {
    TORCH_CHECK(lm_head.scalar_type() == torch::kBFloat16 && lm_head.dim() == 2 && lm_head.size(1) == embed_.size(1),
                "lm_head: bf16 [vocab, hidden]");
    if (!runs_in_team(input_ids.size(0)))
      return linear_bf16(forward(input_ids, positions, slots, block_tables, seq_lens), lm_head, c10::nullopt);
    StepInputs in = prepare(input_ids, positions, slots, block_tables, seq_lens);
    const Step& s = in.step;
    auto head = lm_head.contiguous();
    auto out = torch::empty({s.B, head.size(0)}, in.x.options());
    const int threads = team_threads();
    TeamBuffers buf(*this, s.B, threads);
    StepPlans plan = attention_plan(s, threads);
    run_team(threads, [&](int w, int n, SpinBarrier& barrier) {
      const auto stream = stream_with_head(w, n, head);
      Walks walks(stream, s.B, false);
      ThreadState ts(D_);
      team_layers(s, plan, buf, bits_mut(in.x), w, n, barrier, walks, ts);
      team_logits(bits(in.x), s.B, head, w, n, buf, bits_mut(out), walks);
    });
    return out;
  }

  // Ends a running decode_greedy after its current step; clear_interrupt() before the next.
  void interrupt() { interrupted_.store(true); }
  void clear_interrupt() { interrupted_.store(false); }

 private:
  std::atomic<bool> interrupted_{false};

  // The inputs of one decode step, as raw views of tensors the caller keeps.
  struct Step {
    int64_t B, hidden;
    const int64_t* slot;  // [B]
    const int64_t* bt;    // [B, nb]
    int64_t nb;
    const int64_t* lens;  // [B]
    uint16_t* cos;        // [B, head_dim], filled by begin_step
    uint16_t* sin;
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
    const int64_t B = in.ids.size(0), hidden = embed_.size(1);
    TORCH_CHECK(in.pos.size(0) == B && in.slot.size(0) == B && in.bt.size(0) == B && in.lens.size(0) == B,
                "batch mismatch");
    TORCH_CHECK(in.bt.dim() == 2, "block_tables: [batch, blocks]");
    check_bounds(in.slot, in.bt, in.lens, 0);
    const auto opts = torch::TensorOptions().dtype(torch::kBFloat16);
    in.x = torch::empty({B, hidden}, opts);
    in.cos = torch::empty({B, D_}, opts);
    in.sin = torch::empty({B, D_}, opts);
    in.step = {B, hidden, in.slot.data_ptr<int64_t>(), in.bt.data_ptr<int64_t>(), in.bt.size(1),
               in.lens.data_ptr<int64_t>(), bits_mut(in.cos), bits_mut(in.sin)};
    begin_step(in.step, in.ids.data_ptr<int64_t>(), in.pos.data_ptr<int64_t>(), bits_mut(in.x));
    return in;
  }

  // x = the embeddings of the step's tokens; the step's rotary rows for their positions.
  void begin_step(const Step& s, const int64_t* ids, const int64_t* pos, uint16_t* x) const {
    const float* cos_table = cos_.data_ptr<float>();
    const float* sin_table = sin_.data_ptr<float>();
    for (int64_t b = 0; b < s.B; ++b) {
      const int64_t id = ids[b], p = pos[b];
      TORCH_CHECK(id >= 0 && id < embed_.size(0), "token id out of range");
      TORCH_CHECK(p >= 0 && p < cos_.size(0), "position beyond the rotary table");
      std::memcpy(x + b * s.hidden, bits(embed_) + id * s.hidden, s.hidden * 2);
      for (int64_t d = 0; d < D_; ++d) {
        s.cos[b * D_ + d] = to_bf16(cos_table[p * D_ + d]);
        s.sin[b * D_ + d] = to_bf16(sin_table[p * D_ + d]);
      }
    }
  }

  // A burst's state: each request's next input, position and context length, advanced step by step.
  struct Burst {
    torch::Tensor ids, pos, lens, slots, lm_head, tokens;
    std::vector<std::vector<int64_t>> stop_ids;
    std::vector<bool> stopped;
    // Request b's token of step `step`: recorded, and its next input.
    void take(int64_t step, int64_t b, int64_t t) {
      const int64_t B = ids.size(0);
      tokens.data_ptr<int64_t>()[step * B + b] = ids.data_ptr<int64_t>()[b] = t;
      ++pos.data_ptr<int64_t>()[b];
      ++lens.data_ptr<int64_t>()[b];
      stopped[b] = stopped[b] || std::find(stop_ids[b].begin(), stop_ids[b].end(), t) != stop_ids[b].end();
    }
    // Whether another step follows `done` of `steps`.
    bool go_on(int64_t done, int64_t steps, bool interrupted) const {
      return done < steps && !interrupted && !std::all_of(stopped.begin(), stopped.end(), [](bool x) { return x; });
    }
  };

  // Whether a batch of B requests runs in one parallel region (the GEMV kernel's shapes).
  bool runs_in_team(int64_t B) const {
    return B <= kMaxGemvRows && embed_.size(1) % 32 == 0 && (H_ * D_) % 32 == 0 && I_ % 32 == 0;
  }

  // The threads a parallel region asks for, with their weight streams planned.
  int team_threads() {
    const int threads = (int)team_size();
    plan_streams(threads, embed_.size(1));
    return threads;
  }

  // The attention plans of a step: one per distinct window among the layers, and the one each layer uses.
  struct StepPlans {
    std::vector<AttentionPlan> plans;
    std::vector<size_t> of_layer;
    AttentionPlan& operator[](size_t layer) { return plans[of_layer[layer]]; }
  };

  // How the attention of the step's requests splits over the threads, per layer. A window that no
  // request's context exceeds selects every token, as no window does, so the two share a plan.
  StepPlans attention_plan(const Step& s, int threads) const {
    int64_t longest = 0;
    for (int64_t b = 0; b < s.B; ++b) longest = std::max(longest, s.lens[b]);
    StepPlans p;
    std::vector<int64_t> windows;
    for (const auto& L : layers_) {
      const int64_t window = L.window < longest ? L.window : 0;
      size_t i = std::find(windows.begin(), windows.end(), window) - windows.begin();
      if (i == windows.size()) {
        windows.push_back(window);
        p.plans.emplace_back(s.bt, s.lens, s.B, H_, KVH_, D_, s.nb, bs_, scale_, window, threads);
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
    const auto slot = slots.to(torch::kLong).contiguous();
    const auto bt = block_tables.to(torch::kLong).contiguous();
    const auto lens = seq_lens.to(torch::kLong).contiguous();
    const int64_t* sp = slot.data_ptr<int64_t>();
    for (int64_t i = 0; i < slot.numel(); ++i)
      TORCH_CHECK(sp[i] >= 0 && sp[i] < cache_slots_, "cache slot ", sp[i], " is outside the KV cache (",
                  cache_slots_, " slots)");
    check_block_tables(bt.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), lens.size(0), bt.size(1), bs_,
                       cache_slots_ / bs_, grow);
  }

  // Request b's new q, k, v (one row of the qkv projection): q/k norms where the model has them, rotary
  // on q and k, q copied out for attention, k and v written to the cache slot of the new token.
  void place_token(const LayerWeights& L, const Step& s, int64_t b, uint16_t* row, uint16_t* q) {
    const int64_t QS = H_ * D_, KVS = KVH_ * D_;
    uint16_t* qb = row;
    uint16_t* kb = row + QS;
    const uint16_t* vb = row + QS + KVS;
    if (L.q_norm) {
      rms_norm_rows(qb, bits(*L.q_norm), qb, H_, D_, eps_);
      rms_norm_rows(kb, bits(*L.k_norm), kb, KVH_, D_, eps_);
    }
    const uint16_t* cb = s.cos + b * D_;
    const uint16_t* sb = s.sin + b * D_;
    for (int64_t i = 0; i < H_; ++i) rotate(qb + i * D_, cb, sb, D_);
    for (int64_t i = 0; i < KVH_; ++i) rotate(kb + i * D_, cb, sb, D_);
    std::memcpy(q + b * QS, qb, QS * 2);
    const int64_t slot = s.slot[b];
    std::memcpy(reinterpret_cast<uint16_t*>(L.k_cache.data_ptr()) + slot * KVS, kb, KVS * 2);
    std::memcpy(reinterpret_cast<uint16_t*>(L.v_cache.data_ptr()) + slot * KVS, vb, KVS * 2);
  }

  // The step's intermediate results, shared by the threads of a team.
  struct TeamBuffers {
    std::vector<uint16_t> qkv, q, attn, gu, act;
    std::vector<uint16_t> normed;  // each thread's own copy of the normed input
    TeamBuffers(const FusedDecoder& d, int64_t B, int threads)
        : qkv(B * (d.H_ + 2 * d.KVH_) * d.D_), q(B * d.H_ * d.D_), attn(B * d.H_ * d.D_), gu(B * 2 * d.I_),
          act(B * d.I_), normed(threads * B * d.embed_.size(1)) {}
  };

  // What a thread of a team keeps for itself.
  struct ThreadState {
    AttentionPlan::Scratch scratch;
    std::vector<float> merged;
    explicit ThreadState(int64_t D) : merged(D) {}
  };

  // The walks ahead of a thread's weight stream: started their distance ahead, those first bytes asked
  // for now. With `wrap`, the walk goes on from the stream's end to its start (the next step of a burst).
  struct Walks {
    FarAhead far;
    NearAhead near;
    Walks(const std::vector<Segment>& stream, int64_t B, bool wrap)
        : far(stream.data(), stream.size(), wrap), near(stream.data(), stream.size(), wrap) {
      if (B == 1) {
        near.advance(kPrefetchRowBytes, true);
      } else {
        far.advance(kPrefetchL2Bytes, true);
        near.advance(kPrefetchL1Bytes, true);
      }
    }
  };

  // A step of a few requests runs in one parallel region. Each thread computes a fixed share of every
  // projection's rows, so its weight reads for the whole step are one stream (its slices of each matrix
  // in turn) walked ahead of it across matrix boundaries; phases that need other threads' results
  // (the whole qkv row, all heads' attention, the full residual) wait at a barrier. The small
  // element-wise pieces between projections run on every thread or are split by request.
  // This is thread w of n's part of the decoder layers, on the residual stream xp [B, hidden].
  void team_layers(const Step& s, StepPlans& plans, TeamBuffers& buf, uint16_t* xp, int w, int n,
                   SpinBarrier& barrier, Walks& walks, ThreadState& ts) {
    const int64_t B = s.B, hidden = s.hidden, QS = H_ * D_, KVS = KVH_ * D_, QKV = QS + 2 * KVS;
    auto bias = [](const c10::optional<torch::Tensor>& t) { return t ? bits(*t) : nullptr; };
    const bf16* qh = reinterpret_cast<const bf16*>(buf.q.data());
    bf16* attn_h = reinterpret_cast<bf16*>(buf.attn.data());
    auto& [far, near] = walks;
    uint16_t* h = buf.normed.data() + w * B * hidden;
    const auto [r0, r1] = share(QKV, w, n);
    const auto [o0, o1] = share(hidden, w, n);
    const auto [i0, i1] = share(I_, w, n);
    const int64_t j0 = B * H_ * w / n, j1 = B * H_ * (w + 1) / n;
    uint16_t *qkv = buf.qkv.data(), *gu = buf.gu.data(), *act = buf.act.data();
    for (size_t li = 0; li < layers_.size(); ++li) {
      const LayerWeights& L = layers_[li];
      AttentionPlan& plan = plans[li];
      const bf16* kc = L.k_cache.data_ptr<bf16>();
      const bf16* vc = L.v_cache.data_ptr<bf16>();
      rms_norm_rows(xp, bits(L.input_norm), h, B, hidden, eps_);
      gemv_rows(h, B, bits(L.qkv), hidden, QKV, r0, r1, bias(L.qkv_bias), qkv, false, far, near);
      for (int64_t i = w; i < plan.parts; i += n) plan.prefetch_part<bf16>(i, kc, vc);
      barrier.wait(n);
      for (int64_t b = w; b < B; b += n) place_token(L, s, b, qkv + b * QKV, buf.q.data());
      barrier.wait(n);
      for (int64_t i = w; i < plan.parts; i += n) plan.run_part<bf16>(i, qh, kc, vc, ts.scratch);
      barrier.wait(n);
      for (int64_t j = j0; j < j1; ++j) plan.merge<bf16>(j, attn_h, ts.merged.data());
      barrier.wait(n);
      gemv_rows(buf.attn.data(), B, bits(L.o), QS, hidden, o0, o1, bias(L.o_bias), xp, true, far, near);
      barrier.wait(n);
      rms_norm_rows(xp, bits(L.post_norm), h, B, hidden, eps_);
      // This thread's gate rows and the matching up rows, so it can apply SwiGLU to them at once.
      const uint16_t* gu_bias = bias(L.gate_up_bias);
      gemv_rows(h, B, bits(L.gate_up), hidden, 2 * I_, i0, i1, gu_bias, gu, false, far, near);
      gemv_rows(h, B, bits(L.gate_up), hidden, 2 * I_, I_ + i0, I_ + i1, gu_bias, gu, false, far, near);
      for (int64_t b = 0; b < B; ++b) silu_mul(gu + b * 2 * I_ + i0, gu + b * 2 * I_ + I_ + i0, act + b * I_ + i0, i1 - i0);
      barrier.wait(n);
      gemv_rows(act, B, bits(L.down), I_, hidden, o0, o1, bias(L.down_bias), xp, true, far, near);
      barrier.wait(n);
    }
  }

  // Thread w of n's weight stream for a step that ends in the output layer: its rows of the decoder
  // layers (see plan_streams), then its share of head's rows (those team_logits gives it).
  std::vector<Segment> stream_with_head(int w, int n, const torch::Tensor& head) const {
    std::vector<Segment> stream = streams_[n][w];
    const auto [v0, v1] = share(head.size(0), w, n);
    const char* base = reinterpret_cast<const char*>(head.data_ptr());
    const int64_t row = head.size(1) * 2;
    stream.push_back({base + v0 * row, base + v1 * row});
    return stream;
  }

  // Thread w of n's share of the logits [B, vocab] of the residual stream x: the final norm (each
  // thread its own copy), then its rows of head. Returns those rows [v0, v1).
  std::pair<int64_t, int64_t> team_logits(const uint16_t* x, int64_t B, const torch::Tensor& head, int w, int n,
                                          TeamBuffers& buf, uint16_t* logits, Walks& walks) {
    const int64_t hidden = embed_.size(1), V = head.size(0);
    uint16_t* h = buf.normed.data() + w * B * hidden;
    rms_norm_rows(x, bits(final_norm_), h, B, hidden, eps_);
    const auto [v0, v1] = share(V, w, n);
    gemv_rows(h, B, bits(head), hidden, V, v0, v1, nullptr, logits, false, walks.far, walks.near);
    return {v0, v1};
  }

  // A burst of greedy steps of a few requests in one parallel region: each thread's stream runs on from
  // its share of the decoder layers to its share of the output layer's rows and back to the layers of
  // the next step, so neither the output layer nor a new step starts cold or waits for a new region.
  // Each thread takes the largest logit of its rows (bf16-rounded, as linear_bf16 leaves them; first
  // index on ties, the first NaN if any, as argmax_row), and one thread combines them in row order,
  // which gives the whole row's argmax. Returns the number of steps done.
  int64_t greedy_team(Burst& burst, const torch::Tensor& block_tables, int64_t steps) {
    const int64_t B = burst.ids.size(0), V = burst.lm_head.size(0);
    if (steps == 0) return 0;
    StepInputs in = prepare(burst.ids, burst.pos, burst.slots[0], block_tables, burst.lens);  // the first step's
    Step& s = in.step;
    s.lens = burst.lens.data_ptr<int64_t>();  // the lengths take() advances
    const int64_t* all_slots = burst.slots.data_ptr<int64_t>();
    uint16_t* x = bits_mut(in.x);
    const int threads = team_threads();
    TeamBuffers buf(*this, B, threads);
    std::vector<uint16_t> logits(B * V);
    struct Best {
      int64_t index;  // -1: an empty share
      float value;
    };
    std::vector<Best> best(threads * B);
    // Inside the region nothing may throw (the other threads would wait at a barrier for ever): the
    // positions of every step must lie in the rotary table, and every token chosen in the embedding.
    TORCH_CHECK(V <= embed_.size(0), "lm_head has more rows than the embedding");
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(burst.pos.data_ptr<int64_t>()[b] + steps <= cos_.size(0), "position beyond the rotary table");
    StepPlans plan = attention_plan(s, threads);
    int64_t done = 0;
    bool more = true;
    auto next_step = [&] {  // on one thread, while the others wait
      s.slot = all_slots + done * B;
      begin_step(s, burst.ids.data_ptr<int64_t>(), burst.pos.data_ptr<int64_t>(), x);
      plan = attention_plan(s, threads);
    };
    run_team(threads, [&](int w, int n, SpinBarrier& barrier) {
      const auto stream = stream_with_head(w, n, burst.lm_head);
      Walks walks(stream, B, true);
      ThreadState ts(D_);
      while (more) {
        team_layers(s, plan, buf, x, w, n, barrier, walks, ts);
        const auto [v0, v1] = team_logits(x, B, burst.lm_head, w, n, buf, logits.data(), walks);
        for (int64_t b = 0; b < B; ++b) {
          const bf16* row = reinterpret_cast<const bf16*>(logits.data()) + b * V;
          const int64_t i = v1 > v0 ? v0 + argmax_row(row + v0, v1 - v0) : -1;
          best[w * B + b] = {i, i >= 0 ? static_cast<float>(row[i]) : 0.f};
        }
        barrier.wait(n);
        if (w == 0) {
          for (int64_t b = 0; b < B; ++b) {
            int64_t pick = -1;
            float top = 0.f;
            for (int t = 0; t < n; ++t) {
              const Best& c = best[t * B + b];
              if (c.index < 0) continue;
              if (std::isnan(c.value)) {  // the first NaN of the row
                pick = c.index;
                break;
              }
              if (pick < 0 || c.value > top) pick = c.index, top = c.value;
            }
            burst.take(done, b, pick);
          }
          more = burst.go_on(++done, steps, interrupted_.load());
          if (more) next_step();
        }
        barrier.wait(n);
      }
    });
    return done;
  }

  // The weight bytes thread w of n reads in a step, in order: its rows of qkv, o, gate, up and down of
  // each layer (the shares team_layers gives it). Made once per thread count.
  void plan_streams(int threads, int64_t hidden) {
    if ((int)streams_.size() > threads) return;
    const int64_t QS = H_ * D_, QKV = QS + 2 * KVH_ * D_;
    streams_.assign(threads + 1, {});
    for (int n = 1; n <= threads; ++n) {
      streams_[n].resize(n);
      for (int w = 0; w < n; ++w) {
        auto& segs = streams_[n][w];
        auto rows = [&](const torch::Tensor& t, int64_t K, int64_t a, int64_t b) {
          const char* base = reinterpret_cast<const char*>(t.data_ptr());
          segs.push_back({base + a * K * 2, base + b * K * 2});
        };
        const auto [r0, r1] = share(QKV, w, n);
        const auto [o0, o1] = share(hidden, w, n);
        const auto [i0, i1] = share(I_, w, n);
        for (const auto& L : layers_) {
          rows(L.qkv, hidden, r0, r1);
          rows(L.o, QS, o0, o1);
          rows(L.gate_up, hidden, i0, i1);
          rows(L.gate_up, hidden, I_ + i0, I_ + i1);
          rows(L.down, I_, o0, o1);
        }
      }
    }
  }

  // Larger batches: operation by operation, projections through linear_bf16 (torch's GEMM).
  void forward_batched(const Step& s, torch::Tensor& x, torch::Tensor& out) {
    const int64_t B = s.B, hidden = s.hidden, QS = H_ * D_, KVS = KVH_ * D_;
    auto h = torch::empty_like(x);
    auto q = torch::empty({B, H_, D_}, x.options());
    auto attn = torch::empty({B, QS}, x.options());
    auto act = torch::empty({B, I_}, x.options());
    uint16_t* xp = bits_mut(x);
    for (auto& L : layers_) {
      rms_norm_rows(xp, bits(L.input_norm), bits_mut(h), B, hidden, eps_);
      auto qkv = linear_bf16(h, L.qkv, L.qkv_bias);
      for (int64_t b = 0; b < B; ++b) place_token(L, s, b, bits_mut(qkv) + b * (QS + 2 * KVS), bits_mut(q));
      decode_attention<bf16>(q.data_ptr<bf16>(), L.k_cache.data_ptr<bf16>(), L.v_cache.data_ptr<bf16>(),
                             s.bt, s.lens, attn.data_ptr<bf16>(), B, H_, KVH_, D_, s.nb, bs_, scale_, L.window);
      auto o = linear_bf16(attn, L.o, L.o_bias);
      add_into(xp, bits(o), B * hidden);
      rms_norm_rows(xp, bits(L.post_norm), bits_mut(h), B, hidden, eps_);
      auto gu = linear_bf16(h, L.gate_up, L.gate_up_bias);
      for (int64_t b = 0; b < B; ++b)
        silu_mul(bits(gu) + b * 2 * I_, bits(gu) + b * 2 * I_ + I_, bits_mut(act) + b * I_, I_);
      auto d = linear_bf16(act, L.down, L.down_bias);
      add_into(xp, bits(d), B * hidden);
    }
    rms_norm_rows(xp, bits(final_norm_), bits_mut(out), B, hidden, eps_);
  }

  int64_t H_, KVH_, D_, I_;
  float eps_, scale_;
  int64_t bs_;
  int64_t cache_slots_ = 0;  // the fewest slots of any layer's cache
  torch::Tensor final_norm_, embed_, cos_, sin_;
  std::vector<LayerWeights> layers_;
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
                                     double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the cache must share a dtype");
  q = q.contiguous();
  auto bt = block_tables.to(torch::kLong).contiguous();
  auto lens = seq_lens.to(torch::kLong).contiguous();
  auto out = torch::empty_like(q);
  TORCH_CHECK(bt.dim() == 2 && bt.size(0) == q.size(0) && lens.dim() == 1 && lens.size(0) == q.size(0),
              "block_tables [batch, blocks] and seq_lens [batch] must match q's batch");
  TORCH_CHECK(block_size >= 1 && window >= 0, "block_size must be at least 1, window 0 (none) or positive");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1), nb = bt.size(1);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(2) == D, "head counts do not match");
  TORCH_CHECK(D % 16 == 0 && D <= 128, "head_dim must be a multiple of 16, at most 128");
  check_block_tables(bt.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), B, nb, block_size, k_cache.size(0) / block_size,
                     0);
  if (q.scalar_type() == torch::kFloat) {
    decode_attention<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                            bt.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(), B, H, KVH, D,
                            nb, block_size, (float)scale, window);
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kBFloat16, "float32 or bfloat16 expected");
    decode_attention<bf16>(q.data_ptr<bf16>(), k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(),
                           bt.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<bf16>(), B, H, KVH, D, nb,
                           block_size, (float)scale, window);
  }
  return out;
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("gemv_bf16", &gemv_bf16, py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), release());
  m.attr("max_gemv_rows") = py::int_(kMaxGemvRows);
  m.def("paged_decode_attention", &paged_decode_attention, release());
  m.def("argmax_rows", &argmax_rows, release());
  py::class_<FusedDecoder>(m, "FusedDecoder")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, double, int64_t, torch::Tensor, torch::Tensor,
                    torch::Tensor, torch::Tensor>())
      .def("add_layer", &FusedDecoder::add_layer)
      .def("forward", &FusedDecoder::forward, release())
      .def("decode_greedy", &FusedDecoder::decode_greedy, release())
      .def("logits", &FusedDecoder::logits, release())
      .def("interrupt", &FusedDecoder::interrupt)
      .def("clear_interrupt", &FusedDecoder::clear_interrupt);
}
