// CPU kernels of circle::anchor_loss, the per-anchor form (docs/math.md).
//
// The pairs are visited in tiles of S = Q Rᵀ, one tile per task at a time:
//   forward   each row's (max, Σ exp(z - max)) of both pair sets, then
//             L_i = softplus(LSE_P(i) + LSE_N(i)).
//   backward  W_ij = g_i·σ(Z_i)·exp(z_ij - LSE_set(i))·dz/ds, then
//             dQ = W R and dR = Wᵀ Q.
// Without a reference set S is symmetric and so is the logit (it depends on
// s_ij and on whether the labels match), so only the tiles {I, J} on and
// above the diagonal are formed: in the forward a tile's row reductions feed
// rows I and its column reductions rows J; in the backward the tile
// C = W_IJ + W_JIᵀ, made elementwise from the one tile of S, adds C Q_J to
// rows I and Cᵀ Q_I to rows J. Round r takes the tiles {I, (I + r) mod n},
// so that each accumulator is written by one task per round, in round order:
// the result is bitwise the same for any thread count.
#include "tiles.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <array>
#include <limits>
#include <optional>
#include <vector>

namespace circle_loss {
namespace {

using namespace cpu;

// Each row's LSE states of (positive, negative) pairs.
using RowStates = std::vector<std::array<LseAccumulator, 2>>;

// Which set a pair belongs to: 0 positive, 1 negative, -1 none (the pair
// (i, i) without a reference set).
constexpr int8_t kNoSet = -1;

// A tile of pairs rows × cols with each pair's logit and set. `diagonal`:
// the tile holds pairs (i, i) at column = row (a diagonal tile of the
// symmetric case), which belong to no set.
template <typename T>
struct PairTile {
  at::Tensor logits; // (R, C)
  std::vector<int8_t> set; // (R, C)
  int64_t rows;
  int64_t cols;

  PairTile(
      const at::Tensor& row_features, // (R, D)
      const int32_t* row_ids, // (R,)
      const at::Tensor& col_features, // (C, D)
      const int32_t* col_ids, // (C,)
      const PairLogit<T>& logit,
      bool diagonal)
      : logits(at::mm(row_features, col_features.t())),
        set(row_features.size(0) * col_features.size(0)),
        rows(row_features.size(0)),
        cols(col_features.size(0)) {
    T* z = logits.data_ptr<T>();
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        const bool positive = row_ids[i] == col_ids[j];
        T slope;
        z[i * cols + j] = logit(z[i * cols + j], positive, &slope);
        set[i * cols + j] = diagonal && i == j ? kNoSet : positive ? 0 : 1;
      }
    }
  }
};

// Merges the LSE states of the tile's rows (by_column: of its columns) into
// states[0, R) (states[0, C)). Two passes: the maxima, then the sums of
// exp(z - max) through ATen's vectorised exp.
template <typename T>
void merge_tile_states(const PairTile<T>& tile, bool by_column, std::array<LseAccumulator, 2>* states) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  const int64_t lines = by_column ? tile.cols : tile.rows;
  const T* z = tile.logits.template data_ptr<T>();
  const auto index = [&](int64_t line, int64_t k) { return by_column ? k * tile.cols + line : line * tile.cols + k; };
  const int64_t length = by_column ? tile.rows : tile.cols;
  std::vector<std::array<T, 2>> line_max(lines, {kNegInf, kNegInf});
  for (int64_t line = 0; line < lines; ++line) {
    for (int64_t k = 0; k < length; ++k) {
      const int64_t e = index(line, k);
      if (tile.set[e] != kNoSet) line_max[line][tile.set[e]] = nan_max(line_max[line][tile.set[e]], z[e]);
    }
  }
  at::Tensor shifted = at::empty_like(tile.logits);
  T* d = shifted.data_ptr<T>();
  for (int64_t line = 0; line < lines; ++line) {
    for (int64_t k = 0; k < length; ++k) {
      const int64_t e = index(line, k);
      const T m = tile.set[e] == kNoSet ? kNegInf : line_max[line][tile.set[e]];
      // As max_ratio: a logit equal to its set's max gives exp(0), infinite ones too.
      d[e] = tile.set[e] == kNoSet ? kNegInf : z[e] == m ? T(0) : z[e] - m;
    }
  }
  shifted.exp_();
  for (int64_t line = 0; line < lines; ++line) {
    std::array<double, 2> sum = {0.0, 0.0};
    for (int64_t k = 0; k < length; ++k) {
      const int64_t e = index(line, k);
      if (tile.set[e] != kNoSet) sum[tile.set[e]] += d[e];
    }
    for (int s = 0; s < 2; ++s) states[line][s].merge(line_max[line][s], sum[s]);
  }
}

