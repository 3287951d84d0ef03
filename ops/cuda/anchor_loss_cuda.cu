// CUDA kernels of circle::anchor_loss, the per-anchor form (docs/math.md).
//
// The same strips of S as the global op's large-batch path (strips.cuh):
// cuBLAS forms each strip, our kernels reduce it, so memory stays O((B + M)·D)
// beyond one strip. Each row keeps a running LSE state (max, Σ) of both pair
// sets, (B, 4) in acc_t, and a strip merges into it:
//   row_states_kernel     one CTA per strip row: the row's pairs in the strip.
//   column_states_kernel  without a reference set, S is symmetric and so is
//                         the logit, so strips cover only the columns from
//                         their first row on (about half of S), and the pairs
//                         right of a strip's diagonal block are also reduced
//                         by column, for the rows they belong to as (j, i).
//   finish_rows_kernel    L_i and (LSE_P(i), LSE_N(i)) from the states.
// The backward forms the strips again: weights_kernel writes
//   W_ij = g_i·σ(Z_i)·exp(z_ij - LSE_set(i))·dz/ds   (+ the same for (j, i)
// without a reference set, from the one entry s_ij), and cuBLAS multiplies:
// dQ = W R and, where the references need a gradient, dR = Wᵀ Q (without a
// reference set both go to Q, as in the global op's gradient pass).
// float16/bfloat16 rows of whole 16-byte chunks, and float32 ones (in TF32
// where it is allowed, large ones as scaled float16 copies, else split into
// TF32 parts that keep float32's accuracy), form S on the tensor cores
// (mma_tiles.cuh) and never write it:
//   tile_states_kernel        the forward: each tile's row states and, without
//                             a reference set, above the diagonal its column
//                             states, written as partials;
//   merge_tile_states_kernel  folds them into the rows' running states;
//   tile_weights_kernel       (mma_tiles.cuh, with AnchorWeightRule) the
//                             backward's W, strip by strip, for cuBLAS as above
//                             (float32's large products in bfloat16 parts, or
//                             with TF32 allowed in float16: float32_split.cuh).
//
// Every reduction runs in an order fixed by the shapes and the GPU, and
// cuBLAS is reproducible on a given GPU, so results are bitwise the same from
// run to run; nothing waits for the host, so the op can be graph-captured.
#include "mma_tiles.cuh"
#include "strips.cuh"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mul.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>
#include <type_traits>

namespace circle_loss {
namespace {

// Merges (positive, negative) into row `row` of the running states (B, 4),
// or, on the row's first visit, writes them there.
template <typename T>
__device__ __forceinline__ void merge_row_state(
    T* states, int64_t row, const LseState<T>& positive, const LseState<T>& negative, bool first_visit) {
  if (first_visit) {
    PairStates<T>{positive, negative}.store_at(states, row);
    return;
  }
  PairStates<T> state = PairStates<T>::at(states, row);
  state.positive.merge(positive.max, positive.sum);
  state.negative.merge(negative.max, negative.sum);
  state.store_at(states, row);
}

// What a row's gradient weights need: its two LSEs and g_i·σ(Z_i) (0 where
// the row's loss is identically 0). Records of a (B, 3) array in acc_t,
// (LSE_P, LSE_N, factor), read and written through at and store_at.
template <typename T>
struct RowCoefficients {
  static constexpr int kValues = 3;
  T lse[2];
  T factor;

  // The coefficients of a row with these LSEs and incoming gradient g.
  __device__ __forceinline__ static RowCoefficients of(T lse_positive, T lse_negative, T g) {
    return {{lse_positive, lse_negative}, g * anchor_row_grad_scale(lse_positive, lse_negative)};
  }

  __device__ __forceinline__ static RowCoefficients at(const T* records, int64_t index) {
    const T* r = records + kValues * index;
    return {{r[0], r[1]}, r[2]};
  }

  __device__ __forceinline__ void store_at(T* records, int64_t index) const {
    T* r = records + kValues * index;
    r[0] = lse[0];
    r[1] = lse[1];
    r[2] = factor;
  }

  // The weight of one pair of this row: factor·exp(z - LSE of its set)·slope.
  __device__ __forceinline__ T weight(T z, bool positive, T slope) const {
    return factor == T(0) ? T(0) : factor * exp(z - lse[positive ? 0 : 1]) * slope;
  }
};

// Adds one pair's logit to the state of its set, unless it belongs to none.
template <typename T>
__device__ __forceinline__ void add_pair(
    const PairLogit<T>& logit, T s, bool positive, bool in_no_set, LseState<T>& pos, LseState<T>& neg) {
  if (in_no_set) return;
  T slope;
  const T z = logit(s, positive, &slope);
  (positive ? pos : neg).add(z, T(1));
}

// Loads per thread in flight before any is used: enough to stream S.
constexpr int kLoadsInFlight = 4;

// The column of the strip (from 0) that holds row r's pair in no set, or -1.
// With a reference set, left_out (the strip's rows, or null) gives each row's
// left-out column of the whole set, and col0 is the strip's first column in
// it. self: the pair (i, i), and col0 counts from the strip's first row
// (first_column).
__device__ __forceinline__ int64_t left_out_column(bool self, const int64_t* left_out, int64_t r, int64_t col0, int64_t cols) {
  if (!self && left_out == nullptr) return -1;
  const int64_t c = (self ? r : left_out[r]) - col0;
  return c >= 0 && c < cols ? c : -1;
}

// The column of the tile whose first column is col0 (within the strip) that
// holds strip row r's pair in no set, or -1; as left_out_column.
__device__ __forceinline__ int tile_left_out_column(
    bool self,
    const int64_t* left_out,
    int64_t r,
    int64_t strip_col0,
    int64_t cols,
    int64_t col0) {
  const int64_t c = left_out_column(self, left_out, r, strip_col0, cols);
  return c >= col0 && c < col0 + kMmaTile ? static_cast<int>(c - col0) : -1;
}

// Row r of the strip: merges its pairs' LSE states into states[r] (writes
// them there on the row's first visit).
template <typename acc_t>
__global__ void __launch_bounds__(kThreads) row_states_kernel(
    const acc_t* __restrict__ s, // (rows, cols)
    int64_t cols,
    int64_t col0, // the strip's first column, as left_out_column counts it
    const int64_t* __restrict__ row_labels, // (rows,)
    const int64_t* __restrict__ col_labels, // (cols,)
    bool self,
    const int64_t* __restrict__ left_out, // (rows,) or null
    PairLogit<acc_t> logit,
    bool first_visit,
    acc_t* __restrict__ states) { // (rows, 4)
  __shared__ acc_t scratch[2 * kWarps];
  const int64_t r = blockIdx.x;
  const acc_t* row = s + r * cols;
  const int64_t label = row_labels[r];
  const int64_t skipped = left_out_column(self, left_out, r, col0, cols);
  LseState<acc_t> positive;
  LseState<acc_t> negative;
  for (int64_t c0 = threadIdx.x; c0 < cols; c0 += kLoadsInFlight * kThreads) {
    acc_t value[kLoadsInFlight];
    int64_t other[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int64_t c = c0 + u * kThreads;
      value[u] = c < cols ? row[c] : acc_t(0);
      other[u] = c < cols ? col_labels[c] : 0;
    }
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int64_t c = c0 + u * kThreads;
      add_pair(logit, value[u], other[u] == label, c >= cols || c == skipped, positive, negative);
    }
  }
  block_fold<kThreads>(positive, negative, scratch);
  if (threadIdx.x == 0) merge_row_state(states, r, positive, negative, first_visit);
}

// Columns [first_col, cols) of a symmetric strip: a CTA takes kColumnsPerCta
// of them, one per lane, so that a warp reads 32 consecutive entries of a row
// at a time, and a share of the rows (blockIdx.y of gridDim.y, so that a
// strip of few columns still fills the GPU); its warps split the share's
// rows, and warp 0 folds the warps' states in warp order. With one share it
// merges them into states[c - first_col]; with several it writes them to
// shares[blockIdx.y][c - first_col], for merge_column_shares_kernel.
constexpr int kColumnsPerCta = 32;
// Shares of a strip's rows: at most this many, of at least kMinShareRows.
constexpr int64_t kMaxColumnShares = 8;
constexpr int64_t kMinShareRows = 128;

template <typename acc_t>
__global__ void __launch_bounds__(kThreads) column_states_kernel(
    const acc_t* __restrict__ s, // (rows, cols)
    int64_t rows,
    int64_t cols,
    int64_t first_col,
    const int64_t* __restrict__ row_labels, // (rows,)
    const int64_t* __restrict__ col_labels, // (cols,)
    PairLogit<acc_t> logit,
    bool first_visit,
    acc_t* __restrict__ states, // (cols - first_col, 4)
    acc_t* __restrict__ shares) { // (gridDim.y, cols - first_col, 4): several shares only
  __shared__ acc_t folded[kWarps][4][kColumnsPerCta];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int64_t c = first_col + blockIdx.x * static_cast<int64_t>(kColumnsPerCta) + lane;
  const bool column = c < cols;
  const int64_t label = column ? col_labels[c] : 0;
  const int64_t share_rows = (rows + gridDim.y - 1) / gridDim.y;
  const int64_t row_end = std::min(rows, (blockIdx.y + 1) * share_rows);
  LseState<acc_t> positive;
  LseState<acc_t> negative;
  for (int64_t r0 = blockIdx.y * share_rows + warp; r0 < row_end; r0 += kLoadsInFlight * kWarps) {
    acc_t value[kLoadsInFlight];
    int64_t other[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int64_t r = r0 + u * kWarps;
      value[u] = column && r < row_end ? s[r * cols + c] : acc_t(0);
      other[u] = r < row_end ? row_labels[r] : 0;
    }
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      add_pair(logit, value[u], other[u] == label, !column || r0 + u * kWarps >= row_end, positive, negative);
    }
  }
  folded[warp][0][lane] = positive.max;
  folded[warp][1][lane] = positive.sum;
  folded[warp][2][lane] = negative.max;
  folded[warp][3][lane] = negative.sum;
  __syncthreads();
  if (warp == 0 && column) {
    LseState<acc_t> p;
    LseState<acc_t> n;
    for (int w = 0; w < kWarps; ++w) {
      p.merge(folded[w][0][lane], folded[w][1][lane]);
      n.merge(folded[w][2][lane], folded[w][3][lane]);
    }
    if (gridDim.y == 1) {
      merge_row_state(states, c - first_col, p, n, first_visit);
    } else {
      PairStates<acc_t>{p, n}.store_at(shares, blockIdx.y * (cols - first_col) + (c - first_col));
    }
  }
}

