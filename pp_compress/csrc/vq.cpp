// vq's pruned codebook search (pp_compress/ops/vq.py: nearest_pruned), one vector at a time: its grid cell's
// candidate points, or every point for a vector beyond the grid. Distances are the reference's fp32 operations in
// its order (difference, square, sum over the coordinates in turn; built without fused multiply-adds), and a
// strict < over candidates in ascending index order keeps the lowest index on a tie, as torch's argmin does.
// ATen's tensor alone, not torch/extension.h (torch's whole C++ frontend, most of the build's time)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>

namespace {

inline float sq_distance(const float* x, const float* c, int64_t dim) {
  float e = x[0] - c[0];
  float d = e * e;
  for (int64_t j = 1; j < dim; ++j) {
    e = x[j] - c[j];
    d = d + e * e;
  }
  return d;
}

}  // namespace

at::Tensor vq_search(at::Tensor v, at::Tensor cb, at::Tensor cand, double lo, double inv_h, int64_t cells) {
  TORCH_CHECK(v.dim() == 2 && cb.dim() == 2 && cand.dim() == 2 && v.size(1) == cb.size(1) && cb.size(0) <= 256,
              "vq_search: v (n, dim), a codebook (points <= 256, dim), candidates (cells**dim, k)");
  TORCH_CHECK(v.is_contiguous() && cb.is_contiguous() && cand.is_contiguous() && v.device().is_cpu() &&
              v.scalar_type() == at::kFloat && cb.scalar_type() == at::kFloat && cand.scalar_type() == at::kLong,
              "vq_search: contiguous CPU tensors, fp32 vectors and points, int64 candidates");
  const int64_t n = v.size(0), dim = v.size(1), points = cb.size(0), k = cand.size(1);
  auto out = at::empty({n}, v.options().dtype(at::kByte));
  const float* pv = v.data_ptr<float>();
  const float* pc = cb.data_ptr<float>();
  const int64_t* pk = cand.data_ptr<int64_t>();
  uint8_t* po = out.data_ptr<uint8_t>();
  const float flo = static_cast<float>(lo), finv = static_cast<float>(inv_h), top = static_cast<float>(cells);
  at::parallel_for(0, n, 1 << 14, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* x = pv + i * dim;
      int64_t flat = 0;
      bool inside = true;
      for (int64_t j = 0; j < dim; ++j) {
        const float f = (x[j] - flo) * finv;  // in cell units
        inside = inside && f >= 0.f && f < top;
        flat = flat * cells + static_cast<int64_t>(std::min(std::max(f, 0.f), top - 1.f));
      }
      float best = std::numeric_limits<float>::infinity();
      int64_t arg = 0;
      if (inside) {
        for (const int64_t* p = pk + flat * k; p < pk + (flat + 1) * k; ++p) {
          const float d = sq_distance(x, pc + *p * dim, dim);
          if (d < best) best = d, arg = *p;
        }
      } else {
        for (int64_t p = 0; p < points; ++p) {
          const float d = sq_distance(x, pc + p * dim, dim);
          if (d < best) best = d, arg = p;
        }
      }
      po[i] = static_cast<uint8_t>(arg);
    }
  });
  return out;
}
