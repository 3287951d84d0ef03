// CPU kernels of circle::anchor_loss, the per-anchor form (docs/math.md).
//
// The pairs are visited in tiles of S = Q Rᵀ, one tile per task at a time:
//   forward   each row's (max, Σ exp(z - max)) of both pair sets, then
//             L_i = softplus(LSE_P(i) + LSE_N(i)).
//   backward  W_ij = g_i·σ(Z_i)·exp(z_ij - LSE_set(i))·dz/ds, then
//             dQ = W R and, where the references need a gradient,
//             dR = Wᵀ Q.
// Without a reference set S is symmetric and so is the logit (it depends on
// s_ij and on whether the labels match), so only the tiles {I, J} on and
// above the diagonal are formed: in the forward a tile's row reductions feed
// rows I and its column reductions rows J; in the backward the tile
// C = W_IJ + W_JIᵀ, made elementwise from the one tile of S, adds C Q_J to
// rows I and, in a second phase of the round, Cᵀ Q_I to rows J. Round r
// takes the tiles {I, (I + r) mod n}, so that each accumulator is written by
// one task per round (per phase), in round order: the result is bitwise the
// same for any thread count.
#include "tiles.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace circle_loss {
namespace {

using namespace cpu;

// Each row's LSE states of (positive, negative) pairs.
using RowStates = std::vector<PairStates<double>>;

// The one pair of each row that belongs to no set, as a column of the whole
// reference set: (i, i) without a reference set, (i, ref_self_index[i]) with
// one; a column out of range leaves none out.
struct LeftOutPairs {
  const int64_t* column = nullptr; // (B,), or null: every pair counts

  // f(r, c) for each row r of the tile of rows [row0, row0 + rows) and
  // columns [col0, col0 + cols) whose left-out pair (r, c) it holds, r and
  // c counted from the tile's corner.
  template <typename F>
  void for_each_in(int64_t row0, int64_t rows, int64_t col0, int64_t cols, const F& f) const {
    if (column == nullptr) return;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t c = column[row0 + r] - col0;
      if (c >= 0 && c < cols) f(r, c);
    }
  }
};

// The tile of rows [row0, row0 + R) and columns [col0, col0 + C) of S.
struct TileOrigin {
  int64_t row0;
  int64_t col0;
};

// A tile of pairs rows × cols and their logits, made in place from the tile
// of S. The left-out pairs' logits are set to -inf, which contributes
// exactly nothing to an LSE (below, a -inf logit never counts, as
// exp(-inf) = 0), so the loops over the tile need no test for them. The
// loops test the set inline from the int32 class ids, branch-free, so that
// they vectorise.
template <typename T>
struct PairTile {
  at::Tensor logits; // (R, C)
  const int32_t* row_ids; // (R,)
  const int32_t* col_ids; // (C,)
  int64_t rows;
  int64_t cols;

  PairTile(
      at::Tensor similarities, // (R, C), contiguous: becomes `logits`
      const int32_t* row_ids_,
      const int32_t* col_ids_,
      const PairLogit<T>& logit,
      const LeftOutPairs& left_out,
      TileOrigin origin)
      : logits(std::move(similarities)),
        row_ids(row_ids_),
        col_ids(col_ids_),
        rows(logits.size(0)),
        cols(logits.size(1)) {
    const int64_t n_rows = rows, n_cols = cols;
    T* zs = logits.data_ptr<T>();
    const int32_t* __restrict__ x = row_ids;
    const int32_t* __restrict__ y = col_ids;
    run_vectorised([=]() CIRCLE_LOSS_VECTOR_LOOP {
      for (int64_t i = 0; i < n_rows; ++i) {
        T* __restrict__ zi = zs + i * n_cols;
        const int32_t yi = x[i];
#pragma omp simd
        for (int64_t j = 0; j < n_cols; ++j) {
          T slope;
          zi[j] = logit(zi[j], yi == y[j], &slope);
        }
      }
    });
    left_out.for_each_in(origin.row0, n_rows, origin.col0, n_cols, [&](int64_t r, int64_t c) {
      logits.data_ptr<T>()[r * n_cols + c] = -std::numeric_limits<T>::infinity();
    });
  }
};

