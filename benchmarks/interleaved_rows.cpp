// A measured prototype, not the engine's kernel: Q8_0 and Q4_1 weight rows stored interleaved by 16, so
// that a vector's 16 int32 lanes are 16 weight rows, against the kernels in tokenmill/kernels/quant.h
// (the rows as the engine repacks them: lanes are 16 blocks of one row, each row summed across its lanes).
//
// Interleaved layout, per tile of 16 weight rows and per 32-element block b of them:
//   Q8_0  [16 float16 scales d] [8 x 64 bytes: word t of row j (its elements 4t..4t+3, as q + 128) at 64t + 4j]
//   Q4_1  [16 float16 scales d] [16 float16 offsets m] [4 x 64 bytes: word t of row j's codes at 64t + 4j]
//         (a Q4_1 code byte i holds element i in its low nibble and i + 16 in its high one, as GGUF has it)
// the same bytes as the 16 rows' blocks. An input row's 4-byte word is broadcast to every lane, so one
// vpdpbusd takes 4 values of 16 weight rows; a block's int32 sums are converted and scaled once for 16
// rows, and no row ends in a horizontal sum. With R input rows each weight vector serves R products.
//
// Built and run by benchmarks/interleaved_rows.py (g++ -O3 -march=native; AVX-512 VNNI needed).
#include "quant.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

using namespace tmq;

namespace {

constexpr int kTile = 16;

struct Inputs {  // R activation rows quantized as the engine does (int8 blocks of 32, scales, block sums)
  const int8_t* q[8];
  const float* d[8];
  const float* s[8];
};

// 16 weight rows (one tile) against R input rows from r0 on: y[r * ldy + j] for weight row j of the tile.
template <int R, bool Q8>
__attribute__((noinline)) void tile_product(const uint8_t* tile, int64_t nb, const Inputs& x, int r0, float* y, int64_t ldy) {
  constexpr int64_t head = Q8 ? 32 : 64, block = head + kTile * (Q8 ? 32 : 16);  // scales (and offsets), codes
  const __m512i m4 = _mm512_set1_epi8(0xF);
  __m512 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + b * block;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
    const uint8_t* w = blk + head;
    __m512i s0[R], s1[R];
    for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) {
      // Two code vectors and the input words they multiply: Q8_0 words 2t and 2t + 1 (elements 8t..8t + 7);
      // Q4_1 one vector's low nibbles (word t, elements 4t..) and high ones (word 4 + t, elements 16 + 4t..).
      __m512i c0, c1;
      int i0, i1;
      if constexpr (Q8) {
        c0 = _mm512_loadu_si512(w + 128 * t), c1 = _mm512_loadu_si512(w + 128 * t + 64), i0 = 2 * t, i1 = 2 * t + 1;
      } else {
        const __m512i v = _mm512_loadu_si512(w + 64 * t);
        c0 = _mm512_and_si512(v, m4), c1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4), i0 = t, i1 = 4 + t;
      }
      for (int r = 0; r < R; ++r) {
        const int32_t* xw = (const int32_t*)(x.q[r0 + r] + b * QK);
        s0[r] = _mm512_dpbusd_epi32(s0[r], c0, _mm512_set1_epi32(xw[i0]));
        s1[r] = _mm512_dpbusd_epi32(s1[r], c1, _mm512_set1_epi32(xw[i1]));
      }
    }
    for (int r = 0; r < R; ++r) {  // d dx sum(c x), plus the offset through the block sums s: Q8_0's -128 d s
      const __m512 p = _mm512_cvtepi32_ps(_mm512_add_epi32(s0[r], s1[r]));  // (the codes are q + 128), Q4_1's m s
      acc[r] = _mm512_fmadd_ps(p, _mm512_mul_ps(dw, _mm512_set1_ps(x.d[r0 + r][b])), acc[r]);
      if constexpr (Q8)
        off[r] = _mm512_fmadd_ps(dw, _mm512_set1_ps(-128.f * x.s[r0 + r][b]), off[r]);
      else
        off[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32))),
                                 _mm512_set1_ps(x.s[r0 + r][b]), off[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, _mm512_add_ps(acc[r], off[r]));
}

template <bool Q8>
void tile_rows(int g, const uint8_t* tile, int64_t nb, const Inputs& x, int r0, float* y, int64_t ldy) {
  switch (g) {
    case 1: return tile_product<1, Q8>(tile, nb, x, r0, y, ldy);
    case 2: return tile_product<2, Q8>(tile, nb, x, r0, y, ldy);
    case 3: return tile_product<3, Q8>(tile, nb, x, r0, y, ldy);
    default: return tile_product<4, Q8>(tile, nb, x, r0, y, ldy);
  }
}

