// Weight formats for the linear layers: GGUF's block quantizations, read in place.
//
// A quantized weight is a matrix [N, K] stored as N rows of blocks, exactly as the GGUF file holds them.
// A product y = x W^T first quantizes each activation row to int8 in blocks of 32 (one float scale per
// block, as llama.cpp's Q8_0), then takes integer dot products of the weight's small integers with the
// activation's int8 ones and scales each block's sum in float. Every format supplies:
//   - dequantize_row: the exact float values of a row (the reference, embedding lookups, fallbacks);
//   - Dot<R>: the dot products of one weight row with R activation rows, vectorised with AVX-512 BW where
//     the compiler targets it, and written portably otherwise.
// Block layouts follow the GGUF specification (ggml's block_q8_0, block_q4_0, block_q4_1, block_q4_K,
// block_q5_K, block_q6_K, block_q5_0, block_q5_1). The K formats are read as the file holds them. Rows of the
// 32-element formats are repacked at load into the same bytes rearranged for the kernel (repack_row):
//   Q8_0  [nb float16 scales d] [codes: q + 128] (the int8 values with their sign bit flipped: unsigned
//         bytes, which VNNI multiplies with the inputs' signed ones directly; the 128 comes back through the
//         inputs' block sums, as Q4_0's 8 does)
//   Q4_0  [nb float16 scales d] [codes]
//   Q4_1  [nb float16 scales d] [nb float16 offsets m] [codes]
//   Q5_0  [nb float16 scales d] [fifth bits] [codes]
//   Q5_1  [nb float16 scales d] [nb float16 offsets m] [fifth bits] [codes]
//   MXFP4 [nb E8M0 scales] [codes] (w = 2^(e - 127) v, v the FP4 (E2M1) value a 4-bit code names; gpt-oss)
//   IQ4_NL [nb float16 scales d] [codes] (w = d v, v the int8 value of a fixed non-linear table a code names)
// Q2_K, Q3_K and IQ4_XS (quant_lowbit.h) are read as the file holds them, as the other K formats.
// The codes come in groups of 16 blocks, each group's blocks transposed by 4-byte words: word t of block l
// lies at word 16 t + l of its group. A block's words are its code bytes as GGUF orders them: 8 for Q8_0
// (elements 4t..4t + 3), 4 for the 4-bit formats (byte j holds element j in its low nibble and j + 16 in its
// high one, so word t holds elements 4t..4t + 3 and 16 + 4t..16 + 4t + 3). So the 64 bytes of word row t of
// a group hold word t of its 16 blocks, one per int32 lane of a vector: a kernel's byte products in lane l
// all belong to block l and sum in int32 over the group's word rows, to be converted and scaled once per
// group (not once per pair of blocks). The activations are transposed alike (QRow::qt). A row's last nb % 16
// blocks are no group: their codes (and fifth bits) stay as GGUF holds them. Every block keeps its place in
// bytes (16 bytes of codes a 4-bit block, 32 a Q8_0 one; 4 bytes of fifth bits). The fifth bits (bit i of a
// GGUF block's qh for element i) of a group: 64 bytes, the bits of the low nibbles of its 64 code words,
// then those of the high nibbles, each word's 4 bits in its bytes' order (bits 4i..4i + 3 for word i), so
// that a word row's nibbles take their 64 bits as one byte mask.
#pragma once

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#include "simd.h"  // AVX-512 intrinsics: native, or through SIMDe on AVX2 CPUs (TM_AVX512 either way)
#endif
#ifdef TM_AVX512
#define TM_QUANT_AVX512 1
#endif
// AVX-512 VNNI (Ice Lake, Sapphire Rapids, Zen 4 and later): vpdpbusd multiplies unsigned bytes by signed
// ones and sums each four into an int32 lane in one instruction, where AVX-512 BW takes two (vpmaddubsw,
// vpmaddwd) and a constant. Not through SIMDe: CPUs that need it have no VNNI.
#if defined(TM_QUANT_AVX512) && defined(__AVX512VNNI__) && !defined(TOKENMILL_SIMDE)
#define TM_QUANT_VNNI 1
#endif

// The small helpers of the inner loops: inlined always. The compiler otherwise leaves some out of the larger
// instantiations and calls them through the PLT, once per super-block.
#define TM_INLINE inline __attribute__((always_inline))

namespace tmq {

// GGML type ids (gguf.GGMLQuantizationType).
enum Type : int {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  IQ4_NL = 20, IQ4_XS = 23, MXFP4 = 39
};

// IQ4_NL's and IQ4_XS's table: the int8 value each 4-bit code names (codes 0-7 negative, 8-15 positive).
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// MXFP4: the FP4 (E2M1) values of the 16 codes, doubled to be integers (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
// negatives), and a block scale 2^(e - 127) halved to match: the scale of a block is e8m0_half(e).
constexpr int8_t kFp4Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
inline float e8m0_half(uint8_t e) {  // 2^(e - 128), as a float's bits (e < 2: a subnormal)
  const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The 32-element formats of 4 or 5 bits (Q4_0, Q4_1, Q5_0, Q5_1): with an offset per block (w = d q + m) or a
// fixed bias (w = d (q - 8), d (q - 16)); where a repacked row's parts start.
inline bool has_min(int type) { return type == Q4_1 || type == Q5_1; }
inline bool five_bits(int type) { return type == Q5_0 || type == Q5_1; }
struct NibbleRow {
  const uint16_t* d;   // [nb] scales
  const uint16_t* m;   // [nb] offsets (has_min)
  const uint8_t* qh;   // [4 nb bytes] fifth bits (five_bits), by group (see the top of this file)
  const uint8_t* qs;   // the codes, by group
  NibbleRow(int type, const uint8_t* row, int64_t nb)
      : d((const uint16_t*)row), m(d + nb), qh(row + (has_min(type) ? 4 : 2) * nb),
        qs(row + ((has_min(type) ? 4 : 2) + (five_bits(type) ? 4 : 0)) * nb) {}
};

constexpr int QK = 32;     // the activation block, and the block of the 32-element formats
constexpr int kGroup = 16;  // blocks a group of repacked codes (see the top of this file)

// The 4-byte code words of a block: 8 for Q8_0 (and the activations), 4 for the 4-bit formats.
inline int code_words(int type) { return type == Q8_0 ? 8 : 4; }

#if defined(TM_QUANT_AVX512) && !defined(TOKENMILL_SIMDE)
// In place, the 4 x 4 words of each 128-bit lane of v[0..3] (a vector a row) transposed.
TM_INLINE void transpose_lane_words(__m512i v[4]) {
  const __m512i u0 = _mm512_unpacklo_epi32(v[0], v[1]), u1 = _mm512_unpackhi_epi32(v[0], v[1]);
  const __m512i u2 = _mm512_unpacklo_epi32(v[2], v[3]), u3 = _mm512_unpackhi_epi32(v[2], v[3]);
  v[0] = _mm512_unpacklo_epi64(u0, u2), v[1] = _mm512_unpackhi_epi64(u0, u2);
  v[2] = _mm512_unpacklo_epi64(u1, u3), v[3] = _mm512_unpackhi_epi64(u1, u3);
}
// In place, the 4 x 4 128-bit lanes of v[0..3] transposed.
TM_INLINE void transpose_lanes(__m512i v[4]) {
  const __m512i a = _mm512_shuffle_i32x4(v[0], v[1], 0x44), b = _mm512_shuffle_i32x4(v[2], v[3], 0x44);
  const __m512i c = _mm512_shuffle_i32x4(v[0], v[1], 0xEE), d = _mm512_shuffle_i32x4(v[2], v[3], 0xEE);
  v[0] = _mm512_shuffle_i32x4(a, b, 0x88), v[1] = _mm512_shuffle_i32x4(a, b, 0xDD);
  v[2] = _mm512_shuffle_i32x4(c, d, 0x88), v[3] = _mm512_shuffle_i32x4(c, d, 0xDD);
}
// A whole group's w (4 or 8) word rows, 64 bytes each, to or from its 16 blocks of 4 w bytes in a row.
// Word rows to blocks: each lane's words transposed, then the lanes (16 blocks of 4 words); with 8 words,
// rows 0-3 and 4-7 so, then each block's two halves put side by side. Blocks to word rows: the inverse.
// group_blocks_each(group, each_block) visits the blocks in registers: each_block(l, v), v the 16 code bytes
// of block l (an __m128i) where W = 4, its 32 (an __m256i) where W = 8.
// each_block(l, v) for the 16 blocks of 8 word rows in registers: v block l's 32 bytes (an __m256i).
template <typename F>
TM_INLINE void word_rows_each_block(__m512i rows[8], F&& each_block) {
  transpose_lane_words(rows), transpose_lanes(rows);
  transpose_lane_words(rows + 4), transpose_lanes(rows + 4);
  for (int j = 0; j < 4; ++j) {
    __m512i x = _mm512_shuffle_i32x4(rows[j], rows[4 + j], 0x44), y = _mm512_shuffle_i32x4(rows[j], rows[4 + j], 0xEE);
    x = _mm512_shuffle_i32x4(x, x, 0xD8), y = _mm512_shuffle_i32x4(y, y, 0xD8);
    each_block(4 * j, _mm512_castsi512_si256(x));
    each_block(4 * j + 1, _mm512_extracti64x4_epi64(x, 1));
    each_block(4 * j + 2, _mm512_castsi512_si256(y));
    each_block(4 * j + 3, _mm512_extracti64x4_epi64(y, 1));
  }
}
template <int W, typename F>
TM_INLINE void group_blocks_each(const uint8_t* group, F&& each_block) {
  __m512i h[8];
  for (int t = 0; t < W; ++t) h[t] = _mm512_loadu_si512((const void*)(group + 64 * t));
  if constexpr (W == 8) {
    word_rows_each_block(h, each_block);
  } else {
    transpose_lane_words(h);
    transpose_lanes(h);
    for (int j = 0; j < 4; ++j) {
      each_block(4 * j, _mm512_extracti32x4_epi32(h[j], 0));
      each_block(4 * j + 1, _mm512_extracti32x4_epi32(h[j], 1));
      each_block(4 * j + 2, _mm512_extracti32x4_epi32(h[j], 2));
      each_block(4 * j + 3, _mm512_extracti32x4_epi32(h[j], 3));
    }
  }
}
TM_INLINE void group_to_blocks(const uint8_t* group, int w, uint8_t* blocks) {
  if (w == 4)
    group_blocks_each<4>(group, [&](int l, __m128i v) { _mm_storeu_si128((__m128i*)(blocks + 16 * l), v); });
  else
    group_blocks_each<8>(group, [&](int l, __m256i v) { _mm256_storeu_si256((__m256i*)(blocks + 32 * l), v); });
}
TM_INLINE void blocks_to_group(const uint8_t* blocks, int w, uint8_t* group) {
  __m512i h[2][4];
  for (int j = 0; j < 4; ++j) {
    if (w == 4) {
      h[0][j] = _mm512_loadu_si512((const void*)(blocks + 64 * j));
      continue;
    }
    __m512i x = _mm512_loadu_si512((const void*)(blocks + 128 * j)), y = _mm512_loadu_si512((const void*)(blocks + 128 * j + 64));
    x = _mm512_shuffle_i32x4(x, x, 0xD8), y = _mm512_shuffle_i32x4(y, y, 0xD8);
    h[0][j] = _mm512_shuffle_i32x4(x, y, 0x44), h[1][j] = _mm512_shuffle_i32x4(x, y, 0xEE);
  }
  for (int k = 0; k < w / 4; ++k) {
    transpose_lanes(h[k]);
    transpose_lane_words(h[k]);
    for (int t = 0; t < 4; ++t) _mm512_storeu_si512((void*)(group + 64 * (4 * k + t)), h[k][t]);
  }
}
#endif

// The codes of a row of nb blocks (w words each, block b's from blocks + b * stride) into the layout: whole
// groups transposed, the last nb % 16 blocks as they are.
inline void codes_to_groups(const uint8_t* blocks, int64_t stride, int w, int64_t nb, uint8_t* out) {
  const int64_t whole = nb / kGroup * kGroup;
  for (int64_t g = 0; g < whole; g += kGroup) {
    uint8_t* group = out + g * 4 * w;
#if defined(TM_QUANT_AVX512) && !defined(TOKENMILL_SIMDE)
    if (stride == 4 * w) {
      blocks_to_group(blocks + g * stride, w, group);
      continue;
    }
#endif
    for (int t = 0; t < w; ++t)
      for (int l = 0; l < kGroup; ++l) std::memcpy(group + 4 * (t * kGroup + l), blocks + (g + l) * stride + 4 * t, 4);
  }
  for (int64_t b = whole; b < nb; ++b) std::memcpy(out + b * 4 * w, blocks + b * stride, 4 * w);
}

// The inverse: a row's codes in block order, 4 w bytes a block.
inline void groups_to_codes(const uint8_t* groups, int w, int64_t nb, uint8_t* blocks) {
  const int64_t whole = nb / kGroup * kGroup;
  for (int64_t g = 0; g < whole; g += kGroup) {
    const uint8_t* group = groups + g * 4 * w;
#if defined(TM_QUANT_AVX512) && !defined(TOKENMILL_SIMDE)
    group_to_blocks(group, w, blocks + g * 4 * w);
#else
    for (int t = 0; t < w; ++t)
      for (int l = 0; l < kGroup; ++l) std::memcpy(blocks + (g + l) * 4 * w + 4 * t, group + 4 * (t * kGroup + l), 4);
#endif
  }
  std::memcpy(blocks + whole * 4 * w, groups + whole * 4 * w, (nb - whole) * 4 * w);
}

// Where fifth bit e of block l of a whole group lies in the group's 64 bytes of them (see the top of this
// file): elements 4t + c and 16 + 4t + c are bit c of the low and high nibbles of code word 16 t + l.
inline int fifth_bit_index(int l, int e) { return (e >= 16 ? 256 : 0) + 4 * ((e & 15) / 4 * kGroup + l) + (e & 3); }

// A row's fifth bits from GGUF's (block b's 32 bits at blocks + b * stride) into the layout.
inline void fifth_bits_to_groups(const uint8_t* blocks, int64_t stride, int64_t nb, uint8_t* out) {
  const int64_t whole = nb / kGroup * kGroup;
  std::memset(out, 0, 4 * whole);
  for (int64_t g = 0; g < whole; g += kGroup)
    for (int l = 0; l < kGroup; ++l) {
      uint32_t h;
      std::memcpy(&h, blocks + (g + l) * stride, 4);
      for (int e = 0; e < 32; ++e)
        if ((h >> e) & 1) {
          const int i = fifth_bit_index(l, e);
          out[4 * g + i / 8] |= (uint8_t)(1 << (i % 8));
        }
    }
  for (int64_t b = whole; b < nb; ++b) std::memcpy(out + 4 * b, blocks + b * stride, 4);
}

#if defined(TM_QUANT_AVX512) && !defined(TOKENMILL_SIMDE)
// A whole group's fifth bits, block l's (as GGUF holds them) in lane l: word row t's 64 bits hold nibble t of
// each block's low (then high) 16 bits, 4 bits a block.
TM_INLINE __m512i group_fifth_bits(const uint8_t* bits) {
  const __m512i half = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i shift = _mm512_set_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16, 12, 8, 4, 0);
  __m512i v = _mm512_setzero_si512();
  for (int k = 0; k < 8; ++k) {  // k = t (low nibbles), 4 + t (high)
    uint64_t word;
    std::memcpy(&word, bits + 8 * k, 8);
    const __m512i nib = _mm512_srlv_epi32(_mm512_permutexvar_epi32(half, _mm512_set1_epi64((long long)word)), shift);
    v = _mm512_or_si512(v, _mm512_slli_epi32(_mm512_and_si512(nib, _mm512_set1_epi32(0xF)), 4 * k));
  }
  return v;
}
#endif

// The inverse: block b's fifth bits as GGUF holds them (bit i for element i) into h[b].
inline void groups_to_fifth_bits(const uint8_t* groups, int64_t nb, uint32_t* h) {
  const int64_t whole = nb / kGroup * kGroup;
  for (int64_t g = 0; g < whole; g += kGroup) {
    const uint8_t* bits = groups + 4 * g;
#if defined(TM_QUANT_AVX512) && !defined(TOKENMILL_SIMDE)
    _mm512_storeu_si512((void*)(h + g), group_fifth_bits(bits));
#else
    for (int l = 0; l < kGroup; ++l) {
      uint32_t v = 0;
      for (int k = 0; k < 8; ++k) {  // nibble k of the block's bits: bits 4 (16 (k % 4) + l) of row k / 4's
        const int i = fifth_bit_index(l, 4 * k);
        v |= (uint32_t)((bits[i / 8] >> (i % 8)) & 0xF) << (4 * k);
      }
      h[g + l] = v;
    }
#endif
  }
  std::memcpy(h + whole, groups + 4 * whole, 4 * (nb - whole));
}

// A row's codes and fifth bits in block order, as GGUF holds them (Q8_0: 32 bytes q + 128 a block; the 4-bit
// formats: 16 bytes, element j in the low nibble of byte j, j + 16 in its high one): for the readers that
// go block by block (dequantization). Kept per thread between calls.
struct BlockCodes {
  std::vector<uint8_t> codes;
  std::vector<uint32_t> h;  // five_bits formats
  void set(int type, const uint8_t* qs, const uint8_t* qh, int64_t nb) {
    const int w = code_words(type);
    codes.resize(nb * 4 * w);
    groups_to_codes(qs, w, nb, codes.data());
    if (qh) {
      h.resize(nb);
      groups_to_fifth_bits(qh, nb, h.data());
    }
  }
  const uint8_t* block(int64_t b, int w) const { return codes.data() + b * 4 * w; }
};

constexpr int QKK = 256;  // the super-block of the K formats

struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct BlockQ5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct BlockQ6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
struct BlockQ2_K { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; };
struct BlockQ3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; };
struct BlockIQ4_XS { uint16_t d, scales_h; uint8_t scales_l[4]; uint8_t qs[128]; };
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210, "block size");
static_assert(sizeof(BlockQ2_K) == 84 && sizeof(BlockQ3_K) == 110 && sizeof(BlockIQ4_XS) == 136, "block size");

