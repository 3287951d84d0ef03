// CPU kernels of circle::loss.
//
// Tiles of S = F Fᵀ over the rows in class order, never more than one tile
// per task. S is symmetric, so only tiles on or above the diagonal are formed
// and off-diagonal ones count twice.
//   loss      each tile's log-sum-exp statistics of both pair sets, folded
//             in tile order.
//   gradient  (when wanted) the same statistics from the same tiles, so the
//             loss keeps its bits, and in the same visit each tile's weights
//             exp(z - m)·c against its own maxima m: negative ones multiply
//             the tile's features whole, positive ones only the blocks of the
//             classes its rows and columns share (class order makes them
//             contiguous). The products are summed at a running scale per
//             block and brought to the exact LSEs at the end (docs/math.md,
//             "Online rescaling"), so S is formed once.
// B²·D/2 multiply-adds for the loss, B²·D·(3/2 + Σ n_c²/B²) for loss and
// gradient (n_c: the class sizes; the eager reference: 3·B²·D and a dozen
// passes over B×B matrices). Tiles are fixed by the shapes and labels alone,
// each is computed by one thread with ATen's single-threaded GEMM, and
// partial results combine in a fixed order, so the result is bitwise the
// same for any thread count.
#include "tiles.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace circle_loss {
namespace {

using namespace cpu;

// One tile rows × colsᵀ of pairs: its log-sum-exp statistics (positive,
// negative) and, with kWeights, every pair's weight exp(z - m)·dz/ds against
// its set's maximum m in this tile, split by set, from which the gradient
// sums are made. Maxima and sums run per column, so that every inner loop is
// elementwise over j (a running scalar would chain each step to the last and
// defeat vectorisation); the columns are folded together at the end, in
// order. The statistics do not depend on kWeights, bit for bit.
template <typename T>
struct TilePairs {
  PairStates<double> states;
  T max_pos;
  T max_neg;
  at::Tensor positive_weights; // (R, C), with kWeights: 0 at negative pairs
  at::Tensor negative_weights; // (R, C), with kWeights: 0 at positive pairs
};

template <bool kWeights, typename T>
TilePairs<T> tile_pairs(
    const at::Tensor& rows, // (R, D)
    const int32_t* row_labels, // (R,)
    const at::Tensor& cols, // (C, D)
    const int32_t* col_labels, // (C,)
    const PairLogit<T>& logit,
    double multiplicity) {
  const int64_t n_rows = rows.size(0);
  const int64_t n_cols = cols.size(0);
  TilePairs<T> out;
  at::Tensor z = similarity_tile(rows, cols); // S, then z, then the positive weights
  at::Tensor slopes = kWeights ? at::empty_like(z) : at::Tensor(); // then the negative weights
  T* zs = z.data_ptr<T>();
  T* cs = kWeights ? slopes.data_ptr<T>() : nullptr;
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  std::vector<T> col_max_pos_v(n_cols, kNegInf);
  std::vector<T> col_max_neg_v(n_cols, kNegInf);
  std::vector<T> col_sum_pos_v(n_cols, T(0));
  std::vector<T> col_sum_neg_v(n_cols, T(0));
  T* __restrict__ col_max_pos = col_max_pos_v.data();
  T* __restrict__ col_max_neg = col_max_neg_v.data();
  T* __restrict__ col_sum_pos = col_sum_pos_v.data();
  T* __restrict__ col_sum_neg = col_sum_neg_v.data();
  const int32_t* __restrict__ x = row_labels;
  const int32_t* __restrict__ y = col_labels;
  run_vectorised([=]() CIRCLE_LOSS_VECTOR_LOOP {
    for (int64_t i = 0; i < n_rows; ++i) {
      T* __restrict__ zi = zs + i * n_cols;
      T* __restrict__ ci = kWeights ? cs + i * n_cols : nullptr;
      const int32_t yi = x[i];
#pragma omp simd
      for (int64_t j = 0; j < n_cols; ++j) {
        const bool positive = yi == y[j];
        T slope;
        const T v = logit(zi[j], positive, &slope);
        zi[j] = v;
        if constexpr (kWeights) ci[j] = slope;
        const T v_pos = positive ? v : kNegInf;
        const T v_neg = positive ? kNegInf : v;
        const T old_pos = col_max_pos[j], old_neg = col_max_neg[j];
        col_max_pos[j] = tile_max(v_pos, old_pos);
        col_max_neg[j] = tile_max(v_neg, old_neg);
      }
    }
  });
  T max_pos = kNegInf, max_neg = kNegInf;
  for (int64_t j = 0; j < n_cols; ++j) {
    max_pos = tile_max(col_max_pos[j], max_pos);
    max_neg = tile_max(col_max_neg[j], max_neg);
  }
  run_vectorised([=]() CIRCLE_LOSS_VECTOR_LOOP {
    for (int64_t i = 0; i < n_rows; ++i) {
      T* __restrict__ zi = zs + i * n_cols;
      T* __restrict__ ci = kWeights ? cs + i * n_cols : nullptr;
      const int32_t yi = x[i];
#pragma omp simd
      for (int64_t j = 0; j < n_cols; ++j) {
        const bool positive = yi == y[j];
        // As max_ratio: a logit equal to its set's max gives exp(0), infinite ones too.
        const T m = positive ? max_pos : max_neg;
        const T e = inline_exp(zi[j] == m ? T(0) : zi[j] - m);
        col_sum_pos[j] += positive ? e : T(0);
        col_sum_neg[j] += positive ? T(0) : e;
        if constexpr (kWeights) {
          const T w = e * ci[j];
          zi[j] = positive ? w : T(0);
          ci[j] = positive ? T(0) : w;
        }
      }
    }
  });
  double sum_pos = 0.0;
  double sum_neg = 0.0;
  for (int64_t j = 0; j < n_cols; ++j) {
    sum_pos += col_sum_pos[j];
    sum_neg += col_sum_neg[j];
  }
  out.states.positive.merge(max_pos, sum_pos * multiplicity);
  out.states.negative.merge(max_neg, sum_neg * multiplicity);
  out.max_pos = max_pos;
  out.max_neg = max_neg;
  if constexpr (kWeights) {
    out.positive_weights = z;
    out.negative_weights = slopes;
  }
  return out;
}

// (positive, negative) LSE accumulators of the pairs rows × colsᵀ, from
// tiles fixed by the shapes alone and folded in tile order. With `symmetric`
// (rows and cols are the same tensor) only tiles on and above the diagonal
// are computed, off-diagonal ones counted twice.
template <typename T>
PairStates<double> lse_over_tiles(
    const at::Tensor& rows, // (R, D)
    const int32_t* row_labels, // (R,)
    const at::Tensor& cols, // (C, D)
    const int32_t* col_labels, // (C,)
    const PairLogit<T>& logit,
    bool symmetric) {
  const int64_t n_rows = rows.size(0);
  const int64_t n_cols = cols.size(0);
  std::vector<std::pair<int64_t, int64_t>> tiles;
  for (int64_t bi = 0; bi < at::divup(n_rows, kTile); ++bi) {
    for (int64_t bj = symmetric ? bi : 0; bj < at::divup(n_cols, kTile); ++bj) {
      tiles.emplace_back(bi, bj);
    }
  }
  std::vector<PairStates<double>> partial(tiles.size());
  for_each_task(static_cast<int64_t>(tiles.size()), [&](int64_t t) {
    const auto [bi, bj] = tiles[t];
    const int64_t r0 = bi * kTile;
    const int64_t c0 = bj * kTile;
    partial[t] = tile_pairs</*kWeights=*/false, T>(
        rows.narrow(0, r0, std::min(kTile, n_rows - r0)), row_labels + r0,
        cols.narrow(0, c0, std::min(kTile, n_cols - c0)), col_labels + c0,
        logit, (symmetric && bi != bj) ? 2.0 : 1.0).states;
  });
  PairStates<double> total;
  for (const auto& p : partial) {
    total.merge(p);
  }
  return total;
}

// The tile G = grad_scale · exp(z - LSE_set) · c of dloss/dS (docs/math.md,
// "The global form", with the factor 2 of 2 G F folded into grad_scale).
template <typename T>
at::Tensor tile_gradient_weights(
    const at::Tensor& rows, // (R, D)
    const int32_t* row_labels, // (R,)
    const at::Tensor& cols, // (C, D)
    const int32_t* col_labels, // (C,)
    const PairLogit<T>& logit,
    const LossScalars& scalars) {
  const int64_t n_rows = rows.size(0);
  const int64_t n_cols = cols.size(0);
  const T lse_pos = static_cast<T>(scalars.lse_positive);
  const T lse_neg = static_cast<T>(scalars.lse_negative);
  const T scale = static_cast<T>(scalars.grad_scale);
  at::Tensor weights = similarity_tile(rows, cols); // S, then G
  T* ws = weights.data_ptr<T>();
  const int32_t* __restrict__ x = row_labels;
  const int32_t* __restrict__ y = col_labels;
  run_vectorised([=]() CIRCLE_LOSS_VECTOR_LOOP {
    for (int64_t i = 0; i < n_rows; ++i) {
      T* __restrict__ wi = ws + i * n_cols;
      const int32_t yi = x[i];
#pragma omp simd
      for (int64_t j = 0; j < n_cols; ++j) {
        const bool positive = yi == y[j];
        T slope;
        const T z = logit(wi[j], positive, &slope);
        wi[j] = scale * slope * inline_exp(z - (positive ? lse_pos : lse_neg));
      }
    }
  });
  return weights;
}

// The rows in class order (stable), so that every class is a run of rows
// and the positive pairs of a tile are the blocks of the classes its rows
// and columns share.
struct ClassOrder {
  at::Tensor features; // (B, D), row k = input row order[k]
  at::Tensor ids; // (B,) int32, non-decreasing
  at::Tensor order; // (B,) int64
  std::vector<int64_t> start; // class c is rows [start[c], start[c + 1])
};

// A counting sort of the class ids (dense, from class_ids).
ClassOrder class_order(const at::Tensor& features, const at::Tensor& ids) {
  const int64_t batch = ids.numel();
  const int32_t* id = ids.data_ptr<int32_t>();
  const int64_t classes = batch == 0 ? 0 : int64_t(*std::max_element(id, id + batch)) + 1;
  ClassOrder out;
  out.start.assign(classes + 1, 0);
  for (int64_t i = 0; i < batch; ++i) ++out.start[id[i] + 1];
  for (int64_t c = 0; c < classes; ++c) out.start[c + 1] += out.start[c];
  out.order = at::empty({batch}, ids.options().dtype(at::kLong));
  out.ids = at::empty_like(ids);
  int64_t* order = out.order.data_ptr<int64_t>();
  int32_t* sorted_ids = out.ids.data_ptr<int32_t>();
  std::vector<int64_t> next(out.start.begin(), out.start.end() - 1);
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t k = next[id[i]]++;
    order[k] = i;
    sorted_ids[k] = id[i];
  }
  out.features = features.index_select(0, out.order);
  return out;
}