// y[m][n] for M input rows (at most 8) and all N weight rows (N a multiple of 16), interleaved layout.
void interleaved_product(int type, const uint8_t* w, int64_t N, int64_t nb, const Inputs& x, int M, float* y) {
  const int64_t tile_bytes = nb * (type == Q8_0 ? 544 : 320);
  for (int64_t t = 0; t < N / kTile; ++t) {
    const uint8_t* tile = w + t * tile_bytes;
    for (int r0 = 0; r0 < M; r0 += 4) {
      const int g = std::min(4, M - r0);
      float* out = y + r0 * N + t * kTile;
      if (type == Q8_0) tile_rows<true>(g, tile, nb, x, r0, out, N);
      else tile_rows<false>(g, tile, nb, x, r0, out, N);
    }
  }
}

// The same product through quant.h's kernels on the engine's layout (two weight rows a pass, up to 4 input
// rows a pass, as the engine's module path takes them; prefetching left out on both sides).
void engine_product(int type, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const QRow* x, int M, float* y) {
  float out[2 * kRowGroup];
  for (int m0 = 0; m0 < M; m0 += kRowGroup) {
    const int g = std::min<int>(kRowGroup, M - m0);
    for (int64_t n = 0; n + 1 < N; n += 2) {
      dot_rows2(type, w + n * row_bytes, w + (n + 1) * row_bytes, x + m0, g, K, out);
      for (int r = 0; r < g; ++r) y[(m0 + r) * N + n] = out[r], y[(m0 + r) * N + n + 1] = out[kRowGroup + r];
    }
  }
}

// One matrix of random blocks (finite scales and offsets around 0.01) in both layouts.
struct Weights {
  int type;
  int64_t K, N, nb, row_bytes;
  std::vector<uint8_t> engine, inter;
  Weights(int type_, int64_t K_, int64_t N_, std::mt19937& rng)
      : type(type_), K(K_), N(N_ / kTile * kTile), nb(K_ / QK) {
    const int64_t gguf_block = type == Q8_0 ? 34 : 20;
    row_bytes = nb * gguf_block;
    std::vector<uint8_t> gguf(N * row_bytes);
    for (auto& v : gguf) v = (uint8_t)rng();
    for (int64_t n = 0; n < N; ++n)
      for (int64_t b = 0; b < nb; ++b)
        for (int h = 0; h < (type == Q8_0 ? 1 : 2); ++h) {
          const uint16_t v = (uint16_t)(0x2000 + rng() % 1024) | (h && rng() % 2 ? 0x8000 : 0);
          std::memcpy(&gguf[n * row_bytes + b * gguf_block + 2 * h], &v, 2);
        }
    engine.resize(N * row_bytes), inter.resize(N * row_bytes);
    for (int64_t n = 0; n < N; ++n) repack_row(type, &gguf[n * row_bytes], &engine[n * row_bytes], K);
    const int64_t head = type == Q8_0 ? 2 : 4, codes = type == Q8_0 ? 32 : 16, tblock = 16 * gguf_block;
    for (int64_t t = 0; t < N / kTile; ++t)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* blk = &inter[(t * nb + b) * tblock];
        for (int j = 0; j < kTile; ++j) {
          const uint8_t* g = &gguf[(t * kTile + j) * row_bytes + b * gguf_block];
          std::memcpy(blk + 2 * j, g, 2);                             // d
          if (type == Q4_1) std::memcpy(blk + 32 + 2 * j, g + 2, 2);  // m
          for (int64_t i = 0; i < codes; ++i)
            blk[16 * head + 64 * (i / 4) + 4 * j + i % 4] = (uint8_t)(g[head + i] + (type == Q8_0 ? 128 : 0));
        }
      }
  }
};

constexpr int kMaxRows = 8;

// kMaxRows random activation rows of width K, quantized as the engine quantizes them, for both kernels.
struct Activations {
  std::vector<int8_t> q, qt;
  std::vector<float> d, s;
  QRow rows[kMaxRows];
  Inputs x;
  Activations(int64_t K, std::mt19937& rng) : q(kMaxRows * K), qt(kMaxRows * K), d(kMaxRows * K / QK), s(kMaxRows * K / QK) {
    const int64_t nb = K / QK;
    std::vector<float> xf(kMaxRows * K);
    for (auto& v : xf) v = std::normal_distribution<float>()(rng);
    for (int r = 0; r < kMaxRows; ++r) {
      quantize_activation_row(&xf[r * K], K, &q[r * K], &d[r * nb], &s[r * nb]);
      group_order(&q[r * K], K, &qt[r * K]);
      rows[r] = {&q[r * K], &d[r * nb], &s[r * nb]};
      rows[r].qt = &qt[r * K];
      x.q[r] = &q[r * K], x.d[r] = &d[r * nb], x.s[r] = &s[r * nb];
    }
  }
};