// Folds column_states_kernel's shares (n_shares, n, 4) in share order and
// merges them into states (n, 4), one thread a column.
template <typename acc_t>
__global__ void __launch_bounds__(kThreads) merge_column_shares_kernel(
    const acc_t* __restrict__ shares, // (n_shares, n, 4)
    int64_t n_shares,
    int64_t n,
    bool first_visit,
    acc_t* __restrict__ states) { // (n, 4)
  const int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (i >= n) return;
  LseState<acc_t> positive;
  LseState<acc_t> negative;
  for (int64_t share = 0; share < n_shares; ++share) {
    const PairStates<acc_t> state = PairStates<acc_t>::at(shares, share * n + i);
    positive.merge(state.positive.max, state.positive.sum);
    negative.merge(state.negative.max, state.negative.sum);
  }
  merge_row_state(states, i, positive, negative, first_visit);
}

// L_i of every row from its state, and either (LSE_P(i), LSE_N(i)) for the
// backward or the row's coefficients for an incoming gradient of 1.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) finish_rows_kernel(
    const acc_t* __restrict__ states, // (B, 4)
    int64_t batch,
    scalar_t* __restrict__ losses, // (B,)
    acc_t* __restrict__ row_lse, // (B, 2) or null
    acc_t* __restrict__ coefficients) { // (B, 3) or null
  const int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (i >= batch) return;
  const PairStates<acc_t> state = PairStates<acc_t>::at(states, i);
  const acc_t lse_positive = state.positive.lse();
  const acc_t lse_negative = state.negative.lse();
  if (row_lse != nullptr) {
    row_lse[2 * i] = lse_positive;
    row_lse[2 * i + 1] = lse_negative;
  }
  if (coefficients != nullptr) {
    RowCoefficients<acc_t>::of(lse_positive, lse_negative, acc_t(1)).store_at(coefficients, i);
  }
  losses[i] = static_cast<scalar_t>(static_cast<acc_t>(anchor_row_loss(lse_positive, lse_negative)));
}

// coefficients[i] = (LSE_P(i), LSE_N(i), g_i·σ(Z_i)).
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads) coefficients_kernel(
    const scalar_t* __restrict__ grad_losses, // (B,)
    const acc_t* __restrict__ row_lse, // (B, 2)
    int64_t batch,
    acc_t* __restrict__ coefficients) { // (B, 3)
  const int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (i >= batch) return;
  RowCoefficients<acc_t>::of(row_lse[2 * i], row_lse[2 * i + 1], static_cast<acc_t>(grad_losses[i]))
      .store_at(coefficients, i);
}

// The gradient weights of every entry of a strip (rows from row0, columns
// from col0 of their sets); the left-out pairs have none. self: each entry
// also carries the weight of its mirrored pair (j, i), whose logit is the same.
template <typename acc_t, typename weight_t>
__global__ void __launch_bounds__(kThreads) weights_kernel(
    const acc_t* s, // (rows, cols)
    int64_t rows,
    int64_t cols,
    const int64_t* __restrict__ row_labels, // (rows,)
    const int64_t* __restrict__ col_labels, // (cols,)
    int64_t row0,
    int64_t col0,
    bool self,
    const int64_t* __restrict__ left_out, // (rows,) or null
    PairLogit<acc_t> logit,
    const acc_t* __restrict__ row_coefficients, // (rows, 3)
    const acc_t* __restrict__ col_coefficients, // (cols, 3): self only
    weight_t* weights) { // (rows, cols), may be s
  for_each_entry(s, rows, cols, row_labels, col_labels, [&](int64_t r, int64_t c, acc_t s_rc, bool positive) {
    acc_t slope;
    const acc_t z = logit(s_rc, positive, &slope);
    acc_t w = RowCoefficients<acc_t>::at(row_coefficients, r).weight(z, positive, slope);
    if (self) {
      w += RowCoefficients<acc_t>::at(col_coefficients, c).weight(z, positive, slope);
      if (row0 + r == col0 + c) w = acc_t(0);
    } else if (left_out != nullptr && left_out[r] == col0 + c) {
      w = acc_t(0);
    }
    weights[r * cols + c] = static_cast<weight_t>(w);
  });
}

// tile_weights_kernel's rule for the per-anchor form: weights_kernel's W,
// from the coefficients of the tile's rows (and, without a reference set,
// of its columns), held in shared memory as (-LSE_P, -LSE_N, factor) in
// Units (TileUnits).
//
// An entry carries the weights of (i, j) and (j, i), which share exp(z), so
// where a tile allows it they take one exp an entry (docs/math.md, "A
// pair's two weights"): exp(z - B)·(a_i + a_j), B the least LSE of the
// entry's set over the tile's rows and columns, a_k = f_k·exp(B - LSE_k)
// made once a row and column. exp(z - B) is at most exp(LSE_i - B) (z ≤
// LSE_i), so it stays in range where each set's LSEs lie within
// kSharedExpSpan of one another (log2 units), and every a_k ≠ 0 is a normal
// float where none lies below 2^-kSharedExpSpan. Other tiles (LSEs far
// apart, factors far below the LSEs' scale, values that are not finite)
// take the two exps.
template <typename Units>
struct AnchorWeightRule {
  PairLogit<float> logit;
  const float* row_coefficients; // (n_rows, 3): the strip's rows
  const float* col_coefficients; // (n_cols, 3): the strip's columns without a reference set, else null
  int64_t n_rows;
  int64_t n_cols;
  int64_t first_col; // the strip's, as left_out_column counts it
  const int64_t* left_out; // (n_rows,): with a reference set, each row's left-out column of it; or null
  const float* weight_scale; // (): a power of two W is taken times (HalfProducts), or null

