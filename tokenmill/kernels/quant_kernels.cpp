// Products with quantized weights (quant.h): y[M, N] = x[M, K] W^T for W in a GGUF block format.
//
// The same entry serves decode (M = a few rows: a GEMV bound by the weight stream) and prompt chunks (M in
// the hundreds: the weight tile stays in cache while every activation row passes over it). Work is split
// into tiles of weight rows that the threads take from a shared counter, so a thread that the OS
// deschedules (another process on the core) delays only the tile it holds, not a fixed half of the matrix.
// Every entry point releases the GIL.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "quant.h"

namespace {

constexpr int64_t kTileRows = 8;   // weight rows per work item

tmq::Format checked_format(int64_t type, int64_t K, const torch::Tensor& w) {
  tmq::Format f;
  TORCH_CHECK(tmq::format_of((int)type, f), "quantized weight type ", type, " has no kernel");
  TORCH_CHECK(K > 0 && K % f.block == 0, "row length ", K, " is not a multiple of the block size ", f.block);
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(),
              "quantized weight must be a contiguous uint8 CPU tensor [rows, bytes per row]");
  TORCH_CHECK(w.size(1) == K / f.block * f.bytes, "quantized weight rows hold ", w.size(1), " bytes, expected ",
              K / f.block * f.bytes, " for ", K, " elements");
  return f;
}

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

}  // namespace

// x [M, K] float32 or bfloat16; w [N, bytes per row] uint8 -> y [M, N] in x's dtype.
torch::Tensor qmatmul(const torch::Tensor& x_in, const torch::Tensor& w, int64_t type, int64_t K) {
  checked_format(type, K, w);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "activation must be [M, ", K, "]");
  TORCH_CHECK(x_in.dtype() == torch::kFloat32 || x_in.dtype() == torch::kBFloat16, "activation must be float32 or bfloat16");
  torch::Tensor x = x_in.to(torch::kFloat32).contiguous();
  const int64_t M = x.size(0), N = w.size(0), nb = K / tmq::QK;
  torch::Tensor y = torch::empty({M, N}, torch::kFloat32);
  if (M == 0 || N == 0) return y.to(x_in.dtype());
  {
    pybind11::gil_scoped_release nogil;
    std::vector<int8_t> q(M * K);
    std::vector<float> d(M * nb), s(M * nb);
    const float* xp = x.data_ptr<float>();
    for_tiles((M + 15) / 16, [&](int64_t t) {
      for (int64_t m = t * 16; m < std::min(M, t * 16 + 16); ++m)
        tmq::quantize_activation_row(xp + m * K, K, q.data() + m * K, d.data() + m * nb, s.data() + m * nb);
    });
    std::vector<tmq::QRow> rows(M);
    for (int64_t m = 0; m < M; ++m) rows[m] = {q.data() + m * K, d.data() + m * nb, s.data() + m * nb};
    const uint8_t* wp = w.data_ptr<uint8_t>();
    const int64_t row_bytes = w.size(1);
    float* yp = y.data_ptr<float>();
    // Decode (few rows): long tiles, so each thread streams long runs of weight rows; prompt chunks:
    // short ones, whose weights stay in cache while every activation row passes over them.
    const int64_t tile = M <= tmq::kRowGroup ? std::max<int64_t>(kTileRows, N / (16 * at::get_num_threads())) : kTileRows;
    for_tiles((N + tile - 1) / tile, [&](int64_t t) {
      const int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
      float out[tmq::kRowGroup];
      for (int64_t m0 = 0; m0 < M; m0 += tmq::kRowGroup) {
        const int g = (int)std::min<int64_t>(tmq::kRowGroup, M - m0);
        for (int64_t n = n0; n < n1; ++n) {
          if (n + 2 < n1) {  // the weight stream two rows ahead
            const char* ahead = (const char*)(wp + (n + 2) * row_bytes);
            for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(ahead + off, 0, 3);
          }
          tmq::dot_rows((int)type, wp + n * row_bytes, rows.data() + m0, g, K, out);
          for (int r = 0; r < g; ++r) yp[(m0 + r) * N + n] = out[r];
        }
      }
    });
  }
  return x_in.dtype() == torch::kFloat32 ? y : y.to(x_in.dtype());
}

// The float32 values of rows `ids` of w (all rows when ids is empty): embedding lookups and the reference.
torch::Tensor dequantize(const torch::Tensor& w, int64_t type, int64_t K, const torch::Tensor& ids_in) {
  checked_format(type, K, w);
  const bool all = ids_in.numel() == 0;
  torch::Tensor ids = all ? ids_in : ids_in.to(torch::kInt64).contiguous();
  const int64_t n = all ? w.size(0) : ids.numel(), N = w.size(0);
  const int64_t* ip = all ? nullptr : ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < (all ? 0 : n); ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "row ", ip[i], " is out of range for ", N, " rows");
  torch::Tensor y = torch::empty({n, K}, torch::kFloat32);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  float* yp = y.data_ptr<float>();
  {
    pybind11::gil_scoped_release nogil;
    at::parallel_for(0, n, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i)
        tmq::dequantize_row((int)type, wp + (all ? i : ip[i]) * row_bytes, yp + i * K, K);
    });
  }
  return y;
}

// GGUF blocks [N, bytes per row] -> the same bytes in the kernel's layout (quant.h).
torch::Tensor repack(const torch::Tensor& blocks, int64_t type, int64_t K, std::optional<torch::Tensor> out_) {
  checked_format(type, K, blocks);
  torch::Tensor out = out_.has_value() ? *out_ : torch::empty_like(blocks);
  checked_format(type, K, out);
  TORCH_CHECK(out.sizes() == blocks.sizes(), "repack output must have the input's shape");
  const int64_t N = blocks.size(0), row_bytes = blocks.size(1);
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  {
    pybind11::gil_scoped_release nogil;
    at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) tmq::repack_row((int)type, in + n * row_bytes, o + n * row_bytes, K);
    });
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmatmul", &qmatmul, "x [M, K] @ W^T for a block-quantized W [N, bytes per row]");
  m.def("repack", &repack, "GGUF blocks into the kernel's layout of the same bytes", py::arg("blocks"),
        py::arg("type"), py::arg("K"), py::arg("out") = py::none());
  m.def("dequantize", &dequantize, "rows of a block-quantized matrix as float32");
#ifdef TM_QUANT_AVX512
  m.attr("vectorized") = true;
#else
  m.attr("vectorized") = false;
#endif
}
