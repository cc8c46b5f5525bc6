// Weight rows interleaved by 16: a second layout of the Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K-Q6_K, IQ4_NL and IQ4_XS
// blocks, for the byte products of a few input rows (decode, speculative verify steps, small batches).
//
// In the row layout (quant.h) a vector's 16 int32 lanes are 16 blocks of one weight row: each pair of weight
// row and input row ends in its own conversion, scaling and horizontal sum, and on short rows (the default
// model's 576 elements are 18 blocks) those instructions, not the weight stream, set the speed. Here a
// vector's lanes are 16 weight rows: a tile of 16 rows is stored block by block, and in block b of a tile
//   Q8_0  [16 float16 scales d] [8 x 64 bytes: word t of row j (elements 4t..4t+3, as q + 128) at 64t + 4j]
//   Q4_0  [16 float16 scales d] [4 x 64 bytes: word t of row j's codes at 64t + 4j]
//   Q4_1  [16 float16 scales d] [16 float16 offsets m] [4 x 64 bytes, as Q4_0]
//   Q5_0  [16 float16 scales d] [16 x 4 bytes: row j's fifth bits (GGUF's qh) at 4j] [4 x 64 bytes, as Q4_0]
//   Q5_1  [16 float16 scales d] [16 float16 offsets m] [16 x 4 bytes of fifth bits] [4 x 64 bytes, as Q4_0]
//   IQ4_NL as Q4_0 (its block is Q4_0's; the codes name the table's values)
// (a 4-bit code byte i holds element i in its low nibble and i + 16 in its high one, as GGUF has it); and in
// super-block b of a tile of the K formats (256 elements a row, GGUF's fields interleaved by 4-byte words):
//   Q4_K  [16 float16 d] [16 float16 dmin] [3 x 64 bytes: word w of row j's 12 packed 6-bit scales and mins
//         at 64w + 4j] [32 x 64 bytes: word t of row j's codes (qs) at 64t + 4j]
//   Q5_K  as Q4_K, with [8 x 64 bytes: the fifth bits' words (qh)] between the scales and the codes
//   Q6_K  [16 x 3 x 64 bytes: sub-block i's 4 code words packed in 3 (q6_k_group)] [16 x 16 bytes: the int8
//         scales, sub-block i's of row j at 16i + j] [16 float16 d]
//   Q2_K  [16 float16 d] [16 float16 dmin] [4 x 64 bytes: scale-and-min words] [16 x 64 bytes: qs words]
//   Q3_K  [16 float16 d] [3 x 64 bytes: packed scale words] [8 x 64 bytes: hmask words] [16 x 64 bytes: qs words]
//   IQ4_XS [16 float16 d] [16 x 2 bytes: scales_h] [16 x 4 bytes: scales_l] [32 x 64 bytes: qs words]
// The
// tile holds the same bytes as its 16 rows of GGUF blocks: a matrix keeps its size, and rows [16t, 16t + 16)
// keep their byte range. An input row's 4-byte word is broadcast to every lane: one vpdpbusd takes 4 values
// of 16 weight rows, a block's sums are converted and scaled once for 16 rows, no row ends in a horizontal
// sum, and each weight vector serves every input row of the pass (benchmarks/interleaved_rows.py times it
// against the row layout).
//
// A tiled matrix's type id is its format's with kTiled set, so that the layout travels wherever the type
// does. Only matrices of whole tiles (rows a multiple of 16) are tiled, and only where the kernels take
// AVX-512 VNNI (quant.py decides at load). A tiled row's result comes from tile_rows alone, whichever path
// (fused decoder or module) or row split asks for it, so it never depends on the schedule.
#pragma once

#include <iterator>
#include <utility>

#include "quant.h"

