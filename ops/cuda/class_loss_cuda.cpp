// CUDA kernels of circle::class_loss. The class-level loss is the per-anchor
// loss of the rows against the columns as references labelled 0..K-1
// (docs/math.md, "The class-level form"), so the CUDA kernels are
// circle::anchor_loss's, verified on the H200: its strips of S = F Wᵀ, its
// row states (whose LSE_P is the one positive's logit here) and its
// gradients to both sets. Around them, ATen ops take the columns through the
// class index, normalise rows and columns, and cast the columns to the rows'
// dtype, and in the backward apply normalize's backward and put the columns'
// gradient back into weight's rows. What this spends beyond kernels of its
// own (docs/design.md): the (K, D) columns and their gradient as buffers, a
// K-long int64 label vector and a label compare an entry.
#include "kernel_args.h"

#include <ATen/OpMathType.h>
#include <ATen/ops/addcmul.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/clamp_min.h>
#include <ATen/ops/div.h>
#include <ATen/ops/einsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gt.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

namespace circle_loss {
namespace {

// Rows x (N, D) normalised as normalize(x, dim=1) does it, each quotient
// taken in float32 (float64) and rounded once into `dtype` (the op's
// compute dtype for the per-anchor kernels): one (N, D) buffer in that
// dtype, no float32 copy of half-precision rows.
struct NormalizedRows {
  at::Tensor values; // (N, D) in dtype
  at::Tensor norms; // (N, 1) max(‖x‖, eps) in x's accumulation dtype

  NormalizedRows(const at::Tensor& x, at::ScalarType dtype)
      : values(at::empty(x.sizes(), x.options().dtype(dtype))),
        norms(at::clamp_min(
            at::linalg_vector_norm(x, 2, {1}, /*keepdim=*/true, at::toOpMathType(x.scalar_type())), kNormalizeEps)) {
    at::div_out(values, x, norms);
  }

  // normalize's backward: dy (N, D) at the values, in their dtype -> the
  // gradient at x in `dtype`, (dy - y⟨y, dy⟩)/norm, ⟨y, dy⟩ taken as 0 where
  // the norm was clamped (the clamp passes no gradient to the norm).
  at::Tensor backward(const at::Tensor& dy, at::ScalarType dtype) const {
    const at::Tensor along = at::where(
        at::gt(norms, kNormalizeEps), at::einsum("nd,nd->n", {values, dy}).unsqueeze(1).to(norms.scalar_type()), 0);
    const at::Tensor projected = at::addcmul(dy, values, along.to(dy.scalar_type()), -1);
    at::Tensor dx = at::empty(dy.sizes(), dy.options().dtype(dtype));
    return at::div_out(dx, projected, norms);
  }
};

// The class-level op's arguments as the per-anchor op's: the columns (the
// classes, or those the index keeps; normalised where asked; in features'
// dtype) as references labelled 0..K-1.
struct AsAnchorArgs {
  std::optional<NormalizedRows> rows;
  std::optional<NormalizedRows> columns;
  at::Tensor features;
  std::optional<at::Tensor> weight; // (K, D)
  std::optional<at::Tensor> column_labels; // (K,) 0..K-1
  std::optional<at::Tensor> no_index;
  AnchorArgs args; // refers to the members above

  explicit AsAnchorArgs(const ClassArgs& a)
      : rows(a.normalize ? std::make_optional<NormalizedRows>(a.features, a.features.scalar_type()) : std::nullopt),
        columns(a.normalize ? std::make_optional<NormalizedRows>(gathered(a), a.features.scalar_type()) : std::nullopt),
        features(rows ? rows->values : a.features),
        weight(columns ? columns->values : gathered(a).to(a.features.scalar_type())),
        column_labels(at::arange(a.columns(), a.labels.options().dtype(at::kLong))),
        args{features, a.labels, weight, column_labels, a.margin, a.gamma, no_index} {}
  AsAnchorArgs(const AsAnchorArgs&) = delete;
  AsAnchorArgs& operator=(const AsAnchorArgs&) = delete;

  // weight's rows that are the columns.
  static at::Tensor gathered(const ClassArgs& a) {
    return is_given(a.class_index) ? at::index_select(a.weight, 0, *a.class_index) : a.weight;
  }
};

std::tuple<at::Tensor, at::Tensor> class_loss_forward_cuda(const ClassArgs& args) {
  const NoAutocast no_autocast;
  check_class_index_values(args); // before index_select's own, blunter assert
  const AsAnchorArgs anchor(args);
  auto [losses, row_lse, unused] = call_anchor_loss_forward(anchor.args, /*keep_diagonal_tiles=*/false);
  return {losses, row_lse};
}

std::tuple<at::Tensor, at::Tensor> class_loss_backward_cuda(
    const at::Tensor& grad_losses, const ClassArgs& args, const at::Tensor& row_lse, bool features_grad,
    bool weight_grad) {
  const NoAutocast no_autocast;
  check_class_index_values(args);
  const AsAnchorArgs anchor(args);
  // The per-anchor backward forms dF whatever is asked; dW where asked.
  auto [grad_rows, grad_columns] =
      call_anchor_loss_backward(grad_losses, anchor.args, row_lse, /*ref_grad=*/weight_grad, std::nullopt);
  const int64_t dim = args.features.size(1);
  at::Tensor grad_features = !features_grad ? at::empty({0, dim}, args.features.options())
      : anchor.rows                          ? anchor.rows->backward(grad_rows, args.features.scalar_type())
                                             : grad_rows;
  if (!weight_grad) return {grad_features, at::empty({0, dim}, args.weight.options())};
  grad_columns = anchor.columns ? anchor.columns->backward(grad_columns, args.weight.scalar_type())
                               : grad_columns.to(args.weight.scalar_type());
  if (!is_given(args.class_index)) return {grad_features, grad_columns};
  // Strictly increasing indices: one add a row, into zeros, in any order.
  at::Tensor grad_weight = at::zeros_like(args.weight);
  grad_weight.index_put_({args.class_index->to(at::kLong)}, grad_columns, /*accumulate=*/true);
  return {grad_features, grad_weight};
}

} // namespace

TORCH_LIBRARY_IMPL(circle, CUDA, m) {
  register_class_kernels<class_loss_forward_cuda, class_loss_backward_cuda>(m);
}

} // namespace circle_loss
