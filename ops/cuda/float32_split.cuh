// float32 on the tensor cores at float32's accuracy, where the user has not
// let float32 matmuls use TF32 (splits_to_tf32). Two splits:
//   S, on the tiles (TileFeatures, mma_tiles.cuh): each x = big + small + e,
//     big = x rounded to TF32 and small = (x - big) rounded to TF32, so that
//     |small| ≤ 2^-11·|x| and |e| ≤ 2^-22·|x|; then
//       x · y = small_x·big_y + big_x·small_y + big_x·big_y + (below 2^-20 of |x|·|y|),
//     three TF32 products whose operands the tensor cores read exactly; the
//     loss's gamma amplifies S's error, so S keeps float32's.
//   G = W·F, by cuBLAS (split_matmul): W and F split alike into bfloat16
//     parts (|e| ≤ 2^-16·|x|), three bfloat16 GEMMs with float32 results.
//     The tensor cores' float32 accumulation over K, not the parts, bounds
//     their error (bench/NOTES.md), and PyTorch offers no TF32 GEMM the
//     user has not allowed.
// Where TF32 is allowed, S takes float32 whole on the tiles; at sizes that
// pay for copies of the features (takes_half_features), the tiles and the
// products G = W·F take them in float16 instead (HalfFeatures,
// HalfProducts): the same 11 significant bits as TF32, at twice its rate
// on the tensor cores, brought into float16's range by powers of two.
#pragma once

#include "strips.cuh"

#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <limits>
#include <type_traits>

namespace circle_loss {
namespace {

// Whether cuBLAS runs float32 GEMMs in TF32 on this thread now: the test
// ATen makes before each one.
inline bool cublas_may_use_tf32() {
  return at::globalContext().allowTF32CuBLAS() && !at::NoTF32Guard::should_disable_tf32();
}

// Whether float32 features are split: wherever the user has not let
// matmuls use TF32 as above (the default, "highest", keeps float32's
// accuracy).
template <typename T>
inline bool splits_to_tf32() {
  return std::is_same_v<T, float> && !cublas_may_use_tf32();
}

// Whether the gradient's products are worth operands made for them: split
// float32's bfloat16 parts (three bfloat16 GEMMs a product rather than one
// float32 SGEMM; TileFeatures), or with TF32 allowed float16 copies, which
// the tiles take too (takes_half_features). Where rows × cols × D, the work
// of W·F, is at least kPreparedProductsWork: below, the op is bound by the
// host, which the extra launches cost more than the GPU time they save
// (bench/NOTES.md).
constexpr double kPreparedProductsWork = 4294967296.0; // 2^32: B = 2 896 at D = 512

inline bool prepares_products(int64_t n_rows, int64_t n_cols, int64_t dim) {
  return static_cast<double>(n_rows) * static_cast<double>(n_cols) * static_cast<double>(dim) >= kPreparedProductsWork;
}

// Whether float32 features go to the tiles and products as HalfFeatures:
// where TF32 is allowed, at a size that prepares_products.
inline bool takes_half_features(int64_t n_rows, int64_t n_cols, int64_t dim) {
  return cublas_may_use_tf32() && prepares_products(n_rows, n_cols, dim);
}

// x rounded to TF32's 10-bit mantissa, to nearest, ties away from zero: a
// float32 whose low 13 bits are 0, which the tensor cores read exactly.
// Infinities and NaNs pass unchanged.
__device__ __forceinline__ float round_to_tf32(float x) {
  uint32_t bits = __float_as_uint(x);
  if ((bits & 0x7f800000u) != 0x7f800000u) bits = (bits + 0x1000u) & 0xffffe000u;
  return __uint_as_float(bits);
}

// x rounded to Out, or with residual what that rounding leaves of x,
// rounded to Out: the big and the small part of x.
template <typename Out>
__device__ __forceinline__ Out rounded_part(float x, bool residual) {
  const Out big = static_cast<Out>(x);
  return residual ? static_cast<Out>(x - static_cast<float>(big)) : big;
}

// features (n, dim) into split (n, 4 · width), each row [big | small | big |
// big] of TF32 parts, zeros from dim to width in each part (TileFeatures),
// and, where products is not null, into products (n, 2 · dim), each row
// [big | small] of bfloat16 parts.
__global__ void split_float32_kernel(
    const float* __restrict__ features,
    int64_t n,
    int64_t dim,
    int64_t width,
    float* __restrict__ split,
    c10::BFloat16* __restrict__ products) { // or null
  const int64_t total = n * width;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / width;
    const int64_t k = i % width;
    float big = 0.0f;
    float small = 0.0f;
    if (k < dim) {
      const float x = features[row * dim + k];
      big = round_to_tf32(x);
      small = round_to_tf32(x - big);
      if (products != nullptr) {
        c10::BFloat16* parts = products + row * 2 * dim + k;
        parts[0] = rounded_part<c10::BFloat16>(x, false);
        parts[dim] = rounded_part<c10::BFloat16>(x, true);
      }
    }
    float* out = split + row * 4 * width + k;
    out[0] = big;
    out[width] = small;
    out[2 * width] = big;
    out[3 * width] = big;
  }
}

// An operand of the gradient's products: the matrix itself (small
// undefined), or float32 split into bfloat16 parts, big + small. Views
// (narrow, t) apply to both parts.
struct SplitMatrix {
  at::Tensor big;
  at::Tensor small;