// The 16 6-bit scales of a Q3_K super-block less their bias of 32, one signed byte a sub-block (of 16):
// sub-block i's low 4 bits in byte i % 8 (low nibble for i < 8, high for the rest), its top 2 bits at bits
// 2 (i / 4) of byte 8 + i % 4. Each 32-bit word of the result holds four of them.
inline void q3_k_scales(const uint8_t* s, int8_t out[16]) {
  uint32_t w[3];
  std::memcpy(w, s, 12);
  const uint32_t lo = 0x0F0F0F0F, hi = 0x03030303;
  const uint32_t v[4] = {(w[0] & lo) | ((w[2] & hi) << 4), (w[1] & lo) | (((w[2] >> 2) & hi) << 4),
                         ((w[0] >> 4) & lo) | (((w[2] >> 4) & hi) << 4), ((w[1] >> 4) & lo) | (((w[2] >> 6) & hi) << 4)};
  std::memcpy(out, v, 16);
  for (int i = 0; i < 16; ++i) out[i] = (int8_t)(out[i] - 32);
}

// The 8 6-bit scales of an IQ4_XS super-block less their bias of 32, one a sub-block (of 32): the low 4
// bits in nibble j % 2 of scales_l[j / 2], the top 2 at bits 2j of scales_h.
inline void iq4_xs_scales(const BlockIQ4_XS& x, int8_t out[8]) {
  for (int j = 0; j < 8; ++j)
    out[j] = (int8_t)((((x.scales_l[j / 2] >> (4 * (j % 2))) & 0xF) | (((x.scales_h >> (2 * j)) & 3) << 4)) - 32);
}

// v as it is, kept from being fused with a later addition into one multiply-add (the reference rounds the
// product first; the compiler may contract a * b - c in scalar code).
TM_INLINE float rounded(float v) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+x"(v));
#elif defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(v));
#else
  volatile float t = v;
  v = t;
#endif
  return v;
}

