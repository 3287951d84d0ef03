// What the CUDA translation units of circle::loss share: the accumulation
// types, the in-CTA LSE fold, the fixed-order fold of LSE partials into the
// loss, programmatic dependent launch, and the inputs as the kernels read
// them. In an anonymous namespace, as the kernels are: each translation unit
// gets the instantiations it uses.
#pragma once

#include "../kernel_args.h"

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <utility>

namespace circle_loss {
namespace {

// Threads of every CTA but the strip path's folds.
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Elements of T in 16 bytes: the unit of vector loads, stores and copies.
template <typename T>
constexpr int kVec = 16 / sizeof(T);

// N values of T moved as one access.
template <typename T, int N>
struct alignas(sizeof(T) * N) Packed {
  T v[N];
};

template <typename T>
at::ScalarType dtype_of() {
  return c10::CppTypeToScalarType<T>::value;
}

// values[k] = op over the CTA's kBlock threads of their values[k], for both k,
// in a fixed order: an xor-shuffle tree within each warp, then the warps in
// index order. Every thread gets the result. scratch: 2 · kBlock / 32 values
// of shared memory. kBlock = 32 is one warp alone: no scratch, no barrier, so
// any one warp of a larger CTA may call it.
template <int kBlock, typename T, typename Op>
__device__ __forceinline__ void block_reduce(T (&values)[2], Op op, T* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    values[0] = op(values[0], __shfl_xor_sync(0xffffffffu, values[0], offset));
    values[1] = op(values[1], __shfl_xor_sync(0xffffffffu, values[1], offset));
  }
  if constexpr (kBlock == 32) {
    return;
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    scratch[2 * warp] = values[0];
    scratch[2 * warp + 1] = values[1];
  }
  __syncthreads();
  values[0] = scratch[0];
  values[1] = scratch[1];
  for (int w = 1; w < kBlock / 32; ++w) {
    values[0] = op(values[0], scratch[2 * w]);
    values[1] = op(values[1], scratch[2 * w + 1]);
  }
  __syncthreads(); // scratch is free again
}

// sum · exp(max - largest): a (max, Σ) state's sum at the stabiliser largest,
// which is at least max. An empty state gives exactly 0, a state whose max is
// the largest its sum (an infinite one too); NaN propagates. The exp is taken
// in every case, so that a thread's several calls compile to straight-line
// code whose exps overlap, not to a branch around each.
template <typename T>
__device__ __forceinline__ T rescaled_sum(const LseState<T>& state, T largest) {
  const T rescaled = state.sum * exp(state.max - largest);
  return state.sum == T(0) ? T(0) : state.max == largest ? state.sum : rescaled;
}

// Folds every thread's state of both sets over a CTA of kBlock threads: the
// largest max first, then each state's sum rescaled to it and summed. Two
// shallow reductions with one exp per thread, in a fixed order, so every run
// sums alike. Every thread gets the result. scratch: 2 · kBlock / 32 values of
// shared memory.
template <int kBlock, typename T>
__device__ __forceinline__ void block_fold(LseState<T>& positive, LseState<T>& negative, T* scratch) {
  T largest[2] = {positive.max, negative.max};
  block_reduce<kBlock>(largest, [](T a, T b) { return nan_max(a, b); }, scratch);
  T total[2] = {rescaled_sum(positive, largest[0]), rescaled_sum(negative, largest[1])};
  block_reduce<kBlock>(total, [](T a, T b) { return a + b; }, scratch);
  positive = {largest[0], total[0]};
  negative = {largest[1], total[1]};
}

// The two orders in which fold_partials combines partials across threads.
enum class FoldOrder {
  // Each thread rescales its own partials' sums to its own largest max, and
  // block_fold merges the threads' states: the loss's float64 fold, whose
  // bits every path of the loss shares.
  kThreadStates,
  // The block's largest max first, then every partial's sum rescaled to it
  // and added up: the exps of a thread's partials are independent and the
  // block's final step is a plain sum, so the fold is shorter (the small
  // path's gradient CTAs each wait for such a fold in float32).
  kBlockMaxFirst,
};

// Folds partials (n, 4) = (max_P, Σ_P, max_N, Σ_N) in T (float64 for the
// loss) in a fixed order: thread t takes partials t, t + kBlock, ... (the
// largest max first, then the sums rescaled to it: independent exps, not a
// chain of merges), and the threads combine in `order`. The same kBlock,
// order, T and n give the same bits wherever it runs. Every thread gets the
// result. scratch: 2 · kBlock / 32 values of shared memory (none for one
// warp, kBlock = 32).
template <int kBlock, FoldOrder order = FoldOrder::kThreadStates, typename T, typename partial_t>
__device__ __forceinline__ void fold_partials(
    const partial_t* __restrict__ partials, // (n, 4)
    int64_t n,
    T* scratch,
    LseState<T>& positive,
    LseState<T>& negative) {
  // A thread reads its partials kTogether at a time, those past n as empty
  // states (a select, not a branch), so that their loads and exps are in
  // flight together: a plain unrolled loop with a runtime count ran as its
  // remainder loop, a branch around every exp. The empty states change no
  // bit: nan_max(x, -inf) = x and x + 0 = x.
  constexpr int kTogether = 4;
  const auto part = [&](int64_t t) { return t < n ? PairStates<T>::at(partials, t) : PairStates<T>{}; };
  const int64_t first = threadIdx.x % kBlock;
  T largest[2] = {-std::numeric_limits<T>::infinity(), -std::numeric_limits<T>::infinity()};
  for (int64_t t0 = first; t0 < n; t0 += kBlock * kTogether) {
#pragma unroll
    for (int k = 0; k < kTogether; ++k) {
      const PairStates<T> p = part(t0 + kBlock * k);
      largest[0] = nan_max(largest[0], p.positive.max);
      largest[1] = nan_max(largest[1], p.negative.max);
    }
  }
  if constexpr (order == FoldOrder::kBlockMaxFirst) {
    block_reduce<kBlock>(largest, [](T a, T b) { return nan_max(a, b); }, scratch);
  }
  T total[2] = {T(0), T(0)};
  for (int64_t t0 = first; t0 < n; t0 += kBlock * kTogether) {
#pragma unroll
    for (int k = 0; k < kTogether; ++k) {
      const PairStates<T> p = part(t0 + kBlock * k);
      total[0] += rescaled_sum(p.positive, largest[0]);
      total[1] += rescaled_sum(p.negative, largest[1]);
    }
  }
  if constexpr (order == FoldOrder::kBlockMaxFirst) {
    block_reduce<kBlock>(total, [](T a, T b) { return a + b; }, scratch);
  }
  positive = {largest[0], total[0]};
  negative = {largest[1], total[1]};
  if constexpr (order == FoldOrder::kThreadStates) {
    block_fold<kBlock>(positive, negative, scratch);
  }
}

// Kernel attributes hold per device, and reading or setting them is a driver
// call: configure() sets `kernel`'s and says whether it can run here, once on
// each device (the first time the kernel runs there), and its answer is kept.
template <auto kernel, typename Configure>
inline bool configure_once(const Configure& configure) {
  static const int devices = c10::cuda::device_count();
  static const std::unique_ptr<std::once_flag[]> done(new std::once_flag[devices]);
  static const std::unique_ptr<bool[]> usable(new bool[devices]());
  const int device = c10::cuda::current_device();
  std::call_once(done[device], [&] { usable[device] = configure(); });
  return usable[device];
}

// The loss in the features' dtype, rounded through the accumulation type as
// every path rounds it.
template <typename loss_t>
__device__ __forceinline__ void store_loss(const LossScalars& scalars, loss_t* loss) {
  using acc_t = at::opmath_type<loss_t>;
  *loss = static_cast<loss_t>(static_cast<acc_t>(scalars.loss));
}

// One CTA of kBlock threads folds partials. Writes, where given: the folded
// partial (max_P, Σ_P, max_N, Σ_N); scalars = (LSE_P, LSE_N, loss, 2·sigmoid(Z));
// the loss in the features' dtype.
template <int kBlock, typename partial_t, typename loss_t>
__global__ void __launch_bounds__(kBlock) finalize_kernel(
    const partial_t* __restrict__ partials, // (n, 4)
    int64_t n,
    double* __restrict__ folded, // (4,) or null
    double* __restrict__ scalars, // (4,) or null
    loss_t* __restrict__ loss) { // () or null
  __shared__ double scratch[2 * kBlock / 32];
  LseState<double> positive;
  LseState<double> negative;
  fold_partials<kBlock>(partials, n, scratch, positive, negative);
  if (threadIdx.x == 0) {
    if (folded != nullptr) PairStates<double>{positive, negative}.store_at(folded, 0);
    const LossScalars out = finish_loss(positive.lse(), negative.lse());
    if (scalars != nullptr) out.store(scalars);
    if (loss != nullptr) store_loss(out, loss);
  }
}

template <int kBlock, typename partial_t, typename loss_t>
void launch_finalize(const partial_t* partials, int64_t n, double* folded, double* scalars, loss_t* loss) {
  finalize_kernel<kBlock, partial_t, loss_t><<<1, kBlock, 0, c10::cuda::getCurrentCUDAStream()>>>(
      partials, n, folded, scalars, loss);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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

// Lets `kernel` launch with dynamic_shared_bytes, which past 48 KiB must be
// asked for, once on each device; largest_carveout also asks each SM for its
// largest shared-memory carveout rather than the driver's choice.
template <auto kernel>
void configure_kernel(size_t dynamic_shared_bytes, bool largest_carveout) {
  configure_once<kernel>([&] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dynamic_shared_bytes)));
    if (largest_carveout) {
      C10_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
    }
    return true;
  });
}

