// The engine's two layouts of Q8_0 and Q4_1 weights, one thread, without the engine around them: rows as
// quant.h lays them out (a vector's lanes are 16 blocks of one row, each row summed across its lanes), and
// rows interleaved by 16 as quant_tiles.h lays them out (lanes are 16 weight rows: see that file), the
// layout the engine now takes for such matrices where the CPU has AVX-512 VNNI.
//
// Built and run by benchmarks/interleaved_rows.py (g++ -O3 -march=native; AVX-512 VNNI needed).
#include "quant_tiles.h"

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

// y[m][n] for M input rows (at most 8) and all N weight rows (N a multiple of 16), tiled layout, through
// the engine's tiled_rows (4 input rows a pass over each tile; no prefetching).
void interleaved_product(int type, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, const QRow* x, int M,
                         float* y) {
  tiled_rows(type | kTiled, w, row_bytes, x, M, K, 0, N, [&](int64_t m, int64_t n, float v) { y[m * N + n] = v; },
             [](int64_t) {});
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
      : type(type_), K(K_), N(N_ / kTileRows * kTileRows), nb(K_ / QK) {
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
    for (int64_t t = 0; t < N / kTileRows; ++t)
      tile_from_gguf(type, &gguf[t * kTileRows * row_bytes], row_bytes, nb, &inter[t * kTileRows * row_bytes]);
  }
};

constexpr int kMaxRows = 8;

// kMaxRows random activation rows of width K, quantized as the engine quantizes them, for both kernels.
struct Activations {
  std::vector<int8_t> q, qt;
  std::vector<float> d, s;
  QRow rows[kMaxRows];
  Activations(int64_t K, std::mt19937& rng) : q(kMaxRows * K), qt(kMaxRows * K), d(kMaxRows * K / QK), s(kMaxRows * K / QK) {
    const int64_t nb = K / QK;
    std::vector<float> xf(kMaxRows * K);
    for (auto& v : xf) v = std::normal_distribution<float>()(rng);
    for (int r = 0; r < kMaxRows; ++r) {
      quantize_activation_row(&xf[r * K], K, &q[r * K], &d[r * nb], &s[r * nb]);
      group_order(&q[r * K], K, &qt[r * K]);
      rows[r] = {&q[r * K], &d[r * nb], &s[r * nb]};
      rows[r].qt = &qt[r * K];
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
        for (const Weights& w : ws)
          interleaved_product(w.type, w.inter.data(), w.row_bytes, w.N, w.K, (w.K == 576 ? a576 : a1536).rows, M, y.data());
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
    const double ti = median_time([&] { interleaved_product(type, w.inter.data(), w.row_bytes, w.N, w.K, act.rows, M, y2.data()); });
    double diff = 0, scale = 0;
    for (int64_t i = 0; i < M * w.N; ++i)
      diff = std::max(diff, (double)std::fabs(y1[i] - y2[i])), scale = std::max(scale, (double)std::fabs(y1[i]));
    std::printf("%s %ld x %ld, %d input row(s), 1 thread: engine layout %.1f us (%.2f ns a weight row), "
                "interleaved %.1f us (%.2f ns), %.2fx; largest difference %.1e of %.1e\n",
                argv[1], (long)w.N, (long)w.K, M, te * 1e6, te * 1e9 / w.N, ti * 1e6, ti * 1e9 / w.N, te / ti, diff, scale);
  }
  return 0;
}