// The shift R of a set's sums in a tile: the largest finite maximum of its
// rows (the columns' share it), and whether every finite row and column
// maximum lies within kSharedShiftSpan of it. An inf logit does not fit.
template <typename T>
struct SharedShift {
  T value = -std::numeric_limits<T>::infinity();
  bool fits = true;

  SharedShift(const T* row_max, int64_t rows, const T* col_max, int64_t cols) {
    for (int64_t k = 0; k < rows; ++k) {
      fits = fits && row_max[k] != std::numeric_limits<T>::infinity();
      if (std::isfinite(row_max[k])) value = std::max(value, row_max[k]);
    }
    fits = fits && within(row_max, rows) && within(col_max, cols);
  }

 private:
  bool within(const T* m, int64_t n) const {
    for (int64_t k = 0; k < n; ++k) {
      if (std::isfinite(m[k]) && value - m[k] > kSharedShiftSpan<T>) return false;
    }
    return true;
  }
};

// Merges the tile's LSE states into its rows' (row_states[0, R)) and, with
// kColumns, its columns' (col_states[0, C)), in two passes over the tile
// that serve both: the maxima, then the sums of exp(z - max). A row's
// maximum and sum are `omp simd` reductions, so that they run in vector
// lanes beside the elementwise column updates. With kColumns, where every
// row's and column's maximum of a set lies within kSharedShiftSpan of the
// set's largest, R, the sums are taken against R: one exp an entry serves
// its row and its column, and the states merge as (R, sum).
template <bool kColumns, typename T>
void merge_tile_states(const PairTile<T>& tile, PairStates<double>* row_states, PairStates<double>* col_states) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  const int64_t n_rows = tile.rows, n_cols = tile.cols;
  std::vector<T> row_max_pos_v(n_rows), row_max_neg_v(n_rows), row_sum_pos_v(n_rows), row_sum_neg_v(n_rows);
  std::vector<T> col_max_pos_v(kColumns ? n_cols : 0, kNegInf), col_max_neg_v(kColumns ? n_cols : 0, kNegInf);
  std::vector<T> col_sum_pos_v(kColumns ? n_cols : 0, T(0)), col_sum_neg_v(kColumns ? n_cols : 0, T(0));
  T* __restrict__ row_max_pos = row_max_pos_v.data();
  T* __restrict__ row_max_neg = row_max_neg_v.data();
  T* __restrict__ row_sum_pos = row_sum_pos_v.data();
  T* __restrict__ row_sum_neg = row_sum_neg_v.data();
  T* __restrict__ col_max_pos = col_max_pos_v.data();
  T* __restrict__ col_max_neg = col_max_neg_v.data();
  T* __restrict__ col_sum_pos = col_sum_pos_v.data();
  T* __restrict__ col_sum_neg = col_sum_neg_v.data();
  const int32_t* __restrict__ x = tile.row_ids;
  const int32_t* __restrict__ y = tile.col_ids;
  const T* __restrict__ zs = tile.logits.template data_ptr<T>();
  run_vectorised([=]() CIRCLE_LOSS_VECTOR_LOOP {
    for (int64_t i = 0; i < n_rows; ++i) {
      const T* __restrict__ zi = zs + i * n_cols;
      const int32_t yi = x[i];
      T max_pos = kNegInf, max_neg = kNegInf;
#pragma omp simd reduction(max : max_pos, max_neg)
      for (int64_t j = 0; j < n_cols; ++j) {
        const bool positive = yi == y[j];
        const T v_pos = positive ? zi[j] : kNegInf;
        const T v_neg = positive ? kNegInf : zi[j];
        max_pos = tile_max(v_pos, max_pos);
        max_neg = tile_max(v_neg, max_neg);
        if constexpr (kColumns) {
          col_max_pos[j] = tile_max(v_pos, col_max_pos[j]);
          col_max_neg[j] = tile_max(v_neg, col_max_neg[j]);
        }
      }
      row_max_pos[i] = max_pos;
      row_max_neg[i] = max_neg;
    }
  });
  if constexpr (kColumns) {
    const SharedShift<T> shift_pos(row_max_pos, n_rows, col_max_pos, n_cols);
    const SharedShift<T> shift_neg(row_max_neg, n_rows, col_max_neg, n_cols);
    if (shift_pos.fits && shift_neg.fits) {
      const T r_pos = shift_pos.value, r_neg = shift_neg.value;
      run_vectorised([=]() CIRCLE_LOSS_VECTOR_LOOP {
        for (int64_t i = 0; i < n_rows; ++i) {
          const T* __restrict__ zi = zs + i * n_cols;
          const int32_t yi = x[i];
          T sum_pos = 0, sum_neg = 0;
#pragma omp simd reduction(+ : sum_pos, sum_neg)
          for (int64_t j = 0; j < n_cols; ++j) {
            const bool positive = yi == y[j];
            const T e = inline_exp(shifted_argument(zi[j], positive ? r_pos : r_neg));
            const T e_pos = positive ? e : T(0);
            const T e_neg = positive ? T(0) : e;
            sum_pos += e_pos;
            sum_neg += e_neg;
            col_sum_pos[j] += e_pos;
            col_sum_neg[j] += e_neg;
          }
          row_sum_pos[i] = sum_pos;
          row_sum_neg[i] = sum_neg;
        }
      });
      for (int64_t i = 0; i < n_rows; ++i) {
        row_states[i].positive.merge(r_pos, row_sum_pos[i]);
        row_states[i].negative.merge(r_neg, row_sum_neg[i]);
      }
      for (int64_t j = 0; j < n_cols; ++j) {
        col_states[j].positive.merge(r_pos, col_sum_pos[j]);
        col_states[j].negative.merge(r_neg, col_sum_neg[j]);
      }
      return;
    }
  }
  run_vectorised([=]() CIRCLE_LOSS_VECTOR_LOOP {
    for (int64_t i = 0; i < n_rows; ++i) {
      const T* __restrict__ zi = zs + i * n_cols;
      const int32_t yi = x[i];
      const T m_pos = row_max_pos[i], m_neg = row_max_neg[i];
      T sum_pos = 0, sum_neg = 0;
#pragma omp simd reduction(+ : sum_pos, sum_neg)
      for (int64_t j = 0; j < n_cols; ++j) {
        const bool positive = yi == y[j];
        const T e = inline_exp(shifted_argument(zi[j], positive ? m_pos : m_neg));
        sum_pos += positive ? e : T(0);
        sum_neg += positive ? T(0) : e;
        if constexpr (kColumns) {
          const T c = inline_exp(shifted_argument(zi[j], positive ? col_max_pos[j] : col_max_neg[j]));
          col_sum_pos[j] += positive ? c : T(0);
          col_sum_neg[j] += positive ? T(0) : c;
        }
      }
      row_sum_pos[i] = sum_pos;
      row_sum_neg[i] = sum_neg;
    }
  });
  for (int64_t i = 0; i < n_rows; ++i) {
    row_states[i].positive.merge(row_max_pos[i], row_sum_pos[i]);
    row_states[i].negative.merge(row_max_neg[i], row_sum_neg[i]);
  }
  if constexpr (kColumns) {
    for (int64_t j = 0; j < n_cols; ++j) {
      col_states[j].positive.merge(col_max_pos[j], col_sum_pos[j]);
      col_states[j].negative.merge(col_max_neg[j], col_sum_neg[j]);
    }
  }
}

