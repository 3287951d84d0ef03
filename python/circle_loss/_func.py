"""Reverse mode under torch.func (grad, vjp, jacrev, and vmap over them).

The ops' autograd kernels are C++ autograd Functions, so that scripted
models keep their gradients when C++ runs them without Python; torch.func's
transforms cannot run a C++ autograd Function. Where a transform is active
and a gradient is wanted, the package's functions and modules take these
Python autograd Functions instead: the same registered forward and backward
ops, with the context saved as torch.func requires (setup_context) and vmap
rules generated from them.
"""

from __future__ import annotations

import torch


def wanted(tensor: torch.Tensor | None) -> bool:
    """Whether a torch.func transform is active and `tensor` needs a
    gradient: then only these Functions give one."""
    return tensor is not None and tensor.requires_grad and torch._C._are_functorch_transforms_active()


class _NoSecondDerivative(torch.autograd.Function):
    """The identity on `grad`, recorded as a function of `tracked` (an input
    of the op whose gradient `grad` is) whose derivative raises: a gradient
    made by the kernels carries no graph, so where torch.func or
    create_graph=True differentiates it again the result would be a silent
    zero; this refuses it instead, lazily, so that a first gradient (which
    torch.func records too) goes through."""

    generate_vmap_rule = True

    @staticmethod
    def forward(grad, tracked, op):
        return grad.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.op = inputs[2]

    @staticmethod
    def backward(ctx, _):
        raise _second_derivative_error(ctx.op)

    @staticmethod
    def jvp(ctx, *_):
        raise _second_derivative_error(ctx.op)


def _second_derivative_error(op: str) -> RuntimeError:
    return RuntimeError(
        f"{op} does not support double backward: its backward is a kernel of its own, not differentiable "
        "again. Take one gradient (backward, torch.autograd.grad, or torch.func's grad, vjp or jacrev once)."
    )


def _mixed_modes_error(op: str) -> RuntimeError:
    return RuntimeError(
        f"{op}: forward-mode AD (jvp, jacfwd) of a reverse-mode torch.func transform (hessian, jacfwd of grad) "
        "is not supported. Use one of the two: forward mode alone (jvp, jacfwd) runs the op's own kernel."
    )


def _first_derivative_only(grad, tracked, op):
    return grad if grad is None else _NoSecondDerivative.apply(grad, tracked, op)


class _OpFunction(torch.autograd.Function):
    """An op's forward and backward ops as a Function: its setup_context
    names the op in ctx.op, for the errors; forward-mode AD of its gradient
    is refused."""

    generate_vmap_rule = True

    @staticmethod
    def jvp(ctx, *_):
        raise _mixed_modes_error(ctx.op)


class Loss(_OpFunction):

    @staticmethod
    def forward(features, labels, margin, gamma):
        return torch.ops.circle._loss_with_grad(features, labels, margin, gamma)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.op = "circle::loss"
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(inputs[0], output[1])

    @staticmethod
    def backward(ctx, grad_loss, _):
        features, grad_features = ctx.saved_tensors
        grad = torch.ops.circle._loss_backward(grad_loss.detach(), grad_features)
        return _first_derivative_only(grad, features, ctx.op), None, None, None


class AnchorLoss(_OpFunction):

    @staticmethod
    def forward(features, labels, ref_features, ref_labels, margin, gamma, ref_self_index):
        losses, row_lse, _ = torch.ops.circle._anchor_loss_forward(
            features, labels, ref_features, ref_labels, margin, gamma, ref_self_index
        )
        return losses, row_lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        features, labels, ref_features, ref_labels, margin, gamma, ref_self_index = inputs
        ctx.op = "circle::anchor_loss"
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(features, labels, ref_features, ref_labels, output[1], ref_self_index)
        ctx.margin, ctx.gamma = margin, gamma

    @staticmethod
    def backward(ctx, grad_losses, _):
        features, labels, ref_features, ref_labels, row_lse, ref_self_index = ctx.saved_tensors
        ref_grad = ref_features is not None and ctx.needs_input_grad[2]
        # The kernel is not differentiable: it takes its inputs untracked, and
        # _first_derivative_only records where its result came from.
        grad_features, grad_ref = torch.ops.circle._anchor_loss_backward(
            grad_losses.detach(), features.detach(), labels, None if ref_features is None else ref_features.detach(),
            ref_labels, row_lse, ctx.margin, ctx.gamma, ref_self_index, ref_grad,
        )
        return (_first_derivative_only(grad_features, features, ctx.op), None,
                _first_derivative_only(grad_ref, ref_features, ctx.op) if ref_grad else None, None, None, None, None)


class ClassLoss(_OpFunction):

    @staticmethod
    def forward(features, labels, weight, margin, gamma, normalize, class_index):
        return torch.ops.circle._class_loss_forward(
            features, labels, weight, margin, gamma, normalize, class_index)

    @staticmethod
    def setup_context(ctx, inputs, output):
        features, labels, weight, margin, gamma, normalize, class_index = inputs
        ctx.op = "circle::class_loss"
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(features, labels, weight, output[1], class_index)
        ctx.margin, ctx.gamma, ctx.normalize = margin, gamma, normalize

    @staticmethod
    def backward(ctx, grad_losses, _):
        features, labels, weight, row_lse, class_index = ctx.saved_tensors
        features_grad, weight_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        grad_features, grad_weight = torch.ops.circle._class_loss_backward(
            grad_losses.detach(), features.detach(), labels, weight.detach(), row_lse, ctx.margin, ctx.gamma,
            ctx.normalize, class_index, features_grad, weight_grad,
        )
        return (_first_derivative_only(grad_features, features, ctx.op) if features_grad else None, None,
                _first_derivative_only(grad_weight, weight, ctx.op) if weight_grad else None, None, None, None, None)


def loss(features, labels, margin: float, gamma: float) -> torch.Tensor:
    return Loss.apply(features, labels, margin, gamma)[0]


def anchor_loss(features, labels, ref_features, ref_labels, margin: float, gamma: float, ref_self_index):
    return AnchorLoss.apply(features, labels, ref_features, ref_labels, margin, gamma, ref_self_index)[0]


def class_loss(features, labels, weight, margin: float, gamma: float, normalize: bool = False,
               class_index: torch.Tensor | None = None) -> torch.Tensor:
    return ClassLoss.apply(features, labels, weight, margin, gamma, normalize, class_index)[0]
