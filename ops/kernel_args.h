// The ops' arguments as their kernels take them. The dispatcher calls every
// backend's kernel with the op's schema as a flat argument list; the
// adapters below gather that list into one of these structs and check it
// against the op's input contract (checks.cpp) before the kernel runs. So
// each op's signature and the shapes of its tensors are written here once,
// and no kernel (CPU, CUDA, Meta, Autograd) runs on unchecked inputs:
//   register_class_kernels<class_loss_forward_cpu, class_loss_backward_cpu>(m);
#pragma once

#include "circle_loss.h"

#include <torch/library.h>

#include <optional>

namespace circle_loss {

// The input contracts (docs/math.md, "Inputs") follow each struct: anything
// outside them is refused with an error that names the argument. The Meta
// kernels check too, so eager calls and traced graphs (fake tensors,
// symbolic sizes) refuse the same inputs alike.

// circle::loss and _loss_with_grad.
struct LossArgs {
  const at::Tensor& features; // (B, D)
  const at::Tensor& labels; // (B,)
  double margin, gamma;
};
// features float32, float64, float16 or bfloat16, with integer labels on its
// device; margin and gamma finite, with no logit slope beyond the
// accumulation dtype.
void check_inputs(const LossArgs& args);

// _lse_partials and _block_grad: the pairs rows × cols.
struct BlockArgs {
  const at::Tensor& rows; // (R, D)
  const at::Tensor& row_labels; // (R,)
  const at::Tensor& cols; // (C, D)
  const at::Tensor& col_labels; // (C,)
  double margin, gamma;
};
// Both blocks as check_inputs requires, with the same width, dtype and device.
void check_block_inputs(const BlockArgs& args);

// circle::anchor_loss and the private ops behind it.
struct AnchorArgs {
  const at::Tensor& features; // (B, D)
  const at::Tensor& labels; // (B,)
  const std::optional<at::Tensor>& ref_features; // (M, D)?
  const std::optional<at::Tensor>& ref_labels; // (M,)?
  double margin, gamma;
  const std::optional<at::Tensor>& ref_self_index; // (B,)?

  bool has_ref() const {
    return is_given(ref_features);
  }
};
// features and labels as check_inputs requires; ref_features and
// ref_labels both given or both absent, and then as check_inputs requires,
// with features' width, dtype and device; ref_self_index only with them,
// integer, one entry per row of features, on features' device (its values
// are not checked: one outside [0, M) leaves no pair out, and checking them
// would wait for the device).
void check_anchor_inputs(const AnchorArgs& args);

// circle::class_loss and the private ops behind it.
constexpr double kNormalizeEps = 1e-12; // torch.nn.functional.normalize's eps, as normalize takes it
struct ClassArgs {
  const at::Tensor& features; // (B, D)
  const at::Tensor& labels; // (B,)
  const at::Tensor& weight; // (C, D)
  double margin, gamma;
  bool normalize; // cosine similarities: rows and classes L2-normalised inside
  const std::optional<at::Tensor>& class_index; // (K,)?: the columns are weight[class_index]

