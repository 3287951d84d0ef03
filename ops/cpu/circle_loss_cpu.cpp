// CPU kernels of circle::loss.
//
// Two passes over tiles of S = F Fᵀ, never holding more than one tile per task:
//   1. log-sum-exp statistics of each pair set. S is symmetric, so only tiles
//      on or above the diagonal are computed and off-diagonal ones count twice.
//   2. (only when a gradient is wanted) dloss/dF = 2·sigmoid(Z)·G F over the
//      same tiles, each adding to the rows and the columns it covers, with
//      the exact softmax weights exp(z - LSE) that pass 1 made known: no
//      running rescale is needed and every weight is <= 1.
// 2·B²·D multiply-adds for loss and gradient (the eager reference: 3·B²·D and
// a dozen passes over B×B matrices), B²·D/2 for the loss alone. Tiles are
// fixed by the shapes alone, each is computed by one thread with ATen's
// single-threaded GEMM, and partial results combine in a fixed order, so the
// result is bitwise the same for any thread count.
#include "tiles.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <vector>

namespace circle_loss {
namespace {

using namespace cpu;

// Log-sum-exp statistics (positive, negative) of one tile rows × colsᵀ.
// Maxima and sums run per column, so that every inner loop is elementwise
// over j (a running scalar would chain each step to the last and defeat
// vectorisation); the columns are folded together at the end, in order.
template <typename T>
PairStates<double> tile_lse(
    const at::Tensor& rows, // (R, D)
    const int32_t* row_labels, // (R,)
    const at::Tensor& cols, // (C, D)
    const int32_t* col_labels, // (C,)
    const PairLogit<T>& logit,
    double multiplicity) {
  const int64_t n_rows = rows.size(0);
  const int64_t n_cols = cols.size(0);
  at::Tensor z = similarity_tile(rows, cols);
  T* zs = z.data_ptr<T>();
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  std::vector<T> col_max_pos_v(n_cols, kNegInf);
  std::vector<T> col_max_neg_v(n_cols, kNegInf);
  T* __restrict__ col_max_pos = col_max_pos_v.data();
  T* __restrict__ col_max_neg = col_max_neg_v.data();
  const PairLogit<T> pair = logit; // a local copy: its fields then stay in registers
  const int32_t* __restrict__ y = col_labels;
  for (int64_t i = 0; i < n_rows; ++i) {
    T* __restrict__ zi = zs + i * n_cols;
    const int32_t yi = row_labels[i];
    for (int64_t j = 0; j < n_cols; ++j) {
      const bool positive = yi == y[j];
      T slope;
      const T v = pair(zi[j], positive, &slope);
      zi[j] = v;
      const T v_pos = positive ? v : kNegInf;
      const T v_neg = positive ? kNegInf : v;
      const T max_pos = col_max_pos[j], max_neg = col_max_neg[j];
      col_max_pos[j] = tile_max(v_pos, max_pos);
      col_max_neg[j] = tile_max(v_neg, max_neg);
    }
  }
  auto fold_max = [](const std::vector<T>& v) {
    T m = -std::numeric_limits<T>::infinity();
    for (T x : v) {
      m = tile_max(x, m);
    }
    return m;
  };
  const T max_pos = fold_max(col_max_pos_v);
  const T max_neg = fold_max(col_max_neg_v);
  for (int64_t i = 0; i < n_rows; ++i) {
    T* __restrict__ zi = zs + i * n_cols;
    const int32_t yi = row_labels[i];
    for (int64_t j = 0; j < n_cols; ++j) {
      // As max_ratio: a logit equal to its set's max gives exp(0), infinite ones too.
      const T m = yi == col_labels[j] ? max_pos : max_neg;
      zi[j] = zi[j] == m ? T(0) : exp_argument(zi[j] - m);
    }
  }
  z.exp_(); // ATen's vectorised exp, single-threaded inside a parallel region
  std::vector<T> col_sum_pos_v(n_cols, T(0));
  std::vector<T> col_sum_neg_v(n_cols, T(0));
  T* __restrict__ col_sum_pos = col_sum_pos_v.data();
  T* __restrict__ col_sum_neg = col_sum_neg_v.data();
  for (int64_t i = 0; i < n_rows; ++i) {
    const T* __restrict__ zi = zs + i * n_cols;
    const int32_t yi = row_labels[i];
    for (int64_t j = 0; j < n_cols; ++j) {
      const bool positive = yi == col_labels[j];
      col_sum_pos[j] += positive ? zi[j] : T(0);
      col_sum_neg[j] += positive ? T(0) : zi[j];
    }
  }
  double sum_pos = 0.0;
  double sum_neg = 0.0;
  for (int64_t j = 0; j < n_cols; ++j) {
    sum_pos += col_sum_pos[j];
    sum_neg += col_sum_neg[j];
  }
  PairStates<double> out;
  out.positive.merge(max_pos, sum_pos * multiplicity);
  out.negative.merge(max_neg, sum_neg * multiplicity);
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
    partial[t] = tile_lse<T>(
        rows.narrow(0, r0, std::min(kTile, n_rows - r0)), row_labels + r0,
        cols.narrow(0, c0, std::min(kTile, n_cols - c0)), col_labels + c0,
        logit, (symmetric && bi != bj) ? 2.0 : 1.0);
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
  at::Tensor weights = similarity_tile(rows, cols); // S, then exp(z - LSE), then G
  at::Tensor slopes = at::empty_like(weights);
  T* __restrict__ ws = weights.data_ptr<T>();
  T* __restrict__ cs = slopes.data_ptr<T>();
  const PairLogit<T> pair = logit;
  const int32_t* __restrict__ y = col_labels;
  for (int64_t i = 0; i < n_rows; ++i) {
    T* __restrict__ wi = ws + i * n_cols;
    T* __restrict__ ci = cs + i * n_cols;
    const int32_t yi = row_labels[i];
    for (int64_t j = 0; j < n_cols; ++j) {
      const bool positive = yi == y[j];
      T slope;
      wi[j] = exp_argument(pair(wi[j], positive, &slope) - (positive ? lse_pos : lse_neg));
      ci[j] = slope;
    }
  }
  weights.exp_();
  for (int64_t k = 0; k < n_rows * n_cols; ++k) {
    ws[k] *= scale * cs[k];
  }
  return weights;
}

// dloss/dF = 2 G F with G symmetric, from tiles on and above the diagonal:
// tile {I, J} adds G_IJ F_J to rows I and G_IJᵀ F_I to rows J, in the rounds
// of for_each_symmetric_round, so that no two threads share an accumulator.
template <typename T>
at::Tensor symmetric_gradient(
    const at::Tensor& features, // (B, D)
    const int32_t* labels, // (B,)
    const PairLogit<T>& logit,
    const LossScalars& scalars) {
  const int64_t batch = features.size(0);
  at::Tensor by_row = at::zeros_like(features);
  if (scalars.grad_scale == 0.0) {
    return by_row; // no negative pair (docs/math.md, "Numerical policy"): loss 0, gradient 0
  }
  at::Tensor by_col = at::zeros_like(features);
  for_each_symmetric_round(at::divup(batch, kTile), [&](int64_t round, int64_t bi, int64_t bj) {
    const at::Tensor rows = block_of(features, bi);
    const at::Tensor cols = block_of(features, bj);
    const at::Tensor g = tile_gradient_weights<T>(rows, labels + bi * kTile, cols, labels + bj * kTile, logit, scalars);
    block_of(by_row, bi).addmm_(g, cols);
    if (round != 0) {
      block_of(by_col, bj).addmm_(g.t(), rows);
    }
  });
  return by_row.add_(by_col);
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
std::tuple<at::Tensor, at::Tensor> loss_and_grad_cpu(
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    double margin,
    double gamma,
    bool with_grad) {
  check_inputs(features, labels, margin, gamma);
  const NoAutocast no_autocast;
  const at::Tensor f = features.to(compute_dtype(features)).contiguous();
  const at::Tensor ids = class_ids({labels})[0];
  double loss = 0.0;
  at::Tensor grad;
  AT_DISPATCH_FLOATING_TYPES(f.scalar_type(), "circle_loss_cpu", [&] {
    const int32_t* y = ids.data_ptr<int32_t>();
    const auto logit = pair_logit<scalar_t>(margin, gamma);
    const auto lse = lse_over_tiles<scalar_t>(f, y, f, y, logit, true);
    const LossScalars scalars = finish_loss(lse.positive.lse(), lse.negative.lse());
    loss = scalars.loss;
    if (with_grad) grad = symmetric_gradient<scalar_t>(f, y, logit, scalars).to(features.scalar_type());
  });
  return {loss_tensor(loss, features), grad};
}

at::Tensor loss_cpu(const at::Tensor& features, const at::Tensor& labels, double margin, double gamma) {
  return std::get<0>(loss_and_grad_cpu(features, labels, margin, gamma, /*with_grad=*/false));
}

std::tuple<at::Tensor, at::Tensor> loss_with_grad_cpu(
    const at::Tensor& features,
    const at::Tensor& labels,
    double margin,
    double gamma) {
  return loss_and_grad_cpu(features, labels, margin, gamma, /*with_grad=*/true);
}

at::Tensor lse_partials_cpu(
    const at::Tensor& rows, // (R, D)
    const at::Tensor& row_labels, // (R,)
    const at::Tensor& cols, // (C, D)
    const at::Tensor& col_labels, // (C,)
    double margin,
    double gamma) {
  check_block_inputs(rows, row_labels, cols, col_labels, margin, gamma);
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

at::Tensor block_grad_cpu(
    const at::Tensor& rows, // (R, D)
    const at::Tensor& row_labels, // (R,)
    const at::Tensor& cols, // (C, D)
    const at::Tensor& col_labels, // (C,)
    const at::Tensor& scalars, // (4,)
    double margin,
    double gamma) {
  check_block_inputs(rows, row_labels, cols, col_labels, margin, gamma);
  const NoAutocast no_autocast;
  check_scalars(scalars, rows.device());
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
  m.impl("loss", &loss_cpu);
  m.impl("_loss_with_grad", &loss_with_grad_cpu);
  m.impl("_lse_partials", &lse_partials_cpu);
  m.impl("_lse_finish", &lse_finish_cpu);
  m.impl("_block_grad", &block_grad_cpu);
}

} // namespace circle_loss
