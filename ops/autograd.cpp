// The autograd kernel of circle::loss: a traceable C++ autograd Function at the
// Autograd key that redispatches below autograd, so eager mode, TorchScript,
// AOTAutograd (torch.compile, torch.export) and compiled autograd all see the
// same two registered ops: _loss_with_grad forward, _loss_backward backward.
#include <ATen/core/dispatch/Dispatcher.h>
#include "circle_loss.h"

#include <ATen/ops/mul.h>
#include <ATen/ops/sum.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace circle_loss {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor loss_below_autograd(
    const at::Tensor& features,
    const at::Tensor& labels,
    double margin,
    double gamma) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("circle::loss", "")
                       .typed<at::Tensor(
                           const at::Tensor&, const at::Tensor&, double, double)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(features, labels, margin, gamma);
}

std::tuple<at::Tensor, at::Tensor> loss_with_grad_below_autograd(
    const at::Tensor& features,
    const at::Tensor& labels,
    double margin,
    double gamma) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("circle::_loss_with_grad", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, double, double)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(features, labels, margin, gamma);
}

class CircleLossFunction : public torch::autograd::Function<CircleLossFunction> {
 public:
  // Lets compiled autograd trace the backward instead of falling back.
  static constexpr bool is_traceable = true;

  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& features, // (B, D)
      const at::Tensor& labels, // (B,)
      double margin,
      double gamma) {
    auto [loss, grad_features] = loss_with_grad_below_autograd(features, labels, margin, gamma);
    ctx->save_for_backward({grad_features});
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    // The saved gradient was computed in the forward pass with the alphas
    // detached; it carries no graph of its own, so a second derivative taken
    // through it would be silently zero. Refuse instead.
    TORCH_CHECK(
        !at::GradMode::is_enabled(),
        "circle::loss does not support double backward: its gradient is computed "
        "in the forward pass and is not differentiable again. Call backward or "
        "torch.autograd.grad without create_graph=True.");
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("circle::_loss_backward", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
    const auto saved = ctx->get_saved_variables();
    return {op.call(grad_outputs[0], saved[0]), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor loss_autograd(
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    double margin,
    double gamma) {
  // Here first, so that a None argument is named before autograd touches it.
  check_inputs(features, labels, margin, gamma);
  // Forward-mode AD (torch.func.jvp, jacfwd, forward_ad dual tensors) keeps
  // tangents at level 0, as ATen's own autograd kernels read them.
  const at::Tensor tangent = features._fw_grad(/*level=*/0);
  at::Tensor loss;
  at::Tensor grad;
  if (at::GradMode::is_enabled() && features.requires_grad()) {
    // The autograd Function sees the primal alone (it keeps the backward
    // graph); the tangent is handled below.
    loss = CircleLossFunction::apply(
        tangent.defined() ? features._fw_primal(/*level=*/0) : features, labels, margin, gamma);
  } else if (tangent.defined()) {
    std::tie(loss, grad) = loss_with_grad_below_autograd(features, labels, margin, gamma);
  } else {
    // No gradient wanted: the cheaper loss-only kernel.
    return loss_below_autograd(features, labels, margin, gamma);
  }
  if (tangent.defined()) {
    // The loss is a scalar, so its directional derivative is <dloss/dF, tangent>.
    if (!grad.defined()) {
      grad = std::get<1>(loss_with_grad_below_autograd(features, labels, margin, gamma));
    }
    loss._set_fw_grad(at::sum(at::mul(grad, tangent)), /*level=*/0, /*is_inplace_op=*/false);
  }
  return loss;
}

at::Tensor loss_backward(
    const at::Tensor& grad_loss, // ()
    const at::Tensor& grad_features) { // (B, D)
  return at::mul(grad_features, grad_loss);
}

} // namespace

TORCH_LIBRARY_IMPL(circle, Autograd, m) {
  m.impl("loss", &loss_autograd);
}

// Plain ATen arithmetic: one kernel serves every backend, Meta included; CUDA
// has a vectorized one of its own (circle_loss_cuda.cu).
TORCH_LIBRARY_IMPL(circle, CompositeExplicitAutograd, m) {
  m.impl("_loss_backward", &loss_backward);
}

} // namespace circle_loss
