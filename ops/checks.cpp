// The input contracts of the ops, checked in one place for every backend
// (kernel_args.h: the adapters call them before any kernel runs).
#include "kernel_args.h"

#include <ATen/OpMathType.h>
#include <ATen/ops/_assert_async.h>
#include <ATen/ops/all.h>
#include <ATen/ops/ge.h>
#include <ATen/ops/gt.h>
#include <ATen/ops/logical_and.h>
#include <ATen/ops/lt.h>
#include <c10/core/SymBool.h>

#include <cmath>
#include <limits>
#include <string>

namespace circle_loss {

namespace {

// One block of rows and their labels: `rows` names the row count in the
// messages ("B" or "M").
void check_rows(
    const char* op,
    const char* features_name,
    const char* labels_name,
    const char* rows,
    const at::Tensor& features,
    const at::Tensor& labels) {
  TORCH_CHECK(
      features.defined(), op, ": ", features_name, " must be a tensor of shape (", rows, ", D), got None");
  TORCH_CHECK(labels.defined(), op, ": ", labels_name, " must be a tensor of shape (", rows, ",), got None");
  TORCH_CHECK(
      features.dim() == 2,
      op, ": ", features_name, " must be a 2-D tensor of shape (", rows, ", D), got ",
      features.dim(),
      " dimension(s)");
  const auto dtype = features.scalar_type();
  TORCH_CHECK(
      dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
          dtype == at::kBFloat16,
      op, ": ", features_name, " must be float32, float64, float16 or bfloat16, got ",
      dtype);
  TORCH_CHECK(
      labels.dim() == 1,
      op, ": ", labels_name, " must be a 1-D tensor of shape (", rows, ",), got ",
      labels.dim(),
      " dimension(s)");
  TORCH_CHECK(
      at::isIntegralType(labels.scalar_type(), /*includeBool=*/false),
      op, ": ", labels_name, " must have an integer dtype, got ",
      labels.scalar_type());
  TORCH_SYM_CHECK(
      labels.sym_size(0).sym_eq(features.sym_size(0)),
      op, ": ", labels_name, " must have one entry per row of ", features_name, ": ", features_name, " has ",
      features.sym_size(0),
      " rows but ", labels_name, " has ",
      labels.sym_size(0),
      " entries");
  TORCH_CHECK(
      labels.device() == features.device(),
      op, ": ", labels_name, " must be on the same device as ", features_name, ", got ", labels_name, " on ",
      labels.device(),
      " and ", features_name, " on ",
      features.device());
}

// margin and gamma must be finite, and small enough that no pair of unit-norm
// rows overflows the slope of its logit, dz/ds = ∓γ·α with α <= 2 + |m| for
// |s| <= 1, in the accumulation dtype the kernels compute in. Larger values
// turn γ or m into inf there, and inf·0 into NaN; within the bound a logit
// or loss beyond the range is inf, as torch.logsumexp gives.
void check_margin_and_gamma(const char* op, double margin, double gamma, at::ScalarType dtype) {
  TORCH_CHECK(std::isfinite(margin), op, ": margin must be a finite float, got ", margin);
  TORCH_CHECK(std::isfinite(gamma), op, ": gamma must be a finite float, got ", gamma);
  const bool in_double = at::toOpMathType(dtype) == at::kDouble;
  const char* accumulation = in_double ? "float64" : "float32";
  const double largest =
      in_double ? std::numeric_limits<double>::max() : static_cast<double>(std::numeric_limits<float>::max());
  TORCH_CHECK(
      std::abs(margin) <= largest,
      op, ": margin must lie within the range of ", accumulation, ", the dtype the op computes in, got ", margin);
  TORCH_CHECK(
      std::abs(gamma) * (2.0 + std::abs(margin)) <= largest,
      op, ": gamma = ", gamma, " with margin = ", margin, " overflows ", accumulation,
      ", the dtype the op computes in: |gamma|·(2 + |margin|), the largest slope of a logit of unit-norm rows, "
      "must be at most ", largest);
}

} // namespace

void check_inputs(const LossArgs& args) {
  check_rows("circle::loss", "features", "labels", "B", args.features, args.labels);
  check_margin_and_gamma("circle::loss", args.margin, args.gamma, args.features.scalar_type());
}

void check_anchor_inputs(const AnchorArgs& args) {
  constexpr const char* op = "circle::anchor_loss";
  const auto& [features, labels, ref_features, ref_labels, margin, gamma, ref_self_index] = args;
  check_rows(op, "features", "labels", "B", features, labels);
  const bool has_features = is_given(ref_features);
  const bool has_labels = is_given(ref_labels);
  TORCH_CHECK(
      has_features == has_labels,
      op, ": ref_features and ref_labels must be given together, got ",
      has_features ? "ref_features without ref_labels" : "ref_labels without ref_features");
  if (has_features) {
    check_rows(op, "ref_features", "ref_labels", "M", *ref_features, *ref_labels);
    TORCH_SYM_CHECK(
        ref_features->sym_size(1).sym_eq(features.sym_size(1)),
        op, ": ref_features must have the width D of features, got ",
        ref_features->sym_size(1),
        " and ",
        features.sym_size(1));
    TORCH_CHECK(
        ref_features->scalar_type() == features.scalar_type(),
        op, ": ref_features must have the dtype of features, got ",
        ref_features->scalar_type(),
        " and ",
        features.scalar_type());
    TORCH_CHECK(
        ref_features->device() == features.device(),
        op, ": ref_features must be on the device of features, got ",
        ref_features->device(),
        " and ",
        features.device());
  }
  if (is_given(ref_self_index)) {
    const at::Tensor& index = *ref_self_index;
    TORCH_CHECK(
        has_features,
        op, ": ref_self_index names rows of ref_features, so it needs ref_features and ref_labels; without "
        "them the pair (i, i) of features is left out already");
    TORCH_CHECK(
        index.dim() == 1,
        op, ": ref_self_index must be a 1-D tensor of shape (B,), got ", index.dim(), " dimension(s)");
    TORCH_CHECK(
        at::isIntegralType(index.scalar_type(), /*includeBool=*/false),
        op, ": ref_self_index must have an integer dtype, got ", index.scalar_type());
    TORCH_SYM_CHECK(
        index.sym_size(0).sym_eq(features.sym_size(0)),
        op, ": ref_self_index must have one entry per row of features: features has ", features.sym_size(0),
        " rows but ref_self_index has ", index.sym_size(0), " entries");
    TORCH_CHECK(
        index.device() == features.device(),
        op, ": ref_self_index must be on the device of features, got ", index.device(), " and ",
        features.device());
  }
  check_margin_and_gamma(op, margin, gamma, features.scalar_type());
}

void check_class_inputs(const ClassArgs& args) {
  constexpr const char* op = "circle::class_loss";
  const auto& [features, labels, weight, margin, gamma, normalize, class_index] = args;
  check_rows(op, "features", "labels", "B", features, labels);
  TORCH_CHECK(weight.defined(), op, ": weight must be a tensor of shape (C, D), got None");
  TORCH_CHECK(
      weight.dim() == 2, op, ": weight must be a 2-D tensor of shape (C, D), got ", weight.dim(), " dimension(s)");
  TORCH_SYM_CHECK(
      weight.sym_size(1).sym_eq(features.sym_size(1)),
      op, ": weight must have the width D of features, got ", weight.sym_size(1), " and ", features.sym_size(1));
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(
      dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16,
      op, ": weight must be float32, float64, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(
      weight.device() == features.device(),
      op, ": weight must be on the device of features, got ", weight.device(), " and ", features.device());
  if (is_given(class_index)) {
    const at::Tensor& index = *class_index;
    TORCH_CHECK(
        index.dim() == 1,
        op, ": class_index must be a 1-D tensor of shape (K,), got ", index.dim(), " dimension(s)");
    TORCH_CHECK(
        at::isIntegralType(index.scalar_type(), /*includeBool=*/false),
        op, ": class_index must have an integer dtype, got ", index.scalar_type());
    TORCH_CHECK(
        index.device() == features.device(),
        op, ": class_index must be on the device of features, got ", index.device(), " and ", features.device());
  }
  check_margin_and_gamma(op, margin, gamma, features.scalar_type());
}

void check_class_index_values(const ClassArgs& args) {
  if (!is_given(args.class_index) || args.class_index->numel() == 0) return;
  const at::Tensor index = args.class_index->to(at::kLong);
  const int64_t classes = args.weight.size(0);
  constexpr const char* rule = "circle::class_loss: class_index must be strictly increasing, with entries in [0, C)";
  if (index.is_cpu()) {
    const at::Tensor values = index.contiguous();
    const int64_t* k = values.const_data_ptr<int64_t>();
    const int64_t n = values.numel();
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(
          k[i] >= 0 && k[i] < classes && (i == 0 || k[i] > k[i - 1]),
          rule, " (C = ", classes, "), got ", k[i], " at position ", i, i > 0 ? " after " : "",
          i > 0 ? std::to_string(k[i - 1]) : std::string());
    }
  } else {
    // On the device: no host synchronisation, as cross_entropy's label check.
    const int64_t n = index.numel();
    const at::Tensor ordered = at::all(at::gt(index.narrow(0, 1, n - 1), index.narrow(0, 0, n - 1)));
    const at::Tensor in_range = at::logical_and(at::ge(index[0], 0), at::lt(index[n - 1], classes));
    at::_assert_async(at::logical_and(ordered, in_range), rule);
  }
}

