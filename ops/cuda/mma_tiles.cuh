// Tiles of S = rows · colsᵀ on the tensor cores, for float16, bfloat16 and
// float32 features: S accumulates in float32 registers and is handed to an
// epilogue in place, so that it never goes to memory. float32 is multiplied
// in TF32 where the user allows TF32 (at large sizes as float16 copies
// scaled by a power of two, HalfFeatures, which TileUnit takes back), and
// otherwise split into TF32 parts that keep float32's accuracy
// (TileFeatures). Used by circle_loss_cuda.cu
// and anchor_loss_cuda.cu for the LSE partials and the gradient weights.
//
// A CTA of kMmaThreads threads owns a kMmaTile × kMmaTile tile of S. The
// features pass through shared memory 128 bytes of a row at a time (kMmaK<T>
// features) in kMmaStages stages; each 128-byte row of a stage stores its
// 16-byte chunks in an XOR-swizzled order (chunk ^ row % 8), which is at once
// the layout Hopper's warpgroup MMA reads as its 128-byte swizzle and one in
// which the 8 rows an ldmatrix phase reads fall in distinct banks. The
// copies and products, 32 bytes of K a product instruction:
//   sm_90a (the code built for Hopper): one thread fills the stages by bulk
//     tensor copies (TMA), which swizzle as they land and signal a barrier
//     in shared memory; wgmma, each of the two warpgroups 64 rows × all 128
//     columns, both operands read from the stages;
//   sm_80 on otherwise: every thread's cp.async copies; mma.sync m16n8k16
//     (m16n8k8 in TF32), the 8 warps 2 (rows) × 4 (columns) of kWarpRows ×
//     kWarpCols, operands by ldmatrix.
// Either way a thread holds 16 m16n8 accumulator fragments in the same
// register layout, so the epilogues are written once.
#pragma once

#include "common.cuh"
#include "float32_split.cuh"

#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda.h>
#include <cudaTypedefs.h>

#include <type_traits>

// The device pass for sm_90a, whose instructions include wgmma.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CIRCLE_LOSS_WARPGROUP_MMA 1
#endif

namespace circle_loss {
namespace {

constexpr int kMmaTile = 128; // rows and columns of a CTA's tile of S
constexpr int kStageRowBytes = 128; // of each row's features a stage holds: the swizzle's width
template <typename T>
constexpr int kMmaK = kStageRowBytes / sizeof(T); // features per stage
constexpr int kStepBytes = 32; // of K one product instruction takes: k16 in 16 bits, k8 in TF32
constexpr int kMmaStages = 3;
constexpr int kMmaThreads = 256;
constexpr int kWarpRows = 64;
constexpr int kWarpCols = 32;
constexpr int kMmaRowTiles = kWarpRows / 16; // m16 tiles a warp
constexpr int kMmaColTiles = kWarpCols / 8; // n8 tiles a warp
constexpr int kChunksPerRow = kStageRowBytes / 16; // 16-byte chunks of a stage row
constexpr int kStageBytes = kMmaTile * kStageRowBytes; // one operand of one stage
// wgmma's swizzle is a function of the shared address, so the stages start on
// a boundary of its 8-row atom (1024 bytes); the dynamic shared memory has
// room to round up to one.
constexpr int kStageAlignment = 1024;
constexpr int kMmaSharedBytes = kMmaStages * 2 * kStageBytes + kStageAlignment;
static_assert((kMmaTile / kWarpRows) * (kMmaTile / kWarpCols) * 32 == kMmaThreads, "8 warps, 2 × 4");
static_assert(kMmaThreads / 128 * 64 == kMmaTile, "two warpgroups of 64 rows");

// Tiles along n rows or columns.
__host__ __device__ constexpr int64_t tiles(int64_t n) { return (n + kMmaTile - 1) / kMmaTile; }

// The tensor cores take these dtypes (float32 as TF32), and rows of whole
// 16-byte chunks, 16-byte aligned.
template <typename T>
constexpr bool kHasMmaTiles =
    std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>;

// Whether the tiles can take these features (n, D): a dtype they multiply,
// with rows of whole 16-byte chunks from an aligned start, or float32 that
// is split (into a buffer that has them).
template <typename T>
inline bool tiles_take(const at::Tensor& features) {
  if constexpr (kHasMmaTiles<T>) {
    return splits_to_tf32<T>() ||
        (features.size(1) * features.element_size() % 16 == 0 && reinterpret_cast<uintptr_t>(features.data_ptr()) % 16 == 0);
  } else {
    return false;
  }
}

// The tensor-core epilogues issue more instructions than their tiles' main
// loops, so each entry's steps are single instructions where one will do:
// exp from the special-function unit (ex2, a few ulp: float16/bfloat16 and
// TF32 inputs resolve far less) with log2(e) folded into one multiply-add, and
// the NaN-propagating max of sm_80 on.
constexpr float kLog2e = 1.4426950408889634f;

// 2^x, approximately, results below 2^-126 flushed to 0, which spares the
// special-function unit's fix-up of subnormals (four instructions an
// entry). Every exp here is of a logit less its set's maximum or LSE: a
// term of a sum that is at least 1, or a softmax weight of a set whose
// weights sum to 1, so what the flush drops lies below float32's
// resolution of that sum.
__device__ __forceinline__ float fast_exp2(float x) {
  float out;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(out) : "f"(x));
  return out;
}

// nan_max(a, b).
__device__ __forceinline__ float fast_nan_max(float a, float b) {
#if __CUDA_ARCH__ >= 800
  float out;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(out) : "f"(a), "f"(b));
  return out;
#else
  return nan_max(a, b);
#endif
}

// PairLogit as the tile epilogues compute it, in units of 1/unit (log2(e)
// for a logit that goes straight to ex2). What bounds the epilogues is the
// ALU pipe (compares, selects, min/max), which issues at half the rate of
// the FMA pipe; so each set's constants are taken by a pair of predicated
// instructions on the FMA pipe, one of which runs, rather than by selects,
// and relu(t) by t + |t| = 2·relu(t), exact. With t the distance
// (1 + m) - s or s + m and v = (1 - m) - s or s - m (positive or negative):
//   z = γ·relu(t)·v = (t + |t|)·(v·γ/2),   dz/ds = ∓γ·relu(t) = ∓(γ/2)·(t + |t|).
struct TileLogit {
  float margin;
  float one_plus_margin;
  float scaled_half_gamma; // unit·γ/2
  float scaled_margin; // unit·m·γ/2
  float scaled_one_less_margin; // unit·(1 - m)·γ/2

  __device__ __forceinline__ TileLogit(const PairLogit<float>& logit, float unit)
      : margin(logit.margin),
        one_plus_margin(1.0f + logit.margin),
        scaled_half_gamma(0.5f * logit.gamma * unit),
        scaled_margin(0.5f * logit.gamma * unit * logit.margin),
        scaled_one_less_margin(0.5f * logit.gamma * unit * (1.0f - logit.margin)) {}