TM_INLINE float fp16(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: value man * 2^-24
    float v = std::ldexp((float)man, -24);
    return sign ? -v : v;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// fn(dl, codes, at) for each 32-element sub-block of an IQ4_XS row: its scale d sc_j (the reference's float
// product), its 16 code bytes, and the index of its first element.
template <typename F>
inline void iq4_xs_sub_blocks(const uint8_t* row, int64_t K, F&& fn) {
  for (int64_t b = 0; b < K / QKK; ++b) {
    const BlockIQ4_XS& x = ((const BlockIQ4_XS*)row)[b];
    int8_t sc[8];
    iq4_xs_scales(x, sc);
    const float d = fp16(x.d);
    for (int j = 0; j < 8; ++j) fn(d * (float)sc[j], x.qs + 16 * j, b * QKK + 32 * j);
  }
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block.
inline void scale_min_k4(int j, const uint8_t* s, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

struct Format {
  int block;   // elements per block
  int bytes;   // bytes per block
};

// A repacked Q8_0 byte's int8 value (the layout stores q + 128); q8_values below: 16 or 32 of them at once.
inline int q8_value(uint8_t u) { return (int)u - 128; }

inline bool format_of(int type, Format& f) {
  switch (type) {
    case Q8_0: f = {QK, 34}; return true;
    case Q4_0: f = {QK, 18}; return true;
    case Q4_1: f = {QK, 20}; return true;
    case Q5_0: f = {QK, 22}; return true;
    case Q5_1: f = {QK, 24}; return true;
    case Q4_K: f = {QKK, 144}; return true;
    case Q5_K: f = {QKK, 176}; return true;
    case Q6_K: f = {QKK, 210}; return true;
    case Q2_K: f = {QKK, 84}; return true;
    case Q3_K: f = {QKK, 110}; return true;
    case IQ4_XS: f = {QKK, 136}; return true;
    case IQ4_NL: f = {QK, 18}; return true;
    case MXFP4: f = {QK, 17}; return true;
    default: return false;
  }
}

// ---------------------------------------------------------------------------------------------- dequantize

inline void dequantize_row_portable(int type, const uint8_t* row, float* y, int64_t K) {
  switch (type) {
    case Q8_0: {
      const int64_t nb = K / QK;
      const uint16_t* d = (const uint16_t*)row;
      thread_local BlockCodes c;
      c.set(type, row + 2 * nb, nullptr, nb);
      for (int64_t i = 0; i < K; ++i) y[i] = fp16(d[i / QK]) * q8_value(c.codes[i]);
      break;
    }
    case MXFP4: {  // the repacked layout: scales, then the codes by group as the 4-bit formats'
      const int64_t nb = K / QK;
      thread_local BlockCodes c;
      c.set(type, row + nb, nullptr, nb);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = c.block(b, 4);
        const float d = e8m0_half(row[b]);
        for (int i = 0; i < 16; ++i)
          y[b * 32 + i] = d * kFp4Doubled[p[i] & 0xF], y[b * 32 + 16 + i] = d * kFp4Doubled[p[i] >> 4];
      }
      break;
    }
    case IQ4_NL: {  // the repacked layout: Q4_0's (scales, then the codes by group)
      const int64_t nb = K / QK;
      const uint16_t* d = (const uint16_t*)row;
      thread_local BlockCodes c;
      c.set(type, row + 2 * nb, nullptr, nb);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = c.block(b, 4);
        const float db = fp16(d[b]);
        for (int i = 0; i < 16; ++i)
          y[b * 32 + i] = db * (float)kIq4Values[p[i] & 0xF], y[b * 32 + 16 + i] = db * (float)kIq4Values[p[i] >> 4];
      }
      break;
    }
    case IQ4_XS:
      iq4_xs_sub_blocks(row, K, [&](float dl, const uint8_t* q, int64_t at) {
        for (int i = 0; i < 16; ++i)
          y[at + i] = dl * (float)kIq4Values[q[i] & 0xF], y[at + 16 + i] = dl * (float)kIq4Values[q[i] >> 4];
      });
      break;
    case Q2_K:
    case Q3_K:  // element 128 h + 32 j + l: bits 2j of qs[32 h + l]; Q3_K's third bit, bit 4h + j of hmask[l]
      for (int64_t b = 0; b < K / QKK; ++b) {
        float dl[16], ml[16];
        const uint8_t* qs;
        const uint8_t* hmask = nullptr;
        if (type == Q2_K) {
          const BlockQ2_K& x = ((const BlockQ2_K*)row)[b];
          const float d = fp16(x.d), dmin = fp16(x.dmin);
          for (int i = 0; i < 16; ++i) dl[i] = d * (float)(x.scales[i] & 0xF), ml[i] = dmin * (float)(x.scales[i] >> 4);
          qs = x.qs;
        } else {
          const BlockQ3_K& x = ((const BlockQ3_K*)row)[b];
          int8_t sc[16];
          q3_k_scales(x.scales, sc);
          const float d = fp16(x.d);
          for (int i = 0; i < 16; ++i) dl[i] = d * (float)sc[i], ml[i] = 0.f;
          qs = x.qs, hmask = x.hmask;
        }
        for (int h = 0; h < 2; ++h)
          for (int j = 0; j < 4; ++j)
            for (int l = 0; l < 32; ++l) {
              const int e = 128 * h + 32 * j + l;
              int q = (qs[32 * h + l] >> (2 * j)) & 3;
              if (hmask) q -= (hmask[l] >> (4 * h + j)) & 1 ? 0 : 4;
              const float v = dl[e / 16] * (float)q;
              y[b * QKK + e] = hmask ? v : rounded(v) - ml[e / 16];
            }
      }
      break;
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1: {
      const int64_t nb = K / QK;
      const NibbleRow r(type, row, nb);
      const uint16_t* d = r.d;
      const uint16_t* m = has_min(type) ? r.m : nullptr;
      thread_local BlockCodes c;
      c.set(type, r.qs, five_bits(type) ? r.qh : nullptr, nb);
      const float bias = five_bits(type) ? 16.f : 8.f;
      for (int64_t b = 0; b < nb; ++b) {
        int q[32];
        const uint8_t* p = c.block(b, 4);
        for (int i = 0; i < 16; ++i) q[i] = p[i] & 0xF, q[i + 16] = p[i] >> 4;
        if (five_bits(type))
          for (int i = 0; i < 32; ++i) q[i] |= ((c.h[b] >> i) & 1) << 4;
        float db = fp16(d[b]), mb = m ? fp16(m[b]) : 0.f;
        for (int i = 0; i < 32; ++i) y[b * 32 + i] = m ? db * q[i] + mb : db * (q[i] - bias);
      }
      break;
    }
    case Q4_K:
    case Q5_K:
      for (int64_t b = 0; b < K / QKK; ++b) {
        const uint8_t *scales, *qs, *qh = nullptr;
        float d, dmin;
        if (type == Q4_K) {
          const BlockQ4_K& x = ((const BlockQ4_K*)row)[b];
          d = fp16(x.d), dmin = fp16(x.dmin), scales = x.scales, qs = x.qs;
        } else {
          const BlockQ5_K& x = ((const BlockQ5_K*)row)[b];
          d = fp16(x.d), dmin = fp16(x.dmin), scales = x.scales, qs = x.qs, qh = x.qh;
        }
        float* out = y + b * QKK;
        for (int j = 0; j < 4; ++j) {  // 64 elements: sub-block 2j in the low nibbles, 2j+1 in the high
          int sc1, m1, sc2, m2;
          scale_min_k4(2 * j, scales, sc1, m1);
          scale_min_k4(2 * j + 1, scales, sc2, m2);
          for (int l = 0; l < 32; ++l) {
            int lo = qs[32 * j + l] & 0xF, hi = qs[32 * j + l] >> 4;
            if (qh) {
              lo += ((qh[l] >> (2 * j)) & 1) << 4;
              hi += ((qh[l] >> (2 * j + 1)) & 1) << 4;
            }
            out[64 * j + l] = d * sc1 * lo - dmin * m1;
            out[64 * j + 32 + l] = d * sc2 * hi - dmin * m2;
          }
        }
      }
      break;
    case Q6_K:
      for (int64_t b = 0; b < K / QKK; ++b) {
        const BlockQ6_K& x = ((const BlockQ6_K*)row)[b];
        float d = fp16(x.d);
        for (int h = 0; h < 2; ++h) {
          const uint8_t* ql = x.ql + 64 * h;
          const uint8_t* qh = x.qh + 32 * h;
          const int8_t* sc = x.scales + 8 * h;
          float* out = y + b * QKK + 128 * h;
          for (int l = 0; l < 32; ++l) {
            int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            int is = l / 16;
            out[l] = d * sc[is] * q1;
            out[l + 32] = d * sc[is + 2] * q2;
            out[l + 64] = d * sc[is + 4] * q3;
            out[l + 96] = d * sc[is + 6] * q4;
          }
        }
      }
      break;
  }
}

#ifdef TM_QUANT_AVX512
// The vectorised dequantizations below compute each value with the portable path's operations in its
// order (no fused multiply-adds), so both give the same floats, those of the gguf package.

inline void store16(float* y, __m128i bytes, __m512 scale, __m512 offset, bool sub) {  // y = scale q -/+ offset
  __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
  __m512 p = _mm512_mul_ps(scale, q);
  _mm512_storeu_ps(y, sub ? _mm512_sub_ps(p, offset) : _mm512_add_ps(p, offset));
}

TM_INLINE __m128i q8_values(__m128i u) { return _mm_xor_si128(u, _mm_set1_epi8((char)0x80)); }
TM_INLINE __m256i q8_values(__m256i u) { return _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80)); }

// One block's 32 values from its codes (a Q8_0 block's 32 bytes as stored, q + 128; a 4-bit block's 16 bytes
// in GGUF's order, with its fifth bits h where FIVE): the row and tile layouts' dequantizations share these.
TM_INLINE void dequantize_block_q8_0(__m256i codes, float d, float* y) {
  const __m512 db = _mm512_set1_ps(d);
  for (int k = 0; k < 2; ++k) {
    const __m128i q8 = q8_values(k ? _mm256_extracti128_si256(codes, 1) : _mm256_castsi256_si128(codes));
    _mm512_storeu_ps(y + 16 * k, _mm512_mul_ps(db, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8))));
  }
}

inline void dequantize_q8_0(const uint8_t* row, float* y, int64_t K) {
  const int64_t nb = K / QK;
  const uint16_t* d = (const uint16_t*)row;
  thread_local BlockCodes c;
  c.set(Q8_0, row + 2 * nb, nullptr, nb);
  for (int64_t b = 0; b < nb; ++b)
    dequantize_block_q8_0(_mm256_loadu_si256((const __m256i*)c.block(b, 8)), fp16(d[b]), y + b * QK);
}

// 32 bytes: byte i is 16 where bit i of h is set, else 0 (a block's fifth bits, in the place they take in q).
inline __m256i fifth_bits(const uint32_t* h) {
  uint32_t v;
  std::memcpy(&v, h, 4);
  const __m256i spread = _mm256_shuffle_epi8(  // byte i of the result: byte i / 8 of v
      _mm256_set1_epi32((int)v), _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// Q4_0: d (q - 8); Q4_1: d q + m; Q5_0: d (q - 16); Q5_1: d q + m, with q's fifth bit.
template <bool HAS_MIN, bool FIVE>
TM_INLINE void dequantize_block_q4_01(__m128i q, float d, float m, const uint32_t* h, float* y) {
  const __m128i m4 = _mm_set1_epi8(0xF);
  __m128i lo16 = _mm_and_si128(q, m4), hi16 = _mm_and_si128(_mm_srli_epi16(q, 4), m4);  // elements 0-15, 16-31
  const __m512 db = _mm512_set1_ps(d), mb = _mm512_set1_ps(m), bias = _mm512_set1_ps(FIVE ? 16.f : 8.f);
  if (FIVE) {
    const __m256i hb = fifth_bits(h);
    lo16 = _mm_or_si128(lo16, _mm256_castsi256_si128(hb)), hi16 = _mm_or_si128(hi16, _mm256_extracti128_si256(hb, 1));
  }
  for (int k = 0; k < 2; ++k) {
    __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(k ? hi16 : lo16));
    _mm512_storeu_ps(y + 16 * k, HAS_MIN ? _mm512_add_ps(_mm512_mul_ps(db, v), mb) : _mm512_mul_ps(db, _mm512_sub_ps(v, bias)));
  }
}

template <bool HAS_MIN, bool FIVE>
inline void dequantize_q4_01(const uint8_t* row, float* y, int64_t K) {
  const int64_t nb = K / QK;
  const NibbleRow r(HAS_MIN ? (FIVE ? Q5_1 : Q4_1) : (FIVE ? Q5_0 : Q4_0), row, nb);
  const uint16_t* d = r.d;
  const uint16_t* m = r.m;
  thread_local BlockCodes c;
  c.set(Q4_0, r.qs, FIVE ? r.qh : nullptr, nb);
  for (int64_t b = 0; b < nb; ++b)
    dequantize_block_q4_01<HAS_MIN, FIVE>(_mm_loadu_si128((const __m128i*)c.block(b, 4)), fp16(d[b]),
                                          HAS_MIN ? fp16(m[b]) : 0.f, FIVE ? &c.h[b] : nullptr, y + b * QK);
}

// Q4_K / Q5_K: (d sc_j) q - dmin m_j per 32-element sub-block j.
template <bool FIVE>
inline void dequantize_q45_k(const uint8_t* row, float* y, int64_t K) {
  const int size = FIVE ? 176 : 144;
  const __m128i m4 = _mm_set1_epi8(0xF), one = _mm_set1_epi8(1);
  for (int64_t b = 0; b < K / QKK; ++b) {
    const uint8_t* blk = row + b * size;
    const float d = fp16(*(const uint16_t*)blk), dmin = fp16(*(const uint16_t*)(blk + 2));
    const uint8_t* scales = blk + 4;
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + (FIVE ? 48 : 16);
    for (int j = 0; j < 4; ++j) {
      int sc[2], mn[2];
      scale_min_k4(2 * j, scales, sc[0], mn[0]);
      scale_min_k4(2 * j + 1, scales, sc[1], mn[1]);
      for (int c = 0; c < 2; ++c) {  // elements l = 16c .. 16c + 15 of the 32 bytes
        __m128i q = _mm_loadu_si128((const __m128i*)(qs + 32 * j + 16 * c));
        __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
        if (FIVE) {
          __m128i h = _mm_loadu_si128((const __m128i*)(qh + 16 * c));
          lo = _mm_or_si128(lo, _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 2 * j), one), 4));
          hi = _mm_or_si128(hi, _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 2 * j + 1), one), 4));
        }
        float* out = y + b * QKK + 64 * j + 16 * c;
        store16(out, lo, _mm512_set1_ps(d * sc[0]), _mm512_set1_ps(dmin * mn[0]), true);
        store16(out + 32, hi, _mm512_set1_ps(d * sc[1]), _mm512_set1_ps(dmin * mn[1]), true);
      }
    }
  }
}

// Q6_K: (d sc_i) (q - 32) per 16-element sub-block i.
inline void dequantize_q6_k(const uint8_t* row, float* y, int64_t K) {
  const __m128i m4 = _mm_set1_epi8(0xF), m2 = _mm_set1_epi8(3);
  const __m512i c32 = _mm512_set1_epi32(32);
  for (int64_t b = 0; b < K / QKK; ++b) {
    const BlockQ6_K& x = ((const BlockQ6_K*)row)[b];
    const float d = fp16(x.d);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = x.ql + 64 * h;
      const uint8_t* qh = x.qh + 32 * h;
      const int8_t* sc = x.scales + 8 * h;
      for (int c = 0; c < 2; ++c) {  // l = 16c .. 16c + 15
        __m128i a = _mm_loadu_si128((const __m128i*)(ql + 16 * c));
        __m128i bq = _mm_loadu_si128((const __m128i*)(ql + 32 + 16 * c));
        __m128i hb = _mm_loadu_si128((const __m128i*)(qh + 16 * c));
        __m128i q[4] = {
            _mm_or_si128(_mm_and_si128(a, m4), _mm_slli_epi16(_mm_and_si128(hb, m2), 4)),
            _mm_or_si128(_mm_and_si128(bq, m4), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 2), m2), 4)),
            _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), m4), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 4), m2), 4)),
            _mm_or_si128(_mm_and_si128(_mm_srli_epi16(bq, 4), m4), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 6), m2), 4))};
        float* out = y + b * QKK + 128 * h + 16 * c;
        for (int k = 0; k < 4; ++k) {
          __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(q[k]), c32));
          _mm512_storeu_ps(out + 32 * k, _mm512_mul_ps(_mm512_set1_ps(d * sc[c + 2 * k]), v));
        }
      }
    }
  }
}

