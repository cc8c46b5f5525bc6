// The vector instructions the kernels are written in: AVX-512 (F, BW, DQ, VL) intrinsics.
//
// CPUs with AVX-512 compile them as they are. Other x86-64 CPUs with AVX2, FMA and F16C (most laptops and
// desktops, AMD before Zen 4) build with TOKENMILL_SIMDE defined: the intrinsics then come from SIMDe
// (the simde-py package's headers), which carries out each 512-bit operation as two 256-bit AVX2 ones, so
// one source serves both. What SIMDe lacks or does differently is written below:
//   - masked loads and stores: SIMDe's read all 64 bytes, and its masked store writes zeros into the
//     lanes outside the mask. The kernels use them on the tails of rows, where the bytes past the end may
//     belong to another buffer (or to no page at all), so these touch only the lanes in the mask;
//   - rounding to integers, which SIMDe 0.8 gets wrong for the kernels' immediate;
//   - integer multiply-adds and a permute that SIMDe 0.8 does lane by lane in scalar code (10x slower);
//   - a few conversions and reductions SIMDe 0.8 does not provide, done on the two 256-bit halves in the
//     order the AVX-512 instructions use (reductions add the same pairs, so they round alike).
// Include this after <immintrin.h> (and torch's headers, which include it): SIMDe's names replace the
// compiler's AVX-512 intrinsics from here on.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(TOKENMILL_SIMDE)

#define SIMDE_X86_AVX512F_ENABLE_NATIVE_ALIASES
#define SIMDE_X86_AVX512BW_ENABLE_NATIVE_ALIASES
#define SIMDE_X86_AVX512DQ_ENABLE_NATIVE_ALIASES
#define SIMDE_X86_AVX512VL_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

namespace tm_simd {

inline __m256 lo256(__m512 v) { return simde__m512_to_private(v).m256[0]; }
inline __m256 hi256(__m512 v) { return simde__m512_to_private(v).m256[1]; }
inline __m256i lo256(__m512i v) { return simde__m512i_to_private(v).m256i[0]; }
inline __m256i hi256(__m512i v) { return simde__m512i_to_private(v).m256i[1]; }
inline __m512 join(__m256 lo, __m256 hi) {
  simde__m512_private r;
  r.m256[0] = lo;
  r.m256[1] = hi;
  return simde__m512_from_private(r);
}
inline __m512i join(__m256i lo, __m256i hi) {
  simde__m512i_private r;
  r.m256i[0] = lo;
  r.m256i[1] = hi;
  return simde__m512i_from_private(r);
}

// Masked loads and stores of the lanes in the mask only.
template <typename V, typename E>
inline V load_lanes(uint64_t mask, const void* p) {
  constexpr int kLanes = sizeof(V) / sizeof(E);
  E lanes[kLanes] = {};
  const E* src = static_cast<const E*>(p);
  for (int i = 0; i < kLanes; ++i)
    if (mask >> i & 1) lanes[i] = src[i];
  V v;
  std::memcpy(&v, lanes, sizeof(V));
  return v;
}
inline __m512 maskz_loadu_ps(__mmask16 k, const void* p) { return load_lanes<__m512, float>(k, p); }
inline __m512i maskz_loadu_epi16(__mmask32 k, const void* p) { return load_lanes<__m512i, uint16_t>(k, p); }
inline __m512i maskz_loadu_epi32(__mmask16 k, const void* p) { return load_lanes<__m512i, uint32_t>(k, p); }
inline __m256i maskz_loadu_epi16_256(__mmask16 k, const void* p) { return load_lanes<__m256i, uint16_t>(k, p); }
inline void mask_storeu_ps(void* p, __mmask16 k, __m512 v) {
  float lanes[16];
  std::memcpy(lanes, &v, sizeof(lanes));
  float* dst = static_cast<float*>(p);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) dst[i] = lanes[i];
}

