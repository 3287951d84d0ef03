// The strips of S = rows · colsᵀ that the CUDA kernels of circle::loss (for
// large batches) and circle::anchor_loss walk: how a product is cut into
// strips of bounded size, the GEMMs that form and consume them, and the
// traversal of a strip's entries by the elementwise kernels.
#pragma once

#include "common.cuh"

#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <iterator>
#include <limits>
#include <vector>

namespace circle_loss {
namespace {

// Largest strip of S held at once. 64 MiB of float32 keeps B = 16 384 in
// strips of 1 024 rows, wide enough for cuBLAS to run near its peak, and lets
// batches up to 4 096 run in a single strip that the gradient pass reuses.
constexpr int64_t kStripBytes = int64_t{64} << 20;
// Largest strip of W that the tensor-core gradient passes hold at once
// (plan_column_chunks), 2 bytes an entry in half precision: B = 16 384 in
// four strips. Every strip costs about four kernel boundaries, a few idle
// microseconds each, and cuBLAS runs taller products of W·F faster.
constexpr int64_t kWeightStripBytes = int64_t{128} << 20;
// Strip heights are multiples of this (and never less): GEMM tile friendly.
constexpr int64_t kStripAlign = 128;
// Elementwise kernels: a CTA covers kThreads · kColsPerThread columns of a
// strip and a grid-stride set of its rows.
constexpr int kColsPerThread = 4;
constexpr int64_t kColsPerCta = kThreads * kColsPerThread;
// One strip of S: rows [row0, row0 + rows) × columns [col0, col0 + cols).
struct Strip {
  int64_t row0, rows, col0, cols;

