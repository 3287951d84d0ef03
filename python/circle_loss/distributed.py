"""Exact Circle Loss over a batch sharded across processes (torch.distributed).

Each rank passes its own rows and labels; every rank gets the loss of the
*global* batch, and backward gives each rank the gradient of that loss with
respect to its own rows: the same, to rounding, as `circle_loss.circle_loss`
on the concatenated batch. gloo (CPU) and NCCL (CUDA) both work; ranks may
hold different numbers of rows, zero included, and need not agree on whether
their rows need a gradient.

How: the loss depends on all pairs only through two log-sum-exps, and the
gradient of row i is 2·Σ_j G_ij f_j (docs/math.md). Feature blocks travel round a
ring twice (point-to-point, each step overlapped with the computation on the
block before), so no rank ever holds more than two blocks nor any
B_global × B_global matrix:
  1. each rank folds LSE partials of its rows against every block
     (circle::_lse_partials); all ranks gather them and fold them in rank
     order (circle::_lse_finish), so every rank holds identical scalars;
  2. each rank sums circle::_block_grad of its rows against every block.

Gradient and data-parallel training, the rule of every form here: every
rank's loss is the global loss, and backward gives each rank's rows their
share of its gradient. The model's parameters, replicated over the ranks,
need the *sum* of the shares; DistributedDataParallel (and FSDP) *average*
them. With reduce_grads="mean", the default, each rank's rows get world ×
their share, so that DDP's average is the global loss's gradient and the
documented recipe (the model under DDP, a plain optimiser, the learning
rate of one process on the whole batch) trains as one process on the whole
batch would; the value returned is still the global loss. With
reduce_grads="sum" each rank's rows get exactly their share, for a
wrapper that sums the ranks' gradients (or none). The class-level head's
own weights are each rank's alone and get their exact gradient either way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import ClassCircleLoss as _OneProcessClassCircleLoss
from . import (
    ANCHOR_DEFAULT_GAMMA,
    ANCHOR_DEFAULT_MARGIN,
    CLASS_DEFAULT_GAMMA,
    CLASS_DEFAULT_MARGIN,
    DEFAULT_GAMMA,
    DEFAULT_MARGIN,
    _check_embeddings,
    _kept_columns,
    _sampled_classes,
    _valid_labels,
)


def _ring_blocks(features, labels, sizes, group):
    """Yields (features, labels) of every rank's block, own block first, each
    next block already in flight while the caller works on the current one."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    send_to = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    recv_from = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    current = (features, labels)
    for step in range(world):
        pending, incoming = [], None
        if step + 1 < world:
            owner_next = (rank - step - 1) % world  # whose block arrives next
            incoming = (
                features.new_empty((sizes[owner_next], features.shape[1])),
                labels.new_empty((sizes[owner_next],)),
            )
            ops = []
            owner_now = (rank - step) % world
            if sizes[owner_now] > 0:  # both sides know the sizes, so both skip empty blocks
                ops += [dist.P2POp(dist.isend, t, send_to, group) for t in current]
            if sizes[owner_next] > 0:
                ops += [dist.P2POp(dist.irecv, t, recv_from, group) for t in incoming]
            if ops:
                pending = dist.batch_isend_irecv(ops)
        yield current
        for request in pending:
            request.wait()
        if incoming is not None:
            current = incoming


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_REDUCE_GRADS = ("mean", "sum")


def _reduce_grads_value(reduce_grads) -> float:
    """reduce_grads as the agreement carries it (-1: not a valid value,
    which the rank's own check then names)."""
    return float(_REDUCE_GRADS.index(reduce_grads)) if reduce_grads in _REDUCE_GRADS else -1.0


def _check_reduce_grads(reduce_grads) -> None:
    if reduce_grads not in _REDUCE_GRADS:
        raise RuntimeError(f"reduce_grads must be 'mean' (a wrapper that averages the ranks' gradients, as "
                           f"DistributedDataParallel does) or 'sum', got {reduce_grads!r}")


