// Products with block-format weights on AMX (Intel Sapphire Rapids and later): y[M, N] = x[M, K] W^T with the
// inputs quantized to int8 in blocks of 32 (as quant.h's byte products take them) and the weights' small
// integers, multiplied 16 x 16 x 32 at a time by the tile unit (tdpbssd), each block's int32 sums then scaled
// in float32 with AVX-512.
//
// A block format scales every 32 weights (16 for Q6_K) by their own factor, and every 32 inputs by theirs, so
// each block's product is a tile of its own: C = W_b X_b^T (16 weight rows by 16 input rows), then
// acc[n][m] += C[n][m] dw[n] dx[m] (+ the format's offset, mw[n] sx[m], where it has one). The weights are
// the tiles' A operand, 16 rows of 32 bytes as the rows run, so a panel of 16 weight rows is only unpacked
// from its blocks (once, into a thread's scratch); the inputs are the B operand, transposed into the layout
// tdpbssd reads (4 bytes of each of 16 rows per tile row) once per product, shared by every panel.
//
// Values as quant.h's byte products compute them, but for the order of the float32 additions.
#pragma once

#include "quant.h"

#if defined(TM_QUANT_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && !defined(TOKENMILL_SIMDE)
#define TM_QUANT_AMX 1

#include <sys/syscall.h>
#include <unistd.h>

namespace tmq {

// The row-layout formats whose blocks the AMX path unpacks into int8 tiles (not MXFP4's, IQ4_NL's or IQ4_XS's
// table codes, nor Q2_K's or Q3_K's 2- and 3-bit codes yet: those take the byte products; nor tiled rows).
inline bool amx_format(int type) {
  switch (type) {
    case Q8_0: case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q4_K: case Q5_K: case Q6_K: return true;
    default: return false;
  }
}

// Linux gives a process AMX's tile state only once it asks for it (arch_prctl ARCH_REQ_XCOMP_PERM).
inline bool amx_usable() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Palette 1, tile t of rows[t] rows of colsb[t] bytes (t < 8).
inline void load_tile_config(const uint8_t (&rows)[8], const uint16_t (&colsb)[8]) {
  struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) c.rows[t] = rows[t], c.colsb[t] = colsb[t];
  // GCC's _tile_loadconfig tells the compiler it reads only a pointer's worth of the configuration, which
  // lets it drop the stores above as dead (seen: ldtilecfg of a configuration without its rows and columns,
  // a general-protection fault); the configuration escapes here, so every store is made first.
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// Tiles: 0, 1 A (16 weight rows x 32 bytes, or 16 for Q6_K's sub-blocks: `half`) and 2, 3 B (the same
// inputs of 16 rows, 4 per tile row), taken in turn, so that a tile is loaded while the other is multiplied;
// 4-7 C (16 x 16 int32), in turn, so that a C tile is zeroed for a new product well after its last sums were
// stored (a tile written too soon after its store waits for it).
inline void configure_tiles(bool half) {
  const uint8_t b = half ? 4 : 8;
  const uint16_t a = half ? 16 : 32;
  load_tile_config({16, 16, b, b, 16, 16, 16, 16}, {a, a, 64, 64, 64, 64, 64, 64});
}

// 16 rows' 32 bytes each, two rows a vector (rows 2p, 2p+1 in the halves of rows[p]), into the B tile layout:
// tile row k holds bytes 4k..4k+3 of each of the 16 rows. A 16 x 8 transpose of dwords.
inline void store_b_tile(const __m512i rows[8], uint8_t* out) {
  const __m512i i0 = _mm512_set_epi32(27, 19, 11, 3, 26, 18, 10, 2, 25, 17, 9, 1, 24, 16, 8, 0);
  const __m512i i1 = _mm512_set_epi32(31, 23, 15, 7, 30, 22, 14, 6, 29, 21, 13, 5, 28, 20, 12, 4);
  __m512i t[2][4];  // t[h][g]: lane l holds dword 4h + l of rows 4g..4g+3
  for (int g = 0; g < 4; ++g) {
    t[0][g] = _mm512_permutex2var_epi32(rows[2 * g], i0, rows[2 * g + 1]);
    t[1][g] = _mm512_permutex2var_epi32(rows[2 * g], i1, rows[2 * g + 1]);
  }
  for (int h = 0; h < 2; ++h) {
    const __m512i a01 = _mm512_shuffle_i32x4(t[h][0], t[h][1], 0x44), b01 = _mm512_shuffle_i32x4(t[h][0], t[h][1], 0xEE);
    const __m512i a23 = _mm512_shuffle_i32x4(t[h][2], t[h][3], 0x44), b23 = _mm512_shuffle_i32x4(t[h][2], t[h][3], 0xEE);
    _mm512_storeu_si512((void*)(out + 64 * (4 * h + 0)), _mm512_shuffle_i32x4(a01, a23, 0x88));
    _mm512_storeu_si512((void*)(out + 64 * (4 * h + 1)), _mm512_shuffle_i32x4(a01, a23, 0xDD));
    _mm512_storeu_si512((void*)(out + 64 * (4 * h + 2)), _mm512_shuffle_i32x4(b01, b23, 0x88));
    _mm512_storeu_si512((void*)(out + 64 * (4 * h + 3)), _mm512_shuffle_i32x4(b01, b23, 0xDD));
  }
}

// A panel: 16 weight rows (fewer at the matrix's end; the rest zero) as A tiles, one per block of 32 weights
// (512 bytes: row n's 32 int8 at 32 n), with each row's scale per block (dw) and, for formats with one, its
// offset per block (mw): the weight is dw q + mw, q the tile's int8. Q6_K's blocks of 32 hold two sub-blocks
// of 16, scaled apart (dw has two entries per block).
struct Panel {
  int type;
  int64_t blocks;        // of 32 weights
  bool offsets, halves;  // mw is used; Q6_K: dw per 16 weights
  std::vector<uint8_t> tiles;  // [blocks][16 rows][32]
  std::vector<float> dw, mw;   // [16 rows][blocks (x2 for halves)]

