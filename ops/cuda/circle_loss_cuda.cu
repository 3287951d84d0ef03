// CUDA kernels of circle::loss.
//
// The same two passes as the CPU kernel, with every scalar kept on the device
// so that nothing waits for the host (the op runs under CUDA-graph capture):
//   lse_tiles_kernel   one CTA per 64×64 tile of S on or above the diagonal
//                      (or, for two different blocks of rows, every tile):
//                      S by SIMT FMA, then each pair set's (max, Σ exp(z - max))
//                      for the tile, off-diagonal tiles counted twice.
//   finalize_kernel    one CTA folds the tiles' partials in tile order into the
//                      two LSEs, the loss and 2·sigmoid(Z).
//   gradient_kernel    one CTA per 64 rows (and per slice of column blocks
//                      when B is small): for each 64 columns, S again, then
//                      G = 2σ(Z)·exp(z - LSE)·c in shared memory and G·F_J
//                      added to a 64 × D accumulator held in registers.
//   sum_slices_kernel  when there were several slices, their sum, in order.
// No atomics: every value is reduced in a fixed order, so results are bitwise
// the same from run to run. float16/bfloat16 are widened to float32 as they
// are staged into shared memory; float64 computes in float64.
#include "../circle_loss.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <cmath>

namespace circle_loss {
namespace {

constexpr int kTile = 64; // rows and columns of one tile of S
constexpr int kChunk = 16; // slice of D staged in shared memory per step
constexpr int kLseThreads = 256; // 16 × 16 threads, 4 × 4 pairs each
constexpr int kGradThreads = 512; // 32 × 16 threads for S, 16 × 32 for G·F

template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

// NaN-propagating max: fmax would drop a NaN and hide it.
template <typename T>
__device__ __forceinline__ T nan_max(T a, T b) {
  return (a > b || a != a) ? a : b;
}

// Tile index t over the upper triangle, row-major, to its block coordinates.
__device__ __forceinline__ void upper_tile(int64_t t, int64_t blocks, int64_t& bi, int64_t& bj) {
  const double n = static_cast<double>(blocks);
  int64_t i = static_cast<int64_t>(floor((2 * n + 1 - sqrt((2 * n + 1) * (2 * n + 1) - 8.0 * t)) / 2));
  auto row_start = [blocks](int64_t r) { return r * blocks - r * (r - 1) / 2; };
  while (i > 0 && row_start(i) > t) --i;
  while (row_start(i + 1) <= t) ++i;
  bi = i;
  bj = i + (t - row_start(i));
}

// Stages features[row0 .. row0+64, k0 .. k0+kChunk) transposed into
// dst[kChunk][kTile + 1], widened to the accumulation type, zero-padded.
template <typename scalar_t, typename acc_t, int THREADS>
__device__ __forceinline__ void stage_chunk(
    const scalar_t* __restrict__ features, // (B, D)
    int64_t batch,
    int64_t dim,
    int64_t row0,
    int64_t k0,
    acc_t (*dst)[kTile + 1]) {
  for (int e = threadIdx.x; e < kTile * kChunk; e += THREADS) {
    const int r = e / kChunk;
    const int k = e % kChunk;
    const int64_t row = row0 + r;
    const int64_t col = k0 + k;
    dst[k][r] = (row < batch && col < dim)
        ? static_cast<acc_t>(features[row * dim + col])
        : acc_t(0);
  }
}

// One 64×64 tile of S = rows colsᵀ. Each thread gets ROWS × 4 entries:
// rows ty·ROWS + i, columns tx·4 + j, with THREADS = 16 · (64 / ROWS).
template <typename scalar_t, typename acc_t, int THREADS, int ROWS>
__device__ __forceinline__ void similarity_tile(
    const scalar_t* __restrict__ rows, // (R, D)
    int64_t n_rows,
    const scalar_t* __restrict__ cols, // (C, D)
    int64_t n_cols,
    int64_t dim,
    int64_t row0,
    int64_t col0,
    acc_t (*a_smem)[kTile + 1], // [kChunk][kTile + 1]
    acc_t (*b_smem)[kTile + 1], // [kChunk][kTile + 1]
    acc_t (&s)[ROWS][4]) {
  static_assert(THREADS == 16 * (kTile / ROWS), "thread grid must cover the tile");
  const int tx = threadIdx.x % 16;
  const int ty = threadIdx.x / 16;
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      s[i][j] = acc_t(0);
    }
  }
  for (int64_t k0 = 0; k0 < dim; k0 += kChunk) {
    stage_chunk<scalar_t, acc_t, THREADS>(rows, n_rows, dim, row0, k0, a_smem);
    stage_chunk<scalar_t, acc_t, THREADS>(cols, n_cols, dim, col0, k0, b_smem);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      acc_t a[ROWS];
      acc_t b[4];
#pragma unroll
      for (int i = 0; i < ROWS; ++i) a[i] = a_smem[k][ty * ROWS + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = b_smem[k][tx * 4 + j];
#pragma unroll
      for (int i = 0; i < ROWS; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          s[i][j] = fma(a[i], b[j], s[i][j]);
        }
      }
    }
    __syncthreads();
  }
}