// Sums of weight · features kept at a scale: acc = Σ exp(m_t - scale)·(W_t F),
// with scale the largest tile maximum m_t added so far (docs/math.md, "Online
// rescaling").
struct ScaledSum {
  at::Tensor acc; // (rows, D), uninitialised until the first add
  double scale = -std::numeric_limits<double>::infinity();

  bool empty() const { return scale == -std::numeric_limits<double>::infinity(); }

  // acc[rows] += exp(m - scale)·(weights · features), rows [row0, row0 + weights.size(0)).
  // The product is formed alone, from operands that are whole tiles or
  // contiguous copies, and added elementwise: handed offset sub-blocks,
  // alpha and beta, MKL's GEMM rounds differently with the thread count on
  // some CPUs, and the result must not depend on it.
  void add(double m, const at::Tensor& weights, const at::Tensor& features, int64_t row0 = 0) {
    const at::Tensor product = at::mm(weights, features);
    if (empty()) {
      acc.zero_();
      scale = m;
    } else if (m > scale) {
      acc.mul_(std::exp(scale - m));
      scale = m;
    }
    acc.narrow(0, row0, product.size(0)).add_(product, std::exp(m - scale));
  }

  // exp(scale - lse): the factor that weights the sum as exp(z - lse) would have.
  double factor_at(double lse) const { return std::exp(scale - lse); }
};