  static constexpr float kSharedExpSpan = 124.0f;
  static constexpr float kToLog2 = kLog2e / Units::kScale; // log2 units a unit of Units

  // What decides whether a tile shares one exp an entry, over some of its
  // rows and columns: each set's greatest and least offset -LSE (Units)
  // and least log2|f| + offset (log2 units, over f ≠ 0), and whether all
  // are finite. Sets without pairs (offset +inf) count in none.
  struct Span {
    float most[2];
    float least[2];
    float least_share[2];
    bool finite;

    __device__ __forceinline__ static Span of(const float4& c, bool inside) {
      constexpr float kInf = std::numeric_limits<float>::infinity();
      Span span{{-kInf, -kInf}, {kInf, kInf}, {kInf, kInf}, isfinite(c.z)};
      if (!inside) return span;
#pragma unroll
      for (int set = 0; set < 2; ++set) {
        const float offset = set == 0 ? c.x : c.y;
        if (offset == kInf) continue;
        span.finite = span.finite && offset > -kInf; // false for NaN too
        span.most[set] = span.least[set] = offset;
        if (c.z != 0.0f) span.least_share[set] = __log2f(fabsf(c.z)) + offset * kToLog2;
      }
      return span;
    }

    // Every lane takes the merge of its aligned group of `group` lanes (a
    // power of two). finite is voted over the whole warp: the group's where
    // the group is the warp, or where every group holds the same spans.
    __device__ __forceinline__ void merge_lanes(int group) {
#pragma unroll
      for (int lanes = group / 2; lanes > 0; lanes >>= 1) {
#pragma unroll
        for (int set = 0; set < 2; ++set) {
          most[set] = fmaxf(most[set], __shfl_xor_sync(0xffffffffu, most[set], lanes));
          least[set] = fminf(least[set], __shfl_xor_sync(0xffffffffu, least[set], lanes));
          least_share[set] = fminf(least_share[set], __shfl_xor_sync(0xffffffffu, least_share[set], lanes));
        }
      }
      finite = __all_sync(0xffffffffu, finite);
    }

    __device__ __forceinline__ bool shares_exp() const {
      bool shares = finite;
#pragma unroll
      for (int set = 0; set < 2; ++set) {
        if (most[set] == -std::numeric_limits<float>::infinity()) continue; // no pairs
        shares = shares && (most[set] - least[set]) * kToLog2 <= kSharedExpSpan &&
            most[set] * kToLog2 - least_share[set] <= kSharedExpSpan;
      }
      return shares;
    }

    // The offset Units::weight_term takes for exp(z - B), B the set's least LSE.
    __device__ __forceinline__ float base(int set) const {
      return most[set] == -std::numeric_limits<float>::infinity() ? 0.0f : most[set];
    }

    // a_k = f·exp(B - LSE_k) of both sets for one row's or column's coefficients.
    __device__ __forceinline__ float2 shares(const float4& c) const {
      const auto share = [&](float offset, int set) {
        return c.z == 0.0f || offset == std::numeric_limits<float>::infinity()
            ? 0.0f
            : c.z * exp2f((offset - most[set]) * kToLog2);
      };
      return make_float2(share(c.x, 0), share(c.y, 1));
    }
  };

  struct Shared {
    float4 row[kMmaTile]; // (-LSE_P, -LSE_N in Units, factor, unused); factor 0 past the end
    float4 col[kMmaTile]; // the same for the columns; factor 0 with a reference set
    float2 row_shares[kMmaTile]; // (a_k of P, of N), where the tile shares one exp an entry
    float2 col_shares[kMmaTile];
    int skipped[kMmaTile]; // the column of the tile with each row's pair in no set, or -1
    Span spans[kMmaThreads / 32]; // each warp's
  };

  // A row's or column's (B, 3) record as Shared holds it, its factor times
  // scale, or none (factor 0).
  __device__ __forceinline__ static float4 scaled(const float* records, int64_t index, bool inside, float scale) {
    if (!inside) return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const RowCoefficients<float> c = RowCoefficients<float>::at(records, index);
    return make_float4(Units::offset(c.lse[0]).hi, Units::offset(c.lse[1]).hi, c.factor * scale, 0.0f);
  }

  // factor·exp(z - LSE of the set) for one side's coefficients, u = z in
  // Units.
  __device__ __forceinline__ static float term(const float4& c, float u, bool positive) {
    return c.z == 0.0f ? 0.0f : c.z * Units::weight_term(u, positive ? c.x : c.y);
  }

  __device__ __forceinline__ void load(Shared& shared, int64_t row0, int64_t col0) const {
    static_assert(2 * kMmaTile == kMmaThreads, "one row or column a thread");
    const int i = threadIdx.x % kMmaTile;
    const bool self = col_coefficients != nullptr;
    const float scale = weight_scale != nullptr ? *weight_scale : 1.0f;
    Span span;
    if (threadIdx.x < kMmaTile) {
      const int64_t r = row0 + i;
      const bool inside = r < n_rows;
      shared.row[i] = scaled(row_coefficients, r, inside, scale);
      shared.skipped[i] = inside ? tile_left_out_column(self, left_out, r, first_col, n_cols, col0) : -1;
      span = Span::of(shared.row[i], inside);
    } else {
      const int64_t c = col0 + i;
      const bool inside = self && c < n_cols;
      shared.col[i] = scaled(col_coefficients, c, inside, scale);
      span = Span::of(shared.col[i], inside);
    }
    span.merge_lanes(32);
    if (threadIdx.x % 32 == 0) shared.spans[threadIdx.x / 32] = span;
  }

  // Once load's writes are visible to every thread: visit(weight) with
  // the tile's weight(s, positive, r, c), each thread in the same branch.
  template <typename Visit>
  __device__ __forceinline__ void with_weight(Shared& shared, Visit visit) const {
    const TileLogit tile_logit(logit, Units::kScale);
    const float half_gamma = 0.5f * logit.gamma; // the slope is ∓half_gamma·twice_alpha
    constexpr int kWarps = kMmaThreads / 32;
    Span span = shared.spans[threadIdx.x % kWarps];
    span.merge_lanes(kWarps);
    if (!span.shares_exp()) {
      visit([&shared, tile_logit, half_gamma](float s, bool positive, int r, int c) {
        float twice_alpha;
        const float u = tile_logit(s, positive, &twice_alpha);
        const float w = (term(shared.row[r], u, positive) + term(shared.col[c], u, positive)) * twice_alpha;
        return c == shared.skipped[r] ? 0.0f : w * (positive ? -half_gamma : half_gamma);
      });
      return;
    }
    const int i = threadIdx.x % kMmaTile;
    if (threadIdx.x < kMmaTile) {
      shared.row_shares[i] = span.shares(shared.row[i]);
    } else {
      shared.col_shares[i] = span.shares(shared.col[i]);
    }
    __syncthreads();
    const float positive_base = span.base(0);
    const float negative_base = span.base(1);
    visit([&shared, tile_logit, half_gamma, positive_base, negative_base](float s, bool positive, int r, int c) {
      float twice_alpha;
      const float u = tile_logit(s, positive, &twice_alpha);
      const float2 row = shared.row_shares[r];
      const float2 col = shared.col_shares[c];
      const float share = positive ? row.x + col.x : row.y + col.y;
      // A weightless pair (its row's factor 0, a row outside the span) may
      // lie far past the base, where float32 cannot resolve its logit (|margin|
      // of 1e4 and more): 0, not inf·0.
      const float w =
          share == 0.0f ? 0.0f : Units::weight_term(u, positive ? positive_base : negative_base) * share * twice_alpha;
      return c == shared.skipped[r] ? 0.0f : w * (positive ? -half_gamma : half_gamma);
    });
  }
};