// Block-wide reductions in a fixed order (xor-shuffle tree, then warps in
// index order), so that every run sums the same way.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T value, Op op, T* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  if (threadIdx.x % 32 == 0) scratch[warp] = value;
  __syncthreads();
  T total = scratch[0];
  for (int w = 1; w < warps; ++w) total = op(total, scratch[w]);
  __syncthreads();
  return total;
}

// With `symmetric` (rows and cols are one tensor) the CTAs cover the tiles
// on and above the diagonal, off-diagonal ones counted twice; otherwise all.
template <typename scalar_t>
__global__ void __launch_bounds__(kLseThreads) lse_tiles_kernel(
    const scalar_t* __restrict__ rows, // (R, D)
    const int64_t* __restrict__ row_labels, // (R,)
    int64_t n_rows,
    const scalar_t* __restrict__ cols, // (C, D)
    const int64_t* __restrict__ col_labels, // (C,)
    int64_t n_cols,
    int64_t dim,
    bool symmetric,
    PairLogit<typename Acc<scalar_t>::type> logit,
    typename Acc<scalar_t>::type* __restrict__ partials) { // (tiles, 4)
  using acc_t = typename Acc<scalar_t>::type;
  __shared__ acc_t a_smem[kChunk][kTile + 1];
  __shared__ acc_t b_smem[kChunk][kTile + 1];
  __shared__ acc_t scratch[kLseThreads / 32];
  const int64_t col_blocks = (n_cols + kTile - 1) / kTile;
  int64_t bi, bj;
  if (symmetric) {
    upper_tile(blockIdx.x, col_blocks, bi, bj);
  } else {
    bi = blockIdx.x / col_blocks;
    bj = blockIdx.x % col_blocks;
  }
  const int64_t row0 = bi * kTile;
  const int64_t col0 = bj * kTile;

  acc_t s[4][4];
  similarity_tile<scalar_t, acc_t, kLseThreads, 4>(rows, n_rows, cols, n_cols, dim, row0, col0, a_smem, b_smem, s);

  const int tx = threadIdx.x % 16;
  const int ty = threadIdx.x / 16;
  constexpr acc_t kNegInf = -INFINITY;
  acc_t z[4][4];
  bool positive[4][4];
  acc_t max_pos = kNegInf;
  acc_t max_neg = kNegInf;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t row = row0 + ty * 4 + i;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t col = col0 + tx * 4 + j;
      const bool valid = row < n_rows && col < n_cols;
      positive[i][j] = valid && row_labels[row] == col_labels[col];
      acc_t slope;
      z[i][j] = valid ? logit(s[i][j], positive[i][j], &slope) : kNegInf;
      if (positive[i][j]) {
        max_pos = nan_max(max_pos, z[i][j]);
      } else {
        max_neg = nan_max(max_neg, z[i][j]);
      }
    }
  }
  auto max_op = [](acc_t a, acc_t b) { return nan_max(a, b); };
  auto sum_op = [](acc_t a, acc_t b) { return a + b; };
  max_pos = block_reduce(max_pos, max_op, scratch);
  max_neg = block_reduce(max_neg, max_op, scratch);
  acc_t sum_pos = 0;
  acc_t sum_neg = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (z[i][j] == kNegInf) continue; // padding, or an exp that is 0 anyway
      if (positive[i][j]) {
        sum_pos += exp(z[i][j] - max_pos);
      } else {
        sum_neg += exp(z[i][j] - max_neg);
      }
    }
  }
  sum_pos = block_reduce(sum_pos, sum_op, scratch);
  sum_neg = block_reduce(sum_neg, sum_op, scratch);
  if (threadIdx.x == 0) {
    const acc_t multiplicity = (symmetric && bi != bj) ? acc_t(2) : acc_t(1);
    acc_t* out = partials + 4 * static_cast<int64_t>(blockIdx.x);
    out[0] = max_pos;
    out[1] = sum_pos * multiplicity;
    out[2] = max_neg;
    out[3] = sum_neg * multiplicity;
  }
}