// Groups of consecutive classes no taller than this share one product of
// their positive weights: all-distinct labels then cost a thin band of
// small GEMMs, not one call per row.
constexpr int64_t kPositiveGroup = 64;

// f(r, rows, c, cols) for each block of a tile's positive pairs: tile rows
// [row0, row0 + n_rows) and columns [col0, col0 + n_cols) of class-ordered
// rows, in groups of the classes both share, offsets from the tile's corner.
template <typename F>
void for_each_positive_block(
    const ClassOrder& in, int64_t row0, int64_t n_rows, int64_t col0, int64_t n_cols, const F& f) {
  const int32_t* id = in.ids.data_ptr<int32_t>();
  const int64_t first = std::max(id[row0], id[col0]);
  const int64_t last = std::min(id[row0 + n_rows - 1], id[col0 + n_cols - 1]);
  const auto span = [&](int64_t c, int64_t lo, int64_t n) {
    return std::pair<int64_t, int64_t>{std::max(in.start[c], lo) - lo, std::min(in.start[c + 1], lo + n) - lo};
  };
  for (int64_t c = first; c <= last;) {
    auto [r_begin, r_end] = span(c, row0, n_rows);
    auto [c_begin, c_end] = span(c, col0, n_cols);
    int64_t next = c + 1;
    for (; next <= last; ++next) {
      const auto [r2_begin, r2_end] = span(next, row0, n_rows);
      if (r2_end - r_begin > kPositiveGroup) break;
      r_end = r2_end;
      c_end = span(next, col0, n_cols).second;
    }
    if (r_end > r_begin && c_end > c_begin) f(r_begin, r_end - r_begin, c_begin, c_end - c_begin);
    c = next;
  }
}