// The most a grid's y may count.
constexpr int64_t kMaxGridY = 65535;

// What tile_states_kernel keeps in the stages' memory once its products are
// done: the tile's logits for the column states, each warp's states of its
// share of the rows, and each column's states over the tile's lower half of
// rows, as PairStates records.
struct TileStatesScratch {
  static constexpr int kStride = kMmaTile + 8; // padded rows: a warp's paired stores fall in distinct banks
  float logits[kMmaTile * kStride]; // in TileUnits; -inf where an entry is no pair
  float row_states[TileAccumulators::kWarpsPerRow * kMmaTile * PairStates<float>::kValues];
  float col_states[kMmaTile * PairStates<float>::kValues]; // the tile's lower half of rows
};
static_assert(sizeof(TileStatesScratch) <= kMmaSharedBytes - kStageAlignment, "the scratch fits in the stages");

// Which entries of a tile are pairs: the strip's self pair (i, i) on a
// diagonal tile, the rows' left-out columns, and anything past the ends are not.
struct TilePairs {
  int skipped[kMmaTile]; // the column of the tile with each row's pair in no set, or -1
  int valid_rows;
  int valid_cols;
};

// The row states of a tile whose entries hold S on entry and, on exit, their
// logits in Units (-inf where they are no pair): each warp's
// (max, Σ exp(z - max)) of both sets over its share of each row, in
// scratch.row_states[row_warp()][row]. kEveryEntry: every entry is a pair,
// and none is tested.
template <bool kEveryEntry, typename Units>
__device__ __forceinline__ void tile_row_states(
    TileAccumulators& tile,
    const TileLabels& labels,
    const TilePairs& pairs,
    const TileLogit& logit,
    TileStatesScratch& scratch) {
  constexpr int kSlots = TileAccumulators::kRowSlots;
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  // Plain arrays, each entry updating one by a predicated instruction, keep
  // them in registers.
  float positive_max[kSlots];
  float negative_max[kSlots];
  float positive_sum[kSlots] = {};
  float negative_sum[kSlots] = {};
#pragma unroll
  for (int slot = 0; slot < kSlots; ++slot) positive_max[slot] = negative_max[slot] = kNone;
  // The pairs of each of the thread's rows: the columns below its end (0
  // for a row past the tile's end) but the skipped one.
  int end[kSlots];
  int skipped[kSlots];
  if constexpr (!kEveryEntry) {
#pragma unroll
    for (int slot = 0; slot < kSlots; ++slot) {
      const int r = TileAccumulators::slot_row(slot);
      end[slot] = r < pairs.valid_rows ? pairs.valid_cols : 0;
      skipped[slot] = pairs.skipped[r];
    }
  }
  tile.for_each([&](float& s, int r, int c, int k) {
    const bool in_positive = labels.positive(r, c);
    const int slot = TileAccumulators::row_slot(k);
    float twice_alpha;
    s = logit(s, in_positive, &twice_alpha);
    if constexpr (!kEveryEntry) {
      if (c >= end[slot] || c == skipped[slot]) s = kNone;
    }
    if (in_positive) {
      positive_max[slot] = fast_nan_max(positive_max[slot], s);
    } else {
      negative_max[slot] = fast_nan_max(negative_max[slot], s);
    }
  });
  float positive_base[kSlots];
  float negative_base[kSlots];
#pragma unroll
  for (int slot = 0; slot < kSlots; ++slot) {
#pragma unroll
    for (int lanes = 1; lanes < 4; lanes <<= 1) {
      positive_max[slot] = fast_nan_max(positive_max[slot], __shfl_xor_sync(0xffffffffu, positive_max[slot], lanes));
      negative_max[slot] = fast_nan_max(negative_max[slot], __shfl_xor_sync(0xffffffffu, negative_max[slot], lanes));
    }
    positive_base[slot] = exponent_base(positive_max[slot]);
    negative_base[slot] = exponent_base(negative_max[slot]);
  }
  int2 column_ids;
  tile.for_each([&](float u, int r, int c, int k) {
    if (k % 4 == 0) column_ids = labels.column_pair_anew(c); // the fragment's columns c and c + 1
    const int slot = TileAccumulators::row_slot(k);
    const bool in_positive = labels.row[r] == (k % 2 == 0 ? column_ids.x : column_ids.y);
    const float term = Units::term(u, in_positive ? positive_base[slot] : negative_base[slot]);
    if (in_positive) {
      positive_sum[slot] += term;
    } else {
      negative_sum[slot] += term;
    }
  });
#pragma unroll
  for (int slot = 0; slot < kSlots; ++slot) {
#pragma unroll
    for (int lanes = 1; lanes < 4; lanes <<= 1) {
      positive_sum[slot] += __shfl_xor_sync(0xffffffffu, positive_sum[slot], lanes);
      negative_sum[slot] += __shfl_xor_sync(0xffffffffu, negative_sum[slot], lanes);
    }
    if (threadIdx.x % 4 == 0) {
      PairStates<float>{Units::state(positive_max[slot], positive_sum[slot]),
                        Units::state(negative_max[slot], negative_sum[slot])}
          .store_at(scratch.row_states, TileAccumulators::row_warp() * kMmaTile + TileAccumulators::slot_row(slot));
    }
  }
}

