// Tiles of S = rows · colsᵀ on the tensor cores, for float16 and bfloat16
// features: S accumulates in float32 registers and is handed to an epilogue
// in place, so that it never goes to memory. Used by circle_loss_cuda.cu for
// the LSE partials and the gradient weights of half-precision batches.
//
// A CTA of kMmaThreads threads owns a kMmaTile × kMmaTile tile of S. Its 8
// warps are 2 (rows) × 4 (columns), each warp kWarpRows × kWarpCols made of
// mma.sync m16n8k16 tiles (sm_80 on). The features pass through shared
// memory kMmaK at a time in kMmaStages stages, copied by cp.async and read
// by ldmatrix; each 128-byte row of a stage stores its 16-byte chunks in an
// XOR-swizzled order, so that the 8 rows one ldmatrix phase reads fall in
// distinct banks.
#pragma once

#include "common.cuh"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>

namespace circle_loss {
namespace {

constexpr int kMmaTile = 128; // rows and columns of a CTA's tile of S
constexpr int kMmaK = 64; // features per stage: 128 bytes of a row
constexpr int kMmaStages = 3;
constexpr int kMmaThreads = 256;
constexpr int kWarpRows = 64;
constexpr int kWarpCols = 32;
constexpr int kMmaRowTiles = kWarpRows / 16; // m16 tiles a warp
constexpr int kMmaColTiles = kWarpCols / 8; // n8 tiles a warp
constexpr int kChunksPerRow = kMmaK * 2 / 16; // 16-byte chunks of a stage row
constexpr int kStageElements = kMmaTile * kMmaK; // one operand of one stage
constexpr int kMmaSharedBytes = kMmaStages * 2 * kStageElements * 2;
static_assert((kMmaTile / kWarpRows) * (kMmaTile / kWarpCols) * 32 == kMmaThreads, "8 warps, 2 × 4");

// The tensor cores take these two dtypes, and rows of a multiple of 8
// features (whole 16-byte chunks), 16-byte aligned.
template <typename T>
constexpr bool kHasMmaTiles = std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>;

// The two sides of a product rows · colsᵀ and their labels, as the
// tensor-core kernels take them.
template <typename T>
struct TileOperands {
  const T* rows; // (n_rows, dim)
  const int64_t* row_labels; // (n_rows,)
  int64_t n_rows;
  const T* cols; // (n_cols, dim)
  const int64_t* col_labels; // (n_cols,)
  int64_t n_cols;
  int64_t dim;
};

// One thread's share of a CTA's tile: acc[mi][ni][e] is S at
// (row_of(mi, e), col_of(ni, e)) relative to the tile's first row and column,
// the layout of mma.sync's m16n8 accumulators.
struct TileAccumulators {
  float acc[kMmaRowTiles][kMmaColTiles][4];

  __device__ __forceinline__ static int row_of(int mi, int e) {
    const int warp_row = threadIdx.x / 32 / (kMmaTile / kWarpCols) * kWarpRows;
    return warp_row + mi * 16 + threadIdx.x % 32 / 4 + e / 2 * 8;
  }
  __device__ __forceinline__ static int col_of(int ni, int e) {
    const int warp_col = threadIdx.x / 32 % (kMmaTile / kWarpCols) * kWarpCols;
    return warp_col + ni * 8 + threadIdx.x % 4 * 2 + e % 2;
  }

