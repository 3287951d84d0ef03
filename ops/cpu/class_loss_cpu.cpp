// CPU kernels of circle::class_loss, the class-level form (docs/math.md):
// row i of F against the C class weights W, its own class y_i the one
// positive, every other class a negative.
//
// The pairs are visited in tiles of S = F Wᵀ, kRowTile rows by kTile classes:
//   forward   each row's positive logit zp_i, from the one tile that holds
//             column y_i, and (max, Σ exp(z - max)) of its negatives; then
//             L_i = softplus(zp_i + LSE_N(i)).
//   backward  G_ij = g_i·σ(Z_i)·exp(z_ij - LSE_N(i))·γ·αn_ij for a negative,
//             g_i·σ(Z_i)·(-γ·αp_i) for the positive (its set's only member,
//             softmax weight 1); dF = G W and dW = Gᵀ F.
// The label says where each row's positive is: no label compare an entry,
// and no C-long label vector. Tasks take (row block, share of the classes),
// the shares' sums then merged in share order, so that results are bitwise
// the same for any thread count.
#include "tiles.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

namespace circle_loss {
namespace {

using namespace cpu;

// Rows of a tile. Unlike the global and per-anchor ops' square tiles (their
// S is symmetric, or its rows and columns alike), a batch of up to 1024 rows
// meets each block of classes in one tile, so that dW_J = Gᵀ F takes one
// product with K = B rather than one a block of 256 rows accumulated into
// it, and every product is larger.
constexpr int64_t kRowTile = 1024;

// Rows of row block b of a (N, ...) tensor.
at::Tensor rows_of(const at::Tensor& t, int64_t b) {
  return t.narrow(0, b * kRowTile, std::min(kRowTile, t.size(0) - b * kRowTile));
}

// The tile of rows [row0, row0 + R) and classes [col0, col0 + C): where
// each row's positive lies in it, if it does.
struct ClassTile {
  int64_t row0;
  int64_t col0;
  int64_t rows;
  int64_t cols;

  // f(r, c) for each row r of the tile whose class c (counted from col0) is
  // one of the tile's.
  template <typename F>
  void for_each_positive(const int64_t* labels, const F& f) const {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t c = labels[row0 + r] - col0;
      if (c >= 0 && c < cols) f(r, c);
    }
  }
};

// The negative logits of a tile, made in place from its similarities: the
// positive entries' logits go to zp (their rows' own), and the entries
// themselves to -inf, which adds nothing to an LSE.
template <typename T>
void negative_logits(T* s, const ClassTile& tile, const int64_t* labels, const PairLogit<T>& logit, T* zp) {
  tile.for_each_positive(labels, [&](int64_t r, int64_t c) {
    T slope;
    zp[tile.row0 + r] = logit(s[r * tile.cols + c], /*positive=*/true, &slope);
  });
  const int64_t n = tile.rows * tile.cols;
  run_vectorised([=]() CIRCLE_LOSS_VECTOR_LOOP {
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) {
      T slope;
      s[k] = logit(s[k], /*positive=*/false, &slope);
    }
  });
  tile.for_each_positive(labels, [&](int64_t r, int64_t c) {
    s[r * tile.cols + c] = -std::numeric_limits<T>::infinity();
  });
}

// Merges each row's negatives of the tile of logits z into its state: the
// maxima, then the sums of exp(z - max), each row's an `omp simd` reduction.
template <typename T>
void merge_negatives(const T* z, const ClassTile& tile, LseState<double>* states) {
  const int64_t n_rows = tile.rows, n_cols = tile.cols;
  std::vector<T> row_max_v(n_rows), row_sum_v(n_rows);
  T* __restrict__ row_max = row_max_v.data();
  T* __restrict__ row_sum = row_sum_v.data();
  run_vectorised([=]() CIRCLE_LOSS_VECTOR_LOOP {
    for (int64_t r = 0; r < n_rows; ++r) {
      const T* __restrict__ zr = z + r * n_cols;
      T max = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : max)
      for (int64_t j = 0; j < n_cols; ++j) max = tile_max(zr[j], max);
      T sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n_cols; ++j) sum += inline_exp(shifted_argument(zr[j], max));
      row_max[r] = max;
      row_sum[r] = sum;
    }
  });
  for (int64_t r = 0; r < n_rows; ++r) states[tile.row0 + r].merge(row_max[r], row_sum[r]);
}

// Labels as int64, and F and W in the compute dtype.
struct ClassInputs {
  at::Tensor f; // (B, D)
  at::Tensor w; // (C, D)
  at::Tensor labels; // (B,) int64

  ClassInputs(const at::Tensor& features, const at::Tensor& labels_, const at::Tensor& weight)
      : f(features.to(compute_dtype(features)).contiguous()),
        w(weight.to(compute_dtype(features)).contiguous()),
        labels(labels_.to(at::kLong).contiguous()) {}

