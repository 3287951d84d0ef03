// What the CPU kernels of circle::loss and circle::anchor_loss share: the
// tile size, the task loop, the compute dtype, and labels as class ids.
#pragma once

#include "../circle_loss.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_unique.h>
#include <ATen/ops/cat.h>

#include <atomic>
#include <vector>

namespace circle_loss {
namespace cpu {

// Edge of a tile of S. Measured on a 2-core AMD EPYC at D = 512 (bench/NOTES.md):
// 256 ran fwd+bwd at B = 2048 in 93 ms, 128 in 100 ms, 64 in 130 ms: larger
// tiles keep ATen's GEMM nearer its peak.
constexpr int64_t kTile = 256;

// Runs task(t) for every t in [0, n) on the intra-op threads, each thread
// taking the next task as it finishes one: a thread that the OS slows down
// does not hold the others back. No result may depend on which thread ran a
// task (each writes its own slot or its own block of rows).
template <typename Task>
inline void for_each_task(int64_t n, const Task& task) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t t = next++; t < n; t = next++) {
      task(t);
    }
  });
}

// The dtype the kernel computes in: float32 for float16/bfloat16, as their
// GEMMs would otherwise round S to 8 or 11 bits.
inline at::ScalarType compute_dtype(const at::Tensor& features) {
  return at::toOpMathType(features.scalar_type());
}

// out[k] = values[k] in out's dtype (contiguous), rounded through its
// compute dtype as the CUDA kernels round: a value beyond the dtype's range
// becomes inf, as IEEE conversion gives.
inline void store_rounded(const double* values, at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "circle_store_rounded", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t k = 0; k < out.numel(); ++k) {
      o[k] = static_cast<scalar_t>(static_cast<at::opmath_type<scalar_t>>(values[k]));
    }
  });
}

// Labels as dense int32 class ids, which compare in the same vector lanes as
// float32; ids are shared by all the label tensors given, so equal labels in
// two blocks get equal ids.
inline std::vector<at::Tensor> class_ids(at::TensorList labels) {
  const at::Tensor ids = std::get<1>(
      at::_unique(at::cat(labels).to(at::kLong), /*sorted=*/true, /*return_inverse=*/true));
  std::vector<at::Tensor> out;
  int64_t offset = 0;
  for (const auto& l : labels) {
    out.push_back(ids.narrow(0, offset, l.size(0)).to(at::kInt).contiguous());
    offset += l.size(0);
  }
  return out;
}

template <typename T>
inline PairLogit<T> pair_logit(double margin, double gamma) {
  return {static_cast<T>(margin), static_cast<T>(gamma)};
}

} // namespace cpu
} // namespace circle_loss