  // visit(s, r, c) for each of the thread's entries s, at (r, c) in the tile.
  template <typename Visit>
  __device__ __forceinline__ void for_each(Visit visit) {
#pragma unroll
    for (int mi = 0; mi < kMmaRowTiles; ++mi) {
#pragma unroll
      for (int ni = 0; ni < kMmaColTiles; ++ni) {
#pragma unroll
        for (int e = 0; e < 4; ++e) visit(acc[mi][ni][e], row_of(mi, e), col_of(ni, e));
      }
    }
  }
};

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// Byte offset of 16-byte chunk `chunk` of row `row` within a stage operand.
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {
  return row * kMmaK * 2 + ((chunk ^ (row % kChunksPerRow)) * 16);
}

// Stage operand ← features[first, first + kMmaTile) × [k0, k0 + kMmaK).
template <typename T>
__device__ __forceinline__ void load_stage(
    T* stage, // (kMmaTile, kMmaK), swizzled
    const T* __restrict__ features, // (n, dim)
    int64_t n,
    int64_t dim,
    int64_t first,
    int64_t k0) {
  constexpr int kChunks = kMmaTile * kChunksPerRow;
  static_assert(kChunks % kMmaThreads == 0, "whole chunks a thread");
#pragma unroll
  for (int u = 0; u < kChunks / kMmaThreads; ++u) {
    const int q = threadIdx.x + u * kMmaThreads;
    const int row = q / kChunksPerRow;
    const int chunk = q % kChunksPerRow;
    const int64_t r = first + row;
    const int64_t k = k0 + chunk * 8;
    const bool valid = r < n && k < dim;
    const T* src = valid ? features + r * dim + k : features;
    copy_16(reinterpret_cast<char*>(stage) + swizzled_offset(row, chunk), src, valid);
  }
}

// Four 8×8 matrices of 16-bit values from shared memory, one register each.
__device__ __forceinline__ void load_matrices(uint32_t (&out)[4], uint32_t address) {
#if __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(out[0]), "=r"(out[1]), "=r"(out[2]), "=r"(out[3])
               : "r"(address));
#endif
}

// acc += a · b for one m16n8k16 tile: a (16 × 16) row-major, b (16 × 8)
// column-major, i.e. both with the features contiguous.
template <typename T>
__device__ __forceinline__ void mma_16x8x16(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
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

// One stage's kMmaK features of the warp's products, 16 at a time.
template <typename T>
__device__ __forceinline__ void multiply_stage(TileAccumulators& tile, const T* row_stage, const T* col_stage) {
  const int lane = threadIdx.x % 32;
  const int warp_row = threadIdx.x / 32 / (kMmaTile / kWarpCols) * kWarpRows;
  const int warp_col = threadIdx.x / 32 % (kMmaTile / kWarpCols) * kWarpCols;
  const uint32_t rows = shared_address(row_stage);
  const uint32_t cols = shared_address(col_stage);
#pragma unroll
  for (int kk = 0; kk < kMmaK / 16; ++kk) {
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
      for (int ni = 0; ni < kMmaColTiles; ++ni) mma_16x8x16<T>(tile.acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
    }
  }
}

// The main loop: the tile rows[row0, +kMmaTile) · cols[col0, +kMmaTile)ᵀ
// over all dim features. shared: kMmaSharedBytes of dynamic shared memory.
template <typename T>
__device__ __forceinline__ void multiply_tile(
    TileAccumulators& tile,
    const TileOperands<T>& in,
    int64_t row0,
    int64_t col0,
    T* shared) {
  tile.for_each([](float& s, int, int) { s = 0.0f; });
  const auto row_stage = [&](int s) { return shared + s * 2 * kStageElements; };
  const auto col_stage = [&](int s) { return shared + s * 2 * kStageElements + kStageElements; };
  const int64_t steps = (in.dim + kMmaK - 1) / kMmaK;
#pragma unroll
  for (int s = 0; s < kMmaStages - 1; ++s) {
    if (s < steps) {
      load_stage(row_stage(s), in.rows, in.n_rows, in.dim, row0, s * kMmaK);
      load_stage(col_stage(s), in.cols, in.n_cols, in.dim, col0, s * kMmaK);
    }
    commit_copies(); // empty groups keep the count that wait_copies relies on
  }
  for (int64_t step = 0; step < steps; ++step) {
    wait_copies<kMmaStages - 2>(); // this step's stage has landed
    __syncthreads(); // ... for every thread, and the stage refilled below is no longer read
    const int64_t next = step + kMmaStages - 1;
    if (next < steps) {
      const int s = static_cast<int>(next % kMmaStages);
      load_stage(row_stage(s), in.rows, in.n_rows, in.dim, row0, next * kMmaK);
      load_stage(col_stage(s), in.cols, in.n_cols, in.dim, col0, next * kMmaK);
    }
    commit_copies();
    const int s = static_cast<int>(step % kMmaStages);
    multiply_stage<T>(tile, row_stage(s), col_stage(s));
  }
  wait_copies<0>();
}

// The labels of a tile's rows and columns in shared memory (0 past the
// end, where no entry is visited), loaded by the CTA before its main loop.
struct TileLabels {
  int64_t row[kMmaTile];
  int64_t col[kMmaTile];

  template <typename T>
  __device__ __forceinline__ void load(const TileOperands<T>& in, int64_t row0, int64_t col0) {
    static_assert(2 * kMmaTile == kMmaThreads, "one label a thread");
    const int i = threadIdx.x % kMmaTile;
    if (threadIdx.x < kMmaTile) {
      row[i] = row0 + i < in.n_rows ? in.row_labels[row0 + i] : 0;
    } else {
      col[i] = col0 + i < in.n_cols ? in.col_labels[col0 + i] : 0;
    }
  }

  __device__ __forceinline__ bool positive(int row_in_tile, int col_in_tile) const {
    return row[row_in_tile] == col[col_in_tile];
  }
};

// Whether `kernel`, built on these tiles, can take these features: whole
// 16-byte chunks per row from an aligned start, and a binary for this GPU
// built for sm_80 or later (before, the tiles compile to nothing). Sets the
// kernel's dynamic shared memory on the way, which it needs beyond 48 KiB.
template <auto kernel>
inline bool mma_tiles_apply(const at::Tensor& features) {
  if (features.size(1) % 8 != 0 || reinterpret_cast<uintptr_t>(features.data_ptr()) % 16 != 0) {
    return false;
  }
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

} // namespace
} // namespace circle_loss
