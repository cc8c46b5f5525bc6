// Tests only: the AVX512-BF16 instructions the kernels use, emulated with AVX512F, so that the kernel tests
// can run on CPUs that lack them (TOKENMILL_TEST_EMULATE_BF16=1; see tests/conftest.py). Slower, same results.
#include <immintrin.h>
static inline __m256bh emu_cvtneps_pbh(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
  __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
  return (__m256bh)h;
}
static inline __m512 emu_dpbf16_ps(__m512 src, __m512bh a, __m512bh b) {
  __m512i ai = (__m512i)a, bi = (__m512i)b;
  const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
  __m512 a1 = _mm512_castsi512_ps(_mm512_and_si512(ai, hi)), b1 = _mm512_castsi512_ps(_mm512_and_si512(bi, hi));
  __m512 a0 = _mm512_castsi512_ps(_mm512_slli_epi32(ai, 16)), b0 = _mm512_castsi512_ps(_mm512_slli_epi32(bi, 16));
  src = _mm512_fmadd_ps(a1, b1, src);
  return _mm512_fmadd_ps(a0, b0, src);
}
#define _mm512_cvtneps_pbh emu_cvtneps_pbh
#define _mm512_dpbf16_ps emu_dpbf16_ps