namespace tmq {

constexpr int kTiled = 256;   // set in a type id: rows interleaved by 16
constexpr int kTileRows = 16;

inline bool is_tiled(int type) { return (type & kTiled) != 0; }
inline int base_type(int type) { return type & ~kTiled; }
inline bool k_format(int base) {
  return base == Q4_K || base == Q5_K || base == Q6_K || base == Q2_K || base == Q3_K || base == IQ4_XS;
}
inline bool can_tile(int type) {
  return type == Q8_0 || type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == IQ4_NL || k_format(type);
}
// A format's GGUF block (quant.h's format_of: elements and bytes), a row's blocks, and a tile's block (16 rows).
inline Format gguf_block(int base) {
  Format f{};
  format_of(base, f);
  return f;
}
inline int64_t tile_blocks(int base, int64_t K) { return K / gguf_block(base).block; }

// format_of for a type id that may carry kTiled: its format's blocks, where the format has kernels (and,
// tiled, a tile kernel).
inline bool kernel_format_of(int type, Format& f) {
  return format_of(base_type(type), f) && (!is_tiled(type) || can_tile(base_type(type)));
}

// Where a tile block's parts lie, and a GGUF block's. A tile block: [16 scales d] ([16 offsets m]) ([16 x 4
// bytes of fifth bits]) [code words]; a GGUF block: d (m) (qh) codes.
struct TileFormat {
  int gguf_bytes;  // a GGUF block
  int m, h;        // a tile block's offsets and fifth bits (-1: none)
  int codes;       // where its code words start
  int code_bytes;  // a row's code bytes in a block (32 for Q8_0, 16 for the 4- and 5-bit formats)
  constexpr int gguf_m() const { return 2; }
  constexpr int gguf_h() const { return m >= 0 ? 4 : 2; }
  constexpr int gguf_codes() const { return 2 + (m >= 0 ? 2 : 0) + (h >= 0 ? 4 : 0); }
};
constexpr TileFormat tile_format(int base) {
  return base == Q8_0   ? TileFormat{34, -1, -1, 32, 32}
         : base == Q4_0 || base == IQ4_NL ? TileFormat{18, -1, -1, 32, 16}  // (IQ4_NL: Q4_0's block, table codes)
         : base == Q4_1 ? TileFormat{20, 32, -1, 64, 16}
         : base == Q5_0 ? TileFormat{22, -1, 32, 96, 16}
                        : TileFormat{24, 32, 64, 128, 16};  // Q5_1
}
inline int64_t tile_block_bytes(int base) { return kTileRows * gguf_block(base).bytes; }

// A K format's super-block as fields of GGUF's block: a field of 2 bytes (a float16) lies at tile + 2j for
// row j, a longer one by 4-byte words, word t of row j at tile + 64t + 4j.
struct KField {
  int gguf, bytes, tile;
};
// Where the kernels find them in a tile block (the layout at the top of this file):
constexpr int kQ4KScales = 64, kQ4KCodes = 256;         // Q4_K (and Q5_K): d at 0, dmin at 32
constexpr int kQ5KHigh = 256, kQ5KCodes = 768;
constexpr int kQ6KScales = 3072, kQ6KD = 3328;  // Q6_K: the packed code words at 0
constexpr KField kQ4KFields[] = {{0, 2, 0}, {2, 2, 32}, {4, 12, kQ4KScales}, {16, 128, kQ4KCodes}};
constexpr KField kQ5KFields[] = {{0, 2, 0}, {2, 2, 32}, {4, 12, kQ4KScales}, {16, 32, kQ5KHigh}, {48, 128, kQ5KCodes}};
// Q6_K's code fields as GGUF has them (ql, then qh), by words of 16 rows: ql word t of row j at 64t + 4j, qh's
// from kQ6KWordsHigh. A Q6_K tile block is packed from this at load (q6_k_pack) and unpacked to it to rebuild
// GGUF's blocks (q6_k_unpack); its scales and d are moved byte by byte.
constexpr int kQ6KWordsHigh = 2048, kQ6KWordBytes = 3072;
constexpr KField kQ6KWordFields[] = {{0, 128, 0}, {128, 64, kQ6KWordsHigh}};
// Q2_K: [16 float16 d] [16 float16 dmin] [4 x 64 bytes: the 16 scale-and-min bytes' words] [16 x 64: qs words]
constexpr int kQ2KScales = 64, kQ2KCodes = 320;
constexpr KField kQ2KFields[] = {{80, 2, 0}, {82, 2, 32}, {0, 16, kQ2KScales}, {16, 64, kQ2KCodes}};
// Q3_K: [16 float16 d] [3 x 64 bytes: the 12 packed scale bytes' words] [8 x 64: hmask words] [16 x 64: qs words]
constexpr int kQ3KScales = 32, kQ3KHigh = 224, kQ3KCodes = 736;
constexpr KField kQ3KFields[] = {{108, 2, 0}, {96, 12, kQ3KScales}, {0, 32, kQ3KHigh}, {32, 64, kQ3KCodes}};
// IQ4_XS: [16 float16 d] [16 x 2 bytes: scales_h] [16 x 4 bytes: scales_l] [32 x 64 bytes: qs words]
constexpr int kIQ4XSHigh = 32, kIQ4XSLow = 64, kIQ4XSCodes = 128;
constexpr KField kIQ4XSFields[] = {{0, 2, 0}, {2, 2, kIQ4XSHigh}, {4, 4, kIQ4XSLow}, {8, 128, kIQ4XSCodes}};
constexpr int kMaxKBlockBytes = sizeof(BlockQ6_K);  // the largest of the K formats' GGUF blocks

// A K format's fields.
struct KFields {
  const KField* begin() const { return first; }
  const KField* end() const { return last; }
  const KField *first, *last;
};
inline KFields k_fields_of(int base) {
  switch (base) {
    case Q4_K: return {std::begin(kQ4KFields), std::end(kQ4KFields)};
    case Q5_K: return {std::begin(kQ5KFields), std::end(kQ5KFields)};
    case Q2_K: return {std::begin(kQ2KFields), std::end(kQ2KFields)};
    case Q3_K: return {std::begin(kQ3KFields), std::end(kQ3KFields)};
    case IQ4_XS: return {std::begin(kIQ4XSFields), std::end(kIQ4XSFields)};
    default: return {std::begin(kQ6KWordFields), std::end(kQ6KWordFields)};  // Q6_K: its code fields' words
  }
}

// Copies a K-format super-block's fields from one side to the other: row j's GGUF block to its tile block
// (ToTile), or back.
template <bool ToTile, typename From, typename To>
inline void k_field(const KField& f, From* from, To* to, int j) {
  if (f.bytes == 2) {  // (fixed sizes: moves, not calls)
    std::memcpy(to + (ToTile ? f.tile + 2 * j : f.gguf), from + (ToTile ? f.gguf : f.tile + 2 * j), 2);
    return;
  }
  for (int i = 0; i < f.bytes; i += 4) {
    const int64_t g = f.gguf + i, t = f.tile + 16 * i + 4 * j;
    std::memcpy(to + (ToTile ? t : g), from + (ToTile ? g : t), 4);
  }
}
// Q6_K's 6-bit code of element e (< 256) of a GGUF block: its low 4 bits in ql, its top 2 in qh. For l < 32,
// ql byte 64h + l holds elements 128h + l (low nibble) and 128h + 64 + l (high), ql byte 64h + 32 + l elements
// 128h + 32 + l and 128h + 96 + l, qh byte 32h + l the top bits of all four (bits 0-1, 2-3, 4-5, 6-7).
inline int q6_k_code(const uint8_t* g, int e) {
  const int h = e / 128, k = (e % 128) / 32, l = e % 32;
  const int lq = g[64 * h + 32 * (k & 1) + l], hq = g[128 + 32 * h + l];
  return ((k < 2 ? lq : lq >> 4) & 0xF) | ((hq >> (2 * k)) & 3) << 4;
}
inline void q6_k_set_code(uint8_t* g, int e, int c) {  // (into a block whose ql and qh start cleared)
  const int h = e / 128, k = (e % 128) / 32, l = e % 32;
  g[64 * h + 32 * (k & 1) + l] |= (uint8_t)((c & 0xF) << (k < 2 ? 0 : 4));
  g[128 + 32 * h + l] |= (uint8_t)((c >> 4) << (2 * k));
}
// Row j's 16 scales and d between its GGUF block (g) and a Q6_K tile block (blk), either way.
template <bool ToTile, typename From, typename To>
inline void q6_k_scales_d(From* from, To* to, int j) {
  for (int s = 0; s < 16; ++s) to[ToTile ? kQ6KScales + 16 * s + j : 192 + s] = from[ToTile ? 192 + s : kQ6KScales + 16 * s + j];
  std::memcpy(to + (ToTile ? kQ6KD + 2 * j : 208), from + (ToTile ? 208 : kQ6KD + 2 * j), 2);
}
// Row j of a Q6_K tile block from its GGUF block, or back: in sub-block s, word a < 3 (elements 16s + 4a + i,
// i < 4) at byte 192s + 64a + 4j + i, bits 0-5, and bits 2a and 2a + 1 of word 3's codes in bits 6-7 there.
inline void q6_k_row_to_tile(const uint8_t* g, uint8_t* blk, int j) {
  for (int s = 0; s < 16; ++s)
    for (int i = 0; i < 4; ++i) {
      const int top = q6_k_code(g, 16 * s + 12 + i);
      for (int a = 0; a < 3; ++a)
        blk[192 * s + 64 * a + 4 * j + i] = (uint8_t)(q6_k_code(g, 16 * s + 4 * a + i) | ((top >> (2 * a)) & 3) << 6);
    }
  q6_k_scales_d<true>(g, blk, j);
}
inline void q6_k_row_from_tile(const uint8_t* blk, uint8_t* g, int j) {
  std::memset(g, 0, 192);
  for (int s = 0; s < 16; ++s)
    for (int i = 0; i < 4; ++i) {
      int top = 0;
      for (int a = 0; a < 3; ++a) {
        const int v = blk[192 * s + 64 * a + 4 * j + i];
        q6_k_set_code(g, 16 * s + 4 * a + i, v & 0x3F);
        top |= (v >> 6) << (2 * a);
      }
      q6_k_set_code(g, 16 * s + 12 + i, top);
    }
  q6_k_scales_d<false>(blk, g, j);
}

template <bool ToTile, typename From, typename To>
inline void k_fields(int base, From* from, To* to, int j) {
  if (base == Q6_K) {
    if constexpr (ToTile) q6_k_row_to_tile(from, to, j);
    else q6_k_row_from_tile(from, to, j);
    return;
  }
  for (const KField& f : k_fields_of(base)) k_field<ToTile>(f, from, to, j);
}

#if defined(TM_QUANT_AVX512) && !defined(TOKENMILL_SIMDE)
// 16 rows' `words` (<= 16) 4-byte words (row j's at in + j ld, `count` rows, the others zero) -> word t of
// row j at out[16 t + j], t < words: a 16 x 16 transpose of 32-bit words, in 128-bit lanes (words, then
// pairs of words), then across lanes.
TM_INLINE void transpose_words(const uint8_t* in, int64_t ld, int count, int words, uint32_t* out) {
  const __mmask16 mask = (__mmask16)((1u << words) - 1);
  __m512i r[16], t[16], u[16];
  for (int j = 0; j < 16; ++j) r[j] = j < count ? _mm512_maskz_loadu_epi32(mask, in + j * ld) : _mm512_setzero_si512();
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + e], lane l: word 4l + e of rows 4i .. 4i + 3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // word 4l + e of all rows: lane l of u[e], u[4 + e], u[8 + e], u[12 + e]
    const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44), w1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    const __m512i word[4] = {_mm512_shuffle_i32x4(v0, w0, 0x88), _mm512_shuffle_i32x4(v0, w0, 0xDD),
                             _mm512_shuffle_i32x4(v1, w1, 0x88), _mm512_shuffle_i32x4(v1, w1, 0xDD)};
    for (int l = 0; l < 4; ++l)
      if (4 * l + e < words) _mm512_storeu_si512((void*)(out + 16 * (4 * l + e)), word[l]);
  }
}

