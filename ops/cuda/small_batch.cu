// CUDA kernels of circle::loss for batches of up to kSmallBatch rows.
//
// There the strip path is bound by launches and latency: two cuBLAS calls and
// four kernels of a few microseconds each, most SMs idle. Here the op is two
// launches of our own, each spread over every SM:
//   small_similarity_kernel  one CTA per kTile × kTile tile on or above the
//                            diagonal of S: the tile's dot products and its
//                            LSE partials (off-diagonal tiles count twice)
//                            and, when the gradient is wanted, each pair's
//                            term E_ij = exp(z_ij − m)·c_ij, m the tile's
//                            largest z of the pair's set, written for the
//                            tile and its mirror image to E, (B, B): 1 MiB at
//                            most;
//   small_gradient_kernel    one CTA per kTile rows × a slice of the features:
//                            folds every tile's partial into the two LSEs
//                            (each CTA the same way, in a fixed order, so all
//                            agree), turns E into the weights
//                            W_ij = 2σ(Z)·exp(m − LSE)·E_ij (SPEC.md,
//                            "Gradient"; one factor per tile and set, no exp
//                            per pair) and multiplies them with F. It is
//                            launched as a programmatic dependent of the
//                            first kernel: its CTAs start, and fetch their
//                            features, while that one finishes.
// The loss alone is the first kernel and finalize_kernel.
//
// Each warp streams its own chunks of F (and of E) into shared memory with
// asynchronous copies, two chunks in flight, and the warps' partial products
// are summed in warp order: no atomics, bitwise the same every run.
#include "common.cuh"
#include "small_batch.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

namespace circle_loss {
namespace {

// Rows of a tile of S, and of a gradient CTA.
constexpr int kTile = 16;
static_assert(kTile * kTile == kThreads, "one thread per entry of a tile in the epilogues");
static_assert(kSmallBatch / kTile <= 32, "one lane per column block in the gradient's factors");

// Chunks a warp has in flight: the one it multiplies and the next.
constexpr int kRing = 2;

// N values of T from shared memory, in one 8- or 16-byte load, as acc_t.
template <typename acc_t, int N, typename T>
__device__ __forceinline__ Packed<acc_t, N> load_as(const T* p) {
  const Packed<T, N> raw = *reinterpret_cast<const Packed<T, N>*>(p);
  Packed<acc_t, N> out;
#pragma unroll
  for (int v = 0; v < N; ++v) out.v[v] = static_cast<acc_t>(raw.v[v]);
  return out;
}

// 16 bytes from global to shared memory, zeros where `inside` is false (then
// nothing is read; `global` must still be a valid address). From sm_80 on an
// asynchronous copy that stages nothing in registers and lands by
// wait_copies; before, an ordinary load and store.
__device__ __forceinline__ void copy_16(void* shared, const void* global, bool inside) {
#if __CUDA_ARCH__ >= 800
  const auto address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global), "r"(inside ? 16 : 0)
               : "memory");
#else
  *static_cast<uint4*>(shared) = inside ? *static_cast<const uint4*>(global) : make_uint4(0, 0, 0, 0);
#endif
}

// Closes the group of this thread's copies issued since the last call.
__device__ __forceinline__ void commit_copies() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most kPending of this thread's groups are still in flight.
template <int kPending>
__device__ __forceinline__ void wait_copies() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Elements [d, d + kVec<T>) of row `row` of a matrix `width` wide to shared
// memory, zeros past the row's end and for rows not `row_inside`: one copy_16
// where `vectorized` (rows 16-byte aligned and width a multiple of kVec<T>, so
// that a vector lies wholly inside or outside), else element by element.
template <typename T>
__device__ __forceinline__ void stage_vector(
    T* shared,
    const T* matrix,
    int row,
    int d,
    bool row_inside,
    int width,
    bool vectorized) {
  if (vectorized) {
    const bool inside = row_inside && d < width;
    copy_16(shared, inside ? matrix + row * width + d : matrix, inside);
  } else {
#pragma unroll
    for (int v = 0; v < kVec<T>; ++v) {
      shared[v] = row_inside && d + v < width ? matrix[row * width + d + v] : T(0);
    }
  }
}