// Tiles (row, col), col >= row, of an edge × edge grid, numbered row by row:
// row r starts at r·(2·edge − r + 1)/2.
template <typename Index>
__device__ __forceinline__ Index upper_triangle_start(Index row, Index edge) {
  return row * (2 * edge - row + 1) / 2;
}

template <typename Index>
struct TilePosition {
  Index row;
  Index col;
};

// The tile numbered `index`: the start formula inverted, then the square
// root's rounding corrected by a step.
template <typename Index>
__device__ __forceinline__ TilePosition<Index> upper_triangle_tile(Index index, Index edge) {
  const double b = 2.0 * static_cast<double>(edge) + 1.0;
  Index row = static_cast<Index>((b - sqrt(b * b - 8.0 * static_cast<double>(index))) / 2.0);
  if (upper_triangle_start<Index>(row + 1, edge) <= index) ++row;
  if (upper_triangle_start<Index>(row, edge) > index) --row;
  return {row, row + index - upper_triangle_start<Index>(row, edge)};
}

// Tiles of a grid taken in bands of `group` rows of tiles, each band column
// by column, so that the CTAs resident at once share a few columns' operand
// tiles through L2 as well as the band's rows: taken row by row, a row of
// tiles reads every column's operand once, and where the operands outgrow
// L2 (float16 features at B = 65 536: 64 MiB) each tile then reads its
// column's from memory. Bands start where the row-by-row numbering starts
// their first row, so a band's tiles keep the same numbers as a set.
// `edge` × `edge` tiles, (row, col) with col >= row: the upper triangle.
template <typename Index>
__device__ __forceinline__ TilePosition<Index> grouped_upper_triangle_tile(Index index, Index edge, Index group) {
  const Index row0 = upper_triangle_tile(index, edge).row / group * group;
  const Index rows = edge - row0 < group ? edge - row0 : group;
  Index k = index - upper_triangle_start(row0, edge);
  // The band's first `rows` columns: column row0 + c holds rows row0 .. row0 + c.
  for (Index c = 0; c < rows; ++c) {
    if (k <= c) return {row0 + k, row0 + c};
    k -= c + 1;
  }
  return {row0 + k % rows, row0 + rows + k / rows};
}