template <typename F>
double median_time(F&& fn) {  // median of 7 timings of enough calls for ~0.1 s each
  fn();
  auto t0 = std::chrono::steady_clock::now();
  fn();
  const double once = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int reps = std::max(1, (int)(0.1 / std::max(once, 1e-7)));
  std::vector<double> times;
  for (int i = 0; i < 7; ++i) {
    t0 = std::chrono::steady_clock::now();
    for (int j = 0; j < reps; ++j) fn();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps);
  }
  std::sort(times.begin(), times.end());
  return times[3];
}

int usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s q8_0|q4_1 K N INPUT_ROWS...\n       %s step INPUT_ROWS...\n", argv0, argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::mt19937 rng(1);
  if (argc >= 3 && std::string(argv[1]) == "step") {
    // Every product of one decode step of the default model's shapes, one after another from memory (30
    // layers of Q4_1 q, k, v, o, gate, up, down, then the 49152 x 576 Q8_0 output layer: 96 MB).
    struct Shape { int type; int64_t K, N; };
    std::vector<Shape> layer = {{Q4_1, 576, 576}, {Q4_1, 576, 192}, {Q4_1, 576, 192}, {Q4_1, 576, 576},
                                {Q4_1, 576, 1536}, {Q4_1, 576, 1536}, {Q4_1, 1536, 576}};
    std::vector<Weights> ws;
    for (int l = 0; l < 30; ++l)
      for (const Shape& s : layer) ws.emplace_back(s.type, s.K, s.N, rng);
    ws.emplace_back(Q8_0, 576, 49152, rng);
    Activations a576(576, rng), a1536(1536, rng);
    std::vector<float> y(kMaxRows * 49152);
    double base1 = 0, inter1 = 0;
    for (int a = 2; a < argc; ++a) {
      const int M = std::min(kMaxRows, std::atoi(argv[a]));
      const double te = median_time([&] {
        for (const Weights& w : ws)
          engine_product(w.type, w.engine.data(), w.row_bytes, w.N, w.K, (w.K == 576 ? a576 : a1536).rows, M, y.data());
      });
      const double ti = median_time([&] {
        for (const Weights& w : ws) interleaved_product(w.type, w.inter.data(), w.N, w.nb, (w.K == 576 ? a576 : a1536).x, M, y.data());
      });
      if (a == 2) base1 = te, inter1 = ti;
      std::printf("default model's step, %d input row(s), 1 thread: engine layout %.2f ms (%.2fx its first count), "
                  "interleaved %.2f ms (%.2fx), %.2fx\n", M, te * 1e3, te / base1, ti * 1e3, ti / inter1, te / ti);
    }
    return 0;
  }
  if (argc < 5) return usage(argv[0]);
  const int type = std::string(argv[1]) == "q8_0" ? Q8_0 : std::string(argv[1]) == "q4_1" ? Q4_1 : -1;
  if (type < 0) return usage(argv[0]);
  const Weights w(type, std::atol(argv[2]), std::atol(argv[3]), rng);
  Activations act(w.K, rng);
  std::vector<float> y1(kMaxRows * w.N), y2(kMaxRows * w.N);
  for (int a = 4; a < argc; ++a) {
    const int M = std::min(kMaxRows, std::atoi(argv[a]));
    const double te = median_time([&] { engine_product(type, w.engine.data(), w.row_bytes, w.N, w.K, act.rows, M, y1.data()); });
    const double ti = median_time([&] { interleaved_product(type, w.inter.data(), w.N, w.nb, act.x, M, y2.data()); });
    double diff = 0, scale = 0;
    for (int64_t i = 0; i < M * w.N; ++i)
      diff = std::max(diff, (double)std::fabs(y1[i] - y2[i])), scale = std::max(scale, (double)std::fabs(y1[i]));
    std::printf("%s %ld x %ld, %d input row(s), 1 thread: engine layout %.1f us (%.2f ns a weight row), "
                "interleaved %.1f us (%.2f ns), %.2fx; largest difference %.1e of %.1e\n",
                argv[1], (long)w.N, (long)w.K, M, te * 1e6, te * 1e9 / w.N, ti * 1e6, ti * 1e9 / w.N, te / ti, diff, scale);
  }
  return 0;
}