// A warp stages rows [first_row, first_row + kRows) of a matrix `width` wide,
// columns [first_col, first_col + kCols), to shared memory kPitch apart, its
// lanes taking kVec<T> elements each in turn; rows at or past `rows` and
// columns past `width` as zeros.
template <int kRows, int kCols, int kPitch, typename T>
__device__ __forceinline__ void stage_rows(
    T* shared,
    const T* matrix,
    int first_row,
    int rows,
    int first_col,
    int width,
    bool vectorized,
    int lane) {
  constexpr int kVectors = kCols / kVec<T>; // a row's
  static_assert(kRows * kVectors % 32 == 0, "every lane copies as many vectors");
#pragma unroll
  for (int u = 0; u < kRows * kVectors / 32; ++u) {
    const int e = lane + 32 * u;
    const int row = first_row + e / kVectors;
    const int col = e % kVectors * kVec<T>;
    stage_vector(shared + e / kVectors * kPitch + col, matrix, row, first_col + col, row < rows, width, vectorized);
  }
}

// Programmatic dependent launch (sm_90 on; no-ops before, and in a kernel
// launched the ordinary way): the first lets the stream's next kernel, if it
// was launched by launch_dependent, start now; the second waits until the
// stream's previous kernel has finished and its writes are visible.
__device__ __forceinline__ void allow_dependents_to_start() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prerequisites() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Tiles (row, col), col >= row, of an edge × edge grid, numbered row by row:
// row r starts at r·(2·edge − r + 1)/2.
__device__ __forceinline__ int upper_triangle_start(int row, int edge) {
  return row * (2 * edge - row + 1) / 2;
}

__device__ __forceinline__ int upper_triangle_index(int row, int col, int edge) {
  return upper_triangle_start(row, edge) + col - row;
}

struct TilePosition {
  int row;
  int col;
};

// The tile numbered `index`: the start formula inverted, then the float
// square root's rounding corrected by a step.
__device__ __forceinline__ TilePosition upper_triangle_tile(int index, int edge) {
  const int b = 2 * edge + 1;
  int row = static_cast<int>((b - sqrtf(static_cast<float>(b * b - 8 * index))) / 2);
  if (upper_triangle_start(row + 1, edge) <= index) ++row;
  if (upper_triangle_start(row, edge) > index) --row;
  return {row, row + index - upper_triangle_start(row, edge)};
}

// small_similarity_kernel: each warp takes every kWarps-th chunk of kChunk
// features (128 bytes of a row) and stages the tile's 16 rows, then its 16
// columns, kPitch apart (a 16-byte pad, so that the 8 rows a load touches fall
// in different banks). Lane l holds 2 × 4 dot products: rows l/4 and l/4 + 8,
// columns l%4 + 4c.
template <typename scalar_t>
struct SimilarityShape {
  static constexpr int kChunk = 128 / sizeof(scalar_t);
  static constexpr int kPitch = kChunk + kVec<scalar_t>;
  static constexpr int kSlot = 2 * kTile * kPitch; // elements of one staged chunk
  static constexpr size_t kSharedBytes = kWarps * kRing * kSlot * sizeof(scalar_t);
};