constexpr int kFinalizeThreads = 1024;

// Folds partials in a fixed order. Writes, where given: the folded partial
// (max_P, Σ_P, max_N, Σ_N); scalars = (LSE_P, LSE_N, loss, 2·sigmoid(Z));
// the loss in the features' dtype.
template <typename partial_t, typename loss_t>
__global__ void __launch_bounds__(kFinalizeThreads) finalize_kernel(
    const partial_t* __restrict__ partials, // (tiles, 4)
    int64_t tiles,
    double* __restrict__ folded, // (4,) or null
    double* __restrict__ scalars, // (4,) or null
    loss_t* __restrict__ loss) { // () or null
  __shared__ double shared_max[2][kFinalizeThreads];
  __shared__ double shared_sum[2][kFinalizeThreads];
  double maxima[2] = {-INFINITY, -INFINITY};
  double sums[2] = {0.0, 0.0};
  auto merge = [](double& max, double& sum, double other_max, double other_sum) {
    if (other_sum == 0.0 && !isnan(other_max)) return;
    if (isnan(other_max) || isnan(max)) {
      max = NAN;
      sum = NAN;
    } else if (other_max > max) {
      sum = sum * exp(max - other_max) + other_sum;
      max = other_max;
    } else {
      sum += other_sum * exp(other_max - max);
    }
  };
  for (int64_t t = threadIdx.x; t < tiles; t += kFinalizeThreads) {
    for (int set = 0; set < 2; ++set) {
      merge(maxima[set], sums[set], partials[4 * t + 2 * set], partials[4 * t + 2 * set + 1]);
    }
  }
  for (int set = 0; set < 2; ++set) {
    shared_max[set][threadIdx.x] = maxima[set];
    shared_sum[set][threadIdx.x] = sums[set];
  }
  __syncthreads();
  for (int stride = kFinalizeThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) {
      for (int set = 0; set < 2; ++set) {
        merge(shared_max[set][threadIdx.x], shared_sum[set][threadIdx.x],
              shared_max[set][threadIdx.x + stride], shared_sum[set][threadIdx.x + stride]);
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    double lse[2];
    for (int set = 0; set < 2; ++set) {
      lse[set] = shared_sum[set][0] == 0.0 ? -INFINITY
                                           : shared_max[set][0] + log(shared_sum[set][0]);
      if (folded != nullptr) {
        folded[2 * set] = shared_max[set][0];
        folded[2 * set + 1] = shared_sum[set][0];
      }
    }
    const LossScalars out = finish_loss(lse[0], lse[1]);
    if (scalars != nullptr) {
      scalars[0] = out.lse_positive;
      scalars[1] = out.lse_negative;
      scalars[2] = out.loss;
      scalars[3] = out.grad_scale;
    }
    if (loss != nullptr) {
      using acc_t = typename Acc<loss_t>::type;
      *loss = static_cast<loss_t>(static_cast<acc_t>(out.loss));
    }
  }
}

// Columns of the G·F accumulator per thread and per pass over D.
template <typename acc_t>
struct GradShape {
  static constexpr int kCols = sizeof(acc_t) == 4 ? 16 : 8;
  static constexpr int kDChunk = 32 * kCols; // 16 × 32 threads cover 64 × kDChunk
  static constexpr int kFRows = 8; // rows of F_J staged per step of G·F
};

template <typename acc_t>
constexpr size_t gradient_smem_bytes() {
  using Shape = GradShape<acc_t>;
  const size_t tile_operands = 2 * kChunk * (kTile + 1) * sizeof(acc_t);
  const size_t f_rows = Shape::kFRows * Shape::kDChunk * sizeof(acc_t);
  const size_t g_tile = kTile * (kTile + 1) * sizeof(acc_t);
  return (tile_operands > f_rows ? tile_operands : f_rows) + g_tile + 2 * kTile * sizeof(int64_t);
}

// out[slice] rows row0..row0+64 = Σ over this slice's column blocks J of
// G_IJ cols_J, with G as in SPEC.md ("Gradient", factor 2 folded in).
template <typename scalar_t, typename out_t>
__global__ void __launch_bounds__(kGradThreads, 1) gradient_kernel(
    const scalar_t* __restrict__ rows, // (R, D)
    const int64_t* __restrict__ row_labels_in, // (R,)
    int64_t n_rows,
    const scalar_t* __restrict__ cols, // (C, D)
    const int64_t* __restrict__ col_labels_in, // (C,)
    int64_t n_cols,
    int64_t dim,
    int64_t blocks_per_slice,
    PairLogit<typename Acc<scalar_t>::type> logit,
    const double* __restrict__ scalars, // (LSE_P, LSE_N, loss, 2σ(Z))
    out_t* __restrict__ out) { // (slices, R, D)
  using acc_t = typename Acc<scalar_t>::type;
  using Shape = GradShape<acc_t>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // Shared memory: the S operands during S, reused for rows of F_J during
  // G·F; then the G tile and the two label blocks.
  auto a_smem = reinterpret_cast<acc_t(*)[kTile + 1]>(smem_raw);
  auto b_smem = a_smem + kChunk;
  auto f_smem = reinterpret_cast<acc_t(*)[Shape::kDChunk]>(smem_raw);
  const size_t operand_bytes = 2 * kChunk * (kTile + 1) * sizeof(acc_t) >
          Shape::kFRows * Shape::kDChunk * sizeof(acc_t)
      ? 2 * kChunk * (kTile + 1) * sizeof(acc_t)
      : Shape::kFRows * Shape::kDChunk * sizeof(acc_t);
  auto g_smem = reinterpret_cast<acc_t(*)[kTile + 1]>(smem_raw + operand_bytes);
  auto row_labels = reinterpret_cast<int64_t*>(g_smem + kTile);
  int64_t* col_labels = row_labels + kTile;

  const double grad_scale = scalars[3];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t slice = blockIdx.y;
  out_t* out_slice = out + slice * n_rows * dim;
  const int64_t total_blocks = (n_cols + kTile - 1) / kTile;
  const int64_t first_block = slice * blocks_per_slice;
  const int64_t last_block = min(total_blocks, first_block + blocks_per_slice);
  const acc_t lse_pos = static_cast<acc_t>(scalars[0]);
  const acc_t lse_neg = static_cast<acc_t>(scalars[1]);
  const acc_t scale = static_cast<acc_t>(grad_scale);

  for (int i = threadIdx.x; i < kTile; i += kGradThreads) {
    row_labels[i] = row0 + i < n_rows ? row_labels_in[row0 + i] : 0;
  }
  // G·F thread layout: rows gy·4 .. +3, columns gx + 32·j of the D chunk
  // (interleaved, so a warp reads shared memory and writes out stride-1).
  const int gx = threadIdx.x % 32;
  const int gy = threadIdx.x / 32;
  // S thread layout (similarity_tile): rows ty·2 .. +1, columns tx·4 .. +3.
  const int tx = threadIdx.x % 16;
  const int ty = threadIdx.x / 16;

  for (int64_t d0 = 0; d0 < dim; d0 += Shape::kDChunk) {
    acc_t acc[4][Shape::kCols];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < Shape::kCols; ++j) acc[i][j] = acc_t(0);
    }
    // Zero scale (no negative pair, SPEC.md): the gradient is 0; skip the work.
    for (int64_t bj = first_block; bj < last_block && grad_scale != 0.0; ++bj) {
      const int64_t col0 = bj * kTile;
      __syncthreads(); // previous G and labels fully used
      for (int j = threadIdx.x; j < kTile; j += kGradThreads) {
        col_labels[j] = col0 + j < n_cols ? col_labels_in[col0 + j] : 0;
      }
      acc_t s[2][4];
      similarity_tile<scalar_t, acc_t, kGradThreads, 2>(rows, n_rows, cols, n_cols, dim, row0, col0, a_smem, b_smem, s);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = ty * 2 + i;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int c = tx * 4 + j;
          const bool valid = row0 + r < n_rows && col0 + c < n_cols;
          const bool positive = row_labels[r] == col_labels[c];
          acc_t slope;
          const acc_t z = logit(s[i][j], positive, &slope);
          g_smem[r][c] = valid ? scale * exp(z - (positive ? lse_pos : lse_neg)) * slope : acc_t(0);
        }
      }
      // G (64×64, shared) · F_J[:, d0 .. d0 + kDChunk), F_J staged kFRows rows at a time.
      for (int k0 = 0; k0 < kTile; k0 += Shape::kFRows) {
        __syncthreads();
        for (int e = threadIdx.x; e < Shape::kFRows * Shape::kDChunk; e += kGradThreads) {
          const int k = e / Shape::kDChunk;
          const int d = e % Shape::kDChunk;
          const int64_t row = col0 + k0 + k;
          f_smem[k][d] = (row < n_cols && d0 + d < dim)
              ? static_cast<acc_t>(cols[row * dim + d0 + d])
              : acc_t(0);
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < Shape::kFRows; ++k) {
          acc_t g[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) g[i] = g_smem[gy * 4 + i][k0 + k];
#pragma unroll
          for (int j = 0; j < Shape::kCols; ++j) {
            const acc_t f = f_smem[k][gx + 32 * j];
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[i][j] = fma(g[i], f, acc[i][j]);
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t row = row0 + gy * 4 + i;
      if (row >= n_rows) continue;
#pragma unroll
      for (int j = 0; j < Shape::kCols; ++j) {
        const int64_t d = d0 + gx + 32 * j;
        if (d < dim) out_slice[row * dim + d] = static_cast<out_t>(acc[i][j]);
      }
    }
  }
}

