// circle::_normalize_rows: rows scaled to unit norm, y = x / max(‖x‖, eps),
// as torch.nn.functional.normalize(x, dim=1) computes it, for the (C, D)
// class weights the class-level modules normalise every step. Autograd's
// backward of normalize (a division by an expanded norm) holds several (C, D)
// temporaries; the gradient written out,
//   dx = (dy - y·⟨y, dy⟩) / max(‖x‖, eps)     (⟨y, dy⟩ = 0 where ‖x‖ ≤ eps),
// holds one, and reads y, which the op that follows keeps anyway.
#include "circle_loss.h"

#include <ATen/ops/addcmul.h>
#include <ATen/ops/clamp_min.h>
#include <ATen/ops/div.h>
#include <ATen/ops/einsum.h>
#include <ATen/ops/gt.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace circle_loss {
namespace {

constexpr double kEps = 1e-12; // torch.nn.functional.normalize's default

void check_rows_input(const at::Tensor& x) {
  TORCH_CHECK(x.defined() && x.dim() == 2, "circle::_normalize_rows: x must be a 2-D tensor (N, D)");
  TORCH_CHECK(x.is_floating_point(), "circle::_normalize_rows: x must be floating, got ", x.scalar_type());
}

// (N, 1) norms, clamped below at eps.
at::Tensor clamped_norms(const at::Tensor& x) {
  return at::clamp_min(at::linalg_vector_norm(x, 2, {1}, /*keepdim=*/true), kEps);
}

at::Tensor normalize_rows(const at::Tensor& x) { // (N, D)
  check_rows_input(x);
  return at::div(x, clamped_norms(x));
}

class NormalizeRowsFunction : public torch::autograd::Function<NormalizeRowsFunction> {
 public:
  static constexpr bool is_traceable = true;

  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::Tensor norms = clamped_norms(x); // (N, 1)
    at::Tensor y = at::div(x, norms);
    ctx->save_for_backward({y, norms, at::gt(norms, kEps)});
    return y;
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grad_outputs) {
    TORCH_CHECK(
        !at::GradMode::is_enabled(),
        "circle::_normalize_rows does not support double backward. Call backward or torch.autograd.grad without "
        "create_graph=True.");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& y = saved[0];
    const at::Tensor& norms = saved[1];
    const at::Tensor& scaled = saved[2]; // rows whose norm was not clamped
    const at::Tensor& dy = grad_outputs[0];
    // ⟨y_i, dy_i⟩ a row, (N, 1), without an (N, D) product in between.
    const at::Tensor along = at::where(scaled, at::einsum("nd,nd->n", {y, dy}).unsqueeze(1), 0);
    at::Tensor dx = at::addcmul(dy, y, along, -1);
    return {dx.div_(norms)};
  }
};

at::Tensor normalize_rows_autograd(const at::Tensor& x) {
  check_rows_input(x);
  TORCH_CHECK(
      !x._fw_grad(/*level=*/0).defined(),
      "circle::_normalize_rows does not support forward-mode AD; use torch.nn.functional.normalize there");
  return NormalizeRowsFunction::apply(x);
}

} // namespace

TORCH_LIBRARY_IMPL(circle, CompositeExplicitAutograd, m) {
  m.impl("_normalize_rows", &normalize_rows);
}

TORCH_LIBRARY_IMPL(circle, Autograd, m) {
  m.impl("_normalize_rows", &normalize_rows_autograd);
}

} // namespace circle_loss
