// The input contract of circle::loss, checked in one place for every backend.
#include "circle_loss.h"

#include <c10/core/SymBool.h>

namespace circle_loss {

void check_inputs(
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    double margin,
    double gamma) {
  TORCH_CHECK(
      features.dim() == 2,
      "circle::loss: features must be a 2-D tensor of shape (B, D), got ",
      features.dim(),
      " dimension(s)");
  const auto dtype = features.scalar_type();
  TORCH_CHECK(
      dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
          dtype == at::kBFloat16,
      "circle::loss: features must be float32, float64, float16 or bfloat16, got ",
      dtype);
  TORCH_CHECK(
      labels.dim() == 1,
      "circle::loss: labels must be a 1-D tensor of shape (B,), got ",
      labels.dim(),
      " dimension(s)");
  TORCH_CHECK(
      at::isIntegralType(labels.scalar_type(), /*includeBool=*/false),
      "circle::loss: labels must have an integer dtype, got ",
      labels.scalar_type());
  TORCH_SYM_CHECK(
      labels.sym_size(0).sym_eq(features.sym_size(0)),
      "circle::loss: labels must have one entry per row of features: features has ",
      features.sym_size(0),
      " rows but labels has ",
      labels.sym_size(0),
      " entries");
  TORCH_CHECK(
      labels.device() == features.device(),
      "circle::loss: labels must be on the same device as features, got labels on ",
      labels.device(),
      " and features on ",
      features.device());
  TORCH_CHECK(
      std::isfinite(margin),
      "circle::loss: margin must be a finite float, got ",
      margin);
  TORCH_CHECK(
      std::isfinite(gamma),
      "circle::loss: gamma must be a finite float, got ",
      gamma);
}

void check_block_inputs(
    const at::Tensor& rows,
    const at::Tensor& row_labels,
    const at::Tensor& cols,
    const at::Tensor& col_labels,
    double margin,
    double gamma) {
  check_inputs(rows, row_labels, margin, gamma);
  check_inputs(cols, col_labels, margin, gamma);
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
