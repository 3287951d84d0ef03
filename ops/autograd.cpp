// The autograd kernels of circle::loss, circle::anchor_loss and
// circle::class_loss: traceable C++ autograd Functions at the Autograd key
// that redispatch below autograd (calls.cpp), so eager mode, TorchScript,
// AOTAutograd (torch.compile, torch.export) and compiled autograd all see
// the same registered ops: _loss_with_grad forward and _loss_backward
// backward; _anchor_loss_forward and _anchor_loss_backward, or, against
// references that need no gradient, _anchor_loss_with_row_grads forward and
// a rescale backward; _class_loss_forward and _class_loss_backward.
#include "kernel_args.h"

#include <ATen/FuncTorchTLS.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sum.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace circle_loss {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// torch.func's transforms cannot run a C++ autograd Function (PyTorch raises
// a generic error that names neither the op nor a way out). The package's
// Python functions and modules take Python autograd Functions of the same
// ops there (python/circle_loss/_func.py); the op called directly says so.
void check_no_func_transform(const char* op, const char* wrapper) {
  // The test torch::autograd::Function::apply makes, asked first so that the
  // error can name the op.
  bool supported = true;
  if (const auto& functorch = at::functorch::functorchTLSAccessor()) {
    try {
      functorch->checkSupportsCppAutogradFunction();
    } catch (const c10::Error&) {
      supported = false;
    }
  }
  TORCH_CHECK(
      supported,
      op, ": torch.func's reverse mode (grad, vjp, jacrev, and vmap over them) cannot run this op's C++ autograd "
      "kernel. Call ", wrapper, " (or the package's modules), which runs under torch.func, or take the gradient "
      "with backward() or torch.autograd.grad.");
}

// Every backward here is made by kernels of its own (or was made in the
// forward) with the inputs detached: it carries no graph, so a second
// derivative taken through it would be silently zero. Refused instead.
void refuse_double_backward(const char* op) {
  TORCH_CHECK(
      !at::GradMode::is_enabled(),
      op, " does not support double backward: its gradient is made by kernels of its own and is not "
      "differentiable again. Call backward or torch.autograd.grad without create_graph=True.");
}

// The tangent of features at forward-mode AD's level (torch.func.jvp,
// jacfwd, forward_ad dual tensors keep it at level 0, as ATen's own autograd
// kernels read it), or an undefined tensor.
at::Tensor tangent_of(const at::Tensor& t) {
  return t._fw_grad(/*level=*/0);
}

class CircleLossFunction : public torch::autograd::Function<CircleLossFunction> {
 public:
  // Lets compiled autograd trace the backward instead of falling back.
  static constexpr bool is_traceable = true;