// What the backward needs of each row, as arrays: its two LSEs and
// g_i·σ(Z_i), 0 for a row whose loss is identically 0 (an empty set).
template <typename T>
struct RowCoefficients {
  std::vector<T> lse_pos, lse_neg, factor;

  explicit RowCoefficients(int64_t n) : lse_pos(n), lse_neg(n), factor(n) {}

  // A row of factor 0 takes LSEs of +inf, so that each exp(z - LSE) of its
  // pairs is 0 without a test in the tile loop: its own LSE may be -inf (an
  // empty set), and z - LSE then +inf, whose exp times 0 would be NaN.
  void set(int64_t i, T lse_positive, T lse_negative, T row_factor) {
    const bool weightless = row_factor == T(0);
    lse_pos[i] = weightless ? std::numeric_limits<T>::infinity() : lse_positive;
    lse_neg[i] = weightless ? std::numeric_limits<T>::infinity() : lse_negative;
    factor[i] = row_factor;
  }

  // The rows from `first` on, as the pointers a tile reads.
  struct View {
    const T* lse_pos;
    const T* lse_neg;
    const T* factor;
  };
  View from(int64_t first) const { return {lse_pos.data() + first, lse_neg.data() + first, factor.data() + first}; }
};

// For W_ij + W_ji from one exp an entry: per set a shift R, the largest LSE
// of the tile's rows and columns that carry weight, and each one's
// factor·exp(R - LSE), so that factor·exp(z - LSE) = exp(z - R)·that. It
// fits where every such LSE is finite and within kSharedShiftSpan of R, so
// that what exp(z - R) loses under its floor is negligible. A pair whose
// row and column both carry no weight (factor 0) gets scale 0.
template <typename T>
struct SharedWeightScales {
  using View = typename RowCoefficients<T>::View;
  std::array<T, 2> shift{-std::numeric_limits<T>::infinity(), -std::numeric_limits<T>::infinity()}; // (P, N)
  std::vector<T> row_pos, row_neg, col_pos, col_neg;
  bool fits = true;