// The loss and dloss/dF with S formed once, over class-ordered rows: each
// tile on and above the diagonal gives its LSE partial and, against its own
// maxima, the weights exp(z - m)·c of both sets. Negative weights multiply
// the tile's features whole; positive ones only the blocks of the classes
// the tile's rows and columns share. Tile {I, J} adds to rows I (W F_J) and,
// off the diagonal, to rows J (Wᵀ F_I), into per-block sums kept at their
// own scale (ScaledSum) in the rounds of for_each_symmetric_round; once all
// partials are folded (in lse_over_tiles' order, so that the loss has the
// loss-only path's bits) the sums are brought to the exact LSEs.
template <typename T>
std::pair<double, at::Tensor> loss_and_gradient_once(
    const ClassOrder& in,
    const PairLogit<T>& logit) {
  const at::Tensor& f = in.features;
  const int32_t* ids = in.ids.data_ptr<int32_t>();
  const int64_t batch = f.size(0);
  const int64_t blocks = at::divup(batch, kTile);
  // Per block: negative and positive sums of the rows it holds as a row
  // block and as a column block; one writer each per round.
  enum { kNegRow, kNegCol, kPosRow, kPosCol, kSums };
  // One allocation for the sums: glibc keeps it from call to call, where
  // many smaller ones went back to the OS and were faulted in again.
  at::Tensor workspace = at::empty({kSums, batch, f.size(1)}, f.options());
  std::vector<std::array<ScaledSum, kSums>> sums(blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    for (int k = 0; k < kSums; ++k) sums[b][k].acc = block_of(workspace[k], b);
  }
  std::vector<PairStates<double>> partial(blocks * (blocks + 1) / 2);
  const auto tile_index = [&](int64_t bi, int64_t bj) { return bi * blocks - bi * (bi - 1) / 2 + (bj - bi); };
  for_each_symmetric_round(blocks, [&](int64_t, int64_t a, int64_t b) {
    // Tile {a, b} is formed above the diagonal, rows bi and columns bj, for
    // its partial to have lse_over_tiles' bits; its sums go where the round
    // lets a write its row sums and b its column sums.
    const int64_t bi = std::min(a, b), bj = std::max(a, b);
    const bool diagonal = bi == bj;
    auto& row_sums = sums[bi];
    auto& col_sums = sums[bj];
    const int neg_rows = bi == a ? kNegRow : kNegCol, pos_rows = bi == a ? kPosRow : kPosCol;
    const int neg_cols = bi == a ? kNegCol : kNegRow, pos_cols = bi == a ? kPosCol : kPosRow;
    const at::Tensor rows = block_of(f, bi);
    const at::Tensor cols = block_of(f, bj);
    TilePairs<T> tile = tile_pairs</*kWeights=*/true, T>(
        rows, ids + bi * kTile, cols, ids + bj * kTile, logit, diagonal ? 1.0 : 2.0);
    partial[tile_index(bi, bj)] = tile.states;
    const int64_t n_rows = rows.size(0), n_cols = cols.size(0);
    if (tile.max_neg != -std::numeric_limits<T>::infinity()) {
      row_sums[neg_rows].add(tile.max_neg, tile.negative_weights, cols);
      if (!diagonal) col_sums[neg_cols].add(tile.max_neg, tile.negative_weights.t(), rows);
    }
    if (tile.max_pos != -std::numeric_limits<T>::infinity()) {
      for_each_positive_block(in, bi * kTile, n_rows, bj * kTile, n_cols, [&](int64_t r, int64_t nr, int64_t c, int64_t nc) {
        const at::Tensor w = tile.positive_weights.narrow(0, r, nr).narrow(1, c, nc);
        row_sums[pos_rows].add(tile.max_pos, w.contiguous(), cols.narrow(0, c, nc), r);
        if (!diagonal) col_sums[pos_cols].add(tile.max_pos, w.t().contiguous(), rows.narrow(0, r, nr), c);
      });
    }
  });
  PairStates<double> total;
  for (const auto& p : partial) total.merge(p);
  const LossScalars scalars = finish_loss(total.positive.lse(), total.negative.lse());
  if (scalars.grad_scale == 0.0) {
    return {scalars.loss, at::zeros_like(f)}; // no negative pair (docs/math.md, "Numerical policy"): loss 0, gradient 0
  }
  // Row k of the class order goes to row order[k] of the gradient, made in
  // one pass over the four sums of its block, each at its LSE.
  at::Tensor grad = at::empty_like(f);
  const int64_t dim = f.size(1);
  const std::vector<T> no_sum(dim, T(0)); // stands in for a sum nothing was added to
  const int64_t* order = in.order.data_ptr<int64_t>();
  T* out = grad.data_ptr<T>();
  for_each_task(blocks, [&](int64_t b) {
    std::array<const T*, kSums> acc;
    std::array<int64_t, kSums> stride;
    std::array<T, kSums> weight;
    for (int k = 0; k < kSums; ++k) {
      const ScaledSum& sum = sums[b][k];
      const double lse = (k == kPosRow || k == kPosCol) ? scalars.lse_positive : scalars.lse_negative;
      acc[k] = sum.empty() ? no_sum.data() : sum.acc.template data_ptr<T>();
      stride[k] = sum.empty() ? 0 : dim;
      weight[k] = sum.empty() ? T(0) : static_cast<T>(scalars.grad_scale * sum.factor_at(lse));
    }
    const int64_t row0 = b * kTile, rows = std::min(kTile, batch - row0);
    run_vectorised([=]() CIRCLE_LOSS_VECTOR_LOOP {
      for (int64_t r = 0; r < rows; ++r) {
        T* __restrict__ dst = out + order[row0 + r] * dim;
        const T* __restrict__ a0 = acc[0] + r * stride[0];
        const T* __restrict__ a1 = acc[1] + r * stride[1];
        const T* __restrict__ a2 = acc[2] + r * stride[2];
        const T* __restrict__ a3 = acc[3] + r * stride[3];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) {
          dst[d] = weight[0] * a0[d] + weight[1] * a1[d] + weight[2] * a2[d] + weight[3] * a3[d];
        }
      }
    });
  });
  return {scalars.loss, grad};
}