// Indices are 32-bit: fits_small_batch keeps B·D and B² below 2^31.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads, 2) small_similarity_kernel(
    const scalar_t* __restrict__ features, // (B, D)
    const int64_t* __restrict__ labels, // (B,)
    int batch,
    int dim,
    bool vectorized, // rows of features 16-byte aligned
    PairLogit<acc_t> logit,
    acc_t* __restrict__ terms, // (B, B) or null
    acc_t* __restrict__ partials) { // (tiles, 4)
  using Shape = SimilarityShape<scalar_t>;
  constexpr int kChunk = Shape::kChunk;
  constexpr int kPitch = Shape::kPitch;
  constexpr int V = kVec<scalar_t>;
  static_assert(kWarps * kTile * kTile * sizeof(acc_t) <= Shape::kSharedBytes, "the warps' sums fit in the staging space");
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  __shared__ acc_t fold_scratch[2 * kWarps];
  allow_dependents_to_start(); // the gradient kernel's CTAs may take free SMs now

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
  scalar_t* ring = reinterpret_cast<scalar_t*>(shared_bytes) + warp * kRing * Shape::kSlot;
  const auto slot_of = [&](int chunk) { return ring + chunk / kWarps % kRing * Shape::kSlot; };
  const auto stage_chunk = [&](int chunk) {
    scalar_t* slot = slot_of(chunk);
    stage_rows<kTile, kChunk, kPitch>(slot, features, row0, batch, chunk * kChunk, dim, vectorized, lane);
    stage_rows<kTile, kChunk, kPitch>(slot + kTile * kPitch, features, col0, batch, chunk * kChunk, dim, vectorized, lane);
  };

  const int chunks = (dim + kChunk - 1) / kChunk;
#pragma unroll
  for (int q = 0; q < kRing; ++q) {
    if (warp + q * kWarps < chunks) stage_chunk(warp + q * kWarps);
    commit_copies();
  }
  const int li = lane / 4;
  const int lj = lane % 4;
  acc_t dot[2][4] = {};
  for (int c = warp; c < chunks; c += kWarps) {
    wait_copies<kRing - 1>(); // this lane's copies of chunk c have landed
    __syncwarp(); // and every lane's
    const scalar_t* slot = slot_of(c);
#pragma unroll
    for (int k = 0; k < kChunk; k += V) {
      Packed<acc_t, V> a[2];
      Packed<acc_t, V> b[4];
#pragma unroll
      for (int x = 0; x < 2; ++x) a[x] = load_as<acc_t, V>(slot + (li + 8 * x) * kPitch + k);
#pragma unroll
      for (int y = 0; y < 4; ++y) b[y] = load_as<acc_t, V>(slot + (kTile + lj + 4 * y) * kPitch + k);
#pragma unroll
      for (int x = 0; x < 2; ++x) {
#pragma unroll
        for (int y = 0; y < 4; ++y) {
#pragma unroll
          for (int v = 0; v < V; ++v) dot[x][y] += a[x].v[v] * b[y].v[v];
        }
      }
    }
    __syncwarp(); // every lane is done with the slot
    if (c + kRing * kWarps < chunks) stage_chunk(c + kRing * kWarps);
    commit_copies();
  }
  __syncthreads(); // every warp is done with its chunks: the space holds the sums now
  acc_t* warp_dots = reinterpret_cast<acc_t*>(shared_bytes); // [warp][row][column]
#pragma unroll
  for (int x = 0; x < 2; ++x) {
#pragma unroll
    for (int y = 0; y < 4; ++y) warp_dots[(warp * kTile + li + 8 * x) * kTile + lj + 4 * y] = dot[x][y];
  }
  __syncthreads();

  acc_t s = acc_t(0);
  for (int w = 0; w < kWarps; ++w) s += warp_dots[w * kTile * kTile + threadIdx.x];
  // One term a thread; the tile's multiplicity (off the diagonal the mirror
  // counts too) scales its sums below.
  const bool is_positive = label_i == label_j;
  acc_t slope;
  const acc_t z = logit(s, is_positive, &slope);
  LseState<acc_t> positive;
  LseState<acc_t> negative;
  if (inside) {
    if (is_positive) {
      positive = {z, acc_t(1)};
    } else {
      negative = {z, acc_t(1)};
    }
  }
  block_fold<kThreads>(positive, negative, fold_scratch);
  if (terms != nullptr && inside) {
    // E = exp(z − m)·c, m the tile's largest z of the pair's set (every
    // thread has it from the fold).
    const LseState<acc_t> entry{z, acc_t(1)};
    const acc_t term = rescaled_sum(entry, is_positive ? positive.max : negative.max) * slope;
    terms[i * batch + j] = term;
    if (!diagonal) terms[j * batch + i] = term;
  }
  if (threadIdx.x == 0) {
    const acc_t multiplicity = diagonal ? acc_t(1) : acc_t(2);
    acc_t* out = partials + 4 * blockIdx.x;
    out[0] = positive.max;
    out[1] = multiplicity * positive.sum;
    out[2] = negative.max;
    out[3] = multiplicity * negative.sum;
  }
}

// 2σ(Z)·exp(m − LSE): what turns a tile's terms exp(z − m)·c of one set into
// gradient weights. A set the tile does not hold (m = −inf) gets 0, which also
// keeps the zeros staged for rows and partners outside the batch zeros.
template <typename acc_t>
__device__ __forceinline__ acc_t set_factor_of(acc_t tile_max, double lse, double grad_scale) {
  return tile_max == -std::numeric_limits<acc_t>::infinity()
      ? acc_t(0)
      : static_cast<acc_t>(grad_scale * exp(static_cast<double>(tile_max) - lse));
}

