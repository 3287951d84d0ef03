// CUDA kernels of circle::loss, and its CUDA registrations (the backward's
// rescale, scale_kernel, among them).
//
// Batches of up to kSmallBatch rows take small_batch.cu's two launches; this
// file is the path for larger ones, which leaves the GEMMs to cuBLAS.
//
// S = F Fᵀ is formed one strip of rows at a time, never more than kStripBytes:
// a strip covers rows [r0, r0 + h) and, S being symmetric, only the columns
// [r0, B). cuBLAS computes each strip (through at::mm: float32 stays float32
// unless the user allows TF32, as for any matmul; float16/bfloat16 run on
// tensor cores with float32 results); the loss-specific work is ours:
//   strip_lse_kernel      one pass over a strip: each CTA's (max, Σ exp(z - max))
//                         of both pair sets; pairs right of the diagonal count
//                         twice, those left of it not at all.
//   finalize_kernel       one CTA folds every CTA's partial, in order, into
//                         the LSEs, the loss and 2σ(Z).
//   strip_weights_kernel  turns a strip of S into gradient weights
//                         W = 2σ(Z)·exp(z - LSE)·c (docs/math.md, "The global form").
// The gradient of a strip's rows is then W·F_[r0, B), and the rows right of
// the strip's diagonal block get their share as Wᵀ·F_strip.
//
// With one strip (B ≤ 4 096 in float32) the gradient pass reuses the S the
// loss pass left. With several, S is formed once, not once per pass: the
// negative pairs' weights are taken against a running maximum of their logits
// (docs/math.md, "Online rescaling"; running_max_kernel, rescale_kernel)
// while the loss's LSEs are still being summed, and the positive pairs, a
// class's worth per row, are done afterwards within their classes with the
// exact LSE_P (positive_band_kernel over the rows sorted by label). Where
// cuBLAS may use TF32 for float32, its GEMMs outrun that SIMT kernel, and the
// two passes of one strip are kept for any number of strips. These strips
// are float64's path, and that of features the tiles below do not take.
//
// float16/bfloat16 batches whose rows are whole 16-byte chunks, and float32
// ones (in TF32 where it is allowed, large ones as scaled float16 copies,
// else split into TF32 parts that keep float32's accuracy), form S on the
// tensor cores instead (mma_tiles.cuh), in registers, and never write it:
//   tile_lse_kernel       the loss pass in one launch over every tile on and
//                         above the diagonal, partials as strip_lse_kernel's.
//   tile_weights_kernel   (mma_tiles.cuh, with GlobalWeightRule) the gradient
//                         pass's W, strip by strip, straight from the tiles
//                         (W is symmetric: a strip's diagonal block from
//                         the tiles above its diagonal, stored both ways);
//                         cuBLAS then multiplies W by F as above (split
//                         float32 as three products of W's and F's
//                         bfloat16 parts, float32_split.cuh; with TF32
//                         allowed, W and F in float16). W alone
//                         leaves strips room for more rows, and wide ones
//                         are cut into chunks of columns (plan_column_chunks).
//
// No atomics: every reduction runs in a fixed order, cuBLAS is reproducible on
// a given GPU, so results are bitwise the same from run to run. Nothing waits
// for the host: the LSEs stay on the device and the op can be graph-captured.
#include "mma_tiles.cuh"
#include "small_batch.h"
#include "strips.cuh"

#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