// Row and column partial states of one kMmaTile² tile of a strip's
// rows · colsᵀ, formed on the tensor cores and reduced in place, S never in
// memory: the forward on the tensor cores. Every tile gives its rows'
// states over its columns, row_partials[row][tj]. Without a reference set
// (cols is the strip's rows onwards) only the tiles on and above the strip's
// diagonal are formed, and those above it also give their columns' states
// over the tile's rows, col_partials[col][ti]: the pairs (j, i) of the rows
// they belong to. Each row's (column's) partials lie together, for the fold.
// Every share of a row or column is summed against its own maximum, so the
// states are exact however far apart the logits lie: one exp an entry for
// the rows, one more for the columns. Units: those of the features' dtype
// (HalfFeatures' float16 operands keep float32's).
template <typename T, typename Units>
__global__ void __launch_bounds__(kMmaThreads, 2) tile_states_kernel(
    const __grid_constant__ TileOperands<T> in,
    bool self,
    const int64_t* __restrict__ left_out, // (n_rows,): with a reference set, each row's left-out column of it; or null
    int64_t strip_col0, // the strip's first column, as left_out_column counts it
    PairLogit<float> logit,
    float* __restrict__ row_partials, // (n_rows, col_tiles, 4)
    float* __restrict__ col_partials) { // (n_cols, row_tiles, 4): self only
  const int64_t ti = blockIdx.x;
  const int64_t tj = blockIdx.y;
  if (self && tj < ti) return;
  extern __shared__ __align__(128) unsigned char stages[];
  __shared__ TileLabels labels;
  __shared__ TilePairs pairs;
  __shared__ TileUnit unit;
  const int64_t row0 = ti * kMmaTile;
  const int64_t col0 = tj * kMmaTile;
  TileAccumulators tile;
  bool labels_fit;
  multiply_tile(tile, in, row0, col0, stage_memory<T>(stages), [&] {
    labels_fit = labels.load(in, row0, col0);
    unit.load(in);
    if (threadIdx.x < kMmaTile) {
      const int64_t r = row0 + threadIdx.x;
      pairs.skipped[threadIdx.x] =
          r < in.n_rows ? tile_left_out_column(self, left_out, r, strip_col0, in.n_cols, col0) : -1;
    }
    if (threadIdx.x == 0) {
      pairs.valid_rows = static_cast<int>(std::min<int64_t>(in.n_rows - row0, kMmaTile));
      pairs.valid_cols = static_cast<int>(std::min<int64_t>(in.n_cols - col0, kMmaTile));
    }
  });
  labels.settle(labels_fit, in, row0, col0, stages); // the labels, pairs and unit, and every warp is done with the stages
  unit.apply(in, tile);
  TileStatesScratch& scratch = *stage_memory<TileStatesScratch>(stages);
  const bool every_entry = pairs.valid_rows == kMmaTile && pairs.valid_cols == kMmaTile && !(self && ti == tj) &&
      left_out == nullptr;
  const TileLogit tile_logit(logit, Units::kScale);
  if (every_entry) {
    tile_row_states<true, Units>(tile, labels, pairs, tile_logit, scratch);
  } else {
    tile_row_states<false, Units>(tile, labels, pairs, tile_logit, scratch);
  }
  const bool columns = self && tj > ti;
  if (columns) {
    // The logits to shared memory, two adjacent columns a store.
#pragma unroll
    for (int f = 0; f < TileAccumulators::kFragments; ++f) {
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int r = TileAccumulators::row_of(f, e);
        const int c = TileAccumulators::col_of(f, e);
        *reinterpret_cast<float2*>(&scratch.logits[r * TileStatesScratch::kStride + c]) =
            make_float2(tile.acc[f][e], tile.acc[f][e + 1]);
      }
    }
  }
  __syncthreads(); // the row states and the logits
  if (threadIdx.x < kMmaTile && row0 + threadIdx.x < in.n_rows) {
    PairStates<float> state = PairStates<float>::at(scratch.row_states, threadIdx.x);
    for (int w = 1; w < TileAccumulators::kWarpsPerRow; ++w) {
      state.merge(PairStates<float>::at(scratch.row_states, w * kMmaTile + threadIdx.x));
    }
    state.store_at(row_partials, (row0 + threadIdx.x) * gridDim.y + tj);
  }
  if (!columns) return;
  // Column c of the tile, over half its rows a thread: its maxima, then its
  // sums at them.
  constexpr int kHalf = kMmaTile / 2;
  static_assert(2 * kMmaTile == kMmaThreads, "a column's two halves");
  const int c = threadIdx.x % kMmaTile;
  const int first = threadIdx.x / kMmaTile * kHalf;
  const int32_t label = labels.col[c];
  const float* logits = scratch.logits + first * TileStatesScratch::kStride + c;
  // Plain floats, each entry picking one by a select, as for the rows: a
  // reference to one set's state or the other's would keep them in local
  // memory, a load and a store an entry.
  uint64_t positives = 0;
  float positive_max = -std::numeric_limits<float>::infinity();
  float negative_max = -std::numeric_limits<float>::infinity();
#pragma unroll 8
  for (int r = 0; r < kHalf; ++r) {
    const bool in_positive = labels.row[first + r] == label;
    positives |= static_cast<uint64_t>(in_positive) << r;
    const float u = logits[r * TileStatesScratch::kStride];
    if (in_positive) {
      positive_max = fast_nan_max(positive_max, u);
    } else {
      negative_max = fast_nan_max(negative_max, u);
    }
  }
  const float positive_base = exponent_base(positive_max);
  const float negative_base = exponent_base(negative_max);
  float positive_sum = 0.0f;
  float negative_sum = 0.0f;
#pragma unroll 8
  for (int r = 0; r < kHalf; ++r) {
    const bool in_positive = (positives >> r & 1u) != 0u;
    const float term = Units::term(logits[r * TileStatesScratch::kStride], in_positive ? positive_base : negative_base);
    positive_sum += in_positive ? term : 0.0f;
    negative_sum += in_positive ? 0.0f : term;
  }
  PairStates<float> state{Units::state(positive_max, positive_sum), Units::state(negative_max, negative_sum)};
  if (first != 0) state.store_at(scratch.col_states, c);
  __syncthreads();
  if (first == 0 && col0 + c < in.n_cols) {
    state.merge(PairStates<float>::at(scratch.col_states, c));
    state.store_at(col_partials, (col0 + c) * gridDim.x + ti);
  }
}

// The strip's tile partials folded, in a fixed order, into the running states
// (n, 4) of the rows they belong to, from the strip's first row (merged, or
// written on first_visit), a warp each: rows [0, n_rows) take their tiles'
// row partials from their own tile on (self) or all of them; without a
// reference set, strip row or later row i (i < n_cols) also takes the column
// partials of the strip's row tiles above its own.
__global__ void __launch_bounds__(kThreads) merge_tile_states_kernel(
    const float* __restrict__ row_partials, // (n_rows, col_tiles, 4)
    const float* __restrict__ col_partials, // (n_cols, row_tiles, 4): self only
    int64_t n_rows,
    int64_t n_cols,
    bool self,
    bool first_visit,
    float* __restrict__ states) { // (self ? n_cols : n_rows, 4)
  const int64_t i = (blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x) / 32;
  if (i >= (self ? n_cols : n_rows)) return; // the warp as a whole
  constexpr int64_t kValues = PairStates<float>::kValues;
  const int64_t own_tile = i / kMmaTile;
  const int64_t col_tiles = tiles(n_cols);
  const int64_t row_tiles = tiles(n_rows);
  PairStates<float> state;
  if (i < n_rows) {
    const int64_t first = self ? own_tile : 0;
    fold_partials<32, FoldOrder::kBlockMaxFirst>(row_partials + kValues * (i * col_tiles + first), col_tiles - first,
                                                 static_cast<float*>(nullptr), state.positive, state.negative);
  }
  if (self) {
    PairStates<float> mirrored;
    fold_partials<32, FoldOrder::kBlockMaxFirst>(col_partials + kValues * i * row_tiles, std::min(own_tile, row_tiles),
                                                 static_cast<float*>(nullptr), mirrored.positive, mirrored.negative);
    state.merge(mirrored);
  }
  if (threadIdx.x % 32 == 0) merge_row_state(states, i, state.positive, state.negative, first_visit);
}

unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>((n + kThreads - 1) / kThreads, 1));
}

// Without a reference set, strips of S start at their first row, so k strips
// form (1 + 1/k)/2 of S, and forward plus backward do 2 + 1/k GEMMs' work:
// at least two strips, however many rows the budget would allow, but one for
// batches whose time goes to launching the kernels rather than to their work
// (a second strip adds six launches). More strips cost more in smaller,
// slower GEMMs and launches than they save (bench/NOTES.md).
constexpr int64_t kSymmetricStrips = 2;
constexpr int64_t kOneStripBatch = 2048;

int64_t max_strip_height(int64_t batch, bool self) {
  if (!self || batch <= kOneStripBatch) return std::numeric_limits<int64_t>::max();
  const int64_t rows = (batch + kSymmetricStrips - 1) / kSymmetricStrips;
  return std::max<int64_t>((rows + kStripAlign - 1) / kStripAlign * kStripAlign, kStripAlign);
}

// The op's inputs as the kernels read them, and the strips of their pairs.
template <typename scalar_t>
class AnchorPasses {
 public:
  using acc_t = at::opmath_type<scalar_t>;