  // Arguments: LossArgs's.
  static at::Tensor forward(
      AutogradContext* ctx, const at::Tensor& features, const at::Tensor& labels, double margin, double gamma) {
    auto [loss, grad_features] = call_loss_with_grad({features, labels, margin, gamma});
    ctx->save_for_backward({grad_features});
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    refuse_double_backward("circle::loss");
    return {call_loss_backward(grad_outputs[0], ctx->get_saved_variables()[0]), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor loss_autograd(const LossArgs& args) {
  const auto& [features, labels, margin, gamma] = args;
  const at::Tensor tangent = tangent_of(features);
  // The autograd Function and the kernels see the primal alone; the tangent
  // is handled below.
  const LossArgs primal{tangent.defined() ? features._fw_primal(/*level=*/0) : features, labels, margin, gamma};
  at::Tensor loss;
  at::Tensor grad;
  if (at::GradMode::is_enabled() && features.requires_grad()) {
    check_no_func_transform("circle::loss", "circle_loss.circle_loss");
    loss = CircleLossFunction::apply(primal.features, labels, margin, gamma);
  } else if (tangent.defined()) {
    std::tie(loss, grad) = call_loss_with_grad(primal);
  } else {
    // No gradient wanted: the cheaper loss-only kernel.
    return call_loss(args);
  }
  if (tangent.defined()) {
    // The loss is a scalar, so its directional derivative is <dloss/dF, tangent>.
    if (!grad.defined()) {
      grad = std::get<1>(call_loss_with_grad(primal));
    }
    loss._set_fw_grad(at::sum(at::mul(grad, tangent)), /*level=*/0, /*is_inplace_op=*/false);
  }
  return loss;
}

// What a backward needs besides the saved tensors; read back by margin_and_gamma.
void save_margin_and_gamma(AutogradContext* ctx, double margin, double gamma) {
  ctx->saved_data["margin"] = margin;
  ctx->saved_data["gamma"] = gamma;
}

std::pair<double, double> margin_and_gamma(AutogradContext* ctx) {
  return {ctx->saved_data["margin"].toDouble(), ctx->saved_data["gamma"].toDouble()};
}

// The saved optional tensor, or none where the forward had none.
std::optional<at::Tensor> if_given(const at::Tensor& saved) {
  return saved.defined() ? std::optional<at::Tensor>(saved) : std::nullopt;
}

// The optional tensor as autograd saves it: undefined where not given.
at::Tensor or_undefined(const std::optional<at::Tensor>& t) {
  return is_given(t) ? *t : at::Tensor();
}

// circle::anchor_loss: the forward keeps each row's two LSEs, (B, 2), and the
// backward forms the tiles of S again with the incoming gradient, which
// weights each row's pairs (it cannot be folded in ahead of time, as the
// global op's scalar can). On the CPU without a reference set the forward
// also keeps S's tiles on the diagonal, (B, kCpuTile): the backward would
// otherwise form them again, an eighth of its multiply-adds at B = 1024.
class AnchorLossFunction : public torch::autograd::Function<AnchorLossFunction> {
 public:
  static constexpr bool is_traceable = true;

  // Arguments: AnchorArgs's.
  static at::Tensor forward(
      AutogradContext* ctx, const at::Tensor& features, const at::Tensor& labels,
      const std::optional<at::Tensor>& ref_features, const std::optional<at::Tensor>& ref_labels, double margin,
      double gamma, const std::optional<at::Tensor>& ref_self_index) {
    const AnchorArgs args{features, labels, ref_features, ref_labels, margin, gamma, ref_self_index};
    const bool keep_diagonal_tiles = features.device().is_cpu() && !args.has_ref();
    auto [losses, row_lse, diagonal_tiles] = call_anchor_loss_forward(args, keep_diagonal_tiles);
    ctx->save_for_backward(
        {features, labels, or_undefined(ref_features), or_undefined(ref_labels), row_lse,
         or_undefined(ref_self_index), keep_diagonal_tiles ? diagonal_tiles : at::Tensor()});
    save_margin_and_gamma(ctx, margin, gamma);
    return losses;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    refuse_double_backward("circle::anchor_loss");
    const auto saved = ctx->get_saved_variables();
    const std::optional<at::Tensor> ref_features = if_given(saved[2]);
    const std::optional<at::Tensor> ref_labels = if_given(saved[3]);
    const std::optional<at::Tensor> ref_self_index = if_given(saved[5]);
    const auto [margin, gamma] = margin_and_gamma(ctx);
    const AnchorArgs args{saved[0], saved[1], ref_features, ref_labels, margin, gamma, ref_self_index};
    // Edges exist for the given tensors only: ref_features, when given, is
    // the third, after features and labels. A memory bank's rows need no
    // gradient, and then its product is not formed.
    const bool ref_grad = args.has_ref() && ctx->needs_input_grad(2);
    auto [grad_features, grad_ref] =
        call_anchor_loss_backward(grad_outputs[0], args, saved[4], ref_grad, if_given(saved[6]));
    return {grad_features, at::Tensor(), ref_grad ? grad_ref : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

// circle::anchor_loss against references that need no gradient (a memory
// bank): L_i depends on features_i alone, so the forward makes each row's
// dL_i/dfeatures_i with the losses, and the backward scales row i by g_i.
class AnchorLossRowGradsFunction : public torch::autograd::Function<AnchorLossRowGradsFunction> {
 public:
  static constexpr bool is_traceable = true;

  // Arguments: AnchorArgs's, a reference set given: only features is an
  // input of the graph.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& features, const AnchorArgs& args) {
    auto [losses, row_grads] = call_anchor_loss_with_row_grads(
        {features, args.labels, args.ref_features, args.ref_labels, args.margin, args.gamma, args.ref_self_index});
    ctx->save_for_backward({row_grads});
    return losses;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    refuse_double_backward("circle::anchor_loss");
    const at::Tensor row_grads = ctx->get_saved_variables()[0]; // (B, D) in the accumulation dtype
    const at::Tensor& grad_losses = grad_outputs[0]; // (B,) in the losses' dtype, which is features'
    const at::Tensor g = grad_losses.to(row_grads.scalar_type()).unsqueeze(1); // (B, 1)
    return {at::mul(row_grads, g).to(grad_losses.scalar_type()), at::Tensor()};
  }
};

at::Tensor anchor_loss_autograd(const AnchorArgs& args) {
  const auto& [features, labels, ref_features, ref_labels, margin, gamma, ref_self_index] = args;
  const bool has_ref = args.has_ref();
  // Forward-mode AD: against a reference set without a tangent of its own,
  // L_i depends on features_i alone, and its tangent is <dL_i/dfeatures_i,
  // tangent_i>, from the row gradients. Elsewhere each loss depends on other
  // rows of the tangent too, which the kernels do not form.
  const at::Tensor tangent = tangent_of(features);
  TORCH_CHECK(
      !(has_ref && tangent_of(*ref_features).defined()) && (has_ref || !tangent.defined()),
      "circle::anchor_loss does not support forward-mode AD (torch.func.jvp, jacfwd, dual tensors) without a "
      "reference set or with a tangent of ref_features: only a tangent of features against references without one. "
      "Use reverse mode (backward, torch.autograd.grad, torch.func.grad or jacrev) there.");
  const AnchorArgs primal{
      tangent.defined() ? features._fw_primal(/*level=*/0) : features, labels, ref_features, ref_labels, margin,
      gamma, ref_self_index};
  const bool wants_grad =
      at::GradMode::is_enabled() && (features.requires_grad() || (has_ref && ref_features->requires_grad()));
  at::Tensor losses;
  at::Tensor row_grads;
  if (wants_grad) {
    check_no_func_transform("circle::anchor_loss", "circle_loss.anchor_loss");
    if (has_ref && features.requires_grad() && !ref_features->requires_grad()) {
      losses = AnchorLossRowGradsFunction::apply(primal.features, args);
    } else {
      losses = AnchorLossFunction::apply(
          primal.features, labels, ref_features, ref_labels, margin, gamma, ref_self_index);
    }
  } else if (tangent.defined()) {
    std::tie(losses, row_grads) = call_anchor_loss_with_row_grads(primal);
  } else {
    return std::get<0>(call_anchor_loss_forward(args, /*keep_diagonal_tiles=*/false));
  }
  if (tangent.defined()) {
    if (!row_grads.defined()) {
      row_grads = std::get<1>(call_anchor_loss_with_row_grads(primal));
    }
    const at::Tensor directional = at::sum(at::mul(row_grads, tangent.to(row_grads.scalar_type())), {1});
    losses._set_fw_grad(directional.to(losses.scalar_type()), /*level=*/0, /*is_inplace_op=*/false);
  }
  return losses;
}

// circle::class_loss: the forward keeps each row's (zp, LSE_N), (B, 2), and
// the backward forms the tiles of S again with the incoming gradient, for
// features, weight or both, as their edges ask.
class ClassLossFunction : public torch::autograd::Function<ClassLossFunction> {
 public:
  static constexpr bool is_traceable = true;

  // Arguments: ClassArgs's.
  static at::Tensor forward(
      AutogradContext* ctx, const at::Tensor& features, const at::Tensor& labels, const at::Tensor& weight,
      double margin, double gamma, bool normalize, const std::optional<at::Tensor>& class_index) {
    auto [losses, row_lse] =
        call_class_loss_forward({features, labels, weight, margin, gamma, normalize, class_index});
    ctx->save_for_backward({features, labels, weight, row_lse, or_undefined(class_index)});
    save_margin_and_gamma(ctx, margin, gamma);
    ctx->saved_data["normalize"] = normalize;
    return losses;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    refuse_double_backward("circle::class_loss");
    const auto saved = ctx->get_saved_variables();
    // Edges: features, labels, weight, then class_index where given.
    const bool features_grad = ctx->needs_input_grad(0);
    const bool weight_grad = ctx->needs_input_grad(2);
    const auto [margin, gamma] = margin_and_gamma(ctx);
    const std::optional<at::Tensor> class_index = if_given(saved[4]);
    const ClassArgs args{saved[0], saved[1], saved[2], margin, gamma, ctx->saved_data["normalize"].toBool(),
                         class_index};
    auto [grad_features, grad_weight] =
        call_class_loss_backward(grad_outputs[0], args, saved[3], features_grad, weight_grad);
    return {features_grad ? grad_features : at::Tensor(), at::Tensor(), weight_grad ? grad_weight : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor class_loss_autograd(const ClassArgs& args) {
  const auto& [features, labels, weight, margin, gamma, normalize, class_index] = args;
  TORCH_CHECK(
      !tangent_of(features).defined() && !tangent_of(weight).defined(),
      "circle::class_loss does not support forward-mode AD (torch.func.jvp, jacfwd, dual tensors): its kernels "
      "form no directional derivative. Use reverse mode (backward, torch.autograd.grad, or torch.func's grad, vjp "
      "or jacrev through circle_loss.class_loss).");
  if (at::GradMode::is_enabled() && (features.requires_grad() || weight.requires_grad())) {
    check_no_func_transform("circle::class_loss", "circle_loss.class_loss");
    return ClassLossFunction::apply(features, labels, weight, margin, gamma, normalize, class_index);
  }
  return std::get<0>(call_class_loss_forward(args));
}

// The per-row ops' losses alone: their forward's first output, one kernel
// for every backend (CPU, CUDA, Meta).
at::Tensor anchor_loss_composite(const AnchorArgs& args) {
  return std::get<0>(call_anchor_loss_forward(args, /*keep_diagonal_tiles=*/false));
}

at::Tensor class_loss_composite(const ClassArgs& args) {
  return std::get<0>(call_class_loss_forward(args));
}

at::Tensor loss_backward(
    const at::Tensor& grad_loss, // ()
    const at::Tensor& grad_features) { // (B, D)
  return at::mul(grad_features, grad_loss);
}

} // namespace

TORCH_LIBRARY_IMPL(circle, Autograd, m) {
  m.impl("loss", loss_kernel<loss_autograd>);
  m.impl("anchor_loss", anchor_loss_kernel<anchor_loss_autograd>);
  m.impl("class_loss", class_kernel<class_loss_autograd>);
}

// One kernel for every backend, Meta included: _loss_backward is plain ATen
// arithmetic (CUDA has a vectorized one of its own, circle_loss_cuda.cu), and
// the per-row ops' loss-only kernels run their forward.
TORCH_LIBRARY_IMPL(circle, CompositeExplicitAutograd, m) {
  m.impl("_loss_backward", &loss_backward);
  m.impl("anchor_loss", anchor_loss_kernel<anchor_loss_composite>);
  m.impl("class_loss", class_kernel<class_loss_composite>);
}

} // namespace circle_loss