namespace circle_loss {
namespace {

constexpr int kFinalizeThreads = 1024;

// partials[blockIdx] = (max_P, Σ_P, max_N, Σ_N) over this CTA's entries of the
// strip. Symmetric strips (row0 == col0) take the diagonal once, pairs right
// of it twice (as (i, j) and (j, i)) and those left of it not at all.
template <typename acc_t>
__global__ void __launch_bounds__(kThreads) strip_lse_kernel(
    const acc_t* __restrict__ s, // (rows, cols)
    int64_t rows,
    int64_t cols,
    const int64_t* __restrict__ row_labels, // (rows,)
    const int64_t* __restrict__ col_labels, // (cols,)
    bool symmetric,
    PairLogit<acc_t> logit,
    acc_t* __restrict__ partials) { // (gridDim.x · gridDim.y, 4)
  __shared__ acc_t scratch[2 * kWarps];
  LseState<acc_t> positive;
  LseState<acc_t> negative;
  for_each_entry(s, rows, cols, row_labels, col_labels, [&](int64_t r, int64_t c, acc_t s_rc, bool is_positive) {
    const acc_t multiplicity = !symmetric ? acc_t(1) : c > r ? acc_t(2) : c == r ? acc_t(1) : acc_t(0);
    if (multiplicity == acc_t(0)) return;
    acc_t slope;
    const acc_t z = logit(s_rc, is_positive, &slope);
    (is_positive ? positive : negative).add(z, multiplicity);
  });
  block_fold<kThreads>(positive, negative, scratch);
  if (threadIdx.x == 0) {
    PairStates<acc_t>{positive, negative}.store_at(partials, static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x);
  }
}

// Gradient weights for every entry of the strip (docs/math.md, "The global form"):
//   negative_max null: W = 2σ(Z)·exp(z - LSE of its set)·dz/ds, the factor 2
//                      of dloss/dF = 2 G F included;
//   otherwise:         W = exp(z - *negative_max)·dz/ds for negative pairs
//                      and 0 for positive ones (the one-pass gradient).
// May write in place (weights == s) when weight_t is acc_t.
template <typename acc_t, typename weight_t>
__global__ void __launch_bounds__(kThreads) strip_weights_kernel(
    const acc_t* s, // (rows, cols)
    int64_t rows,
    int64_t cols,
    const int64_t* __restrict__ row_labels, // (rows,)
    const int64_t* __restrict__ col_labels, // (cols,)
    PairLogit<acc_t> logit,
    const double* __restrict__ scalars, // (LSE_P, LSE_N, loss, 2σ(Z))
    const acc_t* __restrict__ negative_max, // () or null
    weight_t* weights) { // (rows, cols)
  const bool negatives_only = negative_max != nullptr;
  const LossScalars loss = negatives_only ? LossScalars{} : LossScalars::load(scalars);
  const acc_t lse_positive = static_cast<acc_t>(loss.lse_positive);
  const acc_t lse_negative = negatives_only ? *negative_max : static_cast<acc_t>(loss.lse_negative);
  const acc_t scale = negatives_only ? acc_t(1) : static_cast<acc_t>(loss.grad_scale);
  for_each_entry(s, rows, cols, row_labels, col_labels, [&](int64_t r, int64_t c, acc_t s_rc, bool is_positive) {
    acc_t slope;
    const acc_t z = logit(s_rc, is_positive, &slope);
    // scale 0 (a set empty) gives 0, also where an overflowed z meets its LSE of inf.
    const acc_t w = scale == acc_t(0) ? acc_t(0) : scale * exp(z - (is_positive ? lse_positive : lse_negative)) * slope;
    weights[r * cols + c] = static_cast<weight_t>(is_positive && negatives_only ? acc_t(0) : w);
  });
}

// Rows of tiles in a band of the tensor-core kernels' grids (common.cuh's
// grouped tiles): the H200's 264 resident CTAs then span 33 columns of 8
// rows, 41 operand tiles (5 MiB at D = 512), which L2 holds whatever the
// batch.
constexpr int64_t kTileBand = 8;

// Which tile of S this CTA owns. Symmetric: the tiles on and above the
// diagonal; otherwise every tile; in bands of kTileBand rows of tiles.
__device__ __forceinline__ void tile_position(bool symmetric, int64_t row_tiles, int64_t col_tiles, int64_t* ti, int64_t* tj) {
  const int64_t t = blockIdx.x;
  const TilePosition<int64_t> tile = symmetric ? grouped_upper_triangle_tile(t, col_tiles, kTileBand)
                                               : grouped_tile(t, row_tiles, col_tiles, kTileBand);
  *ti = tile.row;
  *tj = tile.col;
}

// The thread's (max, Σ) of both sets over its entries of a tile, which hold
// S on entry and their logits in Units on exit, -inf at the entries that do
// not count (below a symmetric product's diagonal, past the ends); each
// entry's sum term is weighted by its multiplicity relative to an
// off-diagonal pair (1; 1/2 on a symmetric product's diagonal). kEveryEntry:
// a full tile off the diagonal, where every entry counts once and none is
// tested. The maxima come first, then the sums at them: one ex2 an entry, no
// branch. An entry that does not count is a term of 0 in the sums rather
// than a skipped one, so that nothing about it is kept from the first pass
// to the second: keeping each entry's weight would take registers enough to
// spill on sm_80.
template <bool kEveryEntry, typename Units>
__device__ __forceinline__ void tile_entry_states(
    TileAccumulators& tile,
    const TileLabels& labels,
    const TileLogit& logit,
    int valid_rows,
    int valid_cols,
    bool diagonal,
    LseState<float>& positive,
    LseState<float>& negative) {
  // Plain floats, each entry updating one by a predicated instruction: a
  // reference to one set's state or the other's would keep both in local
  // memory.
  constexpr float kInfinity = std::numeric_limits<float>::infinity();
  float positive_max = -kInfinity;
  float negative_max = -kInfinity;
  tile.for_each([&](float& s, int r, int c, int) {
    const bool in_positive = labels.positive(r, c);
    float twice_alpha;
    s = logit(s, in_positive, &twice_alpha); // the entry now holds its logit
    if constexpr (!kEveryEntry) {
      if (r >= valid_rows || c >= valid_cols || (diagonal && c < r)) s = -kInfinity;
    }
    if (in_positive) {
      positive_max = fast_nan_max(positive_max, s);
    } else {
      negative_max = fast_nan_max(negative_max, s);
    }
  });
  // A set whose entries do not count has no maximum (-inf): its terms are
  // 2^(-inf - 0) = 0, not 2^(-inf + inf) = NaN.
  const float positive_base = exponent_base(positive_max);
  const float negative_base = exponent_base(negative_max);
  float positive_sum = 0.0f;
  float negative_sum = 0.0f;
  int2 column_ids;
  tile.for_each([&](float u, int r, int c, int k) {
    if (k % 4 == 0) column_ids = labels.column_pair_anew(c); // the fragment's columns c and c + 1
    const bool in_positive = labels.row[r] == (k % 2 == 0 ? column_ids.x : column_ids.y);
    float term = Units::term(u, in_positive ? positive_base : negative_base);
    if constexpr (!kEveryEntry) {
      if (diagonal && c == r) term *= 0.5f;
    }
    if (in_positive) {
      positive_sum += term;
    } else {
      negative_sum += term;
    }
  });
  positive = Units::state(positive_max, positive_sum);
  negative = Units::state(negative_max, negative_sum);
}

// tile_entry_states for a full tile off the diagonal whose every pair is
// in the one set `state` (positive: kPositive): no compares, the same
// terms in the same order, so the same bits.
template <bool kPositive, typename Units>
__device__ __forceinline__ void tile_set_state(TileAccumulators& tile, const TileLogit& logit, LseState<float>& state) {
  float max_u = -std::numeric_limits<float>::infinity();
  tile.for_each([&](float& s, int, int, int) {
    float twice_alpha;
    s = logit(s, kPositive, &twice_alpha);
    max_u = fast_nan_max(max_u, s);
  });
  float sum = 0.0f;
  tile.for_each([&](float u, int, int, int) { sum += Units::term(u, max_u); });
  state = Units::state(max_u, sum);
}

// partials[blockIdx] = (max_P, Σ_P, max_N, Σ_N) of one kMmaTile² tile of
// rows · colsᵀ, formed on the tensor cores and reduced in registers: the
// loss pass on the tensor cores, with S never in memory. Pairs count
// as in strip_lse_kernel: in a symmetric product, twice above the diagonal,
// once on it, not at all below it. Units: those of the features' dtype
// (HalfFeatures' float16 operands keep float32's).
template <typename T, typename Units>
__global__ void __launch_bounds__(kMmaThreads, 2) tile_lse_kernel(
    const __grid_constant__ TileOperands<T> in,
    bool symmetric, // rows is cols: only the tiles on and above the diagonal
    PairLogit<float> logit,
    float* __restrict__ partials) { // (tiles, 4)
  extern __shared__ __align__(128) unsigned char stages[];
  __shared__ float scratch[2 * kMmaThreads / 32];
  __shared__ int32_t id_ranges[2 * kMmaThreads / 32];
  __shared__ TileLabels labels;
  __shared__ TileUnit unit;
  int64_t ti, tj;
  tile_position(symmetric, tiles(in.n_rows), tiles(in.n_cols), &ti, &tj);
  const int64_t row0 = ti * kMmaTile;
  const int64_t col0 = tj * kMmaTile;
  TileAccumulators tile;
  bool labels_fit;
  multiply_tile(tile, in, row0, col0, stage_memory<T>(stages), [&] {
    labels_fit = labels.load(in, row0, col0);
    unit.load(in);
  });
  labels.settle(labels_fit, in, row0, col0, stages); // also where dim gives the main loop no step
  unit.apply(in, tile);
  const int valid_rows = static_cast<int>(in.n_rows - row0 < kMmaTile ? in.n_rows - row0 : kMmaTile);
  const int valid_cols = static_cast<int>(in.n_cols - col0 < kMmaTile ? in.n_cols - col0 : kMmaTile);
  const bool diagonal = symmetric && ti == tj;
  const TileLogit tile_logit(logit, Units::kScale);
  LseState<float> positive;
  LseState<float> negative;
  if (!diagonal && valid_rows == kMmaTile && valid_cols == kMmaTile) {
    switch (labels.sets(id_ranges)) {
      case TileLabels::Sets::kNegativesOnly:
        tile_set_state<false, Units>(tile, tile_logit, negative);
        break;
      case TileLabels::Sets::kPositivesOnly:
        tile_set_state<true, Units>(tile, tile_logit, positive);
        break;
      default:
        tile_entry_states<true, Units>(tile, labels, tile_logit, valid_rows, valid_cols, diagonal, positive, negative);
    }
  } else {
    tile_entry_states<false, Units>(tile, labels, tile_logit, valid_rows, valid_cols, diagonal, positive, negative);
  }
  block_fold<kMmaThreads>(positive, negative, scratch);
  if (threadIdx.x == 0) {
    const float off_diagonal = symmetric ? 2.0f : 1.0f; // the weight the sums are relative to
    positive.sum *= off_diagonal;
    negative.sum *= off_diagonal;
    PairStates<float>{positive, negative}.store_at(partials, blockIdx.x);
  }
}

// tile_weights_kernel's rule for the global form: W = 2σ(Z)·exp(z - LSE of
// its set)·dz/ds, from the loss's scalars, logits in Units (TileUnits).
template <typename Units>
struct GlobalWeightRule {
  PairLogit<float> logit;
  const double* scalars; // (LSE_P, LSE_N, loss, 2σ(Z))
  const float* weight_scale; // (): a power of two W is taken times (HalfProducts), or null

  struct Shared {
    WeightOffset offset[2]; // of (LSE_P, LSE_N)
    float scale; // 2σ(Z), times weight_scale
  };

  __device__ __forceinline__ void load(Shared& shared, int64_t, int64_t) const {
    if (threadIdx.x != 0) return;
    const LossScalars loss = LossScalars::load(scalars);
    shared.offset[0] = Units::offset(loss.lse_positive);
    shared.offset[1] = Units::offset(loss.lse_negative);
    shared.scale = static_cast<float>(loss.grad_scale) * (weight_scale != nullptr ? *weight_scale : 1.0f);
  }

