// Products with a block-format weight, y[M, N] = x[M, K] W^T, for both extensions (quant_kernels.cpp's
// qmatmul, cpu_kernels.cpp's matrix_product): one place for the choice between two ways.
//
//  - Few input rows (decode, short chunks): the weight is read once, row by row, through quant.h's integer
//    dot products, the inputs quantized to int8 in blocks of 32. The weight stream is the cost.
//  - float_rows_for() rows or more (prompt chunks, large batches): the weights are dequantized to the
//    inputs' dtype (float32 or bfloat16) and multiplied as floats. The multiply-adds are the cost there, and
//    the inputs keep their float values (no int8 rounding), so a prompt's logits are those of the dequantized
//    model. bfloat16 inputs on CPUs with AMX: panels of 32 weight rows (tiled or not) dequantized in cache
//    to bfloat16 pairs and multiplied there on AMX's bfloat16 tiles (amx_pair_product below); tiled weights
//    and bfloat16 inputs on other CPUs with AVX-512 BF16: the same pairs through vdpbf16ps (quant_pairs.h,
//    pair_product below); otherwise a thousand or more rows at a time dequantized into a buffer, then
//    torch's GEMM.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "quant.h"
#include "quant_amx.h"
#include "quant_pairs.h"
#include "quant_tiles.h"

namespace tmq {

// From this many input rows on, dequantize + GEMM. Measured on 2 cores with a 2048 x 8192 matrix: float32
// (AVX-512 without VNNI), the byte products were faster at 32 rows (~1.3x), the float GEMM at 64 (~1.2x;
// ~1.6x at 256). With AMX, bfloat16 inputs (whose GEMM runs ~6x the float32 rate), a Q4_K 8192 x 2048
// product: 16 rows 2.7 ms one weight row at a time (VNNI), 1.4 on AMX's int8 tiles, 2.4 dequantized; 48 rows
// 7.8, 2.6 and 3.0 ms; 64 rows 3.3 on tiles, 3.2 dequantized, which pulls ahead from there (128 rows: 6.0
// and 4.0 ms; 512: 24 and 9.9). Q6_K 2048 x 8192 alike.
// With AVX-512 BF16 and VNNI but no AMX (Zen 4), bfloat16 inputs on the default model's and Gemma 3 270M's
// shapes (benchmarks/float_rows_products.py), dequantized against byte products: 1.1-3.1x the time at 4-8
// rows, 0.64-1.12x at 16, 0.49-0.89x at 24, 0.33-0.71x at 48; time to first token of 16-, 24-, 37- and
// 47-token prompts on those two models (benchmarks/float_rows_ttft.py), switching at 16 against 48: 1.06x,
// 0.86x, 0.72x, 0.65x. So from 20.
// With AMX, bfloat16 inputs now meet the weights' pairs on AMX's bfloat16 tiles (amx_pair_product below):
// against the tiles' byte products (benchmarks/pair_products.py, 2-core Xeon), 0.92x their time at 16 rows,
// 0.72x at 24, 0.59x at 32, 0.50x at 48 (Q4_K 8192 x 2048; Q4_0, Q8_0, Q4_1 alike; Q6_K in rows 1.7-2.5
// ms at 16-48 rows, about AMX's int8 panels' 1.4-2.6 above). So from 20 there too: the default model's
// batches of 48 (past the fused decoder's 32 rows) decoded 1.48-1.56x as fast.
constexpr int64_t kFloatRows = 48;
#if defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define TM_GEMM_AMX 1  // torch's bfloat16 GEMM runs on AMX
#endif
#if defined(__AVX512BF16__)
constexpr int64_t kFloatRowsBf16 = 20;
#else
constexpr int64_t kFloatRowsBf16 = kFloatRows;
#endif
// Settable (set_float_rows in each extension; TOKENMILL_QUANT_FLOAT_ROWS), one count for both dtypes; 0: the
// defaults above. A row's result depends on the path its product took, so tests that compare schedules pin
// it, and benchmarks compare the two.
inline std::atomic<int64_t> float_rows{0};
inline int64_t float_rows_for(bool bf16) {
  const int64_t n = float_rows.load(std::memory_order_relaxed);
  return n > 0 ? n : bf16 ? kFloatRowsBf16 : kFloatRows;
}
// Dequantized weight rows at a time: 4M values (8 MiB in bfloat16, 16 in float32), and at least 1024 rows.
// Each tile is one GEMM call, which packs its inputs again: measured with AMX, tiles of 1024-2048 rows run
// within ~10% of one whole GEMM, 512-row tiles at half its speed for some shapes (512 x 8192 by 8192 x 512).
constexpr int64_t kDequantTileFloats = 1 << 22, kDequantTileRows = 1024;

// Runs fn(tile) for tiles 0..n-1 on torch's intra-op threads, each thread taking the next tile from a
// shared counter: a thread the OS deschedules (another process on its core) holds up only the tile it has,
// while the others take the rest. (A pool of our own would compete with torch's spinning OpenMP threads
// for the same cores between the model's other operations; measured slower.)
template <typename F>
void for_tiles(int64_t n, const F& fn) {
  int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1) {
    for (int64_t t = 0; t < n; ++t) fn(t);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < n;) fn(t);
  });
}