void check_row_lse_backward_inputs(
    const char* op,
    const at::Tensor& grad_losses, // (B,)
    const at::Tensor& features, // (B, D)
    const at::Tensor& row_lse) { // (B, 2)
  TORCH_CHECK(grad_losses.defined() && row_lse.defined(), op, ": grad_losses and row_lse must be tensors");
  TORCH_SYM_CHECK(
      grad_losses.dim() == 1 ? grad_losses.sym_size(0).sym_eq(features.sym_size(0)) : c10::SymBool(false),
      op, ": grad_losses must have shape (B,) with B = ", features.sym_size(0), ", got ", grad_losses.sym_sizes());
  TORCH_SYM_CHECK(
      row_lse.dim() == 2 ? row_lse.sym_size(0).sym_eq(features.sym_size(0)).sym_and(row_lse.sym_size(1).sym_eq(2))
                         : c10::SymBool(false),
      op, ": row_lse must have shape (B, 2) with B = ", features.sym_size(0), ", got ", row_lse.sym_sizes());
  TORCH_CHECK(
      row_lse.scalar_type() == at::toOpMathType(features.scalar_type()),
      op, ": row_lse must be ", at::toOpMathType(features.scalar_type()), ", got ", row_lse.scalar_type());
  TORCH_CHECK(
      grad_losses.device() == features.device() && row_lse.device() == features.device(),
      op, ": grad_losses and row_lse must be on the device of features");
}