  // unit·z; twice_alpha = t + |t|, from which the slope.
  __device__ __forceinline__ float operator()(float s, bool positive, float* twice_alpha) const {
    float t = s + margin;
    float scaled_v = fmaf(s, scaled_half_gamma, -scaled_margin);
    if (positive) {
      t = one_plus_margin - s;
      scaled_v = fmaf(s, -scaled_half_gamma, scaled_one_less_margin);
    }
    *twice_alpha = t + fabsf(t);
    return *twice_alpha * scaled_v;
  }
};

// exp(z - base) as a tile epilogue's terms take it, from u = z·scale: 1
// within rounding at the maximum. exponent_base: the max u the terms take,
// 0 for a set that has no pair (max -inf), whose entries are then -inf, no
// pairs, and take 0 rather than 2^(-inf + inf) = NaN.
__device__ __forceinline__ float exponent_base(float max_u) {
  return max_u == -std::numeric_limits<float>::infinity() ? 0.0f : max_u;
}

// The units the tile epilogues carry logits in, by the features' dtype
// (TileUnits<T>):
//   Log2Units (float16, bfloat16): u = z·log2(e), folded into the logit's
//     constants, so that a term is one subtraction and one ex2;
//   NaturalUnits (float32): u = z, a term one subtraction, one multiply and
//     one ex2. At gamma = 256 logits and LSEs of several hundred are common;
//     log2 units resolve them half as finely, and the LSE against which the
//     backward takes a set's weights shifts them all alike, which the
//     gradient, whose sets' parts largely cancel, amplifies past float32's
//     tolerance (bench/NOTES.md). float16/bfloat16 inputs resolve far less.
// Each gives
//   kScale                u = z·kScale (TileLogit's unit);
//   term(u, base)         exp(z - base), base from exponent_base;
//   state(max_u, sum)     the set's (max, Σ) in natural units; an infinite
//                         maximum, whose terms were NaN, gets the sum 1
//                         instead: the same infinite LSE;
//   offset(lse)           -LSE as weight_term takes it, a pair (hi, lo =
//                         what hi leaves of -LSE) where the LSE is known
//                         past float32 (the global form's, in float64):
//                         z - LSE is then exact near the set's maximum;
//   weight_term(u, o)     exp(z - LSE) for o = offset(LSE), or for o =
//                         offset(LSE).hi of a float LSE: the backward's.
struct WeightOffset {
  float hi;
  float lo;
};

struct Log2Units {
  static constexpr float kScale = kLog2e;
  __device__ __forceinline__ static float term(float u, float base) { return fast_exp2(u - base); }
  __device__ __forceinline__ static LseState<float> state(float max_u, float sum) {
    constexpr float kLn2 = 1.0f / kLog2e;
    return {max_u * kLn2, max_u == std::numeric_limits<float>::infinity() ? 1.0f : sum};
  }
  template <typename Lse>
  __device__ __forceinline__ static WeightOffset offset(Lse lse) {
    return {-static_cast<float>(lse) * kLog2e, 0.0f};
  }
  __device__ __forceinline__ static float weight_term(float u, WeightOffset offset) { return fast_exp2(u + offset.hi); }
  __device__ __forceinline__ static float weight_term(float u, float offset) { return fast_exp2(u + offset); }
};

struct NaturalUnits {
  static constexpr float kScale = 1.0f;
  __device__ __forceinline__ static float term(float u, float base) { return fast_exp2((u - base) * kLog2e); }
  __device__ __forceinline__ static LseState<float> state(float max_u, float sum) {
    return {max_u, max_u == std::numeric_limits<float>::infinity() ? 1.0f : sum};
  }
  template <typename Lse>
  __device__ __forceinline__ static WeightOffset offset(Lse lse) {
    const float hi = -static_cast<float>(lse);
    return {hi, static_cast<float>(-lse - static_cast<Lse>(hi))};
  }
  __device__ __forceinline__ static float weight_term(float u, WeightOffset offset) {
    return fast_exp2(((u + offset.hi) + offset.lo) * kLog2e);
  }
  __device__ __forceinline__ static float weight_term(float u, float offset) { return fast_exp2((u + offset) * kLog2e); }
};

template <typename T>
using TileUnits = std::conditional_t<std::is_same_v<T, float>, NaturalUnits, Log2Units>;

// One side of a product rows · colsᵀ as the tiles read it: dim features a
// row, rows stride elements apart.
template <typename T>
struct TileSide {
  const T* features;
  int64_t dim;
  int64_t stride;

  TileSide from(int64_t row) const { return {features + row * stride, dim, stride}; }
};

// The two sides of a product rows · colsᵀ and their labels, as the
// tensor-core kernels take them (as __grid_constant__ parameters, which the
// bulk copies require of their tensor maps). Made by make_tile_operands.
template <typename T>
struct TileOperands {
  using Scalar = T;

  const T* rows; // (n_rows, dim), rows stride apart
  const int64_t* row_labels; // (n_rows,)
  int64_t n_rows;
  const T* cols; // (n_cols, dim), rows stride apart
  const int64_t* col_labels; // (n_cols,)
  int64_t n_cols;
  int64_t dim;
  int64_t stride;
  const float* similarity_unit; // (): S = *similarity_unit · rows · colsᵀ (HalfFeatures), or null: 1
  // The bulk copies' view of each side, on GPUs that have them: boxes of
  // kMmaTile rows × kStageRowBytes, as one stage operand takes them.
  CUtensorMap row_boxes;
  CUtensorMap col_boxes;
};

// The driver's cuTensorMapEncodeTiled, through the runtime, so that the
// library needs no link to the driver library.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion(
        "cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found));
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && function != nullptr,
                "circle_loss: the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encode;
}

