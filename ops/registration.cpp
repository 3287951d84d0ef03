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

  // The per-anchor form (pytorch-metric-learning's CircleLoss): one loss per
  // row of features against ref_features (without them: against the other
  // rows of features, the pair (i, i) left out), docs/math.md. ref_self_index
  // (B,), only with ref_features: the reference row that is anchor i's own
  // copy (a memory bank's), whose pair is left out; an index outside [0, M)
  // leaves none out. Kernels: one for every backend runs
  // _anchor_loss_forward for the losses alone; the Autograd kernel routes
  // through _anchor_loss_forward and _anchor_loss_backward, or
  // _anchor_loss_with_row_grads.
  m.def(
      "anchor_loss(Tensor features, Tensor labels, Tensor? ref_features=None, Tensor? ref_labels=None, float margin=0.4, float gamma=80.0, Tensor? ref_self_index=None) -> Tensor");
  // -> (losses (B,), row_lse (B, 2), diagonal_tiles): row_lse holds each
  // row's (LSE_P, LSE_N) in the accumulation dtype (float64 for float64
  // features, else float32), -inf for an empty set: all the backward needs
  // besides the inputs. diagonal_tiles, with keep_diagonal_tiles (CPU, no
  // reference set): S's tiles on the diagonal of the CPU kernels' blocks of
  // kCpuTile rows, (B, kCpuTile) in the accumulation dtype, row i holding
  // s_ij for the rows j of its own block in order (zeros past a short last
  // block), which the backward then need not form again; else (0, kCpuTile).
  m.def(
      "_anchor_loss_forward(Tensor features, Tensor labels, Tensor? ref_features, Tensor? ref_labels, float margin, float gamma, Tensor? ref_self_index=None, bool keep_diagonal_tiles=False) -> (Tensor, Tensor, Tensor)");
  // -> (grad_features (B, D), grad_ref_features: (M, D) if ref_grad, else
  // (0, D) and not computed), for the incoming gradient grad_losses (B,).
  // diagonal_tiles: the forward's, or None.
  m.def(
      "_anchor_loss_backward(Tensor grad_losses, Tensor features, Tensor labels, Tensor? ref_features, Tensor? ref_labels, Tensor row_lse, float margin, float gamma, Tensor? ref_self_index=None, bool ref_grad=False, Tensor? diagonal_tiles=None) -> (Tensor, Tensor)");
  // With a reference set that needs no gradient (a memory bank), L_i
  // depends on row i of features alone, so dL/dfeatures is g_i times a row
  // that the forward can make from the same strips of S:
  // -> (losses (B,), row_grads (B, D)): row i is dL_i/dfeatures_i, in the
  // accumulation dtype; the backward is grad_losses[:, None] · row_grads.
  m.def(
      "_anchor_loss_with_row_grads(Tensor features, Tensor labels, Tensor ref_features, Tensor ref_labels, float margin, float gamma, Tensor? ref_self_index=None) -> (Tensor, Tensor)");

  // The class-level form (the paper's classification head): each row of
  // features against the class weights (class proxies), the column
  // labels[i] its one positive, every other column a negative
  // (docs/math.md). normalize: the similarities are cosines, rows and
  // classes L2-normalised inside the op as normalize(x, dim=1) does them,
  // and the gradients are those at the raw inputs. class_index (K,),
  // strictly increasing in [0, C): the columns are the classes
  // weight[class_index] (Partial FC's kept classes), labels are positions
  // among them, and weight's gradient is 0 outside them. weight may have
  // another floating dtype than features (float32 weights under
  // half-precision rows): it enters at least at features' precision, and
  // its gradient comes back in its own dtype. A label outside the columns
  // leaves the row without a positive and its loss 0. Kernels: one for
  // every backend runs _class_loss_forward for the losses alone; the
  // Autograd kernel routes through it and _class_loss_backward.
  m.def(
      "class_loss(Tensor features, Tensor labels, Tensor weight, float margin=0.25, float gamma=256.0, *, bool normalize=False, Tensor? class_index=None) -> Tensor");
  // -> (losses (B,), row_lse (B, 2)): row i's (zp_i, LSE_N(i)) in the
  // accumulation dtype, -inf where the row has no positive or no negative,
  // the layout of _anchor_loss_forward's row_lse (a single positive's LSE is
  // its logit).
  m.def(
      "_class_loss_forward(Tensor features, Tensor labels, Tensor weight, float margin, float gamma, bool normalize, Tensor? class_index) -> (Tensor, Tensor)");
  // -> (grad_features (B, D) if features_grad else (0, D), grad_weight
  // (C, D) in weight's dtype if weight_grad else (0, D)), for the incoming
  // gradient grad_losses (B,).
  m.def(
      "_class_loss_backward(Tensor grad_losses, Tensor features, Tensor labels, Tensor weight, Tensor row_lse, float margin, float gamma, bool normalize, Tensor? class_index, bool features_grad, bool weight_grad) -> (Tensor, Tensor)");

  // Pieces of the loss over the pairs of two row blocks, for computing it
  // sharded (circle_loss.distributed). Partials are float64 rows
  // (max_P, Σ exp(z - max_P), max_N, Σ exp(z - max_N)) that combine exactly.
  //   rows: (R, D), cols: (C, D) -> (4,): the pairs rows × cols
  m.def(
      "_lse_partials(Tensor rows, Tensor row_labels, Tensor cols, Tensor col_labels, float margin, float gamma) -> Tensor");
  //   partials: (n, 4) -> (4,): (LSE_P, LSE_N, loss, 2·sigmoid(LSE_P + LSE_N))
  m.def("_lse_finish(Tensor partials) -> Tensor");
  //   -> (R, D) float32 (float64 for float64 rows): Σ_j G_ij cols_j, with G
  //   as in docs/math.md, "The global form" (2σ(Z) folded in) from scalars = _lse_finish(...)
  m.def(
      "_block_grad(Tensor rows, Tensor row_labels, Tensor cols, Tensor col_labels, Tensor scalars, float margin, float gamma) -> Tensor");
}
