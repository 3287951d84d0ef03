// CPU kernels of circle::class_loss, the class-level form (docs/math.md):
// row i of F against the columns of W (the class weights, or those the
// class index keeps), its own class y_i the one positive, every other
// column a negative.
//
// The pairs are visited in tiles of S = F Wᵀ, kRowTile rows by kTile columns:
//   forward   each row's positive logit zp_i, from the one tile that holds
//             column y_i, and (max, Σ exp(z - max)) of its negatives; then
//             L_i = softplus(zp_i + LSE_N(i)).
//   backward  G_ij = g_i·σ(Z_i)·exp(z_ij - LSE_N(i))·γ·αn_ij for a negative,
//             g_i·σ(Z_i)·(-γ·αp_i) for the positive (its set's only member,
//             softmax weight 1); dF = G W and dW = Gᵀ F.
// The label says where each row's positive is: no label compare an entry,
// and no C-long label vector. Tasks take (row block, share of the columns),
// the shares' sums then merged in share order, so that results are bitwise
// the same for any thread count.
//
// A block of columns is taken as a view of W where it can be, else loaded
// into the task's own (kTile, D) buffer: gathered through the class index,
// cast to the compute dtype, and, with normalize, scaled by its rows'
// inverse norms. So normalisation and the gather cost a pass over a block
// that the block's products then read from cache, no normalised (C, D)
// copy exists, and normalize's backward, (dy - y⟨y, dy⟩)/max(‖x‖, eps), is
// applied to each block of dW as it is finished, before it is stored into
// weight's rows in weight's dtype.
#include "tiles.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
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

// normalize(x, dim=1) of n rows of width d, in place: norms[r] = max(‖x_r‖,
// eps), and x_r scaled by its inverse (a product, not normalize's
// division: within an ulp of it, and a vector division an entry is the
// dearest instruction of the pass).
template <typename T>
void normalize_rows(T* x, int64_t n, int64_t d, T* norms) {
  for (int64_t r = 0; r < n; ++r) {
    T* __restrict__ row = x + r * d;
    T squares = 0;
#pragma omp simd reduction(+ : squares)
    for (int64_t k = 0; k < d; ++k) squares += row[k] * row[k];
    const T norm = std::max(std::sqrt(squares), static_cast<T>(kNormalizeEps));
    const T inverse = T(1) / norm;
    norms[r] = norm;
#pragma omp simd
    for (int64_t k = 0; k < d; ++k) row[k] *= inverse;
  }
}

// normalize's backward of row r: dy (d,), the gradient at y = normalize(x),
// -> the gradient at x, (dy - y⟨y, dy⟩)/norm, with ⟨y, dy⟩ taken as 0 where
// the norm was clamped at eps (normalize's own backward: the clamp passes
// no gradient to the norm), written to out (which may be dy).
template <typename T, typename Out>
void normalize_row_backward(const T* dy, const T* y, T norm, int64_t d, Out* out) {
  T along = 0;
  if (norm > static_cast<T>(kNormalizeEps)) {
#pragma omp simd reduction(+ : along)
    for (int64_t k = 0; k < d; ++k) along += y[k] * dy[k];
  }
  const T inverse = T(1) / norm;
#pragma omp simd
  for (int64_t k = 0; k < d; ++k) out[k] = static_cast<Out>((dy[k] - y[k] * along) * inverse);
}

// Rows first, ..., first + n - 1 of the columns, as rows of `weight` (C, D)
// in its own dtype and layout (through index where given), into out (n, D)
// in T. A transposed weight (PML keeps W as (D, C)) is read a feature at a
// time across the block's rows, which lie side by side there.
template <typename T>
void load_rows(const at::Tensor& weight, const int64_t* index, int64_t first, int64_t n, T* out) {
  const int64_t d = weight.size(1), row_stride = weight.stride(0), feature_stride = weight.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "circle_class_load_rows", [&] {
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    const auto row = [&](int64_t r) { return w + (index ? index[first + r] : first + r) * row_stride; };
    if (feature_stride == 1) {
      for (int64_t r = 0; r < n; ++r) {
        const scalar_t* __restrict__ src = row(r);
        T* __restrict__ dst = out + r * d;
        for (int64_t k = 0; k < d; ++k) dst[k] = static_cast<T>(src[k]);
      }
    } else {
      for (int64_t k = 0; k < d; ++k) {
        for (int64_t r = 0; r < n; ++r) out[r * d + k] = static_cast<T>(row(r)[k * feature_stride]);
      }
    }
  });
}