// n rows of a side as boxes of kMmaTile rows × kStageRowBytes, swizzled as
// the stages store them, zeros past the rows' and the features' ends.
template <typename T>
CUtensorMap stage_boxes(const TileSide<T>& side, int64_t n) {
  CUtensorMap boxes = {};
  const cuuint64_t extent[2] = {static_cast<cuuint64_t>(side.dim), static_cast<cuuint64_t>(n)};
  const cuuint64_t row_bytes[1] = {static_cast<cuuint64_t>(side.stride) * sizeof(T)};
  const cuuint32_t box[2] = {kMmaK<T>, kMmaTile};
  const cuuint32_t unit_strides[2] = {1, 1};
  // The copies move bits: float32 goes to the tensor cores as it is (TF32
  // reads its upper 19 bits), as with cp.async.
  const CUtensorMapDataType type = sizeof(T) == 2 ? CU_TENSOR_MAP_DATA_TYPE_UINT16 : CU_TENSOR_MAP_DATA_TYPE_UINT32;
  const CUresult result = tensor_map_encoder()(
      &boxes, type, 2, const_cast<T*>(side.features), extent, row_bytes, box, unit_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(result == CUDA_SUCCESS, "circle_loss: cuTensorMapEncodeTiled failed with CUresult ", static_cast<int>(result),
              " for features of ", n, " × ", side.dim, " (", side.stride, " apart)");
  return boxes;
}

// The operands of rows · colsᵀ, with the bulk copies' tensor maps on GPUs
// of compute capability 9.0 and later (the sm_90a code reads them; others
// leave them unused).
template <typename T>
TileOperands<T> make_tile_operands(
    const TileSide<T>& rows,
    const int64_t* row_labels,
    int64_t n_rows,
    const TileSide<T>& cols,
    const int64_t* col_labels,
    int64_t n_cols,
    const float* similarity_unit = nullptr) {
  TORCH_INTERNAL_ASSERT(rows.dim == cols.dim && rows.stride == cols.stride);
  TileOperands<T> in{rows.features, row_labels, n_rows, cols.features, col_labels, n_cols,
                     rows.dim, rows.stride, similarity_unit, {}, {}};
  if (compute_capability_major() >= 9 && n_rows > 0 && n_cols > 0 && rows.dim > 0) {
    in.row_boxes = stage_boxes(rows, n_rows);
    in.col_boxes = stage_boxes(cols, n_cols);
  }
  return in;
}

// Features (n, D) as the tiles take them: both sides the features themselves,
// or for float32 where splits_to_tf32, split into TF32 parts
// (float32_split.cuh) as one product over K = 3·D: the rows side [small |
// big | big] against the columns side [big | small | big], both views of one
// (n, 4·D) buffer [big | small | big | big] (D rounded up to whole 16-byte
// chunks, zeros beyond it), the small products first. The sum is symmetric
// in i and j as x_i · x_j is, so symmetric products may keep one of two
// tiles. Made for_products, split features also keep their bfloat16 parts
// for the gradient's products (parts()).
template <typename T>
class TileFeatures {
 public:
  TileFeatures() = default;

  // features: (n, D) contiguous, such that tiles_take<T>(features).
  // for_products: the gradient's products will take these features at a
  // size that pays for operands made for them (prepares_products); a pass
  // that runs no products, or small ones, is spared making them.
  TileFeatures(const at::Tensor& features, bool for_products)
      : features_(features), storage_(features), dim_(features.size(1)), width_(features.size(1)) {
    if constexpr (std::is_same_v<T, float>) {
      if (!splits_to_tf32<T>()) return;
      constexpr int64_t kChunk = 16 / sizeof(float);
      const int64_t n = features.size(0);
      width_ = (dim_ + kChunk - 1) / kChunk * kChunk;
      split_ = true;
      storage_ = at::empty({n, kSplitParts * width_}, features.options());
      if (for_products) products_ = at::empty({n, 2 * dim_}, features.options().dtype(at::kBFloat16));
      const int64_t total = n * width_;
      if (total == 0) return;
      const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 8 * multiprocessors());
      split_float32_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          features.data_ptr<float>(), n, dim_, width_, storage_.data_ptr<float>(),
          for_products ? products_.data_ptr<c10::BFloat16>() : nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }

  // The side that stands for rows, and for columns, of S = rows · colsᵀ.
  TileSide<T> rows() const { return side(split_ ? width_ : 0); }
  TileSide<T> cols() const { return side(0); }

  // Whether the gradient's products take these features in bfloat16 parts,
  // and W with them.
  bool has_parts() const { return products_.defined(); }

  // The features (n, D) as the gradient's products take them: in bfloat16
  // parts where has_parts(), else whole.
  SplitMatrix parts() const {
    if (!has_parts()) return {features_, at::Tensor()};
    return {products_.narrow(1, 0, dim_), products_.narrow(1, dim_, dim_)};
  }

 private:
  static constexpr int64_t kSplitParts = 4;

  TileSide<T> side(int64_t first) const {
    const int64_t stride = split_ ? kSplitParts * width_ : width_;
    return {storage_.data_ptr<T>() + first, split_ ? (kSplitParts - 1) * width_ : width_, stride};
  }

  at::Tensor features_; // (n, D) as given
  at::Tensor storage_; // the features, or their split (n, 4 · width_)
  at::Tensor products_; // with parts: the features' bfloat16 parts (n, 2 · D), [big | small]
  int64_t dim_ = 0; // D
  int64_t width_ = 0; // features a row of each part
  bool split_ = false;
};

// One thread's share of a CTA's tile: acc[f][e] is S at (row_of(f, e),
// col_of(f, e)) relative to the tile's first row and column; each fragment f
// is an m16n8 accumulator tile in mma.sync's layout (lane / 4 picks the row,
// lane % 4 the column pair, e / 2 the upper 8 rows). wgmma's m64n128 result
// is 16 of them side by side, warp w of the CTA holding rows [16w, 16w + 16);
// with mma.sync, f = mi · kMmaColTiles + ni within the warp's own block.
struct TileAccumulators {
  static constexpr int kFragments = kMmaRowTiles * kMmaColTiles;
  static_assert(kFragments * 8 == kMmaTile, "a warpgroup's fragments span the tile's columns");
  float acc[kFragments][4];

  __device__ __forceinline__ static int row_of(int f, int e) {
    const int lane_row = threadIdx.x % 32 / 4 + e / 2 * 8;
#if defined(CIRCLE_LOSS_WARPGROUP_MMA)
    return threadIdx.x / 32 * 16 + lane_row;
#else
    const int warp_row = threadIdx.x / 32 / (kMmaTile / kWarpCols) * kWarpRows;
    return warp_row + f / kMmaColTiles * 16 + lane_row;
#endif
  }
  __device__ __forceinline__ static int col_of(int f, int e) {
    const int lane_col = threadIdx.x % 4 * 2 + e % 2;
#if defined(CIRCLE_LOSS_WARPGROUP_MMA)
    return f * 8 + lane_col;
#else
    const int warp_col = threadIdx.x / 32 % (kMmaTile / kWarpCols) * kWarpCols;
    return warp_col + f % kMmaColTiles * 8 + lane_col;
#endif
  }

  static constexpr int kEntries = kFragments * 4;

  // The rows a thread holds, kRowSlots of them: entry k (as for_each numbers
  // it) is in slot row_slot(k), which is row slot_row(slot) of the tile. The
  // four lanes lane ^ 1, lane ^ 2 of a warp hold the same rows; kWarpsPerRow
  // warps share a row, this one being row_warp() among them.
#if defined(CIRCLE_LOSS_WARPGROUP_MMA)
  static constexpr int kRowSlots = 2;
  static constexpr int kWarpsPerRow = 1;
  __device__ __forceinline__ static int row_slot(int k) { return k % 4 / 2; }
  __device__ __forceinline__ static int row_warp() { return 0; }
#else
  static constexpr int kRowSlots = kMmaRowTiles * 2;
  static constexpr int kWarpsPerRow = kMmaTile / kWarpCols;
  __device__ __forceinline__ static int row_slot(int k) { return k / 4 / kMmaColTiles * 2 + k % 4 / 2; }
  __device__ __forceinline__ static int row_warp() { return threadIdx.x / 32 % kWarpsPerRow; }
#endif
  __device__ __forceinline__ static int slot_row(int slot) {
    return row_of(slot / 2 * kMmaColTiles, slot % 2 * 2);
  }

  // visit(s, r, c, k) for each of the thread's entries s, at (r, c) in the
  // tile; k in [0, kEntries) numbers them.
  template <typename Visit>
  __device__ __forceinline__ void for_each(Visit visit) {
#pragma unroll
    for (int f = 0; f < kFragments; ++f) {
#pragma unroll
      for (int e = 0; e < 4; ++e) visit(acc[f][e], row_of(f, e), col_of(f, e), f * 4 + e);
    }
  }
};

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// The stages' start: the dynamic shared memory rounded up to kStageAlignment.
template <typename T>
__device__ __forceinline__ T* stage_memory(unsigned char* dynamic_shared) {
  const uint32_t past = shared_address(dynamic_shared) % kStageAlignment;
  return reinterpret_cast<T*>(dynamic_shared + (past == 0 ? 0 : kStageAlignment - past));
}

// Byte offset of 16-byte chunk `chunk` of row `row` within a stage operand.
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {
  return row * kStageRowBytes + ((chunk ^ (row % kChunksPerRow)) * 16);
}

// One thread's share of filling a stage operand with features[first, first
// + kMmaTile) × [k0, k0 + kMmaK<T>): kCopies 16-byte chunks, all in the same
// column of chunks and kRowStep rows apart, so that what a stage's copies
// need beyond k0 (their offsets, which rows exist, where they land) is worked
// out once a tile rather than at every stage.
template <typename T>
struct StageCopies {
  static constexpr int kCopies = kMmaTile * kChunksPerRow / kMmaThreads;
  static constexpr int kRowStep = kMmaThreads / kChunksPerRow;
  static_assert(kMmaThreads % kChunksPerRow == 0 && kRowStep % kChunksPerRow == 0,
                "a thread's copies share their column of chunks and their swizzle");

  const T* features; // (n, dim), rows stride apart
  int64_t dim;
  int64_t offset; // of the first copy's chunk at k0 = 0
  int64_t row_step; // kRowStep rows
  int feature; // the chunk's first feature within a stage
  uint32_t inside_rows; // bit u: copy u's row is one of the n
  int target; // byte offset of the first copy within the operand

  __device__ __forceinline__ StageCopies(const T* features_, int64_t n, int64_t dim_, int64_t stride, int64_t first)
      : features(features_), dim(dim_) {
    const int row = threadIdx.x / kChunksPerRow;
    const int chunk = threadIdx.x % kChunksPerRow;
    feature = chunk * kVec<T>;
    offset = (first + row) * stride + feature;
    row_step = kRowStep * stride;
    inside_rows = 0;
#pragma unroll
    for (int u = 0; u < kCopies; ++u) inside_rows |= static_cast<uint32_t>(first + row + u * kRowStep < n) << u;
    target = swizzled_offset(row, chunk);
  }

  // Issues the copies of features [k0, k0 + kMmaK<T>) into `stage`, swizzled;
  // zeros past the rows' and the features' ends.
  __device__ __forceinline__ void issue(T* stage, int64_t k0) const {
    const bool inside_features = k0 + feature < dim;
#pragma unroll
    for (int u = 0; u < kCopies; ++u) {
      const bool inside = inside_features && (inside_rows >> u & 1u) != 0u;
      copy_16(reinterpret_cast<char*>(stage) + target + u * kRowStep * kStageRowBytes,
              features + (inside ? offset + u * row_step + k0 : 0), inside);
    }
  }
};

// Four matrices of 8 rows × 16 bytes (8 × 8 16-bit values, or 8 × 4 32-bit
// ones) from shared memory, one register each.
__device__ __forceinline__ void load_matrices(uint32_t (&out)[4], uint32_t address) {
#if __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(out[0]), "=r"(out[1]), "=r"(out[2]), "=r"(out[3])
               : "r"(address));
#endif
}