// torch's GEMM in bfloat16 (or half) on the CPU is oneDNN's, which compiles kernels for each row count it
// meets and keeps them: varied prompt lengths then cost a compilation per new count and memory that is not
// given back. Measured with AMX, four weight shapes of the default model, row counts drawn from 16-600:
// 14.6 ms a step at a new count against 3.6 at a known one, and the process grew from 245 MB to 1.5 GB over
// 580 counts. So such products go in chunks of kGemmChunk rows, the last padded with zero rows to a multiple
// of 16 (AMX's tile height): at most kGemmChunk / 16 row counts per weight shape. float32 (MKL) is left alone:
// it compiles nothing per shape.
constexpr int64_t kGemmChunk = 512, kGemmRowStep = 16;

// fn(x_rows) = the product of some rows of x (a [rows, ...] tensor), for all of x's rows, in row counts drawn
// from the fixed set above; y [M, N] receives it (a fresh tensor where y is undefined).
template <typename F>
torch::Tensor bucketed_rows(const torch::Tensor& x, torch::Tensor y, const F& fn) {
  const int64_t M = x.size(0);
  const bool reduced = x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf;
  if (!reduced || !x.device().is_cpu() || (M <= kGemmChunk && M % kGemmRowStep == 0)) {
    if (!y.defined()) return fn(x);
    y.copy_(fn(x));
    return y;
  }
  for (int64_t m0 = 0; m0 < M; m0 += kGemmChunk) {
    const int64_t rows = std::min(kGemmChunk, M - m0), padded = (rows + kGemmRowStep - 1) / kGemmRowStep * kGemmRowStep;
    torch::Tensor part = x.narrow(0, m0, rows);
    if (padded != rows) {
      torch::Tensor grown = torch::zeros({padded, x.size(1)}, x.options());
      grown.narrow(0, 0, rows).copy_(part);
      part = grown;
    }
    torch::Tensor out = fn(part).narrow(0, 0, rows);
    if (!y.defined()) y = torch::empty({M, out.size(1)}, out.options());
    y.narrow(0, m0, rows).copy_(out);
  }
  return y;
}

// x [M, K] W^T (+ bias) through torch's GEMM, in bucketed row counts.
inline torch::Tensor gemm_linear(const torch::Tensor& x, const torch::Tensor& w,
                                 const c10::optional<torch::Tensor>& bias = c10::nullopt) {
  return bucketed_rows(x, torch::Tensor(), [&](const torch::Tensor& rows) { return at::linear(rows, w, bias); });
}