  // The number of columns: K with a class index, else C.
  int64_t columns() const {
    return is_given(class_index) ? class_index->size(0) : weight.size(0);
  }
};
// features and labels as check_inputs requires; weight floating, with
// features' width and device; class_index integer and 1-D on that device.
// Its values (strictly increasing, in [0, C)) are the backend's to check:
// the CPU's at once, CUDA's by an asynchronous device-side assert
// (check_class_index_values).
void check_class_inputs(const ClassArgs& args);
// class_index's values: strictly increasing and in [0, C), so that each
// class is one column and each row of weight's gradient has one writer.
void check_class_index_values(const ClassArgs& args);

// The adapters, one per flat signature of the schema (registration.cpp).
// Each takes the kernel it calls as a template argument, so a registration
// names the adapter and the backend's kernel, and the adapter is the
// function the dispatcher calls.

template <auto kernel> // loss (LossArgs)
auto loss_kernel(const at::Tensor& features, const at::Tensor& labels, double margin, double gamma) {
  const LossArgs args{features, labels, margin, gamma};
  check_inputs(args);
  return kernel(args);
}

// The loss alone and (loss, dloss/dfeatures), for loss and _loss_with_grad,
// from a backend's one kernel loss_and_grad(args, with_grad).
template <auto loss_and_grad>
at::Tensor loss_alone(const LossArgs& args) {
  return std::get<0>(loss_and_grad(args, /*with_grad=*/false));
}
template <auto loss_and_grad>
std::tuple<at::Tensor, at::Tensor> loss_with_grad(const LossArgs& args) {
  return loss_and_grad(args, /*with_grad=*/true);
}

template <auto kernel> // _lse_partials (BlockArgs)
at::Tensor lse_partials_kernel(
    const at::Tensor& rows, const at::Tensor& row_labels, const at::Tensor& cols, const at::Tensor& col_labels,
    double margin, double gamma) {
  const BlockArgs args{rows, row_labels, cols, col_labels, margin, gamma};
  check_block_inputs(args);
  return kernel(args);
}

template <auto kernel> // _block_grad (BlockArgs, scalars (4,) from _lse_finish)
at::Tensor block_grad_kernel(
    const at::Tensor& rows, const at::Tensor& row_labels, const at::Tensor& cols, const at::Tensor& col_labels,
    const at::Tensor& scalars, double margin, double gamma) {
  const BlockArgs args{rows, row_labels, cols, col_labels, margin, gamma};
  check_block_inputs(args);
  check_scalars(scalars, rows.device());
  return kernel(args, scalars);
}

template <auto kernel> // anchor_loss (AnchorArgs)
at::Tensor anchor_loss_kernel(
    const at::Tensor& features, const at::Tensor& labels, const std::optional<at::Tensor>& ref_features,
    const std::optional<at::Tensor>& ref_labels, double margin, double gamma,
    const std::optional<at::Tensor>& ref_self_index) {
  const AnchorArgs args{features, labels, ref_features, ref_labels, margin, gamma, ref_self_index};
  check_anchor_inputs(args);
  return kernel(args);
}

template <auto kernel> // _anchor_loss_forward (AnchorArgs, keep_diagonal_tiles)
std::tuple<at::Tensor, at::Tensor, at::Tensor> anchor_loss_forward_kernel(
    const at::Tensor& features, const at::Tensor& labels, const std::optional<at::Tensor>& ref_features,
    const std::optional<at::Tensor>& ref_labels, double margin, double gamma,
    const std::optional<at::Tensor>& ref_self_index, bool keep_diagonal_tiles) {
  const AnchorArgs args{features, labels, ref_features, ref_labels, margin, gamma, ref_self_index};
  check_anchor_inputs(args);
  return kernel(args, keep_diagonal_tiles);
}

// _anchor_loss_backward (grad_losses (B,), AnchorArgs, row_lse (B, 2),
// ref_grad, diagonal_tiles (B, kCpuTile)?)
template <auto kernel>
std::tuple<at::Tensor, at::Tensor> anchor_loss_backward_kernel(
    const at::Tensor& grad_losses, const at::Tensor& features, const at::Tensor& labels,
    const std::optional<at::Tensor>& ref_features, const std::optional<at::Tensor>& ref_labels,
    const at::Tensor& row_lse, double margin, double gamma, const std::optional<at::Tensor>& ref_self_index,
    bool ref_grad, const std::optional<at::Tensor>& diagonal_tiles) {
  const AnchorArgs args{features, labels, ref_features, ref_labels, margin, gamma, ref_self_index};
  check_anchor_inputs(args);
  check_row_lse_backward_inputs("circle::_anchor_loss_backward", grad_losses, features, row_lse);
  check_anchor_diagonal_tiles(diagonal_tiles, features, args.has_ref());
  return kernel(grad_losses, args, row_lse, ref_grad, diagonal_tiles);
}

template <auto kernel> // _anchor_loss_with_row_grads (AnchorArgs with a reference set)
std::tuple<at::Tensor, at::Tensor> anchor_loss_with_row_grads_kernel(
    const at::Tensor& features, const at::Tensor& labels, const at::Tensor& ref_features,
    const at::Tensor& ref_labels, double margin, double gamma, const std::optional<at::Tensor>& ref_self_index) {
  const std::optional<at::Tensor> refs(ref_features);
  const std::optional<at::Tensor> ref_ids(ref_labels);
  const AnchorArgs args{features, labels, refs, ref_ids, margin, gamma, ref_self_index};
  check_anchor_inputs(args);
  return kernel(args);
}

template <auto kernel> // class_loss and _class_loss_forward (ClassArgs)
auto class_kernel(
    const at::Tensor& features, const at::Tensor& labels, const at::Tensor& weight, double margin, double gamma,
    bool normalize, const std::optional<at::Tensor>& class_index) {
  const ClassArgs args{features, labels, weight, margin, gamma, normalize, class_index};
  check_class_inputs(args);
  return kernel(args);
}

// _class_loss_backward (grad_losses (B,), ClassArgs, row_lse (B, 2), which
// gradients to form)
template <auto kernel>
std::tuple<at::Tensor, at::Tensor> class_loss_backward_kernel(
    const at::Tensor& grad_losses, const at::Tensor& features, const at::Tensor& labels, const at::Tensor& weight,
    const at::Tensor& row_lse, double margin, double gamma, bool normalize,
    const std::optional<at::Tensor>& class_index, bool features_grad, bool weight_grad) {
  const ClassArgs args{features, labels, weight, margin, gamma, normalize, class_index};
  check_class_inputs(args);
  check_row_lse_backward_inputs("circle::_class_loss_backward", grad_losses, features, row_lse);
  return kernel(grad_losses, args, row_lse, features_grad, weight_grad);
}

// A backend's kernels of each form, registered under the schema's names.
template <auto loss_and_grad, auto lse_partials, auto lse_finish, auto block_grad>
void register_global_kernels(torch::Library& m) {
  m.impl("loss", loss_kernel<loss_alone<loss_and_grad>>);
  m.impl("_loss_with_grad", loss_kernel<loss_with_grad<loss_and_grad>>);
  m.impl("_lse_partials", lse_partials_kernel<lse_partials>);
  m.impl("_lse_finish", lse_finish); // partials: checked by the CPU and CUDA kernels
  m.impl("_block_grad", block_grad_kernel<block_grad>);
}

template <auto forward, auto backward, auto with_row_grads>
void register_anchor_kernels(torch::Library& m) {
  m.impl("_anchor_loss_forward", anchor_loss_forward_kernel<forward>);
  m.impl("_anchor_loss_backward", anchor_loss_backward_kernel<backward>);
  m.impl("_anchor_loss_with_row_grads", anchor_loss_with_row_grads_kernel<with_row_grads>);
}

template <auto forward, auto backward>
void register_class_kernels(torch::Library& m) {
  m.impl("_class_loss_forward", class_kernel<forward>);
  m.impl("_class_loss_backward", class_loss_backward_kernel<backward>);
}

// The ops that kernels call through the dispatcher (autograd's, the
// composite ones, CUDA's class-level ones), below the Autograd key
// (calls.cpp).
at::Tensor call_loss(const LossArgs& args);
std::tuple<at::Tensor, at::Tensor> call_loss_with_grad(const LossArgs& args);
at::Tensor call_loss_backward(const at::Tensor& grad_loss, const at::Tensor& grad_features);
std::tuple<at::Tensor, at::Tensor, at::Tensor> call_anchor_loss_forward(
    const AnchorArgs& args, bool keep_diagonal_tiles);
std::tuple<at::Tensor, at::Tensor> call_anchor_loss_backward(
    const at::Tensor& grad_losses, const AnchorArgs& args, const at::Tensor& row_lse, bool ref_grad,
    const std::optional<at::Tensor>& diagonal_tiles);
std::tuple<at::Tensor, at::Tensor> call_anchor_loss_with_row_grads(const AnchorArgs& args);
std::tuple<at::Tensor, at::Tensor> call_class_loss_forward(const ClassArgs& args);
std::tuple<at::Tensor, at::Tensor> call_class_loss_backward(
    const at::Tensor& grad_losses, const ClassArgs& args, const at::Tensor& row_lse, bool features_grad,
    bool weight_grad);

} // namespace circle_loss
