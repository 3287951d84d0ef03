// CUDA kernels of circle::loss for batches of up to kSmallBatch rows.
//
// There the strip path is bound by launches and latency: two cuBLAS calls and
// four kernels of a few microseconds each, most SMs idle. Here the op is two
// launches of our own, each spread over every SM:
//   small_similarity_kernel  one CTA per kTile × kTile tile on or above the
//                            diagonal of S: the tile's dot products, its LSE
//                            partials (off-diagonal tiles count twice) and,
//                            when the gradient is wanted, the tile and its
//                            mirror image written to S, (B, B): 1 MiB at most;
//   small_gradient_kernel    one CTA per kTile rows × a slice of the features:
//                            folds every tile's partial (each CTA the same
//                            way, in a fixed order, so all agree), turns S's
//                            rows into gradient weights W = 2σ(Z)·exp(z - LSE)·c
//                            (SPEC.md, "Gradient") and multiplies them with F.
// The loss alone is the first kernel and finalize_kernel.
//
// Both stage F through shared memory in chunks, each warp its own chunks, the
// next chunk loaded into registers while this one is used, and sum the warps'
// partial products in warp order: no atomics, bitwise the same every run.
#include "common.cuh"
#include "small_batch.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>

namespace circle_loss {
namespace {

// Rows of a tile of S, and of a gradient CTA.
constexpr int kTile = 16;
static_assert(kTile * kTile == kThreads, "one thread per entry of a tile in the epilogues");

// Elements of T in 16 bytes: the unit of the shared-memory loads.
template <typename T>
constexpr int kVec = 16 / sizeof(T);

// N values of T loaded from shared memory as one (or two) 16-byte accesses.
template <typename T, int N>
struct alignas(sizeof(T) * N) Packed {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Packed<T, N> load_packed(const T* p) {
  return *reinterpret_cast<const Packed<T, N>*>(p);
}

// small_similarity_kernel: each warp takes every kWarps-th chunk of kChunk
// features and stages the tile's 16 rows, then its 16 columns, kPitch apart (a
// 16-byte pad, so that the 8 rows a load touches fall in different banks).
// Lane l holds 2 × 4 dot products: rows l/4 and l/4 + 8, columns l%4 + 4c.
template <typename acc_t>
struct SimilarityShape {
  static constexpr int kChunk = 128 / sizeof(acc_t);
  static constexpr int kPitch = kChunk + kVec<acc_t>;
  static constexpr int kLoads = 2 * kTile * kChunk / 32; // per lane and chunk
  static constexpr int kWarpElements = 2 * kTile * kPitch;
  static_assert(kWarps * kTile * kTile <= kWarps * kWarpElements, "the warps' sums fit in the staging space");
};

// The tile (ti, tj), tj >= ti, that is number `index` of the upper triangle
// of an edge × edge grid of tiles, counted row by row.
struct TilePosition {
  int row;
  int col;
};

__device__ __forceinline__ TilePosition upper_triangle_tile(int index, int edge) {
  // Row r starts at index r·(2·edge − r + 1)/2: invert that, then correct the
  // float square root's rounding by a step.
  const auto start = [edge](int r) { return r * (2 * edge - r + 1) / 2; };
  const int b = 2 * edge + 1;
  int row = static_cast<int>((b - sqrtf(static_cast<float>(b * b - 8 * index))) / 2);
  if (start(row + 1) <= index) ++row;
  if (start(row) > index) --row;
  return {row, row + index - start(row)};
}

// Indices are 32-bit: fits_small_batch keeps B·D and B² below 2^31.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads, 2) small_similarity_kernel(
    const scalar_t* __restrict__ features, // (B, D)
    const int64_t* __restrict__ labels, // (B,)
    int batch,
    int dim,
    PairLogit<acc_t> logit,
    acc_t* __restrict__ similarities, // (B, B) or null
    acc_t* __restrict__ partials) { // (tiles, 4)
  using Shape = SimilarityShape<acc_t>;
  constexpr int kChunk = Shape::kChunk;
  constexpr int kPitch = Shape::kPitch;
  constexpr int V = kVec<acc_t>;
  __shared__ __align__(16) acc_t staged[kWarps * Shape::kWarpElements];
  __shared__ acc_t fold_scratch[2 * kWarps];

  const TilePosition tile_at = upper_triangle_tile(blockIdx.x, (batch + kTile - 1) / kTile);
  const int row0 = tile_at.row * kTile;
  const int col0 = tile_at.col * kTile;
  const bool diagonal = row0 == col0;
  // This thread's entry of the tile in the epilogue; its labels are loaded now.
  const int i = row0 + threadIdx.x / kTile;
  const int j = col0 + threadIdx.x % kTile;
  const bool inside = i < batch && j < batch;
  const int64_t label_i = inside ? labels[i] : 0;
  const int64_t label_j = inside ? labels[j] : 0;

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  acc_t* tile = staged + warp * Shape::kWarpElements; // [row0.. then col0..][feature]
  acc_t next[Shape::kLoads];
  const auto load_chunk = [&](int d0) {
#pragma unroll
    for (int u = 0; u < Shape::kLoads; ++u) {
      const int e = lane + 32 * u;
      const int r = e / kChunk;
      const int row = r < kTile ? row0 + r : col0 + r - kTile;
      const int d = d0 + e % kChunk;
      next[u] = row < batch && d < dim ? static_cast<acc_t>(features[row * dim + d]) : acc_t(0);
    }
  };

  const int li = lane / 4;
  const int lj = lane % 4;
  acc_t dot[2][4] = {};
  const int chunks = (dim + kChunk - 1) / kChunk;
  if (warp < chunks) load_chunk(warp * kChunk);
  for (int c = warp; c < chunks; c += kWarps) {
    __syncwarp(); // the previous chunk has been used
#pragma unroll
    for (int u = 0; u < Shape::kLoads; ++u) {
      const int e = lane + 32 * u;
      tile[e / kChunk * kPitch + e % kChunk] = next[u];
    }
    __syncwarp();
    if (c + kWarps < chunks) load_chunk((c + kWarps) * kChunk);
#pragma unroll
    for (int k = 0; k < kChunk; k += V) {
      Packed<acc_t, V> a[2];
      Packed<acc_t, V> b[4];
#pragma unroll
      for (int x = 0; x < 2; ++x) a[x] = load_packed<acc_t, V>(tile + (li + 8 * x) * kPitch + k);
#pragma unroll
      for (int y = 0; y < 4; ++y) b[y] = load_packed<acc_t, V>(tile + (kTile + lj + 4 * y) * kPitch + k);
#pragma unroll
      for (int x = 0; x < 2; ++x) {
#pragma unroll
        for (int y = 0; y < 4; ++y) {
#pragma unroll
          for (int v = 0; v < V; ++v) dot[x][y] += a[x].v[v] * b[y].v[v];
        }
      }
    }
  }
  __syncthreads(); // every warp is done with its chunks: the space holds the sums now
  acc_t* warp_dots = staged; // [warp][row][column]
#pragma unroll
  for (int x = 0; x < 2; ++x) {
#pragma unroll
    for (int y = 0; y < 4; ++y) warp_dots[(warp * kTile + li + 8 * x) * kTile + lj + 4 * y] = dot[x][y];
  }
  __syncthreads();

  acc_t s = acc_t(0);
  for (int w = 0; w < kWarps; ++w) s += warp_dots[w * kTile * kTile + threadIdx.x];
  LseState<acc_t> positive;
  LseState<acc_t> negative;
  if (inside) {
    if (similarities != nullptr) {
      similarities[i * batch + j] = s;
      if (!diagonal) similarities[j * batch + i] = s;
    }
    const bool is_positive = label_i == label_j;
    acc_t slope;
    const acc_t z = logit(s, is_positive, &slope);
    // A diagonal tile holds both (i, j) and (j, i); another tile stands for its mirror too.
    const LseState<acc_t> entry{z, diagonal ? acc_t(1) : acc_t(2)};
    if (is_positive) {
      positive = entry;
    } else {
      negative = entry;
    }
  }
  block_fold<kThreads>(positive, negative, fold_scratch);
  if (threadIdx.x == 0) {
    acc_t* out = partials + 4 * blockIdx.x;
    out[0] = positive.max;
    out[1] = positive.sum;
    out[2] = negative.max;
    out[3] = negative.sum;
  }
}

// small_gradient_kernel: a CTA owns kTile rows and kSliceCols features of the
// gradient. Each warp takes every kWarps-th chunk of kSpan partners j and
// stages their weights W[j][rows] (S's row j, S being symmetric) and features
// F[j][slice]. Lane l holds 4 × 2V outputs: rows 4·(l/8) + [0, 4), features
// V·(l%8) + [0, V) and the same kSliceCols/2 further on.
template <typename acc_t>
struct GradientShape {
  static constexpr int kSliceCols = 16 * kVec<acc_t>;
  static constexpr int kSpan = 64 / sizeof(acc_t);
  static constexpr int kWeightLoads = kSpan * kTile / 32; // per lane and chunk
  static constexpr int kFeatureLoads = kSpan * kSliceCols / 32;
  static constexpr int kWarpElements = kSpan * (kTile + kSliceCols);
  static constexpr int kOutputs = kTile * kSliceCols / kThreads; // per thread, in the final sum
  // Shared memory: the warps' staging, then their sums.
  static constexpr size_t kSharedBytes =
      std::max(kWarps * kWarpElements * sizeof(acc_t), kWarps * kTile * kSliceCols * sizeof(acc_t));
};

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads, 2) small_gradient_kernel(
    const scalar_t* __restrict__ features, // (B, D)
    const int64_t* __restrict__ labels, // (B,)
    int batch,
    int dim,
    const acc_t* __restrict__ similarities, // (B, B)
    const acc_t* __restrict__ partials, // (tiles, 4)
    int tiles,
    PairLogit<acc_t> logit,
    scalar_t* __restrict__ loss, // ()
    scalar_t* __restrict__ grad) { // (B, D)
  using Shape = GradientShape<acc_t>;
  constexpr int kSpan = Shape::kSpan;
  constexpr int kSliceCols = Shape::kSliceCols;
  constexpr int V = kVec<acc_t>;
  __shared__ __align__(32) unsigned char shared_bytes[Shape::kSharedBytes];
  __shared__ double fold_scratch[2 * kWarps];
  __shared__ int64_t row_label[kTile];

  const int row0 = blockIdx.x * kTile;
  const int col0 = blockIdx.y * kSliceCols;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  acc_t* weight = reinterpret_cast<acc_t*>(shared_bytes) + warp * Shape::kWarpElements; // [partner][row]
  acc_t* member = weight + kSpan * kTile; // [partner][feature]
  acc_t similarity_next[Shape::kWeightLoads];
  int64_t label_next[Shape::kWeightLoads];
  acc_t feature_next[Shape::kFeatureLoads];
  const auto load_chunk = [&](int j0) {
#pragma unroll
    for (int u = 0; u < Shape::kWeightLoads; ++u) {
      const int e = lane + 32 * u;
      const int j = j0 + e / kTile;
      const int i = row0 + e % kTile;
      const bool inside = j < batch && i < batch;
      similarity_next[u] = inside ? similarities[j * batch + i] : acc_t(0);
      label_next[u] = inside ? labels[j] : 0;
    }
#pragma unroll
    for (int u = 0; u < Shape::kFeatureLoads; ++u) {
      const int e = lane + 32 * u;
      const int j = j0 + e / kSliceCols;
      const int d = col0 + e % kSliceCols;
      feature_next[u] = j < batch && d < dim ? static_cast<acc_t>(features[j * dim + d]) : acc_t(0);
    }
  };
  // The first chunk's loads are in flight while the partials are folded.
  const int chunks = (batch + kSpan - 1) / kSpan;
  if (warp < chunks) load_chunk(warp * kSpan);
  if (threadIdx.x < kTile) row_label[threadIdx.x] = row0 + threadIdx.x < batch ? labels[row0 + threadIdx.x] : 0;

  // Every CTA folds the same partials the same way, as finalize_kernel does
  // for the loss alone: all agree, and with the loss-only path, to the bit.
  // (The fold's barriers also publish row_label.)
  LseState<double> positive_set;
  LseState<double> negative_set;
  fold_partials<kThreads>(partials, tiles, fold_scratch, positive_set, negative_set);
  const LossScalars scalars = finish_loss(positive_set.lse(), negative_set.lse());
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) store_loss(scalars, loss);
  const acc_t lse_positive = static_cast<acc_t>(scalars.lse_positive);
  const acc_t lse_negative = static_cast<acc_t>(scalars.lse_negative);
  const acc_t scale = static_cast<acc_t>(scalars.grad_scale);