  SharedWeightScales(const View& rows, int64_t n_rows, const View& cols, int64_t n_cols)
      : row_pos(n_rows), row_neg(n_rows), col_pos(n_cols), col_neg(n_cols) {
    take_shifts(rows, n_rows);
    take_shifts(cols, n_cols);
    scale(rows, n_rows, row_pos.data(), row_neg.data());
    scale(cols, n_cols, col_pos.data(), col_neg.data());
  }

 private:
  void take_shifts(const View& v, int64_t n) {
    for (int64_t k = 0; k < n; ++k) {
      if (v.factor[k] == T(0)) continue;
      fits = fits && std::isfinite(v.lse_pos[k]) && std::isfinite(v.lse_neg[k]);
      shift[0] = std::max(shift[0], v.lse_pos[k]);
      shift[1] = std::max(shift[1], v.lse_neg[k]);
    }
  }

  void scale(const View& v, int64_t n, T* pos, T* neg) {
    for (int64_t k = 0; k < n; ++k) {
      const bool weighted = v.factor[k] != T(0);
      fits = fits && (!weighted || (shift[0] - v.lse_pos[k] <= kSharedShiftSpan<T> &&
                                    shift[1] - v.lse_neg[k] <= kSharedShiftSpan<T>));
      pos[k] = weighted ? v.factor[k] * std::exp(shift[0] - v.lse_pos[k]) : T(0);
      neg[k] = weighted ? v.factor[k] * std::exp(shift[1] - v.lse_neg[k]) : T(0);
    }
  }
};