  // left_out: (B,) int64 with a reference set, each row's pair in no set as
  // a column of it, or undefined.
  AnchorPasses(const KernelRows& q, const KernelRows& r, bool self, const at::Tensor& left_out, double margin, double gamma)
      : q_(q),
        r_(r),
        self_(self),
        left_out_(left_out),
        logit_{static_cast<acc_t>(margin), static_cast<acc_t>(gamma)},
        strips_(plan_strips(q.size(), r.size(), /*symmetric=*/self, sizeof(acc_t), max_strip_height(q.size(), self))),
        sms_(multiprocessors()),
        accumulation_(q.features.options().dtype(dtype_of<acc_t>())),
        largest_strip_(strips_.empty() ? 0 : strips_.front().rows * strips_.front().cols) {
    if constexpr (kHasMmaTiles<scalar_t>) {
      // float32's tiles include the float16 ones, which HalfFeatures take.
      tensor_cores_ = tiles_take<scalar_t>(q.features) && tiles_take<scalar_t>(r.features) && tiles_built<scalar_t>() &&
          (!std::is_same_v<scalar_t, float> || tiles_built<c10::Half>()) && tiles(r.size()) <= kMaxGridY;
      takes_halves_ = tensor_cores_ && std::is_same_v<scalar_t, float> && takes_half_features(q.size(), r.size(), q.dim());
    }
  }

