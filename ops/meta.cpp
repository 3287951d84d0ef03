// Meta kernels: shapes and dtypes only, written with symbolic sizes so that
// fake tensors, torch.compile(dynamic=True) and torch.export need no
// Python-side registration.
#include "kernel_args.h"

#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace circle_loss {
namespace {

std::tuple<at::Tensor, at::Tensor> loss_and_grad_meta(const LossArgs& args, bool with_grad) {
  const at::Tensor& features = args.features;
  return {
      at::empty({}, features.options()),
      with_grad ? at::empty_symint(features.sym_sizes(), features.options()) : at::Tensor()};
}

at::Tensor lse_partials_meta(const BlockArgs& args) {
  return at::empty({4}, args.rows.options().dtype(at::kDouble));
}

at::Tensor lse_finish_meta(const at::Tensor& partials) { // (n, 4)
  return at::empty({4}, partials.options());
}

at::Tensor block_grad_meta(const BlockArgs& args, const at::Tensor& /*scalars*/) {
  const at::Tensor& rows = args.rows;
  return at::empty_symint(rows.sym_sizes(), rows.options().dtype(at::toOpMathType(rows.scalar_type())));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> anchor_loss_forward_meta(
    const AnchorArgs& args, bool keep_diagonal_tiles) {
  const at::Tensor& features = args.features;
  const c10::SymInt batch = features.sym_size(0);
  const at::TensorOptions accumulation = features.options().dtype(at::toOpMathType(features.scalar_type()));
  const bool diagonal = keep_diagonal_tiles && !args.has_ref();
  return {
      at::empty_symint({batch}, features.options()),
      at::empty_symint({batch, 2}, accumulation),
      at::empty_symint({diagonal ? batch : c10::SymInt(0), c10::SymInt(kCpuTile)}, accumulation)};
}

std::tuple<at::Tensor, at::Tensor> anchor_loss_backward_meta(
    const at::Tensor& /*grad_losses*/, const AnchorArgs& args, const at::Tensor& /*row_lse*/, bool ref_grad,
    const std::optional<at::Tensor>& /*diagonal_tiles*/) {
  const at::Tensor& features = args.features;
  return {
      at::empty_symint(features.sym_sizes(), features.options()),
      args.has_ref() && ref_grad ? at::empty_symint(args.ref_features->sym_sizes(), features.options())
                                 : at::empty_symint({0, features.sym_size(1)}, features.options())};
}

std::tuple<at::Tensor, at::Tensor> anchor_loss_with_row_grads_meta(const AnchorArgs& args) {
  const at::Tensor& features = args.features;
  return {
      at::empty_symint({features.sym_size(0)}, features.options()),
      at::empty_symint(features.sym_sizes(), features.options().dtype(at::toOpMathType(features.scalar_type())))};
}

std::tuple<at::Tensor, at::Tensor> class_loss_forward_meta(const ClassArgs& args) {
  const at::Tensor& features = args.features;
  const c10::SymInt batch = features.sym_size(0);
  return {
      at::empty_symint({batch}, features.options()),
      at::empty_symint({batch, 2}, features.options().dtype(at::toOpMathType(features.scalar_type())))};
}

std::tuple<at::Tensor, at::Tensor> class_loss_backward_meta(
    const at::Tensor& /*grad_losses*/, const ClassArgs& args, const at::Tensor& /*row_lse*/, bool features_grad,
    bool weight_grad) {
  const at::Tensor& features = args.features;
  const c10::SymInt dim = features.sym_size(1);
  return {
      features_grad ? at::empty_symint(features.sym_sizes(), features.options())
                    : at::empty_symint({0, dim}, features.options()),
      weight_grad ? at::empty_symint(args.weight.sym_sizes(), args.weight.options())
                  : at::empty_symint({0, dim}, args.weight.options())};
}

} // namespace

TORCH_LIBRARY_IMPL(circle, Meta, m) {
  register_global_kernels<loss_and_grad_meta, lse_partials_meta, lse_finish_meta, block_grad_meta>(m);
  register_anchor_kernels<anchor_loss_forward_meta, anchor_loss_backward_meta, anchor_loss_with_row_grads_meta>(m);
  register_class_kernels<class_loss_forward_meta, class_loss_backward_meta>(m);
}

} // namespace circle_loss
