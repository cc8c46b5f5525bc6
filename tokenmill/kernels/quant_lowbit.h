// The byte products of Q2_K, Q3_K and IQ4_XS rows (quant.h's block layouts, read as the file holds them),
// AVX-512, against inputs with one scale per 256 values (QRow::per256: q in element order, d, sums16), as
// the other K formats'. Included by quant.h inside its AVX-512 part.
//
// Q2_K and Q3_K: element 128 h + 32 j + l of a super-block (h < 2, j < 4, l < 32) has its 2 low bits at bits
// 2j of qs[32 h + l]. Shifting a copy of qs[32 h..32 h + 31] in each 256-bit half of a vector by 2j and 2j + 2
// puts elements 128 h + 64 j' .. 128 h + 64 j' + 63 in order (j = 2 j', 2 j' + 1), against one load of the
// inputs; Q3_K's third bit (bit 4h + j of hmask[l]) comes in as a byte mask. Each 16-element sub-block has
// its own scale (four lanes of a product vector): a sub-block's byte products times its scale sum in int32
// over the super-block, which then takes one float multiply, as Q6_K's do.
// (It has no includes or namespace of its own: quant.h includes it inside namespace tmq.)
#pragma once

// A float16 scale in every lane.
TM_INLINE __m512 fp16_lanes(uint16_t h) { return _mm512_cvtph_ps(_mm256_set1_epi16((short)h)); }

// The 16 scales of a Q3_K super-block (q3_k_scales' values, sub-block order) as signed bytes, built in
// registers: scalar byte stores read back as one vector would wait for the stores to complete.
TM_INLINE __m128i q3_k_scale_bytes(const uint8_t* s) {
  const __m128i m4 = _mm_set1_epi8(0xF), m2 = _mm_set1_epi8(3);
  const __m128i lo8 = _mm_loadl_epi64((const __m128i*)s);  // low 4 bits: nibble i / 8 of byte i % 8
  const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(lo8, m4), _mm_and_si128(_mm_srli_epi16(lo8, 4), m4));
  uint32_t w2;
  std::memcpy(&w2, s + 8, 4);  // top 2 bits: bits 2 (i / 4) of byte 8 + i % 4
  const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)w2), _mm_setr_epi32(0, 2, 4, 6)), m2);
  return _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
}

// The 8 scales of an IQ4_XS super-block (iq4_xs_scales' values) as int16 lanes, built in registers.
TM_INLINE __m128i iq4_xs_scale_words(const BlockIQ4_XS& x) {
  uint32_t l;
  std::memcpy(&l, x.scales_l, 4);
  const __m128i lv = _mm_cvtsi32_si128((int)l), m4 = _mm_set1_epi8(0xF);
  const __m128i lo = _mm_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_and_si128(lv, m4), _mm_and_si128(_mm_srli_epi16(lv, 4), m4)));
  const __m128i hi = _mm_and_si128(_mm_srlv_epi16(_mm_set1_epi16((short)x.scales_h), _mm_setr_epi16(0, 2, 4, 6, 8, 10, 12, 14)),
                                   _mm_set1_epi16(3));
  return _mm_sub_epi16(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi16(32));
}

