// A prompt's rows (bfloat16) through tiled weights (quant_tiles.h) without a dequantized copy in memory.
//
// The float-input path of quant_product.h otherwise dequantizes a thousand or more weight rows at a time into
// a buffer and hands it to torch's GEMM: the buffer (8 MiB and more) leaves the cache before the GEMM reads it
// back, and a tile's rows dequantize at about one value a cycle, so on a 2-core Zen 5 a prompt chunk's product
// took 1.1-1.2x the bfloat16 GEMM's time at 256-512 rows and 1.2-1.9x at 16-64 (benchmarks/pair_products.py).
// Here each panel of 32 weight rows (two tiles) is dequantized once into bfloat16 pairs, lanes being rows as
// in the tile itself (a code word of 16 rows becomes two vectors of (element k, element k + 1) pairs: four
// conversions, two permutes for 64 values), into a buffer that stays in the core's L2, and every input row
// meets it there: vdpbf16ps multiplies an input row's pair, broadcast, by the 16 rows' pairs, with 12 input
// rows x 2 tiles of float32 sums in registers over the whole row. Measured the same way: 0.82-0.99x the
// bfloat16 GEMM's time at 256-512 rows, 0.54-0.94x at 16-64 (where it reads 4-8-bit weights, not 16).
//
// The weights are the dequantized model's bfloat16 values bit for bit (each value one fused multiply-add
// whose exact result is the row layout's, rounded once: see pair_values), and each output is one float32
// sum over k in a fixed order whatever the row count or the row's place in it, so a prompt's logits do not
// depend on how it was split into chunks or how much of it the prefix cache held. They are not torch's GEMM's
// last bits (its summation order is its own), which only the float32 path (and CPUs without AVX-512 BF16)
// still goes through. On CPUs with AMX the same pairs are AMX's B tiles instead (quant_product.h's
// amx_pair_product), for matrices in rows too.
#pragma once

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_tiles.h"

namespace tmq {

#if defined(TM_QUANT_AVX512) && defined(__AVX512BF16__) && !defined(TOKENMILL_SIMDE)
#define TM_QUANT_PAIRS 1

constexpr int kPairRows = 12;  // input rows a pass: 12 x 2 tiles of sums, 2 weight vectors, one broadcast (27 of 32 registers)

// f[i] (i < 4): element k0 + i of the 16 rows, a lane per row -> the pairs (k0, k0 + 1) at out, (k0 + 2,
// k0 + 3) at out + 16, each lane a row's two bfloat16 values (rounded to nearest even, as bf16x16 does).
TM_INLINE void store_pairs(const __m512 f[4], uint32_t* out) {
  alignas(64) static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512((const void*)interleave);
  for (int p = 0; p < 2; ++p) {
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(f[2 * p + 1], f[2 * p]);  // words 0-15: f[2p]
    _mm512_storeu_si512((void*)(out + 16 * p), _mm512_permutexvar_epi16(idx, both));
  }
}

// Four codes of each row (q[i], int32 lanes) as values scale q + offset: one fused multiply-add, whose exact
// result is the row layout's value (quant.h's dequantize_bf16_*) before its one rounding. Q8_0's d q, Q4_0's
// d q - 8 d, Q4_1's d q + m, Q4_K's and Q5_K's (d sc) q - dmin m: the product is exact in float32 (an 11-bit
// scale times a code of at most 8 bits, or the 17-bit d sc times one of 4 or 5), so rounding the sum once is
// what the row layout's product-then-sum does. Q6_K's (d sc)(q - 32), rounded once there, is exactly
// (d sc) q - 32 (d sc), which the fused multiply-add rounds once too.
// (Q8_0, without an offset: d q alone, as the row layout has it, down to the sign of a zero.)
template <bool OFFSET = true>
TM_INLINE void pair_values(const __m512i q[4], __m512 scale, __m512 offset, uint32_t* out) {
  __m512 f[4];
  for (int i = 0; i < 4; ++i)
    f[i] = OFFSET ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(q[i]), scale, offset) : _mm512_mul_ps(_mm512_cvtepi32_ps(q[i]), scale);
  store_pairs(f, out);
}

// Bits 4s .. 4s + 3 of each lane (a nibble); quant_tiles.h has the bytes (lane_byte, lane_sbyte).
TM_INLINE __m512i lane_nibble(__m512i v, int s) {
  return _mm512_and_si512(_mm512_srli_epi32(v, 4 * s), _mm512_set1_epi32(0xF));
}

