// What the CPU kernels of circle::loss and circle::anchor_loss share: the
// tile size, the task loop, the compute dtype, and labels as class ids.
#pragma once

#include "../kernel_args.h"
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

#include <algorithm>
#include <array>
#include <limits>
#include <atomic>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

namespace circle_loss {
namespace cpu {

// Edge of a tile of S (circle_loss.h says why 256).
constexpr int64_t kTile = kCpuTile;

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

// Runs step(t) for every t in [0, n) on the intra-op threads as if one after
// another: step t touches (reads or writes) the two accumulators touched(t),
// ids in [0, n_accumulators), and starts once every earlier step that touches
// either is done. Each accumulator so sees its steps in index order whichever
// thread runs them, and the result is the same for any thread count; yet a
// thread that finishes early takes the next step whose accumulators are free,
// instead of waiting at a barrier for a slower one. Steps are taken in index
// order and wait only on earlier ones, so the earliest unfinished step can
// always run.
template <typename Touched, typename Step>
inline void for_each_step_in_order(int64_t n, int64_t n_accumulators, const Touched& touched, const Step& step) {
  // turn[t][k]: how many earlier steps touch the accumulator touched(t)[k].
  std::vector<std::array<int64_t, 2>> turn(n);
  std::vector<int64_t> touches(n_accumulators, 0);
  for (int64_t t = 0; t < n; ++t) {
    const std::array<int64_t, 2> ids = touched(t);
    TORCH_INTERNAL_ASSERT(ids[0] != ids[1]);
    for (int k = 0; k < 2; ++k) turn[t][k] = touches[ids[k]]++;
  }
  const std::unique_ptr<std::atomic<int64_t>[]> done(new std::atomic<int64_t>[n_accumulators]);
  for (int64_t a = 0; a < n_accumulators; ++a) done[a].store(0, std::memory_order_relaxed);
  std::atomic<bool> failed{false};
  for_each_task(n, [&](int64_t t) {
    const std::array<int64_t, 2> ids = touched(t);
    for (int k = 0; k < 2; ++k) {
      while (done[ids[k]].load(std::memory_order_acquire) != turn[t][k]) {
        if (failed.load(std::memory_order_relaxed)) return; // a step threw: its accumulators never free up
        std::this_thread::yield();
      }
    }
    try {
      step(t);
    } catch (...) {
      failed = true;
      throw;
    }
    for (int k = 0; k < 2; ++k) done[ids[k]].fetch_add(1, std::memory_order_release);
  });
}

// The number of tiles in round `round` of for_each_symmetric_round: with an
// even count the last round meets each pair from both ends, so it has half.
inline int64_t tiles_in_round(int64_t blocks, int64_t round) {
  return (2 * round == blocks) ? blocks / 2 : blocks;
}

// The tiles {bi, (bi + round) mod n} on and above the diagonal of a symmetric
// product, n = blocks, round by round (with phases, each round's tiles visited
// twice): within a round every block is some tile's row block once and some
// tile's column block once.
struct RoundStep {
  int64_t round;
  int64_t phase;
  int64_t bi;
  int64_t bj;
};

inline std::vector<RoundStep> symmetric_round_steps(int64_t blocks, int64_t phases) {
  std::vector<RoundStep> steps;
  for (int64_t round = 0; round <= blocks / 2; ++round) {
    for (int64_t phase = 0; phase < (round == 0 ? 1 : phases); ++phase) {
      for (int64_t bi = 0; bi < tiles_in_round(blocks, round); ++bi) {
        steps.push_back({round, phase, bi, (bi + round) % blocks});
      }
    }
  }
  return steps;
}

// task(round, bi, bj) for every tile, where a task may write what is kept by
// its row block bi (for the block as a row block) and what is kept by its
// column block bj (as a column block): each has one writer a round, and sums
// in round order.
template <typename Task>
inline void for_each_symmetric_round(int64_t blocks, const Task& task) {
  const std::vector<RoundStep> steps = symmetric_round_steps(blocks, 1);
  for_each_step_in_order(
      static_cast<int64_t>(steps.size()), 2 * blocks,
      [&](int64_t t) { return std::array<int64_t, 2>{steps[t].bi, blocks + steps[t].bj}; },
      [&](int64_t t) { task(steps[t].round, steps[t].bi, steps[t].bj); });
}

// As above with one accumulator per block, and in two phases: in each round
// task(round, bi, bj) for every tile, which may write block bi's accumulator
// and leave something in slot bi, then, off the diagonal,
// column_task(round, bi, bj), which may write block bj's and read slot bi.
template <typename Task, typename ColumnTask>
inline void for_each_symmetric_round(int64_t blocks, const Task& task, const ColumnTask& column_task) {
  const std::vector<RoundStep> steps = symmetric_round_steps(blocks, 2);
  for_each_step_in_order(
      static_cast<int64_t>(steps.size()), 2 * blocks,
      [&](int64_t t) {
        const RoundStep& s = steps[t];
        return std::array<int64_t, 2>{s.phase == 0 ? s.bi : s.bj, blocks + s.bi};
      },
      [&](int64_t t) {
        const RoundStep& s = steps[t];
        if (s.phase == 0) {
          task(s.round, s.bi, s.bj);
        } else {
          column_task(s.round, s.bi, s.bj);
        }
      });
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

// The argument of exp(z - m), m the max of z's set, that gives 0 for z = -inf
// and, as max_ratio, exp(0) for a logit equal to its set's max, +inf too.
template <typename T>
inline T shifted_argument(T z, T m) {
  // Two selects in a row, which the compiler keeps as vector blends (a
  // nested conditional becomes control flow and a scalar loop).
  T d = z == m ? T(0) : z - m;
  d = z == -std::numeric_limits<T>::infinity() ? z : d;
  return d;
}

// Against a reference set (or class weights) the tiles are Q's row blocks ×
// R's column blocks. A few row blocks against many references (a memory bank
// of M ≫ B, 10^5 classes) would leave most threads idle if a task took a row
// block, so the column blocks are split into shares, each with accumulators
// of its own that are then merged share by share. The split depends on the shapes alone, so results
// stay the same for any thread count.
constexpr int64_t kGroupedTasks = 16;
// The gradient's shares hold a (B, D) sum each: no more than this many rows
// of them in all.
constexpr int64_t kGroupedRows = 16 * kTile;

struct ColumnGroups {
  int64_t row_blocks;
  int64_t col_blocks;
  int64_t groups;

  // Column blocks [first(g), first(g + 1)) are share g's.
  int64_t first(int64_t g) const { return col_blocks * g / groups; }

  // The row states: a task a (row block, share), kGroupedTasks of them;
  // row blocks of row_tile rows, column blocks of kTile.
  static ColumnGroups for_states(int64_t rows, int64_t cols, int64_t row_tile = kTile) {
    const int64_t row_blocks = at::divup(rows, row_tile);
    return make(row_blocks, at::divup(cols, kTile), at::divup(kGroupedTasks, std::max<int64_t>(row_blocks, 1)));
  }

  // The gradient: a task a share, walking every row block, so that each tile
  // of W serves dQ and dR; worth it where the shares outnumber the row blocks.
  static ColumnGroups for_gradient(int64_t rows, int64_t cols, int64_t row_tile = kTile) {
    const int64_t wanted = std::min(kGroupedTasks, kGroupedRows / std::max<int64_t>(rows, 1));
    return make(at::divup(rows, row_tile), at::divup(cols, kTile), wanted);
  }

 private:
  static ColumnGroups make(int64_t row_blocks, int64_t col_blocks, int64_t wanted) {
    return {row_blocks, col_blocks, std::clamp<int64_t>(wanted, 1, std::max<int64_t>(col_blocks, 1))};
  }
};

template <typename T>
inline PairLogit<T> pair_logit(double margin, double gamma) {
  return {static_cast<T>(margin), static_cast<T>(gamma)};
}

} // namespace cpu
} // namespace circle_loss
