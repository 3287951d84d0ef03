// Meta kernels: shapes and dtypes only, written with symbolic sizes so that
// fake tensors, torch.compile(dynamic=True) and torch.export need no
// Python-side registration.
#include "circle_loss.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace circle_loss {
namespace {

at::Tensor loss_meta(
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    double margin,
    double gamma) {
  check_inputs(features, labels, margin, gamma);
  return at::empty({}, features.options());
}

std::tuple<at::Tensor, at::Tensor> loss_with_grad_meta(
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    double margin,
    double gamma) {
  check_inputs(features, labels, margin, gamma);
  return {
      at::empty({}, features.options()),
      at::empty_symint(features.sym_sizes(), features.options())};
}

} // namespace

TORCH_LIBRARY_IMPL(circle, Meta, m) {
  m.impl("loss", &loss_meta);
  m.impl("_loss_with_grad", &loss_with_grad_meta);
}

} // namespace circle_loss