class _ScaledGradient(torch.autograd.Function):
    """rows as they are; their gradient times `factor`."""

    @staticmethod
    def forward(ctx, rows, factor):
        ctx.factor = factor
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _for_data_parallel(rows, reduce_grads, group):
    """rows whose gradient, under reduce_grads="mean", is world × theirs: the
    share that a wrapper averaging over the ranks turns into the sum."""
    if reduce_grads == "sum" or not (isinstance(rows, torch.Tensor) and rows.requires_grad):
        return rows
    return _ScaledGradient.apply(rows, float(dist.get_world_size(group)))


def _check_local(features, labels, margin, gamma, op="loss"):
    """The op's own checks, at no cost on meta tensors; labels on another
    device keep that device, so the device check fires too."""
    for name, value in (("features", features), ("labels", labels)):
        if not isinstance(value, torch.Tensor):
            raise RuntimeError(f"circle_loss.distributed.{op}: {name} must be a tensor, got {type(value).__name__}")
    same_device = labels.device == features.device
    torch.ops.circle.loss(features.to("meta"), labels.to("meta") if same_device else labels, margin, gamma)


def _collective_device(group):
    on_cuda = "nccl" in str(dist.get_backend(group))
    return torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")


def _agree(name, check, features, agreed, group, need_grad, hints=None):
    """Every rank's row count, and whether any rank's rows need a gradient,
    once every rank's check() has passed and all ranks agree on the values
    in `agreed` (name -> a float: the width D, dtype, margin, gamma, ...).
    One all_gather carries all of it, so every rank raises the same error,
    or none does, before any other collective: a rank that raised alone
    would leave the others waiting. The gradients' collectives take every
    rank, so a rank whose rows need none (an empty shard, rows under
    no_grad) still takes part when another rank's rows need one."""
    problem = None
    try:
        check()
    except RuntimeError as error:
        problem = error
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    valid = problem is None
    values = [float(v) for v in agreed.values()] if valid else [0.0] * len(agreed)
    local = torch.tensor(
        [float(valid), float(features.shape[0]) if valid else -1.0, float(need_grad), *values],
        dtype=torch.float64,
        device=_collective_device(group),
    )
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    rows = torch.stack(gathered).cpu().tolist()  # the one host synchronisation: shapes
    bad = [r for r, row in enumerate(rows) if row[0] != 1.0]
    if bad:
        if problem is not None:
            raise RuntimeError(f"circle_loss.distributed.{name}: rank {rank}: {problem}") from problem
        raise RuntimeError(f"circle_loss.distributed.{name}: bad input on rank(s) {bad}; see their errors")
    by_rank = {key: [row[3 + k] for row in rows] for k, key in enumerate(agreed)}
    differing = {key: values for key, values in by_rank.items() if len(set(values)) > 1}
    if differing:
        shown = {key: [_SHOWN.get(key, float)(v) for v in values] for key, values in differing.items()}
        details = "; ".join(f"{key} by rank: {values}" + (hints or {}).get(key, "") for key, values in shown.items())
        raise RuntimeError(
            f"circle_loss.distributed.{name}: every rank must pass the same {', '.join(agreed)}, got {details}"
        )
    return [int(row[1]) for row in rows], any(row[2] == 1.0 for row in rows)


# How the errors show agreed values other than floats.
_SHOWN = {
    "D": int,
    "num_classes": int,
    "dtype": lambda v: str(_DTYPES[int(v)]),
    "needs a gradient": bool,
    "reduce_grads": lambda v: _REDUCE_GRADS[int(v)] if v >= 0 else "invalid",
}


def _agreed_values(features, margin, gamma, **more):
    """What every rank must pass alike: the width D and dtype of its
    features (-1 where they are not (B, D) floating rows, which its own
    check then names), margin, gamma, and `more`."""
    valid = isinstance(features, torch.Tensor) and features.dim() == 2 and features.dtype in _DTYPES
    return {
        "D": features.shape[1] if valid else -1,
        "dtype": _DTYPES.index(features.dtype) if valid else -1,
        "margin": margin,
        "gamma": gamma,
        **more,
    }