// Q2_K (w = d sc_i q - dmin m_i, q 0..3) and Q3_K (THREE: w = d sc_i q, q = low 2 bits less 4 where the third
// bit is clear): the codes taken as unsigned u (Q3_K's u = q + 4, 0..7), so a lane's 4 products are below
// 2^15; Q3_K's 4 comes off through the inputs' sums of 16 (as Q6_K's 32), Q2_K's mins alike in their own sum.
template <int R, bool THREE>
inline void dot_q23_k(const uint8_t* row, const QRow* x, int64_t K, float* out) {
  constexpr int size = THREE ? 110 : 84;
  const __m512i m2 = _mm512_set1_epi8(3), c4 = _mm512_set1_epi8(4), low16 = _mm512_set1_epi32(0xFFFF);
  // vector c (0..3) of a super-block: the shift of its low half's bytes and of its high half's (as 16-bit
  // lanes), and (Q3_K) the hmask bit of each half
  __m512i shift[2], bit[4];
  for (int c = 0; c < 2; ++c)
    shift[c] = _mm512_mask_blend_epi64(0xF0, _mm512_set1_epi16((short)(4 * c)), _mm512_set1_epi16((short)(4 * c + 2)));
  for (int c = 0; c < 4; ++c)  // vector c holds h = c / 2, j = 2 (c % 2) and 2 (c % 2) + 1
    bit[c] = _mm512_mask_blend_epi64(0xF0, _mm512_set1_epi8((char)(1 << (4 * (c / 2) + 2 * (c % 2)))),
                                     _mm512_set1_epi8((char)(1 << (4 * (c / 2) + 2 * (c % 2) + 1))));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / QKK; ++b) {
    const uint8_t* blk = row + b * size;
    const uint8_t* qs = THREE ? ((const BlockQ3_K*)blk)->qs : ((const BlockQ2_K*)blk)->qs;
    __m128i scv;
    __m256i mn16;
    if constexpr (THREE) {
      scv = q3_k_scale_bytes(((const BlockQ3_K*)blk)->scales);
    } else {
      const __m128i s = _mm_loadu_si128((const __m128i*)((const BlockQ2_K*)blk)->scales);
      scv = _mm_and_si128(s, _mm_set1_epi8(0xF));
      mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), _mm_set1_epi8(0xF)));
    }
    const __m512i sc = _mm512_and_si512(_mm512_cvtepi8_epi32(scv), low16);  // (scale, 0) as int16 pairs
    const int64_t a0 = b * (QKK / QK);
    __m512i isum[R];
    __m256 mins[R];  // (Q2_K) its mins times the inputs' sums of 16, times the inputs' scale
    for (int r = 0; r < R; ++r) {
      const __m256i s16 = _mm256_loadu_si256((const __m256i*)(x[r].per256->sums16 + b * 16));
      if constexpr (THREE) {  // - 4 sum_i sc_i (sum of sub-block i's inputs)
        const __m256i m = _mm256_madd_epi16(_mm256_cvtepi8_epi16(scv), s16);
        isum[r] = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(m, 2)), 0);
      } else {
        isum[r] = _mm512_setzero_si512();
        mins[r] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mn16, s16)), _mm256_set1_ps(x[r].per256->d[a0]));
      }
    }
    __m512i hm;
    if constexpr (THREE) hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)((const BlockQ3_K*)blk)->hmask));
    for (int c = 0; c < 4; ++c) {
      const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(qs + 32 * (c / 2))));
      __m512i u = _mm512_and_si512(_mm512_srlv_epi16(q, shift[c % 2]), m2);
      if constexpr (THREE) u = _mm512_mask_add_epi8(u, _mm512_test_epi8_mask(hm, bit[c]), u, c4);
      const __m512i s = _mm512_permutexvar_epi32(pick_sub16(c), sc);
      for (int r = 0; r < R; ++r)
        isum[r] = add_scaled(isum[r], dot4(u, _mm512_loadu_si512((const void*)(x[r].per256->q + a0 * QK + 64 * c))), s);
    }
    const __m512 d = fp16_lanes(THREE ? ((const BlockQ3_K*)blk)->d : ((const BlockQ2_K*)blk)->d);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, _mm512_set1_ps(x[r].per256->d[a0])), acc[r]);
    if constexpr (!THREE) {  // the mins' part, scaled by dmin (per super-block) at the end of each
      const __m512 dmin = fp16_lanes(((const BlockQ2_K*)blk)->dmin);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fnmadd_ps(zext(mins[r]), dmin, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

// IQ4_XS: w = d sc_j v, v the table value (kIq4Values) of a 4-bit code, sc_j the 6-bit scale less 32 of
// sub-block j (32 elements: byte i of qs[16 j..] holds element i in its low nibble, 16 + i in its high one).
// A 64-byte load of codes is sub-blocks 4h..4h + 3; its nibbles, put in element order (two sub-blocks a
// vector), name |v| by a byte shuffle and v's sign by the code (codes below 8 are negative), so that |v|
// multiplies the inputs with v's sign: 16-bit pairs of products below 2^15, which take their sub-block's
// scale in one multiply-add of 16-bit pairs and sum in int32 over the super-block.
template <int R>
inline void dot_iq4_xs(const uint8_t* row, const QRow* x, int64_t K, float* out) {
  const __m512i m4 = _mm512_set1_epi8(0xF), c8 = _mm512_set1_epi8(8);
  __m128i absv = _mm_loadu_si128((const __m128i*)kIq4Values);
  absv = _mm_abs_epi8(absv);
  const __m512i table = _mm512_broadcast_i32x4(absv);
  // 64-bit lanes: sub-blocks 0 and 1 of a load in element order (low nibbles then high), then 2 and 3
  const __m512i order[2] = {_mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4)};
  // 16-bit lanes 0-15 take sub-block 2c's scale, 16-31 sub-block 2c + 1's
  __m512i pick[4];
  for (int c = 0; c < 4; ++c)
    pick[c] = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16((short)(2 * c)), _mm512_set1_epi16((short)(2 * c + 1)));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / QKK; ++b) {
    const BlockIQ4_XS& blk = ((const BlockIQ4_XS*)row)[b];
    const __m512i sc = _mm512_castsi128_si512(iq4_xs_scale_words(blk));
    const int64_t a0 = b * (QKK / QK);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      const __m512i q = _mm512_loadu_si512((const void*)(blk.qs + 64 * h));
      const __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
      for (int k = 0; k < 2; ++k) {
        const int c = 2 * h + k;
        const __m512i codes = _mm512_permutex2var_epi64(lo, order[k], hi);
        const __m512i a = _mm512_shuffle_epi8(table, codes);
        const __mmask64 neg = _mm512_cmplt_epu8_mask(codes, c8);
        const __m512i s = _mm512_permutexvar_epi16(pick[c], sc);
        for (int r = 0; r < R; ++r) {
          const __m512i xv = _mm512_loadu_si512((const void*)(x[r].per256->q + a0 * QK + 64 * c));
          const __m512i p = _mm512_maddubs_epi16(a, _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv));
#ifdef TM_QUANT_VNNI
          isum[r] = _mm512_dpwssd_epi32(isum[r], p, s);
#else
          isum[r] = _mm512_add_epi32(isum[r], _mm512_madd_epi16(p, s));
#endif
        }
      }
    }
    const __m512 d = fp16_lanes(blk.d);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, _mm512_set1_ps(x[r].per256->d[a0])), acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