// acc += a · b for one m16n8 tile over kStepBytes of K (m16n8k16, or
// m16n8k8 in TF32): a (16 × K) row-major, b (K × 8) column-major, i.e. both
// with the features contiguous. Either way a[0..3] are the 8 × 16-byte
// quarters rows 0-7 and 8-15 at the first 16 bytes, then the same at the
// next 16, and b0, b1 the columns at the first and the next 16 bytes: what
// ldmatrix gives.
template <typename T>
__device__ __forceinline__ void mma_16x8_step(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, float>) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

// wgmma's descriptor of a stage operand from `address` on: K-major rows of
// 128 bytes in the 128-byte swizzle, 8-row atoms 1024 bytes apart (the stride
// byte offset); the leading byte offset is unused in this mode (1 by
// convention). Bits: start >> 4 at 0, leading >> 4 at 16, stride >> 4 at 32,
// the swizzle mode at 62.
__device__ __forceinline__ uint64_t stage_descriptor(uint32_t address) {
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) | (uint64_t{1} << 16) |
      (static_cast<uint64_t>(kStageAlignment >> 4) << 32) | (uint64_t{1} << 62);
}

// d += a · bᵀ for the warpgroup over kStepBytes of K (16 features, 8 in
// TF32): a 64 rows and b 128, both K-major in shared memory, d (64 × 128) in
// its 16 fragments. Asynchronous: the result is there after warpgroup_wait.
template <typename T>
__device__ __forceinline__ void warpgroup_mma_step(float (&d)[16][4], uint64_t a, uint64_t b) {
#if defined(CIRCLE_LOSS_WARPGROUP_MMA)
#define FRAGMENT(f) "+f"(d[f][0]), "+f"(d[f][1]), "+f"(d[f][2]), "+f"(d[f][3])
#define WGMMA(shape_and_types, operand_modes)                                                               \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                \
               "wgmma.mma_async.sync.aligned." shape_and_types " "                                           \
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                      \
               "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "             \
               "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "             \
               "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "            \
               "%64, %65, p, " operand_modes ";\n}\n"                                                        \
               : FRAGMENT(0), FRAGMENT(1), FRAGMENT(2), FRAGMENT(3), FRAGMENT(4), FRAGMENT(5), FRAGMENT(6),    \
                 FRAGMENT(7), FRAGMENT(8), FRAGMENT(9), FRAGMENT(10), FRAGMENT(11), FRAGMENT(12), FRAGMENT(13), \
                 FRAGMENT(14), FRAGMENT(15)                                                                   \
               : "l"(a), "l"(b), "r"(1))
  // Operands: d, the two descriptors, scale-d (1: accumulate), then a and b
  // unscaled and, for 16-bit types, untransposed (both K-major; TF32 takes
  // no transpose).
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    WGMMA("m64n128k16.f32.bf16.bf16", "1, 1, 0, 0");
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    WGMMA("m64n128k16.f32.f16.f16", "1, 1, 0, 0");
  } else {
    static_assert(std::is_same_v<T, float>, "float16, bfloat16 or float32 as TF32");
    WGMMA("m64n128k8.f32.tf32.tf32", "1, 1");
  }