  int64_t units_per_row() const { return blocks * (halves ? 2 : 1); }

  void build(int type_, const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t K) {
    type = type_;
    blocks = K / QK;
    offsets = has_min(type) || type == Q4_K || type == Q5_K;
    halves = type == Q6_K;
    tiles.resize(blocks * 512);
    if (rows < 16) std::fill(tiles.begin(), tiles.end(), 0);
    dw.assign(16 * units_per_row(), 0.f);
    mw.assign(offsets ? 16 * blocks : 0, 0.f);
    for (int64_t n = 0; n < rows; ++n)
      scales(w + n * row_bytes, dw.data() + n * units_per_row(), offsets ? mw.data() + n * blocks : nullptr, K);
    // values(row, b, lo, hi): blocks b and b + 1 (b even) of one row, into rows n of tiles b and b + 1.
    auto pairs = [&](auto&& values) {
      for (int64_t n = 0; n < rows; ++n)
        for (int64_t b = 0; b < blocks; b += 2) {
          __m256i lo = _mm256_setzero_si256(), hi = lo;
          values(w + n * row_bytes, b, lo, hi);
          _mm256_storeu_si256((__m256i*)(tiles.data() + b * 512 + 32 * n), lo);
          if (b + 1 < blocks) _mm256_storeu_si256((__m256i*)(tiles.data() + (b + 1) * 512 + 32 * n), hi);
        }
    };
    const __m256i m4 = _mm256_set1_epi8(0xF), eight = _mm256_set1_epi8(8);
    switch (type) {
      case Q8_0:
      case Q4_0:
      case Q4_1:
      case Q5_0:
      case Q5_1: {
        // A block a tile row, its codes taken from the row's groups in registers (a group's 4-bit codes split
        // into 8 word rows of whole values, then transposed to blocks), the row's last nb % 16 blocks as they
        // are: Q8_0's signed values; Q4_0, Q5_0: q - 8, q - 16, signed;
        // Q4_1, Q5_1: q, with its offset m.
        const bool q8 = type == Q8_0, sub = !has_min(type) && !q8, five = five_bits(type);
        const __m256i bias = five ? _mm256_set1_epi8(16) : eight;
        const __m128i m = _mm_set1_epi8(0xF);
        auto nibbles = [&](__m128i q, const uint32_t* h) {  // 16 code bytes (and the fifth bits) -> 32 values
          __m256i v = two_halves(_mm_and_si128(q, m), _mm_and_si128(_mm_srli_epi16(q, 4), m));
          if (five) v = _mm256_or_si256(v, fifth_bits(h));
          return sub ? _mm256_sub_epi8(v, bias) : v;
        };
        const int64_t whole = blocks / kGroup * kGroup;
        for (int64_t n = 0; n < rows; ++n) {
          const uint8_t* r = w + n * row_bytes;
          const NibbleRow nr(type, r, blocks);
          const uint8_t* qs = q8 ? r + 2 * blocks : nr.qs;
          auto put = [&](int64_t b, __m256i v) { _mm256_storeu_si256((__m256i*)(tiles.data() + b * 512 + 32 * n), v); };
          for (int64_t g = 0; g < whole; g += kGroup) {
            if (q8) {
              group_blocks_each<8>(qs + g * QK, [&](int l, __m256i v) { put(g + l, q8_values(v)); });
            } else {  // each word row's low and high nibbles (with their fifth bits): words 0-3 and 4-7 of 8
              const __m512i m4 = _mm512_set1_epi8(0xF), c16 = _mm512_set1_epi8(16);
              __m512i words[8];
              for (int t = 0; t < 4; ++t) {
                const __m512i q = _mm512_loadu_si512((const void*)(qs + g * 16 + 64 * t));
                words[t] = _mm512_and_si512(q, m4), words[4 + t] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
                if (five) {
                  uint64_t lo, hi;
                  std::memcpy(&lo, nr.qh + 4 * g + 8 * t, 8);
                  std::memcpy(&hi, nr.qh + 4 * g + 32 + 8 * t, 8);
                  words[t] = _mm512_mask_add_epi8(words[t], (__mmask64)lo, words[t], c16);
                  words[4 + t] = _mm512_mask_add_epi8(words[4 + t], (__mmask64)hi, words[4 + t], c16);
                }
              }
              word_rows_each_block(words, [&](int l, __m256i v) { put(g + l, sub ? _mm256_sub_epi8(v, bias) : v); });
            }
          }
          for (int64_t b = whole; b < blocks; ++b) {
            if (q8)
              put(b, q8_values(_mm256_loadu_si256((const __m256i*)(qs + b * QK))));
            else
              put(b, nibbles(_mm_loadu_si128((const __m128i*)(qs + 16 * b)), (const uint32_t*)(nr.qh + 4 * b)));
          }
        }
        break;
      }
      case Q4_K:
      case Q5_K: {
        const bool five = type == Q5_K;
        const int size = five ? 176 : 144;
        const __m256i one = _mm256_set1_epi8(1);
        pairs([&](const uint8_t* r, int64_t bb, __m256i& l, __m256i& h) {
          const uint8_t* blk = r + (bb / 8) * size;
          const int j = (int)(bb % 8) / 2;  // sub-blocks 2j (low nibbles) and 2j + 1 (high)
          const __m256i q = _mm256_loadu_si256((const __m256i*)(blk + (five ? 48 : 16) + 32 * j));
          l = _mm256_and_si256(q, m4), h = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
          if (five) {
            const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 16));
            l = _mm256_or_si256(l, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
            h = _mm256_or_si256(h, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
          }
        });
        break;
      }
      case Q6_K: {
        const __m256i m2 = _mm256_set1_epi8(3), c32 = _mm256_set1_epi8(32);
        pairs([&](const uint8_t* r, int64_t bb, __m256i& l, __m256i& h) {
          const BlockQ6_K* x = (const BlockQ6_K*)(r + (bb / 8) * 210);
          const int half = (int)(bb % 8) / 4, k = (int)(bb % 4);  // blocks k, k + 1 (k even) of the half
          const uint8_t* ql = x->ql + 64 * half;
          const __m256i qh = _mm256_loadu_si256((const __m256i*)(x->qh + 32 * half));
          auto block = [&](int kk) {  // q = 4 bits of ql | 2 bits of qh, minus 32
            const __m256i q = _mm256_loadu_si256((const __m256i*)(ql + 32 * (kk & 1)));
            const __m256i low = kk < 2 ? _mm256_and_si256(q, m4) : _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * kk), m2), 4);
            return _mm256_sub_epi8(_mm256_or_si256(low, high), c32);
          };
          l = block(k), h = block(k + 1);
        });
        break;
      }
    }
  }

 private:
  static __m256i two_halves(__m128i a, __m128i b) { return _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1); }

  // One weight row's scales (dw, a value per block, or per 16 weights for Q6_K) and offsets (mw, per block).
  void scales(const uint8_t* r, float* dw_row, float* mw_row, int64_t K) const {
    switch (type) {
      case Q8_0:
      case Q4_0:
      case Q4_1:
      case Q5_0:
      case Q5_1: {
        const uint16_t* d = (const uint16_t*)r;  // then the offsets where the format has them (NibbleRow)
        int64_t b = 0;
        for (; b + 16 <= blocks; b += 16) {
          _mm512_storeu_ps(dw_row + b, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(d + b))));
          if (mw_row) _mm512_storeu_ps(mw_row + b, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(d + blocks + b))));
        }
        for (; b < blocks; ++b) {
          dw_row[b] = fp16(d[b]);
          if (mw_row) mw_row[b] = fp16(d[blocks + b]);
        }
        break;
      }
      case Q4_K:
      case Q5_K: {
        const int size = type == Q5_K ? 176 : 144;
        for (int64_t s = 0; s < K / QKK; ++s) {
          const uint8_t* blk = r + s * size;
          const __m256 d = _mm256_set1_ps(fp16(*(const uint16_t*)blk)), dmin = _mm256_set1_ps(fp16(*(const uint16_t*)(blk + 2)));
          const __m128i scm = scales_mins_k4(blk + 4);  // as quant.h's dequantization: (d sc) q - (dmin m)
          _mm256_storeu_ps(dw_row + 8 * s, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(scm))));
          _mm256_storeu_ps(mw_row + 8 * s, _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(
              dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scm, 8))))));
        }
        break;
      }
      case Q6_K:
        for (int64_t s = 0; s < K / QKK; ++s) {
          const BlockQ6_K* x = (const BlockQ6_K*)(r + s * 210);
          _mm512_storeu_ps(dw_row + 16 * s, _mm512_mul_ps(_mm512_set1_ps(fp16(x->d)), _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)x->scales)))));
        }
        break;
    }
  }
};

