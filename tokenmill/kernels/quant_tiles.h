// Weight rows interleaved by 16: a second layout of the Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 blocks, for the byte
// products of a few input rows (decode, speculative verify steps, small batches).
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
// (a 4-bit code byte i holds element i in its low nibble and i + 16 in its high one, as GGUF has it). The
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

#include "quant.h"

namespace tmq {

constexpr int kTiled = 256;   // set in a type id: rows interleaved by 16
constexpr int kTileRows = 16;

inline bool is_tiled(int type) { return (type & kTiled) != 0; }
inline int base_type(int type) { return type & ~kTiled; }
inline bool can_tile(int type) { return type == Q8_0 || type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1; }

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
         : base == Q4_0 ? TileFormat{18, -1, -1, 32, 16}
         : base == Q4_1 ? TileFormat{20, 32, -1, 64, 16}
         : base == Q5_0 ? TileFormat{22, -1, 32, 96, 16}
                        : TileFormat{24, 32, 64, 128, 16};  // Q5_1
}
inline int64_t tile_block_bytes(int base) { return kTileRows * tile_format(base).gguf_bytes; }

// 16 rows of GGUF blocks (row_bytes apart) -> one tile of nb blocks.
inline void tile_from_gguf(int base, const uint8_t* rows, int64_t row_bytes, int64_t nb, uint8_t* tile) {
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

// Row j of a tile of nb blocks back to GGUF blocks (the inverse of tile_from_gguf for that row).
inline void tile_row_to_gguf(int base, const uint8_t* tile, int64_t nb, int j, uint8_t* row) {
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
  tile_row_to_gguf(base, w + n / kTileRows * kTileRows * row_bytes, K / QK, (int)(n % kTileRows), buf.data() + row_bytes);
  repack_row(base, buf.data() + row_bytes, buf.data(), K);
  return buf.data();
}

// The values of a tile's 16 rows (nb blocks each) into y (row j at y + j ldy), float32 or bfloat16 (T =
// float or uint16_t): the prompt path's dequantized weight tiles. Each value as the row layout's
// dequantize_row(_bf16) gives it (the same per-block code).
template <typename T>
inline void dequantize_tile(int type, const uint8_t* tile, int64_t nb, T* y, int64_t ldy) {
  const int base = base_type(type);
#if defined(TM_QUANT_AVX512) && !defined(TOKENMILL_SIMDE)
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
  const int64_t K = nb * QK, row_bytes = nb * tile_block_bytes(base) / kTileRows;
  std::vector<uint8_t> buf;
  for (int j = 0; j < kTileRows; ++j) {
    const uint8_t* row = row_layout(type, tile, row_bytes, j, K, buf);
    if constexpr (std::is_same_v<T, float>) dequantize_row(base, row, y + j * ldy, K);
    else dequantize_row_bf16(base, row, y + j * ldy, K);
  }
#endif
}

// The products of one tile (16 weight rows) with g input rows (1 <= g <= kRowGroup): out[16 r + j] for
// input row r and weight row j of the tile.
// ahead(bytes) is called before each block's bytes are read (a caller's prefetch walk keeps pace so).
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
  // Q5_0's q + 16 (w = d (c - bias)); Q4_1's and Q5_1's w = d c + m.
  constexpr float bias = BASE == Q8_0 ? -128.f : five ? -16.f : -8.f;
  __m512 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    ahead(block);
    const uint8_t* blk = tile + b * block;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
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
        c0 = _mm512_and_si512(v, m4), c1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4), i0 = t, i1 = 4 + t;
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
    if constexpr (has_min) m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + f.m)));
    for (int r = 0; r < R; ++r) {  // d dx sum(c x), and the bias or offset times s
      const __m512 p = _mm512_cvtepi32_ps(_mm512_add_epi32(s0[r], s1[r]));
      acc[r] = _mm512_fmadd_ps(p, _mm512_mul_ps(dw, _mm512_set1_ps(x[r].d[b])), acc[r]);
      if constexpr (has_min)
        off[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x[r].s[b]), off[r]);
      else
        off[r] = _mm512_fmadd_ps(dw, _mm512_set1_ps(bias * x[r].s[b]), off[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + 16 * r, _mm512_add_ps(acc[r], off[r]));
}
#endif

// The portable reference of tile_product: the same sums, lane by lane (not used where VNNI is: quant.py tiles
// only there; kept so any build multiplies a tiled matrix correctly).
inline void tile_product_portable(int base, const uint8_t* tile, int64_t nb, const QRow* x, int g, float* out) {
  const TileFormat f = tile_format(base);
  const int64_t block = tile_block_bytes(base);
  const float bias = base == Q8_0 ? -128.f : f.h >= 0 ? -16.f : -8.f;
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

template <typename Ahead>
inline void tile_rows(int type, const uint8_t* tile, int64_t nb, const QRow* x, int g, float* out, const Ahead& ahead) {
  const int base = base_type(type);
#ifdef TM_QUANT_VNNI
  auto run = [&](auto r) {
    constexpr int R = decltype(r)::value;
    switch (base) {
      case Q8_0: return tile_product<R, Q8_0>(tile, nb, x, out, ahead);
      case Q4_0: return tile_product<R, Q4_0>(tile, nb, x, out, ahead);
      case Q4_1: return tile_product<R, Q4_1>(tile, nb, x, out, ahead);
      case Q5_0: return tile_product<R, Q5_0>(tile, nb, x, out, ahead);
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
  tile_product_portable(base, tile, nb, x, g, out);
#endif
}

// Rows [n0, n1) of y = x W^T for a tiled W (row_bytes a row), M input rows: each tile once, every group of
// up to kRowGroup input rows over it while it is in cache; a tile cut by n0 or n1 is computed whole and
// only its rows in range kept. store(m, n, value) receives each product; ahead(bytes) as tile_product's, on
// the first pass over each tile.
template <typename Store, typename Ahead>
inline void tiled_rows(int type, const uint8_t* w, int64_t row_bytes, const QRow* x, int64_t M, int64_t K, int64_t n0,
                       int64_t n1, const Store& store, const Ahead& ahead) {
  const int64_t nb = K / QK, tile_bytes = kTileRows * row_bytes;
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