  // The tile (bi, bj) of S, written into the front of a task's own buffer:
  // a fresh allocation a tile would be mapped and faulted in each time.
  at::Tensor tile_of_s(int64_t bi, int64_t bj, at::Tensor& buffer) const {
    const ClassTile t = tile(bi, bj);
    if (!buffer.defined()) buffer = at::empty({kRowTile * kTile}, f.options());
    at::Tensor s = buffer.narrow(0, 0, t.rows * t.cols).view({t.rows, t.cols});
    return at::mm_out(s, rows_of(f, bi), block_of(w, bj).t());
  }

  ClassTile tile(int64_t bi, int64_t bj) const {
    return {bi * kRowTile, bj * kTile, std::min(kRowTile, f.size(0) - bi * kRowTile),
            std::min(kTile, w.size(0) - bj * kTile)};
  }
};

std::tuple<at::Tensor, at::Tensor> class_loss_forward_cpu(const ClassArgs& args) {
  const auto& [features, labels, weight, margin, gamma] = args;
  const NoAutocast no_autocast;
  const ClassInputs in(features, labels, weight);
  const int64_t batch = features.size(0);
  at::Tensor losses = at::empty({batch}, features.options());
  at::Tensor row_lse = at::empty({batch, 2}, in.f.options());
  AT_DISPATCH_FLOATING_TYPES(in.f.scalar_type(), "circle_class_loss_cpu", [&] {
    using T = scalar_t;
    const PairLogit<T> logit = pair_logit<T>(margin, gamma);
    const int64_t* y = in.labels.data_ptr<int64_t>();
    // zp: written by the one tile that holds the row's class, else -inf.
    std::vector<T> zp(batch, -std::numeric_limits<T>::infinity());
    const ColumnGroups split = ColumnGroups::for_states(batch, weight.size(0), kRowTile);
    std::vector<std::vector<LseState<double>>> shares(split.groups, std::vector<LseState<double>>(batch));
    for_each_task(split.row_blocks * split.groups, [&](int64_t t) {
      const int64_t bi = t / split.groups, g = t % split.groups;
      at::Tensor buffer;
      for (int64_t bj = split.first(g); bj < split.first(g + 1); ++bj) {
        at::Tensor s = in.tile_of_s(bi, bj, buffer);
        const ClassTile tile = in.tile(bi, bj);
        negative_logits(s.data_ptr<T>(), tile, y, logit, zp.data());
        merge_negatives(s.data_ptr<T>(), tile, shares[g].data());
      }
    });
    T* lse = row_lse.data_ptr<T>();
    std::vector<double> values(batch);
    for (int64_t i = 0; i < batch; ++i) {
      for (int64_t g = 1; g < split.groups; ++g) shares[0][i].merge(shares[g][i].max, shares[g][i].sum);
      const double lse_negative = shares[0][i].lse();
      lse[2 * i] = zp[i];
      lse[2 * i + 1] = static_cast<T>(lse_negative);
      values[i] = anchor_row_loss(zp[i], lse_negative);
    }
    store_rounded(values.data(), losses);
  });
  return {losses, row_lse};
}

// The tile of G for rows × classes, made in place from the tile of S.
// factor_i = g_i·σ(Z_i), 0 where L_i is identically 0; such a row takes
// LSE_N = +inf, so that each exp(z - LSE_N) of it is 0 with no test.
template <typename T>
void tile_gradient_weights(
    T* s,
    const ClassTile& tile,
    const int64_t* labels,
    const T* factor, // (B,)
    const T* lse_negative, // (B,), +inf where factor is 0
    const PairLogit<T>& logit) {
  // The positives first, from their similarities.
  std::vector<std::pair<int64_t, T>> positives;
  tile.for_each_positive(labels, [&](int64_t r, int64_t c) {
    T slope;
    logit(s[r * tile.cols + c], /*positive=*/true, &slope);
    positives.emplace_back(r * tile.cols + c, factor[tile.row0 + r] * slope);
  });
  const int64_t n_cols = tile.cols;
  for (int64_t r = 0; r < tile.rows; ++r) {
    T* __restrict__ sr = s + r * n_cols;
    const T f = factor[tile.row0 + r], lse = lse_negative[tile.row0 + r];
    run_vectorised([=]() CIRCLE_LOSS_VECTOR_LOOP {
#pragma omp simd
      for (int64_t j = 0; j < n_cols; ++j) {
        T slope;
        const T z = logit(sr[j], /*positive=*/false, &slope);
        sr[j] = f * inline_exp(shifted_argument(z, lse)) * slope;
      }
    });
  }
  for (const auto& [k, weight] : positives) s[k] = weight;
}

