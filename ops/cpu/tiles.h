// What the CPU kernels of circle::loss and circle::anchor_loss share: the
// tile size, the task loop, the compute dtype, and labels as class ids.
#pragma once

#include "../circle_loss.h"
#include "vector_loops.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_unique.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <atomic>
#include <type_traits>
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
//
// Tasks call ATen ops, which dispatch by thread-local state, and at::parallel_for
// does not carry the caller's to its worker threads: there autograd would
// record every tile's GEMM (grad mode is on by default, the kernel's
// below-autograd exclusion absent) and tie the kernel's outputs to its
// inputs' graph. Each task runs under the caller's state.
template <typename Task>
inline void for_each_task(int64_t n, const Task& task) {
  std::atomic<int64_t> next{0};
  const at::ThreadLocalState caller;
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    const at::ThreadLocalStateGuard same_state_as_caller(caller);
    for (int64_t t = next++; t < n; t = next++) {
      task(t);
    }
  });
}

// Rows of block b of a (N, ...) tensor.
inline at::Tensor block_of(const at::Tensor& t, int64_t b) {
  return t.narrow(0, b * kTile, std::min(kTile, t.size(0) - b * kTile));
}

// The number of tiles in round `round` of for_each_symmetric_round: with an
// even count the last round meets each pair from both ends, so it has half.
inline int64_t tiles_in_round(int64_t blocks, int64_t round) {
  return (2 * round == blocks) ? blocks / 2 : blocks;
}

// The tiles {bi, (bi + round) mod n} on and above the diagonal of a
// symmetric product, round by round: within a round every block is some
// tile's row block once and some tile's column block once, so accumulators
// kept by row block and by column block each have one writer a round, and
// every accumulator sums in round order.
template <typename Task>
inline void for_each_symmetric_round(int64_t blocks, const Task& task) {
  for (int64_t round = 0; round <= blocks / 2; ++round) {
    for_each_task(tiles_in_round(blocks, round), [&](int64_t bi) { task(round, bi, (bi + round) % blocks); });
  }
}

// As above, with a second phase in each round after the first: then
// column_task(round, bi, bj) runs for each of the round's tiles off the
// diagonal. A block is the row block of one tile and the column block of
// one, so a single accumulator per block has one writer in each phase:
// task writes row block bi, column_task column block bj.
template <typename Task, typename ColumnTask>
inline void for_each_symmetric_round(int64_t blocks, const Task& task, const ColumnTask& column_task) {
  for (int64_t round = 0; round <= blocks / 2; ++round) {
    const int64_t tiles = tiles_in_round(blocks, round);
    for_each_task(tiles, [&](int64_t bi) { task(round, bi, (bi + round) % blocks); });
    if (round == 0) continue;
    for_each_task(tiles, [&](int64_t bi) { column_task(round, bi, (bi + round) % blocks); });
  }
}

// The tile rows · colsᵀ of S. A diagonal tile (cols the same rows: S_II,
// symmetric) takes three quarters of the multiply-adds: the top half of the
// rows against all of them, the bottom half against itself, and the
// bottom-left quarter mirrored from the top-right one, which makes the tile
// exactly symmetric as S is.
inline at::Tensor similarity_tile(const at::Tensor& rows, const at::Tensor& cols) {
  const bool diagonal =
      rows.data_ptr() == cols.data_ptr() && rows.sizes() == cols.sizes() && rows.strides() == cols.strides();
  const int64_t n = rows.size(0);
  const int64_t top = n / 2;
  if (!diagonal || top == 0) {
    return at::mm(rows, cols.t());
  }
  at::Tensor s = at::empty({n, n}, rows.options());
  at::Tensor upper = s.narrow(0, 0, top);
  at::Tensor lower = s.narrow(0, top, n - top);
  at::Tensor lower_right = lower.narrow(1, top, n - top);
  const at::Tensor lower_rows = rows.narrow(0, top, n - top);
  at::mm_out(upper, rows.narrow(0, 0, top), rows.t());
  at::mm_out(lower_right, lower_rows, lower_rows.t());
  lower.narrow(1, 0, top).copy_(upper.narrow(1, top, n - top).t());
  return s;
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

// Larger of a and b, as the tile loops take their maxima: written as the
// one select that GCC turns into a vector max (nan_max's two tests, or even
// `a > b ? a : b` beside a second maximum, stay control flow and keep the
// loop scalar and branchy: with few classes, a mispredicted branch a pair).
// A NaN may be dropped from a maximum, yet still poisons its set: exp(NaN -
// max) puts it into the set's sum, and the LSE of a NaN sum is NaN.
template <typename T>
inline T tile_max(T a, T b) {
  return a < b ? b : a;
}

template <typename T>
inline PairLogit<T> pair_logit(double margin, double gamma) {
  return {static_cast<T>(margin), static_cast<T>(gamma)};
}

} // namespace cpu
} // namespace circle_loss
