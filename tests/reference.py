"""The float64 references for circle::loss and circle::anchor_loss, written
from docs/math.md in plain PyTorch, and the tolerances every comparison with
them uses."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Largest accepted relative error against the reference, per input dtype:
# (loss, gradient as ‖g - g_ref‖ / ‖g_ref‖). float16/bfloat16 are bounded by
# the rounding of the returned loss and gradient to their 11 and 8 bits.
TOLERANCE = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-4),
    torch.float16: (2e-3, 4e-3),
    torch.bfloat16: (1e-2, 2e-2),
}
# Below float64 the gradient's error is set by the rounding of S itself, which
# gamma amplifies in the logits and a few dominant pairs fail to average out:
# the same definition evaluated in plain float32 PyTorch misses 1e-4 on some
# small batches. The op may then be off by up to this many times that error.
FLOAT32_YARDSTICK_FACTOR = 4.0
# In float64 there is no higher precision to measure against; its rounding of
# S is amplified by gamma alike, so the gradient's bound grows as gamma · ε
# (1e-10 stands up to gamma ≈ 450; at gamma = 1e6 it is 2.2e-7).
FLOAT64_GAMMA_FACTOR = 1e3


def circle_loss_reference(
    features: torch.Tensor,
    labels: torch.Tensor,
    margin: float = 0.25,
    gamma: float = 256.0,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The unified Circle Loss over all ordered pairs (docs/math.md), computed in `dtype`
    (float64 unless measuring float32's own error), differentiable with the
    alphas detached. Materialises B×B: tests only."""
    f = features.to(dtype)
    s = f @ f.T
    positive = labels[:, None] == labels[None, :]
    sp, sn = s[positive], s[~positive]
    alpha_p = torch.clamp_min(1 + margin - sp.detach(), 0)
    alpha_n = torch.clamp_min(sn.detach() + margin, 0)
    zp = -gamma * alpha_p * (sp - (1 - margin))
    zn = gamma * alpha_n * (sn - margin)
    # F.softplus returns its input past `threshold` (20 by default), which is
    # off by e^-z: 2e-9 at z = 20, beyond the float64 tolerance. From 40 on
    # that is below float64's resolution.
    return F.softplus(torch.logsumexp(zn, 0) + torch.logsumexp(zp, 0), threshold=40.0)