inline __m256i bf16x16(__m512 v);  // (below)

// 16 values into y: as they are (float), or rounded to bfloat16 (uint16_t: dequantize_row_bf16's, one pass).
TM_INLINE void store_values(float* y, __m512 v) { _mm512_storeu_ps(y, v); }
TM_INLINE void store_values(uint16_t* y, __m512 v) { _mm256_storeu_si256((__m256i*)y, bf16x16(v)); }

// IQ4_NL / IQ4_XS: the table in each 128-bit lane as bytes, for a shuffle by code: v, or (offset) v + 128
// as an unsigned byte (1 .. 241), the form VNNI's unsigned-by-signed products take.
TM_INLINE __m512i iq4_bytes(bool offset) {
  const __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)kIq4Values));
  return offset ? _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80)) : v;
}

// IQ4_NL / IQ4_XS: each code's table value as a float lane (permutexvar over the 16 values).
TM_INLINE __m512 iq4_lanes(__m128i codes) {
  const __m512 table = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)kIq4Values)));
  return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codes), table);
}

template <typename T>
inline void dequantize_iq4_nl(const uint8_t* row, T* y, int64_t K) {
  const int64_t nb = K / QK;
  const uint16_t* d = (const uint16_t*)row;
  thread_local BlockCodes c;
  c.set(IQ4_NL, row + 2 * nb, nullptr, nb);
  const __m128i m4 = _mm_set1_epi8(0xF);
  for (int64_t b = 0; b < nb; ++b) {
    const __m128i q = _mm_loadu_si128((const __m128i*)c.block(b, 4));
    const __m512 db = _mm512_set1_ps(fp16(d[b]));
    store_values(y + b * QK, _mm512_mul_ps(db, iq4_lanes(_mm_and_si128(q, m4))));
    store_values(y + b * QK + 16, _mm512_mul_ps(db, iq4_lanes(_mm_and_si128(_mm_srli_epi16(q, 4), m4))));
  }
}

template <typename T>
inline void dequantize_iq4_xs(const uint8_t* row, T* y, int64_t K) {
  const __m128i m4 = _mm_set1_epi8(0xF);
  iq4_xs_sub_blocks(row, K, [&](float d, const uint8_t* codes, int64_t at) {
    const __m512 dl = _mm512_set1_ps(d);
    const __m128i q = _mm_loadu_si128((const __m128i*)codes);
    store_values(y + at, _mm512_mul_ps(dl, iq4_lanes(_mm_and_si128(q, m4))));
    store_values(y + at + 16, _mm512_mul_ps(dl, iq4_lanes(_mm_and_si128(_mm_srli_epi16(q, 4), m4))));
  });
}

// Q2_K and Q3_K: 16 elements (sub-block i = 8h + 2j + c) at a time, with the portable path's operations.
template <bool THREE, typename T>
inline void dequantize_q23_k(const uint8_t* row, T* y, int64_t K) {
  const __m128i m2 = _mm_set1_epi8(3);
  for (int64_t b = 0; b < K / QKK; ++b) {
    float dl[16], ml[16];
    const uint8_t *qs, *hmask = nullptr;
    if constexpr (THREE) {
      const BlockQ3_K& x = ((const BlockQ3_K*)row)[b];
      int8_t sc[16];
      q3_k_scales(x.scales, sc);
      const float d = fp16(x.d);
      for (int i = 0; i < 16; ++i) dl[i] = d * (float)sc[i];
      qs = x.qs, hmask = x.hmask;
    } else {
      const BlockQ2_K& x = ((const BlockQ2_K*)row)[b];
      const float d = fp16(x.d), dmin = fp16(x.dmin);
      for (int i = 0; i < 16; ++i) dl[i] = d * (float)(x.scales[i] & 0xF), ml[i] = dmin * (float)(x.scales[i] >> 4);
      qs = x.qs;
    }
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j)
        for (int c = 0; c < 2; ++c) {
          __m512i q = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i*)(qs + 32 * h + 16 * c)), 2 * j), m2));
          if constexpr (THREE) {  // less 4 where the third bit is clear
            const __m128i hb = _mm_loadu_si128((const __m128i*)(hmask + 16 * c));
            const __mmask16 set = _mm512_test_epi32_mask(_mm512_cvtepu8_epi32(hb), _mm512_set1_epi32(1 << (4 * h + j)));
            q = _mm512_mask_sub_epi32(q, (__mmask16)~set, q, _mm512_set1_epi32(4));
          }
          const int i = 8 * h + 2 * j + c;
          __m512 v = _mm512_mul_ps(_mm512_set1_ps(dl[i]), _mm512_cvtepi32_ps(q));
          if constexpr (!THREE) v = _mm512_sub_ps(v, _mm512_set1_ps(ml[i]));
          store_values(y + b * QKK + 128 * h + 32 * j + 16 * c, v);
        }
  }
}
#endif  // TM_QUANT_AVX512

// The exact float values of a row (the portable path's, vectorised where the CPU allows).
inline void dequantize_row(int type, const uint8_t* row, float* y, int64_t K) {
#ifdef TM_QUANT_AVX512
  switch (type) {
    case Q8_0: return dequantize_q8_0(row, y, K);
    case Q4_0: return dequantize_q4_01<false, false>(row, y, K);
    case Q4_1: return dequantize_q4_01<true, false>(row, y, K);
    case Q5_0: return dequantize_q4_01<false, true>(row, y, K);
    case Q5_1: return dequantize_q4_01<true, true>(row, y, K);
    case Q4_K: return dequantize_q45_k<false>(row, y, K);
    case Q5_K: return dequantize_q45_k<true>(row, y, K);
    case Q6_K: return dequantize_q6_k(row, y, K);
    case Q2_K: return dequantize_q23_k<false>(row, y, K);
    case Q3_K: return dequantize_q23_k<true>(row, y, K);
    case IQ4_NL: return dequantize_iq4_nl(row, y, K);
    case IQ4_XS: return dequantize_iq4_xs(row, y, K);
  }
#endif
  dequantize_row_portable(type, row, y, K);
}

// ---------------------------------------------------------------------------------------------- to bfloat16

// The row's values rounded to bfloat16 (to nearest even), as dequantize_row's floats round: the weight tiles
// a bfloat16 model's prompt rows are multiplied with. Each value is computed with dequantize_row's float
// operations, then rounded. The 4- and 5-bit formats take a lookup: a block's (or sub-block's) possible
// values are few (16 or 32), so they are computed once, rounded once, and each element picks its own with
// one 16-bit permute per 32 elements.
inline uint16_t bf16_bits(float f) {  // round to nearest even (these values are finite)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

#ifdef TM_QUANT_AVX512
inline __m256i bf16x16(__m512 v) {
#if defined(__AVX512BF16__) && !defined(TOKENMILL_SIMDE)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16));
#endif
}

// The 16 values scale * i - offset (sub) or scale * i + offset, i = 0..15 (+16 with `high`), as bf16 words.
inline __m512i table16(float scale, float offset, bool sub, bool high = false) {
  const __m512 i = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 p = _mm512_mul_ps(_mm512_set1_ps(scale), high ? _mm512_add_ps(i, _mm512_set1_ps(16.f)) : i);
  const __m512 o = _mm512_set1_ps(offset);
  return _mm512_castsi256_si512(bf16x16(sub ? _mm512_sub_ps(p, o) : _mm512_add_ps(p, o)));
}
// 32 entries: values 0..15 in words 0-15, 16..31 in words 16-31.
inline __m512i table32(float scale, float offset, bool sub) {
  return _mm512_inserti64x4(table16(scale, offset, sub), _mm512_castsi512_si256(table16(scale, offset, sub, true)), 1);
}

// 32 elements: each 16-bit index (0..31) picks its value from the table.
inline void store_lookup(uint16_t* y, __m256i idx8, __m512i table) {
  _mm512_storeu_si512((void*)y, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(idx8), table));
}

// The bfloat16 values of one block (the codes as dequantize_block_q8_0's and dequantize_block_q4_01's).
TM_INLINE void dequantize_bf16_block_q8_0(__m256i codes, float d, uint16_t* y) {
  const __m512 db = _mm512_set1_ps(d);
  for (int k = 0; k < 2; ++k) {
    const __m128i q8 = q8_values(k ? _mm256_extracti128_si256(codes, 1) : _mm256_castsi256_si128(codes));
    _mm256_storeu_si256((__m256i*)(y + 16 * k), bf16x16(_mm512_mul_ps(db, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8)))));
  }
}

inline void dequantize_bf16_q8_0(const uint8_t* row, uint16_t* y, int64_t K) {
  const int64_t nb = K / QK;
  const uint16_t* d = (const uint16_t*)row;
  thread_local BlockCodes c;
  c.set(Q8_0, row + 2 * nb, nullptr, nb);
  for (int64_t b = 0; b < nb; ++b)
    dequantize_bf16_block_q8_0(_mm256_loadu_si256((const __m256i*)c.block(b, 8)), fp16(d[b]), y + b * QK);
}

// Q4_0: d q - 8 d, equal to the float path's d (q - 8): every product here is exact in float32 (an 11-bit
// scale times a 4- or 5-bit integer), so the difference is too (Q5_0: d q - 16 d). Q4_1, Q5_1: d q + m.
template <bool HAS_MIN, bool FIVE>
TM_INLINE void dequantize_bf16_block_q4_01(__m128i q, float d, float m, const uint32_t* h, uint16_t* y) {
  const __m128i m4 = _mm_set1_epi8(0xF);
  const float off = HAS_MIN ? m : (FIVE ? 16.f : 8.f) * d;
  const __m512i table = FIVE ? table32(d, off, !HAS_MIN) : table16(d, off, !HAS_MIN);
  __m256i idx = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(q, m4)),
                                        _mm_and_si128(_mm_srli_epi16(q, 4), m4), 1);
  if (FIVE) idx = _mm256_or_si256(idx, fifth_bits(h));
  store_lookup(y, idx, table);
}

template <bool HAS_MIN, bool FIVE>
inline void dequantize_bf16_q4_01(const uint8_t* row, uint16_t* y, int64_t K) {
  const int64_t nb = K / QK;
  const NibbleRow r(HAS_MIN ? (FIVE ? Q5_1 : Q4_1) : (FIVE ? Q5_0 : Q4_0), row, nb);
  thread_local BlockCodes c;
  c.set(Q4_0, r.qs, FIVE ? r.qh : nullptr, nb);
  for (int64_t b = 0; b < nb; ++b)
    dequantize_bf16_block_q4_01<HAS_MIN, FIVE>(_mm_loadu_si128((const __m128i*)c.block(b, 4)), fp16(r.d[b]),
                                               HAS_MIN ? fp16(r.m[b]) : 0.f, FIVE ? &c.h[b] : nullptr, y + b * QK);
}

template <bool FIVE>
inline void dequantize_bf16_q45_k(const uint8_t* row, uint16_t* y, int64_t K) {
  const int size = FIVE ? 176 : 144;
  const __m256i m4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < K / QKK; ++b) {
    const uint8_t* blk = row + b * size;
    const float d = fp16(*(const uint16_t*)blk), dmin = fp16(*(const uint16_t*)(blk + 2));
    const uint8_t* qs = blk + (FIVE ? 48 : 16);
    __m256i hbits = FIVE ? _mm256_loadu_si256((const __m256i*)(blk + 16)) : _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      int sc[2], mn[2];
      scale_min_k4(2 * j, blk + 4, sc[0], mn[0]);
      scale_min_k4(2 * j + 1, blk + 4, sc[1], mn[1]);
      const __m256i q = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
      __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if (FIVE) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hbits, one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 1), one), 4));
        hbits = _mm256_srli_epi16(hbits, 2);
      }
      uint16_t* out = y + b * QKK + 64 * j;
      auto table = [&](int k) {
        return FIVE ? table32(d * sc[k], dmin * mn[k], true) : table16(d * sc[k], dmin * mn[k], true);
      };
      store_lookup(out, lo, table(0));
      store_lookup(out + 32, hi, table(1));
    }
  }
}