#ifdef TM_QUANT_PAIRS
// y [M, N] (bfloat16, unit column stride) = x [M, K] (bfloat16) W^T, W tiled (N a multiple of 16): panels of
// two tiles (one where K is long: the pairs of two 16384-wide tiles would outgrow L2) on torch's threads.
inline void pair_product(int type, const uint8_t* w, int64_t row_bytes, int64_t N, const torch::Tensor& x,
                         torch::Tensor& y) {
  const int base = base_type(type);
  const int64_t M = x.size(0), K = x.size(1), tiles = N / kTileRows, pairs = K / 2;
  const int W = K <= 8192 ? 2 : 1;
  const torch::Tensor xc = x.contiguous();
  const uint16_t* xp = (const uint16_t*)xc.data_ptr();
  uint16_t* yp = (uint16_t*)y.data_ptr();
  const int64_t ldy = y.stride(0);
  for_tiles((tiles + W - 1) / W, [&](int64_t p) {
    const int64_t t0 = p * W, nt = std::min<int64_t>(W, tiles - t0);
    thread_local std::vector<uint32_t> buf;  // kept between calls: a fresh one would fault its pages in
    if ((int64_t)buf.size() < nt * pairs * 16) buf.resize(nt * pairs * 16);
    for (int64_t t = 0; t < nt; ++t) tile_pairs(base, w + (t0 + t) * kTileRows * row_bytes, K, buf.data() + t * pairs * 16);
    for (int64_t m0 = 0; m0 < M; m0 += kPairRows) {
      const int rows = (int)std::min<int64_t>(kPairRows, M - m0);
      uint16_t* out = yp + m0 * ldy + t0 * kTileRows;
      if (nt == 2) pair_rows_n<2>(rows, xp + m0 * K, K, buf.data(), pairs, out, ldy);
      else pair_rows_n<1>(rows, xp + m0 * K, K, buf.data(), pairs, out, ldy);
    }
  });
}
#endif

#if defined(TM_QUANT_PAIRS) && defined(TM_QUANT_AMX) && defined(__AMX_BF16__)
#define TM_PAIRS_AMX 1
// The same pairs on AMX's bfloat16 tiles (tdpbf16ps), where the CPU has them: a pair buffer's 16 pairs of
// 16 weight rows (1 KiB) are exactly a B tile (tile row p: pair p of each row), so a panel is dequantized
// into them as above and every 16 input rows, as an A tile (16 rows of 32 values), meet it 16 x 16 x 32 at
// a time. Each output is one float32 sum over k, 32 at a time in k's order, whatever
// the row count or the row's place in it (a tile's rows are independent), so a prompt's rows keep the same
// bits however it is chunked, as the pairs' do. torch's GEMM on a dequantized copy, which this replaces,
// wrote the whole matrix out as bfloat16 and read it back (a 4-row prompt paid for the matrix twice over).

// Tiles: 0, 1 A (input rows), 2, 3 B (pairs of two weight tiles), 4-7 C (float32 sums, A x B in turn).
inline void configure_bf16_tiles() {
  load_tile_config({16, 16, 16, 16, 16, 16, 16, 16}, {64, 64, 64, 64, 64, 64, 64, 64});
}

// Rows not in tiles (a format kept in rows; N's last rows): `count` (<= 16) rows' elements [k0, k0 + n) in
// pairs as a tile's are (the missing rows' pairs zero). k0 > 0 only for the K formats, whose rows are GGUF's
// blocks one after the other: 16 of them are moved into a tile of those blocks, whose pairs tile_pairs makes;
// other rows are dequantized as the row layout has them, then transposed into pairs.
inline void row_pairs(int type, const uint8_t* w, int64_t row_bytes, int64_t count, int64_t k0, int64_t n, uint32_t* out) {
  const int64_t offset = k0 > 0 ? k0 / QKK * gguf_block(type).bytes : 0;
  if (count == kTileRows && k_format(type)) {
    thread_local std::vector<uint8_t> tile;
    const int64_t bytes = tile_blocks(type, n) * tile_block_bytes(type);
    if ((int64_t)tile.size() < bytes) tile.resize(bytes);
    tile_from_gguf(type, w + offset, row_bytes, n, tile.data());
    return tile_pairs(type, tile.data(), n, out);
  }
  thread_local std::vector<uint16_t> rows;
  if ((int64_t)rows.size() < kTileRows * n) rows.resize(kTileRows * n);
  for (int64_t j = 0; j < count; ++j) dequantize_row_bf16(type, w + j * row_bytes + offset, rows.data() + j * n, n);
  for (int64_t p0 = 0; p0 < n / 2; p0 += 16)
    transpose_words((const uint8_t*)(rows.data() + 2 * p0), 2 * n, (int)count, 16, out + 16 * p0);
}