def _agreed_sizes(features, labels, margin, gamma, reduce_grads, group, need_grad):
    """_agree for the global form's arguments."""

    def check():
        _check_reduce_grads(reduce_grads)
        _check_local(features, labels, margin, gamma)

    return _agree("loss", check, features,
                  _agreed_values(features, margin, gamma, reduce_grads=_reduce_grads_value(reduce_grads)), group,
                  need_grad)


def _loss_and_grad(features, labels, margin, gamma, reduce_grads, group, need_grad):
    """The global loss and, where any rank's rows need a gradient, this
    rank's rows' gradient of it (None where none does)."""
    sizes, need_grad = _agreed_sizes(features, labels, margin, gamma, reduce_grads, group, need_grad)
    world = len(sizes)
    labels = labels.to(torch.int64).contiguous()
    features = features.contiguous()

    partials = torch.stack([
        torch.ops.circle._lse_partials(features, labels, cols, col_labels, margin, gamma)
        for cols, col_labels in _ring_blocks(features, labels, sizes, group)
    ])  # (world, 4), by ring step
    every_rank = [torch.empty_like(partials) for _ in range(world)]
    dist.all_gather(every_rank, partials, group=group)
    scalars = torch.ops.circle._lse_finish(torch.cat(every_rank))  # identical on all ranks
    loss = scalars[2].to(features.dtype)
    if not need_grad:
        return loss, None
    grad = None
    for cols, col_labels in _ring_blocks(features, labels, sizes, group):
        block = torch.ops.circle._block_grad(features, labels, cols, col_labels, scalars, margin, gamma)
        grad = block if grad is None else grad.add_(block)
    return loss, grad.to(features.dtype)


class _DistributedCircleLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, features, labels, margin, gamma, reduce_grads, group):
        loss, grad = _loss_and_grad(features.detach(), labels, margin, gamma, reduce_grads, group,
                                    ctx.needs_input_grad[0])
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if torch.is_grad_enabled():
            # The saved gradient carries no graph: a second derivative through
            # it would be silently zero, as circle::loss refuses too.
            raise RuntimeError(
                "circle_loss.distributed.loss does not support double backward: its gradient is "
                "computed in the forward pass and is not differentiable again. Call backward or "
                "torch.autograd.grad without create_graph=True."
            )
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None, None, None, None


def loss(
    features: torch.Tensor,
    labels: torch.Tensor,
    margin: float = DEFAULT_MARGIN,
    gamma: float = DEFAULT_GAMMA,
    group: dist.ProcessGroup | None = None,
    reduce_grads: str = "mean",
) -> torch.Tensor:
    """Circle Loss of the batch formed by every rank's rows (in rank order).

    Args:
        features: (B_rank, D) this rank's rows; B_rank may differ per rank, 0 included.
        labels: (B_rank,) integer labels of those rows.
        margin, gamma: as for :func:`circle_loss.circle_loss`; equal on every rank.
        group: the process group (default: the world).
        reduce_grads: "mean" (the model under DistributedDataParallel) or
            "sum": see the module's docstring; equal on every rank.

    Returns:
        The global loss, a 0-dim tensor identical on every rank; backward gives
        this rank's rows their gradient of it (times the world size under
        reduce_grads="mean"). Every rank of the group must call.
    """
    if not (dist.is_available() and dist.is_initialized()):
        _check_local(features, labels, margin, gamma)  # no group: the op's own error, at once
    return _DistributedCircleLoss.apply(_for_data_parallel(features, reduce_grads, group), labels, float(margin),
                                        float(gamma), reduce_grads, group)


