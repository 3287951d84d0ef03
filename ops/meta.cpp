// Meta kernels: shapes and dtypes only, written with symbolic sizes so that
// fake tensors, torch.compile(dynamic=True) and torch.export need no
// Python-side registration.
#include "circle_loss.h"

#include <ATen/OpMathType.h>
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> anchor_loss_forward_meta(
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    const std::optional<at::Tensor>& ref_features, // (M, D)?
    const std::optional<at::Tensor>& ref_labels, // (M,)?
    double margin,
    double gamma,
    const std::optional<at::Tensor>& ref_self_index, // (B,)?
    bool keep_diagonal_tiles) {
  check_anchor_inputs(features, labels, ref_features, ref_labels, margin, gamma, ref_self_index);
  const c10::SymInt batch = features.sym_size(0);
  const at::TensorOptions accumulation = features.options().dtype(at::toOpMathType(features.scalar_type()));
  const bool diagonal = keep_diagonal_tiles && !is_given(ref_features);
  return {
      at::empty_symint({batch}, features.options()),
      at::empty_symint({batch, 2}, accumulation),
      at::empty_symint({diagonal ? batch : c10::SymInt(0), c10::SymInt(kCpuTile)}, accumulation)};
}

std::tuple<at::Tensor, at::Tensor> anchor_loss_backward_meta(
    const at::Tensor& grad_losses, // (B,)
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    const std::optional<at::Tensor>& ref_features, // (M, D)?
    const std::optional<at::Tensor>& ref_labels, // (M,)?
    const at::Tensor& row_lse, // (B, 2)
    double margin,
    double gamma,
    const std::optional<at::Tensor>& ref_self_index, // (B,)?
    bool ref_grad,
    const std::optional<at::Tensor>& diagonal_tiles) { // (B, kCpuTile)?
  check_anchor_inputs(features, labels, ref_features, ref_labels, margin, gamma, ref_self_index);
  check_row_lse_backward_inputs("circle::_anchor_loss_backward", grad_losses, features, row_lse);
  const bool has_ref = is_given(ref_features);
  check_anchor_diagonal_tiles(diagonal_tiles, features, has_ref);
  return {
      at::empty_symint(features.sym_sizes(), features.options()),
      has_ref && ref_grad ? at::empty_symint(ref_features->sym_sizes(), features.options())
                          : at::empty_symint({0, features.sym_size(1)}, features.options())};
}

std::tuple<at::Tensor, at::Tensor> anchor_loss_with_row_grads_meta(
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    const at::Tensor& ref_features, // (M, D)
    const at::Tensor& ref_labels, // (M,)
    double margin,
    double gamma,
    const std::optional<at::Tensor>& ref_self_index) { // (B,)?
  check_anchor_inputs(features, labels, ref_features, ref_labels, margin, gamma, ref_self_index);
  return {
      at::empty_symint({features.sym_size(0)}, features.options()),
      at::empty_symint(features.sym_sizes(), features.options().dtype(at::toOpMathType(features.scalar_type())))};
}

std::tuple<at::Tensor, at::Tensor> class_loss_forward_meta(
    const at::Tensor& features, // (B, D)
    const at::Tensor& labels, // (B,)
    const at::Tensor& weight, // (C, D)
    double margin,
    double gamma) {
  check_class_inputs(features, labels, weight, margin, gamma);
  const c10::SymInt batch = features.sym_size(0);
  return {
      at::empty_symint({batch}, features.options()),
      at::empty_symint({batch, 2}, features.options().dtype(at::toOpMathType(features.scalar_type())))};
}

std::tuple<at::Tensor, at::Tensor> class_loss_backward_meta(
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
  const c10::SymInt dim = features.sym_size(1);
  return {
      features_grad ? at::empty_symint(features.sym_sizes(), features.options())
                    : at::empty_symint({0, dim}, features.options()),
      weight_grad ? at::empty_symint(weight.sym_sizes(), features.options())
                  : at::empty_symint({0, dim}, features.options())};
}

} // namespace

TORCH_LIBRARY_IMPL(circle, Meta, m) {
  m.impl("_class_loss_forward", &class_loss_forward_meta);
  m.impl("_class_loss_backward", &class_loss_backward_meta);
  m.impl("_anchor_loss_forward", &anchor_loss_forward_meta);
  m.impl("_anchor_loss_backward", &anchor_loss_backward_meta);
  m.impl("_anchor_loss_with_row_grads", &anchor_loss_with_row_grads_meta);
  m.impl("loss", &loss_meta);
  m.impl("_loss_with_grad", &loss_with_grad_meta);
  m.impl("_lse_partials", &lse_partials_meta);
  m.impl("_lse_finish", &lse_finish_meta);
  m.impl("_block_grad", &block_grad_meta);
}

} // namespace circle_loss
