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

at::Tensor lse_partials_meta(
    const at::Tensor& rows, // (R, D)
    const at::Tensor& row_labels, // (R,)
    const at::Tensor& cols, // (C, D)
    const at::Tensor& col_labels, // (C,)
    double margin,
    double gamma) {
  check_block_inputs(rows, row_labels, cols, col_labels, margin, gamma);
  return at::empty({4}, rows.options().dtype(at::kDouble));
}

at::Tensor lse_finish_meta(const at::Tensor& partials) { // (n, 4)
  return at::empty({4}, partials.options());
}

at::Tensor block_grad_meta(
    const at::Tensor& rows, // (R, D)
    const at::Tensor& row_labels, // (R,)
    const at::Tensor& cols, // (C, D)
    const at::Tensor& col_labels, // (C,)
    const at::Tensor& scalars, // (4,)
    double margin,
    double gamma) {
  check_block_inputs(rows, row_labels, cols, col_labels, margin, gamma);
  const auto accumulate = rows.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return at::empty_symint(rows.sym_sizes(), rows.options().dtype(accumulate));
}

} // namespace

TORCH_LIBRARY_IMPL(circle, Meta, m) {
  m.impl("loss", &loss_meta);
  m.impl("_loss_with_grad", &loss_with_grad_meta);
  m.impl("_lse_partials", &lse_partials_meta);
  m.impl("_lse_finish", &lse_finish_meta);
  m.impl("_block_grad", &block_grad_meta);
}

} // namespace circle_loss