inline void dequantize_bf16_q6_k(const uint8_t* row, uint16_t* y, int64_t K) {
  thread_local std::vector<float> f;  // Q6_K's 64 values per sub-block: computed in float, then rounded
  if ((int64_t)f.size() < QKK) f.resize(QKK);
  for (int64_t b = 0; b < K / QKK; ++b) {
    dequantize_q6_k(row + b * 210, f.data(), QKK);
    for (int i = 0; i < QKK; i += 16)
      _mm256_storeu_si256((__m256i*)(y + b * QKK + i), bf16x16(_mm512_loadu_ps(f.data() + i)));
  }
}
#endif  // TM_QUANT_AVX512

inline void dequantize_row_bf16(int type, const uint8_t* row, uint16_t* y, int64_t K) {
#ifdef TM_QUANT_AVX512
  switch (type) {
    case Q8_0: return dequantize_bf16_q8_0(row, y, K);
    case Q4_0: return dequantize_bf16_q4_01<false, false>(row, y, K);
    case Q4_1: return dequantize_bf16_q4_01<true, false>(row, y, K);
    case Q5_0: return dequantize_bf16_q4_01<false, true>(row, y, K);
    case Q5_1: return dequantize_bf16_q4_01<true, true>(row, y, K);
    case Q4_K: return dequantize_bf16_q45_k<false>(row, y, K);
    case Q5_K: return dequantize_bf16_q45_k<true>(row, y, K);
    case Q6_K: return dequantize_bf16_q6_k(row, y, K);
    case Q2_K: return dequantize_q23_k<false>(row, y, K);
    case Q3_K: return dequantize_q23_k<true>(row, y, K);
    case IQ4_NL: return dequantize_iq4_nl(row, y, K);
    case IQ4_XS: return dequantize_iq4_xs(row, y, K);
  }
#endif
  thread_local std::vector<float> f;
  if ((int64_t)f.size() < K) f.resize(K);
  dequantize_row(type, row, f.data(), K);
  int64_t k = 0;
#ifdef TM_QUANT_AVX512  // (K is a multiple of 32)
  for (; k < K; k += 16) _mm256_storeu_si256((__m256i*)(y + k), bf16x16(_mm512_loadu_ps(f.data() + k)));
#endif
  for (; k < K; ++k) y[k] = bf16_bits(f[k]);
}

// A row of GGUF blocks into the kernel's layout (see the top of this file); K formats are copied as they are.
inline void repack_row(int type, const uint8_t* in, uint8_t* out, int64_t K) {
  Format f;
  format_of(type, f);
  const int64_t nb = K / f.block;
  if (type != Q8_0 && f.block != QK) {
    std::memcpy(out, in, nb * f.bytes);
    return;
  }
  if (type == MXFP4) {  // [nb scales] then the codes by group (a GGUF block: its scale, 16 bytes of codes)
    for (int64_t b = 0; b < nb; ++b) out[b] = in[b * f.bytes];
    codes_to_groups(in + 1, f.bytes, 4, nb, out + nb);
    return;
  }
  const bool min = has_min(type), five = five_bits(type);
  const int hdr = 2 + (min ? 2 : 0) + (five ? 4 : 0);  // scale, offset and fifth-bit bytes of a GGUF block
  uint16_t* d = (uint16_t*)out;
  uint16_t* m = min ? d + nb : nullptr;
  uint8_t* qs = out + hdr * nb;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = in + b * f.bytes;
    std::memcpy(&d[b], blk, 2);
    if (m) std::memcpy(&m[b], blk + 2, 2);
  }
  if (five) fifth_bits_to_groups(in + (min ? 4 : 2), f.bytes, nb, out + (min ? 4 : 2) * nb);
  if (type == Q8_0) {
    std::vector<uint8_t> u(nb * QK);
    for (int64_t b = 0; b < nb; ++b)
      for (int i = 0; i < 32; ++i) u[b * QK + i] = in[b * f.bytes + 2 + i] ^ 0x80;
    codes_to_groups(u.data(), QK, 8, nb, qs);
    return;
  }
  codes_to_groups(in + hdr, f.bytes, 4, nb, qs);
}

// ---------------------------------------------------------------------------------------------- activations

// Activation rows quantized to int8 in blocks of 32: q[K] per row, d[K/32] the block scales, s[K/32] each
// block's value sum d * sum(q) (the offsets and mins of the weight formats multiply it). q4, where given:
// the same values with the blocks of each whole group of four in the order 0, 2, 1, 3 (quad_order), which
// the K formats read two pairs of sub-blocks at a time in. qt, where given: the same values in groups of 16
// blocks transposed by 4-byte words as the 32-element formats' codes are (group_order; the top of this file).
struct QRow {
  const int8_t* q;
  const float* d;
  const float* s;
  const int8_t* q4 = nullptr;
  const int16_t* sums16 = nullptr;  // the integer sum of each 16 values of q (rows rounded per 256)
  // The same row rounded with one scale per 256 values (quantize_activation_row's per256), with its q4 and
  // sums16: where given, the K formats' rows take it. (A row already rounded so points to itself.)
  const QRow* per256 = nullptr;
  const int8_t* qt = nullptr;
};

// The K formats' rows multiply inputs with one scale per 256 values: a super-block's integer sub-block
// products then sum in int32 before a single float multiply. Every other format takes a scale per 32.
inline bool wants_per256(int type) {
  return type == Q4_K || type == Q5_K || type == Q6_K || type == Q2_K || type == Q3_K || type == IQ4_XS;
}

// q4 = q with blocks 4j + 1 and 4j + 2 swapped in every whole group of four blocks (the rest left out): the
// 64 bytes of one load of a Q4_K or Q5_K super-block hold sub-blocks 4j, 4j + 2 in their low nibbles and
// 4j + 1, 4j + 3 in their high ones.
inline void quad_order(const int8_t* q, int64_t K, int8_t* q4) {
  for (int64_t j = 0; j < K / (4 * QK); ++j) {
    const int8_t* a = q + j * 4 * QK;
    int8_t* b = q4 + j * 4 * QK;
    std::memcpy(b, a, QK);
    std::memcpy(b + QK, a + 2 * QK, QK);
    std::memcpy(b + 2 * QK, a + QK, QK);
    std::memcpy(b + 3 * QK, a + 3 * QK, QK);
  }
}

// qt = q in groups of 16 blocks, each group's 8-word blocks transposed (word t of block l at word t n + l).
inline void group_order(const int8_t* q, int64_t K, int8_t* qt) {
  codes_to_groups((const uint8_t*)q, QK, 8, K / QK, (uint8_t*)qt);
}

// d = max|x| / 127, q = round-to-nearest-even(x * (127 / max|x|)); an all-zero block gets d = 0. With
// per256 (K a multiple of 256), max|x| is taken over each 256 values, so their 8 blocks share one d: an
// integer sum over a K-format super-block then needs no float scale per block (as llama.cpp's Q8_K).
// sums16, where given: the integer sum of each 16 values of q.
inline void quantize_activation_row(const float* x, int64_t K, int8_t* q, float* d, float* s, bool per256 = false,
                                    int16_t* sums16 = nullptr) {
  const int group = per256 && K % 256 == 0 ? 8 : 1;
  for (int64_t g = 0; g < K / QK; g += group) {
    float amax = 0.f;
    for (int64_t b = g; b < g + group; ++b) {
      const float* xb = x + b * QK;
#ifdef TM_QUANT_AVX512
      __m512 a0 = _mm512_loadu_ps(xb), a1 = _mm512_loadu_ps(xb + 16);
      amax = std::fmax(amax, _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1))));
#else
      for (int i = 0; i < QK; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
#endif
    }
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t b = g; b < g + group; ++b) {
      const float* xb = x + b * QK;
#ifdef TM_QUANT_AVX512
      __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb), _mm512_set1_ps(inv)));
      __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16), _mm512_set1_ps(inv)));
      _mm_storeu_si128((__m128i*)(q + b * QK), _mm512_cvtsepi32_epi8(i0));
      _mm_storeu_si128((__m128i*)(q + b * QK + 16), _mm512_cvtsepi32_epi8(i1));
      const int sum0 = sums16 ? _mm512_reduce_add_epi32(i0) : 0;
      const int sum = sums16 ? sum0 + _mm512_reduce_add_epi32(i1) : _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#else
      int sum0 = 0, sum = 0;
      for (int i = 0; i < QK; ++i) {
        int v = (int)std::nearbyint(xb[i] * inv);
        q[b * QK + i] = (int8_t)v;
        sum += v;
        if (i == 15) sum0 = sum;
      }
#endif
      if (sums16) sums16[2 * b] = (int16_t)sum0, sums16[2 * b + 1] = (int16_t)(sum - sum0);
      d[b] = amax / 127.f;
      s[b] = d[b] * (float)sum;
    }
  }
}

// ---------------------------------------------------------------------------------------------- dot products

// The portable path: the weight row dequantized, then multiplied with the dequantized activations.
template <int R>
inline void dot_generic(int type, const uint8_t* row, const QRow* x, int64_t K, float* out) {
  thread_local std::vector<float> w;
  if ((int64_t)w.size() < K) w.resize(K);
  dequantize_row(type, row, w.data(), K);
  const bool per256 = wants_per256(type) && x[0].per256;
  for (int r = 0; r < R; ++r) {
    const QRow& xr = per256 ? *x[r].per256 : x[r];
    float acc = 0.f;
    for (int64_t b = 0; b < K / QK; ++b) {
      const int8_t* q = xr.q + b * QK;
      const float* wb = w.data() + b * QK;
      float part = 0.f;
      for (int i = 0; i < QK; ++i) part += wb[i] * q[i];
      acc += part * xr.d[b];
    }
    out[r] = acc;
  }
}

#ifdef TM_QUANT_AVX512

// 16 int32 lanes, each the sum of 4 adjacent products of unsigned bytes u with signed bytes s. The two
// ways give the same sums: the weights' unsigned values are at most 63, so no 16-bit pair saturates.
TM_INLINE __m512i dot4(__m512i u, __m512i s) {
#ifdef TM_QUANT_VNNI
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}

TM_INLINE float hsum(__m512 a, __m512 b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }

// v in the low half, zeros in the high one (a cast leaves the high half undefined: SIMDe fills it).
TM_INLINE __m512 zext(__m256 v) {
  return _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_setzero_si512(), _mm256_castps_si256(v), 0));
}

// acc + dot4(u, s): one instruction with VNNI.
TM_INLINE __m512i dot4_add(__m512i acc, __m512i u, __m512i s) {
#ifdef TM_QUANT_VNNI
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, dot4(u, s));
#endif
}

// Lanes 0-7 take element 2k of a vector of per-block scales, lanes 8-15 element 2k + 1: the scales of the
// two 32-element blocks one 64-byte product of block-ordered codes covers (a row's last nb % 16 blocks).
TM_INLINE __m512 pair_scales(__m512 v, int k) {
  const __m512i lo = _mm512_set1_epi32(2 * k), hi = _mm512_set1_epi32(2 * k + 1);
  return _mm512_permutexvar_ps(_mm512_mask_blend_epi32(0xFF00, lo, hi), v);
}

// The int8 products of a 64-byte vector of words: signed weights q (Q8_0's, without VNNI) by signed inputs,
// as unsigned |q| by the inputs with q's sign.
TM_INLINE __m512i dot4_signed(__m512i q, __m512i x) {
  const __mmask64 neg = _mm512_movepi8_mask(q);
  return dot4(_mm512_abs_epi8(q), _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x));
}