// The tile of weights W_ij (with col_view: W_ij + W_ji) for rows × cols,
// made in place from the tile of S in one pass; the left-out pairs get 0.
template <typename T>
at::Tensor tile_weights(
    at::Tensor weights, // (R, C), contiguous: S on entry, W on return
    const int32_t* row_ids, // (R,)
    const typename RowCoefficients<T>::View& row_view,
    const int32_t* col_ids, // (C,)
    const typename RowCoefficients<T>::View* col_view, // or null
    const PairLogit<T>& logit,
    const LeftOutPairs& left_out,
    TileOrigin origin) {
  const int64_t n_rows = weights.size(0), n_cols = weights.size(1);
  T* ws = weights.data_ptr<T>();
  const int32_t* __restrict__ x = row_ids;
  const int32_t* __restrict__ y = col_ids;
  const std::optional<SharedWeightScales<T>> shared =
      col_view == nullptr ? std::nullopt : std::make_optional<SharedWeightScales<T>>(row_view, n_rows, *col_view, n_cols);
  if (shared && shared->fits) {
    const T shift_pos = shared->shift[0], shift_neg = shared->shift[1];
    const T* __restrict__ row_pos = shared->row_pos.data();
    const T* __restrict__ row_neg = shared->row_neg.data();
    const T* __restrict__ col_pos = shared->col_pos.data();
    const T* __restrict__ col_neg = shared->col_neg.data();
    run_vectorised([=]() CIRCLE_LOSS_VECTOR_LOOP {
      for (int64_t i = 0; i < n_rows; ++i) {
        T* __restrict__ wi = ws + i * n_cols;
        const int32_t yi = x[i];
        const T scale_pos = row_pos[i], scale_neg = row_neg[i];
#pragma omp simd
        for (int64_t j = 0; j < n_cols; ++j) {
          const bool positive = yi == y[j];
          T slope;
          const T z = logit(wi[j], positive, &slope);
          const T e = inline_exp(z - (positive ? shift_pos : shift_neg));
          const T scale = positive ? scale_pos + col_pos[j] : scale_neg + col_neg[j];
          // A weightless pair's z may lie past R (a set without weight has
          // R = -inf): 0, not inf·0. Elsewhere z ≤ its LSE ≤ R.
          wi[j] = scale == T(0) ? T(0) : e * scale * slope;
        }
      }
    });
  } else if (shared) {
    const T* __restrict__ col_pos = col_view->lse_pos;
    const T* __restrict__ col_neg = col_view->lse_neg;
    const T* __restrict__ col_factor = col_view->factor;
    run_vectorised([=]() CIRCLE_LOSS_VECTOR_LOOP {
      for (int64_t i = 0; i < n_rows; ++i) {
        T* __restrict__ wi = ws + i * n_cols;
        const int32_t yi = x[i];
        const T row_pos = row_view.lse_pos[i], row_neg = row_view.lse_neg[i], row_factor = row_view.factor[i];
#pragma omp simd
        for (int64_t j = 0; j < n_cols; ++j) {
          const bool positive = yi == y[j];
          T slope;
          const T z = logit(wi[j], positive, &slope);
          const T by_row = inline_exp(z - (positive ? row_pos : row_neg));
          const T by_col = inline_exp(z - (positive ? col_pos[j] : col_neg[j]));
          // A weightless side contributes 0, not 0·exp(inf - inf) = NaN
          // where an overflowing logit meets its LSE of +inf.
          wi[j] = ((row_factor == T(0) ? T(0) : row_factor * by_row) +
                   (col_factor[j] == T(0) ? T(0) : col_factor[j] * by_col)) * slope;
        }
      }
    });
  } else {
    run_vectorised([=]() CIRCLE_LOSS_VECTOR_LOOP {
      for (int64_t i = 0; i < n_rows; ++i) {
        T* __restrict__ wi = ws + i * n_cols;
        const int32_t yi = x[i];
        const T row_pos = row_view.lse_pos[i], row_neg = row_view.lse_neg[i], row_factor = row_view.factor[i];
        if (row_factor == T(0)) { // 0, not 0·exp(inf - inf) where a logit overflows
          std::fill(wi, wi + n_cols, T(0));
          continue;
        }
#pragma omp simd
        for (int64_t j = 0; j < n_cols; ++j) {
          const bool positive = yi == y[j];
          T slope;
          const T z = logit(wi[j], positive, &slope);
          wi[j] = row_factor * inline_exp(z - (positive ? row_pos : row_neg)) * slope;
        }
      }
    });
  }
  left_out.for_each_in(origin.row0, n_rows, origin.col0, n_cols, [&](int64_t r, int64_t c) {
    weights.data_ptr<T>()[r * n_cols + c] = T(0);
  });
  return weights;
}

// Block b's tile of S on the diagonal, as diagonal_tiles holds it.
at::Tensor diagonal_tile_of(const at::Tensor& diagonal_tiles, int64_t b) {
  const at::Tensor rows = block_of(diagonal_tiles, b);
  return rows.narrow(1, 0, rows.size(0));
}

// With diagonal_tiles defined ((B, kTile)), S's tiles on the diagonal are
// copied there before they become logits.
template <typename T>
RowStates row_states_symmetric(
    const at::Tensor& f,
    const int32_t* ids,
    const PairLogit<T>& logit,
    const LeftOutPairs& left_out,
    const at::Tensor& diagonal_tiles) {
  const int64_t batch = f.size(0);
  RowStates by_row(batch), by_col(batch);
  for_each_symmetric_round(at::divup(batch, kTile), [&](int64_t round, int64_t bi, int64_t bj) {
    at::Tensor similarities = similarity_tile(block_of(f, bi), block_of(f, bj));
    if (round == 0 && diagonal_tiles.defined()) {
      diagonal_tile_of(diagonal_tiles, bi).copy_(similarities);
    }
    const PairTile<T> tile(
        std::move(similarities), ids + bi * kTile, ids + bj * kTile, logit, left_out, {bi * kTile, bj * kTile});
    if (round == 0) {
      merge_tile_states</*kColumns=*/false>(tile, by_row.data() + bi * kTile, nullptr);
    } else {
      merge_tile_states</*kColumns=*/true>(tile, by_row.data() + bi * kTile, by_col.data() + bj * kTile);
    }
  });
  for (int64_t i = 0; i < batch; ++i) {
    by_row[i].merge(by_col[i]);
  }
  return by_row;
}