// A C tile's 16 x 16 float32 sums (stored at `sums`) -> rows [0, rows) of y (bfloat16, ldy apart), columns
// [0, cols). (The tile is named in the macro's text, so each caller stores its own.)
TM_INLINE void store_bf16_sums(const float* sums, uint16_t* y, int64_t ldy, int rows, int cols) {
  const __mmask16 mask = (__mmask16)((1u << cols) - 1);
  for (int r = 0; r < rows; ++r)
    _mm256_mask_storeu_epi16(y + r * ldy, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sums + 16 * r)));
}

// Input rows a pass over the weights: each pass builds every panel's pairs again (about a tenth of a pass's
// time at 256 rows), and its rows as A tiles stay near the cores while every panel meets them (a whole prompt
// chunk at once gave 1,024-token prompts first tokens 1.09-1.18x later than the dequantized copy and torch's
// GEMM). And elements of k
// a panel takes at a time (its pairs 128 KiB, those columns of 256 rows 1 MiB): longer rows in parts, the
// sums so far kept in float32 between them, so a sum carried on is the sum the tile held.
constexpr int64_t kAmxPairRows = 256, kAmxPairK = 2048;

// At least n elements of v (grown where it is shorter), from its first address on a 64-byte line: tile rows
// that straddle two lines load at half the rate.
template <typename T>
T* line_aligned(std::vector<T>& v, int64_t n) {
  const int64_t extra = 64 / sizeof(T);
  if ((int64_t)v.size() < n + extra) v.resize(n + extra);
  return (T*)(((uintptr_t)v.data() + 63) & ~(uintptr_t)63);
}