// Q6_K in a tile block: sub-block s's 4 code words (word a: elements 16s + 4a .. 16s + 4a + 3 of the 16 rows,
// a lane's 4 bytes) are 3 vectors, vector a < 3 holding word a's codes in bits 0-5 of its bytes and bits 2a
// and 2a + 1 of word 3's in bits 6-7. Three words are one mask each; the fourth, where the CPU has GFNI, is
// three byte-wise bit moves (gf2p8affine: bits 6-7 to 2a, 2a + 1, the rest cleared) and one OR of the three,
// else three shifts and three logic operations (shifts by 16-bit lanes: the bits they bring in from the next
// byte are cleared by the selects and the mask). Against GGUF's 4 + 2 bits, three loads a sub-block, not eight.
TM_INLINE void q6_k_group(const uint8_t* blk, int s, __m512i v[4]) {
  const __m512i m6 = _mm512_set1_epi8(0x3F);
  const uint8_t* p = blk + 192 * s;
  const __m512i s0 = _mm512_loadu_si512(p), s1 = _mm512_loadu_si512(p + 64), s2 = _mm512_loadu_si512(p + 128);
  v[0] = _mm512_and_si512(s0, m6), v[1] = _mm512_and_si512(s1, m6), v[2] = _mm512_and_si512(s2, m6);
#ifdef __GFNI__
  // Byte 7 - i of a matrix names the source bits of result bit i: bits 6, 7 -> 0, 1 (2, 3; 4, 5).
  auto moved = [](__m512i x, int a) {
    return _mm512_gf2p8affine_epi64_epi8(x, _mm512_set1_epi64((int64_t)0x4080ll << (48 - 16 * a)), 0);
  };
  v[3] = _mm512_ternarylogic_epi32(moved(s0, 0), moved(s1, 1), moved(s2, 2), 0xFE);  // a | b | c
#else
  // 0xE4: the third operand's set bits take the first operand's, its clear bits the second's
  const __m512i t = _mm512_ternarylogic_epi32(_mm512_srli_epi16(s0, 6), _mm512_srli_epi16(s1, 4), _mm512_set1_epi8(0x03), 0xE4);
  v[3] = _mm512_and_si512(_mm512_ternarylogic_epi32(t, _mm512_srli_epi16(s2, 2), _mm512_set1_epi8(0x0F), 0xE4), m6);
#endif
}

// Word t of 16 rows' codes from GGUF's fields as words (kQ6KWordFields' layout): element 4t + i is
// 128h + 32k + 4u + i (t = 32h + 8k + u), its low bits in ql word 16h + 8 (k % 2) + u (low nibbles for k < 2),
// its top bits at bits 2k of qh word 8h + u.
TM_INLINE __m512i q6_k_gguf_word(const uint8_t* words, int t) {
  const int h = t / 32, k = (t % 32) / 8, u = t % 8;
  const __m512i m4 = _mm512_set1_epi8(0xF), top = _mm512_set1_epi8(0x30);
  const __m512i a = _mm512_loadu_si512(words + 64 * (16 * h + (k & 1) * 8 + u));
  const __m512i hb = _mm512_loadu_si512(words + kQ6KWordsHigh + 64 * (8 * h + u));
  const __m512i lo4 = k < 2 ? _mm512_and_si512(a, m4) : _mm512_and_si512(_mm512_srli_epi16(a, 4), m4);
  const __m512i hi2 = k == 0 ? _mm512_slli_epi16(hb, 4) : k == 1 ? _mm512_slli_epi16(hb, 2) : k == 2 ? hb : _mm512_srli_epi16(hb, 2);
  return _mm512_ternarylogic_epi32(lo4, hi2, top, 0xF8);  // lo4 | (hi2 & top)
}

// A Q6_K tile block's code vectors (q6_k_group) from its rows' GGUF code words, and back.
TM_INLINE void q6_k_pack(const uint8_t* words, uint8_t* blk) {
  const __m512i m6 = _mm512_set1_epi8(0x3F);
  for (int s = 0; s < 16; ++s) {
    const __m512i w3 = q6_k_gguf_word(words, 4 * s + 3);
    for (int a = 0; a < 3; ++a)  // bits 2a, 2a + 1 of word 3 up to bits 6-7
      _mm512_storeu_si512(blk + 192 * s + 64 * a, _mm512_ternarylogic_epi32(q6_k_gguf_word(words, 4 * s + a),
                                                                            _mm512_slli_epi16(w3, 6 - 2 * a), m6, 0xE4));
  }
}
TM_INLINE void q6_k_unpack(const uint8_t* blk, uint8_t* words) {
  const __m512i m4 = _mm512_set1_epi8(0xF);
  __m512i codes[64];  // word t: the codes of elements 4t .. (6 bits: bits 6-7 clear)
  for (int s = 0; s < 16; ++s) q6_k_group(blk, s, codes + 4 * s);
  for (int h = 0; h < 2; ++h)
    for (int u = 0; u < 8; ++u) {
      const __m512i* v = codes + 32 * h + u;  // v[8k]: elements 128h + 32k + 4u ..
      const __m512i v0 = v[0], v1 = v[8], v2 = v[16], v3 = v[24];
      _mm512_storeu_si512(words + 64 * (16 * h + u), _mm512_ternarylogic_epi32(v0, _mm512_slli_epi16(v2, 4), m4, 0xE4));
      _mm512_storeu_si512(words + 64 * (16 * h + 8 + u), _mm512_ternarylogic_epi32(v1, _mm512_slli_epi16(v3, 4), m4, 0xE4));
      const __m512i hb = _mm512_or_si512(
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v0, 4), _mm512_set1_epi8(0x03)),
                          _mm512_and_si512(_mm512_srli_epi16(v1, 2), _mm512_set1_epi8(0x0C))),
          _mm512_or_si512(_mm512_and_si512(v2, _mm512_set1_epi8(0x30)),
                          _mm512_and_si512(_mm512_slli_epi16(v3, 2), _mm512_set1_epi8((char)0xC0))));
      _mm512_storeu_si512(words + kQ6KWordsHigh + 64 * (8 * h + u), hb);
    }
}
#endif

// 16 rows of GGUF blocks (row_bytes apart, K elements each) -> one tile.
inline void tile_from_gguf(int base, const uint8_t* rows, int64_t row_bytes, int64_t K, uint8_t* tile) {
  const int64_t nb = tile_blocks(base, K);
  if (k_format(base)) {
    const int64_t gb = tile_block_bytes(base) / kTileRows;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* blk = tile + b * tile_block_bytes(base);
#if defined(TM_QUANT_AVX512) && !defined(TOKENMILL_SIMDE)
      alignas(64) uint8_t words[kQ6KWordBytes];  // Q6_K: its code fields' words, then packed
      uint8_t* to = base == Q6_K ? words : blk;
      for (const KField& f : k_fields_of(base)) {  // the words of 16 rows at a time
        const uint8_t* from = rows + b * gb + f.gguf;
        if (f.bytes == 2) {
          for (int j = 0; j < kTileRows; ++j) std::memcpy(to + f.tile + 2 * j, from + j * row_bytes, 2);
          continue;
        }
        for (int w0 = 0; w0 < f.bytes / 4; w0 += 16)
          transpose_words(from + 4 * w0, row_bytes, kTileRows, std::min(16, f.bytes / 4 - w0), (uint32_t*)(to + f.tile) + 16 * w0);
      }
      if (base == Q6_K) {
        q6_k_pack(words, blk);
        for (int j = 0; j < kTileRows; ++j) q6_k_scales_d<true>(rows + j * row_bytes + b * gb, blk, j);
      }
#else
      for (int j = 0; j < kTileRows; ++j) k_fields<true>(base, rows + j * row_bytes + b * gb, blk, j);
#endif
    }
    return;
  }
  const TileFormat f = tile_format(base);
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* blk = tile + b * tile_block_bytes(base);
    for (int j = 0; j < kTileRows; ++j) {
      const uint8_t* g = rows + j * row_bytes + b * f.gguf_bytes;
      std::memcpy(blk + 2 * j, g, 2);
      if (f.m >= 0) std::memcpy(blk + f.m + 2 * j, g + f.gguf_m(), 2);
      if (f.h >= 0) std::memcpy(blk + f.h + 4 * j, g + f.gguf_h(), 4);
      for (int i = 0; i < f.code_bytes; ++i) {
        const uint8_t u = g[f.gguf_codes() + i];
        blk[f.codes + 64 * (i / 4) + 4 * j + i % 4] = base == Q8_0 ? (uint8_t)(u ^ 0x80) : u;
      }
    }
  }
}