  // In a symmetric product: the first of the strip's columns right of its
  // diagonal block, whose rows take the strip's mirrored share Wᵀ·rows, and
  // how many there are.
  int64_t first_mirrored() const { return std::max(col0, row0 + rows); }
  int64_t mirrored() const { return std::max<int64_t>(col0 + cols - first_mirrored(), 0); }
};

// The strips covering rows × cols. Symmetric (rows and cols one tensor): each
// strip starts its columns at its first row, so S is covered on and above the
// diagonal; the first strip is the widest.
// At most max_height rows a strip (default: no limit but the budget) and
// budget_bytes a strip.
inline std::vector<Strip> plan_strips(
    int64_t n_rows,
    int64_t n_cols,
    bool symmetric,
    size_t element_bytes,
    int64_t max_height = std::numeric_limits<int64_t>::max(),
    int64_t budget_bytes = kStripBytes) {
  const int64_t budget_rows = std::min(
      max_height, budget_bytes / static_cast<int64_t>(element_bytes) / std::max<int64_t>(n_cols, 1));
  const int64_t height = budget_rows >= n_rows
      ? std::max<int64_t>(n_rows, 1)
      : std::max(kStripAlign, budget_rows / kStripAlign * kStripAlign);
  std::vector<Strip> strips;
  for (int64_t row0 = 0; row0 < n_rows; row0 += height) {
    const int64_t col0 = symmetric ? row0 : 0;
    strips.push_back({row0, std::min(height, n_rows - row0), col0, n_cols - col0});
  }
  return strips;
}

// The gradient passes' strips when they hold only W (the tensor-core paths),
// in kWeightStripBytes. Each strip's mirrored product Wᵀ·rows reads and
// writes the float32 gradient rows of all its columns, B²·D·4/h bytes over
// the strips of height h, and on an H200 below about 1024 rows that traffic
// rather than the arithmetic bounds the product. So where the budget leaves
// a strip of the whole width fewer than kTallStrip rows, strips of
// kTallStrip rows are cut into chunks of columns of the same budget, left to
// right; chunks of one strip are consecutive, and in a symmetric product the
// first starts at the strip's first row and holds its diagonal block.
// Taller strips cost W's entries below their diagonals, B·h/2 in all, so
// the chunks stop at kTallStrip. Otherwise as plan_strips.
constexpr int64_t kTallStrip = 2048;

inline std::vector<Strip> plan_column_chunks(
    int64_t n_rows,
    int64_t n_cols,
    bool symmetric,
    size_t element_bytes,
    int64_t max_height = std::numeric_limits<int64_t>::max()) {
  std::vector<Strip> strips = plan_strips(n_rows, n_cols, symmetric, element_bytes, max_height, kWeightStripBytes);
  const int64_t height = std::min({kTallStrip, max_height, n_rows});
  if (strips.empty() || strips.front().rows >= height) {
    return strips;
  }
  const int64_t budget = kWeightStripBytes / static_cast<int64_t>(element_bytes);
  const int64_t width = std::max(height, budget / height / kStripAlign * kStripAlign);
  std::vector<Strip> chunks;
  for (int64_t row0 = 0; row0 < n_rows; row0 += height) {
    const int64_t rows = std::min(height, n_rows - row0);
    for (int64_t col0 = symmetric ? row0 : 0; col0 < n_cols; col0 += width) {
      chunks.push_back({row0, rows, col0, std::min(width, n_cols - col0)});
    }
  }
  return chunks;
}

// Whether `strip`, met walking `plan` back from its end, is the last chunk of
// its rows: the first that reaches them, so the one that writes their
// gradient rather than adding to it.
inline bool last_chunk_of_rows(const std::vector<Strip>& plan, std::vector<Strip>::const_reverse_iterator strip) {
  return strip == plan.rbegin() || std::prev(strip)->row0 != strip->row0;
}

// Grid of the elementwise kernels over a strip: x over column chunks, y over
// row groups, enough CTAs to fill every SM (8 × 256 threads): these kernels
// stream S, and only many loads in flight reach the memory's bandwidth. Fixed
// by the shapes and the GPU, so the partials, and their fold, are too.
inline dim3 strip_grid(const Strip& strip, int sms) {
  constexpr int64_t kCtasPerSm = 8;
  const int64_t col_chunks = std::max<int64_t>((strip.cols + kColsPerCta - 1) / kColsPerCta, 1);
  const int64_t row_groups =
      std::clamp<int64_t>((kCtasPerSm * sms + col_chunks - 1) / col_chunks, 1, std::max<int64_t>(strip.rows, 1));
  return dim3(static_cast<unsigned>(col_chunks), static_cast<unsigned>(row_groups));
}

// Calls visit(r, c, s_rc, is_positive) for this thread's entries of a strip.
// Column labels are read once per thread, row labels once per row; the
// entries of kRowsInFlight rows (64 bytes a thread) are loaded before any is
// visited, so that enough loads are in flight to stream S at the memory's speed.
template <typename acc_t, typename Visit>
__device__ __forceinline__ void for_each_entry(
    const acc_t* __restrict__ s, // (rows, cols)
    int64_t rows,
    int64_t cols,
    const int64_t* __restrict__ row_labels, // (rows,)
    const int64_t* __restrict__ col_labels, // (cols,)
    Visit visit) {
  constexpr int kRowsInFlight = 16 / sizeof(acc_t);
  int64_t col[kColsPerThread];
  int64_t col_label[kColsPerThread];
#pragma unroll
  for (int k = 0; k < kColsPerThread; ++k) {
    col[k] = blockIdx.x * kColsPerCta + k * kThreads + threadIdx.x;
    col_label[k] = col[k] < cols ? col_labels[col[k]] : 0;
  }
  for (int64_t r0 = blockIdx.y; r0 < rows; r0 += static_cast<int64_t>(gridDim.y) * kRowsInFlight) {
    int64_t row_label[kRowsInFlight];
    acc_t value[kRowsInFlight][kColsPerThread];
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      const int64_t r = r0 + u * static_cast<int64_t>(gridDim.y);
      row_label[u] = r < rows ? row_labels[r] : 0;
#pragma unroll
      for (int k = 0; k < kColsPerThread; ++k) {
        value[u][k] = r < rows && col[k] < cols ? s[r * cols + col[k]] : acc_t(0);
      }
    }
#pragma unroll
    for (int u = 0; u < kRowsInFlight; ++u) {
      const int64_t r = r0 + u * static_cast<int64_t>(gridDim.y);
#pragma unroll
      for (int k = 0; k < kColsPerThread; ++k) {
        if (r < rows && col[k] < cols) visit(r, col[k], value[u][k], row_label[u] == col_label[k]);
      }
    }
  }
}

// out = a · b, in out's dtype: float16/bfloat16 operands give float32 results
// (cuBLAS accumulates in float32 either way).
inline void matmul_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == out.scalar_type()) {
    at::mm_out(out, a, b);
  } else {
    at::mm_out(out, a, b, out.scalar_type());
  }
}

// out += a · b, likewise.
inline void matmul_add(at::Tensor out, const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == out.scalar_type()) {
    out.addmm_(a, b);
  } else {
    at::addmm_out(out, out, a, b, out.scalar_type()); // the add in cuBLAS's epilogue, not a pass of its own
  }
}

// S for one strip, as a (rows, cols) view of the workspace.
inline at::Tensor strip_similarities(const KernelRows& rows, const KernelRows& cols, const Strip& strip, const at::Tensor& workspace) {
  at::Tensor s = workspace.narrow(0, 0, strip.rows * strip.cols).view({strip.rows, strip.cols});
  matmul_into(s, rows.features.narrow(0, strip.row0, strip.rows), cols.features.narrow(0, strip.col0, strip.cols).t());
  return s;
}

} // namespace
} // namespace circle_loss