// A block's gradient rows (n, D) in T into the rows of `out` (C, D), in its
// own dtype, that the columns first, ..., first + n - 1 are (through index
// where given), with normalize's backward on the way where the block's
// rows y (n, D) were normalised by `norms`.
template <typename T>
void store_rows(const T* rows, const T* y, const T* norms, const int64_t* index, int64_t first, int64_t n,
                at::Tensor& out) {
  const int64_t d = out.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "circle_class_store_rows", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t r = 0; r < n; ++r) {
      const T* __restrict__ src = rows + r * d;
      scalar_t* __restrict__ dst = o + (index ? index[first + r] : first + r) * d;
      if (norms) {
        normalize_row_backward(src, y + r * d, norms[r], d, dst);
      } else {
        for (int64_t k = 0; k < d; ++k) dst[k] = static_cast<scalar_t>(src[k]);
      }
    }
  });
}

// A block of columns as the products take them.
template <typename T>
struct ColumnBlock {
  at::Tensor rows; // (n, D) in T: W's rows, normalised where asked
  std::vector<T> norms; // (n,) max(‖w_j‖, eps), with normalize
};

// The rows of F in the compute dtype T (normalised where asked), W and the
// class index as the kernels read them, and labels as int64.
template <typename T>
struct ClassInputs {
  const ClassArgs& args;
  at::Tensor f; // (B, D) in T, contiguous, normalised where asked
  std::vector<T> f_norms; // (B,) max(‖f_i‖, eps), with normalize
  at::Tensor weight; // (C, D) in its own dtype
  at::Tensor index; // (K,) int64, contiguous, or undefined
  at::Tensor labels; // (B,) int64
  int64_t columns;
  // The blocks are views of W (made contiguous): in T, every class,
  // nothing to scale. Else they are loaded from W as it lies.
  bool blocks_are_views;

  explicit ClassInputs(const ClassArgs& a)
      : args(a),
        f(a.features.to(c10::CppTypeToScalarType<T>::value, /*non_blocking=*/false, /*copy=*/a.normalize)
              .contiguous()),
        index(is_given(a.class_index) ? a.class_index->to(at::kLong).contiguous() : at::Tensor()),
        labels(a.labels.to(at::kLong).contiguous()),
        columns(a.columns()),
        blocks_are_views(!a.normalize && !index.defined() && a.weight.scalar_type() == f.scalar_type()) {
    weight = blocks_are_views ? a.weight.contiguous() : a.weight;
    check_class_index_values(a);
    if (a.normalize) {
      f_norms.resize(f.size(0));
      normalize_rows(f.data_ptr<T>(), f.size(0), f.size(1), f_norms.data());
    }
  }

  // The class index's entries, or null without one.
  const int64_t* index_data() const {
    return index.defined() ? index.const_data_ptr<int64_t>() : nullptr;
  }

  // Column block bj, into the task's buffer (kTile, D) unless a view serves.
  ColumnBlock<T> column_block(int64_t bj, at::Tensor& buffer) const {
    const int64_t first = bj * kTile, n = std::min(kTile, columns - first);
    if (blocks_are_views) return {weight.narrow(0, first, n), {}};
    if (!buffer.defined()) buffer = at::empty({kTile, f.size(1)}, f.options());
    ColumnBlock<T> block{buffer.narrow(0, 0, n), {}};
    T* rows = block.rows.template data_ptr<T>();
    load_rows(weight, index_data(), first, n, rows);
    if (args.normalize) {
      block.norms.resize(n);
      normalize_rows(rows, n, f.size(1), block.norms.data());
    }
    return block;
  }

  // A block's dW (n, D) in T, the gradient at its rows as the products took
  // them, stored into grad_w's rows: normalize's backward applied, through
  // the index, in weight's dtype. Unless it is already there (views).
  void store_weight_grad(int64_t bj, const ColumnBlock<T>& block, at::Tensor& grad_block, at::Tensor& grad_w) const {
    if (blocks_are_views) return;
    store_rows(grad_block.const_data_ptr<T>(), block.rows.template const_data_ptr<T>(),
               args.normalize ? block.norms.data() : nullptr, index_data(), bj * kTile, block.rows.size(0), grad_w);
  }