// Row j of a tile (rows of K elements) back to GGUF blocks (the inverse of tile_from_gguf for that row).
inline void tile_row_to_gguf(int base, const uint8_t* tile, int64_t K, int j, uint8_t* row) {
  const int64_t nb = tile_blocks(base, K);
  if (k_format(base)) {
    const int64_t gb = tile_block_bytes(base) / kTileRows;
    for (int64_t b = 0; b < nb; ++b)
      k_fields<false>(base, tile + b * tile_block_bytes(base), row + b * gb, j);
    return;
  }
  const TileFormat f = tile_format(base);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + b * tile_block_bytes(base);
    uint8_t* g = row + b * f.gguf_bytes;
    std::memcpy(g, blk + 2 * j, 2);
    if (f.m >= 0) std::memcpy(g + f.gguf_m(), blk + f.m + 2 * j, 2);
    if (f.h >= 0) std::memcpy(g + f.gguf_h(), blk + f.h + 4 * j, 4);
    for (int i = 0; i < f.code_bytes; ++i) {
      const uint8_t u = blk[f.codes + 64 * (i / 4) + 4 * j + i % 4];
      g[f.gguf_codes() + i] = base == Q8_0 ? (uint8_t)(u ^ 0x80) : u;
    }
  }
}

// Row n of a matrix (N rows of row_bytes, type `type`) in quant.h's row layout of its format: a pointer into
// w where it is not tiled, else the row rebuilt into buf (2 row_bytes, kept by the caller). For the readers
// that take one row at a time: embedding lookups, the reference dequantization, builds without AVX-512.
inline const uint8_t* row_layout(int type, const uint8_t* w, int64_t row_bytes, int64_t n, int64_t K,
                                 std::vector<uint8_t>& buf) {
  if (!is_tiled(type)) return w + n * row_bytes;
  const int base = base_type(type);
  buf.resize(2 * row_bytes);
  tile_row_to_gguf(base, w + n / kTileRows * kTileRows * row_bytes, K, (int)(n % kTileRows), buf.data() + row_bytes);
  repack_row(base, buf.data() + row_bytes, buf.data(), K);
  return buf.data();
}

#if defined(TM_QUANT_AVX512) && !defined(TOKENMILL_SIMDE)
// Byte k (0-3) of each int32 lane, zero- or sign-extended.
TM_INLINE __m512i lane_byte(__m512i v, int k) { return _mm512_and_si512(_mm512_srli_epi32(v, 8 * k), _mm512_set1_epi32(0xFF)); }
TM_INLINE __m512i lane_sbyte(__m512i v, int k) { return _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * k), 24); }
// 16 float16 values (a tile block's d, m or dmin: one a row) as float32 lanes.
TM_INLINE __m512 half_lanes(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// A Q4_K tile block's 6-bit scales and mins, a lane per row: bytes 0-3 of sc[0] the scales of sub-blocks 0-3,
// of sc[1] those of 4-7; mn likewise (GGUF's packing, as scale_min_k4 reads it: scales and mins 0-3 in the low
// 6 bits of words 0 and 1, 4-7 in word 2's low and high nibbles with their top 2 bits in words 0 and 1).
TM_INLINE void q4_k_scales(const uint8_t* blk, __m512i sc[2], __m512i mn[2]) {
  const __m512i m4 = _mm512_set1_epi8(0xF), m6 = _mm512_set1_epi8(0x3F), m2 = _mm512_set1_epi8(0x3);
  const uint8_t* w = blk + kQ4KScales;
  const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64), w2 = _mm512_loadu_si512(w + 128);
  sc[0] = _mm512_and_si512(w0, m6), mn[0] = _mm512_and_si512(w1, m6);
  sc[1] = _mm512_or_si512(_mm512_and_si512(w2, m4), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w0, 6), m2), 4));
  mn[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), m4),
                          _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w1, 6), m2), 4));
}

// A K-format tile's 16 rows of nb super-blocks dequantized (dequantize_tile's, below): each super-block's 16
// GGUF blocks rebuilt (word fields transposed in registers), then dequantize_row(_bf16) on each, so the same
// bits as out of the row layout. (A bfloat16 prompt on a CPU with AVX-512 BF16 takes quant_pairs.h instead;
// this serves float32 prompts, CPUs without it, and the reference dequantization.)
template <typename T>
inline void dequantize_k_tile(int base, const uint8_t* tile, int64_t nb, T* y, int64_t ldy) {
  const int64_t block = tile_block_bytes(base);
  const int64_t gb = block / kTileRows;
  alignas(64) uint8_t rows[kTileRows * kMaxKBlockBytes];
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + b * block;
    // The next super-block asked for now: its bytes would otherwise arrive only when the rebuild reads
    // them, after this one's dequantization.
    if (b + 1 < nb)
      for (int64_t off = 0; off < block; off += 64) __builtin_prefetch(blk + block + off, 0, 3);
    alignas(64) uint8_t words[kQ6KWordBytes];  // Q6_K: its code fields' words, unpacked
    const uint8_t* from = blk;
    if (base == Q6_K) {
      q6_k_unpack(blk, words), from = words;
      for (int j = 0; j < kTileRows; ++j) q6_k_scales_d<false>(blk, rows + j * gb, j);
    }
    for (const KField& f : k_fields_of(base)) {
      if (f.bytes % 32 == 0) {  // 8 words of 16 rows at a time
        for (int g = 0; g < f.bytes / 32; ++g)
          group_blocks_each<8>(from + f.tile + 512 * g, [&](int j, __m256i v) {
            _mm256_storeu_si256((__m256i*)(rows + j * gb + f.gguf + 32 * g), v);
          });
      } else if (f.bytes % 16 == 0) {
        for (int g = 0; g < f.bytes / 16; ++g)
          group_blocks_each<4>(from + f.tile + 256 * g, [&](int j, __m128i v) {
            _mm_storeu_si128((__m128i*)(rows + j * gb + f.gguf + 16 * g), v);
          });
      } else {
        for (int j = 0; j < kTileRows; ++j) k_field<false>(f, from, rows + j * gb, j);
      }
    }
    for (int j = 0; j < kTileRows; ++j) {
      if constexpr (std::is_same_v<T, float>) dequantize_row(base, rows + j * gb, y + j * ldy + b * QKK, QKK);
      else dequantize_row_bf16(base, rows + j * gb, y + j * ldy + b * QKK, QKK);
    }
  }
}
#endif

// A tile's 16 rows dequantized one at a time, each rebuilt in the row layout (row_layout).
template <typename T>
inline void dequantize_tile_rows(int type, const uint8_t* tile, int64_t K, T* y, int64_t ldy) {
  const int base = base_type(type);
  const int64_t row_bytes = tile_blocks(base, K) * tile_block_bytes(base) / kTileRows;
  std::vector<uint8_t> buf;
  for (int j = 0; j < kTileRows; ++j) {
    const uint8_t* row = row_layout(type, tile, row_bytes, j, K, buf);
    if constexpr (std::is_same_v<T, float>) dequantize_row(base, row, y + j * ldy, K);
    else dequantize_row_bf16(base, row, y + j * ldy, K);
  }
}

// The values of a tile's 16 rows (K elements each) into y (row j at y + j ldy), float32 or bfloat16 (T =
// float or uint16_t): the prompt path's dequantized weight tiles. Each value as the row layout's
// dequantize_row(_bf16) gives it (the same per-block code; the K formats' through dequantize_k_tile).
template <typename T>
inline void dequantize_tile(int type, const uint8_t* tile, int64_t K, T* y, int64_t ldy) {
  const int base = base_type(type);
  const int64_t nb = tile_blocks(base, K);
#if defined(TM_QUANT_AVX512) && !defined(TOKENMILL_SIMDE)
  if (k_format(base)) {
    dequantize_k_tile(base, tile, nb, y, ldy);
    return;
  }
  if (base == IQ4_NL) return dequantize_tile_rows(type, tile, K, y, ldy);  // (a float32 prompt's path, or no BF16)
  const TileFormat f = tile_format(base);
  const int64_t block = tile_block_bytes(base);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + b * block;
    const uint16_t* d = (const uint16_t*)blk;
    const uint16_t* m = (const uint16_t*)(blk + f.m);
    const uint32_t* h = (const uint32_t*)(blk + f.h);
    auto out = [&](int j) { return y + j * ldy + b * QK; };
    auto nibbles = [&](auto has_min, auto five) {
      constexpr bool HAS_MIN = decltype(has_min)::value, FIVE = decltype(five)::value;
      group_blocks_each<4>(blk + f.codes, [&](int j, __m128i v) {
        const float mj = HAS_MIN ? fp16(m[j]) : 0.f;
        if constexpr (std::is_same_v<T, float>)
          dequantize_block_q4_01<HAS_MIN, FIVE>(v, fp16(d[j]), mj, FIVE ? h + j : nullptr, out(j));
        else
          dequantize_bf16_block_q4_01<HAS_MIN, FIVE>(v, fp16(d[j]), mj, FIVE ? h + j : nullptr, out(j));
      });
    };
    using yes = std::true_type;
    using no = std::false_type;
    switch (base) {
      case Q8_0:
        group_blocks_each<8>(blk + f.codes, [&](int j, __m256i v) {
          if constexpr (std::is_same_v<T, float>) dequantize_block_q8_0(v, fp16(d[j]), out(j));
          else dequantize_bf16_block_q8_0(v, fp16(d[j]), out(j));
        });
        break;
      case Q4_0: nibbles(no(), no()); break;
      case Q4_1: nibbles(yes(), no()); break;
      case Q5_0: nibbles(no(), yes()); break;
      default: nibbles(yes(), yes()); break;
    }
  }