#undef WGMMA
#undef FRAGMENT
#endif
}

// Orders the warpgroup's register accesses before the wgmma that follow.
__device__ __forceinline__ void warpgroup_fence() {
#if defined(CIRCLE_LOSS_WARPGROUP_MMA)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

// Closes the wgmma issued so far into a group.
__device__ __forceinline__ void warpgroup_commit() {
#if defined(CIRCLE_LOSS_WARPGROUP_MMA)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// Waits until at most kPending of the warpgroup's groups are in flight.
template <int kPending>
__device__ __forceinline__ void warpgroup_wait() {
#if defined(CIRCLE_LOSS_WARPGROUP_MMA)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}

// The barriers in shared memory (mbarrier) that the bulk copies signal,
// sm_90a's: each counts arrivals, and bytes where a copy is expected, and
// completes a phase when both are in; waits name the phase by its parity.
__device__ __forceinline__ void init_barrier(uint64_t* barrier, uint32_t arrivals) {
#if defined(CIRCLE_LOSS_WARPGROUP_MMA)
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(arrivals) : "memory");
#endif
}

// Makes the barriers' initialisation visible to the copies (another memory
// proxy); a CTA barrier then makes it visible to the other threads.
__device__ __forceinline__ void fence_barrier_init() {
#if defined(CIRCLE_LOSS_WARPGROUP_MMA)
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void arrive(uint64_t* barrier) {
#if defined(CIRCLE_LOSS_WARPGROUP_MMA)
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(barrier)) : "memory");
#endif
}

// Arrives, and adds `bytes` to what the phase waits for.
__device__ __forceinline__ void arrive_expecting(uint64_t* barrier, uint32_t bytes) {
#if defined(CIRCLE_LOSS_WARPGROUP_MMA)
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(bytes)
               : "memory");
#endif
}

// Waits until the phase of this parity has completed.
__device__ __forceinline__ void wait_barrier(uint64_t* barrier, uint32_t parity) {
#if defined(CIRCLE_LOSS_WARPGROUP_MMA)
  uint32_t done = 0;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(shared_address(barrier)), "r"(parity)
                 : "memory");
  } while (done == 0);
#endif
}

// A bulk tensor copy of the box at (feature, row) of `boxes` into `stage`,
// counted in bytes by `barrier`.
__device__ __forceinline__ void copy_box(void* stage, const CUtensorMap& boxes, int64_t feature, int64_t row, uint64_t* barrier) {
#if defined(CIRCLE_LOSS_WARPGROUP_MMA)
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          shared_address(stage)),
      "l"(reinterpret_cast<uint64_t>(&boxes)), "r"(static_cast<int32_t>(feature)), "r"(static_cast<int32_t>(row)),
      "r"(shared_address(barrier))
      : "memory");
#endif
}

// multiply_stage with mma.sync.
template <typename T>
__device__ __forceinline__ void multiply_stage_by_mma_sync(TileAccumulators& tile, const T* row_stage, const T* col_stage) {
#if !defined(CIRCLE_LOSS_WARPGROUP_MMA)
  const int lane = threadIdx.x % 32;
  const int warp_row = threadIdx.x / 32 / (kMmaTile / kWarpCols) * kWarpRows;
  const int warp_col = threadIdx.x / 32 % (kMmaTile / kWarpCols) * kWarpCols;
  const uint32_t rows = shared_address(row_stage);
  const uint32_t cols = shared_address(col_stage);
#pragma unroll
  for (int kk = 0; kk < kStageRowBytes / kStepBytes; ++kk) {
    // A: lanes 0-15 give rows 0-15 at the step's first 8 features, lanes
    // 16-31 the same rows at the next 8: the four 8×8 matrices are a0..a3.
    uint32_t a[kMmaRowTiles][4];
#pragma unroll
    for (int mi = 0; mi < kMmaRowTiles; ++mi) {
      const int row = warp_row + mi * 16 + lane % 16;
      load_matrices(a[mi], rows + swizzled_offset(row, kk * 2 + lane / 16));
    }
    // B: one x4 load covers two n8 tiles: lanes 0-7 and 8-15 give columns
    // 0-7 at the first and the next 8 features, lanes 16-31 columns 8-15.
    uint32_t b[kMmaColTiles][2];
#pragma unroll
    for (int pair = 0; pair < kMmaColTiles / 2; ++pair) {
      const int col = warp_col + pair * 16 + lane % 8 + lane / 16 * 8;
      uint32_t m[4];
      load_matrices(m, cols + swizzled_offset(col, kk * 2 + lane / 8 % 2));
      b[2 * pair][0] = m[0];
      b[2 * pair][1] = m[1];
      b[2 * pair + 1][0] = m[2];
      b[2 * pair + 1][1] = m[3];
    }
#pragma unroll
    for (int mi = 0; mi < kMmaRowTiles; ++mi) {
#pragma unroll
      for (int ni = 0; ni < kMmaColTiles; ++ni) {
        mma_16x8_step<T>(tile.acc[mi * kMmaColTiles + ni], a[mi], b[ni][0], b[ni][1]);
      }
    }
  }
#endif
}

// One stage's kMmaK<T> features of the products, kStepBytes at a time. With
// wgmma they are only issued, as one group: warpgroup_wait says when they
// are done.
template <typename T>
__device__ __forceinline__ void multiply_stage(TileAccumulators& tile, const T* row_stage, const T* col_stage) {
#if defined(CIRCLE_LOSS_WARPGROUP_MMA)
  // The warpgroup's 64 rows are 8 whole swizzle atoms of the row stage; a
  // step is kStepBytes into each 128-byte row.
  const uint32_t rows = shared_address(row_stage) + threadIdx.x / 128 * 64 * kStageRowBytes;
  const uint32_t cols = shared_address(col_stage);
  warpgroup_fence();
#pragma unroll
  for (int kk = 0; kk < kStageRowBytes / kStepBytes; ++kk) {
    warpgroup_mma_step<T>(tile.acc, stage_descriptor(rows + kk * kStepBytes), stage_descriptor(cols + kk * kStepBytes));
  }
  warpgroup_commit();
#else
  multiply_stage_by_mma_sync(tile, row_stage, col_stage);
#endif
}