// y [M, N] (bfloat16, unit column stride) = x [M, K] (bfloat16) W^T, W tiled or in rows: for every 256 input
// rows, panels of two weight tiles on torch's threads, each panel's pairs built once (by parts of k) and met
// by 32 input rows x 32 weight rows at a time (four C tiles).
inline void amx_pair_product(int type, const uint8_t* w, int64_t row_bytes, int64_t N, const torch::Tensor& x,
                             torch::Tensor& y) {
  const int base = base_type(type);
  const bool tiled = is_tiled(type);
  const int64_t M = x.size(0), K = x.size(1), tiles = (N + kTileRows - 1) / kTileRows, steps = K / 32;
  // parts of k where a part's blocks can be found alone: tiles, and the K formats' rows (GGUF's blocks)
  const int64_t Kc = tiled || k_format(base) ? std::min(K, kAmxPairK) : K, part_pairs = Kc / 2 * 16;
  const torch::Tensor xc = x.contiguous();
  const uint16_t* xs = (const uint16_t*)xc.data_ptr();
  uint16_t* yp = (uint16_t*)y.data_ptr();
  const int64_t ldy = y.stride(0);
  thread_local std::vector<uint16_t> packed;
  thread_local std::vector<float> sums_so_far;  // [256 rows][the panels' 32 columns], between parts of k
  const int64_t most = std::min((M + 15) / 16 * 16, kAmxPairRows), ldp = 32 * ((tiles + 1) / 2);
  uint16_t* xp = line_aligned(packed, most * K);
  float* partial = Kc < K ? line_aligned(sums_so_far, most * ldp) : nullptr;
  for (int64_t r0 = 0; r0 < M; r0 += kAmxPairRows) {
    const int64_t rows = std::min(kAmxPairRows, M - r0), padded = (rows + 15) / 16 * 16;
    // these rows as A tiles: for each 16 rows (zeros past M) and each 32 columns, 1 KiB (a tile's rows 64
    // bytes apart: x's own rows, 2K bytes apart, would all fall in a few sets of L1)
    for_tiles(padded / 16, [&](int64_t mt) {
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t m = mt * 16 + r;
        uint16_t* o = xp + mt * 16 * K + 32 * r;
        for (int64_t s = 0; s < steps; ++s) {
          if (m < rows) std::memcpy(o + 512 * s, xs + (r0 + m) * K + 32 * s, 64);
          else std::memset(o + 512 * s, 0, 64);
        }
      }
    });
    for (int64_t k0 = 0; k0 < K; k0 += Kc) {  // (a part of k for every panel, so that those columns stay in L2)
      const int64_t kn = std::min(Kc, K - k0);
      const bool first = k0 == 0, last = k0 + kn == K;
      for_tiles((tiles + 1) / 2, [&](int64_t p) {
        const int64_t t0 = 2 * p, nt = std::min<int64_t>(2, tiles - t0);
        thread_local std::vector<uint32_t> pairs;  // kept between calls: a fresh one would fault its pages in
        uint32_t* buf = line_aligned(pairs, 2 * part_pairs);
        if (nt == 1) std::memset(buf + part_pairs, 0, part_pairs * 4);  // (B tile 3 multiplies zeros)
        const int cols0 = (int)std::min<int64_t>(16, N - t0 * kTileRows);
        const int cols1 = nt == 2 ? (int)std::min<int64_t>(16, N - (t0 + 1) * kTileRows) : 0;
        const uint32_t* b0 = buf;
        const uint32_t* b1 = buf + part_pairs;
        configure_bf16_tiles();  // per task: other code on this thread (oneDNN's GEMM, the int8 panels) sets its own
        for (int64_t t = 0; t < nt; ++t) {
          const int64_t n0 = (t0 + t) * kTileRows;
          uint32_t* out = buf + t * part_pairs;
          if (tiled) tile_pairs(base, w + n0 * row_bytes + k0 / gguf_block(base).block * tile_block_bytes(base), kn, out);
          else row_pairs(type, w + n0 * row_bytes, row_bytes, std::min<int64_t>(kTileRows, N - n0), k0, kn, out);
        }
        for (int64_t m0 = 0; m0 < padded; m0 += 32) {
          const bool two = m0 + 16 < padded;          // a second A tile of input rows
          const uint16_t* a0 = xp + m0 * K + 16 * k0;  // (A tile of rows m0.. and columns 32 s..: at xp + m0 K + 512 s)
          float* part = partial + m0 * ldp + 32 * p;   // (rows m0.. of the sums so far, this panel's 32 columns)
          if (first) {
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
          } else {
            _tile_loadd(4, part, 4 * ldp);
            _tile_loadd(5, part + 16, 4 * ldp);
            if (two) {
              _tile_loadd(6, part + 16 * ldp, 4 * ldp);
              _tile_loadd(7, part + 16 * ldp + 16, 4 * ldp);
            }
          }
          for (int64_t k = 0; k < kn; k += 32) {
            _tile_loadd(0, a0 + 16 * k, 64);
            _tile_loadd(2, b0 + 8 * k, 64);
            _tile_loadd(3, b1 + 8 * k, 64);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(5, 0, 3);
            if (two) {
              _tile_loadd(1, a0 + 16 * K + 16 * k, 64);
              _tile_dpbf16ps(6, 1, 2);
              _tile_dpbf16ps(7, 1, 3);
            }
          }
          if (!last) {
            _tile_stored(4, part, 4 * ldp);
            _tile_stored(5, part + 16, 4 * ldp);
            if (two) {
              _tile_stored(6, part + 16 * ldp, 4 * ldp);
              _tile_stored(7, part + 16 * ldp + 16, 4 * ldp);
            }
            continue;
          }
          uint16_t* out = yp + (r0 + m0) * ldy + t0 * kTileRows;
          const int rows0 = (int)std::min<int64_t>(16, rows - m0);
          alignas(64) float sums[16 * 16];
          _tile_stored(4, sums, 64);
          store_bf16_sums(sums, out, ldy, rows0, cols0);
          if (cols1) {
            _tile_stored(5, sums, 64);
            store_bf16_sums(sums, out + 16, ldy, rows0, cols1);
          }
          if (two && rows > m0 + 16) {
            const int rows1 = (int)std::min<int64_t>(16, rows - m0 - 16);
            _tile_stored(6, sums, 64);
            store_bf16_sums(sums, out + 16 * ldy, ldy, rows1, cols0);
            if (cols1) {
              _tile_stored(7, sums, 64);
              store_bf16_sums(sums, out + 16 * ldy + 16, ldy, rows1, cols1);
            }
          }
        }
        _tile_release();
      });
    }
  }
  if (sums_so_far.size() > (size_t)(4 << 20)) std::vector<float>().swap(sums_so_far);  // (a large vocabulary's rows: not kept)
}
#endif