def reference_loss_and_grad(
    features: torch.Tensor, *args, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """circle_loss_reference(features, *args) (labels, margin, gamma) and its
    gradient with respect to features, in dtype."""
    f = features.detach().to(dtype).requires_grad_()
    loss = circle_loss_reference(f, *args, dtype=dtype)
    (grad,) = torch.autograd.grad(loss, f)
    return loss.detach(), grad


def relative_error(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """||actual - expected|| / ||expected||; a norm below floor counts as floor."""
    actual = actual.detach().double().cpu()
    expected = expected.detach().double().cpu()
    scale = max(expected.norm().item(), floor)
    diff = (actual - expected).norm().item()
    return diff if scale == 0 else diff / scale


def assert_matches_reference(loss, grad, features, labels, margin=0.25, gamma=256.0):
    """Checks the op's loss and gradient (None: loss only) for these inputs
    against the float64 reference, with the tolerances of features.dtype."""
    dtype = features.dtype
    ref_loss, ref_grad = reference_loss_and_grad(features, labels, margin, gamma)
    loss_tol, grad_tol = TOLERANCE[dtype]
    if dtype != torch.float64 and grad is not None:
        _, grad32 = reference_loss_and_grad(features, labels, margin, gamma, dtype=torch.float32)
        grad_tol = max(grad_tol, FLOAT32_YARDSTICK_FACTOR * relative_error(grad32, ref_grad))
    if dtype == torch.float64:
        grad_tol = max(grad_tol, FLOAT64_GAMMA_FACTOR * abs(gamma) * torch.finfo(torch.float64).eps)
    assert torch.isfinite(loss).all(), f"loss is {loss}"
    loss_err = relative_error(loss, ref_loss)
    assert loss_err <= loss_tol, (
        f"loss {loss.item()} vs reference {ref_loss.item()}: relative error {loss_err:.3g} > {loss_tol}"
    )
    if grad is not None:
        assert torch.isfinite(grad).all(), "gradient has non-finite entries"
        err = relative_error(grad, ref_grad)
        assert err <= grad_tol, f"gradient relative error {err:.3g} > {grad_tol:.3g}"


def anchor_loss_reference(
    features: torch.Tensor,
    labels: torch.Tensor,
    ref_features: torch.Tensor | None = None,
    ref_labels: torch.Tensor | None = None,
    margin: float = 0.4,
    gamma: float = 80.0,
    dtype: torch.dtype = torch.float64,
    ref_self_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """The per-anchor Circle Loss (docs/math.md), (B,) in `dtype`, the alphas
    detached; without a reference set the pairs (i, i) are left out, with one
    the pairs (i, ref_self_index[i]) for the indices in [0, M).
    Materialises B×M: tests only."""
    q = features.to(dtype)
    r = q if ref_features is None else ref_features.to(dtype)
    ref_labels = labels if ref_features is None else ref_labels
    s = q @ r.T
    same = labels[:, None] == ref_labels[None, :]
    mine = torch.ones_like(same)
    if ref_features is None:
        mine = ~torch.eye(len(labels), dtype=torch.bool, device=same.device)
    elif ref_self_index is not None:
        columns = torch.arange(len(ref_labels), device=same.device)
        mine = columns[None, :] != ref_self_index.to(same.device)[:, None]
    positive, negative = same & mine, ~same & mine
    zp = -gamma * torch.clamp_min(1 + margin - s.detach(), 0) * (s - (1 - margin))
    zn = gamma * torch.clamp_min(s.detach() + margin, 0) * (s - margin)
    neg_inf = torch.tensor(-torch.inf, dtype=dtype, device=s.device)
    lse_p = torch.logsumexp(torch.where(positive, zp, neg_inf), dim=1)
    lse_n = torch.logsumexp(torch.where(negative, zn, neg_inf), dim=1)
    rows = positive.any(1) & negative.any(1)
    # Where a set is empty its LSE is -inf; the masked sum keeps inf - inf
    # out of those rows' (zero) gradient.
    z = torch.where(rows, lse_p + lse_n, torch.zeros_like(lse_p))
    return torch.where(rows, F.softplus(z, threshold=40.0), torch.zeros_like(z))


# The references hold about ten B×M matrices of their dtype at once; large
# cases take their rows in chunks of at most this many entries of S, so that
# a case's memory does not grow with B (two test processes share one GPU).
REFERENCE_CHUNK_ENTRIES = 1 << 26


def _row_chunks(rows, cols):
    step = max(1, REFERENCE_CHUNK_ENTRIES // max(cols, 1))
    return [(first, min(first + step, rows)) for first in range(0, rows, step)] or [(0, 0)]


def anchor_reference_and_grads(features, labels, ref_features=None, ref_labels=None, margin=0.4, gamma=80.0,
                               weights=None, dtype=torch.float64, ref_self_index=None):
    """The reference losses (B,) and the gradients of Σ_i weights_i · L_i with
    respect to features and ref_features (None without a reference set),
    rows in chunks: a row's loss depends on its own row of S alone."""
    q = features.detach().to(dtype).requires_grad_()
    r = None if ref_features is None else ref_features.detach().to(dtype).requires_grad_()
    w = torch.ones(len(labels), dtype=dtype, device=q.device) if weights is None else weights.to(dtype)
    losses, grad_q, grad_r = [], torch.zeros_like(q), None if r is None else torch.zeros_like(r)
    for first, last in _row_chunks(len(labels), len(labels) if r is None else len(r)):
        if r is None:  # the chunk's rows against the whole batch, each its own pair left out
            own = torch.arange(first, last, device=q.device)
            chunk = anchor_loss_reference(q[first:last], labels[first:last], q, labels, margin, gamma, dtype, own)
        else:
            own = None if ref_self_index is None else ref_self_index[first:last]
            chunk = anchor_loss_reference(q[first:last], labels[first:last], r, ref_labels, margin, gamma, dtype, own)
        if last > first:
            for grad, part in zip((grad_q, grad_r), torch.autograd.grad((chunk * w[first:last]).sum(),
                                                                        [q] if r is None else [q, r])):
                grad += part
        losses.append(chunk.detach())
    return torch.cat(losses), grad_q, grad_r


def class_loss_reference(
    features: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    margin: float = 0.25,
    gamma: float = 256.0,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The class-level Circle Loss (docs/math.md), (B,) in `dtype`, the alphas
    detached: row i against every class, labels[i] its one positive (none
    for a label outside [0, C)). Materialises B×C: tests only."""
    s = features.to(dtype) @ weight.to(dtype).T
    positive = labels[:, None] == torch.arange(weight.shape[0], device=s.device)[None, :]
    neg_inf = torch.tensor(-torch.inf, dtype=dtype, device=s.device)
    zp = -gamma * torch.clamp_min(1 + margin - s.detach(), 0) * (s - (1 - margin))
    zn = gamma * torch.clamp_min(s.detach() + margin, 0) * (s - margin)
    lse_p = torch.logsumexp(torch.where(positive, zp, neg_inf), dim=1)
    lse_n = torch.logsumexp(torch.where(positive, neg_inf, zn), dim=1)
    rows = positive.any(1) & (~positive).any(1)
    z = torch.where(rows, lse_p + lse_n, torch.zeros_like(lse_p))
    return torch.where(rows, F.softplus(z, threshold=40.0), torch.zeros_like(z))


def class_reference_and_grads(features, labels, weight, margin=0.25, gamma=256.0, weights=None, dtype=torch.float64):
    """The reference losses (B,) and the gradients of Σ_i weights_i · L_i with
    respect to features and weight."""
    f = features.detach().to(dtype).requires_grad_()
    w = weight.detach().to(dtype).requires_grad_()
    g = torch.ones(len(labels), dtype=dtype, device=f.device) if weights is None else weights.to(dtype)
    losses, grad_f, grad_w = [], torch.zeros_like(f), torch.zeros_like(w)
    for first, last in _row_chunks(len(labels), len(w)):
        chunk = class_loss_reference(f[first:last], labels[first:last], w, margin, gamma, dtype)
        if last > first:
            part_f, part_w = torch.autograd.grad((chunk * g[first:last]).sum(), [f, w])
            grad_f += part_f
            grad_w += part_w
        losses.append(chunk.detach())
    return torch.cat(losses), grad_f, grad_w