// out (+)= a b: added where `accumulate`, else assigned.
void add_product(at::Tensor out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  if (accumulate) {
    out.addmm_(a, b);
  } else {
    at::mm_out(out, a, b);
  }
}

std::tuple<at::Tensor, at::Tensor> class_loss_backward_cpu(
    const at::Tensor& grad_losses, const ClassArgs& args, const at::Tensor& row_lse, bool features_grad,
    bool weight_grad) {
  const auto& [features, labels, weight, margin, gamma] = args;
  const NoAutocast no_autocast;
  const ClassInputs in(features, labels, weight);
  const int64_t batch = features.size(0), dim = features.size(1);
  at::Tensor grad_f = features_grad ? at::zeros_like(in.f) : at::empty({0, dim}, in.f.options());
  // Each block of dW takes its first product (row block 0) by assignment,
  // so dW starts empty, except where there are no rows to give one.
  at::Tensor grad_w = !weight_grad ? at::empty({0, dim}, in.f.options())
      : batch > 0                  ? at::empty_like(in.w)
                                   : at::zeros_like(in.w);
  if (!features_grad && !weight_grad) {
    return {grad_f.to(features.scalar_type()), grad_w.to(features.scalar_type())};
  }
  AT_DISPATCH_FLOATING_TYPES(in.f.scalar_type(), "circle_class_loss_backward_cpu", [&] {
    using T = scalar_t;
    const PairLogit<T> logit = pair_logit<T>(margin, gamma);
    const int64_t* y = in.labels.data_ptr<int64_t>();
    const at::Tensor g = grad_losses.to(in.f.scalar_type()).contiguous();
    const at::Tensor states = row_lse.contiguous();
    std::vector<T> factor(batch), lse_negative(batch);
    for (int64_t i = 0; i < batch; ++i) {
      const T zp = states.data_ptr<T>()[2 * i], lse_n = states.data_ptr<T>()[2 * i + 1];
      factor[i] = g.data_ptr<T>()[i] * anchor_row_grad_scale(zp, lse_n);
      lse_negative[i] = factor[i] == T(0) ? std::numeric_limits<T>::infinity() : lse_n;
    }
    const auto weights = [&](int64_t bi, int64_t bj, at::Tensor& buffer) {
      at::Tensor s = in.tile_of_s(bi, bj, buffer);
      tile_gradient_weights(s.data_ptr<T>(), in.tile(bi, bj), y, factor.data(), lse_negative.data(), logit);
      return s;
    };
    const ColumnGroups split = ColumnGroups::for_gradient(batch, weight.size(0), kRowTile);
    if (split.groups > 1 && split.groups >= split.row_blocks) {
      // dW's blocks are each share's own; dF is summed share by share.
      const at::Tensor shares =
          at::zeros({features_grad ? split.groups - 1 : 0, batch, dim}, in.f.options());
      for_each_task(split.groups, [&](int64_t share) {
        at::Tensor buffer;
        for (int64_t bj = split.first(share); bj < split.first(share + 1); ++bj) {
          for (int64_t bi = 0; bi < split.row_blocks; ++bi) {
            const at::Tensor w = weights(bi, bj, buffer);
            if (features_grad) rows_of(share == 0 ? grad_f : shares[share - 1], bi).addmm_(w, block_of(in.w, bj));
            if (weight_grad) add_product(block_of(grad_w, bj), w.t(), rows_of(in.f, bi), bi > 0);
          }
        }
      });
      for (int64_t k = 0; k < shares.size(0); ++k) grad_f.add_(shares[k]);
    } else {
      // dF by row blocks, then dW by class blocks, each walking the other in
      // order: every accumulator has one owner, at the price of forming the
      // tiles of G twice where both are wanted.
      if (features_grad) {
        for_each_task(split.row_blocks, [&](int64_t bi) {
          at::Tensor buffer;
          for (int64_t bj = 0; bj < split.col_blocks; ++bj) {
            rows_of(grad_f, bi).addmm_(weights(bi, bj, buffer), block_of(in.w, bj));
          }
        });
      }
      if (weight_grad) {
        for_each_task(split.col_blocks, [&](int64_t bj) {
          at::Tensor buffer;
          for (int64_t bi = 0; bi < split.row_blocks; ++bi) {
            add_product(block_of(grad_w, bj), weights(bi, bj, buffer).t(), rows_of(in.f, bi), bi > 0);
          }
        });
      }
    }
  });
  return {grad_f.to(features.scalar_type()), grad_w.to(features.scalar_type())};
}

} // namespace

TORCH_LIBRARY_IMPL(circle, CPU, m) {
  register_class_kernels<class_loss_forward_cpu, class_loss_backward_cpu>(m);
}

} // namespace circle_loss
