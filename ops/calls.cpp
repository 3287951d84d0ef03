// The ops that kernels call through the dispatcher, each op's typed handle
// looked up once. The calls run below the Autograd key: autograd's kernels
// call the ops that make their forward and backward, the composite kernels
// and CUDA's class-level kernels the ops they are made of.
#include "kernel_args.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace circle_loss {
namespace {

using Tensor = at::Tensor;
using OptionalTensor = std::optional<at::Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

template <typename Signature, typename... Args>
auto call_below_autograd(const c10::TypedOperatorHandle<Signature>& op, const Args&... args) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(args...);
}

} // namespace

Tensor call_loss(const LossArgs& a) {
  static const auto op = find_op<Tensor(const Tensor&, const Tensor&, double, double)>("circle::loss");
  return call_below_autograd(op, a.features, a.labels, a.margin, a.gamma);
}

std::tuple<Tensor, Tensor> call_loss_with_grad(const LossArgs& a) {
  static const auto op =
      find_op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, double, double)>("circle::_loss_with_grad");
  return call_below_autograd(op, a.features, a.labels, a.margin, a.gamma);
}

Tensor call_loss_backward(const Tensor& grad_loss, const Tensor& grad_features) {
  static const auto op = find_op<Tensor(const Tensor&, const Tensor&)>("circle::_loss_backward");
  return call_below_autograd(op, grad_loss, grad_features);
}

std::tuple<Tensor, Tensor, Tensor> call_anchor_loss_forward(const AnchorArgs& a, bool keep_diagonal_tiles) {
  static const auto op = find_op<std::tuple<Tensor, Tensor, Tensor>(
      const Tensor&, const Tensor&, const OptionalTensor&, const OptionalTensor&, double, double,
      const OptionalTensor&, bool)>("circle::_anchor_loss_forward");
  return call_below_autograd(
      op, a.features, a.labels, a.ref_features, a.ref_labels, a.margin, a.gamma, a.ref_self_index,
      keep_diagonal_tiles);
}

std::tuple<Tensor, Tensor> call_anchor_loss_backward(
    const Tensor& grad_losses, const AnchorArgs& a, const Tensor& row_lse, bool ref_grad,
    const OptionalTensor& diagonal_tiles) {
  static const auto op = find_op<std::tuple<Tensor, Tensor>(
      const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&, const OptionalTensor&, const Tensor&,
      double, double, const OptionalTensor&, bool, const OptionalTensor&)>("circle::_anchor_loss_backward");
  return call_below_autograd(
      op, grad_losses, a.features, a.labels, a.ref_features, a.ref_labels, row_lse, a.margin, a.gamma,
      a.ref_self_index, ref_grad, diagonal_tiles);
}

std::tuple<Tensor, Tensor> call_anchor_loss_with_row_grads(const AnchorArgs& a) {
  static const auto op = find_op<std::tuple<Tensor, Tensor>(
      const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, double, const OptionalTensor&)>(
      "circle::_anchor_loss_with_row_grads");
  return call_below_autograd(
      op, a.features, a.labels, *a.ref_features, *a.ref_labels, a.margin, a.gamma, a.ref_self_index);
}

std::tuple<Tensor, Tensor> call_class_loss_forward(const ClassArgs& a) {
  static const auto op = find_op<std::tuple<Tensor, Tensor>(
      const Tensor&, const Tensor&, const Tensor&, double, double, bool, const OptionalTensor&)>(
      "circle::_class_loss_forward");
  return call_below_autograd(op, a.features, a.labels, a.weight, a.margin, a.gamma, a.normalize, a.class_index);
}

std::tuple<Tensor, Tensor> call_class_loss_backward(
    const Tensor& grad_losses, const ClassArgs& a, const Tensor& row_lse, bool features_grad, bool weight_grad) {
  static const auto op = find_op<std::tuple<Tensor, Tensor>(
      const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, double, bool,
      const OptionalTensor&, bool, bool)>("circle::_class_loss_backward");
  return call_below_autograd(
      op, grad_losses, a.features, a.labels, a.weight, row_lse, a.margin, a.gamma, a.normalize, a.class_index,
      features_grad, weight_grad);
}

} // namespace circle_loss
