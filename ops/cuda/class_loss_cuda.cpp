// CUDA kernels of circle::class_loss. The class-level loss is the per-anchor
// loss of the rows against the class weights as references labelled 0..C-1
// (docs/math.md, "The class-level form"), so the CUDA kernels are
// circle::anchor_loss's, verified on the H200: its strips of S = F Wᵀ, its
// row states (whose LSE_P is the one positive's logit here) and its
// gradients to both sets. What they spend on it beyond a kernel of its own:
// a C-long int64 label vector (8 bytes a class) and a label compare an
// entry, which a label rule in the tile epilogues would save (the GPU issue).
#include "kernel_args.h"

#include <ATen/ops/arange.h>
#include <torch/library.h>

namespace circle_loss {
namespace {

// The class-level op's arguments as the per-anchor op's: the classes as
// references labelled 0..C-1.
struct AsAnchorArgs {
  std::optional<at::Tensor> weight;
  std::optional<at::Tensor> class_labels;
  std::optional<at::Tensor> no_index;
  AnchorArgs args; // refers to the members above

  explicit AsAnchorArgs(const ClassArgs& a)
      : weight(a.weight),
        class_labels(at::arange(a.weight.size(0), a.labels.options().dtype(at::kLong))),
        args{a.features, a.labels, weight, class_labels, a.margin, a.gamma, no_index} {}
  AsAnchorArgs(const AsAnchorArgs&) = delete;
  AsAnchorArgs& operator=(const AsAnchorArgs&) = delete;
};

std::tuple<at::Tensor, at::Tensor> class_loss_forward_cuda(const ClassArgs& args) {
  const AsAnchorArgs anchor(args);
  auto [losses, row_lse, unused] = call_anchor_loss_forward(anchor.args, /*keep_diagonal_tiles=*/false);
  return {losses, row_lse};
}

std::tuple<at::Tensor, at::Tensor> class_loss_backward_cuda(
    const at::Tensor& grad_losses, const ClassArgs& args, const at::Tensor& row_lse, bool features_grad,
    bool weight_grad) {
  const AsAnchorArgs anchor(args);
  // The per-anchor backward forms dF whatever is asked; dW where asked.
  auto [grad_features, grad_weight] =
      call_anchor_loss_backward(grad_losses, anchor.args, row_lse, /*ref_grad=*/weight_grad, std::nullopt);
  return {features_grad ? grad_features : grad_features.narrow(0, 0, 0), grad_weight};
}

} // namespace

TORCH_LIBRARY_IMPL(circle, CUDA, m) {
  register_class_kernels<class_loss_forward_cuda, class_loss_backward_cuda>(m);
}

} // namespace circle_loss
