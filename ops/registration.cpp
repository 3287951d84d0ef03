// The schema of the circle namespace: the single source of truth for the op's
// signature and its defaults (the Python package reads them back from here).
#include <torch/library.h>

TORCH_LIBRARY(circle, m) {
  // The public op. Kernels: CPU, CUDA and Meta compute the loss alone; the
  // Autograd kernel routes through _loss_with_grad when a gradient is needed.
  m.def(
      "loss(Tensor features, Tensor labels, float margin=0.25, float gamma=256.0) -> Tensor");
  // Loss and dloss/dfeatures in one pass, so that backward is a rescale.
  m.def(
      "_loss_with_grad(Tensor features, Tensor labels, float margin, float gamma) -> (Tensor, Tensor)");
  // The backward: grad_loss (0-dim) times the saved dloss/dfeatures (B, D).
  m.def("_loss_backward(Tensor grad_loss, Tensor grad_features) -> Tensor");
}