  const auto store_chunk = [&](int j0) {
#pragma unroll
    for (int u = 0; u < Shape::kWeightLoads; ++u) {
      const int e = lane + 32 * u;
      const bool inside = j0 + e / kTile < batch && row0 + e % kTile < batch;
      const bool is_positive = label_next[u] == row_label[e % kTile];
      acc_t slope;
      const acc_t z = logit(similarity_next[u], is_positive, &slope);
      weight[e] = inside ? scale * exp(z - (is_positive ? lse_positive : lse_negative)) * slope : acc_t(0);
    }
#pragma unroll
    for (int u = 0; u < Shape::kFeatureLoads; ++u) member[lane + 32 * u] = feature_next[u];
  };

  const int li = lane / 8;
  const int lj = lane % 8;
  acc_t sum[4][2 * V] = {};
  for (int c = warp; c < chunks; c += kWarps) {
    __syncwarp(); // the previous chunk has been used
    store_chunk(c * kSpan);
    __syncwarp();
    if (c + kWarps < chunks) load_chunk((c + kWarps) * kSpan);
#pragma unroll
    for (int p = 0; p < kSpan; ++p) {
      const Packed<acc_t, 4> w = load_packed<acc_t, 4>(weight + p * kTile + 4 * li);
      const Packed<acc_t, V> f0 = load_packed<acc_t, V>(member + p * kSliceCols + V * lj);
      const Packed<acc_t, V> f1 = load_packed<acc_t, V>(member + p * kSliceCols + kSliceCols / 2 + V * lj);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int v = 0; v < V; ++v) {
          sum[r][v] += w.v[r] * f0.v[v];
          sum[r][V + v] += w.v[r] * f1.v[v];
        }
      }
    }
  }
  __syncthreads(); // every warp is done with its chunks: the space holds the sums now
  acc_t* warp_sums = reinterpret_cast<acc_t*>(shared_bytes); // [warp][row][feature]
