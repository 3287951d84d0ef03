"""Circle Loss (Sun et al., CVPR 2020) as fused PyTorch custom operators.

Importing this package registers the ops ``torch.ops.circle.loss`` (the
global "unified" form over every pair of a batch), ``torch.ops.circle.anchor_loss``
(pytorch-metric-learning's per-anchor form) and ``torch.ops.circle.class_loss``
(the class-level form: rows against class weights). None forms the B×B (B×M,
B×C) similarity matrix or synchronises with the host, and each works in
eager mode, TorchScript, ``torch.compile``, ``torch.export`` and under
``torch.func``.

Which to use:
    circle_loss(), CircleLoss           pair labels, the global form (features as given)
    anchor_loss(), AnchorCircleLoss     pair labels, one loss per anchor (features as given)
    class_loss(), ClassCircleLoss       class labels against class weights (the module normalises)
    circle_loss.pml                     drop-ins for pytorch-metric-learning (normalise inside)
    circle_loss.distributed             the three forms across processes

Documentation: the README and docs/ of the source tree.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Optional, Tuple

import torch

from . import _func
from ._library import library_path, load

load()

__version__: str = version("circle-loss")


@torch.jit.unused
def _under_func_transform(tensor):
    # type: (Tensor) -> bool
    # Never asked in TorchScript, which cannot run torch.func (and reads the
    # signature from the type comment: the annotations here are strings).
    return _func.wanted(tensor)


def _schema_default(op, name: str) -> float:
    # The C++ schema is the single source of truth for the defaults.
    for argument in op.default._schema.arguments:
        if argument.name == name:
            return float(argument.default_value)
    raise LookupError(name)


DEFAULT_MARGIN: float = _schema_default(torch.ops.circle.loss, "margin")
DEFAULT_GAMMA: float = _schema_default(torch.ops.circle.loss, "gamma")
# The per-anchor form's defaults are pytorch-metric-learning's (m = 0.4, gamma = 80).
ANCHOR_DEFAULT_MARGIN: float = _schema_default(torch.ops.circle.anchor_loss, "margin")
ANCHOR_DEFAULT_GAMMA: float = _schema_default(torch.ops.circle.anchor_loss, "gamma")


def circle_loss(
    features: torch.Tensor,
    labels: torch.Tensor,
    margin: float = DEFAULT_MARGIN,
    gamma: float = DEFAULT_GAMMA,
) -> torch.Tensor:
    """Circle Loss of a batch, in the unified global form (docs/math.md).

    Args:
        features: (B, D) float32, float64, float16 or bfloat16 embeddings, used
            as given (L2-normalise them first, as the paper does).
        labels: (B,) integer class labels on the same device.
        margin: the relaxation margin m.
        gamma: the scale factor γ.

    Returns:
        A 0-dim tensor of ``features.dtype``: softplus(LSE_N(zn) + LSE_P(zp))
        over every ordered pair (i, j), the diagonal counted as positive.
        Differentiable with respect to ``features`` (once), also under
        torch.func (grad, vjp, jacrev, vmap over them).
    """
    if _func.wanted(features):
        return _func.loss(features, labels, margin, gamma)
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
        """(B, D) features and (B,) labels -> the 0-dim loss (see :func:`circle_loss`)."""
        if not torch.jit.is_scripting() and _under_func_transform(features):
            return _func.loss(features, labels, self.margin, self.gamma)
        return torch.ops.circle.loss(features, labels, self.margin, self.gamma)

    def extra_repr(self) -> str:
        return f"margin={self.margin}, gamma={self.gamma}"


def anchor_loss(
    features: torch.Tensor,
    labels: torch.Tensor,
    ref_features: torch.Tensor | None = None,
    ref_labels: torch.Tensor | None = None,
    margin: float = ANCHOR_DEFAULT_MARGIN,
    gamma: float = ANCHOR_DEFAULT_GAMMA,
    ref_self_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-anchor Circle Loss (pytorch-metric-learning's ``CircleLoss`` formula).

    Args:
        features: (B, D) float32, float64, float16 or bfloat16 anchors, used as
            given (L2-normalise them first).
        labels: (B,) integer labels on the same device.
        ref_features: optional (M, D) reference rows of the same dtype and
            device; without them each anchor meets the other rows of
            ``features`` (the pair (i, i) left out).
        ref_labels: (M,) integer labels, given exactly when ``ref_features`` is.
        margin: the relaxation margin m.
        gamma: the scale factor γ.
        ref_self_index: optional (B,) integer positions, only with
            ``ref_features``: row ``ref_self_index[i]`` of the reference set
            is anchor i's own copy (as in a memory bank that already holds
            the batch), and that one pair is left out, as
            pytorch-metric-learning's ``CrossBatchMemory`` leaves it out. An
            index outside [0, M) leaves no pair out.

    Returns:
        (B,) losses of ``features.dtype``: L_i = softplus(LSE_P(i) + LSE_N(i)),
        0 for a row with no positive or no negative pair. Differentiable (once)
        with respect to ``features`` and ``ref_features``. Average the rows as
        you like; pytorch-metric-learning averages those above zero. Also
        differentiable under torch.func (grad, vjp, jacrev, vmap over them).
    """
    if _func.wanted(features) or _func.wanted(ref_features):
        return _func.anchor_loss(features, labels, ref_features, ref_labels, margin, gamma, ref_self_index)
    return torch.ops.circle.anchor_loss(features, labels, ref_features, ref_labels, margin, gamma, ref_self_index)