// Q8_0: w = d q, the codes by group (see the top of this file). A whole group's products sum per block in
// int32 over its 8 word rows (two chains), then take one conversion and one multiply-add by the 16 blocks'
// scales. With VNNI the stored unsigned bytes u = q + 128 multiply the signed inputs directly, so
// sum(w x) = d (sum(u x) - 128 sum(x)) per block, the second term through the inputs' block sums s (one
// multiply-add a 16 blocks); without it, the codes are made signed again. The row's last nb % 16 blocks, in
// block order, take one product a pair against the inputs as they are (q).
template <int R>
inline void dot_q8_0(const uint8_t* row, const QRow* x, int64_t K, float* out) {
  const int64_t nb = K / QK;
  const uint16_t* dp = (const uint16_t*)row;
  const uint8_t* qs = row + 2 * nb;
#ifdef TM_QUANT_VNNI
  auto codes = [](__m512i u) { return u; };
  auto product = [](__m512i acc, __m512i u, __m512i xv) { return _mm512_dpbusd_epi32(acc, u, xv); };
#else
  auto codes = [](__m512i u) { return _mm512_xor_si512(u, _mm512_set1_epi8((char)0x80)); };
  auto product = [](__m512i acc, __m512i q, __m512i xv) { return _mm512_add_epi32(acc, dot4_signed(q, xv)); };
#endif
  __m512 acc[R], acc2[R];
  for (int r = 0; r < R; ++r) acc[r] = acc2[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < nb; g += kGroup) {
    const int n = (int)std::min<int64_t>(kGroup, nb - g);
    const __mmask16 mask = (__mmask16)((1u << n) - 1);
    const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, dp + g));
    __m512 scale[R];
    for (int r = 0; r < R; ++r) {
      scale[r] = _mm512_mul_ps(dv, _mm512_maskz_loadu_ps(mask, x[r].d + g));
#ifdef TM_QUANT_VNNI
      acc2[r] = _mm512_fmadd_ps(_mm512_mul_ps(dv, _mm512_set1_ps(-128.f)), _mm512_maskz_loadu_ps(mask, x[r].s + g), acc2[r]);
#endif
    }
    const uint8_t* w = qs + g * QK;
    if (n == kGroup) {
      __m512i a[R], b[R];
      for (int r = 0; r < R; ++r) a[r] = b[r] = _mm512_setzero_si512();
      for (int t = 0; t < 8; t += 2) {
        const __m512i w0 = codes(_mm512_loadu_si512((const void*)(w + 64 * t)));
        const __m512i w1 = codes(_mm512_loadu_si512((const void*)(w + 64 * t + 64)));
        for (int r = 0; r < R; ++r) {
          const int8_t* xp = x[r].qt + g * QK + 64 * t;
          a[r] = product(a[r], w0, _mm512_loadu_si512((const void*)xp));
          b[r] = product(b[r], w1, _mm512_loadu_si512((const void*)(xp + 64)));
        }
      }
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a[r], b[r])), scale[r], acc[r]);
      continue;
    }
    for (int k = 0; 2 * k < n; ++k) {  // the row's last blocks, in block order: two (or the last one) a vector
      const __mmask16 lanes = 2 * k + 1 < n ? 0xFFFF : 0x00FF;
      const __m512i wv = codes(_mm512_maskz_loadu_epi32(lanes, w + 64 * k));
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_maskz_loadu_epi32(lanes, x[r].q + (g + 2 * k) * QK);
        const __m512 p = _mm512_cvtepi32_ps(product(_mm512_setzero_si512(), wv, xv));
        acc[r] = _mm512_fmadd_ps(p, pair_scales(scale[r], k), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r], acc2[r]);
}

// Two weight rows' pieces of the pair kernels below. A whole group's int32 sums a[v][r] converted and scaled
// by the blocks' weight and input scales into acc[v][r] (the scales multiplied here: held through the group's
// products, they would take registers the products need).
template <int R>
TM_INLINE void add_group_pair(__m512 (&acc)[2][R], const __m512i (&a)[2][R], const __m512 (&dv)[2], const QRow* x, int64_t g) {
  for (int r = 0; r < R; ++r) {
    const __m512 xd = _mm512_loadu_ps(x[r].d + g);
    for (int v = 0; v < 2; ++v) acc[v][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[v][r]), _mm512_mul_ps(dv[v], xd), acc[v][r]);
  }
}
// The scales of a row's last blocks (the lanes of `mask`): weight row v's times input row r's.
template <int R>
TM_INLINE void scales_pair(__m512 (&scale)[2][R], const __m512 (&dv)[2], const QRow* x, int64_t g, __mmask16 mask) {
  for (int r = 0; r < R; ++r) {
    const __m512 xd = _mm512_maskz_loadu_ps(mask, x[r].d + g);
    for (int v = 0; v < 2; ++v) scale[v][r] = _mm512_mul_ps(dv[v], xd);
  }
}

// Q8_0, two weight rows (rows[0], rows[1]) against R input rows at once: out[r] for the first, out[R + r] for
// the second, each exactly as dot_q8_0 gives it (the same operations in the same order, the integer sums
// exact however they are chained), with one load of each input vector for both rows.
template <int R>
inline void dot_q8_0_pair(const uint8_t* const* rows, const QRow* x, int64_t K, float* out) {
  const int64_t nb = K / QK;
  const uint16_t* dp[2];
  const uint8_t* qs[2];
  for (int v = 0; v < 2; ++v) dp[v] = (const uint16_t*)rows[v], qs[v] = rows[v] + 2 * nb;
#ifdef TM_QUANT_VNNI
  auto codes = [](__m512i u) { return u; };
  auto product = [](__m512i acc, __m512i u, __m512i xv) { return _mm512_dpbusd_epi32(acc, u, xv); };
#else
  auto codes = [](__m512i u) { return _mm512_xor_si512(u, _mm512_set1_epi8((char)0x80)); };
  auto product = [](__m512i acc, __m512i q, __m512i xv) { return _mm512_add_epi32(acc, dot4_signed(q, xv)); };
#endif
  __m512 acc[2][R], acc2[2][R];
  for (int v = 0; v < 2; ++v)
    for (int r = 0; r < R; ++r) acc[v][r] = acc2[v][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < nb; g += kGroup) {
    const int n = (int)std::min<int64_t>(kGroup, nb - g);
    const __mmask16 mask = (__mmask16)((1u << n) - 1);
    __m512 dv[2];
    for (int v = 0; v < 2; ++v) dv[v] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, dp[v] + g));
#ifdef TM_QUANT_VNNI
    for (int r = 0; r < R; ++r) {
      const __m512 xs = _mm512_maskz_loadu_ps(mask, x[r].s + g);
      for (int v = 0; v < 2; ++v) acc2[v][r] = _mm512_fmadd_ps(_mm512_mul_ps(dv[v], _mm512_set1_ps(-128.f)), xs, acc2[v][r]);
    }
#endif
    if (n == kGroup) {
      __m512i a[2][R];
      for (int v = 0; v < 2; ++v)
        for (int r = 0; r < R; ++r) a[v][r] = _mm512_setzero_si512();
      for (int t = 0; t < 8; t += 2) {
        __m512i w0[2], w1[2];
        for (int v = 0; v < 2; ++v) {
          const uint8_t* w = qs[v] + g * QK + 64 * t;
          w0[v] = codes(_mm512_loadu_si512((const void*)w)), w1[v] = codes(_mm512_loadu_si512((const void*)(w + 64)));
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xp = x[r].qt + g * QK + 64 * t;
          const __m512i x0 = _mm512_loadu_si512((const void*)xp), x1 = _mm512_loadu_si512((const void*)(xp + 64));
          for (int v = 0; v < 2; ++v) a[v][r] = product(product(a[v][r], w0[v], x0), w1[v], x1);
        }
      }
      add_group_pair<R>(acc, a, dv, x, g);
      continue;
    }
    __m512 scale[2][R];
    scales_pair<R>(scale, dv, x, g, mask);
    for (int k = 0; 2 * k < n; ++k) {  // the row's last blocks, in block order: two (or the last one) a vector
      const __mmask16 lanes = 2 * k + 1 < n ? 0xFFFF : 0x00FF;
      __m512i wv[2];
      for (int v = 0; v < 2; ++v) wv[v] = codes(_mm512_maskz_loadu_epi32(lanes, qs[v] + g * QK + 64 * k));
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_maskz_loadu_epi32(lanes, x[r].q + (g + 2 * k) * QK);
        for (int v = 0; v < 2; ++v) {
          const __m512 p = _mm512_cvtepi32_ps(product(_mm512_setzero_si512(), wv[v], xv));
          acc[v][r] = _mm512_fmadd_ps(p, pair_scales(scale[v][r], k), acc[v][r]);
        }
      }
    }
  }
  for (int v = 0; v < 2; ++v)
    for (int r = 0; r < R; ++r) out[v * R + r] = hsum(acc[v][r], acc2[v][r]);
}

// Q4_0 (w = d (q - 8)) and Q4_1 (w = d q + m), the codes by group: a whole group's four 64-byte word rows hold
// its blocks' elements 4t..4t + 3 in their low nibbles and 16 + 4t..16 + 4t + 3 in their high ones, so
// each block's byte products sum in int32 (two chains, low and high) and take one conversion and one
// multiply-add a group; the offsets (m, or the bias times d) come through the inputs' block sums. Q5_0 and
// Q5_1 add the fifth bits, a byte mask a word row. MXFP4 (FP4): a byte shuffle turns each code q into
// u = v + 12, v its doubled FP4 value, so w = e8m0_half(e) (u - 12): unsigned bytes as the other formats',
// with the offset taken through the inputs' block sums as Q4_0's. IQ4_NL (NL): the shuffle names the
// table value v (kIq4Values, -127..113): as u = v + 128 with VNNI (whose products of unsigned bytes cannot
// saturate), the offset of 128 again through the block sums; without it as v itself, multiplied as |v| by
// the inputs with v's sign (dot4_signed: each 16-bit pair of products stays below 2^15). The row's last
// nb % 16 blocks, in block order, take one product a pair as Q8_0's.
template <int R, bool HAS_MIN, bool FIVE, bool FP4 = false, bool NL = false>
inline void dot_q4_01(const uint8_t* row, const QRow* x, int64_t K, float* out) {
  const int64_t nb = K / QK;
  const NibbleRow rw(HAS_MIN ? (FIVE ? Q5_1 : Q4_1) : (FIVE ? Q5_0 : Q4_0), row, nb);
  const uint16_t* dp = rw.d;
  const uint16_t* mp = rw.m;
  const uint8_t* qs = FP4 ? row + nb : rw.qs;
#ifdef TM_QUANT_VNNI
  constexpr bool kSigned = false;
#else
  constexpr bool kSigned = NL;
#endif
  const float bias = FP4 ? -12.f : NL ? (kSigned ? 0.f : -128.f) : FIVE ? -16.f : -8.f;
  const __m512i fp4 = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m512i nl = iq4_bytes(!kSigned);
  const __m512i m4 = _mm512_set1_epi8(0xF), c16 = _mm512_set1_epi8(16);
  auto lookup = [&](__m512i codes) {
    return FP4 ? _mm512_shuffle_epi8(fp4, codes) : NL ? _mm512_shuffle_epi8(nl, codes) : codes;
  };
  // acc + the byte products of codes-made-values w with inputs xv, four to a lane
  auto product = [](__m512i acc, __m512i w, __m512i xv) {
    if constexpr (kSigned) return _mm512_add_epi32(acc, dot4_signed(w, xv));
    else return dot4_add(acc, w, xv);
  };
  __m512 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < nb; g += kGroup) {
    const int n = (int)std::min<int64_t>(kGroup, nb - g);
    const __mmask16 mask = (__mmask16)((1u << n) - 1);
    __m512 dv;
    if constexpr (FP4) {  // 2^(e - 128) (subnormal for e < 2) from 16 scale bytes (the codes follow: in the row)
      const __m512i e = _mm512_maskz_mov_epi32(mask, _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(row + g))));
      dv = _mm512_scalef_ps(_mm512_set1_ps(1.f), _mm512_cvtepi32_ps(_mm512_sub_epi32(e, _mm512_set1_epi32(128))));
    } else {
      dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, dp + g));
    }
    __m512 mv = HAS_MIN ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mp + g)) : _mm512_mul_ps(dv, _mm512_set1_ps(bias));
    __m512 scale[R];
    for (int r = 0; r < R; ++r) {
      scale[r] = _mm512_mul_ps(dv, _mm512_maskz_loadu_ps(mask, x[r].d + g));
      off[r] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(mask, x[r].s + g), off[r]);
    }
    const uint8_t* w = qs + g * 16;
    const uint8_t* bits = rw.qh + 4 * g;  // (read only by FIVE)
    if (n == kGroup) {
      __m512i a[R], b[R];
      for (int r = 0; r < R; ++r) a[r] = b[r] = _mm512_setzero_si512();
      for (int t = 0; t < 4; ++t) {
        const __m512i q = _mm512_loadu_si512((const void*)(w + 64 * t));
        __m512i lo = lookup(_mm512_and_si512(q, m4)), hi = lookup(_mm512_and_si512(_mm512_srli_epi16(q, 4), m4));
        if (FIVE) {  // the word row's 64 bits of each (see the top of this file)
          uint64_t l, h;
          std::memcpy(&l, bits + 8 * t, 8);
          std::memcpy(&h, bits + 32 + 8 * t, 8);
          lo = _mm512_mask_add_epi8(lo, (__mmask64)l, lo, c16), hi = _mm512_mask_add_epi8(hi, (__mmask64)h, hi, c16);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xp = x[r].qt + g * QK + 64 * t;  // words t (low nibbles) and 4 + t (high ones)
          a[r] = product(a[r], lo, _mm512_loadu_si512((const void*)xp));
          b[r] = product(b[r], hi, _mm512_loadu_si512((const void*)(xp + 256)));
        }
      }
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a[r], b[r])), scale[r], acc[r]);
      continue;
    }
    for (int k = 0; 2 * k < n; ++k) {  // the row's last blocks, in block order: two (or the last one) a vector
      const bool pair = 2 * k + 1 < n;
      const __m256i q = pair ? _mm256_loadu_si256((const __m256i*)(w + 32 * k))
                             : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)(w + 32 * k)));
      // [first's low nibbles | its high ones | second's low | its high]: elements 0-31 of each
      const __m512i lh = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, _mm512_castsi512_si256(m4))),
                                            _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm512_castsi512_si256(m4)), 1);
      __m512i wv = lookup(_mm512_shuffle_i64x2(lh, lh, 0xD8));
      if (FIVE) {
        uint64_t h = 0;
        std::memcpy(&h, bits + 8 * k, pair ? 8 : 4);
        wv = _mm512_mask_add_epi8(wv, (__mmask64)h, wv, c16);
      }
      const __mmask16 lanes = pair ? 0xFFFF : 0x00FF;
      for (int r = 0; r < R; ++r) {
        const __m512 p = _mm512_cvtepi32_ps(product(_mm512_setzero_si512(), wv, _mm512_maskz_loadu_epi32(lanes, x[r].q + (g + 2 * k) * QK)));
        acc[r] = _mm512_fmadd_ps(p, pair_scales(scale[r], k), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r], off[r]);
}