  template <typename Visit>
  __device__ __forceinline__ void with_weight(const Shared& shared, Visit visit) const {
    if (shared.scale == 0.0f) { // a set empty: a zero gradient, even where a logit overflowed to inf
      visit([](float, bool, int, int) { return 0.0f; });
      return;
    }
    const TileLogit tile_logit(logit, Units::kScale);
    const WeightOffset positive_offset = shared.offset[0];
    const WeightOffset negative_offset = shared.offset[1];
    // 2σ(Z) times the slope's factor ∓γ/2 of twice_alpha.
    const float positive_factor = -0.5f * shared.scale * logit.gamma;
    const float negative_factor = 0.5f * shared.scale * logit.gamma;
    visit([=](float s, bool positive, int, int) {
      float twice_alpha;
      const float u = tile_logit(s, positive, &twice_alpha);
      const float w = twice_alpha * Units::weight_term(u, positive ? positive_offset : negative_offset);
      return w * (positive ? positive_factor : negative_factor);
    });
  }
};

// GlobalWeightRule's W / |dz/ds| is at most 2σ(Z)·exp(max z - LSE) = 2σ(Z)/Σ
// over each set, Σ its folded sum relative to its largest logit (at least
// 1 where the set has pairs): HalfProducts' weight factor. A bound from
// the logits alone would be off by the number of pairs the weights spread
// over, and put them among float16's subnormals.
__global__ void global_weight_factor_kernel(
    const double* __restrict__ scalars, // (LSE_P, LSE_N, loss, 2σ(Z))
    const double* __restrict__ folded, // (max_P, Σ_P, max_N, Σ_N)
    float* __restrict__ factor) { // ()
  const PairStates<double> sets = PairStates<double>::at(folded, 0);
  const double largest_share = fmax(sets.positive.sum > 0.0 ? 1.0 / sets.positive.sum : 0.0,
                                    sets.negative.sum > 0.0 ? 1.0 / sets.negative.sum : 0.0);
  *factor = static_cast<float>(LossScalars::load(scalars).grad_scale * largest_share);
}

// negative_max[strip] = max(negative_max[strip - 1], the largest negative
// logit of this strip), from the strip's LSE partials: the stabiliser of its
// negative weights.
template <typename acc_t>
__global__ void __launch_bounds__(kFinalizeThreads) running_max_kernel(
    const acc_t* __restrict__ partials, // (n, 4): this strip's
    int64_t n,
    acc_t* __restrict__ negative_max, // (strips,)
    int64_t strip) {
  __shared__ acc_t shared[kFinalizeThreads];
  acc_t largest = strip > 0 ? negative_max[strip - 1] : -std::numeric_limits<acc_t>::infinity();
  for (int64_t t = threadIdx.x; t < n; t += kFinalizeThreads) {
    largest = nan_max(largest, PairStates<acc_t>::at(partials, t).negative.max);
  }
  shared[threadIdx.x] = largest;
  __syncthreads();
  for (int stride = kFinalizeThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) shared[threadIdx.x] = nan_max(shared[threadIdx.x], shared[threadIdx.x + stride]);
    __syncthreads();
  }
  if (threadIdx.x == 0) negative_max[strip] = shared[0];
}

// Brings the rows that are still accumulating negative weights from the
// previous strip's stabiliser to this strip's: values *= exp(previous - current).
template <typename acc_t>
__global__ void __launch_bounds__(kThreads) rescale_kernel(
    acc_t* __restrict__ values, // (n,)
    int64_t n,
    const acc_t* __restrict__ negative_max) { // (previous, current)
  const acc_t previous = negative_max[0];
  const acc_t current = negative_max[1];
  if (previous == current) return; // the usual case once the largest logit has been seen
  const acc_t factor = exp(previous - current);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    values[i] *= factor;
  }
}

// First index in sorted[0, n) whose value is not below (strictly_above: is
// above) value.
__device__ __forceinline__ int64_t search_sorted(const int64_t* sorted, int64_t n, int64_t value, bool strictly_above) {
  int64_t low = 0;
  while (n > 0) {
    const int64_t half = n / 2;
    const int64_t probe = sorted[low + half];
    if (probe < value || (strictly_above && probe == value)) {
      low += half + 1;
      n -= half + 1;
    } else {
      n = half;
    }
  }
  return low;
}

// Positive pairs of the one-pass gradient. With the rows sorted by label, a
// CTA's kRows rows meet their class members in one contiguous span of sorted
// positions, which it walks kCols members a step as two small GEMMs: the dot
// products (kChunk features at a time through shared memory), their weights,
// then the weighted sum of the members' rows (kSumChunk features at a time).
// In both a thread holds a block of two 16-byte runs of rows by two runs of
// columns (features in the sum), as an SGEMM's threads do, which keeps
// shared memory under the FMA units' rate. A few CTAs may share a row
// block's span (positive_band_kernel). The rows' grad holds on entry the
// negative pairs' Σ exp(z - M)·c·f_j at their strip's stabiliser M and on
// exit the whole gradient:
//   2σ(Z)·(exp(M - LSE_N)·that + Σ_P exp(z - LSE_P)·c·f_j).
template <typename acc_t>
struct BandShape {
  static constexpr int kRun = 16 / static_cast<int>(sizeof(acc_t)); // values in one 16-byte load
  static constexpr int kGroups = 16; // thread groups along each side of a block
  static constexpr int kRows = 2 * kGroups * kRun; // float32 128, float64 64
  static constexpr int kCols = kRows;
  static constexpr int kChunk = 16;
  static constexpr int kSumChunk = kGroups * kRun;
  // Staged rows of features are padded by 4 values, which spreads the
  // stores that stage them over the banks and keeps 16-byte runs aligned.
  static constexpr int kPad = 4;
  static_assert(kGroups * kGroups == kThreads, "a block of each product a thread");
};

template <typename acc_t>
struct BandTiles {
  using Shape = BandShape<acc_t>;
  union {
    struct { // the dot products'
      acc_t rows[Shape::kChunk][Shape::kRows + Shape::kPad]; // [feature][row]
      acc_t cols[Shape::kChunk][Shape::kCols + Shape::kPad]; // [feature][member]
    } dots;
    acc_t members[Shape::kCols][Shape::kSumChunk + Shape::kPad]; // the weighted sum's: [member][feature]
  } staged;
  acc_t weight[Shape::kCols][Shape::kRows]; // [member][row]
  int64_t row_of[Shape::kRows];
  int64_t col_of[Shape::kCols];
  int64_t span[2]; // the sorted positions of the rows' classes: [span[0], span[1])
};

// The thread's place in both products: row group and column group, each of
// kGroups. A warp spans 4 row groups and 8 column groups, so that its loads
// of a run from shared memory touch 4 and 8 distinct 16-byte words.
struct BandLanes {
  int row_group = static_cast<int>(threadIdx.x) / 64 * 4 + static_cast<int>(threadIdx.x) % 32 / 8;
  int col_group = static_cast<int>(threadIdx.x) / 32 % 2 * 8 + static_cast<int>(threadIdx.x) % 8;

  // The k-th of the thread's 2·kRun rows (or columns) of a side of `extent`:
  // two runs, half the extent apart.
  template <typename acc_t>
  __device__ __forceinline__ static int member(int group, int k, int extent) {
    constexpr int kRun = BandShape<acc_t>::kRun;
    return k / kRun * (extent / 2) + group * kRun + k % kRun;
  }
};

// Features [d0, d0 + kWidth) of n rows (kN at most), in registers on their
// way to shared memory, so that they can load while the previous chunk is
// used. Zeros past the rows and features there are. A thread loads kLoads
// consecutive features of one row (at least 32 bytes): one row address to
// keep, and whole sectors for each warp.
template <typename acc_t, int kN, int kWidth>
struct RowChunk {
  static constexpr int kThreadsPerRow = kThreads / kN;
  static constexpr int kLoads = kWidth / kThreadsPerRow;
  static_assert(kThreadsPerRow * kLoads == kWidth && kLoads * sizeof(acc_t) % 16 == 0, "a thread's features are whole 16-byte runs");
  acc_t value[kLoads];

  __device__ __forceinline__ static int row() { return static_cast<int>(threadIdx.x) / kThreadsPerRow; }
  __device__ __forceinline__ static int first_feature() { return static_cast<int>(threadIdx.x) % kThreadsPerRow * kLoads; }