// Σ_j G_ij cols_j for every row i of a block against another block: each
// task owns a block of rows and adds its column tiles in order.
template <typename T>
at::Tensor block_gradient(
    const at::Tensor& rows, // (R, D)
    const int32_t* row_labels, // (R,)
    const at::Tensor& cols, // (C, D)
    const int32_t* col_labels, // (C,)
    const PairLogit<T>& logit,
    const LossScalars& scalars) {
  const int64_t n_rows = rows.size(0);
  const int64_t n_cols = cols.size(0);
  at::Tensor grad = at::zeros_like(rows);
  if (scalars.grad_scale == 0.0) {
    return grad;
  }
  for_each_task(at::divup(n_rows, kTile), [&](int64_t bi) {
    const int64_t r0 = bi * kTile;
    const int64_t nr = std::min(kTile, n_rows - r0);
    const at::Tensor row_block = rows.narrow(0, r0, nr);
    at::Tensor acc = grad.narrow(0, r0, nr);
    for (int64_t c0 = 0; c0 < n_cols; c0 += kTile) {
      const at::Tensor col_block = cols.narrow(0, c0, std::min(kTile, n_cols - c0));
      acc.addmm_(
          tile_gradient_weights<T>(row_block, row_labels + r0, col_block, col_labels + c0, logit, scalars),
          col_block);
    }
  });
  return grad;
}