// Q4_0 and Q4_1, two weight rows against R input rows at once, each exactly as dot_q4_01 gives it, as
// dot_q8_0_pair.
template <int R, bool HAS_MIN>
inline void dot_q4_01_pair(const uint8_t* const* rows, const QRow* x, int64_t K, float* out) {
  const int64_t nb = K / QK;
  const NibbleRow rw[2] = {{HAS_MIN ? Q4_1 : Q4_0, rows[0], nb}, {HAS_MIN ? Q4_1 : Q4_0, rows[1], nb}};
  const __m512i m4 = _mm512_set1_epi8(0xF);
  __m512 acc[2][R], off[2][R];
  for (int v = 0; v < 2; ++v)
    for (int r = 0; r < R; ++r) acc[v][r] = off[v][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < nb; g += kGroup) {
    const int n = (int)std::min<int64_t>(kGroup, nb - g);
    const __mmask16 mask = (__mmask16)((1u << n) - 1);
    __m512 dv[2], mv[2];
    for (int v = 0; v < 2; ++v) {
      dv[v] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, rw[v].d + g));
      mv[v] = HAS_MIN ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, rw[v].m + g)) : _mm512_mul_ps(dv[v], _mm512_set1_ps(-8.f));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xs = _mm512_maskz_loadu_ps(mask, x[r].s + g);
      for (int v = 0; v < 2; ++v) off[v][r] = _mm512_fmadd_ps(mv[v], xs, off[v][r]);
    }
    if (n == kGroup) {
      __m512i a[2][R];
      for (int v = 0; v < 2; ++v)
        for (int r = 0; r < R; ++r) a[v][r] = _mm512_setzero_si512();
      for (int t = 0; t < 4; ++t) {
        __m512i lo[2], hi[2];
        for (int v = 0; v < 2; ++v) {
          const __m512i q = _mm512_loadu_si512((const void*)(rw[v].qs + g * 16 + 64 * t));
          lo[v] = _mm512_and_si512(q, m4), hi[v] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xp = x[r].qt + g * QK + 64 * t;  // words t (low nibbles) and 4 + t (high ones)
          const __m512i xl = _mm512_loadu_si512((const void*)xp), xh = _mm512_loadu_si512((const void*)(xp + 256));
          for (int v = 0; v < 2; ++v) a[v][r] = dot4_add(dot4_add(a[v][r], lo[v], xl), hi[v], xh);
        }
      }
      add_group_pair<R>(acc, a, dv, x, g);
      continue;
    }
    __m512 scale[2][R];
    scales_pair<R>(scale, dv, x, g, mask);
    for (int k = 0; 2 * k < n; ++k) {  // the row's last blocks, in block order: two (or the last one) a vector
      const bool pair = 2 * k + 1 < n;
      __m512i wv[2];
      for (int v = 0; v < 2; ++v) {
        const uint8_t* w = rw[v].qs + g * 16 + 32 * k;
        const __m256i q = pair ? _mm256_loadu_si256((const __m256i*)w) : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)w));
        const __m512i lh = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, _mm512_castsi512_si256(m4))),
                                              _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm512_castsi512_si256(m4)), 1);
        wv[v] = _mm512_shuffle_i64x2(lh, lh, 0xD8);
      }
      const __mmask16 lanes = pair ? 0xFFFF : 0x00FF;
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_maskz_loadu_epi32(lanes, x[r].q + (g + 2 * k) * QK);
        for (int v = 0; v < 2; ++v)
          acc[v][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot4(wv[v], xv)), pair_scales(scale[v][r], k), acc[v][r]);
      }
    }
  }
  for (int v = 0; v < 2; ++v)
    for (int r = 0; r < R; ++r) out[v * R + r] = hsum(acc[v][r], off[v][r]);
}

// The 6-bit scales and mins of a Q4_K / Q5_K super-block as 16 bytes [sc 0..7 | m 0..7].
TM_INLINE __m128i scales_mins_k4(const uint8_t* s) {
  uint32_t w[3];
  std::memcpy(w, s, 12);
  uint32_t sc_lo = w[0] & 0x3f3f3f3f, m_lo = w[1] & 0x3f3f3f3f;
  uint32_t sc_hi = (w[2] & 0x0f0f0f0f) | (((w[0] >> 6) & 0x03030303) << 4);
  uint32_t m_hi = ((w[2] >> 4) & 0x0f0f0f0f) | (((w[1] >> 6) & 0x03030303) << 4);
  return _mm_set_epi32((int)m_hi, (int)m_lo, (int)sc_hi, (int)sc_lo);
}

// int32 lanes of p (each |p| < 2^15) times the signed 16-bit values in the low halves of sc's int32 lanes
// (their high halves zero), added to acc: p read as int16 pairs (value, sign), sc as (value, 0), whose pair
// products sum to p * sc.
TM_INLINE __m512i add_scaled(__m512i acc, __m512i p, __m512i sc) {
#ifdef TM_QUANT_VNNI
  return _mm512_dpwssd_epi32(acc, p, sc);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p, sc));
#endif
}

// Q4_K and Q5_K: w = d sc_j q - dmin m_j per 32-element sub-block j of a 256-element super-block, against
// inputs with one scale per 256 (QRow::per256, its q4, d and s). A sub-block's byte products (at most 4 * 31 *
// 127 per lane) times its 6-bit scale sum in int32 over the super-block, which then takes one float
// multiply. A 64-byte load holds sub-blocks 4h, 4h + 2 (low nibbles) and 4h + 1, 4h + 3 (high ones).
template <int R, bool FIVE>
inline void dot_q45_k(const uint8_t* row, const QRow* x, int64_t K, float* out) {
  __m512 acc[R];
  __m256 off[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), off[r] = _mm256_setzero_ps();
  const int size = FIVE ? 176 : 144;
  const __m512i m4 = _mm512_set1_epi8(0xF);
  // the scale lanes of each product vector: sub-block 4h + i in lanes 0-7, 4h + i + 2 in lanes 8-15
  const __m512i pick[4] = {_mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0),
                           _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1),
                           _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4),
                           _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 5, 5, 5, 5, 5, 5, 5, 5)};
  for (int64_t b = 0; b < K / QKK; ++b) {
    const uint8_t* blk = row + b * size;
    const uint8_t* qs = blk + (FIVE ? 48 : 16);
    const __m128i scm = scales_mins_k4(blk + 4);
    const __m512i sc = _mm512_cvtepu8_epi32(scm);  // lanes 0-7 the scales (8-15 the mins, unused here)
    const __m256 mn = _mm256_mul_ps(_mm256_set1_ps(fp16(*(const uint16_t*)(blk + 2))),
                                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scm, 8))));
    const int64_t a0 = b * (QKK / QK);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) {
      isum[r] = _mm512_setzero_si512();
      off[r] = _mm256_fnmadd_ps(mn, _mm256_loadu_ps(x[r].per256->s + a0), off[r]);
    }
    __m512i hb;
    if (FIVE) hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(blk + 16)));
    for (int h = 0; h < 2; ++h) {
      const __m512i q = _mm512_loadu_si512((const void*)(qs + 64 * h));
      __m512i w[2] = {_mm512_and_si512(q, m4), _mm512_and_si512(_mm512_srli_epi16(q, 4), m4)};
      if (FIVE) {  // bit k of the high-bit byte i: the fifth bit of element i of sub-block k
        const __m512i c16 = _mm512_set1_epi8(16);
        for (int i = 0; i < 2; ++i) {
          const int k = 4 * h + i;
          const __m512i bit = _mm512_mask_blend_epi64(0xF0, _mm512_set1_epi8((char)(1 << k)), _mm512_set1_epi8((char)(1 << (k + 2))));
          w[i] = _mm512_mask_add_epi8(w[i], _mm512_test_epi8_mask(hb, bit), w[i], c16);
        }
      }
      const __m512i s0 = _mm512_permutexvar_epi32(pick[2 * h], sc), s1 = _mm512_permutexvar_epi32(pick[2 * h + 1], sc);
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x[r].per256->q4 + (a0 + 4 * h) * QK;
        isum[r] = add_scaled(isum[r], dot4(w[0], _mm512_loadu_si512((const void*)xq)), s0);
        isum[r] = add_scaled(isum[r], dot4(w[1], _mm512_loadu_si512((const void*)(xq + 2 * QK))), s1);
      }
    }
    const float d = fp16(*(const uint16_t*)blk);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_set1_ps(d * x[r].per256->d[a0]), acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r], zext(off[r]));
}

// Lanes 4k..4k + 3 of pick_sub16(c) name sub-block 4c + k: the scale lanes of a product vector c of
// 64 elements in order (Q6_K's, Q3_K's and Q2_K's sub-blocks of 16).
TM_INLINE __m512i pick_sub16(int c) {
  const __m512i k = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2);
  return _mm512_add_epi32(k, _mm512_set1_epi32(4 * c));
}

// Q6_K: w = d sc_i (q - 32) per 16-element sub-block i, q's 4 low bits in ql and 2 high bits in qh; against
// inputs with one scale per 256 (QRow::per256, its q, d and sums16). As Q4_K's above, the sub-blocks' byte products
// (at most 4 * 63 * 127 per lane) times their signed 8-bit scales sum in int32 over the super-block; the
// codes' offset of 32 comes off once per super-block through the inputs' sums of 16.
template <int R>
inline void dot_q6_k(const uint8_t* row, const QRow* x, int64_t K, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0xF), m2 = _mm512_set1_epi8(0x33), low16 = _mm512_set1_epi32(0xFFFF);
  for (int64_t b = 0; b < K / QKK; ++b) {
    const BlockQ6_K* blk = (const BlockQ6_K*)(row + b * 210);
    const __m128i sc8 = _mm_loadu_si128((const __m128i*)blk->scales);
    const __m512i sc = _mm512_and_si512(_mm512_cvtepi8_epi32(sc8), low16);  // (scale, 0) as int16 pairs
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
    const int64_t a0 = b * (QKK / QK);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) {  // - 32 sum_i sc_i (sum of sub-block i's inputs)
      const __m256i m = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i*)(x[r].per256->sums16 + b * 16)));
      isum[r] = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(m, 5)), 0);
    }
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512((const void*)(blk->ql + 64 * h));
      const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk->qh + 32 * h));
      // hh: the 2-bit pairs of values 0-63 in bits 0-1 and of values 64-127 in bits 4-5 of each byte; then
      // each code's low 4 bits where m4 is set and its high 2 bits above them (0xE4: m4 ? first : second)
      const __m512i hh = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1), m2);
      const __m512i qa = _mm512_ternarylogic_epi32(ql, _mm512_slli_epi16(hh, 4), m4, 0xE4);
      const __m512i qb = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), hh, m4, 0xE4);
      const __m512i sa = _mm512_permutexvar_epi32(pick_sub16(2 * h), sc), sb = _mm512_permutexvar_epi32(pick_sub16(2 * h + 1), sc);
      const int64_t ab = a0 + 4 * h;  // qa: values 0-63 of this half, qb: 64-127
      for (int r = 0; r < R; ++r) {
        isum[r] = add_scaled(isum[r], dot4(qa, _mm512_loadu_si512((const void*)(x[r].per256->q + ab * QK))), sa);
        isum[r] = add_scaled(isum[r], dot4(qb, _mm512_loadu_si512((const void*)(x[r].per256->q + (ab + 2) * QK))), sb);
      }
    }
    const float d = fp16(blk->d);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_set1_ps(d * x[r].per256->d[a0]), acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