class AnchorCircleLoss(torch.nn.Module):
    """``nn.Module`` form of :func:`anchor_loss` that returns the mean of the
    nonzero rows' losses (pytorch-metric-learning's default reduction), or 0
    when every row's loss is 0. Scriptable with ``torch.jit.script``."""

    def __init__(self, margin: float = ANCHOR_DEFAULT_MARGIN, gamma: float = ANCHOR_DEFAULT_GAMMA) -> None:
        super().__init__()
        self.margin = float(margin)
        self.gamma = float(gamma)

    def forward(
        self,
        features: torch.Tensor,
        labels: torch.Tensor,
        ref_features: torch.Tensor | None = None,
        ref_labels: torch.Tensor | None = None,
        ref_self_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Features (B, D), labels (B,), optionally a reference set, as for
        :func:`anchor_loss` -> the mean of the nonzero rows' losses."""
        if not torch.jit.is_scripting() and (
            _under_func_transform(features) or (ref_features is not None and _under_func_transform(ref_features))
        ):
            losses = _func.anchor_loss(features, labels, ref_features, ref_labels, self.margin, self.gamma,
                                       ref_self_index)
        else:
            losses = torch.ops.circle.anchor_loss(
                features, labels, ref_features, ref_labels, self.margin, self.gamma, ref_self_index
            )
        # Without a host synchronisation: the count is a tensor, clamped so
        # that no nonzero row gives 0 / 0.
        nonzero = (losses > 0).sum().clamp_min(1)
        return losses.sum() / nonzero

    def extra_repr(self) -> str:
        return f"margin={self.margin}, gamma={self.gamma}"


# The class-level form's defaults are the paper's for face recognition (m = 0.25, gamma = 256).
CLASS_DEFAULT_MARGIN: float = _schema_default(torch.ops.circle.class_loss, "margin")
CLASS_DEFAULT_GAMMA: float = _schema_default(torch.ops.circle.class_loss, "gamma")


def class_loss(
    features: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    margin: float = CLASS_DEFAULT_MARGIN,
    gamma: float = CLASS_DEFAULT_GAMMA,
    *,
    normalize: bool = False,
    class_index: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Class-level Circle Loss: each row against C class weights (proxies),
    its own class the one positive (the paper's classification head, as
    fast-reid's ``CircleSoftmax`` computes it, without the B×C logits).

    Args:
        features: (B, D) float32, float64, float16 or bfloat16 rows.
        labels: (B,) integer class of each row, on the same device: a column
            of the loss (a position in ``class_index`` where one is given); a
            label outside the columns leaves its row without a positive, and
            its loss 0.
        weight: (C, D) class weights on the same device, of any of those
            dtypes: they enter the products at least at ``features``'
            precision, and their gradient comes back in their own dtype.
        margin: the relaxation margin m.
        gamma: the scale factor γ.
        normalize: take cosine similarities: rows and classes L2-normalised
            inside the op, as ``F.normalize(x, dim=1)`` does them, with no
            normalised copy and normalize's backward folded into the
            gradients. Without it both are used as given.
        class_index: (K,) integer, strictly increasing, in [0, C): the loss is
            taken against the classes ``weight[class_index]`` alone (Partial
            FC's kept classes), ``labels`` then being positions among them;
            the other rows of ``weight`` get a zero gradient.

    Returns:
        (B,) losses of ``features.dtype``: L_i = softplus(zp_i + LSE_{j≠y_i} zn_ij).
        Differentiable (once) with respect to ``features`` and ``weight``,
        also under torch.func (grad, vjp, jacrev, vmap over them).
    """
    if _func.wanted(features) or _func.wanted(weight):
        return _func.class_loss(features, labels, weight, margin, gamma, normalize, class_index)
    return torch.ops.circle.class_loss(features, labels, weight, margin, gamma, normalize=normalize,
                                       class_index=class_index)


def _check_embeddings(embeddings: torch.Tensor, prefix: str) -> None:
    """A class-level head's embeddings are (B, D) floating rows: said in the
    head's own words (after `prefix`) before normalize would fail in its own."""
    if embeddings.dim() != 2:
        raise RuntimeError(prefix + "embeddings must be a 2-D tensor (B, D), got a " + str(embeddings.dim())
                           + "-D tensor of shape " + str(list(embeddings.shape)))
    if not embeddings.is_floating_point():
        raise RuntimeError(prefix + "embeddings must be float32, float64, float16 or bfloat16, got "
                           + str(embeddings.dtype))


def _valid_labels(labels: torch.Tensor, num_classes: int, ignore_index: Optional[int]) -> torch.Tensor:
    """Whether each label lies in [0, num_classes) or equals ignore_index."""
    valid = (labels >= 0) & (labels < num_classes)
    return valid if ignore_index is None else valid | (labels == ignore_index)


def _check_labels_in_range(labels: torch.Tensor, num_classes: int, ignore_index: Optional[int], head: str) -> None:
    """Refuses a label outside [0, num_classes) other than ignore_index, as
    cross_entropy does: on the CPU at once, on CUDA asynchronously (a
    device-side assert, no host synchronisation), in TorchScript at once."""
    valid = _valid_labels(labels, num_classes, ignore_index)
    message = head + ": labels must lie in [0, num_classes = " + str(num_classes) + ")"
    if ignore_index is not None:
        message = message + " or equal ignore_index = " + str(ignore_index)
    if torch.jit.is_scripting():
        # TorchScript drops an _assert_async whose result nothing uses.
        if not bool(valid.all()):
            raise RuntimeError(message)
    else:
        torch._assert_async(valid.all(), message)


def _check_sample_rate(sample_rate: float, head: str) -> float:
    if not 0.0 < sample_rate <= 1.0:  # NaN fails too
        raise ValueError(f"{head}: sample_rate must lie in (0, 1], got {sample_rate}")
    return float(sample_rate)


def _sampled_classes(labels: torch.Tensor, num_classes: int, sample_rate: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Partial FC's class sampling. Keeps every class that labels a row (a
    label in [0, num_classes)), and, where they are fewer than
    int(sample_rate · num_classes), as many more drawn uniformly at random
    without replacement from the other classes (torch's generator of the
    labels' device): ranked by a uniform score, the positives' set above
    all. Returns the kept classes, ascending, (K,), and each row's position
    among them, -1 for a label outside [0, num_classes). Synchronises with
    the host once (the number of distinct positives)."""
    valid = _valid_labels(labels, num_classes, None)
    positives = torch.unique(labels[valid])  # ascending
    wanted = int(sample_rate * num_classes)
    if wanted > positives.numel():
        score = torch.rand(num_classes, device=labels.device)
        score[positives] = 2.0
        # The set alone: topk need not order it by score (a third of its time).
        kept = torch.sort(torch.topk(score, wanted, sorted=False)[1])[0]
    else:
        kept = positives
    positions = torch.searchsorted(kept, labels.clamp(0, max(num_classes - 1, 0)))
    return kept, torch.where(valid, positions, -1)


def _kept_columns(weight: torch.Tensor, kept: torch.Tensor, sparse_grad: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The op's weight and class index for a sampled step: with sparse_grad
    the kept rows gathered by embedding(sparse=True), whose gradient is a
    sparse tensor of them; else all of weight, the op taking the kept rows
    through its index (the others' gradient 0)."""
    if sparse_grad:
        return torch.nn.functional.embedding(kept, weight, sparse=True), None
    return weight, kept


def _mean_of_kept(losses: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The mean over the rows whose label is not ignore_index (0 where none is)."""
    kept = labels != ignore_index
    return losses.masked_fill(~kept, 0.0).sum() / kept.sum().clamp_min(1)


class ClassCircleLoss(torch.nn.Module):
    """The class-level Circle Loss head: an ``nn.Module`` holding the class
    weights ``weight`` (num_classes, embedding_size) as a parameter.
    ``forward(embeddings, labels)`` returns the mean over rows of
    :func:`class_loss` with ``normalize=True`` (cosine similarities, the
    normalisation inside the op). Scriptable, compilable, exportable.

    Labels must lie in [0, num_classes), except ``ignore_index`` (-100 by
    default, as for ``torch.nn.functional.cross_entropy``), whose rows leave
    the mean; any other label is refused (on CUDA by an asynchronous
    device-side assert, as cross_entropy's). Embeddings of another floating
    dtype than the weights (half precision under ``torch.autocast``, float32
    weights) are welcome: the weights enter the products at least at the
    embeddings' precision, and their gradient arrives in their own dtype.

    ``sample_rate`` below 1 samples the classes as insightface's Partial FC
    does: each step keeps the classes that label a row and, up to
    ``int(sample_rate * num_classes)`` in all, others drawn uniformly at
    random (torch's generator: ``torch.manual_seed`` makes a step
    reproducible); the loss is the rows' against the kept classes, and the
    gradient reaches their rows of ``weight`` alone (the others' stay exactly
    0). The op reads the kept rows through its ``class_index``; the kept
    classes of the last step are ``last_kept`` (empty at sample_rate 1). With
    ``sparse_grad=True`` the kept rows are gathered instead, (K, D), and the
    weights' gradient of a sampled step is a sparse tensor of them (as
    ``nn.Embedding(sparse=True)`` gives), for
    optimisers that take one (``torch.optim.SGD``, ``SparseAdam``): no dense
    (C, D) gradient is formed.

    Example::

        head = ClassCircleLoss(num_classes=10_000, embedding_size=512)
        loss = head(backbone(images), identities)  # optimise head.parameters() too
    """

    def __init__(
        self,
        num_classes: int,
        embedding_size: int,
        margin: float = CLASS_DEFAULT_MARGIN,
        gamma: float = CLASS_DEFAULT_GAMMA,
        ignore_index: int = -100,
        sample_rate: float = 1.0,
        sparse_grad: bool = False,
    ) -> None:
        super().__init__()
        self.margin = float(margin)
        self.gamma = float(gamma)
        self.ignore_index = int(ignore_index)
        self.sample_rate = _check_sample_rate(sample_rate, f"{type(self).__module__}.{type(self).__name__}")
        self.sparse_grad = bool(sparse_grad)
        self.last_kept = torch.empty(0, dtype=torch.long)  # the last sampled step's kept classes
        self.weight = torch.nn.Parameter(torch.empty(num_classes, embedding_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # As torch.nn.Linear (and fast-reid's CircleSoftmax) start their weights.
        torch.nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(B, D) embeddings and (B,) integer labels in [0, num_classes) (or
        ignore_index) -> the 0-dim mean loss over the kept rows (0 for none)."""
        _check_embeddings(embeddings, "circle_loss.ClassCircleLoss: ")
        classes, positions = self.weight, labels
        index = torch.jit.annotate(Optional[torch.Tensor], None)
        if self.sample_rate < 1.0:
            kept, positions = _sampled_classes(labels, self.weight.shape[0], self.sample_rate)
            self.last_kept = kept
            classes, index = _kept_columns(self.weight, kept, self.sparse_grad)
        if not torch.jit.is_scripting() and (_under_func_transform(embeddings) or _under_func_transform(classes)):
            losses = _func.class_loss(embeddings, positions, classes, self.margin, self.gamma, True, index)
        else:
            losses = torch.ops.circle.class_loss(embeddings, positions, classes, self.margin, self.gamma,
                                                 normalize=True, class_index=index)
        _check_labels_in_range(labels, self.weight.shape[0], self.ignore_index, "circle_loss.ClassCircleLoss")
        return _mean_of_kept(losses, labels, self.ignore_index)

    def extra_repr(self) -> str:
        return (f"num_classes={self.weight.shape[0]}, embedding_size={self.weight.shape[1]}, "
                f"margin={self.margin}, gamma={self.gamma}, ignore_index={self.ignore_index}, "
                f"sample_rate={self.sample_rate}, sparse_grad={self.sparse_grad}")


__all__ = [
    "__version__",
    "ANCHOR_DEFAULT_GAMMA",
    "ANCHOR_DEFAULT_MARGIN",
    "AnchorCircleLoss",
    "anchor_loss",
    "CircleLoss",
    "CLASS_DEFAULT_GAMMA",
    "CLASS_DEFAULT_MARGIN",
    "ClassCircleLoss",
    "class_loss",
    "DEFAULT_GAMMA",
    "DEFAULT_MARGIN",
    "circle_loss",
    "library_path",
]