// The stages' addresses in `shared` (from stage_memory): each stage the
// row operand, then the column operand.
template <typename T>
struct Stages {
  static constexpr int kElements = kStageBytes / sizeof(T);
  T* shared;
  __device__ __forceinline__ T* rows(int s) const { return shared + s * 2 * kElements; }
  __device__ __forceinline__ T* cols(int s) const { return shared + s * 2 * kElements + kElements; }
};

__device__ __forceinline__ int following_stage(int s) { return s + 1 == kMmaStages ? 0 : s + 1; }

// multiply_tile on sm_90a. Thread 0 issues the copies: the stages start
// full, and a stage is refilled once both warpgroups' products of it are
// done (its `emptied` barrier), so no thread waits on another's copies and
// the CTA meets at no barrier in the loop.
template <typename T, typename Meanwhile>
__device__ __forceinline__ void multiply_tile_by_bulk_copies(
    TileAccumulators& tile,
    const TileOperands<T>& in,
    int64_t row0,
    int64_t col0,
    const Stages<T>& stages,
    int64_t steps,
    Meanwhile meanwhile) {
  constexpr int kWarpgroups = kMmaThreads / 128;
  __shared__ uint64_t filled[kMmaStages]; // a phase a fill: the stage has landed
  __shared__ uint64_t emptied[kMmaStages]; // a phase a fill: both warpgroups are done with it
  const auto fill = [&](int s, int64_t step) {
    arrive_expecting(&filled[s], 2 * kStageBytes);
    copy_box(stages.rows(s), in.row_boxes, step * kMmaK<T>, row0, &filled[s]);
    copy_box(stages.cols(s), in.col_boxes, step * kMmaK<T>, col0, &filled[s]);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kMmaStages; ++s) {
      init_barrier(&filled[s], 1);
      init_barrier(&emptied[s], kWarpgroups);
    }
    fence_barrier_init();
    for (int s = 0; s < kMmaStages && s < steps; ++s) fill(s, s);
  }
  meanwhile();
  __syncthreads(); // the barriers are initialised
  int read = 0; // step % kMmaStages
  uint32_t parity = 0; // of the stage's fill: step / kMmaStages % 2
  for (int64_t step = 0; step < steps; ++step) {
    wait_barrier(&filled[read], parity);
    multiply_stage<T>(tile, stages.rows(read), stages.cols(read));
    warpgroup_wait<1>(); // the previous step's products are done
    if (step > 0) {
      const int done = read == 0 ? kMmaStages - 1 : read - 1;
      const uint32_t done_parity = read == 0 ? parity ^ 1u : parity;
      if (threadIdx.x % 128 == 0) arrive(&emptied[done]);
      const int64_t next = step - 1 + kMmaStages;
      if (threadIdx.x == 0 && next < steps) {
        wait_barrier(&emptied[done], done_parity);
        fill(done, next);
      }
      __syncwarp(); // warp 0 together again for the warpgroup's next wgmma
    }
    read = following_stage(read);
    parity ^= read == 0 ? 1u : 0u;
  }
  warpgroup_wait<0>();
}

// multiply_tile with every thread's cp.async copies, kMmaStages - 1 stages
// ahead, and mma.sync.
template <typename T, typename Meanwhile>
__device__ __forceinline__ void multiply_tile_by_copies(
    TileAccumulators& tile,
    const TileOperands<T>& in,
    int64_t row0,
    int64_t col0,
    const Stages<T>& stages,
    int64_t steps,
    Meanwhile meanwhile) {
  const StageCopies<T> row_copies(in.rows, in.n_rows, in.dim, in.stride, row0);
  const StageCopies<T> col_copies(in.cols, in.n_cols, in.dim, in.stride, col0);
#pragma unroll
  for (int s = 0; s < kMmaStages - 1; ++s) {
    if (s < steps) {
      row_copies.issue(stages.rows(s), s * kMmaK<T>);
      col_copies.issue(stages.cols(s), s * kMmaK<T>);
    }
    commit_copies(); // empty groups keep the count that wait_copies relies on
  }
  meanwhile();
  int read = 0; // step % kMmaStages
  int refill = kMmaStages - 1; // (step + kMmaStages - 1) % kMmaStages
  for (int64_t step = 0; step < steps; ++step) {
    wait_copies<kMmaStages - 2>(); // this step's stage has landed
    __syncthreads(); // ... for every thread, and the stage refilled below is no longer read
    const int64_t next = step + kMmaStages - 1;
    if (next < steps) {
      row_copies.issue(stages.rows(refill), next * kMmaK<T>);
      col_copies.issue(stages.cols(refill), next * kMmaK<T>);
    }
    commit_copies();
    multiply_stage<T>(tile, stages.rows(read), stages.cols(read));
    read = following_stage(read);
    refill = following_stage(refill);
  }
  wait_copies<0>();
}

// The main loop: the tile rows[row0, +kMmaTile) · cols[col0, +kMmaTile)ᵀ
// over all dim features; meanwhile() runs while the first stages load (the
// CTA's other loads, such as its labels). shared: from stage_memory.
template <typename T, typename Meanwhile>
__device__ __forceinline__ void multiply_tile(
    TileAccumulators& tile,
    const TileOperands<T>& in,
    int64_t row0,
    int64_t col0,
    T* shared,
    Meanwhile meanwhile) {
  tile.for_each([](float& s, int, int, int) { s = 0.0f; });
  const int64_t steps = (in.dim + kMmaK<T> - 1) / kMmaK<T>;
#if defined(CIRCLE_LOSS_WARPGROUP_MMA)
  multiply_tile_by_bulk_copies(tile, in, row0, col0, Stages<T>{shared}, steps, meanwhile);
#else
  multiply_tile_by_copies(tile, in, row0, col0, Stages<T>{shared}, steps, meanwhile);
#endif
}

// The operands' similarity unit (TileOperands), by which a tile of S / unit
// is taken back to S: read into shared memory while the first stages land,
// applied once the CTA has met after the main loop (TileLabels::settle), so
// that no register holds it through the loop.
struct TileUnit {
  float value;

  template <typename T>
  __device__ __forceinline__ void load(const TileOperands<T>& in) {
    if (threadIdx.x == 0 && in.similarity_unit != nullptr) value = *in.similarity_unit;
  }

  // A power of two: exact.
  template <typename T>
  __device__ __forceinline__ void apply(const TileOperands<T>& in, TileAccumulators& tile) const {
    if (in.similarity_unit == nullptr) return;
    const float unit = value;
    tile.for_each([unit](float& s, int, int, int) { s *= unit; });
  }
};