// What the backward needs of a row: its two LSEs and g_i·σ(Z_i), 0 for a row
// whose loss is identically 0 (an empty set).
template <typename T>
struct RowCoefficients {
  T lse[2];
  T factor;
};

// The tile of weights W_ij (with col_coefficients: W_ij + W_ji) for rows × cols.
template <typename T>
at::Tensor tile_weights(
    const at::Tensor& row_features, // (R, D)
    const int32_t* row_ids, // (R,)
    const RowCoefficients<T>* row_coefficients, // (R,)
    const at::Tensor& col_features, // (C, D)
    const int32_t* col_ids, // (C,)
    const RowCoefficients<T>* col_coefficients, // (C,) or null
    const PairLogit<T>& logit,
    bool diagonal) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  const int64_t rows = row_features.size(0);
  const int64_t cols = col_features.size(0);
  at::Tensor s = at::mm(row_features, col_features.t());
  at::Tensor slopes = at::empty_like(s);
  at::Tensor by_row = at::empty_like(s);
  at::Tensor by_col = col_coefficients != nullptr ? at::empty_like(s) : at::Tensor();
  const T* ss = s.data_ptr<T>();
  T* cs = slopes.data_ptr<T>();
  T* rs = by_row.data_ptr<T>();
  T* ks = col_coefficients != nullptr ? by_col.data_ptr<T>() : nullptr;
  for (int64_t i = 0; i < rows; ++i) {
    const RowCoefficients<T>& ri = row_coefficients[i];
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t e = i * cols + j;
      const bool positive = row_ids[i] == col_ids[j];
      const bool none = diagonal && i == j;
      const T z = logit(ss[e], positive, cs + e);
      const int set = positive ? 0 : 1;
      rs[e] = none || ri.factor == T(0) ? kNegInf : z - ri.lse[set];
      if (ks != nullptr) {
        const RowCoefficients<T>& rj = col_coefficients[j];
        ks[e] = none || rj.factor == T(0) ? kNegInf : z - rj.lse[set];
      }
    }
  }
  by_row.exp_();
  if (ks != nullptr) by_col.exp_();
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t e = i * cols + j;
      T w = row_coefficients[i].factor * rs[e];
      if (ks != nullptr) w += col_coefficients[j].factor * ks[e];
      rs[e] = w * cs[e];
    }
  }
  return by_row;
}

// Rows of block b of a (N, ...) tensor.
at::Tensor block_of(const at::Tensor& t, int64_t b) {
  return t.narrow(0, b * kTile, std::min(kTile, t.size(0) - b * kTile));
}

// The tiles {bi, (bi + round) mod n} of round `round` of the symmetric case.
template <typename Task>
void for_each_symmetric_round(int64_t blocks, const Task& task) {
  for (int64_t round = 0; round <= blocks / 2; ++round) {
    // With an even count the last round meets each pair from both ends.
    const int64_t tiles = (2 * round == blocks) ? blocks / 2 : blocks;
    for_each_task(tiles, [&](int64_t bi) { task(round, bi, (bi + round) % blocks); });
  }
}

template <typename T>
RowStates row_states_symmetric(const at::Tensor& f, const int32_t* ids, const PairLogit<T>& logit) {
  const int64_t batch = f.size(0);
  RowStates by_row(batch), by_col(batch);
  for_each_symmetric_round(at::divup(batch, kTile), [&](int64_t round, int64_t bi, int64_t bj) {
    const PairTile<T> tile(block_of(f, bi), ids + bi * kTile, block_of(f, bj), ids + bj * kTile, logit, round == 0);
    merge_tile_states(tile, /*by_column=*/false, by_row.data() + bi * kTile);
    if (round != 0) merge_tile_states(tile, /*by_column=*/true, by_col.data() + bj * kTile);
  });
  for (int64_t i = 0; i < batch; ++i) {
    for (int s = 0; s < 2; ++s) by_row[i][s].merge(by_col[i][s].max, by_col[i][s].sum);
  }
  return by_row;
}