  bool split() const { return small.defined(); }
  SplitMatrix narrow(int64_t dim, int64_t start, int64_t length) const {
    return {big.narrow(dim, start, length), split() ? small.narrow(dim, start, length) : small};
  }
  SplitMatrix t() const { return {big.t(), split() ? small.t() : small}; }
};

// A strip's W (rows, cols) from the start of its workspaces: whole in
// space, or split into space and small_space where that is defined.
inline SplitMatrix strip_weights(const at::Tensor& space, const at::Tensor& small_space, const Strip& strip) {
  const auto view = [&](const at::Tensor& s) { return s.narrow(0, 0, strip.rows * strip.cols).view({strip.rows, strip.cols}); };
  return {view(space), small_space.defined() ? view(small_space) : small_space};
}

// The power of two 2^e, |e| ≤ kMaxHalfShift, that brings a nonnegative
// bound to at most 2^kHalfReach: four times below float16's largest value,
// room for what the kernels round above the bound; e = 0 where the bound is
// 0 or not finite. kMaxHalfShift keeps 2^-2e, which takes S of features
// scaled by 2^e back, a normal float32 number.
constexpr int kHalfReach = 14;
constexpr int kMaxHalfShift = 63;

__device__ inline int half_shift(double bound) {
  if (!(bound > 0.0) || isinf(bound)) return 0;
  int exponent; // bound < 2^exponent
  frexp(bound, &exponent);
  return min(max(kHalfReach - exponent, -kMaxHalfShift), kMaxHalfShift);
}

// maxima[blockIdx.x] = the largest finite norm of the rows of features (n,
// dim) the CTA takes, a warp a row, the rows strided by the grid's warps; 0
// where it has none. Squares add in float64, so that no finite row
// overflows.
__global__ void __launch_bounds__(kThreads) finite_norm_maxima_kernel(
    const float* __restrict__ features,
    int64_t n,
    int64_t dim,
    float* __restrict__ maxima) { // (gridDim.x,)
  __shared__ float scratch[2 * kWarps];
  const int lane = threadIdx.x % 32;
  float largest = 0.0f;
  for (int64_t row = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32; row < n;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const float* x = features + row * dim;
    double squares = 0.0;
    for (int64_t k = lane; k < dim; k += 32) squares += static_cast<double>(x[k]) * x[k];
    for (int offset = 16; offset > 0; offset >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
    const double norm = sqrt(squares);
    if (norm <= std::numeric_limits<float>::max()) largest = fmaxf(largest, static_cast<float>(norm)); // not NaN nor past float
  }
  float values[2] = {largest, largest};
  block_reduce<kThreads>(values, [](float a, float b) { return fmaxf(a, b); }, scratch);
  if (threadIdx.x == 0) maxima[blockIdx.x] = values[0];
}

// scales = (2^f, 2^-2f, norm): the features' scale, S's way back and the
// largest of maxima (count,), f from that norm, which bounds every entry of
// the rows it was taken over. One CTA.
__global__ void __launch_bounds__(kThreads) half_feature_scales_kernel(
    const float* __restrict__ maxima,
    int64_t count,
    float* __restrict__ scales) { // (3,)
  __shared__ float scratch[2 * kWarps];
  float largest = 0.0f;
  for (int64_t i = threadIdx.x; i < count; i += kThreads) largest = fmaxf(largest, maxima[i]);
  float values[2] = {largest, largest};
  block_reduce<kThreads>(values, [](float a, float b) { return fmaxf(a, b); }, scratch);
  if (threadIdx.x != 0) return;
  const int features = half_shift(values[0]);
  scales[0] = ldexpf(1.0f, features);
  scales[1] = ldexpf(1.0f, -2 * features);
  scales[2] = values[0];
}

// features (n, dim) times *scale, rounded to float16, into out (n, width):
// zeros from dim to width.
__global__ void scale_to_half_kernel(
    const float* __restrict__ features,
    int64_t n,
    int64_t dim,
    int64_t width,
    const float* __restrict__ scale, // ()
    c10::Half* __restrict__ out) {
  const float by = *scale;
  const int64_t total = n * width;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / width;
    const int64_t k = i % width;
    out[i] = static_cast<c10::Half>(k < dim ? features[row * dim + k] * by : 0.0f);
  }
}

// scales = (2^w, 2^-(w+f)): W's scale and G·F's way back. W's bound is
// weight_factor · γ(1 + |m| + norm²), the caller's bound on W / |dz/ds|
// times |dz/ds| = γα's, α bounded through |s| ≤ norm²; f is
// half_feature_scales_kernel's.
__global__ void half_weight_scales_kernel(
    const float* __restrict__ largest_norm, // ()
    const float* __restrict__ weight_factor, // ()
    PairLogit<float> logit,
    float* __restrict__ scales) { // (2,)
  const double norm = *largest_norm;
  const double weight_bound =
      static_cast<double>(*weight_factor) * logit.gamma * (1.0 + fabs(static_cast<double>(logit.margin)) + norm * norm);
  const int features = half_shift(norm);
  // Both shifts and their sum's inverse stay normal float32 numbers.
  const int weights = min(max(half_shift(weight_bound), -126 - features), 126 - features);
  scales[0] = ldexpf(1.0f, weights);
  scales[1] = ldexpf(1.0f, -(weights + features));
}

// float32 features where TF32 is allowed, as the tiles and the gradient's
// products take them from B·M·D = kPreparedProductsWork on: float16 copies
// of the rows and columns, both times one power of two 2^f that brings the
// largest finite row norm to at most 2^14. float16 holds TF32's 11
// significant bits, and the tensor cores multiply it at twice TF32's rate
// in any layout. The tiles form S times 2^2f and take it back by
// similarity_unit() (exactly), so their epilogues see S itself. An entry
// from 2^-28 of the largest norm up keeps 11 bits; one below is off by at
// most 2^-39 of it, so S is off by at most 2^-39·√D·norm² beyond TF32's
// rounding (docs/math.md).
class HalfFeatures {
 public:
  HalfFeatures() = default;