// The loss as a 0-dim tensor of the features' dtype.
at::Tensor loss_tensor(double loss, const at::Tensor& features) {
  at::Tensor out = at::empty({}, features.options());
  store_rounded(&loss, out);
  return out;
}

// The loss, and with with_grad dloss/dfeatures (else an undefined tensor):
// the one entry point behind both registered kernels.
std::tuple<at::Tensor, at::Tensor> loss_and_grad_cpu(const LossArgs& args, bool with_grad) {
  const auto& [features, labels, margin, gamma] = args;
  const NoAutocast no_autocast;
  const at::Tensor f = features.to(compute_dtype(features)).contiguous();
  const at::Tensor ids = class_ids({labels})[0];
  const ClassOrder in = class_order(f, ids);
  double loss = 0.0;
  at::Tensor grad;
  AT_DISPATCH_FLOATING_TYPES(f.scalar_type(), "circle_loss_cpu", [&] {
    const auto logit = pair_logit<scalar_t>(margin, gamma);
    if (with_grad) {
      at::Tensor g;
      std::tie(loss, g) = loss_and_gradient_once<scalar_t>(in, logit);
      grad = g.to(features.scalar_type());
    } else {
      const int32_t* y = in.ids.data_ptr<int32_t>();
      const auto lse = lse_over_tiles<scalar_t>(in.features, y, in.features, y, logit, true);
      loss = finish_loss(lse.positive.lse(), lse.negative.lse()).loss;
    }
  });
  return {loss_tensor(loss, features), grad};
}

at::Tensor lse_partials_cpu(const BlockArgs& args) {
  const auto& [rows, row_labels, cols, col_labels, margin, gamma] = args;
  const NoAutocast no_autocast;
  const at::Tensor r = rows.to(compute_dtype(rows)).contiguous();
  const at::Tensor c = cols.to(compute_dtype(cols)).contiguous();
  const auto ids = class_ids({row_labels, col_labels});
  at::Tensor out = at::empty({4}, rows.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES(r.scalar_type(), "circle_lse_partials_cpu", [&] {
    const auto lse = lse_over_tiles<scalar_t>(
        r, ids[0].data_ptr<int32_t>(), c, ids[1].data_ptr<int32_t>(), pair_logit<scalar_t>(margin, gamma), false);
    lse.store_at(out.data_ptr<double>(), 0);
  });
  return out;
}

at::Tensor lse_finish_cpu(const at::Tensor& partials) { // (n, 4)
  check_partials(partials);
  const at::Tensor p = partials.contiguous();
  PairStates<double> total;
  for (int64_t i = 0; i < p.size(0); ++i) {
    total.merge(PairStates<double>::at(p.data_ptr<double>(), i));
  }
  at::Tensor out = at::empty({4}, partials.options());
  finish_loss(total.positive.lse(), total.negative.lse()).store(out.data_ptr<double>());
  return out;
}

at::Tensor block_grad_cpu(const BlockArgs& args, const at::Tensor& scalars) { // scalars: (4,)
  const auto& [rows, row_labels, cols, col_labels, margin, gamma] = args;
  const NoAutocast no_autocast;
  const at::Tensor r = rows.to(compute_dtype(rows)).contiguous();
  const at::Tensor c = cols.to(compute_dtype(cols)).contiguous();
  const auto ids = class_ids({row_labels, col_labels});
  const LossScalars loss_scalars = LossScalars::load(scalars.contiguous().data_ptr<double>());
  at::Tensor grad;
  AT_DISPATCH_FLOATING_TYPES(r.scalar_type(), "circle_block_grad_cpu", [&] {
    grad = block_gradient<scalar_t>(
        r, ids[0].data_ptr<int32_t>(), c, ids[1].data_ptr<int32_t>(),
        pair_logit<scalar_t>(margin, gamma), loss_scalars);
  });
  return grad;
}

} // namespace

TORCH_LIBRARY_IMPL(circle, CPU, m) {
  register_global_kernels<loss_and_grad_cpu, lse_partials_cpu, lse_finish_cpu, block_grad_cpu>(m);
}

} // namespace circle_loss