  // Writes losses (B,) and row_lse (B, 2).
  void forward(at::Tensor& losses, at::Tensor& row_lse) {
    const int64_t batch = q_.size();
    at::Tensor states = at::empty({batch, PairStates<acc_t>::kValues}, accumulation_);
    acc_t* state = states.data_ptr<acc_t>();
    if (tensor_cores_) {
      take_tile_features(/*for_gradient=*/false);
      reduce_on_tiles(state);
    } else {
      for (const Strip& strip : strips_) {
        reduce_strip(strip, strip_similarities(q_, r_, strip, similarity_space()), state);
      }
    }
    finish_rows_kernel<scalar_t, acc_t><<<blocks_for(batch), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        state, batch, losses.data_ptr<scalar_t>(), row_lse.data_ptr<acc_t>(), nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // With a reference set: writes losses (B,) and row_grads (B, D) in acc_t,
  // row i = dL_i/dq_i. A strip spans every column, so its rows are finished
  // once it is reduced, and their weights for an incoming gradient of 1 come
  // from the same S before the next strip takes the workspace: S is formed
  // once, where forward and backward form it twice.
  void forward_with_row_grads(at::Tensor& losses, at::Tensor& row_grads) {
    TORCH_INTERNAL_ASSERT(!self_);
    const auto stream = c10::cuda::getCurrentCUDAStream();
    const int64_t batch = q_.size();
    at::Tensor states = at::empty({batch, PairStates<acc_t>::kValues}, accumulation_);
    at::Tensor coefficients = at::empty({batch, RowCoefficients<acc_t>::kValues}, accumulation_);
    const at::Tensor weight_space = make_weight_space(largest_strip_, /*over_similarities=*/true);
    if (r_.size() == 0) row_grads.zero_();
    for (const Strip& strip : strips_) {
      const at::Tensor s = strip_similarities(q_, r_, strip, similarity_space());
      acc_t* state = states.data_ptr<acc_t>() + PairStates<acc_t>::kValues * strip.row0;
      acc_t* coefficient = coefficients.data_ptr<acc_t>() + RowCoefficients<acc_t>::kValues * strip.row0;
      reduce_strip(strip, s, states.data_ptr<acc_t>());
      finish_rows_kernel<scalar_t, acc_t><<<blocks_for(strip.rows), kThreads, 0, stream>>>(
          state, strip.rows, losses.data_ptr<scalar_t>() + strip.row0, nullptr, coefficient);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (strip.cols == 0) continue;
      const at::Tensor weights = launch_weights(strip, s, weight_space, coefficient, nullptr);
      matmul_into(row_grads.narrow(0, strip.row0, strip.rows), weights, r_.features);
    }
  }

  // (dQ (B, D), dR (M, D) if ref_grad, else (0, D)), in acc_t.
  std::tuple<at::Tensor, at::Tensor> backward(const at::Tensor& grad_losses, const at::Tensor& row_lse, bool ref_grad) {
    const auto stream = c10::cuda::getCurrentCUDAStream();
    const int64_t batch = q_.size();
    const int64_t dim = q_.dim();
    at::Tensor coefficients = at::empty({batch, RowCoefficients<acc_t>::kValues}, accumulation_);
    coefficients_kernel<scalar_t, acc_t><<<blocks_for(batch), kThreads, 0, stream>>>(
        grad_losses.data_ptr<scalar_t>(), row_lse.data_ptr<acc_t>(), batch, coefficients.data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    at::Tensor grad_q = at::empty({batch, dim}, accumulation_);
    ref_grad = ref_grad && !self_;
    at::Tensor grad_r = at::empty({ref_grad ? r_.size() : 0, dim}, accumulation_);
    if (batch == 0 || r_.size() == 0) {
      grad_q.zero_();
      grad_r.zero_();
      return {grad_q, grad_r};
    }
    const std::vector<Strip> strips = gradient_strips();
    if (tensor_cores_) take_tile_features(/*for_gradient=*/true);
    HalfProducts halves;
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (takes_halves_) {
        // W / |dz/ds| = g_i·σ(Z_i)·exp(z - LSE_set(i)) is at most the largest
        // |factor|, twice without a reference set (an entry carries (i, j)
        // and (j, i)).
        const at::Tensor factor = at::mul(at::amax(at::abs(coefficients.select(1, 2))), self_ ? 2.0 : 1.0);
        halves = HalfProducts(half_features_, factor, logit_);
      }
    }
    const int64_t largest = strips.front().rows * strips.front().cols;
    // W in bfloat16 parts where the products take the features' parts
    // (float32_split.cuh), in float16 for HalfProducts.
    const bool in_parts = tensor_cores_ && q_tiles_.has_parts();
    const at::Tensor weight_space = in_parts ? at::empty({largest}, q_.features.options().dtype(at::kBFloat16))
        : halves.defined()                   ? at::empty({largest}, q_.features.options().dtype(at::kHalf))
                                             : make_weight_space(largest, /*over_similarities=*/!tensor_cores_);
    const at::Tensor small_weight_space = in_parts ? at::empty_like(weight_space) : at::Tensor();
    const SplitMatrix q = halves.defined() ? halves.rows()
        : tensor_cores_                    ? q_tiles_.parts()
                                           : SplitMatrix{q_.features, {}};
    const SplitMatrix r = halves.defined() ? halves.cols()
        : tensor_cores_                    ? r_tiles_.parts()
                                           : SplitMatrix{r_.features, {}};
    // Last strip first: a strip writes its own rows before any earlier one
    // adds its mirrored share to them; with a reference set the last strip's
    // chunks write dR, the earlier ones add to it.
    for (auto strip = strips.crbegin(); strip != strips.crend(); ++strip) {
      const acc_t* coefficient = coefficients.data_ptr<acc_t>();
      constexpr int kValues = RowCoefficients<acc_t>::kValues;
      const acc_t* row_coefficients = coefficient + kValues * strip->row0;
      const acc_t* col_coefficients = self_ ? coefficient + kValues * strip->col0 : nullptr;
      const SplitMatrix weights = tensor_cores_
          ? launch_tile_weights(*strip, weight_space, small_weight_space, row_coefficients, col_coefficients,
                                halves.defined() ? halves.weight_scale() : nullptr,
                                /*after_products=*/strip != strips.crbegin())
          : SplitMatrix{launch_weights(*strip, strip_similarities(q_, r_, *strip, similarity_space()), weight_space,
                                       row_coefficients, col_coefficients),
                        {}};
      const SplitMatrix own_rows = q.narrow(0, strip->row0, strip->rows);
      split_matmul(grad_q.narrow(0, strip->row0, strip->rows), weights, r.narrow(0, strip->col0, strip->cols),
                   /*accumulate=*/!last_chunk_of_rows(strips, strip));
      if (self_ && strip->mirrored() > 0) {
        split_matmul(grad_q.narrow(0, strip->first_mirrored(), strip->mirrored()),
                     weights.narrow(1, strip->first_mirrored() - strip->col0, strip->mirrored()).t(), own_rows,
                     /*accumulate=*/true);
      } else if (!self_ && ref_grad) {
        split_matmul(grad_r.narrow(0, strip->col0, strip->cols), weights.t(), own_rows,
                     /*accumulate=*/strip->row0 != strips.back().row0);
      }
    }
    if (halves.defined()) {
      halves.unscale(grad_q);
      halves.unscale(grad_r);
    }
    return {grad_q, grad_r};
  }

 private:
  // Merges the pairs of strip (its S given) into the running states (B, 4)
  // of the rows they belong to. The first strip visits every row first: all
  // of its own rows' pairs and, without a reference set, the later rows'
  // pairs with its rows; so the states need no initial value.
  void reduce_strip(const Strip& strip, const at::Tensor& s, acc_t* states) const {
    const auto stream = c10::cuda::getCurrentCUDAStream();
    const bool first_visit = !self_ || strip.row0 == 0;
    row_states_kernel<acc_t><<<static_cast<unsigned>(strip.rows), kThreads, 0, stream>>>(
        s.data_ptr<acc_t>(), strip.cols, first_column(strip), row_labels(strip), col_labels(strip), self_, left_out(strip),
        logit_, first_visit, states + PairStates<acc_t>::kValues * strip.row0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int64_t beyond = strip.mirrored(); // columns right of the diagonal block
    if (self_ && beyond > 0) {
      const int64_t blocks = (beyond + kColumnsPerCta - 1) / kColumnsPerCta;
      const int64_t shares = std::clamp<int64_t>(
          std::min((2 * sms_ + blocks - 1) / blocks, strip.rows / kMinShareRows), 1, kMaxColumnShares);
      acc_t* beyond_states = states + PairStates<acc_t>::kValues * strip.first_mirrored();
      const at::Tensor share_states =
          at::empty({shares > 1 ? shares * beyond : 0, PairStates<acc_t>::kValues}, accumulation_);
      column_states_kernel<acc_t>
          <<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(shares)), kThreads, 0, stream>>>(
              s.data_ptr<acc_t>(), strip.rows, strip.cols, strip.rows, row_labels(strip), col_labels(strip), logit_,
              first_visit, beyond_states, share_states.data_ptr<acc_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (shares > 1) {
        merge_column_shares_kernel<acc_t><<<blocks_for(beyond), kThreads, 0, stream>>>(
            share_states.data_ptr<acc_t>(), shares, beyond, first_visit, beyond_states);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    }
  }

  // The states (B, 4) of every row from tile_states_kernel's partials, strip
  // by strip. Only the partials go to memory, 16 bytes for each row (and,
  // without a reference set, each column) of a tile: at most a quarter of a
  // byte for each entry of S. Strips budgeted at a byte an entry keep them to
  // a quarter of kStripBytes; taller ones would save only launches.
  void reduce_on_tiles(acc_t* states) const {
    if constexpr (kHasMmaTiles<scalar_t>) {
      const auto stream = c10::cuda::getCurrentCUDAStream();
      const std::vector<Strip> strips = plan_strips(q_.size(), r_.size(), self_, 1);
      constexpr int64_t kValues = PairStates<float>::kValues;
      const Strip& largest = strips.front();
      const at::Tensor row_partials = at::empty({tiles(largest.cols) * largest.rows * kValues}, accumulation_);
      const at::Tensor col_partials = at::empty({self_ ? tiles(largest.rows) * largest.cols * kValues : 0}, accumulation_);
      for (const Strip& strip : strips) {
        if (strip.cols > 0) {
          const dim3 grid(static_cast<unsigned>(tiles(strip.rows)), static_cast<unsigned>(tiles(strip.cols)));
          on_tiles(strip, [&](const auto& in) {
            using T = typename std::decay_t<decltype(in)>::Scalar;
            tile_states_kernel<T, TileUnits<scalar_t>><<<grid, kMmaThreads, kMmaSharedBytes, stream>>>(
                in, self_, left_out(strip), first_column(strip), logit_, row_partials.data_ptr<float>(),
                col_partials.data_ptr<float>());
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          });
        }
        const bool first_visit = !self_ || strip.row0 == 0;
        merge_tile_states_kernel<<<blocks_for(32 * (self_ ? strip.cols : strip.rows)), kThreads, 0, stream>>>(
            row_partials.data_ptr<float>(), col_partials.data_ptr<float>(), strip.rows, strip.cols, self_, first_visit,
            states + kValues * strip.row0);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    }
  }

  // Q and R as the tensor-core kernels take them, for on_tiles; made by
  // the passes that use them (a split of float32 features takes 4·D a row,
  // and 2·D more for the bfloat16 parts of for_gradient's large products;
  // HalfFeatures' float16 copies D, which the backward's products take too).
  void take_tile_features(bool for_gradient) {
    if (takes_halves_) {
      half_features_ = HalfFeatures(q_.features, self_ ? at::Tensor() : r_.features);
      q_half_tiles_ = TileFeatures<c10::Half>(half_features_.rows(), /*for_products=*/false);
      r_half_tiles_ = self_ ? q_half_tiles_ : TileFeatures<c10::Half>(half_features_.cols(), /*for_products=*/false);
      return;
    }
    const bool for_products = for_gradient && prepares_products(q_.size(), r_.size(), q_.dim());
    q_tiles_ = TileFeatures<scalar_t>(q_.features, for_products);
    r_tiles_ = self_ ? q_tiles_ : TileFeatures<scalar_t>(r_.features, for_products);
  }

  // Calls launch(operands) with the strip's two sides as the tensor-core
  // kernels take them: HalfFeatures' float16 copies where the op takes
  // them, else the features as TileFeatures.
  template <typename Launch>
  void on_tiles(const Strip& strip, const Launch& launch) const {
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (takes_halves_) {
        launch(make_tile_operands(q_half_tiles_.rows().from(strip.row0), row_labels(strip), strip.rows,
                                  r_half_tiles_.cols().from(strip.col0), col_labels(strip), strip.cols,
                                  half_features_.similarity_unit()));
        return;
      }
    }
    launch(make_tile_operands(q_tiles_.rows().from(strip.row0), row_labels(strip), strip.rows,
                              r_tiles_.cols().from(strip.col0), col_labels(strip), strip.cols));
  }

  // Whether this GPU runs the tile kernels of operands T, in the units of
  // the features' dtype.
  template <typename T>
  static bool tiles_built() {
    using Units = TileUnits<scalar_t>;
    return mma_tiles_built<tile_weights_kernel<T, AnchorWeightRule<Units>>>() &&
        mma_tiles_built<tile_states_kernel<T, Units>>();
  }

  // The backward's strips. On the tensor cores a strip holds only W, in the
  // features' dtype and W's own budget (plan_column_chunks), so it takes
  // more rows than a strip of float32 S: fewer launches, and taller
  // products for cuBLAS; and strips too wide for kTallStrip rows are cut
  // into chunks of columns.
  std::vector<Strip> gradient_strips() const {
    if (!tensor_cores_) return strips_;
    return plan_column_chunks(q_.size(), r_.size(), self_, takes_halves_ ? sizeof(c10::Half) : sizeof(scalar_t),
                              max_strip_height(q_.size(), self_));
  }

  // The workspace of S's strips in acc_t, (largest strip,), made on first use.
  const at::Tensor& similarity_space() {
    if (!workspace_.defined()) workspace_ = at::empty({largest_strip_}, accumulation_);
    return workspace_;
  }

  // W for strips of up to `entries`, in the features' dtype. over_similarities:
  // S's strips are in memory, and W of float32/float64 overwrites them.
  at::Tensor make_weight_space(int64_t entries, bool over_similarities) {
    return std::is_same_v<scalar_t, acc_t> && over_similarities ? similarity_space()
                                                                : at::empty({entries}, q_.features.options());
  }

  // tile_weights_kernel over a strip, as launch_weights without S; in
  // bfloat16 parts where small_weight_space is defined, scaled by
  // weight_scale where that is given (HalfProducts). after_products: the
  // stream's last kernels are the products of the previous strip's W, of
  // which the kernel is made a dependent. Without a reference set an entry
  // carries both (i, j) and (j, i), so W is symmetric, and a strip's
  // diagonal block takes only the tiles on and above its diagonal.
  SplitMatrix launch_tile_weights(
      const Strip& strip,
      const at::Tensor& weight_space,
      const at::Tensor& small_weight_space,
      const acc_t* row_coefficients,
      const acc_t* col_coefficients,
      const float* weight_scale,
      bool after_products) const {
    const SplitMatrix weights = strip_weights(weight_space, small_weight_space, strip);
    if constexpr (kHasMmaTiles<scalar_t>) {
      on_tiles(strip, [&](const auto& in) {
        launch_tile_weights_kernel(
            after_products, in,
            AnchorWeightRule<TileUnits<scalar_t>>{logit_, row_coefficients, col_coefficients, strip.rows, strip.cols,
                                                  first_column(strip), left_out(strip), weight_scale},
            /*symmetric=*/self_ && strip.col0 == strip.row0, weights);
      });
    }
    return weights;
  }

  // weights_kernel over strip's S with the rows' coefficients (rows, 3) (and,
  // without a reference set, the columns'); returns the (rows, cols) weights.
  at::Tensor launch_weights(
      const Strip& strip,
      const at::Tensor& s,
      const at::Tensor& weight_space,
      const acc_t* row_coefficients,
      const acc_t* col_coefficients) const {
    const at::Tensor weights = weight_space.narrow(0, 0, strip.rows * strip.cols).view({strip.rows, strip.cols});
    weights_kernel<acc_t, scalar_t><<<strip_grid(strip, sms_), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        s.data_ptr<acc_t>(), strip.rows, strip.cols, row_labels(strip), col_labels(strip), strip.row0, strip.col0,
        self_, left_out(strip), logit_, row_coefficients, col_coefficients, weights.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return weights;
  }

  const int64_t* row_labels(const Strip& strip) const { return q_.labels.data_ptr<int64_t>() + strip.row0; }
  const int64_t* col_labels(const Strip& strip) const { return r_.labels.data_ptr<int64_t>() + strip.col0; }
  // The strip's first column as left_out_column counts it: in the reference
  // set, or without one from the strip's first row.
  int64_t first_column(const Strip& strip) const { return self_ ? strip.col0 - strip.row0 : strip.col0; }

  const int64_t* left_out(const Strip& strip) const {
    return left_out_.defined() ? left_out_.data_ptr<int64_t>() + strip.row0 : nullptr;
  }

  const KernelRows& q_;
  const KernelRows& r_;
  bool self_;
  at::Tensor left_out_;
  PairLogit<acc_t> logit_;
  std::vector<Strip> strips_;
  int sms_;
  at::TensorOptions accumulation_; // acc_t on the features' device
  int64_t largest_strip_; // entries
  bool tensor_cores_ = false; // the backward's W from tensor-core tiles (mma_tiles.cuh)
  // float32 with TF32 allowed, at a size that takes_half_features: the tiles
  // and the backward's products take HalfFeatures.
  bool takes_halves_ = false;
  TileFeatures<scalar_t> q_tiles_; // take_tile_features(), or with takes_halves_:
  TileFeatures<scalar_t> r_tiles_;
  HalfFeatures half_features_;
  TileFeatures<c10::Half> q_half_tiles_;
  TileFeatures<c10::Half> r_half_tiles_;
  at::Tensor workspace_; // (largest_strip_,) in acc_t, S's strips: see similarity_space
};

// The CPU kernels' diagonal tiles are theirs alone: these kernels form S in
// strips and keep none of it for the backward.
constexpr const char* kNoDiagonalTiles =
    "diagonal_tiles are kept by the CPU kernels only: the CUDA kernels form S in strips and keep none of it";

std::tuple<at::Tensor, at::Tensor, at::Tensor> anchor_loss_forward_cuda(
    const AnchorArgs& args, bool keep_diagonal_tiles) {
  const auto& [features, labels, ref_features, ref_labels, margin, gamma, ref_self_index] = args;
  const bool self = !args.has_ref();
  TORCH_CHECK(!(keep_diagonal_tiles && self), "circle::_anchor_loss_forward: keep_diagonal_tiles=True: ", kNoDiagonalTiles);
  const NoAutocast no_autocast;
  const c10::cuda::CUDAGuard guard(features.device());
  const KernelRows q = kernel_rows(features, labels);
  const KernelRows r = self ? q : kernel_rows(*ref_features, *ref_labels);
  const at::TensorOptions accumulation = features.options().dtype(at::toOpMathType(features.scalar_type()));
  at::Tensor losses = at::empty({q.size()}, features.options());
  at::Tensor row_lse = at::empty({q.size(), 2}, accumulation);
  at::Tensor no_tiles = at::empty({0, kCpuTile}, accumulation);
  if (q.size() == 0) {
    return {losses, row_lse, no_tiles};
  }
  const at::Tensor left_out = left_out_columns(ref_self_index);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, features.scalar_type(), "circle_anchor_loss_cuda", [&] {
    AnchorPasses<scalar_t>(q, r, self, left_out, margin, gamma).forward(losses, row_lse);
  });
  return {losses, row_lse, no_tiles};
}

std::tuple<at::Tensor, at::Tensor> anchor_loss_with_row_grads_cuda(const AnchorArgs& args) {
  const auto& [features, labels, ref_features, ref_labels, margin, gamma, ref_self_index] = args;
  const NoAutocast no_autocast;
  const c10::cuda::CUDAGuard guard(features.device());
  const KernelRows q = kernel_rows(features, labels);
  const KernelRows r = kernel_rows(*ref_features, *ref_labels);
  at::Tensor losses = at::empty({q.size()}, features.options());
  at::Tensor row_grads =
      at::empty({q.size(), features.size(1)}, features.options().dtype(at::toOpMathType(features.scalar_type())));
  if (q.size() == 0) {
    return {losses, row_grads};
  }
  const at::Tensor left_out = left_out_columns(ref_self_index);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, features.scalar_type(), "circle_anchor_loss_row_grads_cuda", [&] {
    AnchorPasses<scalar_t>(q, r, /*self=*/false, left_out, margin, gamma).forward_with_row_grads(losses, row_grads);
  });
  return {losses, row_grads};
}

std::tuple<at::Tensor, at::Tensor> anchor_loss_backward_cuda(
    const at::Tensor& grad_losses, const AnchorArgs& args, const at::Tensor& row_lse, bool ref_grad,
    const std::optional<at::Tensor>& diagonal_tiles) {
  const auto& [features, labels, ref_features, ref_labels, margin, gamma, ref_self_index] = args;
  const bool self = !args.has_ref();
  TORCH_CHECK(!is_given(diagonal_tiles), "circle::_anchor_loss_backward: ", kNoDiagonalTiles);
  const NoAutocast no_autocast;
  const c10::cuda::CUDAGuard guard(features.device());
  const KernelRows q = kernel_rows(features, labels);
  const KernelRows r = self ? q : kernel_rows(*ref_features, *ref_labels);
  const at::Tensor left_out = left_out_columns(ref_self_index);
  at::Tensor grad_q;
  at::Tensor grad_r;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, features.scalar_type(), "circle_anchor_loss_backward_cuda", [&] {
    const at::Tensor g = grad_losses.to(features.scalar_type()).contiguous();
    std::tie(grad_q, grad_r) =
        AnchorPasses<scalar_t>(q, r, self, left_out, margin, gamma).backward(g, row_lse.contiguous(), ref_grad);
  });
  return {grad_q.to(features.scalar_type()), grad_r.to(features.scalar_type())};
}

} // namespace

TORCH_LIBRARY_IMPL(circle, CUDA, m) {
  register_anchor_kernels<anchor_loss_forward_cuda, anchor_loss_backward_cuda, anchor_loss_with_row_grads_cuda>(m);
}

} // namespace circle_loss
