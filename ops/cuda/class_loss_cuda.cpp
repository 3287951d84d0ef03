// CUDA kernels of circle::class_loss. The class-level loss is the per-anchor
// loss of the rows against the class weights as references labelled 0..C-1
// (docs/math.md, "The class-level form"), so the CUDA kernels are
// circle::anchor_loss's, verified on the H200: its strips of S = F Wᵀ, its
// row states (whose LSE_P is the one positive's logit here) and its
// gradients to both sets. What they spend on it beyond a kernel of its own:
// a C-long int64 label vector (8 bytes a class) and a label compare an
// entry, which a label rule in the tile epilogues would save (the GPU issue).
#include "circle_loss.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/arange.h>
#include <torch/library.h>

namespace circle_loss {
namespace {

at::Tensor class_labels(const at::Tensor& weight, const at::Tensor& labels) {
  return at::arange(weight.size(0), labels.options().dtype(at::kLong));
}

std::tuple<at::Tensor, at::Tensor> class_loss_forward_cuda(
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    const at::Tensor& weight, // (C, D)
    double margin,
    double gamma) {
  check_class_inputs(features, labels, weight, margin, gamma);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("circle::_anchor_loss_forward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, double, double, const std::optional<at::Tensor>&, bool)>();
  auto [losses, row_lse, unused] = op.call(
      features, labels.to(at::kLong), weight, class_labels(weight, labels), margin, gamma, std::nullopt, false);
  return {losses, row_lse};
}

std::tuple<at::Tensor, at::Tensor> class_loss_backward_cuda(
    const at::Tensor& grad_losses, // (B,)
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    const at::Tensor& weight, // (C, D)
    const at::Tensor& row_lse, // (B, 2)
    double margin,
    double gamma,
    bool features_grad,
    bool weight_grad) {
  check_class_inputs(features, labels, weight, margin, gamma);
  check_row_lse_backward_inputs("circle::_class_loss_backward", grad_losses, features, row_lse);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("circle::_anchor_loss_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                           const at::Tensor&, double, double, const std::optional<at::Tensor>&, bool,
                           const std::optional<at::Tensor>&)>();
  // The per-anchor backward forms dF whatever is asked; dW where asked.
  auto [grad_features, grad_weight] = op.call(
      grad_losses, features, labels.to(at::kLong), weight, class_labels(weight, labels), row_lse, margin, gamma,
      std::nullopt, weight_grad, std::nullopt);
  return {features_grad ? grad_features : grad_features.narrow(0, 0, 0), grad_weight};
}

} // namespace

TORCH_LIBRARY_IMPL(circle, CUDA, m) {
  m.impl("_class_loss_forward", &class_loss_forward_cuda);
  m.impl("_class_loss_backward", &class_loss_backward_cuda);
}

} // namespace circle_loss