template <typename T>
RowStates row_states_against(
    const at::Tensor& q,
    const int32_t* q_ids,
    const at::Tensor& r,
    const int32_t* r_ids,
    const PairLogit<T>& logit,
    const LeftOutPairs& left_out) {
  const int64_t batch = q.size(0);
  const ColumnGroups split = ColumnGroups::for_states(batch, r.size(0));
  std::vector<RowStates> shares(split.groups, RowStates(batch));
  for_each_task(split.row_blocks * split.groups, [&](int64_t t) {
    const int64_t bi = t / split.groups, g = t % split.groups;
    for (int64_t bj = split.first(g); bj < split.first(g + 1); ++bj) {
      const PairTile<T> tile(
          similarity_tile(block_of(q, bi), block_of(r, bj)), q_ids + bi * kTile, r_ids + bj * kTile, logit, left_out,
          {bi * kTile, bj * kTile});
      merge_tile_states</*kColumns=*/false>(tile, shares[g].data() + bi * kTile, nullptr);
    }
  });
  for (int64_t g = 1; g < split.groups; ++g) {
    for (int64_t i = 0; i < batch; ++i) shares[0][i].merge(shares[g][i]);
  }
  return std::move(shares[0]);
}

// The op's inputs in the compute dtype, and labels as shared class ids.
struct AnchorInputs {
  at::Tensor q; // (B, D)
  at::Tensor r; // (M, D): q itself without a reference set
  at::Tensor q_ids; // (B,) int32
  at::Tensor r_ids; // (M,) int32
  at::Tensor left_out_columns; // (B,) int64, or undefined: each row's pair in no set
  bool self; // no reference set: the pairs (i, j), j != i, of q

  LeftOutPairs left_out() const {
    return {left_out_columns.defined() ? left_out_columns.data_ptr<int64_t>() : nullptr};
  }
};

AnchorInputs prepare_anchor_inputs(const AnchorArgs& args) {
  const auto& [features, labels, ref_features, ref_labels, margin, gamma, ref_self_index] = args;
  AnchorInputs in;
  in.self = !is_given(ref_features);
  in.q = features.to(compute_dtype(features)).contiguous();
  if (in.self) {
    in.r = in.q;
    in.q_ids = in.r_ids = class_ids({labels})[0];
    in.left_out_columns = at::arange(features.size(0), labels.options().dtype(at::kLong));
  } else {
    in.r = ref_features->to(compute_dtype(features)).contiguous();
    const auto ids = class_ids({labels, *ref_labels});
    in.q_ids = ids[0];
    in.r_ids = ids[1];
    in.left_out_columns = left_out_columns(ref_self_index);
  }
  return in;
}

