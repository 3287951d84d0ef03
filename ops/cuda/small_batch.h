// circle::loss for small batches on CUDA (small_batch.cu): the whole op in two
// launches of our own kernels, no cuBLAS call, for batches where launches and
// latency, not FLOPs, set the time.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>
#include <tuple>

namespace circle_loss {

// Largest batch the small-batch kernels take. Their cost grows as B²·D on
// CUDA cores, while the strip path's GEMMs run on cuBLAS's tuned kernels; at
// 512 rows S is 1 MiB in float32.
constexpr int64_t kSmallBatch = 512;

// The kernels index with 32 bits: B·D must stay below 2^31 too.
inline bool fits_small_batch(int64_t batch, int64_t dim) {
  return batch >= 1 && batch <= kSmallBatch && batch * dim <= std::numeric_limits<int32_t>::max();
}

// The loss () and, with with_grad, dloss/dfeatures (B, D) (else undefined),
// in the features' dtype, from the inputs as prepared for the kernels, on the
// current device, with fits_small_batch(B, D):
//   features: (B, D) contiguous, labels: (B,) contiguous int64
std::tuple<at::Tensor, at::Tensor> small_batch_loss(
    const at::Tensor& features,
    const at::Tensor& labels,
    double margin,
    double gamma,
    bool with_grad);

} // namespace circle_loss