  // Where a block's dW is summed: grad_w's own rows (views), else the
  // task's buffer (kTile, D).
  at::Tensor weight_grad_block(int64_t bj, int64_t n, at::Tensor& grad_w, at::Tensor& buffer) const {
    if (blocks_are_views) return grad_w.narrow(0, bj * kTile, n);
    if (!buffer.defined()) buffer = at::empty({kTile, f.size(1)}, f.options());
    return buffer.narrow(0, 0, n);
  }

  // The tile (bi, bj) of S against the block's rows, written into the front
  // of a task's own buffer: a fresh allocation a tile would be mapped and
  // faulted in each time.
  at::Tensor tile_of_s(int64_t bi, const ColumnBlock<T>& block, at::Tensor& buffer) const {
    const int64_t rows = std::min(kRowTile, f.size(0) - bi * kRowTile), cols = block.rows.size(0);
    if (!buffer.defined()) buffer = at::empty({kRowTile * kTile}, f.options());
    at::Tensor s = buffer.narrow(0, 0, rows * cols).view({rows, cols});
    return at::mm_out(s, rows_of(f, bi), block.rows.t());
  }

  ClassTile tile(int64_t bi, int64_t bj) const {
    return {bi * kRowTile, bj * kTile, std::min(kRowTile, f.size(0) - bi * kRowTile),
            std::min(kTile, columns - bj * kTile)};
  }

  // dF at the rows as the products took them, (B, D) in T, made the
  // gradient at features, in features' dtype.
  at::Tensor features_grad(at::Tensor grad_f) const {
    if (args.normalize && grad_f.numel() > 0) {
      const int64_t d = f.size(1);
      T* g = grad_f.data_ptr<T>();
      for (int64_t r = 0; r < f.size(0); ++r) {
        normalize_row_backward(g + r * d, f.const_data_ptr<T>() + r * d, f_norms[r], d, g + r * d);
      }
    }
    return grad_f.to(args.features.scalar_type());
  }
};