class CircleLoss(torch.nn.Module):
    """``nn.Module`` form of :func:`loss`."""

    def __init__(self, margin: float = DEFAULT_MARGIN, gamma: float = DEFAULT_GAMMA, group=None,
                 reduce_grads: str = "mean") -> None:
        super().__init__()
        self.margin = float(margin)
        self.gamma = float(gamma)
        self.group = group
        self.reduce_grads = reduce_grads

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This rank's (B_rank, D) features and (B_rank,) labels -> the
        global loss, the same on every rank (see :func:`loss`)."""
        return loss(features, labels, self.margin, self.gamma, self.group, self.reduce_grads)

    def extra_repr(self) -> str:
        return f"margin={self.margin}, gamma={self.gamma}, reduce_grads={self.reduce_grads!r}"


def _all_gather_rows(rows, sizes, group):
    """Every rank's rows (sizes[r] of them) in rank order, on every rank:
    padded to the largest shard for the all_gather, which needs equal sizes."""
    widest = max(sizes)
    padded = rows.new_zeros((widest, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([block[:n] for block, n in zip(gathered, sizes)])


def _agreed_class_batch(embeddings, labels, weight, num_classes, ignore_index, margin, gamma, reduce_grads, group,
                        need_grad):
    """_agree for the sharded head, on the embeddings as the user passed
    them (before any normalisation, which would raise on one rank alone):
    every rank's row count and whether any rank needs a gradient. A label
    outside [0, num_classes) other than ignore_index is refused here, on
    every rank, at the cost of the host synchronisation the agreement makes
    anyway."""

    def check():  # its errors get the head's name and the rank from _agree
        _check_reduce_grads(reduce_grads)
        for name, value in (("embeddings", embeddings), ("labels", labels)):
            if not isinstance(value, torch.Tensor):
                raise RuntimeError(f"{name} must be a tensor, got {type(value).__name__}")
        _check_embeddings(embeddings, "")
        _check_local(embeddings, labels, margin, gamma, "ClassCircleLoss")
        torch.ops.circle.class_loss(embeddings.to("meta"), labels.to("meta"),
                                    weight.to("meta"), margin, gamma)
        valid = _valid_labels(labels, num_classes, ignore_index)
        if not bool(valid.all()):
            wrong = labels[~valid][:5].tolist()
            raise RuntimeError(f"labels must lie in [0, num_classes = {num_classes}) or equal "
                               f"ignore_index = {ignore_index}, got {wrong}")

    agreed = _agreed_values(embeddings, margin, gamma, num_classes=num_classes, ignore_index=ignore_index,
                            reduce_grads=_reduce_grads_value(reduce_grads))
    return _agree("ClassCircleLoss", check, embeddings, agreed, group, need_grad)


def _class_states_and_grads(features, global_labels, shard_labels, weight, class_index, ignore_index, margin, gamma,
                            group, sizes, need_grad):
    """The mean class-level loss of the global batch (every rank's rows
    against every rank's classes, the rows labelled ignore_index left out),
    and, where any rank needs a gradient, its gradients with respect to this
    rank's rows and its classes `weight`. The rows and classes are
    normalised inside the op; class_index: the kept classes, or None.
    shard_labels: each global row's column (class among `weight`'s rows, or
    position among the kept), outside the columns for a class of another
    rank (or an ignored row)."""
    rank = dist.get_rank(group)
    all_features = _all_gather_rows(features.contiguous(), sizes, group)
    kept = global_labels != ignore_index
    _, row_lse = torch.ops.circle._class_loss_forward(all_features, shard_labels, weight, margin, gamma, True,
                                                      class_index)
    # A row's positive lies on one rank, its negatives on all: both columns,
    # (zp, LSE_N), merge over ranks by one log-sum-exp, the same on every rank.
    states = torch.logsumexp(torch.stack(_all_gather_rows_equal(row_lse, group)), dim=0)
    zp, lse_n = states.unbind(1)
    rows = (zp != -torch.inf) & (lse_n != -torch.inf) & kept
    losses = torch.where(rows, torch.logaddexp(zp + lse_n, torch.zeros_like(zp)), torch.zeros_like(zp))
    batch = kept.sum().clamp_min(1)
    loss = (losses.sum() / batch).to(features.dtype)
    if not need_grad:
        return loss, None, None
    # The gradient of the mean: every kept row's incoming gradient is 1 / B_kept.
    incoming = kept.to(states.dtype) / batch
    grad_rows, grad_weight = torch.ops.circle._class_loss_backward(
        incoming, all_features, shard_labels, weight, states, margin, gamma, True, class_index, True, True)
    dist.all_reduce(grad_rows, group=group)  # every rank's share, summed
    first = sum(sizes[:rank])
    return loss, grad_rows[first : first + sizes[rank]], grad_weight


def _all_gather_rows_equal(tensor, group):
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor.contiguous(), group=group)
    return gathered


class _DistributedClassLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, features, global_labels, shard_labels, weight, class_index, ignore_index, margin, gamma, group,
                sizes, need_grad):
        loss, grad_features, grad_weight = _class_states_and_grads(
            features.detach(), global_labels, shard_labels, weight.detach(), class_index, ignore_index, margin, gamma,
            group, sizes, need_grad)
        ctx.save_for_backward(grad_features, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "circle_loss.distributed.ClassCircleLoss does not support double backward: its gradients are "
                "computed in the forward pass and are not differentiable again."
            )
        grad_features, grad_weight = ctx.saved_tensors
        return (grad_features * grad_loss, None, None, grad_weight * grad_loss) + (None,) * 7


class ClassCircleLoss(_OneProcessClassCircleLoss):
    """The class-level Circle Loss head with its classes sharded across the
    ranks of a process group (model parallel, exact: no class sampling).

    Rank r holds ``weight``, the rows of the classes
    ``torch.tensor_split(torch.arange(num_classes), world)[r]``, and exposes
    them as ``class_range = (start, stop)``. ``forward(embeddings, labels)``
    takes this rank's rows (any number, zero included) with their global
    class labels and returns the mean loss over the global batch, the same
    on every rank: what ``circle_loss.ClassCircleLoss`` gives on the
    concatenated batch with the concatenated weights. Embeddings and labels
    travel (all-gathered), the weights never do. backward gives this rank's
    rows and its weight shard their gradients of that loss; it needs no
    collective of its own (the forward made them), so it is safe to call on
    some ranks only.

    Labels, ``ignore_index`` and mixed precision are as for
    ``circle_loss.ClassCircleLoss``; bad input on any rank (a label out of
    range included) raises the same error on every rank, before any other
    collective. ``sample_rate`` below 1 is Partial FC's sampling on each
    rank's classes: every class of the shard that labels a row of the global
    batch, and up to ``int(sample_rate * classes of the shard)`` in all,
    others drawn at random on each rank; ``last_kept`` holds the shard's
    kept classes (global ids) of the last step. Each rank draws its shard's
    initial rows from a stream of its own, seeded by one draw from the
    default generator (the same on every rank, so the ranks' generators stay
    in step) and by the rank: every class starts from its own row, as in the
    single-process head, though not the same rows.

    Under DistributedDataParallel keep this head out of DDP (its shards
    differ by rank: wrap the backbone alone) and give it a plain optimiser:
    with reduce_grads="mean", the default, the embeddings' gradient is
    world × this rank's share, which DDP's average over the ranks turns into
    the gradient of the global loss, so the whole trains as one process on
    the whole batch would, at its learning rate; the head's weights, each
    rank's own, get their exact gradient. reduce_grads="sum" gives the
    embeddings their exact share, for a wrapper that sums.
    """

    def __init__(
        self,
        num_classes: int,
        embedding_size: int,
        margin: float = CLASS_DEFAULT_MARGIN,
        gamma: float = CLASS_DEFAULT_GAMMA,
        ignore_index: int = -100,
        sample_rate: float = 1.0,
        group: dist.ProcessGroup | None = None,
        reduce_grads: str = "mean",
        sparse_grad: bool = False,
    ) -> None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        counts = [len(shard) for shard in torch.tensor_split(torch.arange(num_classes), world)]
        self.rank = rank  # reset_parameters' stream depends on it
        # The single-process head's parameter and initialisation, on this
        # rank's classes (each row's distribution depends on D alone).
        super().__init__(counts[rank], embedding_size, margin, gamma, ignore_index, sample_rate, sparse_grad)
        self.class_range = (sum(counts[:rank]), sum(counts[: rank + 1]))
        self.num_classes = int(num_classes)
        self.group = group
        self.reduce_grads = reduce_grads

    def reset_parameters(self) -> None:
        # One draw from the default generator on every rank keeps the ranks'
        # generators in step whatever their shard sizes; the rank then picks
        # the stream, so that no two shards start alike.
        seed = int(torch.randint(2**62, (), device="cpu"))
        stream = torch.Generator(device=self.weight.device).manual_seed(seed + 0x9E3779B97F4A7C15 * self.rank % 2**62)
        torch.nn.init.kaiming_uniform_(self.weight, a=5**0.5, generator=stream)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(B_rank, D) embeddings and (B_rank,) labels in [0, num_classes)
        (or ignore_index) -> the 0-dim mean loss of the global batch. Every
        rank must call."""
        need_grad = torch.is_grad_enabled() and (
            (isinstance(embeddings, torch.Tensor) and embeddings.requires_grad) or self.weight.requires_grad)
        sizes, need_grad = _agreed_class_batch(embeddings, labels, self.weight, self.num_classes, self.ignore_index,
                                               self.margin, self.gamma, self.reduce_grads, self.group, need_grad)
        embeddings = _for_data_parallel(embeddings, self.reduce_grads, self.group)
        global_labels = _all_gather_rows(labels.to(torch.int64), sizes, self.group)
        # Each row's class among this shard's (outside [0, C_r) for another
        # rank's class or an ignored row), and the shard's classes.
        shard_labels = global_labels - self.class_range[0]
        classes, index = self.weight, None
        if self.sample_rate < 1.0:
            kept, shard_labels = _sampled_classes(shard_labels, self.weight.shape[0], self.sample_rate)
            self.last_kept = kept + self.class_range[0]
            classes, index = _kept_columns(self.weight, kept, self.sparse_grad)
        shard_labels = torch.where(global_labels != self.ignore_index, shard_labels, -1)
        # The rows and classes are normalised inside the op, as
        # circle_loss.ClassCircleLoss has them.
        return _DistributedClassLoss.apply(embeddings, global_labels, shard_labels, classes, index, self.ignore_index,
                                           self.margin, self.gamma, self.group, sizes, need_grad)

    def extra_repr(self) -> str:
        return (f"num_classes={self.num_classes}, class_range={self.class_range}, "
                f"embedding_size={self.weight.shape[1]}, margin={self.margin}, gamma={self.gamma}, "
                f"ignore_index={self.ignore_index}, sample_rate={self.sample_rate}, sparse_grad={self.sparse_grad}, "
                f"reduce_grads={self.reduce_grads!r}")