// The labels of a tile's rows and columns in shared memory as 32-bit ids,
// equal where the labels are equal: an entry's set is then one 32-bit
// compare, where 64-bit labels take two. Labels that fit in 32 bits are
// their own ids; a tile with one that does not numbers its labels apart
// instead (each one's id is the first of the tile's 2·kMmaTile positions
// that holds it). Past the ends: id 0, at no visited entry. Aligned for
// column_pair_anew's paired loads.
struct alignas(8) TileLabels {
  int32_t row[kMmaTile];
  int32_t col[kMmaTile];

  template <typename T>
  __device__ __forceinline__ static int64_t label_at(const TileOperands<T>& in, int64_t row0, int64_t col0) {
    static_assert(2 * kMmaTile == kMmaThreads, "one label a thread");
    const int i = threadIdx.x % kMmaTile;
    if (threadIdx.x < kMmaTile) return row0 + i < in.n_rows ? in.row_labels[row0 + i] : 0;
    return col0 + i < in.n_cols ? in.col_labels[col0 + i] : 0;
  }

  __device__ __forceinline__ int32_t& id() { return threadIdx.x < kMmaTile ? row[threadIdx.x] : col[threadIdx.x - kMmaTile]; }

  // While the first stages land. Returns whether this thread's label fits
  // in 32 bits, for settle().
  template <typename T>
  __device__ __forceinline__ bool load(const TileOperands<T>& in, int64_t row0, int64_t col0) {
    const int64_t label = label_at(in, row0, col0);
    id() = static_cast<int32_t>(label);
    return static_cast<int32_t>(label) == label;
  }

  // After the main loop, in place of a CTA barrier (which it is): makes the
  // ids final and visible to every thread. fits: what load() returned;
  // scratch: the stages, free once the products are done, for the labels of
  // a tile that has to number them apart.
  template <typename T>
  __device__ __forceinline__ void settle(bool fits, const TileOperands<T>& in, int64_t row0, int64_t col0, void* scratch) {
    if (__syncthreads_and(fits)) return;
    int64_t* labels = static_cast<int64_t*>(scratch);
    const int64_t label = label_at(in, row0, col0);
    labels[threadIdx.x] = label;
    __syncthreads();
    int first = 0;
    while (labels[first] != label) ++first;
    id() = first;
    __syncthreads();
  }

  __device__ __forceinline__ bool positive(int row_in_tile, int col_in_tile) const {
    return row[row_in_tile] == col[col_in_tile];
  }

  // Which sets a whole tile's pairs fall in, from the ranges of its ids: an
  // exact test that rows taken in label order meet on most tiles. After
  // settle(), every thread calls it; the CTA meets at one barrier. scratch:
  // 2 · kMmaThreads / 32 ints of shared memory. Without warpgroup products
  // always kBoth: on mma.sync the kernels' extra entry loops would spill.
  enum class Sets { kBoth, kPositivesOnly, kNegativesOnly };
  __device__ __forceinline__ Sets sets(int32_t* scratch) const {
#if defined(CIRCLE_LOSS_WARPGROUP_MMA)
    static_assert(kMmaTile % 32 == 0, "a warp's ids are all rows or all columns");
    int32_t low = threadIdx.x < kMmaTile ? row[threadIdx.x] : col[threadIdx.x - kMmaTile];
    int32_t high = low;
    for (int offset = 16; offset > 0; offset >>= 1) {
      low = min(low, __shfl_xor_sync(0xffffffffu, low, offset));
      high = max(high, __shfl_xor_sync(0xffffffffu, high, offset));
    }
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) {
      scratch[2 * warp] = low;
      scratch[2 * warp + 1] = high;
    }
    __syncthreads();
    constexpr int kRowWarps = kMmaTile / 32;
    // [rows, columns][lowest, highest]
    int32_t range[2][2] = {{scratch[0], scratch[1]}, {scratch[2 * kRowWarps], scratch[2 * kRowWarps + 1]}};
    for (int w = 1; w < kRowWarps; ++w) {
      for (int side = 0; side < 2; ++side) {
        range[side][0] = min(range[side][0], scratch[2 * (side * kRowWarps + w)]);
        range[side][1] = max(range[side][1], scratch[2 * (side * kRowWarps + w) + 1]);
      }
    }
    if (range[0][1] < range[1][0] || range[1][1] < range[0][0]) return Sets::kNegativesOnly;
    if (range[0][0] == range[0][1] && range[1][0] == range[1][1] && range[0][0] == range[1][0]) {
      return Sets::kPositivesOnly;
    }
#endif
    return Sets::kBoth;
  }

  // The ids of columns c and c + 1 (c even), read from shared memory anew:
  // a pass that compares labels again after an earlier one then costs an
  // instruction an entry, where the compiler would otherwise keep the
  // earlier compares packed as bits, two or three instructions an entry.
  __device__ __forceinline__ int2 column_pair_anew(int c) const {
    int2 ids;
    asm volatile("ld.volatile.shared.v2.s32 {%0, %1}, [%2];" : "=r"(ids.x), "=r"(ids.y) : "r"(shared_address(&col[c])));
    return ids;
  }
};