// y [M, N] = x [M, K] W^T through tiles of W dequantized to x's dtype (float32 or bfloat16) and torch's
// GEMM: a bfloat16 model's prompt rows meet bfloat16 weights, as with the file dequantized at load, and
// run on the CPU's bfloat16 matrix units (AMX, AVX-512 BF16) where it has them, several times the float32
// rate; float32 models keep the exact dequantized values.
inline void dequantized_product(int type, const uint8_t* w, int64_t row_bytes, int64_t N, const torch::Tensor& x,
                                torch::Tensor& y) {
  const int64_t K = x.size(1);
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
#ifdef TM_PAIRS_AMX
  if (bf16 && y.stride(1) == 1 && amx_usable()) return amx_pair_product(type, w, row_bytes, N, x, y);
#endif
#if defined(TM_QUANT_PAIRS) && !defined(TM_GEMM_AMX)
  // (With AMX's int8 tiles and no bfloat16 ones, torch's GEMM on the dequantized tiles: a prompt of 256 rows
  // took a fifth of the pairs' time.)
  if (bf16 && is_tiled(type) && y.stride(1) == 1) return pair_product(type, w, row_bytes, N, x, y);
#endif
  int64_t tile = std::min<int64_t>(N, std::max<int64_t>(kDequantTileRows, kDequantTileFloats / K));
  if (is_tiled(type)) tile = tile / kTileRows * kTileRows;  // (whole tiles of rows: N is)
  thread_local std::vector<float> scratch;  // kept between calls: a fresh one would fault its pages in
  scratch.resize(bf16 ? (tile * K + 1) / 2 : tile * K);
  void* buf = scratch.data();  // (the worker threads below have row buffers of their own)
  for (int64_t n0 = 0; n0 < N; n0 += tile) {
    const int64_t rows = std::min(tile, N - n0);
    for_tiles((rows + 15) / 16, [&](int64_t t) {
      if (is_tiled(type)) {
        const uint8_t* tw = w + (n0 + t * 16) * row_bytes;
        if (bf16) dequantize_tile(type, tw, K, (uint16_t*)buf + t * 16 * K, K);
        else dequantize_tile(type, tw, K, (float*)buf + t * 16 * K, K);
        return;
      }
      for (int64_t n = t * 16; n < std::min(rows, t * 16 + 16); ++n) {
        if (bf16)
          dequantize_row_bf16(type, w + (n0 + n) * row_bytes, (uint16_t*)buf + n * K, K);
        else
          dequantize_row(type, w + (n0 + n) * row_bytes, (float*)buf + n * K, K);
      }
    });
    auto wt = torch::from_blob(buf, {rows, K}, x.options());
    bucketed_rows(x, y.narrow(1, n0, rows), [&](const torch::Tensor& r) { return at::mm(r, wt.t()); });
  }
}