// (losses (B,) in features' dtype, row_lse (B, 2) and diagonal_tiles
// ((B, kTile) if kept, else (0, kTile)) in the compute dtype).
std::tuple<at::Tensor, at::Tensor, at::Tensor> anchor_losses(
    const AnchorInputs& in,
    const at::Tensor& features,
    double margin,
    double gamma,
    bool keep_diagonal_tiles) {
  const int64_t batch = features.size(0);
  at::Tensor losses = at::empty({batch}, features.options());
  at::Tensor row_lse = at::empty({batch, 2}, in.q.options());
  const bool keep = keep_diagonal_tiles && in.self;
  at::Tensor diagonal_tiles = at::empty({keep ? batch : 0, kTile}, in.q.options());
  if (keep && batch % kTile != 0) {
    // The short last block leaves the rest of its rows unwritten.
    block_of(diagonal_tiles, batch / kTile).narrow(1, batch % kTile, kTile - batch % kTile).zero_();
  }
  AT_DISPATCH_FLOATING_TYPES(in.q.scalar_type(), "circle_anchor_loss_cpu", [&] {
    const PairLogit<scalar_t> logit = pair_logit<scalar_t>(margin, gamma);
    const int32_t* q_ids = in.q_ids.data_ptr<int32_t>();
    const RowStates states = in.self
        ? row_states_symmetric<scalar_t>(in.q, q_ids, logit, in.left_out(), keep ? diagonal_tiles : at::Tensor())
        : row_states_against<scalar_t>(in.q, q_ids, in.r, in.r_ids.data_ptr<int32_t>(), logit, in.left_out());
    scalar_t* lse = row_lse.data_ptr<scalar_t>();
    std::vector<double> values(batch);
    for (int64_t i = 0; i < batch; ++i) {
      const double lse_positive = states[i].positive.lse();
      const double lse_negative = states[i].negative.lse();
      lse[2 * i] = static_cast<scalar_t>(lse_positive);
      lse[2 * i + 1] = static_cast<scalar_t>(lse_negative);
      values[i] = anchor_row_loss(lse_positive, lse_negative);
    }
    store_rounded(values.data(), losses);
  });
  return {losses, row_lse, diagonal_tiles};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> anchor_loss_forward_cpu(
    const AnchorArgs& args, bool keep_diagonal_tiles) {
  const NoAutocast no_autocast;
  return anchor_losses(prepare_anchor_inputs(args), args.features, args.margin, args.gamma, keep_diagonal_tiles);
}

// (dQ (B, D), dR (M, D) if ref_grad, else (0, D)) in the compute dtype, for
// the incoming gradient grad_losses (B,). diagonal_tiles: the forward's
// (B, kTile), or undefined: the diagonal tiles of S are then formed again.
std::tuple<at::Tensor, at::Tensor> anchor_gradients(
    const AnchorInputs& in,
    const at::Tensor& grad_losses,
    const at::Tensor& row_lse,
    double margin,
    double gamma,
    bool ref_grad,
    const at::Tensor& diagonal_tiles) {
  const int64_t batch = in.q.size(0);
  ref_grad = ref_grad && !in.self;
  // Without a reference set every block's first term is written, not added.
  at::Tensor grad_q = in.self ? at::empty_like(in.q) : at::zeros_like(in.q);
  at::Tensor grad_r = ref_grad ? at::zeros_like(in.r) : at::empty({0, in.q.size(1)}, in.q.options());
  AT_DISPATCH_FLOATING_TYPES(in.q.scalar_type(), "circle_anchor_loss_backward_cpu", [&] {
    using T = scalar_t;
    const PairLogit<T> logit = pair_logit<T>(margin, gamma);
    const at::Tensor g = grad_losses.to(in.q.scalar_type()).contiguous();
    const at::Tensor lse = row_lse.contiguous();
    RowCoefficients<T> coefficients(batch);
    for (int64_t i = 0; i < batch; ++i) {
      const T lse_positive = lse.data_ptr<T>()[2 * i];
      const T lse_negative = lse.data_ptr<T>()[2 * i + 1];
      coefficients.set(i, lse_positive, lse_negative, g.data_ptr<T>()[i] * anchor_row_grad_scale(lse_positive, lse_negative));
    }
    const int32_t* q_ids = in.q_ids.data_ptr<int32_t>();
    if (in.self) {
      // Round r's tiles of C, by row block, kept for the round's column phase.
      const int64_t blocks = at::divup(batch, kTile);
      std::vector<at::Tensor> round_tiles(blocks);
      for_each_symmetric_round(
          blocks,
          [&](int64_t round, int64_t bi, int64_t bj) {
            const at::Tensor cols = block_of(in.q, bj);
            const auto col_view = coefficients.from(bj * kTile);
            at::Tensor similarities;
            if (round == 0 && diagonal_tiles.defined()) {
              const at::Tensor kept = diagonal_tile_of(diagonal_tiles, bi); // the saved input: copied, not overwritten
              similarities = at::empty(kept.sizes(), kept.options()).copy_(kept);
            } else {
              similarities = similarity_tile(block_of(in.q, bi), cols);
            }
            at::Tensor c = tile_weights<T>(
                std::move(similarities), q_ids + bi * kTile, coefficients.from(bi * kTile), q_ids + bj * kTile,
                &col_view, logit, in.left_out(), {bi * kTile, bj * kTile});
            at::Tensor rows_grad = block_of(grad_q, bi);
            if (round == 0) {
              at::mm_out(rows_grad, c, cols); // the diagonal tile: the block's first term
            } else {
              rows_grad.addmm_(c, cols);
              round_tiles[bi] = std::move(c);
            }
          },
          [&](int64_t, int64_t bi, int64_t bj) {
            block_of(grad_q, bj).addmm_(round_tiles[bi].t(), block_of(in.q, bi));
            round_tiles[bi].reset();
          });
    } else {
      const int32_t* r_ids = in.r_ids.data_ptr<int32_t>();
      const auto weights = [&](int64_t bi, int64_t bj) {
        return tile_weights<T>(
            similarity_tile(block_of(in.q, bi), block_of(in.r, bj)), q_ids + bi * kTile, coefficients.from(bi * kTile),
            r_ids + bj * kTile, nullptr, logit, in.left_out(), {bi * kTile, bj * kTile});
      };
      const ColumnGroups split = ColumnGroups::for_gradient(batch, in.r.size(0));
      if (split.groups > 1 && split.groups >= split.row_blocks) {
        // dR's blocks are each share's own; dQ is summed share by share.
        const at::Tensor shares = at::zeros({split.groups - 1, batch, in.q.size(1)}, in.q.options());
        for_each_task(split.groups, [&](int64_t g) {
          at::Tensor grad_q_share = g == 0 ? grad_q : shares[g - 1];
          for (int64_t bj = split.first(g); bj < split.first(g + 1); ++bj) {
            for (int64_t bi = 0; bi < split.row_blocks; ++bi) {
              const at::Tensor w = weights(bi, bj);
              block_of(grad_q_share, bi).addmm_(w, block_of(in.r, bj));
              if (ref_grad) block_of(grad_r, bj).addmm_(w.t(), block_of(in.q, bi));
            }
          }
        });
        for (int64_t g = 1; g < split.groups; ++g) grad_q.add_(shares[g - 1]);
      } else {
        // dQ by row blocks, then dR by column blocks, each walking the other
        // in order: every accumulator has one owner, at the price of forming
        // the tiles of W twice (once, when dR is not wanted).
        for_each_task(split.row_blocks, [&](int64_t bi) {
          for (int64_t bj = 0; bj < split.col_blocks; ++bj) {
            block_of(grad_q, bi).addmm_(weights(bi, bj), block_of(in.r, bj));
          }
        });
        if (ref_grad) {
          for_each_task(split.col_blocks, [&](int64_t bj) {
            for (int64_t bi = 0; bi < split.row_blocks; ++bi) {
              block_of(grad_r, bj).addmm_(weights(bi, bj).t(), block_of(in.q, bi));
            }
          });
        }
      }
    }
  });
  return {grad_q, grad_r};
}

std::tuple<at::Tensor, at::Tensor> anchor_loss_backward_cpu(
    const at::Tensor& grad_losses, const AnchorArgs& args, const at::Tensor& row_lse, bool ref_grad,
    const std::optional<at::Tensor>& diagonal_tiles) {
  const NoAutocast no_autocast;
  const auto [grad_q, grad_r] = anchor_gradients(
      prepare_anchor_inputs(args), grad_losses, row_lse, args.margin, args.gamma, ref_grad,
      is_given(diagonal_tiles) ? *diagonal_tiles : at::Tensor());
  const at::ScalarType dtype = args.features.scalar_type();
  return {grad_q.to(dtype), grad_r.to(dtype)};
}

// Row i of dL/dQ is dL_i/dq_i (the references are another set): the
// gradient for an incoming gradient of ones. The tiles of S are formed twice,
// as forward and backward would; the backward is then a rescale.
std::tuple<at::Tensor, at::Tensor> anchor_loss_with_row_grads_cpu(const AnchorArgs& args) {
  const NoAutocast no_autocast;
  const AnchorInputs in = prepare_anchor_inputs(args);
  const auto forward = anchor_losses(in, args.features, args.margin, args.gamma, /*keep_diagonal_tiles=*/false);
  const at::Tensor ones = at::ones({args.features.size(0)}, in.q.options());
  const at::Tensor& row_lse = std::get<1>(forward);
  return {std::get<0>(forward),
          std::get<0>(anchor_gradients(in, ones, row_lse, args.margin, args.gamma, /*ref_grad=*/false, at::Tensor()))};
}

} // namespace

TORCH_LIBRARY_IMPL(circle, CPU, m) {
  register_anchor_kernels<anchor_loss_forward_cpu, anchor_loss_backward_cpu, anchor_loss_with_row_grads_cpu>(m);
}

} // namespace circle_loss