#else
  (void)nb;
  dequantize_tile_rows(type, tile, K, y, ldy);
#endif
}

// The products of one tile (16 weight rows) with g input rows (1 <= g <= kRowGroup): out[16 r + j] for
// input row r and weight row j of the tile.
// ahead(bytes) is called before each block's bytes are read, a K format's super-block a part at a time (a
// caller's prefetch walk keeps pace so).
#ifdef TM_QUANT_VNNI
// Entry v: bit 4 of byte e set where bit e of v is (e < 4).
alignas(64) inline constexpr int32_t kFifthBitBytes[16] = {
    0x00000000, 0x00000010, 0x00001000, 0x00001010, 0x00100000, 0x00100010, 0x00101000, 0x00101010,
    0x10000000, 0x10000010, 0x10001000, 0x10001010, 0x10100000, 0x10100010, 0x10101000, 0x10101010};

template <int R, int BASE, typename Ahead>
TM_INLINE void tile_product(const uint8_t* tile, int64_t nb, const QRow* x, float* out, const Ahead& ahead) {
  constexpr TileFormat f = tile_format(BASE);
  constexpr int64_t block = kTileRows * f.gguf_bytes;
  constexpr bool has_min = f.m >= 0, five = f.h >= 0;
  // A 5-bit code's fifth bit: for 4 elements of one row (a lane's 4 bytes), the 4 bits of its qh that
  // belong to them, bits 4t..4t + 3 (low nibbles) or 16 + 4t.. (high ones), spread to bit 4 of each byte.
  // vpermd picks lane i of `spread` by the low 4 bits of the index: qh shifted right by 4t (or 16 + 4t).
  const __m512i spread = _mm512_load_si512(kFifthBitBytes);
  const __m512i m4 = _mm512_set1_epi8(0xF);
  // The codes' bias, through the inputs' block sums s = dx sum(x): Q8_0's codes are q + 128, Q4_0's q + 8 and
  // Q5_0's q + 16 (w = d (c - bias)); Q4_1's and Q5_1's w = d c + m. IQ4_NL's name v + 128 by a byte shuffle.
  constexpr bool nl = BASE == IQ4_NL;
  constexpr float bias = BASE == Q8_0 || nl ? -128.f : five ? -16.f : -8.f;
  const __m512i table = nl ? iq4_bytes(true) : _mm512_setzero_si512();
  // Q4_0's and Q4_1's high nibbles are multiplied where they lie (byte & 0xF0: 16 times the code, no shift a
  // code word); their sums, 16 times over, are shifted back exactly before they join the low nibbles'.
  constexpr bool in_place = BASE == Q4_0 || BASE == Q4_1;
  const __m512i high = _mm512_set1_epi8((char)0xF0);
  __m512 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    ahead(block);
    const uint8_t* blk = tile + b * block;
    const __m512 dw = half_lanes(blk);
    const uint8_t* w = blk + f.codes;
    __m512i qh;
    if constexpr (five) qh = _mm512_loadu_si512(blk + f.h);
    __m512i s0[R], s1[R];
    for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) {
      // Two code vectors and the input words they multiply: Q8_0 words 2t and 2t + 1 (elements 8t..8t + 7);
      // the 4- and 5-bit formats one vector's low nibbles (word t, elements 4t..) and high ones (16 + 4t..).
      __m512i c0, c1;
      int i0, i1;
      if constexpr (BASE == Q8_0) {
        c0 = _mm512_loadu_si512(w + 128 * t), c1 = _mm512_loadu_si512(w + 128 * t + 64), i0 = 2 * t, i1 = 2 * t + 1;
      } else {
        const __m512i v = _mm512_loadu_si512(w + 64 * t);
        c0 = _mm512_and_si512(v, m4), i0 = t, i1 = 4 + t;
        c1 = in_place ? _mm512_and_si512(v, high) : _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        if constexpr (nl) c0 = _mm512_shuffle_epi8(table, c0), c1 = _mm512_shuffle_epi8(table, c1);
        if constexpr (five) {
          c0 = _mm512_or_si512(c0, _mm512_permutexvar_epi32(_mm512_srli_epi32(qh, 4 * t), spread));
          c1 = _mm512_or_si512(c1, _mm512_permutexvar_epi32(_mm512_srli_epi32(qh, 16 + 4 * t), spread));
        }
      }
      for (int r = 0; r < R; ++r) {
        const int32_t* xw = (const int32_t*)(x[r].q + b * QK);
        s0[r] = _mm512_dpbusd_epi32(s0[r], c0, _mm512_set1_epi32(xw[i0]));
        s1[r] = _mm512_dpbusd_epi32(s1[r], c1, _mm512_set1_epi32(xw[i1]));
      }
    }
    __m512 m;
    if constexpr (has_min) m = half_lanes(blk + f.m);
    for (int r = 0; r < R; ++r) {  // d dx sum(c x), and the bias or offset times s
      const __m512i s1r = in_place ? _mm512_srai_epi32(s1[r], 4) : s1[r];
      const __m512 p = _mm512_cvtepi32_ps(_mm512_add_epi32(s0[r], s1r));
      acc[r] = _mm512_fmadd_ps(p, _mm512_mul_ps(dw, _mm512_set1_ps(x[r].d[b])), acc[r]);
      if constexpr (has_min)
        off[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x[r].s[b]), off[r]);
      else
        off[r] = _mm512_fmadd_ps(dw, _mm512_set1_ps(bias * x[r].s[b]), off[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, _mm512_add_ps(acc[r], off[r]));
}

// Bit `bit` (0-7) of each byte of v moved to bit 4 of that byte, the other bits cleared: a Q5_K code's fifth
// bit out of its qh byte.
TM_INLINE __m512i fifth_bit(__m512i v, int bit) {
  const __m512i b4 = _mm512_set1_epi8(0x10);
  return _mm512_and_si512(bit <= 4 ? _mm512_slli_epi16(v, 4 - bit) : _mm512_srli_epi16(v, bit - 4), b4);
}

// Super-block b of R input rows rounded with one scale per 256 (QRow::per256): their 4-byte words of q
// (xw[r][e / 4] holds element e) and their sums of 16.
template <int R>
struct SuperBlockInputs {
  const int32_t* xw[R];
  const int16_t* s16[R];
  TM_INLINE SuperBlockInputs(const QRow* x, int64_t b) {
    for (int r = 0; r < R; ++r) xw[r] = (const int32_t*)(x[r].per256->q + b * QKK), s16[r] = x[r].per256->sums16 + b * 16;
  }
};