void check_anchor_diagonal_tiles(
    const std::optional<at::Tensor>& diagonal_tiles, // (B, kCpuTile)?
    const at::Tensor& features, // (B, D)
    bool has_ref) {
  if (!is_given(diagonal_tiles)) return;
  constexpr const char* op = "circle::_anchor_loss_backward";
  const at::Tensor& tiles = *diagonal_tiles;
  TORCH_CHECK(
      !has_ref,
      op, ": diagonal_tiles are tiles of S = features featuresᵀ, made without a reference set; got ref_features too");
  TORCH_SYM_CHECK(
      tiles.dim() == 2 ? tiles.sym_size(0).sym_eq(features.sym_size(0)).sym_and(tiles.sym_size(1).sym_eq(kCpuTile))
                       : c10::SymBool(false),
      op, ": diagonal_tiles must have shape (B, ", kCpuTile, ") with B = ", features.sym_size(0), ", got ",
      tiles.sym_sizes());
  TORCH_CHECK(
      tiles.scalar_type() == at::toOpMathType(features.scalar_type()),
      op, ": diagonal_tiles must be ", at::toOpMathType(features.scalar_type()), ", got ", tiles.scalar_type());
  TORCH_CHECK(
      tiles.device() == features.device(),
      op, ": diagonal_tiles must be on the device of features, got ", tiles.device(), " and ", features.device());
}

void check_block_inputs(const BlockArgs& args) {
  const auto& [rows, row_labels, cols, col_labels, margin, gamma] = args;
  check_inputs({rows, row_labels, margin, gamma});
  check_inputs({cols, col_labels, margin, gamma});
  TORCH_SYM_CHECK(
      rows.sym_size(1).sym_eq(cols.sym_size(1)),
      "circle: rows and cols must have the same width D, got ",
      rows.sym_size(1),
      " and ",
      cols.sym_size(1));
  TORCH_CHECK(
      rows.scalar_type() == cols.scalar_type() && rows.device() == cols.device(),
      "circle: rows and cols must share dtype and device, got ",
      rows.scalar_type(),
      " on ",
      rows.device(),
      " and ",
      cols.scalar_type(),
      " on ",
      cols.device());
}

void check_partials(const at::Tensor& partials) {
  TORCH_CHECK(
      partials.dim() == 2 && partials.size(1) == 4 && partials.scalar_type() == at::kDouble,
      "circle::_lse_finish: partials must be a float64 tensor of shape (n, 4), got ",
      partials.scalar_type(),
      " of shape ",
      partials.sizes());
}

void check_scalars(const at::Tensor& scalars, const c10::Device& device) {
  TORCH_CHECK(
      scalars.dim() == 1 && scalars.size(0) == 4 && scalars.scalar_type() == at::kDouble &&
          scalars.device() == device,
      "circle::_block_grad: scalars must be the float64 (4,) tensor from _lse_finish on ",
      device,
      ", got ",
      scalars.scalar_type(),
      " of shape ",
      scalars.sizes(),
      " on ",
      scalars.device());
}

} // namespace circle_loss
