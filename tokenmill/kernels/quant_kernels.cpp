// Products with quantized weights (quant.h): y[M, N] = x[M, K] W^T for W in a GGUF block format.
//
// The same entry serves decode (a few rows: a GEMV bound by the weight stream) and prompt chunks (a
// dequantized tile of weight rows times torch's GEMM); quant_product.h chooses. Every entry point releases
// the GIL.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "quant_fit.h"
#include "quant_product.h"

namespace {

tmq::Format checked_format(int64_t type, int64_t K, const torch::Tensor& w) {
  tmq::Format f;
  TORCH_CHECK(tmq::kernel_format_of((int)type, f), "quantized weight type ", type, " has no kernel");
  TORCH_CHECK(K > 0 && K % f.block == 0, "row length ", K, " is not a multiple of the block size ", f.block);
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(),
              "quantized weight must be a contiguous uint8 CPU tensor [rows, bytes per row]");
  TORCH_CHECK(w.size(1) == K / f.block * f.bytes, "quantized weight rows hold ", w.size(1), " bytes, expected ",
              K / f.block * f.bytes, " for ", K, " elements");
  TORCH_CHECK(!tmq::is_tiled((int)type) || w.size(0) % tmq::kTileRows == 0, "a matrix of rows interleaved by ",
              tmq::kTileRows, " has whole tiles of rows, not ", w.size(0));
  return f;
}

}  // namespace

// x [M, K] float32 or bfloat16; w [N, bytes per row] uint8 -> y [M, N] in x's dtype. float_inputs: the
// dequantized-tile path whatever M.
torch::Tensor qmatmul(const torch::Tensor& x_in, const torch::Tensor& w, int64_t type, int64_t K, bool float_inputs) {
  checked_format(type, K, w);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "activation must be [M, ", K, "]");
  TORCH_CHECK(x_in.dtype() == torch::kFloat32 || x_in.dtype() == torch::kBFloat16, "activation must be float32 or bfloat16");
  torch::Tensor x = x_in.contiguous();
  torch::Tensor y = torch::empty({x.size(0), w.size(0)}, x.options());
  {
    pybind11::gil_scoped_release nogil;
    tmq::block_product((int)type, w.data_ptr<uint8_t>(), w.size(1), w.size(0), x, y, float_inputs);
  }
  return y;
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
      std::vector<uint8_t> buf;
      for (int64_t i = i0; i < i1; ++i)
        tmq::dequantize_row(tmq::base_type((int)type), tmq::row_layout((int)type, wp, row_bytes, all ? i : ip[i], K, buf),
                            yp + i * K, K);
    });
  }
  return y;
}

// GGUF blocks [N, bytes per row] -> the same bytes in the kernel's layout of `type`: quant.h's rows, or
// (type with tmq::kTiled) quant_tiles.h's tiles of 16 rows.
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
    if (tmq::is_tiled((int)type)) {
      TORCH_CHECK(blocks.data_ptr() != out.data_ptr(), "tiles are not repacked in place");
      const int64_t tile_bytes = tmq::kTileRows * row_bytes;
      at::parallel_for(0, N / tmq::kTileRows, 16, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
          tmq::tile_from_gguf(tmq::base_type((int)type), in + t * tile_bytes, row_bytes, K, o + t * tile_bytes);
      });
    } else {
      at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) tmq::repack_row((int)type, in + n * row_bytes, o + n * row_bytes, K);
      });
    }
  }
  return out;
}

// Groups g [G, n] float32 -> (d, m) [G] float16 and codes [G, n] uint8: each group's affine grid and its
// weights' codes on it (quant_fit.h). importance [n] and steps [search] float32 (importance empty: all 1).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> fit_affine(const torch::Tensor& g_in, int64_t top, int64_t iterations,
                                                    const torch::Tensor& importance, const torch::Tensor& steps_in) {
  TORCH_CHECK(g_in.dim() == 2 && g_in.size(1) > 0 && g_in.size(1) <= tmq::AffineFit::kMaxGroup,
              "groups must be [G, n] with n in 1..", tmq::AffineFit::kMaxGroup);
  TORCH_CHECK(top > 0 && top < 256, "a grid of 2 to 256 levels, not ", top + 1);
  const int n = (int)g_in.size(1);
  const torch::Tensor g = g_in.to(torch::kFloat32).contiguous();
  const torch::Tensor c = importance.numel() ? importance.to(torch::kFloat32).contiguous() : torch::ones({n});
  TORCH_CHECK(c.numel() == n, "importance has ", c.numel(), " elements for groups of ", n);
  const torch::Tensor steps = steps_in.to(torch::kFloat32).contiguous();
  torch::Tensor d = torch::empty({g.size(0)}), m = torch::empty({g.size(0)});
  torch::Tensor codes = torch::empty({g.size(0), n}, torch::kUInt8);
  {
    py::gil_scoped_release release;
    tmq::fit_affine_groups(g.data_ptr<float>(), g.size(0), n, (int)top, (int)iterations, c.data_ptr<float>(),
                           steps.data_ptr<float>(), (int)steps.numel(), d.data_ptr<float>(), m.data_ptr<float>(),
                           codes.data_ptr<uint8_t>());
  }
  return {d.to(torch::kFloat16), m.to(torch::kFloat16), codes};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmatmul", &qmatmul, "x [M, K] @ W^T for a block-quantized W [N, bytes per row]", py::arg("x"), py::arg("w"),
        py::arg("type"), py::arg("K"), py::arg("float_inputs") = false);
  m.def("repack", &repack, "GGUF blocks into the kernel's layout of the same bytes", py::arg("blocks"),
        py::arg("type"), py::arg("K"), py::arg("out") = py::none());
  m.def("dequantize", &dequantize, "rows of a block-quantized matrix as float32");
  m.def("fit_affine", &fit_affine, "each group's affine grid d q + m, q in 0..top (float16 d and m), and its codes", py::arg("groups"),
        py::arg("top"), py::arg("iterations"), py::arg("importance"), py::arg("steps"));
  m.attr("tiled") = tmq::kTiled;  // the flag of a type id whose matrix has rows interleaved by 16
  m.def("float_rows", [](bool bf16) { return tmq::float_rows_for(bf16); }, py::arg("bfloat16") = false,
        "input rows (float32, or bfloat16) from which products dequantize + GEMM");
  m.def("set_float_rows", [](int64_t n) { tmq::float_rows.store(std::max<int64_t>(0, n)); },
        "one count for both dtypes; 0: the defaults");
#ifdef TM_QUANT_AVX512
  m.attr("vectorized") = true;
#else
  m.attr("vectorized") = false;
#endif
#ifdef TM_QUANT_VNNI
  m.attr("vnni") = true;  // the byte products take AVX-512 VNNI's vpdpbusd
#else
  m.attr("vnni") = false;
#endif
#ifdef TM_QUANT_AMX
  m.attr("amx") = tmq::amx_usable();  // products of 16 rows or more run on AMX's int8 tiles
#else
  m.attr("amx") = false;
#endif
#ifdef TM_PAIRS_AMX
  m.attr("amx_pairs") = tmq::amx_usable();  // bfloat16 prompt rows meet the weights' pairs on AMX's bfloat16 tiles
#else
  m.attr("amx_pairs") = false;
#endif
}
