"""Circle Loss (Sun et al., CVPR 2020) as a fused PyTorch custom operator.

Importing this package registers ``torch.ops.circle.loss``; the functions and
module here are typed conveniences around it. The op never forms the B×B
similarity matrix, never synchronises with the host, and works in eager mode,
TorchScript, ``torch.compile`` and ``torch.export``.
"""

from __future__ import annotations

import torch

from ._library import library_path, load

load()


def _schema_default(name: str) -> float:
    # The C++ schema is the single source of truth for the defaults.
    for argument in torch.ops.circle.loss.default._schema.arguments:
        if argument.name == name:
            return float(argument.default_value)
    raise LookupError(name)


DEFAULT_MARGIN: float = _schema_default("margin")
DEFAULT_GAMMA: float = _schema_default("gamma")


def circle_loss(
    features: torch.Tensor,
    labels: torch.Tensor,
    margin: float = DEFAULT_MARGIN,
    gamma: float = DEFAULT_GAMMA,
) -> torch.Tensor:
    """Circle Loss of a batch, in the unified global form of SPEC.md.

    Args:
        features: (B, D) float32, float64, float16 or bfloat16 embeddings, used
            as given (L2-normalise them first, as the paper does).
        labels: (B,) integer class labels on the same device.
        margin: the relaxation margin m.
        gamma: the scale factor γ.

    Returns:
        A 0-dim tensor of ``features.dtype``: softplus(LSE_N(zn) + LSE_P(zp))
        over every ordered pair (i, j), the diagonal counted as positive.
        Differentiable with respect to ``features`` (once).
    """
    return torch.ops.circle.loss(features, labels, margin, gamma)


class CircleLoss(torch.nn.Module):
    """``nn.Module`` form of :func:`circle_loss`; scriptable with ``torch.jit.script``.

    Example::

        criterion = CircleLoss(margin=0.25, gamma=256.0)
        loss = criterion(torch.nn.functional.normalize(embeddings, dim=1), labels)
    """

    def __init__(self, margin: float = DEFAULT_MARGIN, gamma: float = DEFAULT_GAMMA) -> None:
        super().__init__()
        self.margin = float(margin)
        self.gamma = float(gamma)

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.ops.circle.loss(features, labels, self.margin, self.gamma)

    def extra_repr(self) -> str:
        return f"margin={self.margin}, gamma={self.gamma}"


__all__ = [
    "CircleLoss",
    "DEFAULT_GAMMA",
    "DEFAULT_MARGIN",
    "circle_loss",
    "library_path",
]