// grad = Σ_s partial[s], in slice order.
template <typename acc_t, typename scalar_t>
__global__ void sum_slices_kernel(
    const acc_t* __restrict__ partial, // (slices, B·D)
    int64_t slices,
    int64_t elements,
    scalar_t* __restrict__ grad) { // (B·D)
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < elements;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    acc_t total = partial[e];
    for (int64_t s = 1; s < slices; ++s) total += partial[s * elements + e];
    grad[e] = static_cast<scalar_t>(total);
  }
}

// One block of rows as the kernels read it.
struct Block {
  at::Tensor features; // (N, D) contiguous, input dtype
  at::Tensor labels; // (N,) contiguous int64
  int64_t size() const { return features.size(0); }
  int64_t blocks() const { return (size() + kTile - 1) / kTile; }
};

Block prepare(const at::Tensor& features, const at::Tensor& labels) {
  return {features.contiguous(), labels.to(at::kLong).contiguous()};
}

template <typename T>
at::ScalarType dtype_of() {
  return c10::CppTypeToScalarType<T>::value;
}

// Per-tile LSE partials of rows × colsᵀ, (tiles, 4) in the accumulation type.
template <typename scalar_t>
at::Tensor launch_lse_tiles(const Block& rows, const Block& cols, bool symmetric, double margin, double gamma) {
  using acc_t = typename Acc<scalar_t>::type;
  const int64_t tiles = symmetric ? rows.blocks() * (rows.blocks() + 1) / 2 : rows.blocks() * cols.blocks();
  at::Tensor partials = at::empty({tiles, 4}, rows.features.options().dtype(dtype_of<acc_t>()));
  if (tiles > 0) {
    lse_tiles_kernel<scalar_t><<<static_cast<unsigned>(tiles), kLseThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        rows.features.data_ptr<scalar_t>(), rows.labels.data_ptr<int64_t>(), rows.size(),
        cols.features.data_ptr<scalar_t>(), cols.labels.data_ptr<int64_t>(), cols.size(),
        rows.features.size(1), symmetric,
        PairLogit<acc_t>{static_cast<acc_t>(margin), static_cast<acc_t>(gamma)}, partials.data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return partials;
}

template <typename partial_t, typename loss_t>
void launch_finalize(const at::Tensor& partials, double* folded, double* scalars, loss_t* loss) {
  finalize_kernel<partial_t, loss_t><<<1, kFinalizeThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      partials.data_ptr<partial_t>(), partials.size(0), folded, scalars, loss);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename out_t>
void launch_gradient_kernel(
    const Block& rows, const Block& cols, int64_t slices, int64_t blocks_per_slice,
    const PairLogit<typename Acc<scalar_t>::type>& logit, const at::Tensor& scalars, out_t* out) {
  using acc_t = typename Acc<scalar_t>::type;
  constexpr size_t smem = gradient_smem_bytes<acc_t>();
  // Per device, so set on every call (it is not a stream operation, and is
  // allowed during graph capture).
  C10_CUDA_CHECK(cudaFuncSetAttribute(
      gradient_kernel<scalar_t, out_t>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(static_cast<unsigned>(rows.blocks()), static_cast<unsigned>(slices));
  gradient_kernel<scalar_t, out_t><<<grid, kGradThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(
      rows.features.data_ptr<scalar_t>(), rows.labels.data_ptr<int64_t>(), rows.size(),
      cols.features.data_ptr<scalar_t>(), cols.labels.data_ptr<int64_t>(), cols.size(),
      rows.features.size(1), blocks_per_slice, logit, scalars.data_ptr<double>(), out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Σ_j G_ij cols_j for the rows, as an (R, D) tensor of out_t.
template <typename scalar_t, typename out_t>
at::Tensor launch_gradient(const Block& rows, const Block& cols, double margin, double gamma, const at::Tensor& scalars) {
  using acc_t = typename Acc<scalar_t>::type;
  const int64_t dim = rows.features.size(1);
  at::Tensor grad = at::empty({rows.size(), dim}, rows.features.options().dtype(dtype_of<out_t>()));
  if (rows.size() == 0 || dim == 0) return grad;
  if (cols.size() == 0) return grad.zero_();
  const PairLogit<acc_t> logit{static_cast<acc_t>(margin), static_cast<acc_t>(gamma)};
  // Enough CTAs to fill the GPU twice over: small batches split the column
  // blocks into slices whose partial sums are added afterwards, in order.
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, rows.features.get_device()));
  const int64_t wanted = std::min((2 * sms + rows.blocks() - 1) / rows.blocks(), cols.blocks());
  const int64_t blocks_per_slice = (cols.blocks() + wanted - 1) / wanted;
  const int64_t slices = (cols.blocks() + blocks_per_slice - 1) / blocks_per_slice;
  if (slices == 1) {
    launch_gradient_kernel<scalar_t, out_t>(rows, cols, 1, blocks_per_slice, logit, scalars, grad.data_ptr<out_t>());
    return grad;
  }
  at::Tensor partial = at::empty({slices, rows.size(), dim}, rows.features.options().dtype(dtype_of<acc_t>()));
  launch_gradient_kernel<scalar_t, acc_t>(rows, cols, slices, blocks_per_slice, logit, scalars, partial.data_ptr<acc_t>());
  const int64_t elements = rows.size() * dim;
  const int threads = 256;
  const int64_t grid = std::min<int64_t>((elements + threads - 1) / threads, 4 * sms);
  sum_slices_kernel<acc_t, out_t><<<grid, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      partial.data_ptr<acc_t>(), slices, elements, grad.data_ptr<out_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad;
}

// (LSE_P, LSE_N, loss, 2σ(Z)) as a float64 device tensor; writes the loss.
template <typename scalar_t>
at::Tensor launch_loss(const Block& block, double margin, double gamma, at::Tensor& loss) {
  using acc_t = typename Acc<scalar_t>::type;
  const at::Tensor partials = launch_lse_tiles<scalar_t>(block, block, /*symmetric=*/true, margin, gamma);
  at::Tensor scalars = at::empty({4}, block.features.options().dtype(at::kDouble));
  launch_finalize<acc_t, scalar_t>(partials, nullptr, scalars.data_ptr<double>(), loss.data_ptr<scalar_t>());
  return scalars;
}

at::Tensor loss_cuda(
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    double margin,
    double gamma) {
  check_inputs(features, labels, margin, gamma);
  const c10::cuda::CUDAGuard guard(features.device());
  const Block block = prepare(features, labels);
  at::Tensor loss = at::empty({}, features.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, features.scalar_type(), "circle_loss_cuda", [&] {
    launch_loss<scalar_t>(block, margin, gamma, loss);
  });
  return loss;
}

std::tuple<at::Tensor, at::Tensor> loss_with_grad_cuda(
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    double margin,
    double gamma) {
  check_inputs(features, labels, margin, gamma);
  const c10::cuda::CUDAGuard guard(features.device());
  const Block block = prepare(features, labels);
  at::Tensor loss = at::empty({}, features.options());
  at::Tensor grad;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, features.scalar_type(), "circle_loss_with_grad_cuda", [&] {
    const at::Tensor scalars = launch_loss<scalar_t>(block, margin, gamma, loss);
    grad = launch_gradient<scalar_t, scalar_t>(block, block, margin, gamma, scalars);
  });
  return {loss, grad};
}

at::Tensor lse_partials_cuda(
    const at::Tensor& rows, // (R, D)
    const at::Tensor& row_labels, // (R,)
    const at::Tensor& cols, // (C, D)
    const at::Tensor& col_labels, // (C,)
    double margin,
    double gamma) {
  check_block_inputs(rows, row_labels, cols, col_labels, margin, gamma);
  const c10::cuda::CUDAGuard guard(rows.device());
  at::Tensor folded = at::empty({4}, rows.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rows.scalar_type(), "circle_lse_partials_cuda", [&] {
    using acc_t = typename Acc<scalar_t>::type;
    const at::Tensor partials = launch_lse_tiles<scalar_t>(
        prepare(rows, row_labels), prepare(cols, col_labels), /*symmetric=*/false, margin, gamma);
    launch_finalize<acc_t, float>(partials, folded.data_ptr<double>(), nullptr, nullptr);
  });
  return folded;
}

at::Tensor lse_finish_cuda(const at::Tensor& partials) { // (n, 4)
  check_partials(partials);
  const c10::cuda::CUDAGuard guard(partials.device());
  at::Tensor scalars = at::empty({4}, partials.options());
  launch_finalize<double, float>(partials.contiguous(), nullptr, scalars.data_ptr<double>(), nullptr);
  return scalars;
}

at::Tensor block_grad_cuda(
    const at::Tensor& rows, // (R, D)
    const at::Tensor& row_labels, // (R,)
    const at::Tensor& cols, // (C, D)
    const at::Tensor& col_labels, // (C,)
    const at::Tensor& scalars, // (4,)
    double margin,
    double gamma) {
  check_block_inputs(rows, row_labels, cols, col_labels, margin, gamma);
  check_scalars(scalars, rows.device());
  const c10::cuda::CUDAGuard guard(rows.device());
  at::Tensor grad;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rows.scalar_type(), "circle_block_grad_cuda", [&] {
    using acc_t = typename Acc<scalar_t>::type;
    grad = launch_gradient<scalar_t, acc_t>(
        prepare(rows, row_labels), prepare(cols, col_labels), margin, gamma, scalars.contiguous());
  });
  return grad;
}

} // namespace

TORCH_LIBRARY_IMPL(circle, CUDA, m) {
  m.impl("loss", &loss_cuda);
  m.impl("_loss_with_grad", &loss_with_grad_cuda);
  m.impl("_lse_partials", &lse_partials_cuda);
  m.impl("_lse_finish", &lse_finish_cuda);
  m.impl("_block_grad", &block_grad_cuda);
}

} // namespace circle_loss