// Q4_K (Q5_K with FIVE), 16 rows a lane each: w = d sc_j c - dmin m_j in sub-block j (32 elements) of a
// super-block, against inputs with one scale per 256 (QRow::per256: q, d, sums16). A lane's sub-block sum of
// c x (at most 32 * 31 * 127) times its 6-bit scale sums in int32 over the super-block, as the mins times
// the inputs' sub-block sums do; then one float multiply each. Q5_K's fifth bits: bit j of qh byte l is
// element l's of sub-block j.
// Q4_K's high nibbles are multiplied where they lie (byte & 0xF0: 16 times the code; no shift a code word),
// so its integer sums come 16 times over and are shifted back once a super-block (exactly: every term is a
// multiple of 16, and 16 times the largest sum, 8 * 32 * 15 * 127 * 63, still fits in int32); the mins'
// products with the inputs' sub-block sums are taken two at a time as 16-bit pairs (vpdpwssd). Both give the
// same integers as multiplying them out one by one.
template <int R, bool FIVE, typename Ahead>
TM_INLINE void tile_product_q45_k(const uint8_t* tile, int64_t nb, const QRow* x, float* out, const Ahead& ahead) {
  constexpr int64_t block = kTileRows * (FIVE ? 176 : 144);
  const __m512i m4 = _mm512_set1_epi8(0xF), high = _mm512_set1_epi8((char)0xF0), words = _mm512_set1_epi32(0x00FF00FF);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + b * block;
    __m512i sc[2], mn[2];
    q4_k_scales(blk, sc, mn);
    const uint8_t* codes = blk + (FIVE ? kQ5KCodes : kQ4KCodes);
    const SuperBlockInputs<R> in(x, b);
    const auto& xw = in.xw;
    // The mins as 16-bit words of each lane: sub-blocks (4q, 4q + 2) in even[q], (4q + 1, 4q + 3) in odd[q].
    const __m512i even[2] = {_mm512_and_si512(mn[0], words), _mm512_and_si512(mn[1], words)};
    const __m512i odd[2] = {_mm512_and_si512(_mm512_srli_epi32(mn[0], 8), words),
                            _mm512_and_si512(_mm512_srli_epi32(mn[1], 8), words)};
    __m512i isum[R], imin[R];
    for (int r = 0; r < R; ++r) {
      const int16_t* s16 = in.s16[r];
      auto xs = [&](int j) { return (uint32_t)(uint16_t)(s16[2 * j] + s16[2 * j + 1]); };  // |sum| < 2^12
      auto pair = [&](int j, int k) { return _mm512_set1_epi32((int)(xs(j) | xs(k) << 16)); };
      imin[r] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), even[0], pair(0, 2));
      imin[r] = _mm512_dpwssd_epi32(imin[r], odd[0], pair(1, 3));
      imin[r] = _mm512_dpwssd_epi32(imin[r], even[1], pair(4, 6));
      imin[r] = _mm512_dpwssd_epi32(imin[r], odd[1], pair(5, 7));
      isum[r] = _mm512_setzero_si512();
    }
    // Chunk c (64 elements): code word u's low nibbles are elements 4u.. of sub-block 2c, its high ones of 2c + 1.
    // sa, sb: their scales (Q4_K: sa 16 times its scale, to match the high nibbles' factor).
    auto chunk = [&](int c, __m512i sa, __m512i sb) {
      __m512i s0[R], s1[R];
      for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_si512();
      for (int u = 0; u < 8; ++u) {
        const __m512i v = _mm512_loadu_si512(codes + 64 * (8 * c + u));
        __m512i lo = _mm512_and_si512(v, m4), hi;
        if constexpr (FIVE) {  // qh word u: elements 4u.. of every chunk
          hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
          const __m512i qh = _mm512_loadu_si512(blk + kQ5KHigh + 64 * u);
          lo = _mm512_or_si512(lo, fifth_bit(qh, 2 * c)), hi = _mm512_or_si512(hi, fifth_bit(qh, 2 * c + 1));
        } else {
          hi = _mm512_and_si512(v, high);
        }
        for (int r = 0; r < R; ++r) {
          s0[r] = _mm512_dpbusd_epi32(s0[r], lo, _mm512_set1_epi32(xw[r][16 * c + u]));
          s1[r] = _mm512_dpbusd_epi32(s1[r], hi, _mm512_set1_epi32(xw[r][16 * c + 8 + u]));
        }
      }
      for (int r = 0; r < R; ++r)
        isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(s0[r], sa), _mm512_mullo_epi32(s1[r], sb)));
    };
    // (Written out, not looped: the shifts inside take their counts as constants.) The caller's walk ahead
    // moves by a chunk's bytes before each chunk, not by the super-block's 36 lines at once: a profile of the
    // fused decode step found most of its time at those prefetches when they came in one burst, and spread
    // out the step took 0.87x the time (a Q4_K_M file, one input row, a Xeon with AMX).
    auto low_scale = [&](__m512i v, int k) { return FIVE ? lane_byte(v, k) : _mm512_slli_epi32(lane_byte(v, k), 4); };
    ahead(block / 4), chunk(0, low_scale(sc[0], 0), lane_byte(sc[0], 1));
    ahead(block / 4), chunk(1, low_scale(sc[0], 2), lane_byte(sc[0], 3));
    ahead(block / 4), chunk(2, low_scale(sc[1], 0), lane_byte(sc[1], 1));
    ahead(block / 4), chunk(3, low_scale(sc[1], 2), lane_byte(sc[1], 3));
    if constexpr (!FIVE)
      for (int r = 0; r < R; ++r) isum[r] = _mm512_srai_epi32(isum[r], 4);
    const __m512 d = half_lanes(blk), dmin = half_lanes(blk + 32);
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x[r].per256->d[b * (QKK / QK)]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, dx), acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imin[r]), _mm512_mul_ps(dmin, dx), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

// Calls f(std::integral_constant<int, I>()) for I = 0 .. N - 1, written out, so that the shifts inside f
// take their counts as constants.
template <typename F, int... I>
TM_INLINE void each_constant(const F& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>()), ...);
}
template <int N, typename F>
TM_INLINE void each_constant(const F& f) {
  each_constant(f, std::make_integer_sequence<int, N>());
}

// Q6_K, 16 rows a lane each: w = d sc_i (c - 32) in sub-block i (16 elements), its 4 code words out of 3
// vectors (q6_k_group); against inputs with one scale per 256 (QRow::per256: q, d, sums16). A lane's
// sub-block sum of c x less 32 times the inputs' sum there (at most 2^16 in size) times its signed 8-bit scale
// (a byte of 16, sign-extended from one load) sums in int32 over the super-block, then takes one float multiply.
template <int R, typename Ahead>
TM_INLINE void tile_product_q6_k(const uint8_t* tile, int64_t nb, const QRow* x, float* out, const Ahead& ahead) {
  constexpr int64_t block = kTileRows * 210;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + b * block;
    const SuperBlockInputs<R> in(x, b);
    const auto &xw = in.xw, &s16 = in.s16;
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int s = 0; s < 16; ++s) {  // (a loop: nothing in it needs s as a constant)
      if (s % 4 == 0) ahead(block / 4);  // a quarter of the super-block's bytes at a time (as Q4_K's chunks)
      __m512i v[4];
      q6_k_group(blk, s, v);
      const __m512i scale = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + kQ6KScales + 16 * s)));
      for (int r = 0; r < R; ++r) {
        __m512i p = _mm512_set1_epi32(-32 * (int)s16[r][s]);
        for (int a = 0; a < 4; ++a) p = _mm512_dpbusd_epi32(p, v[a], _mm512_set1_epi32(xw[r][4 * s + a]));
        isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(p, scale));
      }
    }
    const __m512 d = half_lanes(blk + kQ6KD);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, _mm512_set1_ps(x[r].per256->d[b * (QKK / QK)])), acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