// The 32-element formats: a block's 16 rows of 32 values -> 16 pair vectors at out (pair p at out + 16 p).
template <int BASE>
TM_INLINE void block_pairs(const uint8_t* blk, uint32_t* out) {
  constexpr TileFormat f = tile_format(BASE);
  const __m512 d = half_lanes(blk);
  if constexpr (BASE == Q8_0) {
    const __m512i c128 = _mm512_set1_epi32(128);
    for (int t = 0; t < 8; ++t) {  // word t: elements 4t .. 4t + 3, as q + 128
      const __m512i v = _mm512_loadu_si512(blk + f.codes + 64 * t);
      const __m512i q[4] = {_mm512_sub_epi32(lane_byte(v, 0), c128), _mm512_sub_epi32(lane_byte(v, 1), c128),
                            _mm512_sub_epi32(lane_byte(v, 2), c128), _mm512_sub_epi32(lane_byte(v, 3), c128)};
      pair_values<false>(q, d, d, out + 32 * t);
    }
    return;
  }
  constexpr bool five = BASE == Q5_0 || BASE == Q5_1, has_min = BASE == Q4_1 || BASE == Q5_1, nl = BASE == IQ4_NL;
  const __m512 offset = has_min ? half_lanes(blk + f.m) : _mm512_mul_ps(d, _mm512_set1_ps(five ? -16.f : -8.f));
  // IQ4_NL: a code's table value as an int32 lane (d v, as the row layout has it)
  const __m512i table = nl ? _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)kIq4Values)) : _mm512_setzero_si512();
  const __m512i h = five ? _mm512_loadu_si512(blk + f.h) : _mm512_setzero_si512(), one = _mm512_set1_epi32(1);
  for (int t = 0; t < 4; ++t) {  // word t: byte i holds element 4t + i (low nibble) and 4t + i + 16 (high)
    const __m512i v = _mm512_loadu_si512(blk + f.codes + 64 * t);
    for (int half = 0; half < 2; ++half) {
      __m512i q[4];
      for (int i = 0; i < 4; ++i) {
        q[i] = lane_nibble(v, 2 * i + half);
        if (five)  // the fifth bit of element e = 16 half + 4t + i: bit e of the row's qh
          q[i] = _mm512_or_si512(q[i], _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 16 * half + 4 * t + i), one), 4));
        if (nl) q[i] = _mm512_permutexvar_epi32(q[i], table);
      }
      if (nl) pair_values<false>(q, d, d, out + 16 * (8 * half + 2 * t));
      else pair_values(q, d, offset, out + 16 * (8 * half + 2 * t));
    }
  }
}

// Q4_K (Q5_K with FIVE): a super-block's 16 rows of 256 values -> 128 pair vectors.
template <bool FIVE>
TM_INLINE void q45_k_pairs(const uint8_t* blk, uint32_t* out) {
  const __m512 d = half_lanes(blk), dmin = half_lanes(blk + 32);
  __m512i sc[2], mn[2];
  q4_k_scales(blk, sc, mn);
  __m512 scale[8], offset[8];
  for (int s = 0; s < 8; ++s) {
    scale[s] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(lane_byte(sc[s / 4], s % 4)));
    offset[s] = _mm512_mul_ps(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(lane_byte(mn[s / 4], s % 4))), _mm512_set1_ps(-1.f));
  }
  for (int t = 0; t < 32; ++t) {  // qs word t: bytes 4t .. 4t + 3 of the 128; chunk j = t / 8 of 32 bytes
    const __m512i v = _mm512_loadu_si512(blk + (FIVE ? kQ5KCodes : kQ4KCodes) + 64 * t);
    const int j = t / 8, e = 64 * j + 4 * (t % 8);  // low nibbles: elements e .. e + 3 (sub-block 2j), high: + 32
    // Q5_K: qh word t % 8 holds elements e.. of every chunk, bit 2j (low nibbles) or 2j + 1 of each byte.
    const __m512i qh = FIVE ? _mm512_loadu_si512(blk + kQ5KHigh + 64 * (t % 8)) : _mm512_setzero_si512();
    for (int half = 0; half < 2; ++half) {
      __m512i q[4] = {lane_nibble(v, half), lane_nibble(v, 2 + half), lane_nibble(v, 4 + half), lane_nibble(v, 6 + half)};
      if (FIVE)
        for (int i = 0; i < 4; ++i)
          q[i] = _mm512_or_si512(q[i], _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh, 8 * i + 2 * j + half), _mm512_set1_epi32(1)), 4));
      pair_values(q, scale[2 * j + half], offset[2 * j + half], out + 8 * (e + 32 * half));
    }
  }
}