// small_gradient_kernel: a CTA owns kTile rows and kSliceCols features of the
// gradient. Each warp takes every kWarps-th chunk of kSpan partners j and
// stages their terms E[j][rows] (E is symmetric), turned into weights in
// place, and their features F[j][slice]. Lane l holds 4 × 2V outputs: rows
// 4·(l/8) + [0, 4), features V·(l%8) + [0, V) and the same kSliceCols/2 on.
template <typename scalar_t, typename acc_t>
struct GradientShape {
  static constexpr int kSpan = 64 / sizeof(acc_t);
  static constexpr int kSliceCols = 16 * kVec<acc_t>;
  static constexpr int kWeights = kSpan * kTile; // acc_t a slot, then
  static constexpr int kFeatures = kSpan * kSliceCols; // scalar_t
  static constexpr size_t kSlotBytes = kWeights * sizeof(acc_t) + kFeatures * sizeof(scalar_t);
  static constexpr int kOutputs = kTile * kSliceCols / kThreads; // per thread, in the final sum
  // Shared memory: the warps' staging, then their sums.
  static constexpr size_t kSharedBytes =
      std::max(kWarps * kRing * kSlotBytes, kWarps * kTile * kSliceCols * sizeof(acc_t));
  static_assert(kTile % kSpan == 0, "a chunk's partners lie in one column block");
};

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads, 2) small_gradient_kernel(
    const scalar_t* __restrict__ features, // (B, D)
    int batch,
    int dim,
    bool vectorized_features, // rows of features 16-byte aligned
    bool vectorized_terms, // rows of terms 16-byte aligned
    const acc_t* __restrict__ terms, // (B, B)
    const acc_t* __restrict__ partials, // (tiles, 4)
    int tiles,
    bool gamma_negative,
    scalar_t* __restrict__ loss, // ()
    scalar_t* __restrict__ grad) { // (B, D)
  using Shape = GradientShape<scalar_t, acc_t>;
  constexpr int kSpan = Shape::kSpan;
  constexpr int kSliceCols = Shape::kSliceCols;
  constexpr int V = kVec<acc_t>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  __shared__ acc_t set_factor[2][kSmallBatch / kTile]; // [positive, negative][column block]

  const int edge = (batch + kTile - 1) / kTile;
  const int row_block = blockIdx.x;
  const int row0 = row_block * kTile;
  const int col0 = blockIdx.y * kSliceCols;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  unsigned char* ring = shared_bytes + warp * kRing * Shape::kSlotBytes;
  const auto weights_of = [&](int chunk) { // [partner][row]
    return reinterpret_cast<acc_t*>(ring + chunk / kWarps % kRing * Shape::kSlotBytes);
  };
  const auto features_of = [&](int chunk) { // [partner][feature]
    return reinterpret_cast<scalar_t*>(weights_of(chunk) + Shape::kWeights);
  };
  const auto stage_features = [&](int chunk) {
    stage_rows<kSpan, kSliceCols, kSliceCols>(
        features_of(chunk), features, chunk * kSpan, batch, col0, dim, vectorized_features, lane);
  };
  const auto stage_terms = [&](int chunk) {
    stage_rows<kSpan, kTile, kTile>(weights_of(chunk), terms, chunk * kSpan, batch, row0, batch, vectorized_terms, lane);
  };

  // The features do not depend on the similarity kernel: their copies start
  // before it has finished. The first group holds both chunks' features.
  const int chunks = (batch + kSpan - 1) / kSpan;
#pragma unroll
  for (int q = 0; q < kRing; ++q) {
    if (warp + q * kWarps < chunks) stage_features(warp + q * kWarps);
  }
  wait_for_prerequisites();
#pragma unroll
  for (int q = 0; q < kRing; ++q) {
    if (warp + q * kWarps < chunks) stage_terms(warp + q * kWarps);
    commit_copies();
  }

  // Warp 0 folds the partials, as finalize_kernel<32> does for the loss alone
  // (every CTA alike, and to the bit with the loss-only path), and finds the
  // factors of the tiles of its row block, one lane per column block.
  if (warp == 0) {
    LseState<double> positive_set;
    LseState<double> negative_set;
    fold_partials<32>(partials, tiles, static_cast<double*>(nullptr), positive_set, negative_set);
    const LossScalars scalars = finish_loss(positive_set.lse(), negative_set.lse());
    if (blockIdx.x == 0 && blockIdx.y == 0 && lane == 0) store_loss(scalars, loss);
    if (lane < edge) {
      const int tile = upper_triangle_index(min(row_block, lane), max(row_block, lane), edge);
      set_factor[0][lane] = set_factor_of(partials[4 * tile], scalars.lse_positive, scalars.grad_scale);
      set_factor[1][lane] = set_factor_of(partials[4 * tile + 2], scalars.lse_negative, scalars.grad_scale);
    }
  }
  __syncthreads();

  const int li = lane / 8;
  const int lj = lane % 8;
  acc_t sum[4][2 * V] = {};
  for (int c = warp; c < chunks; c += kWarps) {
    wait_copies<kRing - 1>(); // this lane's copies of chunk c have landed
    __syncwarp(); // and every lane's
    acc_t* weight = weights_of(c);
    const scalar_t* member = features_of(c);
    // Terms to weights, by the factor of their set: positive pairs' slopes
    // −γ·αp carry the sign of −γ, negative pairs' γ·αn that of γ (a zero
    // term stays zero either way).
    const int col_block = c * kSpan / kTile;
    const acc_t positive_factor = set_factor[0][col_block];
    const acc_t negative_factor = set_factor[1][col_block];
#pragma unroll
    for (int u = 0; u < Shape::kWeights / 32; ++u) {
      const acc_t term = weight[lane + 32 * u];
      const bool negative_sign = signbit(term);
      weight[lane + 32 * u] = term * (negative_sign != gamma_negative ? positive_factor : negative_factor);
    }
    __syncwarp();
#pragma unroll
    for (int p = 0; p < kSpan; ++p) {
      const Packed<acc_t, 4> w = load_as<acc_t, 4>(weight + p * kTile + 4 * li);
      const Packed<acc_t, V> f0 = load_as<acc_t, V>(member + p * kSliceCols + V * lj);
      const Packed<acc_t, V> f1 = load_as<acc_t, V>(member + p * kSliceCols + kSliceCols / 2 + V * lj);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
#pragma unroll
        for (int v = 0; v < V; ++v) {
          sum[r][v] += w.v[r] * f0.v[v];
          sum[r][V + v] += w.v[r] * f1.v[v];
        }
      }
    }
    __syncwarp(); // every lane is done with the slot
    if (c + kRing * kWarps < chunks) {
      stage_features(c + kRing * kWarps);
      stage_terms(c + kRing * kWarps);
    }
    commit_copies();
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

// Dynamic shared memory past 48 KiB must be asked for, per kernel and device.
template <typename Kernel>
void allow_shared_bytes(Kernel* kernel, size_t bytes) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

// Launches `kernel` on the current stream as a programmatic dependent of the
// stream's previous kernel (sm_90 on): it may start before that one has
// finished, and calls wait_for_prerequisites() before reading its output.
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, size_t shared_bytes, Args&&... args) {
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = c10::cuda::getCurrentCUDAStream();
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, c10::cuda::current_device()));
  config.attrs = &attribute;
  config.numAttrs = major >= 9 ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
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
  const scalar_t* feature_data = features.data_ptr<scalar_t>();
  const bool vectorized = dim % kVec<scalar_t> == 0 && reinterpret_cast<uintptr_t>(feature_data) % 16 == 0;
  // The tiles' partials, then E when the gradient needs it (16-byte aligned:
  // 4 values a tile).
  at::Tensor workspace =
      at::empty({4 * tiles + (grad != nullptr ? int64_t{batch} * batch : 0)}, features.options().dtype(dtype_of<acc_t>()));
  acc_t* partials = workspace.data_ptr<acc_t>();
  acc_t* terms = grad != nullptr ? partials + 4 * tiles : nullptr;

  constexpr auto similarity_kernel = small_similarity_kernel<scalar_t, acc_t>;
  constexpr size_t similarity_bytes = SimilarityShape<scalar_t>::kSharedBytes;
  allow_shared_bytes(similarity_kernel, similarity_bytes);
  similarity_kernel<<<tiles, kThreads, similarity_bytes, c10::cuda::getCurrentCUDAStream()>>>(
      feature_data, labels.data_ptr<int64_t>(), batch, dim, vectorized, logit, terms, partials);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (grad == nullptr) {
    launch_finalize<32, acc_t, scalar_t>(partials, tiles, nullptr, nullptr, loss.data_ptr<scalar_t>());
    return;
  }
  *grad = at::empty_like(features);
  using Shape = GradientShape<scalar_t, acc_t>;
  constexpr auto gradient_kernel = small_gradient_kernel<scalar_t, acc_t>;
  allow_shared_bytes(gradient_kernel, Shape::kSharedBytes);
  const dim3 grid(edge, std::max((dim + Shape::kSliceCols - 1) / Shape::kSliceCols, 1));
  launch_dependent(gradient_kernel, grid, Shape::kSharedBytes, feature_data, batch, dim, vectorized,
                   batch % kVec<acc_t> == 0, static_cast<const acc_t*>(terms), static_cast<const acc_t*>(partials),
                   tiles, std::signbit(gamma), loss.data_ptr<scalar_t>(), grad->data_ptr<scalar_t>());
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