// Q2_K (Q3_K with THREE), 16 rows a lane each: w = d sc_s q - dmin m_s (Q3_K: d sc_s q) in sub-block s (16
// elements) of a super-block. Element 128h + 32j + 4u + i (u < 8, i < 4) has its 2 low bits at bits 2j of
// byte i of qs word 8h + u, Q3_K's third bit at bit 4h + j of byte i of hmask word u (set: q = the low bits,
// clear: the low bits less 4). The codes go in as u = low bits (Q3_K: | third bit << 2, so q + 4); a lane's
// sub-block sum of u x (Q3_K less 4 times the inputs' sum there) times its scale sums in int32 over the
// super-block, Q2_K's mins times the inputs' sums of 16 in 16-bit pairs alike; then one float multiply each.
template <int R, bool THREE, typename Ahead>
TM_INLINE void tile_product_q23_k(const uint8_t* tile, int64_t nb, const QRow* x, float* out, const Ahead& ahead) {
  constexpr int64_t block = kTileRows * (THREE ? 110 : 84);
  constexpr int codes_at = THREE ? kQ3KCodes : kQ2KCodes;
  const __m512i m2 = _mm512_set1_epi8(3), b2 = _mm512_set1_epi8(4), m4 = _mm512_set1_epi32(0xF);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + b * block;
    const SuperBlockInputs<R> in(x, b);
    const auto &xw = in.xw, &s16 = in.s16;
    __m512i isum[R], imin[R];
    for (int r = 0; r < R; ++r) isum[r] = imin[r] = _mm512_setzero_si512();
    __m512i sw[4];  // the scale words: Q2_K's 4 (byte s: sub-block s's scale, low nibble, and min), Q3_K's 3
    for (int w = 0; w < (THREE ? 3 : 4); ++w) sw[w] = _mm512_loadu_si512(blk + (THREE ? kQ3KScales : kQ2KScales) + 64 * w);
    if constexpr (!THREE) {
      // Mins in 16-bit pairs (m_2p, m_2p+1): half p % 2 of word p / 2, its bytes' high nibbles; each pair times
      // the inputs' sums of 16 over sub-blocks 2p, 2p + 1 (an int32 word of sums16) in one multiply-add.
      each_constant<8>([&](auto pc) {
        constexpr int p = decltype(pc)::value, at = 16 * (p % 2);
        const __m512i v = sw[p / 2];
        const __m512i pair = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(v, at + 4), m4),
                                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(v, at + 12), m4), 16));
        for (int r = 0; r < R; ++r) {
          int32_t sp;
          std::memcpy(&sp, s16[r] + 2 * p, 4);
          imin[r] = _mm512_dpwssd_epi32(imin[r], pair, _mm512_set1_epi32(sp));
        }
      });
    }
    // Sub-blocks 8h + 2j and 8h + 2j + 1: qs words 8h + u (u < 4, then 4 .. 7).
    each_constant<8>([&](auto hj) {
      constexpr int h = decltype(hj)::value / 4, j = decltype(hj)::value % 4;
      if constexpr (j % 2 == 0) ahead(block / 4);  // a quarter super-block at a time (see tile_product_q45_k)
      for (int half = 0; half < 2; ++half) {
        const int sb = 8 * h + 2 * j + half;
        __m512i sc;  // sub-block sb's scale, a lane per row
        if constexpr (THREE) {
          // low 4 bits: nibble sb / 8 of byte sb % 8; top 2: bits 2 (sb / 4) of byte 8 + sb % 4; less 32
          const int lw = (sb % 8) / 4, ls = 8 * (sb % 4) + 4 * (sb / 8), hs = 8 * (sb % 4) + 2 * (sb / 4);
          const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(sw[lw], ls), m4);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(sw[2], hs), _mm512_set1_epi32(3));
          sc = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), _mm512_set1_epi32(32));
        } else {
          sc = _mm512_and_si512(_mm512_srli_epi32(sw[sb / 4], 8 * (sb % 4)), m4);
        }
        __m512i s[R];
        for (int r = 0; r < R; ++r) s[r] = THREE ? _mm512_set1_epi32(-4 * (int)s16[r][sb]) : _mm512_setzero_si512();
        for (int u = 4 * half; u < 4 * half + 4; ++u) {
          __m512i c = _mm512_and_si512(_mm512_srli_epi32(_mm512_loadu_si512(blk + codes_at + 64 * (8 * h + u)), 2 * j), m2);
          if constexpr (THREE) {
            const __m512i hm = _mm512_loadu_si512(blk + kQ3KHigh + 64 * u);
            constexpr int bit = 4 * h + j;  // -> bit 2 of each byte
            const __m512i hb = bit >= 2 ? _mm512_srli_epi32(hm, bit - 2) : _mm512_slli_epi32(hm, 2 - bit);
            c = _mm512_ternarylogic_epi32(c, hb, b2, 0xF8);  // c | (hb & 4)
          }
          for (int r = 0; r < R; ++r) s[r] = _mm512_dpbusd_epi32(s[r], c, _mm512_set1_epi32(xw[r][32 * h + 8 * j + u]));
        }
        for (int r = 0; r < R; ++r) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(s[r], sc));
      }
    });
    const __m512 d = half_lanes(blk);
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x[r].per256->d[b * (QKK / QK)]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, dx), acc[r]);
      if constexpr (!THREE) acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imin[r]), _mm512_mul_ps(half_lanes(blk + 32), dx), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

// IQ4_XS, 16 rows a lane each: w = d sc_j v in sub-block j (32 elements), v = kIq4Values[code], sc_j the 6-bit
// scale less 32 (its low 4 bits nibble j of the scales_l word, its top 2 at bits 2j of scales_h). qs word 4j + u
// holds elements 32j + 4u + i in its bytes' low nibbles and 32j + 16 + 4u + i in their high ones. A byte shuffle
// names u = v + 128 (1 .. 241, unsigned); a lane's sub-block sum of u x less 128 times the inputs' sum there
// (below 2^21 in size) times sc_j sums in int32 over the super-block, then takes one float multiply.
template <int R, typename Ahead>
TM_INLINE void tile_product_iq4_xs(const uint8_t* tile, int64_t nb, const QRow* x, float* out, const Ahead& ahead) {
  constexpr int64_t block = kTileRows * 136;
  const __m512i m4 = _mm512_set1_epi8(0xF), m4w = _mm512_set1_epi32(0xF);
  const __m512i table = iq4_bytes(true);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + b * block;
    const __m512i sl = _mm512_loadu_si512(blk + kIQ4XSLow);
    const __m512i sh = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(blk + kIQ4XSHigh)));
    const SuperBlockInputs<R> in(x, b);
    const auto &xw = in.xw, &s16 = in.s16;
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    each_constant<8>([&](auto jc) {
      constexpr int j = decltype(jc)::value;
      if constexpr (j % 2 == 0) ahead(block / 4);  // a quarter super-block at a time (see tile_product_q45_k)
      const __m512i sc = _mm512_sub_epi32(
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(sl, 4 * j), m4w),
                          _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(sh, 2 * j), _mm512_set1_epi32(3)), 4)),
          _mm512_set1_epi32(32));
      __m512i s[R];
      for (int r = 0; r < R; ++r) s[r] = _mm512_set1_epi32(-128 * ((int)s16[r][2 * j] + (int)s16[r][2 * j + 1]));
      for (int u = 0; u < 4; ++u) {
        const __m512i v = _mm512_loadu_si512(blk + kIQ4XSCodes + 64 * (4 * j + u));
        const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, m4));
        const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
        for (int r = 0; r < R; ++r) {
          s[r] = _mm512_dpbusd_epi32(s[r], lo, _mm512_set1_epi32(xw[r][8 * j + u]));
          s[r] = _mm512_dpbusd_epi32(s[r], hi, _mm512_set1_epi32(xw[r][8 * j + 4 + u]));
        }
      }
      for (int r = 0; r < R; ++r) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(s[r], sc));
    });
    const __m512 d = half_lanes(blk);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, _mm512_set1_ps(x[r].per256->d[b * (QKK / QK)])), acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}
#endif

// The portable reference of tile_product: the same sums, lane by lane (not used where VNNI is: quant.py tiles
// only there; kept so any build multiplies a tiled matrix correctly).
inline void tile_product_portable(int base, const uint8_t* tile, int64_t nb, const QRow* x, int g, float* out) {
  const TileFormat f = tile_format(base);
  const int64_t block = tile_block_bytes(base);
  const float bias = base == Q8_0 || base == IQ4_NL ? -128.f : f.h >= 0 ? -16.f : -8.f;
  for (int r = 0; r < g; ++r)
    for (int j = 0; j < kTileRows; ++j) {
      float acc = 0.f, off = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = tile + b * block;
        const uint8_t* w = blk + f.codes;
        const int8_t* xq = x[r].q + b * QK;
        uint32_t qh = 0;
        if (f.h >= 0) std::memcpy(&qh, blk + f.h + 4 * j, 4);
        int32_t sum = 0;
        for (int i = 0; i < QK; ++i) {
          int c;
          if (base == Q8_0) c = w[64 * (i / 4) + 4 * j + i % 4];
          else c = ((w[64 * ((i % 16) / 4) + 4 * j + i % 4] >> (i < 16 ? 0 : 4)) & 0xF) | (((qh >> i) & 1) << 4);
          if (base == IQ4_NL) c = kIq4Values[c] + 128;
          sum += c * xq[i];
        }
        uint16_t dh, mh;
        std::memcpy(&dh, blk + 2 * j, 2);
        const float d = fp16(dh);
        acc += (float)sum * (d * x[r].d[b]);
        if (f.m >= 0) std::memcpy(&mh, blk + f.m + 2 * j, 2), off += fp16(mh) * x[r].s[b];
        else off += d * (bias * x[r].s[b]);
      }
      out[16 * r + j] = acc + off;
    }
}