// weights = W over a strip rows × colsᵀ, one kMmaTile² tile a CTA, S formed
// on the tensor cores: the gradient passes' W, S never in memory. W's entries come from a Rule, which gives
//   Shared                         what the tile's entries share (its rows'
//                                  coefficients, the loss's scalars), held
//                                  in shared memory;
//   load(Shared&, row0, col0)      fills it for the tile at (row0, col0),
//                                  each of the CTA's threads taking part;
//   with_weight(Shared&, visit)    once load's writes are visible, calls
//                                  visit(weight) in every thread, where
//                                  weight(s, positive, r, c) is W at (r, c)
//                                  of the tile (a rule may first derive more
//                                  from Shared, meeting at a CTA barrier).
// The tile of W goes through shared memory, so that global stores are whole
// 16 bytes. symmetric: the strip's columns start at its first row and W is
// symmetric there (the global form, and the per-anchor form without a
// reference set, whose entries carry both orders), so its diagonal block's
// tiles below the diagonal are those above it transposed: those CTAs return
// at once, and the ones above store their tile's transpose too. Launched as a
// dependent of the products that read the previous strip's W from the same
// memory, a CTA forms its tile while they finish and waits only before it
// stores. W goes out in the features' dtype, for split float32 in bfloat16
// parts (Out, float32_split.cuh): W rounded to Out to weights, what that
// rounding leaves to small_weights. (float32 with TF32 allowed comes as
// HalfFeatures' float16, its W scaled by the Rule: HalfProducts.)
template <typename T, typename Rule, typename Out = T>
__global__ void __launch_bounds__(kMmaThreads, 2) tile_weights_kernel(
    const __grid_constant__ TileOperands<T> in,
    const Rule rule,
    bool symmetric,
    Out* __restrict__ weights, // (R, C)
    Out* __restrict__ small_weights) { // (R, C) where Out is bfloat16 for float32 features, else unused
  constexpr bool kParts = std::is_same_v<T, float> && std::is_same_v<Out, c10::BFloat16>;
  extern __shared__ __align__(128) unsigned char stages[];
  constexpr int kStride = kMmaTile + 8; // padded rows of the staged tile: its writes avoid bank conflicts
  static_assert(kStride * sizeof(Out) % 16 == 0, "staged rows start 16-byte aligned");
  if (symmetric && blockIdx.y < blockIdx.x) return;
  const int64_t row0 = blockIdx.x * static_cast<int64_t>(kMmaTile);
  const int64_t col0 = blockIdx.y * static_cast<int64_t>(kMmaTile);
  __shared__ TileLabels labels;
  __shared__ int32_t id_ranges[2 * kMmaThreads / 32];
  __shared__ typename Rule::Shared shared_rule;
  __shared__ TileUnit unit;
  TileAccumulators tile;
  bool labels_fit;
  multiply_tile(tile, in, row0, col0, stage_memory<T>(stages), [&] {
    labels_fit = labels.load(in, row0, col0);
    rule.load(shared_rule, row0, col0);
    unit.load(in);
  });
  // The labels, the rule's values and the unit, also where dim gives the main loop no step.
  labels.settle(labels_fit, in, row0, col0, stages);
  unit.apply(in, tile);
  // W in registers first, then to shared memory: with no store between them
  // the compiler reads each row's labels and values from shared memory once.
  // A tile whose pairs are all in one set takes that set's W without a
  // label compare an entry (TileLabels::sets; its ranges count the ids past
  // the ends too, which only makes the test stricter).
  rule.with_weight(shared_rule, [&](const auto& weight) {
    switch (labels.sets(id_ranges)) {
      case TileLabels::Sets::kNegativesOnly:
        tile.for_each([&](float& s, int r, int c, int) { s = weight(s, false, r, c); });
        break;
      case TileLabels::Sets::kPositivesOnly:
        tile.for_each([&](float& s, int r, int c, int) { s = weight(s, true, r, c); });
        break;
      default:
        tile.for_each([&](float& s, int r, int c, int) { s = weight(s, labels.positive(r, c), r, c); });
    }
  });
  wait_for_prerequisites();
  // The tile, or its transpose, through shared memory to W's rows from
  // out_row0 and columns from out_col0, those before row_end and col_end
  // (with kParts both parts, each staged tile beside the other).
  Out* staged = stage_memory<Out>(stages);
  Out* staged_small = staged + kMmaTile * kStride;
  static_assert((kParts ? 2 : 1) * kMmaTile * kStride * sizeof(Out) <= kMmaSharedBytes - kStageAlignment,
                "the staged tiles fit in the stages");
  const bool whole_chunks = in.n_cols % kVec<Out> == 0 && reinterpret_cast<uintptr_t>(weights) % 16 == 0 &&
      (!kParts || reinterpret_cast<uintptr_t>(small_weights) % 16 == 0);
  const auto copy_out = [&](const Out* tile_in, Out* out, int64_t out_row0, int64_t out_col0, int64_t row_end,
                            int64_t col_end) {
    constexpr int kChunks = kMmaTile * kMmaTile / kVec<Out>;
    for (int q = threadIdx.x; q < kChunks; q += kMmaThreads) {
      const int row = q / (kMmaTile / kVec<Out>);
      const int col = q % (kMmaTile / kVec<Out>) * kVec<Out>;
      const int64_t r = out_row0 + row;
      const int64_t c = out_col0 + col;
      if (r >= row_end || c >= col_end) continue;
      const Out* from = tile_in + row * kStride + col; // 16-byte aligned: kStride · sizeof(Out) is a multiple of 16
      Out* to = out + r * in.n_cols + c;
      if (whole_chunks && c + kVec<Out> <= col_end) {
        *reinterpret_cast<Packed<Out, kVec<Out>>*>(to) = *reinterpret_cast<const Packed<Out, kVec<Out>>*>(from);
      } else {
        for (int v = 0; v < kVec<Out> && c + v < col_end; ++v) to[v] = from[v];
      }
    }
  };
  const auto store = [&](bool transposed, int64_t out_row0, int64_t out_col0, int64_t row_end, int64_t col_end) {
    __syncthreads(); // every warp is done with the stages, or with the staged tiles
    tile.for_each([&](float w, int r, int c, int) {
      const int at = transposed ? c * kStride + r : r * kStride + c;
      staged[at] = rounded_part<Out>(w, false);
      if constexpr (kParts) staged_small[at] = rounded_part<Out>(w, true);
    });
    __syncthreads();
    copy_out(staged, weights, out_row0, out_col0, row_end, col_end);
    if constexpr (kParts) copy_out(staged_small, small_weights, out_row0, out_col0, row_end, col_end);
  };
  store(false, row0, col0, in.n_rows, in.n_cols);
  // Row col0 + c of the strip is its column col0 + c.
  if (symmetric && blockIdx.y > blockIdx.x && col0 < in.n_rows) store(true, col0, row0, in.n_rows, in.n_rows);
}

// Whether `kernel`, built on these tiles, runs on this GPU: a binary built
// for sm_80 or later (before, the tiles compile to nothing). Sets the
// kernel's dynamic shared memory on the way, which it needs beyond 48 KiB.
template <auto kernel>
inline bool mma_tiles_built() {
  return configure_once<kernel>([] {
    cudaFuncAttributes attributes = {};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    if (attributes.binaryVersion < 80) {
      return false;
    }
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMmaSharedBytes));
    return true;
  });
}

// tile_weights_kernel over a strip into weights (R, C): W whole in the
// features' dtype, or split float32's bfloat16 parts. dependent: as
// launch_kernel's.
template <typename T, typename Rule>
void launch_tile_weights_kernel(
    bool dependent,
    const TileOperands<T>& in,
    const Rule& rule,
    bool symmetric,
    const SplitMatrix& weights) {
  // x over the strip's rows of tiles, the fastest: the CTAs resident at once
  // share their columns' operand tiles through L2.
  const dim3 grid(static_cast<unsigned>(tiles(in.n_rows)), static_cast<unsigned>(tiles(in.n_cols)));
  if constexpr (std::is_same_v<T, float>) {
    if (weights.split()) {
      constexpr auto kernel = tile_weights_kernel<T, Rule, c10::BFloat16>;
      TORCH_INTERNAL_ASSERT(mma_tiles_built<kernel>());
      launch_kernel(dependent, kernel, grid, dim3(kMmaThreads), kMmaSharedBytes, in, rule, symmetric,
                    weights.big.data_ptr<c10::BFloat16>(), weights.small.data_ptr<c10::BFloat16>());
      return;
    }
  }
  launch_kernel(dependent, tile_weights_kernel<T, Rule>, grid, dim3(kMmaThreads), kMmaSharedBytes, in, rule, symmetric,
                weights.big.data_ptr<T>(), static_cast<T*>(nullptr));
}

} // namespace
} // namespace circle_loss