// The inputs as tdpbssd's B operand: for each 16 rows (zeros past M) and each block of 32, a 512-byte tile
// (store_b_tile's layout), and each row's block scale and scaled sum as vectors over the 16 rows.
struct Inputs {
  int64_t blocks, tiles16;  // blocks of 32 per row; tiles of 16 rows
  std::vector<uint8_t> b;   // [tiles16][blocks][512]
  std::vector<float> d, s;  // [tiles16][blocks][16]

  // q [rows rounded up to 16, K] int8 with zero rows past M; d, s [.., K / 32].
  void set(const int8_t* q, const float* dq, const float* sq, int64_t M, int64_t K) {
    blocks = K / QK, tiles16 = (M + 15) / 16;
    b.resize(tiles16 * blocks * 512);
    d.resize(tiles16 * blocks * 16), s.resize(tiles16 * blocks * 16);
    const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32((int)blocks));
    for (int64_t t = 0; t < tiles16; ++t)
      for (int64_t j = 0; j < blocks; ++j) {
        __m512i rows[8];
        for (int p = 0; p < 8; ++p) {
          const int8_t* r = q + (t * 16 + 2 * p) * K + j * QK;
          rows[p] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)r)),
                                       _mm256_loadu_si256((const __m256i*)(r + K)), 1);
        }
        store_b_tile(rows, b.data() + (t * blocks + j) * 512);
        _mm512_storeu_ps(d.data() + (t * blocks + j) * 16, _mm512_i32gather_ps(idx, dq + t * 16 * blocks + j, 4));
        _mm512_storeu_ps(s.data() + (t * blocks + j) * 16, _mm512_i32gather_ps(idx, sq + t * 16 * blocks + j, 4));
      }
  }
};