#ifdef TM_QUANT_AMX
// From this many input rows on (below float_rows_for), the byte products run on AMX tiles (quant_amx.h): a
// tile takes 16 input rows, so fewer would waste most of it on zeros.
constexpr int64_t kAmxRows = 16;

// y [M, N] (rows ldy apart) = x W^T for int8 inputs q [M rounded up to 16, K] (zero rows past M) with block
// scales d and scaled sums s [.., K / 32]: the inputs transposed into B tiles once, then panels of 16 weight
// rows over the threads, each unpacked once into A tiles and multiplied with every 16 input rows.
inline void amx_product(int type, const uint8_t* w, int64_t row_bytes, int64_t N, const int8_t* q, const float* d,
                        const float* s, int64_t M, int64_t K, float* y, int64_t ldy) {
  Inputs inputs;
  inputs.set(q, d, s, M, K);
  const int64_t panels = (N + 15) / 16;
  const int64_t per_task = std::max<int64_t>(1, panels / (8 * std::max(1, at::get_num_threads())));
  for_tiles((panels + per_task - 1) / per_task, [&](int64_t t) {
    configure_tiles(type == Q6_K);  // per task: other code on this thread (oneDNN's GEMM) sets its own
    thread_local Panel panel;
    for (int64_t i = t * per_task; i < std::min(panels, (t + 1) * per_task); ++i) {
      const int64_t n0 = i * 16, cols = std::min<int64_t>(16, N - n0);
      panel.build(type, w + n0 * row_bytes, row_bytes, cols, K);
      for (int64_t m = 0; m < inputs.tiles16; ++m) panel_product(panel, inputs, m, M, y + n0, ldy, cols);
    }
    _tile_release();
  });
}
#endif

// How far ahead (bytes, into L1) block_product asks for the weight rows of a few input rows.
constexpr int64_t kAheadBytes = 4096;

// y [M, N] = x [M, K] W^T, W: N rows of `row_bytes` in block format `type` (quant.h's layout); x float32 or
// bfloat16 (contiguous), y a view of x's dtype (rows may be strided: a merged projection's columns).
// float_inputs: dequantized tiles whatever M (a prompt's rows, quant.py). Call it outside any parallel
// region, without the GIL.
inline void block_product(int type, const uint8_t* w, int64_t row_bytes, int64_t N, const torch::Tensor& x,
                          torch::Tensor y, bool float_inputs = false) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  if (M == 0 || N == 0) return;
  if (float_inputs || M >= float_rows_for(x.scalar_type() == torch::kBFloat16))
    return dequantized_product(type, w, row_bytes, N, x, y);
  const torch::Tensor x32 = x.to(torch::kFloat32).contiguous();
  const float* xp = x32.data_ptr<float>();
  // The products are float32: straight into y where it is float32 with unit column stride, else through a copy.
  const bool direct = y.scalar_type() == torch::kFloat32 && y.stride(1) == 1;
  torch::Tensor y32 = direct ? y : torch::empty({M, N}, x32.options());
  float* yp = y32.data_ptr<float>();
  const int64_t ldy = y32.stride(0);
  const int64_t padded = (M + 15) / 16 * 16;  // whole tiles of input rows for AMX, the rest zeros
  std::vector<int8_t> q(padded * K);
  std::vector<float> d(padded * nb), s(padded * nb);
  std::vector<QRow> rows(M);
  const bool per256 = wants_per256(base_type(type)) && K % QKK == 0;  // (then q, d, s take one scale per 256)
  std::vector<int16_t> sums16(per256 ? M * K / 16 : 0);
  for_tiles((M + 7) / 8, [&](int64_t t) {  // (with float_rows raised, M may be a whole prompt chunk)
    for (int64_t m = t * 8; m < std::min(M, t * 8 + 8); ++m)
      quantize_activation_row(xp + m * K, K, q.data() + m * K, d.data() + m * nb, s.data() + m * nb, per256,
                              per256 ? sums16.data() + m * K / 16 : nullptr);
  });
