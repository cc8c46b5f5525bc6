// Fitting an affine 4-bit grid to groups of weights: w ~ d q + m, q in 0..top, d and m in float16 as Q4_1
// stores them (kernels/quant.py, `_fit_affine`, which documents the method). In C++ because a load
// quantizes every weight of the model this way: as whole-tensor torch operations, the fit of a 1.17B model's
// groups took 62.6 s on 2 cores, the search over starting grids (below) five times that.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace tmq {

inline float half_rounded(float v) { return static_cast<float>(c10::Half(v)); }

inline float round_even(float v) {
#if defined(__GNUC__)
  return __builtin_roundevenf(v);  // (vectorizes; std::nearbyint reads the rounding mode)
#else
  return std::nearbyint(v);
#endif
}

// One group of n weights g (importance c: each weight's share of the squared error; cn their sum): its d
// and m (float16 values). steps: the starting grids' step counts over the group's range (search of them).
class AffineFit {
 public:
  static constexpr int kMaxGroup = 256;

  AffineFit(const float* g, const float* c, float cn, int n, int top) : g_(g), c_(c), cn_(cn), n_(n), top_(top) {
    sw_ = 0;
    for (int j = 0; j < n; ++j) sw_ += c[j] * g[j];
  }

  void fit(int iterations, const float* steps, int search, float& d_out, float& m_out) {
    float lo = g_[0], hi = g_[0];
    for (int j = 1; j < n_; ++j) lo = std::min(lo, g_[j]), hi = std::max(hi, g_[j]);
    float best_d = half_rounded((hi - lo) / top_), best_m = half_rounded(lo);
    float q[kMaxGroup], trial[kMaxGroup];
    float best = error(best_d, best_m, q);
    if (search) {
      const float span = std::max(hi - lo, 1e-30f);
      for (int s = 0; s < search; ++s) {
        const float r = steps[s] / span;
        for (int j = 0; j < n_; ++j) trial[j] = std::clamp(round_even((g_[j] - lo) * r), 0.0f, (float)top_);
        float d, m;
        refit(trial, best_d, d, m);
        const float err = error(d, m, trial);
        if (err < best) {
          best = err, best_d = d, best_m = m;
          std::copy(trial, trial + n_, q);
        }
      }
    }
    for (int i = 0; i < iterations; ++i) {
      float d, m;
      refit(q, best_d, d, m);
      const float err = error(d, m, q);
      if (err < best) best = err, best_d = d, best_m = m;
    }
    d_out = best_d, m_out = best_m;
  }

 private:
  // The weighted squared error of the grid (d, m), its codes (rounded to nearest, all 0 where d is 0) into q.
  float error(float d, float m, float* q) const {
    const float inv = d > 0 ? 1.0f / d : 0.0f;
    float e = 0;
    for (int j = 0; j < n_; ++j) {
      q[j] = std::clamp(round_even((g_[j] - m) * inv), 0.0f, (float)top_);
      const float r = q[j] * d + m - g_[j];
      e += c_[j] * (r * r);
    }
    return e;
  }

  // d and m by weighted least squares for codes q (d: fallback where the codes are all equal; at least 0).
  void refit(const float* q, float fallback, float& d, float& m) const {
    float sq = 0, sqq = 0, sqw = 0;
    for (int j = 0; j < n_; ++j) {
      const float cq = c_[j] * q[j];
      sq += cq, sqq += cq * q[j], sqw += cq * g_[j];
    }
    const float den = cn_ * sqq - sq * sq;
    const float df = std::max(den > 0 ? (cn_ * sqw - sq * sw_) / std::max(den, 1e-30f) : fallback, 0.0f);
    d = half_rounded(df), m = half_rounded((sw_ - df * sq) / cn_);
  }

  const float* g_;
  const float* c_;
  float cn_, sw_;
  int n_, top_;
};

// Groups g [G, n] (float32, contiguous) -> d, m [G] (float16 values, as float) on torch's threads.
inline void fit_affine_groups(const float* g, int64_t groups, int n, int top, int iterations, const float* c,
                              const float* steps, int search, float* d, float* m) {
  float cn = 0;
  for (int j = 0; j < n; ++j) cn += c[j];
  at::parallel_for(0, groups, 256, [&](int64_t g0, int64_t g1) {
    for (int64_t i = g0; i < g1; ++i) AffineFit(g + i * n, c, cn, n, top).fit(iterations, steps, search, d[i], m[i]);
  });
}

}  // namespace tmq