  // rows, cols: (n, D) float32, contiguous (cols undefined: the rows again).
  HalfFeatures(const at::Tensor& rows, const at::Tensor& cols)
      : scales_(at::empty({3}, rows.options())), dim_(rows.size(1)), width_((rows.size(1) + kChunk - 1) / kChunk * kChunk) {
    const auto stream = c10::cuda::getCurrentCUDAStream();
    const int64_t row_blocks = norm_blocks(rows);
    const int64_t col_blocks = cols.defined() ? norm_blocks(cols) : 0;
    const at::Tensor maxima = at::empty({row_blocks + col_blocks}, rows.options());
    finite_norm_maxima_kernel<<<static_cast<unsigned>(row_blocks), kThreads, 0, stream>>>(
        rows.data_ptr<float>(), rows.size(0), dim_, maxima.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (cols.defined()) {
      finite_norm_maxima_kernel<<<static_cast<unsigned>(col_blocks), kThreads, 0, stream>>>(
          cols.data_ptr<float>(), cols.size(0), dim_, maxima.data_ptr<float>() + row_blocks);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    half_feature_scales_kernel<<<1, kThreads, 0, stream>>>(maxima.data_ptr<float>(), maxima.numel(),
                                                           scales_.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    rows_ = scaled(rows);
    cols_ = cols.defined() ? scaled(cols) : rows_;
  }

  bool defined() const { return scales_.defined(); }
  // (n, width) float16, width = D rounded up to whole 16-byte chunks, zeros
  // beyond D: as the tiles take them.
  const at::Tensor& rows() const { return rows_; }
  const at::Tensor& cols() const { return cols_; }
  // () float32 on the device: S = similarity_unit · rows · colsᵀ.
  const float* similarity_unit() const { return scales_.data_ptr<float>() + 1; }
  // () float32 on the device: the largest finite row norm of both.
  const float* largest_norm() const { return scales_.data_ptr<float>() + 2; }
  int64_t dim() const { return dim_; }

 private:
  static constexpr int64_t kChunk = 16 / sizeof(c10::Half);

  // CTAs of finite_norm_maxima_kernel over features: enough warps for
  // every row, at most two CTAs an SM. Only the finite norms count: a row
  // of NaN or infinities keeps them, and the others keep their scale.
  static int64_t norm_blocks(const at::Tensor& features) {
    return std::clamp<int64_t>((features.size(0) + kWarps - 1) / kWarps, 1, 2 * multiprocessors());
  }

  at::Tensor scaled(const at::Tensor& features) const {
    const int64_t n = features.size(0);
    at::Tensor out = at::empty({n, width_}, features.options().dtype(at::kHalf));
    const int64_t blocks = std::clamp<int64_t>((n * width_ + kThreads - 1) / kThreads, 1, 8 * multiprocessors());
    scale_to_half_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        features.data_ptr<float>(), n, dim_, width_, scales_.data_ptr<float>(), out.data_ptr<c10::Half>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
  }

  at::Tensor scales_; // (3,) float32: half_feature_scales_kernel's
  int64_t dim_ = 0;
  int64_t width_ = 0;
  at::Tensor rows_; // (n, width_) float16: the rows' features · 2^f
  at::Tensor cols_; // the columns', or rows_
};

// The gradient's products where TF32 is allowed, as float16 GEMMs with
// float32 results: W in the tiles' float16 output, scaled by
// weight_scale() (exactly: a power of two), HalfFeatures' copies of the
// rows and columns, and G·F scaled by both until unscale() takes it back.
// Scaled, W's bound is 2^14: a weight from 2^-28 of the bound up is a
// normal float16 number and keeps TF32's 11 bits; one below is off by at
// most 2^-39 of the bound. Over a row of M weights that adds at most
// M·2^-39 of the bound, within TF32's error of every row whose weights sum
// to M·2^-28 of the bound or more, and far within it of the rows that carry
// the gradient (bench/NOTES.md).
class HalfProducts {
 public:
  HalfProducts() = default;

  // weight_factor: () float32 on the device, a bound on W / |dz/ds|.
  HalfProducts(const HalfFeatures& features, const at::Tensor& weight_factor, PairLogit<float> logit)
      : scales_(at::empty({2}, weight_factor.options())),
        rows_(features.rows().narrow(1, 0, features.dim())),
        cols_(features.cols().narrow(1, 0, features.dim())) {
    half_weight_scales_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>(
        features.largest_norm(), weight_factor.data_ptr<float>(), logit, scales_.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  bool defined() const { return scales_.defined(); }
  SplitMatrix rows() const { return {rows_, at::Tensor()}; }
  SplitMatrix cols() const { return {cols_, at::Tensor()}; }
  const float* weight_scale() const { return scales_.data_ptr<float>(); }
  void unscale(at::Tensor& grad) const { grad.mul_(scales_[1]); }

 private:
  at::Tensor scales_; // (2,) float32: half_weight_scales_kernel's
  at::Tensor rows_; // (n, D) float16: the rows' features · 2^f
  at::Tensor cols_; // the columns', or rows_
};

// out = a · b, or with accumulate out += a · b, in out's dtype: split
// operands (both or neither) as three products, the small ones first.
inline void split_matmul(const at::Tensor& out, const SplitMatrix& a, const SplitMatrix& b, bool accumulate) {
  TORCH_INTERNAL_ASSERT(a.split() == b.split());
  if (!a.split()) {
    accumulate ? matmul_add(out, a.big, b.big) : matmul_into(out, a.big, b.big);
    return;
  }
  accumulate ? matmul_add(out, a.small, b.big) : matmul_into(out, a.small, b.big);
  matmul_add(out, a.big, b.small);
  matmul_add(out, a.big, b.big);
}

} // namespace
} // namespace circle_loss