// The portable reference of the K formats' tile products: each row's GGUF block rebuilt, then the same
// integer sums and float steps as tile_product_q45_k / _q6_k (so the same bits).
inline void tile_product_k_portable(int base, const uint8_t* tile, int64_t nb, const QRow* x, int g, float* out) {
  const int64_t block = tile_block_bytes(base);
  uint8_t row[kMaxKBlockBytes];
  for (int r = 0; r < g; ++r)
    for (int j = 0; j < kTileRows; ++j) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        k_fields<false>(base, tile + b * block, row, j);
        const int8_t* xq = x[r].per256->q + b * QKK;
        const int16_t* s16 = x[r].per256->sums16 + b * 16;
        const float dx = x[r].per256->d[b * (QKK / QK)];
        int32_t isum = 0, imin = 0;
        uint16_t h;
        if (base == Q2_K || base == Q3_K) {
          const bool three = base == Q3_K;
          int8_t sc3[16];
          if (three) q3_k_scales(row + 96, sc3);
          for (int sb = 0; sb < 16; ++sb) {  // element e = 16 sb + l = 128 h + 32 j + (l' < 32)
            int dot = three ? -4 * s16[sb] : 0;
            for (int l = 0; l < 16; ++l) {
              const int e = 16 * sb + l, hh = e / 128, j = (e % 128) / 32, ll = e % 32;
              int c = (row[(three ? 32 : 16) + 32 * hh + ll] >> (2 * j)) & 3;
              if (three) c |= ((row[ll] >> (4 * hh + j)) & 1) << 2;
              dot += c * xq[e];
            }
            isum += (three ? (int)sc3[sb] : (row[sb] & 0xF)) * dot;
            if (!three) imin += (row[sb] >> 4) * s16[sb];
          }
          std::memcpy(&h, row + (three ? 108 : 80), 2);
          acc = std::fma((float)isum, fp16(h) * dx, acc);
          if (!three) {
            std::memcpy(&h, row + 82, 2);
            acc = std::fma(-(float)imin, fp16(h) * dx, acc);
          }
        } else if (base == IQ4_XS) {
          BlockIQ4_XS blk;
          std::memcpy(&blk, row, sizeof blk);
          int8_t sc[8];
          iq4_xs_scales(blk, sc);
          for (int sb = 0; sb < 8; ++sb) {
            int dot = 0;
            for (int l = 0; l < 16; ++l)
              dot += kIq4Values[blk.qs[16 * sb + l] & 0xF] * xq[32 * sb + l] + kIq4Values[blk.qs[16 * sb + l] >> 4] * xq[32 * sb + 16 + l];
            isum += sc[sb] * dot;
          }
          acc = std::fma((float)isum, fp16(blk.d) * dx, acc);
        } else if (base != Q6_K) {
          const bool five = base == Q5_K;
          const uint8_t* qs = row + (five ? 48 : 16);
          for (int sb = 0; sb < 8; ++sb) {  // sub-block sb: chunk sb / 2's low (even) or high (odd) nibbles
            int sc, m, dot = 0;
            scale_min_k4(sb, row + 4, sc, m);
            for (int l = 0; l < 32; ++l) {
              const int c = ((qs[32 * (sb / 2) + l] >> (4 * (sb % 2))) & 0xF) | (five ? ((row[16 + l] >> sb) & 1) << 4 : 0);
              dot += c * xq[32 * sb + l];
            }
            isum += sc * dot;
            imin += m * (s16[2 * sb] + s16[2 * sb + 1]);
          }
          std::memcpy(&h, row, 2);
          acc = std::fma((float)isum, fp16(h) * dx, acc);
          std::memcpy(&h, row + 2, 2);
          acc = std::fma(-(float)imin, fp16(h) * dx, acc);
        } else {
          for (int i = 0; i < 16; ++i) {  // sub-block i: elements 16i..
            int dot = -32 * s16[i];
            for (int e = 0; e < 16; ++e) dot += q6_k_code(row, 16 * i + e) * xq[16 * i + e];
            isum += (int8_t)row[192 + i] * dot;
          }
          std::memcpy(&h, row + 208, 2);
          acc = std::fma((float)isum, fp16(h) * dx, acc);
        }
      }
      out[16 * r + j] = acc;
    }
}

template <typename Ahead>
inline void tile_rows(int type, const uint8_t* tile, int64_t nb, const QRow* x, int g, float* out, const Ahead& ahead) {
  const int base = base_type(type);
#ifdef TM_QUANT_VNNI
  auto run = [&](auto r) {
    constexpr int R = decltype(r)::value;
    switch (base) {
      case Q4_K: return tile_product_q45_k<R, false>(tile, nb, x, out, ahead);
      case Q5_K: return tile_product_q45_k<R, true>(tile, nb, x, out, ahead);
      case Q6_K: return tile_product_q6_k<R>(tile, nb, x, out, ahead);
      case Q2_K: return tile_product_q23_k<R, false>(tile, nb, x, out, ahead);
      case Q3_K: return tile_product_q23_k<R, true>(tile, nb, x, out, ahead);
      case IQ4_XS: return tile_product_iq4_xs<R>(tile, nb, x, out, ahead);
      case Q8_0: return tile_product<R, Q8_0>(tile, nb, x, out, ahead);
      case Q4_0: return tile_product<R, Q4_0>(tile, nb, x, out, ahead);
      case Q4_1: return tile_product<R, Q4_1>(tile, nb, x, out, ahead);
      case Q5_0: return tile_product<R, Q5_0>(tile, nb, x, out, ahead);
      case IQ4_NL: return tile_product<R, IQ4_NL>(tile, nb, x, out, ahead);
      default: return tile_product<R, Q5_1>(tile, nb, x, out, ahead);
    }
  };
  switch (g) {
    case 1: return run(std::integral_constant<int, 1>());
    case 2: return run(std::integral_constant<int, 2>());
    case 3: return run(std::integral_constant<int, 3>());
    default: return run(std::integral_constant<int, 4>());
  }
#else
  ahead(nb * tile_block_bytes(base));
  if (k_format(base)) tile_product_k_portable(base, tile, nb, x, g, out);
  else tile_product_portable(base, tile, nb, x, g, out);
#endif
}

// Rows [n0, n1) of y = x W^T for a tiled W (row_bytes a row), M input rows: each tile once, every group of
// up to kRowGroup input rows over it while it is in cache; a tile cut by n0 or n1 is computed whole and
// only its rows in range kept. store(m, n, value) receives each product; ahead(bytes) as tile_product's, on
// the first pass over each tile.
template <typename Store, typename Ahead>
inline void tiled_rows(int type, const uint8_t* w, int64_t row_bytes, const QRow* x, int64_t M, int64_t K, int64_t n0,
                       int64_t n1, const Store& store, const Ahead& ahead) {
  const int64_t nb = tile_blocks(base_type(type), K), tile_bytes = kTileRows * row_bytes;
  float out[kTileRows * kRowGroup];
  for (int64_t t = n0 / kTileRows; t * kTileRows < n1; ++t) {
    const int64_t a = std::max(n0, t * kTileRows), b = std::min(n1, (t + 1) * kTileRows);
    for (int64_t m0 = 0; m0 < M; m0 += kRowGroup) {
      const int g = (int)std::min<int64_t>(kRowGroup, M - m0);
      if (m0 == 0)
        tile_rows(type, w + t * tile_bytes, nb, x + m0, g, out, ahead);
      else
        tile_rows(type, w + t * tile_bytes, nb, x + m0, g, out, [](int64_t) {});
      for (int r = 0; r < g; ++r)
        for (int64_t n = a; n < b; ++n) store(m0 + r, n, out[16 * r + n - t * kTileRows]);
    }
  }
}

}  // namespace tmq