std::tuple<at::Tensor, at::Tensor> class_loss_forward_cpu(const ClassArgs& args) {
  const NoAutocast no_autocast;
  const int64_t batch = args.features.size(0);
  at::Tensor losses = at::empty({batch}, args.features.options());
  at::Tensor row_lse = at::empty({batch, 2}, args.features.options().dtype(compute_dtype(args.features)));
  AT_DISPATCH_FLOATING_TYPES(row_lse.scalar_type(), "circle_class_loss_cpu", [&] {
    using T = scalar_t;
    const ClassInputs<T> in(args);
    const PairLogit<T> logit = pair_logit<T>(args.margin, args.gamma);
    const int64_t* y = in.labels.template data_ptr<int64_t>();
    // zp: written by the one tile that holds the row's class, else -inf.
    std::vector<T> zp(batch, -std::numeric_limits<T>::infinity());
    const ColumnGroups split = ColumnGroups::for_states(batch, in.columns, kRowTile);
    std::vector<std::vector<LseState<double>>> shares(split.groups, std::vector<LseState<double>>(batch));
    for_each_task(split.row_blocks * split.groups, [&](int64_t t) {
      const int64_t bi = t / split.groups, g = t % split.groups;
      at::Tensor block_buffer, tile_buffer;
      for (int64_t bj = split.first(g); bj < split.first(g + 1); ++bj) {
        const ColumnBlock<T> block = in.column_block(bj, block_buffer);
        at::Tensor s = in.tile_of_s(bi, block, tile_buffer);
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
  const NoAutocast no_autocast;
  const at::Tensor& weight = args.weight;
  const int64_t batch = args.features.size(0), dim = args.features.size(1);
  // Each block of dW takes its first product (row block 0) by assignment and
  // is stored whole, so dW starts empty, except where some rows of it get no
  // block (those outside the class index) or there are no rows of F.
  // Row-major whatever weight's layout (PML keeps it transposed).
  at::Tensor grad_w = !weight_grad                 ? at::empty({0, dim}, weight.options())
      : batch > 0 && !is_given(args.class_index) ? at::empty(weight.sizes(), weight.options())
                                                   : at::zeros(weight.sizes(), weight.options());
  if ((!features_grad && !weight_grad) || batch == 0) {
    return {at::zeros({features_grad ? batch : 0, dim}, args.features.options()), grad_w};
  }
  at::Tensor grad_f;
  AT_DISPATCH_FLOATING_TYPES(row_lse.scalar_type(), "circle_class_loss_backward_cpu", [&] {
    using T = scalar_t;
    const ClassInputs<T> in(args);
    grad_f = features_grad ? at::zeros_like(in.f) : at::empty({0, dim}, in.f.options());
    const PairLogit<T> logit = pair_logit<T>(args.margin, args.gamma);
    const int64_t* y = in.labels.template data_ptr<int64_t>();
    const at::Tensor g = grad_losses.to(in.f.scalar_type()).contiguous();
    const at::Tensor states = row_lse.contiguous();
    std::vector<T> factor(batch), lse_negative(batch);
    for (int64_t i = 0; i < batch; ++i) {
      const T zp = states.data_ptr<T>()[2 * i], lse_n = states.data_ptr<T>()[2 * i + 1];
      factor[i] = g.data_ptr<T>()[i] * anchor_row_grad_scale(zp, lse_n);
      lse_negative[i] = factor[i] == T(0) ? std::numeric_limits<T>::infinity() : lse_n;
    }
    const auto weights = [&](int64_t bi, int64_t bj, const ColumnBlock<T>& block, at::Tensor& buffer) {
      at::Tensor s = in.tile_of_s(bi, block, buffer);
      tile_gradient_weights(s.data_ptr<T>(), in.tile(bi, bj), y, factor.data(), lse_negative.data(), logit);
      return s;
    };
    const ColumnGroups split = ColumnGroups::for_gradient(batch, in.columns, kRowTile);
    if (split.groups > 1 && split.groups >= split.row_blocks) {
      // dW's blocks are each share's own; dF is summed share by share.
      const at::Tensor shares = at::zeros({features_grad ? split.groups - 1 : 0, batch, dim}, in.f.options());
      for_each_task(split.groups, [&](int64_t share) {
        at::Tensor block_buffer, tile_buffer, grad_buffer;
        for (int64_t bj = split.first(share); bj < split.first(share + 1); ++bj) {
          const ColumnBlock<T> block = in.column_block(bj, block_buffer);
          at::Tensor grad_block =
              weight_grad ? in.weight_grad_block(bj, block.rows.size(0), grad_w, grad_buffer) : at::Tensor();
          for (int64_t bi = 0; bi < split.row_blocks; ++bi) {
            const at::Tensor w = weights(bi, bj, block, tile_buffer);
            if (features_grad) rows_of(share == 0 ? grad_f : shares[share - 1], bi).addmm_(w, block.rows);
            if (weight_grad) add_product(grad_block, w.t(), rows_of(in.f, bi), bi > 0);
          }
          if (weight_grad) in.store_weight_grad(bj, block, grad_block, grad_w);
        }
      });
      for (int64_t k = 0; k < shares.size(0); ++k) grad_f.add_(shares[k]);
    } else {
      // dF by row blocks, then dW by column blocks, each walking the other
      // in order: every accumulator has one owner, at the price of forming
      // the tiles of G twice where both are wanted.
      if (features_grad) {
        for_each_task(split.row_blocks, [&](int64_t bi) {
          at::Tensor block_buffer, tile_buffer;
          for (int64_t bj = 0; bj < split.col_blocks; ++bj) {
            const ColumnBlock<T> block = in.column_block(bj, block_buffer);
            rows_of(grad_f, bi).addmm_(weights(bi, bj, block, tile_buffer), block.rows);
          }
        });
      }
      if (weight_grad) {
        for_each_task(split.col_blocks, [&](int64_t bj) {
          at::Tensor block_buffer, tile_buffer, grad_buffer;
          const ColumnBlock<T> block = in.column_block(bj, block_buffer);
          at::Tensor grad_block = in.weight_grad_block(bj, block.rows.size(0), grad_w, grad_buffer);
          for (int64_t bi = 0; bi < split.row_blocks; ++bi) {
            add_product(grad_block, weights(bi, bj, block, tile_buffer).t(), rows_of(in.f, bi), bi > 0);
          }
          in.store_weight_grad(bj, block, grad_block, grad_w);
        });
      }
    }
    grad_f = in.features_grad(grad_f);
  });
  return {grad_f, grad_w};
}

} // namespace

TORCH_LIBRARY_IMPL(circle, CPU, m) {
  register_class_kernels<class_loss_forward_cpu, class_loss_backward_cpu>(m);
}

} // namespace circle_loss