  // kWide: rows start on 16-byte boundaries and hold whole 16-byte runs,
  // which then load one run an instruction.
  template <bool kWide, typename scalar_t>
  __device__ __forceinline__ void load(const scalar_t* features, int64_t dim, const int64_t* row_of, int n, int64_t d0) {
    const bool inside = row() < n;
    const scalar_t* line = features + (inside ? row_of[row()] : 0) * dim + d0 + first_feature();
    const int64_t left = dim - d0 - first_feature(); // features of the row from here on
    if constexpr (kWide) {
      constexpr int kPer = 16 / sizeof(scalar_t);
      static_assert(kLoads % kPer == 0, "whole runs");
#pragma unroll
      for (int k = 0; k < kLoads; k += kPer) {
        Packed<scalar_t, kPer> run = {};
        if (inside && k < left) run = *reinterpret_cast<const Packed<scalar_t, kPer>*>(line + k);
#pragma unroll
        for (int i = 0; i < kPer; ++i) value[k + i] = static_cast<acc_t>(run.v[i]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < kLoads; ++k) value[k] = inside && k < left ? static_cast<acc_t>(line[k]) : acc_t(0);
    }
  }

  // As out[feature][row] (kPad-padded rows: two threads a bank).
  __device__ __forceinline__ void store_transposed(acc_t (*out)[kN + BandShape<acc_t>::kPad]) const {
#pragma unroll
    for (int k = 0; k < kLoads; ++k) out[first_feature() + k][row()] = value[k];
  }

  // As out[row][feature], 16 bytes a store.
  __device__ __forceinline__ void store_rows(acc_t (*out)[kWidth + BandShape<acc_t>::kPad]) const {
    constexpr int kRun = BandShape<acc_t>::kRun;
    using Run = Packed<acc_t, kRun>;
#pragma unroll
    for (int k = 0; k < kLoads; k += kRun) {
      Run run;
#pragma unroll
      for (int i = 0; i < kRun; ++i) run.v[i] = value[k + i];
      *reinterpret_cast<Run*>(&out[row()][first_feature() + k]) = run;
    }
  }
};

// The thread's 2·kRun values of a side at shared-memory row `line`: two
// 16-byte loads.
template <typename acc_t, int kExtent>
__device__ __forceinline__ void load_runs(const acc_t* line, int group, acc_t (&out)[2 * BandShape<acc_t>::kRun]) {
  constexpr int kRun = BandShape<acc_t>::kRun;
  using Run = Packed<acc_t, kRun>;
  const Run low = *reinterpret_cast<const Run*>(line + group * kRun);
  const Run high = *reinterpret_cast<const Run*>(line + kExtent / 2 + group * kRun);
#pragma unroll
  for (int k = 0; k < kRun; ++k) {
    out[k] = low.v[k];
    out[kRun + k] = high.v[k];
  }
}

// The negative pairs' share of the CTA's rows, from their strip's stabiliser
// M to LSE_N and by 2σ(Z). The barrier before the first span step orders it
// before the steps' sums, which other threads add.
template <typename acc_t>
__device__ __forceinline__ void scale_negative_share(
    const BandTiles<acc_t>& tiles, int rows, int64_t dim, acc_t scale, acc_t lse_negative,
    const acc_t* negative_max, int64_t strip_height, acc_t* grad) {
  for (int r = 0; r < rows; ++r) {
    const int64_t i = tiles.row_of[r];
    const acc_t factor = scale * max_ratio(negative_max[i / strip_height], lse_negative);
    for (int64_t d = threadIdx.x; d < dim; d += kThreads) grad[i * dim + d] *= factor;
  }
}

template <typename acc_t>
using BandDots = acc_t[2 * BandShape<acc_t>::kRun][2 * BandShape<acc_t>::kRun];

// The main loop of a span step: the dot products of the rows with the
// step's members, chunk by chunk through shared memory.
template <bool kWide, typename scalar_t, typename acc_t>
__device__ __forceinline__ void band_dot_products(
    const scalar_t* features, int64_t dim, BandTiles<acc_t>& tiles, int rows, int cols, BandDots<acc_t>& dot) {
  using Shape = BandShape<acc_t>;
  const BandLanes lanes;
  RowChunk<acc_t, Shape::kRows, Shape::kChunk> next_rows;
  RowChunk<acc_t, Shape::kCols, Shape::kChunk> next_cols;
  next_rows.template load<kWide>(features, dim, tiles.row_of, rows, 0);
  next_cols.template load<kWide>(features, dim, tiles.col_of, cols, 0);
  for (int64_t d0 = 0; d0 < dim; d0 += Shape::kChunk) {
    next_rows.store_transposed(tiles.staged.dots.rows);
    next_cols.store_transposed(tiles.staged.dots.cols);
    __syncthreads();
    if (d0 + Shape::kChunk < dim) {
      next_rows.template load<kWide>(features, dim, tiles.row_of, rows, d0 + Shape::kChunk);
      next_cols.template load<kWide>(features, dim, tiles.col_of, cols, d0 + Shape::kChunk);
    }
#pragma unroll 2
    for (int k = 0; k < Shape::kChunk; ++k) {
      acc_t r[2 * Shape::kRun], c[2 * Shape::kRun];
      load_runs<acc_t, Shape::kRows>(tiles.staged.dots.rows[k], lanes.row_group, r);
      load_runs<acc_t, Shape::kCols>(tiles.staged.dots.cols[k], lanes.col_group, c);
#pragma unroll
      for (int i = 0; i < 2 * Shape::kRun; ++i) {
#pragma unroll
        for (int j = 0; j < 2 * Shape::kRun; ++j) dot[i][j] += r[i] * c[j];
      }
    }
    __syncthreads();
  }
}

// The epilogue of a span step: each product's weight 2σ(Z)·exp(z - LSE_P)·c
// where its row and member share a class (0 elsewhere, past the rows and
// members too), to tiles.weight.
template <typename acc_t>
__device__ __forceinline__ void store_band_weights(
    const BandDots<acc_t>& dot, const int64_t* row_labels, const int64_t* col_labels, int rows, int cols,
    const PairLogit<acc_t>& logit, acc_t scale, acc_t lse_positive, BandTiles<acc_t>& tiles) {
  using Shape = BandShape<acc_t>;
  const BandLanes lanes;
#pragma unroll
  for (int i = 0; i < 2 * Shape::kRun; ++i) {
    const int r = BandLanes::member<acc_t>(lanes.row_group, i, Shape::kRows);
    const int64_t row_label = r < rows ? row_labels[r] : -1;
#pragma unroll
    for (int j = 0; j < 2 * Shape::kRun; ++j) {
      const int c = BandLanes::member<acc_t>(lanes.col_group, j, Shape::kCols);
      acc_t w = acc_t(0);
      if (r < rows && c < cols && row_label == col_labels[c]) {
        acc_t slope;
        const acc_t z = logit(dot[i][j], /*positive=*/true, &slope);
        w = scale * exp(z - lse_positive) * slope;
      }
      tiles.weight[c][r] = w;
    }
  }
}

// The store of a span step: Σ_c weight[c][r]·f_(member c) added to each row's
// gradient, kSumChunk features at a time through shared memory, a block of
// 2·kRun rows × kRun features a thread. Past `cols` the weights and the
// staged members are zeros, so every step sums all kCols.
template <bool kWide, typename scalar_t, typename acc_t>
__device__ __forceinline__ void add_weighted_members(
    const scalar_t* features, int64_t dim, BandTiles<acc_t>& tiles, int rows, int cols, acc_t* grad) {
  using Shape = BandShape<acc_t>;
  using Run = Packed<acc_t, Shape::kRun>;
  const BandLanes lanes;
  const int first_feature = lanes.col_group * Shape::kRun;
  for (int64_t d0 = 0; d0 < dim; d0 += Shape::kSumChunk) {
    RowChunk<acc_t, Shape::kCols, Shape::kSumChunk> chunk;
    chunk.template load<kWide>(features, dim, tiles.col_of, cols, d0);
    chunk.store_rows(tiles.staged.members);
    __syncthreads();
    acc_t sum[2 * Shape::kRun][Shape::kRun] = {};
#pragma unroll 4
    for (int c = 0; c < Shape::kCols; ++c) {
      acc_t w[2 * Shape::kRun];
      load_runs<acc_t, Shape::kRows>(tiles.weight[c], lanes.row_group, w);
      const Run m = *reinterpret_cast<const Run*>(&tiles.staged.members[c][first_feature]);
#pragma unroll
      for (int i = 0; i < 2 * Shape::kRun; ++i) {
#pragma unroll
        for (int j = 0; j < Shape::kRun; ++j) sum[i][j] += w[i] * m.v[j];
      }
    }
    // Every load of grad before any store: rows may alias as far as the
    // compiler knows, and a store between would keep each load waiting for
    // the one before. grad's rows are whole runs where the features' are.
    Run* out[2 * Shape::kRun];
    const bool inside = d0 + first_feature < dim;
#pragma unroll
    for (int i = 0; i < 2 * Shape::kRun; ++i) {
      const int r = BandLanes::member<acc_t>(lanes.row_group, i, Shape::kRows);
      out[i] = r < rows && inside ? reinterpret_cast<Run*>(grad + tiles.row_of[r] * dim + d0 + first_feature) : nullptr;
      if (out[i] == nullptr) continue;
      if constexpr (kWide) {
        const Run old = *out[i];
#pragma unroll
        for (int j = 0; j < Shape::kRun; ++j) sum[i][j] += old.v[j];
      } else {
#pragma unroll
        for (int j = 0; j < Shape::kRun; ++j) {
          if (d0 + first_feature + j < dim) sum[i][j] += out[i]->v[j];
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 2 * Shape::kRun; ++i) {
      if (out[i] == nullptr) continue;
      if constexpr (kWide) {
        Run run;
#pragma unroll
        for (int j = 0; j < Shape::kRun; ++j) run.v[j] = sum[i][j];
        *out[i] = run;
      } else {
#pragma unroll
        for (int j = 0; j < Shape::kRun; ++j) {
          if (d0 + first_feature + j < dim) out[i]->v[j] = sum[i][j];
        }
      }
    }
    __syncthreads(); // the next chunk overwrites the staged members
  }
}

// blockIdx.x: the CTA's kRows sorted rows; blockIdx.y: its share of their
// span's steps, so that a few long spans still fill the GPU. Share 0 adds to
// grad, after the negative pairs' share; share s > 0 to share_sums[s - 1],
// zeros on entry, which the launch then adds to grad in order.
template <typename scalar_t, typename acc_t, bool kWide>
__global__ void __launch_bounds__(kThreads, 2) positive_band_kernel(
    const scalar_t* __restrict__ features, // (B, D)
    int64_t batch,
    int64_t dim,
    const int64_t* __restrict__ sorted_labels, // (B,)
    const int64_t* __restrict__ order, // (B,): the row at each sorted position
    PairLogit<acc_t> logit,
    const double* __restrict__ scalars, // (LSE_P, LSE_N, loss, 2σ(Z))
    const acc_t* __restrict__ negative_max, // (strips,)
    int64_t strip_height,
    acc_t* __restrict__ grad, // (B, D)
    acc_t* __restrict__ share_sums) { // (gridDim.y - 1, B, D)
  using Shape = BandShape<acc_t>;
  extern __shared__ __align__(16) unsigned char band_shared[];
  BandTiles<acc_t>& tiles = *reinterpret_cast<BandTiles<acc_t>*>(band_shared);
  const int64_t p0 = blockIdx.x * static_cast<int64_t>(Shape::kRows);
  const int rows = static_cast<int>(std::min<int64_t>(Shape::kRows, batch - p0));
  const LossScalars loss = LossScalars::load(scalars);
  const acc_t lse_positive = static_cast<acc_t>(loss.lse_positive);
  const acc_t lse_negative = static_cast<acc_t>(loss.lse_negative);
  const acc_t scale = static_cast<acc_t>(loss.grad_scale);
  if (threadIdx.x < rows) tiles.row_of[threadIdx.x] = order[p0 + threadIdx.x];
  if (threadIdx.x == 0) {
    tiles.span[0] = search_sorted(sorted_labels, batch, sorted_labels[p0], /*strictly_above=*/false);
    tiles.span[1] = search_sorted(sorted_labels, batch, sorted_labels[p0 + rows - 1], /*strictly_above=*/true);
  }
  __syncthreads();
  acc_t* out = grad;
  if (blockIdx.y == 0) {
    scale_negative_share(tiles, rows, dim, scale, lse_negative, negative_max, strip_height, grad);
  } else {
    out = share_sums + (blockIdx.y - 1) * batch * dim;
  }
  if (scale == acc_t(0)) return; // Z = -inf: no negative pair, a zero gradient

  const int64_t steps = (tiles.span[1] - tiles.span[0] + Shape::kCols - 1) / Shape::kCols;
  const int64_t first = steps * blockIdx.y / gridDim.y;
  const int64_t last = steps * (blockIdx.y + 1) / gridDim.y;
  for (int64_t step = first; step < last; ++step) {
    const int64_t q0 = tiles.span[0] + step * Shape::kCols;
    const int cols = static_cast<int>(std::min<int64_t>(Shape::kCols, tiles.span[1] - q0));
    if (threadIdx.x < cols) tiles.col_of[threadIdx.x] = order[q0 + threadIdx.x];
    __syncthreads();
    BandDots<acc_t> dot = {};
    band_dot_products<kWide>(features, dim, tiles, rows, cols, dot);
    store_band_weights(dot, sorted_labels + p0, sorted_labels + q0, rows, cols, logit, scale, lse_positive, tiles);
    __syncthreads();
    add_weighted_members<kWide>(features, dim, tiles, rows, cols, out);
    // add_weighted_members ends on a barrier: col_of and weight may be rewritten
  }
}

// Rows of whole 16-byte runs from a 16-byte boundary: the band kernel's kWide.
inline bool whole_runs(const at::Tensor& features) {
  return features.size(1) * features.element_size() % 16 == 0 && reinterpret_cast<uintptr_t>(features.data_ptr()) % 16 == 0;
}

// At most this many CTAs share a row block's span: each share beyond the
// first holds a (B, D) partial.
constexpr int64_t kMaxBandShares = 4;

// The passes over the strips of rows × colsᵀ (symmetric: rows is cols).
template <typename scalar_t>
class StripPasses {
 public:
  using acc_t = at::opmath_type<scalar_t>;

  // for_gradient: the gradient pass will run (float32 features then keep
  // the operands its products take: TileFeatures).
  StripPasses(const KernelRows& rows, const KernelRows& cols, bool symmetric, double margin, double gamma,
              bool for_gradient)
      : rows_(rows),
        cols_(cols),
        symmetric_(symmetric),
        logit_{static_cast<acc_t>(margin), static_cast<acc_t>(gamma)},
        tensor_cores_(use_tensor_cores(rows, cols)),
        // The symmetric op's float32 with TF32 allowed goes to the tiles as
        // float16 copies (HalfFeatures), and so do its gradient's products
        // (HalfProducts): the op has the loss's folded sums that bound W.
        // The block ops are given its scalars alone, and keep float32 W and
        // TF32.
        takes_halves_(tensor_cores_ && std::is_same_v<scalar_t, float> && symmetric &&
                      takes_half_features(rows.size(), cols.size(), rows.dim())),
        // With the tensor cores only the weights are held, sizeof(scalar_t) an
        // entry (split float32: two bfloat16 parts; HalfProducts: float16).
        strips_(tensor_cores_ ? plan_column_chunks(rows.size(), cols.size(), symmetric,
                                                   takes_halves_ ? sizeof(c10::Half) : sizeof(scalar_t))
                              : plan_strips(rows.size(), cols.size(), symmetric, sizeof(acc_t))),
        sms_(multiprocessors()) {
    if (takes_halves_) {
      half_features_ = HalfFeatures(rows.features, at::Tensor());
      half_tiles_ = TileFeatures<c10::Half>(half_features_.rows(), /*for_products=*/false);
    } else if (tensor_cores_) {
      const bool for_products = for_gradient && prepares_products(rows.size(), cols.size(), rows.dim());
      row_tiles_ = TileFeatures<scalar_t>(rows.features, for_products);
      col_tiles_ = symmetric ? row_tiles_ : TileFeatures<scalar_t>(cols.features, for_products);
    }
    // The tiles' loss pass needs no workspace: theirs is W's, made by the
    // gradient pass.
    if (!tensor_cores_) workspace_ = at::empty({largest_strip()}, rows.features.options().dtype(dtype_of<acc_t>()));
  }

  int64_t strip_count() const { return static_cast<int64_t>(strips_.size()); }
  // Entries of the largest strip, the first.
  int64_t largest_strip() const { return strips_.empty() ? 0 : strips_.front().rows * strips_.front().cols; }
  bool on_tensor_cores() const { return tensor_cores_; }

  // Loss pass: every CTA's LSE partials, (n, 4) in acc_t. Leaves the last
  // strip's S in the workspace.
  at::Tensor lse_partials() {
    if (tensor_cores_) {
      return tile_lse_partials();
    }
    at::Tensor partials = at::empty({partial_count(), 4}, workspace_.options());
    int64_t offset = 0;
    for (const Strip& strip : strips_) {
      offset += launch_strip_lse(strip, strip_similarities(rows_, cols_, strip, workspace_), partials, offset);
    }
    last_strip_in_workspace_ = !strips_.empty();
    return partials;
  }

  // Gradient pass after the loss pass: Σ_j G_ij cols_j for every row (R, D),
  // in acc_t, from scalars = (LSE_P, LSE_N, loss, 2σ(Z)) on the device, and
  // for the symmetric op's float16 products the loss pass's folded partial
  // (max_P, Σ_P, max_N, Σ_N). S is formed again, strip by strip, last to
  // first: the last strip reuses the S the loss pass left, and each strip's
  // own rows are written before any earlier strip adds its transposed share
  // to them.
  at::Tensor gradient(const at::Tensor& scalars, const at::Tensor& folded = at::Tensor()) {
    at::Tensor grad = at::empty({rows_.size(), rows_.features.size(1)}, rows_.features.options().dtype(dtype_of<acc_t>()));
    if (tensor_cores_) {
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (takes_halves_) half_products_ = HalfProducts(half_features_, weight_factor(scalars, folded), logit_);
      }
      // W whole, in float16 for HalfProducts, or its big bfloat16 part where
      // the products take parts (float32_split.cuh) and its small one beside it.
      const bool parts = row_tiles_.has_parts();
      workspace_ = at::empty({largest_strip()}, rows_.features.options().dtype(
                                                    parts ? at::kBFloat16 : takes_halves_ ? at::kHalf : dtype_of<scalar_t>()));
      if (parts) small_workspace_ = at::empty_like(workspace_);
      for (auto strip = strips_.crbegin(); strip != strips_.crend(); ++strip) {
        const bool after_products = strip != strips_.crbegin();
        add_strip_gradient(grad, launch_tile_weights(*strip, scalars.data_ptr<double>(), after_products), *strip,
                           /*accumulate_own=*/!last_chunk_of_rows(strips_, strip), /*accumulate_below=*/true);
      }
      if (takes_halves_) half_products_.unscale(grad);
      return grad;
    }
    const at::Tensor weight_space = make_weight_space();
    for (auto strip = strips_.rbegin(); strip != strips_.rend(); ++strip) {
      const at::Tensor s = strip == strips_.rbegin() && last_strip_in_workspace_
          ? workspace_.narrow(0, 0, strip->rows * strip->cols).view({strip->rows, strip->cols})
          : strip_similarities(rows_, cols_, *strip, workspace_);
      const at::Tensor weights = launch_weights(*strip, s, weight_space, scalars.data_ptr<double>(), nullptr);
      add_strip_gradient(grad, {weights, {}}, *strip, /*accumulate_own=*/false, /*accumulate_below=*/true);
    }
    last_strip_in_workspace_ = false;
    return grad;
  }

  // The symmetric op over several strips: writes the loss and returns the
  // gradient (B, D) in acc_t, each strip of S formed once. Strips run first to
  // last; strip k's negative weights are taken against M_k, the largest
  // negative logit of strips 0..k, and added to the rows [r0_k, B) once those
  // are brought from M_(k-1) to M_k. Rows of strip k get no later share, so
  // each row ends at its strip's M; positive_band_kernel then scales every
  // row to LSE_N and adds the positive pairs.
  at::Tensor loss_and_gradient(at::Tensor& loss) {
    TORCH_INTERNAL_ASSERT(symmetric_ && !tensor_cores_);
    const auto stream = c10::cuda::getCurrentCUDAStream();
    const int64_t batch = rows_.size();
    const int64_t dim = rows_.features.size(1);
    at::Tensor partials = at::empty({partial_count(), 4}, workspace_.options());
    at::Tensor negative_max = at::empty({strip_count()}, workspace_.options());
    at::Tensor grad = at::empty({batch, dim}, workspace_.options());
    {
      const at::Tensor weight_space = make_weight_space();
      int64_t offset = 0;
      for (int64_t k = 0; k < strip_count(); ++k) {
        const Strip& strip = strips_[k];
        const at::Tensor s = strip_similarities(rows_, cols_, strip, workspace_);
        const int64_t n = launch_strip_lse(strip, s, partials, offset);
        running_max_kernel<acc_t><<<1, kFinalizeThreads, 0, stream>>>(
            partials.data_ptr<acc_t>() + PairStates<acc_t>::kValues * offset, n, negative_max.data_ptr<acc_t>(), k);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        offset += n;
        const bool first = k == 0; // writes every row: no fill, no rescale
        if (!first) {
          const int64_t values = (batch - strip.row0) * dim;
          const int64_t blocks = std::clamp<int64_t>((values + kColsPerCta - 1) / kColsPerCta, 1, 8 * sms_);
          rescale_kernel<acc_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
              grad.data_ptr<acc_t>() + strip.row0 * dim, values, negative_max.data_ptr<acc_t>() + k - 1);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
        const at::Tensor weights = launch_weights(strip, s, weight_space, nullptr, negative_max.data_ptr<acc_t>() + k);
        add_strip_gradient(grad, {weights, {}}, strip, /*accumulate_own=*/!first, /*accumulate_below=*/!first);
      }
    }
    // Past the strips S's workspace is free for the positive pairs' partials.
    workspace_ = at::Tensor();
    at::Tensor scalars = at::empty({4}, rows_.features.options().dtype(at::kDouble));
    launch_finalize<kFinalizeThreads>(
        partials.data_ptr<acc_t>(), partials.size(0), nullptr, scalars.data_ptr<double>(), loss.data_ptr<scalar_t>());
    add_positive_pairs(grad, scalars, negative_max);
    return grad;
  }

 private:
  // positive_band_kernel over the rows sorted by label, with as many shares of
  // each row block's span as put two CTAs on every SM.
  void add_positive_pairs(at::Tensor& grad, const at::Tensor& scalars, const at::Tensor& negative_max) const {
    const int64_t batch = rows_.size();
    const int64_t dim = rows_.features.size(1);
    const auto [sorted_labels, order] = at::sort(rows_.labels, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    const int64_t bands = (batch + BandShape<acc_t>::kRows - 1) / BandShape<acc_t>::kRows;
    const int64_t shares = std::clamp<int64_t>((2 * sms_ + bands - 1) / bands, 1, kMaxBandShares);
    const at::Tensor share_sums = at::zeros({shares - 1, batch, dim}, grad.options());
    const auto launch = [&](auto wide) {
      constexpr auto kernel = &positive_band_kernel<scalar_t, acc_t, decltype(wide)::value>;
      configure_kernel<kernel>(sizeof(BandTiles<acc_t>), /*largest_carveout=*/false);
      kernel<<<dim3(static_cast<unsigned>(bands), static_cast<unsigned>(shares)), kThreads, sizeof(BandTiles<acc_t>),
               c10::cuda::getCurrentCUDAStream()>>>(
          rows_.features.data_ptr<scalar_t>(), batch, dim, sorted_labels.data_ptr<int64_t>(), order.data_ptr<int64_t>(),
          logit_, scalars.data_ptr<double>(), negative_max.data_ptr<acc_t>(), strips_.front().rows,
          grad.data_ptr<acc_t>(), share_sums.data_ptr<acc_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    whole_runs(rows_.features) ? launch(std::true_type{}) : launch(std::false_type{});
    for (int64_t s = 0; s + 1 < shares; ++s) grad.add_(share_sums[s]);
  }

 private:
  // Features the tensor-core kernels can take (mma_tiles.cuh), on a GPU
  // that runs them (for float32 also the float16 ones, for HalfFeatures).
  static bool use_tensor_cores(const KernelRows& rows, const KernelRows& cols) {
    if constexpr (kHasMmaTiles<scalar_t>) {
      return tiles_take<scalar_t>(rows.features) && tiles_take<scalar_t>(cols.features) && tiles_built<scalar_t>() &&
          (!std::is_same_v<scalar_t, float> || tiles_built<c10::Half>());
    } else {
      return false;
    }
  }

  // Whether this GPU runs the tile kernels of operands T, in the units of
  // the features' dtype.
  template <typename T>
  static bool tiles_built() {
    using Units = TileUnits<scalar_t>;
    return mma_tiles_built<tile_lse_kernel<T, Units>>() && mma_tiles_built<tile_weights_kernel<T, GlobalWeightRule<Units>>>();
  }

  // The loss pass on the tensor cores: one launch over every tile, (tiles, 4)
  // partials in float32.
  at::Tensor tile_lse_partials() {
    at::Tensor partials;
    if constexpr (kHasMmaTiles<scalar_t>) {
      const int64_t row_tiles = tiles(rows_.size());
      const int64_t col_tiles = tiles(cols_.size());
      const int64_t tile_count = symmetric_ ? row_tiles * (row_tiles + 1) / 2 : row_tiles * col_tiles;
      partials = at::empty({tile_count, 4}, rows_.features.options().dtype(at::kFloat));
      if (tile_count > 0) {
        on_tiles(0, rows_.size(), 0, cols_.size(), [&](const auto& in) {
          using T = typename std::decay_t<decltype(in)>::Scalar;
          constexpr auto kernel = tile_lse_kernel<T, TileUnits<scalar_t>>;
          kernel<<<static_cast<unsigned>(tile_count), kMmaThreads, kMmaSharedBytes, c10::cuda::getCurrentCUDAStream()>>>(
              in, symmetric_, logit_, partials.data_ptr<float>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      }
    }
    return partials;
  }

  // Calls launch(operands) with the tiles' operands of rows [row0, row0 +
  // n_rows) against columns [col0, col0 + n_cols): HalfFeatures' float16
  // copies where the op takes them, else the features as TileFeatures.
  template <typename Launch>
  void on_tiles(int64_t row0, int64_t n_rows, int64_t col0, int64_t n_cols, const Launch& launch) const {
    const int64_t* row_labels = rows_.labels.data_ptr<int64_t>() + row0;
    const int64_t* col_labels = cols_.labels.data_ptr<int64_t>() + col0;
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (takes_halves_) {
        launch(make_tile_operands(half_tiles_.rows().from(row0), row_labels, n_rows, half_tiles_.cols().from(col0),
                                  col_labels, n_cols, half_features_.similarity_unit()));
        return;
      }
    }
    launch(make_tile_operands(row_tiles_.rows().from(row0), row_labels, n_rows, col_tiles_.cols().from(col0), col_labels,
                              n_cols));
  }

  // tile_weights_kernel over a strip; returns its (rows, cols) weights,
  // split where the features are. after_products: the stream's last kernels
  // are the products of the previous strip's W, of which the kernel is made
  // a dependent.
  SplitMatrix launch_tile_weights(const Strip& strip, const double* scalars, bool after_products) {
    const SplitMatrix weights = strip_weights(workspace_, small_workspace_, strip);
    if constexpr (kHasMmaTiles<scalar_t>) {
      on_tiles(strip.row0, strip.rows, strip.col0, strip.cols, [&](const auto& in) {
        launch_tile_weights_kernel(
            after_products, in,
            GlobalWeightRule<TileUnits<scalar_t>>{logit_, scalars, takes_halves_ ? half_products_.weight_scale() : nullptr},
            symmetric_ && strip.col0 == strip.row0, weights);
      });
    }
    return weights;
  }

  // global_weight_factor_kernel's bound, () float32 on the device.
  at::Tensor weight_factor(const at::Tensor& scalars, const at::Tensor& folded) const {
    at::Tensor factor = at::empty({}, rows_.features.options().dtype(at::kFloat));
    global_weight_factor_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
        scalars.data_ptr<double>(), folded.data_ptr<double>(), factor.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return factor;
  }

  const int64_t* row_labels(const Strip& strip) const { return rows_.labels.data_ptr<int64_t>() + strip.row0; }
  const int64_t* col_labels(const Strip& strip) const { return cols_.labels.data_ptr<int64_t>() + strip.col0; }

  int64_t partial_count() const {
    int64_t n = 0;
    for (const Strip& strip : strips_) {
      const dim3 grid = strip_grid(strip, sms_);
      n += static_cast<int64_t>(grid.x) * grid.y;
    }
    return n;
  }

  // strip_lse_kernel over strip's S into partials[offset:]; returns how many
  // partials it wrote.
  int64_t launch_strip_lse(const Strip& strip, const at::Tensor& s, at::Tensor& partials, int64_t offset) {
    const dim3 grid = strip_grid(strip, sms_);
    strip_lse_kernel<acc_t><<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        s.data_ptr<acc_t>(), strip.rows, strip.cols, row_labels(strip), col_labels(strip), symmetric_, logit_,
        partials.data_ptr<acc_t>() + PairStates<acc_t>::kValues * offset);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return static_cast<int64_t>(grid.x) * grid.y;
  }

  // float16/bfloat16 weights feed the tensor cores; wider ones overwrite S.
  at::Tensor make_weight_space() const {
    return std::is_same_v<scalar_t, acc_t> ? workspace_ : at::empty_like(workspace_, rows_.features.options());
  }

  // strip_weights_kernel over strip's S; returns the (rows, cols) weights.
  at::Tensor launch_weights(
      const Strip& strip,
      const at::Tensor& s,
      const at::Tensor& weight_space,
      const double* scalars,
      const acc_t* negative_max) {
    const at::Tensor weights = weight_space.narrow(0, 0, strip.rows * strip.cols).view({strip.rows, strip.cols});
    strip_weights_kernel<acc_t, scalar_t><<<strip_grid(strip, sms_), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        s.data_ptr<acc_t>(), strip.rows, strip.cols, row_labels(strip), col_labels(strip), logit_, scalars,
        negative_max, weights.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return weights;
  }

  // grad[strip's rows] = (accumulate_own: +=) weights·cols[strip's columns];
  // symmetric: grad[the strip's columns right of its diagonal block] =
  // (accumulate_below: +=) their weightsᵀ·rows[strip's rows]. Split weights
  // take the features split as the tiles took them.
  void add_strip_gradient(
      at::Tensor& grad,
      const SplitMatrix& weights,
      const Strip& strip,
      bool accumulate_own,
      bool accumulate_below) const {
    const SplitMatrix rows = takes_halves_ ? half_products_.rows()
        : tensor_cores_                    ? row_tiles_.parts()
                                           : SplitMatrix{rows_.features, {}};
    const SplitMatrix cols = takes_halves_ ? half_products_.cols()
        : tensor_cores_                    ? col_tiles_.parts()
                                           : SplitMatrix{cols_.features, {}};
    split_matmul(grad.narrow(0, strip.row0, strip.rows), weights, cols.narrow(0, strip.col0, strip.cols), accumulate_own);
    if (symmetric_ && strip.mirrored() > 0) {
      split_matmul(
          grad.narrow(0, strip.first_mirrored(), strip.mirrored()),
          weights.narrow(1, strip.first_mirrored() - strip.col0, strip.mirrored()).t(),
          rows.narrow(0, strip.row0, strip.rows),
          accumulate_below);
    }
  }

  const KernelRows& rows_;
  const KernelRows& cols_;
  bool symmetric_;
  PairLogit<acc_t> logit_;
  bool tensor_cores_; // S formed and consumed in registers (mma_tiles.cuh)
  bool takes_halves_; // the tiles and products take HalfFeatures
  TileFeatures<scalar_t> row_tiles_; // with tensor_cores_, rows and cols as the tiles take them
  TileFeatures<scalar_t> col_tiles_;
  HalfFeatures half_features_; // or with takes_halves_ these, and as the tiles take them:
  TileFeatures<c10::Half> half_tiles_;
  HalfProducts half_products_; // with takes_halves_, made by the gradient pass
  std::vector<Strip> strips_;
  int sms_;
  at::Tensor workspace_; // (largest strip,): S in acc_t, or with tensor_cores_ (from the gradient pass on) the weights in scalar_t (parts: W's big bfloat16 part; takes_halves_: float16)
  at::Tensor small_workspace_; // (largest strip,): where the products take parts, W's small bfloat16 part
  bool last_strip_in_workspace_ = false;
};

// The loss pass's (LSE_P, LSE_N, loss, 2σ(Z)) and folded partial (max_P,
// Σ_P, max_N, Σ_N), as float64 device tensors; writes the loss.
template <typename scalar_t>
std::pair<at::Tensor, at::Tensor> loss_scalars(StripPasses<scalar_t>& passes, const at::Tensor& features, at::Tensor& loss) {
  using acc_t = at::opmath_type<scalar_t>;
  const at::Tensor partials = passes.lse_partials();
  at::Tensor scalars = at::empty({4}, features.options().dtype(at::kDouble));
  at::Tensor folded = at::empty({4}, features.options().dtype(at::kDouble));
  launch_finalize<kFinalizeThreads>(partials.data_ptr<acc_t>(), partials.size(0), folded.data_ptr<double>(),
                                    scalars.data_ptr<double>(), loss.data_ptr<scalar_t>());
  return {scalars, folded};
}

// The loss, and with with_grad dloss/dfeatures (else an undefined tensor):
// the one entry point behind both registered kernels.
std::tuple<at::Tensor, at::Tensor> loss_and_grad_cuda(const LossArgs& args, bool with_grad) {
  const auto& [features, labels, margin, gamma] = args;
  const NoAutocast no_autocast;
  const c10::cuda::CUDAGuard guard(features.device());
  const KernelRows block = kernel_rows(features, labels);
  if (fits_small_batch(block.size(), block.dim())) {
    return small_batch_loss(block.features, block.labels, margin, gamma, with_grad);
  }
  at::Tensor loss = at::empty({}, features.options());
  at::Tensor grad;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, features.scalar_type(), "circle_loss_cuda", [&] {
    StripPasses<scalar_t> passes(block, block, /*symmetric=*/true, margin, gamma, with_grad);
    if (!with_grad) {
      loss_scalars(passes, features, loss);
      return;
    }
    // float32/float64 strips of S from cuBLAS, several of them, form S once
    // (loss_and_gradient): that costs less than a second pass. On the tensor
    // cores the second pass costs less than the positive band, and so it
    // does for float32 where TF32 is allowed but rows are not whole 16-byte
    // chunks (cuBLAS's TF32 GEMMs run about six times as fast as float32's,
    // the band kernel not at all faster).
    const bool tf32 = std::is_same_v<scalar_t, float> && cublas_may_use_tf32();
    const bool one_pass = std::is_same_v<scalar_t, at::opmath_type<scalar_t>> && passes.strip_count() > 1 &&
        !passes.on_tensor_cores() && !tf32;
    if (one_pass) {
      grad = passes.loss_and_gradient(loss).to(features.scalar_type());
    } else {
      const auto [scalars, folded] = loss_scalars(passes, features, loss);
      grad = passes.gradient(scalars, folded).to(features.scalar_type());
    }
  });
  return {loss, grad};
}

at::Tensor lse_partials_cuda(const BlockArgs& args) {
  const auto& [rows, row_labels, cols, col_labels, margin, gamma] = args;
  const NoAutocast no_autocast;
  const c10::cuda::CUDAGuard guard(rows.device());
  at::Tensor folded = at::empty({4}, rows.options().dtype(at::kDouble));
  const KernelRows row_block = kernel_rows(rows, row_labels);
  const KernelRows col_block = kernel_rows(cols, col_labels);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rows.scalar_type(), "circle_lse_partials_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    StripPasses<scalar_t> passes(row_block, col_block, /*symmetric=*/false, margin, gamma, /*for_gradient=*/false);
    const at::Tensor partials = passes.lse_partials();
    launch_finalize<kFinalizeThreads, acc_t, float>(
        partials.data_ptr<acc_t>(), partials.size(0), folded.data_ptr<double>(), nullptr, nullptr);
  });
  return folded;
}

at::Tensor lse_finish_cuda(const at::Tensor& partials) { // (n, 4)
  check_partials(partials);
  const c10::cuda::CUDAGuard guard(partials.device());
  at::Tensor scalars = at::empty({4}, partials.options());
  const at::Tensor contiguous = partials.contiguous();
  launch_finalize<kFinalizeThreads, double, float>(
      contiguous.data_ptr<double>(), contiguous.size(0), nullptr, scalars.data_ptr<double>(), nullptr);
  return scalars;
}

at::Tensor block_grad_cuda(const BlockArgs& args, const at::Tensor& scalars) { // scalars: (4,)
  const auto& [rows, row_labels, cols, col_labels, margin, gamma] = args;
  const NoAutocast no_autocast;
  const c10::cuda::CUDAGuard guard(rows.device());
  const KernelRows row_block = kernel_rows(rows, row_labels);
  const KernelRows col_block = kernel_rows(cols, col_labels);
  at::Tensor grad;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rows.scalar_type(), "circle_block_grad_cuda", [&] {
    StripPasses<scalar_t> passes(row_block, col_block, /*symmetric=*/false, margin, gamma, /*for_gradient=*/true);
    grad = passes.gradient(scalars.contiguous());
  });
  return grad;
}

// out = factor · values, the factor read once on the device. Launched as a
// programmatic dependent: its CTAs are placed while the kernel before it (the
// one that wrote factor, in autograd's backward) finishes.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) scale_kernel(
    const scalar_t* __restrict__ values, // (n,), 16-byte aligned
    const scalar_t* __restrict__ factor, // ()
    int64_t n,
    scalar_t* __restrict__ out) { // (n,), 16-byte aligned
  using acc_t = at::opmath_type<scalar_t>;
  using Vector = Packed<scalar_t, kVec<scalar_t>>;
  wait_for_prerequisites();
  const acc_t scale = static_cast<acc_t>(*factor);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t first = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  const int64_t vectors = n / kVec<scalar_t>;
  for (int64_t k = first; k < vectors; k += stride) {
    Vector x = reinterpret_cast<const Vector*>(values)[k];
#pragma unroll
    for (int v = 0; v < kVec<scalar_t>; ++v) x.v[v] = static_cast<scalar_t>(static_cast<acc_t>(x.v[v]) * scale);
    reinterpret_cast<Vector*>(out)[k] = x;
  }
  for (int64_t k = vectors * kVec<scalar_t> + first; k < n; k += stride) {
    out[k] = static_cast<scalar_t>(static_cast<acc_t>(values[k]) * scale);
  }
}

// The backward, grad_loss · the gradient saved by the forward pass, reading
// the 0-dim grad_loss on the device: ATen's mul takes its strided kernel for
// a 0-dim operand (2.2 µs at B = 256, D = 512), this moves 16-byte vectors.
// Anything but what autograd passes (one dtype and device, the saved gradient
// contiguous and aligned) goes to at::mul, which rounds alike.
at::Tensor loss_backward_cuda(
    const at::Tensor& grad_loss, // ()
    const at::Tensor& grad_features) { // (B, D)
  const bool vectorized = grad_loss.dim() == 0 && grad_loss.device() == grad_features.device() &&
      grad_loss.scalar_type() == grad_features.scalar_type() && grad_features.is_contiguous() &&
      reinterpret_cast<uintptr_t>(grad_features.data_ptr()) % 16 == 0;
  if (!vectorized) {
    return at::mul(grad_features, grad_loss);
  }
  const c10::cuda::CUDAGuard guard(grad_features.device());
  at::Tensor out = at::empty_like(grad_features, at::MemoryFormat::Contiguous);
  const int64_t n = grad_features.numel();
  if (n == 0) {
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_features.scalar_type(), "circle_loss_backward_cuda", [&] {
    const int64_t vectors = std::max<int64_t>(n / kVec<scalar_t>, 1);
    const auto blocks = static_cast<unsigned>(std::min<int64_t>((vectors + kThreads - 1) / kThreads, 4096));
    launch_kernel(/*dependent=*/true, scale_kernel<scalar_t>, dim3(blocks), dim3(kThreads), 0,
                  grad_features.data_ptr<scalar_t>(), grad_loss.data_ptr<scalar_t>(), n, out.data_ptr<scalar_t>());
  });
  return out;
}

} // namespace

TORCH_LIBRARY_IMPL(circle, CUDA, m) {
  register_global_kernels<loss_and_grad_cuda, lse_partials_cuda, lse_finish_cuda, block_grad_cuda>(m);
  m.impl("_loss_backward", &loss_backward_cuda);
}

} // namespace circle_loss