// Every tile of a row_tiles × col_tiles grid, in the same bands.
template <typename Index>
__device__ __forceinline__ TilePosition<Index> grouped_tile(Index index, Index row_tiles, Index col_tiles, Index group) {
  const Index row0 = index / (group * col_tiles) * group;
  const Index rows = row_tiles - row0 < group ? row_tiles - row0 : group;
  const Index k = index - row0 * col_tiles;
  return {row0 + k % rows, k / rows};
}

// Programmatic dependent launch (sm_90 on; no-ops before, and in a kernel
// launched the ordinary way): the first lets the stream's next kernel, if
// launch_kernel made it a dependent, start now; the second waits until the
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

// The current device's multiprocessor count. (ATen's cached device
// properties come through a header that needs cuBLAS and cuSPARSE headers,
// which the compile check against a CPU torch does not have.)
inline int multiprocessors() {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  return sms;
}

// The current GPU's compute capability, major part.
inline int compute_capability_major() {
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, c10::cuda::current_device()));
  return major;
}

// Launches `kernel` on the current stream; with `dependent` (sm_90 on) as a
// programmatic dependent of the stream's previous kernel: it may start before
// that one has finished, and calls wait_for_prerequisites() before it reads
// that kernel's output or writes what that kernel reads.
template <typename... Params, typename... Args>
void launch_kernel(bool dependent, void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, Args&&... args) {
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = c10::cuda::getCurrentCUDAStream();
  config.attrs = &attribute;
  config.numAttrs = dependent && compute_capability_major() >= 9 ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// Rows of features and their labels as the kernels read them.
struct KernelRows {
  at::Tensor features; // (N, D) contiguous, input dtype
  at::Tensor labels; // (N,) contiguous int64
  int64_t size() const { return features.size(0); }
  int64_t dim() const { return features.size(1); }
};

inline KernelRows kernel_rows(const at::Tensor& features, const at::Tensor& labels) {
  return {features.contiguous(), labels.to(at::kLong).contiguous()};
}

} // namespace
} // namespace circle_loss