#ifdef TM_QUANT_AMX
  if (M >= kAmxRows && amx_usable() && amx_format(type)) {
    amx_product(type, w, row_bytes, N, q.data(), d.data(), s.data(), M, K, yp, ldy);
    if (!direct) y.copy_(y32);
    return;
  }
#endif
  if (is_tiled(type)) {  // tiles of 16 weight rows (quant_tiles.h), a few to a task
    for (int64_t m = 0; m < M; ++m) {
      rows[m] = {q.data() + m * K, d.data() + m * nb, s.data() + m * nb};
      if (per256) rows[m].sums16 = sums16.data() + m * K / 16, rows[m].per256 = &rows[m];  // (the K formats')
    }
    const int64_t tiles = N / kTileRows;
    const int64_t per_task = M <= kRowGroup ? std::max<int64_t>(1, tiles / (8 * at::get_num_threads())) : 1;
    for_tiles((tiles + per_task - 1) / per_task, [&](int64_t t) {
      const int64_t n0 = t * per_task * kTileRows, n1 = std::min(N, n0 + per_task * kTileRows);
      tiled_rows(type, w, row_bytes, rows.data(), M, K, n0, n1, [&](int64_t m, int64_t n, float v) { yp[m * ldy + n] = v; },
                 [](int64_t) {});
    });
    if (!direct) y.copy_(y32);
    return;
  }
  std::vector<int8_t> reordered(M * K);  // the K formats' quad order (per256), else the 32-element groups
  for (int64_t m = 0; m < M; ++m) {
    int8_t* r = reordered.data() + m * K;
    rows[m] = {q.data() + m * K, d.data() + m * nb, s.data() + m * nb};
    if (per256) {
      quad_order(q.data() + m * K, K, r);
      rows[m].q4 = r, rows[m].sums16 = sums16.data() + m * K / 16, rows[m].per256 = &rows[m];
    } else {
      group_order(q.data() + m * K, K, r);
      rows[m].qt = r;
    }
  }
  // A few rows: long tiles, so each thread streams long runs of weight rows, asked for at least 4 KiB (and
  // two rows) ahead: short rows (a 640-wide Q8_0 row is 680 bytes) would otherwise leave too few lines in
  // flight. More: tiles of 8 weight rows, which stay in cache while every group of input rows passes over them.
  const int64_t tile = M <= kRowGroup ? std::max<int64_t>(8, N / (16 * at::get_num_threads())) : 8;
  const int64_t ahead_rows = std::max<int64_t>(2, (kAheadBytes + row_bytes - 1) / row_bytes);
  for_tiles((N + tile - 1) / tile, [&](int64_t t) {
    const int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
    float out[2 * kRowGroup];
    auto prefetch = [&](int64_t a) {
      if (a >= n1) return;
      const char* ahead = (const char*)(w + a * row_bytes);
      for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(ahead + off, 0, 3);
    };
    for (int64_t m0 = 0; m0 < M; m0 += kRowGroup) {
      const int g = (int)std::min<int64_t>(kRowGroup, M - m0);
      int64_t n = n0;
      if (pairs_rows(type)) {  // two weight rows at a time (dot_rows2), then the last one alone
        for (; n + 1 < n1; n += 2) {
          prefetch(n + ahead_rows), prefetch(n + ahead_rows + 1);
          dot_rows2(type, w + n * row_bytes, w + (n + 1) * row_bytes, rows.data() + m0, g, K, out);
          for (int r = 0; r < g; ++r) yp[(m0 + r) * ldy + n] = out[r], yp[(m0 + r) * ldy + n + 1] = out[kRowGroup + r];
        }
      }
      for (; n < n1; ++n) {
        prefetch(n + ahead_rows);
        dot_rows(type, w + n * row_bytes, rows.data() + m0, g, K, out);
        for (int r = 0; r < g; ++r) yp[(m0 + r) * ldy + n] = out[r];
      }
    }
  });
  if (!direct) y.copy_(y32);
}

}  // namespace tmq