#pragma unroll
  for (int r = 0; r < 4; ++r) {
#pragma unroll
    for (int v = 0; v < 2 * V; ++v) {
      const int feature = (v < V ? 0 : kSliceCols / 2) + V * lj + v % V;
      warp_sums[(warp * kTile + 4 * li + r) * kSliceCols + feature] = sum[r][v];
    }
  }
  __syncthreads();
#pragma unroll
  for (int u = 0; u < Shape::kOutputs; ++u) {
    const int e = threadIdx.x + kThreads * u;
    acc_t total = acc_t(0);
    for (int w = 0; w < kWarps; ++w) total += warp_sums[w * kTile * kSliceCols + e];
    const int i = row0 + e / kSliceCols;
    const int d = col0 + e % kSliceCols;
    if (i < batch && d < dim) grad[i * dim + d] = static_cast<scalar_t>(total);
  }
}

// The loss, and with grad given dloss/dfeatures, of one small batch.
template <typename scalar_t>
void small_batch(
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    double margin,
    double gamma,
    at::Tensor& loss, // ()
    at::Tensor* grad) { // (B, D) or null
  using acc_t = typename Acc<scalar_t>::type;
  const int batch = static_cast<int>(features.size(0));
  const int dim = static_cast<int>(features.size(1));
  const int edge = (batch + kTile - 1) / kTile;
  const int tiles = edge * (edge + 1) / 2;
  const PairLogit<acc_t> logit{static_cast<acc_t>(margin), static_cast<acc_t>(gamma)};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  // The tiles' partials, then S when the gradient needs it.
  at::Tensor workspace =
      at::empty({4 * tiles + (grad != nullptr ? int64_t{batch} * batch : 0)}, features.options().dtype(dtype_of<acc_t>()));
  acc_t* partials = workspace.data_ptr<acc_t>();
  acc_t* similarities = grad != nullptr ? partials + 4 * tiles : nullptr;
  small_similarity_kernel<scalar_t, acc_t><<<tiles, kThreads, 0, stream>>>(
      features.data_ptr<scalar_t>(), labels.data_ptr<int64_t>(), batch, dim, logit, similarities, partials);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (grad == nullptr) {
    launch_finalize<kThreads, acc_t, scalar_t>(partials, tiles, nullptr, nullptr, loss.data_ptr<scalar_t>());
    return;
  }
  *grad = at::empty_like(features);
  constexpr int kSliceCols = GradientShape<acc_t>::kSliceCols;
  const dim3 grid(edge, std::max((dim + kSliceCols - 1) / kSliceCols, 1));
  small_gradient_kernel<scalar_t, acc_t><<<grid, kThreads, 0, stream>>>(
      features.data_ptr<scalar_t>(), labels.data_ptr<int64_t>(), batch, dim, similarities, partials, tiles, logit,
      loss.data_ptr<scalar_t>(), grad->data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

} // namespace

at::Tensor small_batch_loss(const at::Tensor& features, const at::Tensor& labels, double margin, double gamma) {
  at::Tensor loss = at::empty({}, features.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, features.scalar_type(), "circle_loss_small_batch", [&] {
    small_batch<scalar_t>(features, labels, margin, gamma, loss, nullptr);
  });
  return loss;
}

std::tuple<at::Tensor, at::Tensor> small_batch_loss_with_grad(
    const at::Tensor& features,
    const at::Tensor& labels,
    double margin,
    double gamma) {
  at::Tensor loss = at::empty({}, features.options());
  at::Tensor grad;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, features.scalar_type(), "circle_loss_small_batch", [&] {
    small_batch<scalar_t>(features, labels, margin, gamma, loss, &grad);
  });
  return {loss, grad};
}

} // namespace circle_loss