// acc[n] += float(c[n]) * dw[n * stride] * dx for the 16 weight rows of a stored C tile (dx: the 16 input
// rows' scales of this block).
inline void scale_rows(__m512 acc[16], const int32_t* c, const float* dw, int64_t stride, __m512 dx) {
#pragma GCC unroll 16
  for (int n = 0; n < 16; ++n)
    acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void*)(c + 16 * n))),
                             _mm512_mul_ps(dx, _mm512_set1_ps(dw[n * stride])), acc[n]);
}

// C tile T (4..7) = A B for one product unit, A and B in tiles A (0 or 1) and B (2 or 3). A macro: the
// compiler's tile intrinsics take a tile's number as text.
#define TM_ISSUE_UNIT(T, A, B, a, b) \
  do {                               \
    _tile_loadd(A, a, 32);           \
    _tile_loadd(B, b, 64);           \
    _tile_zero(T);                   \
    _tile_dpbssd(T, A, B);           \
  } while (0)

// y[m0 + m, n0 + n] (rows ldy apart, n < cols, m0 + m < M) for input tile t of x (rows [16 t, 16 t + 16)).
// A unit is a block of 32 weights (two of 16 for Q6_K). Pipelined: while unit u is issued to the tile unit,
// the sums of unit u - 1 are stored, and those of unit u - 2 (stored one step earlier, so landed) scaled.
inline void panel_product(const Panel& p, const Inputs& x, int64_t t, int64_t M, float* y, int64_t ldy,
                          int64_t cols) {
  const int64_t nb = p.blocks, per_block = p.halves ? 2 : 1, units = nb * per_block, stride = p.units_per_row();
  alignas(64) int32_t c[2][16 * 16];
  __m512 acc[16];
  for (int n = 0; n < 16; ++n) acc[n] = _mm512_setzero_ps();
  const uint8_t* wt = p.tiles.data();
  const uint8_t* xt = x.b.data() + t * nb * 512;
  const float* dx = x.d.data() + t * nb * 16;
  for (int64_t u = 0; u < units + 2; ++u) {
    if (u < units) {
      const int64_t b = u / per_block, h = u % per_block;
      const uint8_t* au = wt + b * 512 + 16 * h;
      const uint8_t* bu = xt + b * 512 + 256 * h;
      switch (u % 4) {
        case 0: TM_ISSUE_UNIT(4, 0, 2, au, bu); break;
        case 1: TM_ISSUE_UNIT(5, 1, 3, au, bu); break;
        case 2: TM_ISSUE_UNIT(6, 0, 2, au, bu); break;
        default: TM_ISSUE_UNIT(7, 1, 3, au, bu); break;
      }
    }
    if (u >= 1 && u <= units) {
      int32_t* out = c[(u - 1) % 2];
      switch ((u - 1) % 4) {
        case 0: _tile_stored(4, out, 64); break;
        case 1: _tile_stored(5, out, 64); break;
        case 2: _tile_stored(6, out, 64); break;
        default: _tile_stored(7, out, 64); break;
      }
    }
    if (u >= 2) {
      const int64_t v = u - 2;
      scale_rows(acc, c[v % 2], p.dw.data() + v, stride, _mm512_loadu_ps(dx + v / per_block * 16));
    }
  }
  if (p.offsets) {  // + mw[n] sx[m] per block: the formats' offsets times the inputs' scaled sums
    const float* sx = x.s.data() + t * nb * 16;
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 sv = _mm512_loadu_ps(sx + b * 16);
#pragma GCC unroll 16
      for (int n = 0; n < 16; ++n) acc[n] = _mm512_fmadd_ps(sv, _mm512_set1_ps(p.mw[n * nb + b]), acc[n]);
    }
  }
  alignas(64) float out[16 * 16];  // [n][m]: written out transposed, y's rows being the inputs'
  for (int n = 0; n < 16; ++n) _mm512_store_ps(out + 16 * n, acc[n]);
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  const __mmask16 mask = (__mmask16)((1u << cols) - 1);
  for (int64_t m = 0; m < 16 && t * 16 + m < M; ++m)
    _mm512_mask_storeu_ps(y + (t * 16 + m) * ldy, mask, _mm512_i32gather_ps(column, out + m, 4));
}

#undef TM_ISSUE_UNIT

}  // namespace tmq

#endif  // TM_QUANT_AMX
