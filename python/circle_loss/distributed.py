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

Gradient and data-parallel training: every rank's loss is the global loss,
so calling backward on each rank gives each the gradient of the global loss
through its own rows. Parameters shared across ranks get the *sum* of these
per-rank contributions as their true gradient; DistributedDataParallel
averages instead, so multiply the loss by the world size under DDP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import DEFAULT_GAMMA, DEFAULT_MARGIN


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


def _check_local(features, labels, margin, gamma):
    """The op's own checks, at no cost on meta tensors; labels on another
    device keep that device, so the device check fires too."""
    for name, value in (("features", features), ("labels", labels)):
        if not isinstance(value, torch.Tensor):
            raise RuntimeError(f"circle_loss.distributed.loss: {name} must be a tensor, got {type(value).__name__}")
    same_device = labels.device == features.device
    torch.ops.circle.loss(features.to("meta"), labels.to("meta") if same_device else labels, margin, gamma)


def _agreed_sizes(features, labels, margin, gamma, group, need_grad):
    """Every rank's row count, and whether any rank's rows need a gradient,
    once all ranks are known to have valid input and to agree on D, dtype,
    margin and gamma. One all_gather carries all of it, so every rank raises
    the same error, or none does, before any ring traffic: a rank that raised
    alone would leave the others waiting. The gradient's ring takes every
    rank, so a rank whose rows need none (an empty shard, rows under
    no_grad) still runs it when another rank's rows do."""
    problem = None
    try:
        _check_local(features, labels, margin, gamma)
    except RuntimeError as error:
        problem = error
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    on_cuda = "nccl" in str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    valid = problem is None
    local = torch.tensor(
        [
            float(valid),
            float(features.shape[0]) if valid else -1.0,
            float(features.shape[1]) if valid else -1.0,
            float(_DTYPES.index(features.dtype)) if valid else -1.0,
            float(margin) if valid else 0.0,
            float(gamma) if valid else 0.0,
            float(need_grad),
        ],
        dtype=torch.float64,
        device=device,
    )
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    rows = torch.stack(gathered).cpu().tolist()  # the one host synchronisation: shapes
    bad = [r for r, row in enumerate(rows) if row[0] != 1.0]
    if bad:
        if problem is not None:
            raise RuntimeError(f"circle_loss.distributed.loss: rank {rank}: {problem}") from problem
        raise RuntimeError(f"circle_loss.distributed.loss: bad input on rank(s) {bad}; see their errors")
    agreed = {
        "D": [int(row[2]) for row in rows],
        "dtype": [str(_DTYPES[int(row[3])]) for row in rows],
        "margin": [row[4] for row in rows],
        "gamma": [row[5] for row in rows],
    }
    differing = {name: values for name, values in agreed.items() if len(set(values)) > 1}
    if differing:
        details = "; ".join(f"{name} by rank: {values}" for name, values in differing.items())
        raise RuntimeError(
            "circle_loss.distributed.loss: every rank must pass features of the same width D and "
            f"dtype, and the same margin and gamma, got {details}"
        )
    return [int(row[1]) for row in rows], any(row[6] == 1.0 for row in rows)


def _loss_and_grad(features, labels, margin, gamma, group, need_grad):
    """The global loss and, where any rank's rows need a gradient, this
    rank's rows' gradient of it (None where none does)."""
    sizes, need_grad = _agreed_sizes(features, labels, margin, gamma, group, need_grad)
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
    def forward(ctx, features, labels, margin, gamma, group):
        loss, grad = _loss_and_grad(features.detach(), labels, margin, gamma, group, ctx.needs_input_grad[0])
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
        return grad * grad_loss, None, None, None, None


def loss(
    features: torch.Tensor,
    labels: torch.Tensor,
    margin: float = DEFAULT_MARGIN,
    gamma: float = DEFAULT_GAMMA,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Circle Loss of the batch formed by every rank's rows (in rank order).

    Args:
        features: (B_rank, D) this rank's rows; B_rank may differ per rank, 0 included.
        labels: (B_rank,) integer labels of those rows.
        margin, gamma: as for :func:`circle_loss.circle_loss`; equal on every rank.
        group: the process group (default: the world).

    Returns:
        The global loss, a 0-dim tensor identical on every rank; backward gives
        this rank's rows their gradient of it. Every rank of the group must call.
    """
    if not (dist.is_available() and dist.is_initialized()):
        _check_local(features, labels, margin, gamma)  # no group: the op's own error, at once
    return _DistributedCircleLoss.apply(features, labels, float(margin), float(gamma), group)


class CircleLoss(torch.nn.Module):
    """``nn.Module`` form of :func:`loss`."""

    def __init__(self, margin: float = DEFAULT_MARGIN, gamma: float = DEFAULT_GAMMA, group=None) -> None:
        super().__init__()
        self.margin = float(margin)
        self.gamma = float(gamma)
        self.group = group

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss(features, labels, self.margin, self.gamma, self.group)

    def extra_repr(self) -> str:
        return f"margin={self.margin}, gamma={self.gamma}"