template <typename T>
RowStates row_states_against(
    const at::Tensor& q,
    const int32_t* q_ids,
    const at::Tensor& r,
    const int32_t* r_ids,
    const PairLogit<T>& logit) {
  RowStates states(q.size(0));
  for_each_task(at::divup(q.size(0), kTile), [&](int64_t bi) {
    for (int64_t bj = 0; bj < at::divup(r.size(0), kTile); ++bj) {
      const PairTile<T> tile(block_of(q, bi), q_ids + bi * kTile, block_of(r, bj), r_ids + bj * kTile, logit, false);
      merge_tile_states(tile, /*by_column=*/false, states.data() + bi * kTile);
    }
  });
  return states;
}

// The op's inputs in the compute dtype, and labels as shared class ids.
struct AnchorInputs {
  at::Tensor q; // (B, D)
  at::Tensor r; // (M, D): q itself without a reference set
  at::Tensor q_ids; // (B,) int32
  at::Tensor r_ids; // (M,) int32
  bool self; // no reference set: the pairs (i, j), j != i, of q
};

AnchorInputs prepare_anchor_inputs(
    const at::Tensor& features,
    const at::Tensor& labels,
    const std::optional<at::Tensor>& ref_features,
    const std::optional<at::Tensor>& ref_labels) {
  AnchorInputs in;
  in.self = !(ref_features.has_value() && ref_features->defined());
  in.q = features.to(compute_dtype(features)).contiguous();
  if (in.self) {
    in.r = in.q;
    in.q_ids = in.r_ids = class_ids({labels})[0];
  } else {
    in.r = ref_features->to(compute_dtype(features)).contiguous();
    const auto ids = class_ids({labels, *ref_labels});
    in.q_ids = ids[0];
    in.r_ids = ids[1];
  }
  return in;
}

std::tuple<at::Tensor, at::Tensor> anchor_loss_forward_cpu(
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    const std::optional<at::Tensor>& ref_features, // (M, D)?
    const std::optional<at::Tensor>& ref_labels, // (M,)?
    double margin,
    double gamma) {
  check_anchor_inputs(features, labels, ref_features, ref_labels, margin, gamma);
  const NoAutocast no_autocast;
  const AnchorInputs in = prepare_anchor_inputs(features, labels, ref_features, ref_labels);
  const int64_t batch = features.size(0);
  at::Tensor losses = at::empty({batch}, features.options());
  at::Tensor row_lse = at::empty({batch, 2}, in.q.options());
  AT_DISPATCH_FLOATING_TYPES(in.q.scalar_type(), "circle_anchor_loss_cpu", [&] {
    const PairLogit<scalar_t> logit = pair_logit<scalar_t>(margin, gamma);
    const int32_t* q_ids = in.q_ids.data_ptr<int32_t>();
    const RowStates states = in.self
        ? row_states_symmetric<scalar_t>(in.q, q_ids, logit)
        : row_states_against<scalar_t>(in.q, q_ids, in.r, in.r_ids.data_ptr<int32_t>(), logit);
    scalar_t* lse = row_lse.data_ptr<scalar_t>();
    std::vector<double> values(batch);
    for (int64_t i = 0; i < batch; ++i) {
      const double lse_positive = states[i][0].lse();
      const double lse_negative = states[i][1].lse();
      lse[2 * i] = static_cast<scalar_t>(lse_positive);
      lse[2 * i + 1] = static_cast<scalar_t>(lse_negative);
      values[i] = anchor_row_loss(lse_positive, lse_negative);
    }
    store_rounded(values.data(), losses);
  });
  return {losses, row_lse};
}

at::Tensor anchor_loss_cpu(
    const at::Tensor& features,
    const at::Tensor& labels,
    const std::optional<at::Tensor>& ref_features,
    const std::optional<at::Tensor>& ref_labels,
    double margin,
    double gamma) {
  return std::get<0>(anchor_loss_forward_cpu(features, labels, ref_features, ref_labels, margin, gamma));
}