#include "quant_lowbit.h"  // Q2_K, Q3_K and IQ4_XS

#endif  // TM_QUANT_AVX512

#if defined(TOKENMILL_SIMDE) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 CPUs (the SIMDe build): the 32-element formats written with 256-bit vectors directly. Through
// SIMDe's 512-bit emulation their inner loops spill every vector to the stack (a 64-byte vector type has
// no register on these CPUs) and run ~4x slower; the K formats still take that path.
#define TM_QUANT_AVX2 1

inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// 8 int32 lanes, each the sum of 4 adjacent products of unsigned bytes u with signed bytes s.
inline __m256i dot4_256(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// Q8_0: w = d q, by group (see the top of this file). A whole group in two halves, blocks 0-7 and 8-15 (the
// 32-byte halves of its word rows), each block's products summed in int32 over the 8 word rows, then one
// conversion and multiply-add a half; the row's last nb % 16 blocks one by one, in block order.
// The codes, made signed again, multiply as unsigned |q| by the inputs with q's sign.
template <int R>
inline void dot_q8_0_avx2(const uint8_t* row, const QRow* x, int64_t K, float* out) {
  const int64_t nb = K / QK;
  const uint16_t* dp = (const uint16_t*)row;
  const uint8_t* qs = row + 2 * nb;
  const __m256i flip = _mm256_set1_epi8((char)0x80);
  auto product = [&](__m256i u, __m256i xv) {
    const __m256i q = _mm256_xor_si256(u, flip);
    return dot4_256(_mm256_abs_epi8(q), _mm256_sign_epi8(xv, q));
  };
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + kGroup <= nb; g += kGroup) {
    const uint8_t* w = qs + g * QK;
    for (int h = 0; h < 2; ++h) {
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dp + g + 8 * h)));
      __m256i a[R];
      for (int r = 0; r < R; ++r) a[r] = _mm256_setzero_si256();
      for (int t = 0; t < 8; ++t) {
        const __m256i wv = _mm256_loadu_si256((const __m256i*)(w + 64 * t + 32 * h));
        for (int r = 0; r < R; ++r)
          a[r] = _mm256_add_epi32(a[r], product(wv, _mm256_loadu_si256((const __m256i*)(x[r].qt + g * QK + 64 * t + 32 * h))));
      }
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r]), _mm256_mul_ps(dv, _mm256_loadu_ps(x[r].d + g + 8 * h)), acc[r]);
    }
  }
  for (int64_t b = g; b < nb; ++b) {  // the row's last blocks, in block order
    const __m256i wv = _mm256_loadu_si256((const __m256i*)(qs + b * QK));
    const float d = fp16(dp[b]);
    for (int r = 0; r < R; ++r) {
      const __m256i p = product(wv, _mm256_loadu_si256((const __m256i*)(x[r].q + b * QK)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * x[r].d[b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum256(acc[r]);
}

// Q4_0 (w = d (q - 8)), Q4_1 (w = d q + m), Q5_0 (w = d (q - 16)) and Q5_1 (w = d q + m), by group: a whole group
// in two halves as Q8_0's above (each word row's low nibbles against input words t, its high ones against
// words 4 + t), the row's last nb % 16 blocks one by one; the offsets through the inputs' block sums.
template <int R, bool HAS_MIN, bool FIVE>
inline void dot_q4_01_avx2(const uint8_t* row, const QRow* x, int64_t K, float* out) {
  const int64_t nb = K / QK;
  const NibbleRow rw(HAS_MIN ? (FIVE ? Q5_1 : Q4_1) : (FIVE ? Q5_0 : Q4_0), row, nb);
  const uint16_t* dp = rw.d;
  const uint16_t* mp = rw.m;
  const __m256i m4 = _mm256_set1_epi8(0xF);
  const float bias = FIVE ? -16.f : -8.f;
  __m256 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + kGroup <= nb; g += kGroup) {
    const uint8_t* w = rw.qs + g * 16;
    const uint8_t* bits = rw.qh + 4 * g;  // (read only by FIVE)
    for (int h = 0; h < 2; ++h) {
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dp + g + 8 * h)));
      const __m256 mv = HAS_MIN ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(mp + g + 8 * h)))
                                : _mm256_mul_ps(dv, _mm256_set1_ps(bias));
      __m256i a[R];
      for (int r = 0; r < R; ++r) {
        a[r] = _mm256_setzero_si256();
        off[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(x[r].s + g + 8 * h), off[r]);
      }
      for (int t = 0; t < 4; ++t) {
        const __m256i q = _mm256_loadu_si256((const __m256i*)(w + 64 * t + 32 * h));
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (FIVE) {  // this half's 8 words: 32 bits of the word row's 64
          lo = _mm256_or_si256(lo, fifth_bits((const uint32_t*)(bits + 8 * t + 4 * h)));
          hi = _mm256_or_si256(hi, fifth_bits((const uint32_t*)(bits + 32 + 8 * t + 4 * h)));
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xp = x[r].qt + g * QK + 64 * t + 32 * h;
          a[r] = _mm256_add_epi32(a[r], dot4_256(lo, _mm256_loadu_si256((const __m256i*)xp)));
          a[r] = _mm256_add_epi32(a[r], dot4_256(hi, _mm256_loadu_si256((const __m256i*)(xp + 256))));
        }
      }
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r]), _mm256_mul_ps(dv, _mm256_loadu_ps(x[r].d + g + 8 * h)), acc[r]);
    }
  }
  float tail[R] = {};
  const __m128i m = _mm_set1_epi8(0xF);
  for (int64_t b = g; b < nb; ++b) {  // the row's last blocks, in block order (codes and fifth bits)
    const __m128i q = _mm_loadu_si128((const __m128i*)(rw.qs + 16 * b));
    __m256i wv = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(q, m)), _mm_and_si128(_mm_srli_epi16(q, 4), m), 1);
    if (FIVE) wv = _mm256_or_si256(wv, fifth_bits((const uint32_t*)(rw.qh + 4 * b)));
    const float d = fp16(dp[b]), mb = HAS_MIN ? fp16(mp[b]) : bias * d;
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256((const __m256i*)(x[r].q + b * QK));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot4_256(wv, xv)), _mm256_set1_ps(d * x[r].d[b]), acc[r]);
      tail[r] += mb * x[r].s[b];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum256(_mm256_add_ps(acc[r], off[r])) + tail[r];
}
#endif

// out[r] = dot(weight row, activation row r) for R activation rows.
template <int R>
inline void dot(int type, const uint8_t* row, const QRow* x, int64_t K, float* out) {
#ifdef TM_QUANT_AVX2
  switch (type) {
    case Q8_0: return dot_q8_0_avx2<R>(row, x, K, out);
    case Q4_0: return dot_q4_01_avx2<R, false, false>(row, x, K, out);
    case Q4_1: return dot_q4_01_avx2<R, true, false>(row, x, K, out);
    case Q5_0: return dot_q4_01_avx2<R, false, true>(row, x, K, out);
    case Q5_1: return dot_q4_01_avx2<R, true, true>(row, x, K, out);
  }
#endif
#ifdef TM_QUANT_AVX512
  switch (type) {
    case Q8_0: return dot_q8_0<R>(row, x, K, out);
    case Q4_0: return dot_q4_01<R, false, false>(row, x, K, out);
    case Q4_1: return dot_q4_01<R, true, false>(row, x, K, out);
    case Q5_0: return dot_q4_01<R, false, true>(row, x, K, out);
    case Q5_1: return dot_q4_01<R, true, true>(row, x, K, out);
    case Q4_K: if (x[0].per256) return dot_q45_k<R, false>(row, x, K, out); break;  // (else: dot_generic)
    case Q5_K: if (x[0].per256) return dot_q45_k<R, true>(row, x, K, out); break;
    case Q6_K: if (x[0].per256) return dot_q6_k<R>(row, x, K, out); break;
    case MXFP4: return dot_q4_01<R, false, false, true>(row, x, K, out);
    case IQ4_NL: return dot_q4_01<R, false, false, false, true>(row, x, K, out);
    case Q2_K: if (x[0].per256) return dot_q23_k<R, false>(row, x, K, out); break;
    case Q3_K: if (x[0].per256) return dot_q23_k<R, true>(row, x, K, out); break;
    case IQ4_XS: if (x[0].per256) return dot_iq4_xs<R>(row, x, K, out); break;
  }
#endif
  dot_generic<R>(type, row, x, K, out);
}

// Whether the kernels take two weight rows of this format in one pass (dot_rows2): the AVX-512 ones of Q8_0,
// Q4_0 and Q4_1, which then share the inputs' loads between the rows. The other formats are better taken
// one row after the other. (Q5_0 in one pass, written as Q4_0's with its fifth bits' byte masks, took
// 1.2-1.6x the time of one row after the other on Zen 4, in a first build whose loop also slowed the
// one-row kernels by 5-13%; it was not tried again.)
inline bool pairs_rows(int type) {
#if defined(TM_QUANT_AVX512) && !defined(TM_QUANT_AVX2)
  return type == Q8_0 || type == Q4_0 || type == Q4_1;
#else
  (void)type;
  return false;
#endif
}

constexpr int kRowGroup = 4;  // the most activation rows one pass over a weight row takes

// out[r] = dot(weight row, activation row r) for n activation rows, 1 <= n <= kRowGroup.
inline void dot_rows(int type, const uint8_t* row, const QRow* x, int n, int64_t K, float* out) {
  switch (n) {
    case 1: return dot<1>(type, row, x, K, out);
    case 2: return dot<2>(type, row, x, K, out);
    case 3: return dot<3>(type, row, x, K, out);
    default: return dot<4>(type, row, x, K, out);
  }
}

// Two weight rows of a format that pairs_rows at once: out[r] for row0, out[kRowGroup + r] for row1, each
// exactly as dot_rows gives it, for n activation rows, 1 <= n <= kRowGroup.
inline void dot_rows2(int type, const uint8_t* row0, const uint8_t* row1, const QRow* x, int n, int64_t K, float* out) {
#if defined(TM_QUANT_AVX512) && !defined(TM_QUANT_AVX2)
  const uint8_t* rows[2] = {row0, row1};
  float o[2 * kRowGroup];
  auto pair = [&](auto r) {
    constexpr int R = decltype(r)::value;
    switch (type) {
      case Q8_0: return dot_q8_0_pair<R>(rows, x, K, o);
      case Q4_0: return dot_q4_01_pair<R, false>(rows, x, K, o);
      default: return dot_q4_01_pair<R, true>(rows, x, K, o);
    }
  };
  switch (n) {
    case 1: pair(std::integral_constant<int, 1>()); break;
    case 2: pair(std::integral_constant<int, 2>()); break;
    case 3: pair(std::integral_constant<int, 3>()); break;
    default: pair(std::integral_constant<int, 4>()); break;
  }
  for (int r = 0; r < n; ++r) out[r] = o[r], out[kRowGroup + r] = o[n + r];
#else
  (void)type, (void)row0, (void)row1, (void)x, (void)n, (void)K, (void)out;  // (pairs_rows: never here)
#endif
}

}  // namespace tmq
