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
// float16/bfloat16 rows of whole 16-byte chunks have the strips' W made
// straight from tensor-core tiles (mma_tiles.cuh's tile_weights_kernel, with
// AnchorWeightRule), S never in memory.
//
// Every reduction runs in an order fixed by the shapes and the GPU, and
// cuBLAS is reproducible on a given GPU, so results are bitwise the same from
// run to run; nothing waits for the host, so the op can be graph-captured.
#include "mma_tiles.cuh"
#include "strips.cuh"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
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
// self: the strip's columns start at its first row, so column r is the pair
// (i, i); with a reference set, left_out (the strip's rows, or null) gives
// each row's left-out column of the whole set, col0 the strip's first one.
__device__ __forceinline__ int64_t left_out_column(bool self, const int64_t* left_out, int64_t r, int64_t col0, int64_t cols) {
  if (self) return r;
  if (left_out == nullptr) return -1;
  const int64_t c = left_out[r] - col0;
  return c >= 0 && c < cols ? c : -1;
}

// Row r of the strip: merges its pairs' LSE states into states[r] (writes
// them there on the row's first visit).
template <typename acc_t>
__global__ void __launch_bounds__(kThreads) row_states_kernel(
    const acc_t* __restrict__ s, // (rows, cols)
    int64_t cols,
    int64_t col0,
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
// of its columns), held in shared memory as (-LSE_P·log2(e), -LSE_N·log2(e),
// factor) so that each term is one multiply-add and one ex2.
struct AnchorWeightRule {
  PairLogit<float> logit;
  const float* row_coefficients; // (n_rows, 3): the strip's rows
  const float* col_coefficients; // (n_cols, 3): the strip's columns without a reference set, else null
  int64_t n_rows;
  int64_t n_cols;
  int64_t first_row; // the strip's, in features
  int64_t first_col; // the strip's, in the reference set (features without one)
  const int64_t* left_out; // (n_rows,): with a reference set, each row's left-out column of it; or null

  struct Shared {
    float4 row[kMmaTile]; // (-LSE_P·log2(e), -LSE_N·log2(e), factor, unused); factor 0 past the end
    float4 col[kMmaTile]; // the same for the columns; factor 0 with a reference set
    int skipped[kMmaTile]; // the column of the tile with each row's pair in no set, or -1
  };

  // A row's or column's (B, 3) record as Shared holds it, or none (factor 0).
  __device__ __forceinline__ static float4 scaled(const float* records, int64_t index, bool inside) {
    if (!inside) return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const RowCoefficients<float> c = RowCoefficients<float>::at(records, index);
    return make_float4(-c.lse[0] * kLog2e, -c.lse[1] * kLog2e, c.factor, 0.0f);
  }

  // factor·exp(z - LSE of the set)·slope for one side's coefficients.
  __device__ __forceinline__ static float term(const float4& c, float z, bool positive) {
    return c.z == 0.0f ? 0.0f : c.z * fast_exp2(fmaf(z, kLog2e, positive ? c.x : c.y));
  }

  __device__ __forceinline__ void load(Shared& shared, int64_t row0, int64_t col0) const {
    static_assert(2 * kMmaTile == kMmaThreads, "one row or column a thread");
    const int i = threadIdx.x % kMmaTile;
    const bool self = col_coefficients != nullptr;
    if (threadIdx.x < kMmaTile) {
      const int64_t r = row0 + i;
      const bool inside = r < n_rows;
      shared.row[i] = scaled(row_coefficients, r, inside);
      // Its pair in no set, as a column of the whole set: (i, i) without a
      // reference set, else left_out's.
      const int64_t column = self ? first_row + r : left_out != nullptr ? left_out[r] : -1;
      const int64_t skipped = inside && column >= 0 ? column - first_col - col0 : -1;
      shared.skipped[i] = skipped >= 0 && skipped < kMmaTile ? static_cast<int>(skipped) : -1;
    } else {
      const int64_t c = col0 + i;
      shared.col[i] = scaled(col_coefficients, c, self && c < n_cols);
    }
  }

  __device__ __forceinline__ auto at(const Shared& shared) const {
    return [&shared, logit = logit](float s, bool positive, int r, int c) {
      float slope;
      const float z = logit(s, positive, &slope);
      const float w = (term(shared.row[r], z, positive) + term(shared.col[c], z, positive)) * slope;
      return c == shared.skipped[r] ? 0.0f : w;
    };
  }
};

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
      tensor_cores_ = mma_tiles_apply<tile_weights_kernel<scalar_t, AnchorWeightRule>>(q.features) &&
          mma_tiles_apply<tile_weights_kernel<scalar_t, AnchorWeightRule>>(r.features);
    }
  }

  // Writes losses (B,) and row_lse (B, 2).
  void forward(at::Tensor& losses, at::Tensor& row_lse) {
    const int64_t batch = q_.size();
    at::Tensor states = at::empty({batch, PairStates<acc_t>::kValues}, accumulation_);
    acc_t* state = states.data_ptr<acc_t>();
    for (const Strip& strip : strips_) {
      reduce_strip(strip, strip_similarities(q_, r_, strip, similarity_space()), state);
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
    const at::Tensor weight_space = make_weight_space();
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
    const at::Tensor weight_space = make_weight_space();
    // Last strip first: a strip writes its own rows before any earlier one
    // adds its mirrored share to them.
    for (auto strip = strips_.rbegin(); strip != strips_.rend(); ++strip) {
      const acc_t* coefficient = coefficients.data_ptr<acc_t>();
      constexpr int kValues = RowCoefficients<acc_t>::kValues;
      const acc_t* row_coefficients = coefficient + kValues * strip->row0;
      const acc_t* col_coefficients = self_ ? coefficient + kValues * strip->col0 : nullptr;
      const at::Tensor weights = tensor_cores_
          ? launch_tile_weights(*strip, weight_space, row_coefficients, col_coefficients)
          : launch_weights(*strip, strip_similarities(q_, r_, *strip, similarity_space()), weight_space,
                           row_coefficients, col_coefficients);
      const at::Tensor own_rows = q_.features.narrow(0, strip->row0, strip->rows);
      matmul_into(grad_q.narrow(0, strip->row0, strip->rows), weights, r_.features.narrow(0, strip->col0, strip->cols));
      if (self_) {
        const int64_t beyond = strip->cols - strip->rows;
        if (beyond > 0) {
          matmul_add(grad_q.narrow(0, strip->row0 + strip->rows, beyond), weights.narrow(1, strip->rows, beyond).t(),
                     own_rows);
        }
      } else if (ref_grad && strip == strips_.rbegin()) {
        matmul_into(grad_r, weights.t(), own_rows);
      } else if (ref_grad) {
        matmul_add(grad_r, weights.t(), own_rows);
      }
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
        s.data_ptr<acc_t>(), strip.cols, strip.col0, row_labels(strip), col_labels(strip), self_, left_out(strip),
        logit_, first_visit, states + PairStates<acc_t>::kValues * strip.row0);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int64_t beyond = strip.cols - strip.rows; // columns right of the diagonal block
    if (self_ && beyond > 0) {
      const int64_t blocks = (beyond + kColumnsPerCta - 1) / kColumnsPerCta;
      const int64_t shares = std::clamp<int64_t>(
          std::min((2 * sms_ + blocks - 1) / blocks, strip.rows / kMinShareRows), 1, kMaxColumnShares);
      acc_t* beyond_states = states + PairStates<acc_t>::kValues * (strip.row0 + strip.rows);
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

  // The workspace of S's strips in acc_t, (largest strip,), made on first use.
  const at::Tensor& similarity_space() {
    if (!workspace_.defined()) workspace_ = at::empty({largest_strip_}, accumulation_);
    return workspace_;
  }

  // float16/bfloat16 weights feed the tensor cores; wider ones overwrite S.
  at::Tensor make_weight_space() {
    return std::is_same_v<scalar_t, acc_t> ? similarity_space() : at::empty({largest_strip_}, q_.features.options());
  }

  // tile_weights_kernel over a strip, as launch_weights without S.
  at::Tensor launch_tile_weights(
      const Strip& strip,
      const at::Tensor& weight_space,
      const acc_t* row_coefficients,
      const acc_t* col_coefficients) const {
    const at::Tensor weights = weight_space.narrow(0, 0, strip.rows * strip.cols).view({strip.rows, strip.cols});
    if constexpr (kHasMmaTiles<scalar_t>) {
      // x over the strip's rows of tiles, the fastest: the CTAs resident at
      // once share their columns' operand tiles through L2.
      const dim3 grid(static_cast<unsigned>((strip.rows + kMmaTile - 1) / kMmaTile),
                      static_cast<unsigned>((strip.cols + kMmaTile - 1) / kMmaTile));
      const int64_t dim = q_.dim();
      tile_weights_kernel<scalar_t, AnchorWeightRule>
          <<<grid, kMmaThreads, kMmaSharedBytes, c10::cuda::getCurrentCUDAStream()>>>(
              TileOperands<scalar_t>{q_.features.data_ptr<scalar_t>() + strip.row0 * dim, row_labels(strip), strip.rows,
                                     r_.features.data_ptr<scalar_t>() + strip.col0 * dim, col_labels(strip), strip.cols,
                                     dim},
              AnchorWeightRule{logit_, row_coefficients, col_coefficients, strip.rows, strip.cols, strip.row0,
                               strip.col0, left_out(strip)},
              weights.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  at::Tensor workspace_; // (largest_strip_,) in acc_t, S's strips: see similarity_space
};

// The CPU kernels' diagonal tiles are theirs alone: these kernels form S in
// strips and keep none of it for the backward.
constexpr const char* kNoDiagonalTiles =
    "diagonal_tiles are kept by the CPU kernels only: the CUDA kernels form S in strips and keep none of it";

std::tuple<at::Tensor, at::Tensor, at::Tensor> anchor_loss_forward_cuda(
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    const std::optional<at::Tensor>& ref_features, // (M, D)?
    const std::optional<at::Tensor>& ref_labels, // (M,)?
    double margin,
    double gamma,
    const std::optional<at::Tensor>& ref_self_index, // (B,)?
    bool keep_diagonal_tiles) {
  check_anchor_inputs(features, labels, ref_features, ref_labels, margin, gamma, ref_self_index);
  const bool self = !is_given(ref_features);
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

std::tuple<at::Tensor, at::Tensor> anchor_loss_with_row_grads_cuda(
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    const at::Tensor& ref_features, // (M, D)
    const at::Tensor& ref_labels, // (M,)
    double margin,
    double gamma,
    const std::optional<at::Tensor>& ref_self_index) { // (B,)?
  check_anchor_inputs(features, labels, ref_features, ref_labels, margin, gamma, ref_self_index);
  const NoAutocast no_autocast;
  const c10::cuda::CUDAGuard guard(features.device());
  const KernelRows q = kernel_rows(features, labels);
  const KernelRows r = kernel_rows(ref_features, ref_labels);
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

at::Tensor anchor_loss_cuda(
    const at::Tensor& features,
    const at::Tensor& labels,
    const std::optional<at::Tensor>& ref_features,
    const std::optional<at::Tensor>& ref_labels,
    double margin,
    double gamma,
    const std::optional<at::Tensor>& ref_self_index) {
  return std::get<0>(
      anchor_loss_forward_cuda(features, labels, ref_features, ref_labels, margin, gamma, ref_self_index, false));
}

std::tuple<at::Tensor, at::Tensor> anchor_loss_backward_cuda(
    const at::Tensor& grad_losses, // (B,)
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    const std::optional<at::Tensor>& ref_features, // (M, D)?
    const std::optional<at::Tensor>& ref_labels, // (M,)?
    const at::Tensor& row_lse, // (B, 2)
    double margin,
    double gamma,
    const std::optional<at::Tensor>& ref_self_index, // (B,)?
    bool ref_grad,
    const std::optional<at::Tensor>& diagonal_tiles) { // (B, kCpuTile)?
  check_anchor_inputs(features, labels, ref_features, ref_labels, margin, gamma, ref_self_index);
  check_anchor_backward_inputs(grad_losses, features, row_lse);
  const bool self = !is_given(ref_features);
  check_anchor_diagonal_tiles(diagonal_tiles, features, !self);
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
  m.impl("anchor_loss", &anchor_loss_cuda);
  m.impl("_anchor_loss_forward", &anchor_loss_forward_cuda);
  m.impl("_anchor_loss_backward", &anchor_loss_backward_cuda);
  m.impl("_anchor_loss_with_row_grads", &anchor_loss_with_row_grads_cuda);
}

} // namespace circle_loss