// Q6_K: a super-block's 16 rows of 256 values -> 128 pair vectors.
TM_INLINE void q6_k_pairs(const uint8_t* blk, uint32_t* out) {
  const __m512 d = half_lanes(blk + kQ6KD);
  for (int s = 0; s < 16; ++s) {  // sub-block s: elements 16s + 4a + (0..3) in word a
    const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + kQ6KScales + 16 * s)))));
    const __m512 offset = _mm512_mul_ps(scale, _mm512_set1_ps(-32.f));
    __m512i v[4];
    q6_k_group(blk, s, v);
    for (int a = 0; a < 4; ++a) {
      const __m512i q[4] = {lane_byte(v[a], 0), lane_byte(v[a], 1), lane_byte(v[a], 2), lane_byte(v[a], 3)};
      pair_values(q, scale, offset, out + 8 * (16 * s + 4 * a));
    }
  }
}

// Q2_K, Q3_K and IQ4_XS: a super-block's 16 rows dequantized to bfloat16 as the row layout has them
// (dequantize_k_tile), then put in pairs.
TM_INLINE void k_tile_pairs(int base, const uint8_t* blk, uint32_t* out) {
  alignas(64) uint16_t rows[kTileRows * QKK];
  dequantize_k_tile(base, blk, 1, rows, QKK);
  for (int p0 = 0; p0 < QKK / 2; p0 += 16) transpose_words((const uint8_t*)(rows + 2 * p0), QKK * 2, kTileRows, 16, out + 16 * p0);
}

// A tile's 16 rows of K values as bfloat16 pairs: pair p (elements 2p, 2p + 1) of row j at out[16 p + j].
inline void tile_pairs(int base, const uint8_t* tile, int64_t K, uint32_t* out) {
  const int64_t nb = tile_blocks(base, K), block = tile_block_bytes(base), per = gguf_block(base).block * 8;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + b * block;
    uint32_t* o = out + b * per;
    if (b + 1 < nb)  // the next block asked for now, while this one converts
      for (int64_t off = 0; off < block; off += 64) __builtin_prefetch(blk + block + off, 0, 3);
    switch (base) {
      case Q8_0: block_pairs<Q8_0>(blk, o); break;
      case Q4_0: block_pairs<Q4_0>(blk, o); break;
      case Q4_1: block_pairs<Q4_1>(blk, o); break;
      case Q5_0: block_pairs<Q5_0>(blk, o); break;
      case Q5_1: block_pairs<Q5_1>(blk, o); break;
      case IQ4_NL: block_pairs<IQ4_NL>(blk, o); break;
      case Q4_K: q45_k_pairs<false>(blk, o); break;
      case Q5_K: q45_k_pairs<true>(blk, o); break;
      case Q6_K: q6_k_pairs(blk, o); break;
      default: k_tile_pairs(base, blk, o); break;
    }
  }
}

// y[r][16 w + j] = the bfloat16 sum over k of x[r][k] w_j[k] for R input rows (ldx apart) and W tiles of
// pairs (pairs elements apart: tile w at wp + w * 16 pairs): the sums in float32 registers over the whole row.
template <int R, int W>
inline void pair_rows(const uint16_t* x, int64_t ldx, const uint32_t* wp, int64_t pairs, uint16_t* y, int64_t ldy) {
  __m512 acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < W; ++w) acc[r][w] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh b[W];
    for (int w = 0; w < W; ++w) b[w] = (__m512bh)_mm512_loadu_si512((const void*)(wp + w * 16 * pairs + 16 * p));
    for (int r = 0; r < R; ++r) {
      int32_t xr;
      std::memcpy(&xr, x + r * ldx + 2 * p, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xr);
      for (int w = 0; w < W; ++w) acc[r][w] = _mm512_dpbf16_ps(acc[r][w], a, b[w]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < W; ++w) _mm256_storeu_si256((__m256i*)(y + r * ldy + 16 * w), (__m256i)_mm512_cvtneps_pbh(acc[r][w]));
}

template <int W, int R = kPairRows>
inline void pair_rows_n(int rows, const uint16_t* x, int64_t ldx, const uint32_t* wp, int64_t pairs, uint16_t* y, int64_t ldy) {
  if constexpr (R > 1)
    if (rows < R) return pair_rows_n<W, R - 1>(rows, x, ldx, wp, pairs, y, ldy);
  pair_rows<R, W>(x, ldx, wp, pairs, y, ldy);
}

#endif

}  // namespace tmq
