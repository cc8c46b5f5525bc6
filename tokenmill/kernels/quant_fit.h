// Fitting an affine 4-bit grid to groups of weights: w ~ d q + m, q in 0..top, d and m in float16 as Q4_1
// stores them (kernels/quant.py, `_fit_affine`, which documents the method). In C++ because a load
// quantizes every weight of the model this way: as whole-tensor torch operations, the fit of a 1.17B model's
// groups took 62.6 s on 2 cores, the search over starting grids (below) five times that.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <memory>

namespace tmq {

inline float half_rounded(float v) { return static_cast<float>(c10::Half(v)); }

// A code: v rounded to nearest (ties to even), clamped to 0..top. By adding and taking away 1.5 * 2^23 (the
// sum's float has no bits below 1, so the addition rounds), on v clamped first to -1..top + 1: one
// vectorized add and subtract, where a rounding call would not vectorize.
inline float code_of(float v, float top) {
  constexpr float kMagic = 12582912.0f;
  const float r = (std::clamp(v, -1.0f, top + 1.0f) + kMagic) - kMagic;
  return std::clamp(r, 0.0f, top);
}

// kLanes groups of n weights at once, one group to a vector lane (every loop below runs over the lanes, so
// the compiler vectorizes it, and no sum is taken across a vector): each group's d and m, float16 values.
// g: the groups' weights, group after group; c: each weight's share of the squared error (the same for all
// groups), cn their sum; steps: the step counts of the `search` starting grids over each group's range.
class AffineFit {
 public:
  static constexpr int kMaxGroup = 256, kLanes = 16;

  AffineFit(const float* g, int groups, const float* c, float cn, int n, int top)
      : c_(c), cn_(cn), n_(n), top_((float)top) {
    for (int j = 0; j < n; ++j)
      for (int l = 0; l < kLanes; ++l) g_[j][l] = g[std::min(l, groups - 1) * n + j];  // (spare lanes repeat one)
    for (int l = 0; l < kLanes; ++l) sw_[l] = 0;
    for (int j = 0; j < n; ++j)
      for (int l = 0; l < kLanes; ++l) sw_[l] += c[j] * g_[j][l];
  }

  // The best grid found into d_out, m_out [kLanes]; its codes into codes (group after group, n each) for the
  // lanes up to `groups`.
  void fit(int iterations, const float* steps, int search, float* d_out, float* m_out, uint8_t* codes, int groups) {
    Lanes lo, hi, best_d, best_m, best, d, m, err;
    for (int l = 0; l < kLanes; ++l) lo[l] = hi[l] = g_[0][l];
    for (int j = 1; j < n_; ++j)
      for (int l = 0; l < kLanes; ++l) lo[l] = std::min(lo[l], g_[j][l]), hi[l] = std::max(hi[l], g_[j][l]);
    for (int l = 0; l < kLanes; ++l) best_d[l] = half_rounded((hi[l] - lo[l]) / top_), best_m[l] = half_rounded(lo[l]);
    error(best_d, best_m, q_, best);
    for (int s = 0; s < search; ++s) {
      Lanes r;
      for (int l = 0; l < kLanes; ++l) r[l] = steps[s] / std::max(hi[l] - lo[l], 1e-30f);
      for (int j = 0; j < n_; ++j)
        for (int l = 0; l < kLanes; ++l) trial_[j][l] = code_of((g_[j][l] - lo[l]) * r[l], top_);
      refit(trial_, best_d, d, m);
      error(d, m, trial_, err);
      for (int j = 0; j < n_; ++j)
        for (int l = 0; l < kLanes; ++l) q_[j][l] = err[l] < best[l] ? trial_[j][l] : q_[j][l];
      keep_better(d, m, err, best_d, best_m, best);
    }
    for (int i = 0; i < iterations; ++i) {
      refit(q_, best_d, d, m);
      error(d, m, q_, err);
      keep_better(d, m, err, best_d, best_m, best);
    }
    for (int l = 0; l < kLanes; ++l) d_out[l] = best_d[l], m_out[l] = best_m[l];
    error(best_d, best_m, q_, err);
    for (int l = 0; l < groups; ++l)
      for (int j = 0; j < n_; ++j) codes[l * n_ + j] = (uint8_t)q_[j][l];
  }

 private:
  using Lanes = float[kLanes];
  using Codes = float[kMaxGroup][kLanes];

  static void keep_better(const Lanes d, const Lanes m, const Lanes err, Lanes best_d, Lanes best_m, Lanes best) {
    for (int l = 0; l < kLanes; ++l) {
      const bool better = err[l] < best[l];
      best_d[l] = better ? d[l] : best_d[l], best_m[l] = better ? m[l] : best_m[l], best[l] = better ? err[l] : best[l];
    }
  }

  // Each lane's weighted squared error on its grid (d, m), and its codes (rounded to nearest; all 0 where d
  // is 0) into q.
  void error(const Lanes d, const Lanes m, Codes q, Lanes e) const {
    Lanes inv;
    for (int l = 0; l < kLanes; ++l) inv[l] = d[l] > 0 ? 1.0f / d[l] : 0.0f, e[l] = 0;
    for (int j = 0; j < n_; ++j)
      for (int l = 0; l < kLanes; ++l) {
        q[j][l] = code_of((g_[j][l] - m[l]) * inv[l], top_);
        const float r = q[j][l] * d[l] + m[l] - g_[j][l];
        e[l] += c_[j] * (r * r);
      }
  }

  // d and m by weighted least squares for codes q (d: fallback where a lane's codes are all equal; at least 0).
  void refit(const Codes q, const Lanes fallback, Lanes d, Lanes m) const {
    Lanes sq, sqq, sqw;
    for (int l = 0; l < kLanes; ++l) sq[l] = sqq[l] = sqw[l] = 0;
    for (int j = 0; j < n_; ++j)
      for (int l = 0; l < kLanes; ++l) {
        const float cq = c_[j] * q[j][l];
        sq[l] += cq, sqq[l] += cq * q[j][l], sqw[l] += cq * g_[j][l];
      }
    for (int l = 0; l < kLanes; ++l) {
      const float den = cn_ * sqq[l] - sq[l] * sq[l];
      const float df = std::max(den > 0 ? (cn_ * sqw[l] - sq[l] * sw_[l]) / std::max(den, 1e-30f) : fallback[l], 0.0f);
      d[l] = half_rounded(df), m[l] = half_rounded((sw_[l] - df * sq[l]) / cn_);
    }
  }

  alignas(64) Codes g_, q_, trial_;
  alignas(64) Lanes sw_;
  const float* c_;
  float cn_;
  int n_;
  float top_;
};

// Groups g [G, n] (float32, contiguous) -> d, m [G] (float16 values, as float) and codes [G, n], on torch's
// threads.
inline void fit_affine_groups(const float* g, int64_t groups, int n, int top, int iterations, const float* c,
                              const float* steps, int search, float* d, float* m, uint8_t* codes) {
  float cn = 0;
  for (int j = 0; j < n; ++j) cn += c[j];
  const int64_t blocks = (groups + AffineFit::kLanes - 1) / AffineFit::kLanes;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t first = b * AffineFit::kLanes, count = std::min<int64_t>(AffineFit::kLanes, groups - first);
      float bd[AffineFit::kLanes], bm[AffineFit::kLanes];
      auto fit = std::make_unique<AffineFit>(g + first * n, (int)count, c, cn, n, top);
      fit->fit(iterations, steps, search, bd, bm, codes + first * n, (int)count);
      std::copy(bd, bd + count, d + first), std::copy(bm, bm + count, m + first);
    }
  });
}

}  // namespace tmq