// Integer products that SIMDe 0.8 does lane by lane in scalar code, and the cross-half float permute.
inline __m512i madd_epi16(__m512i a, __m512i b) {
  return join(_mm256_madd_epi16(lo256(a), lo256(b)), _mm256_madd_epi16(hi256(a), hi256(b)));
}
inline __m512i maddubs_epi16(__m512i a, __m512i b) {
  return join(_mm256_maddubs_epi16(lo256(a), lo256(b)), _mm256_maddubs_epi16(hi256(a), hi256(b)));
}
// r[i] = v[idx[i] & 15]: each half picks from both halves of v, bit 3 of the index choosing which.
inline __m512 permutexvar_ps(__m512i idx, __m512 v) {
  const __m256 lo = lo256(v), hi = hi256(v);
  auto half = [&](__m256i i) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, i), _mm256_permutevar8x32_ps(hi, i),
                            _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
  };
  return join(half(lo256(idx)), half(hi256(idx)));
}

inline __m512i cvtepi8_epi32(__m128i a) {
  return join(_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
}
inline __m512i cvtepu8_epi16(__m256i a) {
  return join(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(a)), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(a, 1)));
}
inline __m512i cvtepu8_epi32(__m128i a) {
  return join(_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)));
}
// 16 int32 to their low 16 bits (vpmovdw: truncation, no saturation).
inline __m256i cvtepi32_epi16(__m512i a) {
  const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  // Within each 128-bit lane the four low halves go to its first 8 bytes; then lanes 0 and 2 of each half.
  const __m256i lo = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(lo256(a), pick), 0x08);
  const __m256i hi = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(hi256(a), pick), 0x08);
  return _mm256_permute2x128_si256(lo, hi, 0x20);
}
// Rounding to an integer (vrndscaleps with no fraction bits kept); SIMDe 0.8 rounds to halves for the
// immediate the kernels pass (_MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC).
template <int Imm>
inline __m512 roundscale_ps(__m512 v) {
  static_assert((Imm >> 4) == 0, "only rounding to integers is provided");
  return join(_mm256_round_ps(lo256(v), Imm), _mm256_round_ps(hi256(v), Imm));
}
inline __m512 mask3_fmadd_ps(__m512 a, __m512 b, __m512 c, __mmask16 k) {
  return _mm512_mask_mov_ps(c, k, _mm512_fmadd_ps(a, b, c));
}
// The pairs AVX-512's reductions add: the 256-bit halves, then the 128-bit halves, then within 128 bits.
inline float reduce_add_ps(__m512 v) {
  const __m256 s8 = _mm256_add_ps(lo256(v), hi256(v));
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 1));
  return _mm_cvtss_f32(s4);
}
inline int reduce_add_epi32(__m512i v) {
  const __m256i s8 = _mm256_add_epi32(lo256(v), hi256(v));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
  s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1));
  return _mm_cvtsi128_si32(s4);
}

}  // namespace tm_simd

#undef _mm512_maskz_loadu_ps
#undef _mm512_maskz_loadu_epi16
#undef _mm512_maskz_loadu_epi32
#undef _mm256_maskz_loadu_epi16
#undef _mm512_mask_storeu_ps
#define _mm512_maskz_loadu_ps tm_simd::maskz_loadu_ps
#define _mm512_maskz_loadu_epi16 tm_simd::maskz_loadu_epi16
#define _mm512_maskz_loadu_epi32 tm_simd::maskz_loadu_epi32
#define _mm256_maskz_loadu_epi16 tm_simd::maskz_loadu_epi16_256
#define _mm512_mask_storeu_ps tm_simd::mask_storeu_ps
#undef _mm512_madd_epi16
#undef _mm512_maddubs_epi16
#undef _mm512_permutexvar_ps
#define _mm512_madd_epi16 tm_simd::madd_epi16
#define _mm512_maddubs_epi16 tm_simd::maddubs_epi16
#define _mm512_permutexvar_ps tm_simd::permutexvar_ps
#define _mm512_cvtepi8_epi32 tm_simd::cvtepi8_epi32
#define _mm512_cvtepu8_epi32 tm_simd::cvtepu8_epi32
#define _mm512_cvtepu8_epi16 tm_simd::cvtepu8_epi16
#define _mm512_cvtepi32_epi16 tm_simd::cvtepi32_epi16
#define _mm512_mask3_fmadd_ps tm_simd::mask3_fmadd_ps
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps(v, imm) tm_simd::roundscale_ps<(imm)>(v)
#define _mm512_reduce_add_ps tm_simd::reduce_add_ps
#define _mm512_reduce_add_epi32 tm_simd::reduce_add_epi32
#define TM_AVX512 1  // the AVX-512 code paths, here through SIMDe

#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define TM_AVX512 1
#endif