class _GatherRows(torch.autograd.Function):
    """Every rank's rows in rank order, with autograd: the backward sums the
    gradient every rank made for the gathered rows (one all_reduce) and
    returns this rank's slice. Every rank whose forward ran must run the
    backward."""

    @staticmethod
    def forward(ctx, rows, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _all_gather_rows(rows.contiguous(), sizes, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        first = sum(ctx.sizes[:rank])
        return grad[first : first + ctx.sizes[rank]], None, None


def anchor_loss(
    features: torch.Tensor,
    labels: torch.Tensor,
    margin: float = ANCHOR_DEFAULT_MARGIN,
    gamma: float = ANCHOR_DEFAULT_GAMMA,
    group: dist.ProcessGroup | None = None,
    reduce_grads: str = "mean",
) -> torch.Tensor:
    """Per-anchor Circle Loss of this rank's rows against the batch formed by
    every rank's rows (in rank order): row i's loss meets every row of the
    global batch but itself, as :func:`circle_loss.anchor_loss` of the
    concatenated batch gives it.

    Args:
        features: (B_rank, D) this rank's rows; B_rank may differ per rank, 0 included.
        labels: (B_rank,) integer labels of those rows.
        margin, gamma: as for :func:`circle_loss.anchor_loss`; equal on every rank.
        group: the process group (default: the world).
        reduce_grads: "mean" (the model under DistributedDataParallel) or
            "sum": see the module's docstring; equal on every rank.

    Returns:
        (B_rank,) losses of this rank's rows. Every rank of the group must
        call, and, for a gradient, every rank must call backward (with its own
        incoming gradient): each rank's rows then get the gradient of the sum
        over ranks of <incoming gradient, losses> (times the world size under
        reduce_grads="mean"), since a row is a query on
        its own rank and a reference on all of them. Ranks that disagree on
        whether their rows need a gradient are refused on every rank, as the
        backward's collective would leave the others waiting.
    """
    if not (dist.is_available() and dist.is_initialized()):
        _check_local(features, labels, margin, gamma, "anchor_loss")  # no group: the op's own error, at once
    margin, gamma = float(margin), float(gamma)
    need_grad = torch.is_grad_enabled() and features.requires_grad
    agreed = _agreed_values(features, margin, gamma, reduce_grads=_reduce_grads_value(reduce_grads),
                            **{"needs a gradient": float(need_grad)})
    hint = {"needs a gradient": (
        " (every rank's backward takes part in one collective, so rows need a gradient on every rank or on none: "
        "pass an empty shard as torch.empty(0, D, requires_grad=True), or call every rank under no_grad)")}

    def check():
        _check_reduce_grads(reduce_grads)
        _check_local(features, labels, margin, gamma, "anchor_loss")

    sizes, _ = _agree("anchor_loss", check, features, agreed, group, need_grad, hint)
    features = _for_data_parallel(features, reduce_grads, group)
    rank = dist.get_rank(group)
    first = sum(sizes[:rank])
    everyone = _GatherRows.apply(features, sizes, group) if need_grad else _all_gather_rows(
        features.contiguous(), sizes, group)
    everyone_labels = _all_gather_rows(labels.to(torch.int64), sizes, group)
    # The own rows are the queries; the gathered batch the references, each
    # query's own copy (at its global position) left out.
    own_copies = torch.arange(first, first + sizes[rank], device=features.device)
    return torch.ops.circle.anchor_loss(features, labels.to(torch.int64), everyone, everyone_labels, margin, gamma,
                                        own_copies)


class _GlobalValue(torch.autograd.Function):
    """The value `total` (the same on every rank), differentiable through
    this rank's share `own` of it."""

    @staticmethod
    def forward(ctx, own, total):
        return total.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class AnchorCircleLoss(torch.nn.Module):
    """``nn.Module`` form of :func:`anchor_loss`: the mean of the nonzero
    rows' losses over the global batch (as ``circle_loss.AnchorCircleLoss``
    reduces one batch), the same value on every rank. Each rank's backward
    gives the gradient of its own rows' share of that mean, so the ranks'
    gradients together are the global mean's (times the world size under
    reduce_grads="mean", for DistributedDataParallel's average: see the
    module's docstring). Every rank must call forward and backward."""

    def __init__(self, margin: float = ANCHOR_DEFAULT_MARGIN, gamma: float = ANCHOR_DEFAULT_GAMMA,
                 group=None, reduce_grads: str = "mean") -> None:
        super().__init__()
        self.margin = float(margin)
        self.gamma = float(gamma)
        self.group = group
        self.reduce_grads = reduce_grads

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This rank's (B_rank, D) features and (B_rank,) labels -> the mean
        of the nonzero per-anchor losses over the global batch, the same on
        every rank."""
        losses = anchor_loss(features, labels, self.margin, self.gamma, self.group, self.reduce_grads)
        totals = torch.stack([losses.detach().sum(), (losses > 0).sum().to(losses.dtype)]).double()
        dist.all_reduce(totals, group=self.group)
        total = _GlobalValue.apply(losses.sum(), totals[0].to(losses.dtype))
        return total / totals[1].clamp_min(1).to(losses.dtype)

    def extra_repr(self) -> str:
        return f"margin={self.margin}, gamma={self.gamma}, reduce_grads={self.reduce_grads!r}"
