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

} // namespace circle_loss