std::tuple<at::Tensor, at::Tensor> anchor_loss_backward_cpu(
    const at::Tensor& grad_losses, // (B,)
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    const std::optional<at::Tensor>& ref_features, // (M, D)?
    const std::optional<at::Tensor>& ref_labels, // (M,)?
    const at::Tensor& row_lse, // (B, 2)
    double margin,
    double gamma) {
  check_anchor_inputs(features, labels, ref_features, ref_labels, margin, gamma);
  check_anchor_backward_inputs(grad_losses, features, row_lse);
  const NoAutocast no_autocast;
  const AnchorInputs in = prepare_anchor_inputs(features, labels, ref_features, ref_labels);
  const int64_t batch = features.size(0);
  at::Tensor grad_q = at::zeros_like(in.q);
  at::Tensor grad_r = in.self ? at::empty({0, features.size(1)}, features.options()) : at::zeros_like(in.r);
  AT_DISPATCH_FLOATING_TYPES(in.q.scalar_type(), "circle_anchor_loss_backward_cpu", [&] {
    using T = scalar_t;
    const PairLogit<T> logit = pair_logit<T>(margin, gamma);
    const at::Tensor g = grad_losses.to(in.q.scalar_type()).contiguous();
    const at::Tensor lse = row_lse.contiguous();
    std::vector<RowCoefficients<T>> coefficients(batch);
    for (int64_t i = 0; i < batch; ++i) {
      const T lse_positive = lse.data_ptr<T>()[2 * i];
      const T lse_negative = lse.data_ptr<T>()[2 * i + 1];
      coefficients[i] = {{lse_positive, lse_negative},
                         static_cast<T>(g.data_ptr<T>()[i] * anchor_row_grad_scale(lse_positive, lse_negative))};
    }
    const int32_t* q_ids = in.q_ids.data_ptr<int32_t>();
    const RowCoefficients<T>* coef = coefficients.data();
    if (in.self) {
      at::Tensor by_col = at::zeros_like(in.q);
      for_each_symmetric_round(at::divup(batch, kTile), [&](int64_t round, int64_t bi, int64_t bj) {
        const at::Tensor rows = block_of(in.q, bi);
        const at::Tensor cols = block_of(in.q, bj);
        const at::Tensor c = tile_weights<T>(
            rows, q_ids + bi * kTile, coef + bi * kTile, cols, q_ids + bj * kTile, coef + bj * kTile, logit, round == 0);
        block_of(grad_q, bi).addmm_(c, cols);
        if (round != 0) block_of(by_col, bj).addmm_(c.t(), rows);
      });
      grad_q.add_(by_col);
    } else {
      const int32_t* r_ids = in.r_ids.data_ptr<int32_t>();
      const int64_t row_blocks = at::divup(batch, kTile);
      const int64_t col_blocks = at::divup(in.r.size(0), kTile);
      // dQ by row blocks, then dR by column blocks, each walking the other
      // in order: every accumulator has one owner, at the price of forming
      // the tiles of W twice.
      for_each_task(row_blocks, [&](int64_t bi) {
        for (int64_t bj = 0; bj < col_blocks; ++bj) {
          const at::Tensor w = tile_weights<T>(
              block_of(in.q, bi), q_ids + bi * kTile, coef + bi * kTile, block_of(in.r, bj), r_ids + bj * kTile,
              nullptr, logit, false);
          block_of(grad_q, bi).addmm_(w, block_of(in.r, bj));
        }
      });
      for_each_task(col_blocks, [&](int64_t bj) {
        for (int64_t bi = 0; bi < row_blocks; ++bi) {
          const at::Tensor w = tile_weights<T>(
              block_of(in.q, bi), q_ids + bi * kTile, coef + bi * kTile, block_of(in.r, bj), r_ids + bj * kTile,
              nullptr, logit, false);
          block_of(grad_r, bj).addmm_(w.t(), block_of(in.q, bi));
        }
      });
    }
  });
  return {grad_q.to(features.scalar_type()), in.self ? grad_r : grad_r.to(features.scalar_type())};
}

} // namespace

TORCH_LIBRARY_IMPL(circle, CPU, m) {
  m.impl("anchor_loss", &anchor_loss_cpu);
  m.impl("_anchor_loss_forward", &anchor_loss_forward_cpu);
  m.impl("_anchor_loss_backward", &anchor_loss_backward_cpu);
}

} // namespace circle_loss
