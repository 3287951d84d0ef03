"""One rank of a distributed circle loss check, started by tests/test_distributed.py
(or by hand on a multi-GPU machine):

    python tests/distributed_worker.py RANK WORLD PORT OUT_DIR [--backend nccl --device cuda]

Every rank builds the same global batch from a fixed seed, takes its rows
(uneven split, possibly none), computes circle_loss.distributed.loss and its
gradient, and saves them to OUT_DIR/rank<RANK>.pt.
"""

import argparse
import datetime
import os

import torch
import torch.distributed as dist

import circle_loss
import circle_loss.distributed


def split_sizes(batch: int, world: int) -> list[int]:
    """Uneven on purpose: rank 1 of 3 or more gets nothing."""
    weights = [w + 1 for w in range(world)]
    if world >= 3:
        weights[1] = 0
    sizes = [batch * w // sum(weights) for w in weights]
    sizes[-1] += batch - sum(sizes)
    return sizes


def global_batch(batch, dim, dtype, device):
    generator = torch.Generator().manual_seed(1234)
    features = torch.nn.functional.normalize(torch.randn(batch, dim, generator=generator, dtype=torch.float64), dim=1)
    labels = torch.randint(0, 12, (batch,), generator=generator)
    return features.to(device=device, dtype=dtype), labels.to(device)


def refusals(rank: int, device) -> dict[str, str]:
    """Each case: rank 1 passes something the others do not; every rank must
    raise a clear error (the same one, bar the bad rank's own detail), with no
    hang and no crash. Returns each case's message on this rank."""
    features, labels = global_batch(40, 8, torch.float32, device)
    deviant = rank == 1
    cases = {
        "dim": (torch.randn(40, 16, device=device) if deviant else features, labels, 0.25, 64.0),
        "dtype": (features.double() if deviant else features, labels, 0.25, 64.0),
        "margin": (features, labels, 0.3 if deviant else 0.25, 64.0),
        "gamma": (features, labels, 0.25, 32.0 if deviant else 64.0),
        "labels": (features, labels[:-1] if deviant else labels, 0.25, 64.0),
    }
    messages = {}
    for name, (f, y, margin, gamma) in cases.items():
        try:
            circle_loss.distributed.loss(f, y, margin, gamma)
            messages[name] = "no error"
        except RuntimeError as error:
            messages[name] = str(error)
    for name, value in (("reduce_grads", "sum"), ("reduce_grads_invalid", "average")):
        for form in ("loss", "anchor_loss"):
            try:
                getattr(circle_loss.distributed, form)(features, labels, reduce_grads=value if deviant else "mean")
                messages[f"{name} {form}"] = "no error"
            except RuntimeError as error:
                messages[f"{name} {form}"] = str(error)
    rows = features.clone().requires_grad_()
    loss = circle_loss.distributed.loss(rows, labels, 0.25, 64.0, reduce_grads="sum")
    try:
        torch.autograd.grad(loss, rows, create_graph=True)
        messages["double_backward"] = "no error"
    except RuntimeError as error:
        messages["double_backward"] = str(error)
    return messages


MIXED_GRAD_CASES = ("plain_empty_shard", "rows_without_grad", "under_no_grad")


def mixed_grad(rank: int, world: int, device) -> dict[str, tuple]:
    """Each case: rank 1's rows need no gradient, the others' do; every rank
    must finish with the global loss, and the others' rows get their
    gradient. Returns each case's (loss, gradient of this rank's rows or
    None) on this rank, for the batch of mixed_grad_sizes."""
    sizes = mixed_grad_sizes(world)
    first = sum(sizes[:rank])
    features, labels = global_batch(sum(sizes), 8, torch.float64, device)
    rows, row_labels = features[first : first + sizes[rank]], labels[first : first + sizes[rank]]
    results = {}
    for case in MIXED_GRAD_CASES:
        mine = rows.clone().requires_grad_(rank != 1 or case == "under_no_grad")
        if rank == 1 and case == "plain_empty_shard":
            mine, row_labels_1 = torch.empty(0, 8, dtype=torch.float64, device=device), row_labels[:0]
        else:
            row_labels_1 = row_labels
        with torch.set_grad_enabled(not (rank == 1 and case == "under_no_grad")):
            loss = circle_loss.distributed.loss(mine, row_labels_1, 0.25, 64.0, reduce_grads="sum")
        grad = torch.autograd.grad(loss, mine)[0].cpu() if loss.requires_grad else None
        results[case] = (loss.detach().cpu(), grad)
    return results


def mixed_grad_sizes(world: int) -> list[int]:
    """Rank 1 holds no rows; the others 30, 40, ... (the plain empty shard's
    case needs rank 1 empty in all cases, so that the batches agree)."""
    return [0 if r == 1 else 30 + 10 * r for r in range(world)]


def class_head(rank: int, world: int, device) -> dict:
    """The sharded class-level head on each dtype: rank 1 holds no rows (3
    ranks and more), the others uneven shares; each rank's loss, its rows'
    gradient and its weight shard's gradient. Then the cases in which rank
    1 deviates, each rank's error message."""
    results = {}
    for dtype in (torch.float64, torch.float32):
        sizes = mixed_grad_sizes(world)
        first = sum(sizes[:rank])
        generator = torch.Generator().manual_seed(99)
        embeddings = torch.randn(sum(sizes), 16, generator=generator, dtype=torch.float64)
        labels = torch.randint(0, 1000, (sum(sizes),), generator=generator)
        weight = torch.randn(1000, 16, generator=generator, dtype=torch.float64)
        head = circle_loss.distributed.ClassCircleLoss(1000, 16, margin=0.25, gamma=64.0, reduce_grads="sum").to(device, dtype)
        start, stop = head.class_range
        with torch.no_grad():
            head.weight.copy_(weight[start:stop])
        rows = embeddings[first : first + sizes[rank]].to(device, dtype).requires_grad_()
        loss = head(rows, labels[first : first + sizes[rank]].to(device))
        loss.backward()
        results[str(dtype)] = dict(loss=loss.detach().cpu(), grad=rows.grad.cpu(), weight_grad=head.weight.grad.cpu(),
                                   class_range=head.class_range)
    # Half-precision rows against float32 weights, and rows left out by
    # ignore_index (every third), against the float64 head's values.
    sizes = mixed_grad_sizes(world)
    first = sum(sizes[:rank])
    ignored = labels.clone()
    ignored[::3] = -100
    mine = slice(first, first + sizes[rank])
    for dtype in (torch.float64, torch.bfloat16):
        weight_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        head = circle_loss.distributed.ClassCircleLoss(1000, 16, margin=0.25, gamma=64.0,
                                                   reduce_grads="sum").to(device, weight_dtype)
        with torch.no_grad():
            head.weight.copy_(weight[head.class_range[0] : head.class_range[1]])
        rows = embeddings[mine].to(device, dtype).requires_grad_()
        loss = head(rows, ignored[mine].to(device))
        loss.backward()
        results[f"ignored {dtype}"] = dict(loss=loss.detach().double().cpu(), grad=rows.grad.double().cpu(),
                                           weight_grad=head.weight.grad.cpu(), weight_dtype=str(head.weight.dtype))
    # Partial FC: each rank samples 30% of its shard; the labels lie in the
    # first 150 classes, so the later ranks' classes label no row.
    sampled = labels % 150
    head = circle_loss.distributed.ClassCircleLoss(1000, 16, margin=0.25, gamma=64.0, sample_rate=0.3,
                                               reduce_grads="sum").to(device)
    head.double()
    with torch.no_grad():
        head.weight.copy_(weight[head.class_range[0] : head.class_range[1]])
    rows = embeddings[mine].to(device).requires_grad_()
    loss = head(rows, sampled[mine].to(device))
    loss.backward()
    results["sampled"] = dict(loss=loss.detach().cpu(), grad=rows.grad.cpu(), weight_grad=head.weight.grad.cpu(),
                              kept=head.last_kept.cpu())
    # Every rank seeds alike (the DDP recipe): the shards must still start
    # apart, and the default generators stay in step.
    torch.manual_seed(5)
    head = circle_loss.distributed.ClassCircleLoss(1001, 16)
    results["initial"] = dict(weight=head.weight.detach().clone(), next_draw=torch.rand(4))
    messages = {}
    deviant = rank == 1
    rows = torch.randn(4, 16, device=device)
    in_range = torch.zeros(4, dtype=torch.long, device=device)
    cases = {
        "num_classes": lambda: (circle_loss.distributed.ClassCircleLoss(30 if deviant else 40, 16), rows, in_range),
        "margin": lambda: (circle_loss.distributed.ClassCircleLoss(40, 16, margin=0.3 if deviant else 0.25), rows,
                           in_range),
        "width": lambda: (circle_loss.distributed.ClassCircleLoss(40, 8 if deviant else 16), rows[:, :8] if deviant
                          else rows, in_range),
        # Bad embeddings or labels on one rank: the same error on every rank, no hang.
        "1-D": lambda: (circle_loss.distributed.ClassCircleLoss(40, 16), rows[0] if deviant else rows, in_range),
        "empty": lambda: (circle_loss.distributed.ClassCircleLoss(40, 16), torch.empty(0, device=device) if deviant
                          else rows, in_range),
        "integer": lambda: (circle_loss.distributed.ClassCircleLoss(40, 16), rows.long() if deviant else rows,
                            in_range),
        "label": lambda: (circle_loss.distributed.ClassCircleLoss(40, 16), rows, in_range + 40 if deviant
                          else in_range),
    }
    for name, make in cases.items():
        head, x, y = make()
        try:
            head.to(device)(x, y)
            messages[name] = "no error"
        except RuntimeError as error:
            messages[name] = str(error)
    results["messages"] = messages
    return results


def per_anchor(rank: int, world: int, device) -> dict:
    """distributed.anchor_loss on uneven shards (rank 1 without rows from 3
    ranks on), each rank with an incoming gradient of its own; the module;
    and each rank's error where rank 1's rows need no gradient."""
    sizes = mixed_grad_sizes(world)
    first = sum(sizes[:rank])
    results = {}
    for dtype in (torch.float64, torch.float32):
        features, labels = global_batch(sum(sizes), 8, dtype, device)
        incoming = torch.linspace(0.5, 1.5, sum(sizes), dtype=dtype, device=device)[first : first + sizes[rank]]
        rows = features[first : first + sizes[rank]].clone().requires_grad_()
        losses = circle_loss.distributed.anchor_loss(rows, labels[first : first + sizes[rank]], 0.4, 80.0,
                                                     reduce_grads="sum")
        (losses * incoming).sum().backward()
        module_rows = features[first : first + sizes[rank]].clone().requires_grad_()
        mean = circle_loss.distributed.AnchorCircleLoss(0.4, 80.0, reduce_grads="sum")(module_rows,
                                                                                    labels[first : first + sizes[rank]])
        mean.backward()
        with torch.no_grad():
            no_grad = circle_loss.distributed.anchor_loss(rows, labels[first : first + sizes[rank]], 0.4, 80.0)
        results[str(dtype)] = dict(losses=losses.detach().cpu(), grad=rows.grad.cpu(), mean=mean.detach().cpu(),
                                   mean_grad=module_rows.grad.cpu(), no_grad=no_grad.cpu())
    features, labels = global_batch(sum(sizes), 8, torch.float32, device)
    own = labels[first : first + sizes[rank]]
    cases = {
        "disagreement": lambda: (features[first : first + sizes[rank]].clone().requires_grad_(rank != 1), own, 0.4),
        "margin": lambda: (features[first : first + sizes[rank]], own, 0.5 if rank == 1 else 0.4),
        "width": lambda: (features[first : first + sizes[rank], : 4 if rank == 1 else 8], own, 0.4),
    }
    for name, make in cases.items():
        rows, row_labels, margin = make()
        try:
            circle_loss.distributed.anchor_loss(rows, row_labels, margin)
            results[name] = "no error"
        except RuntimeError as error:
            results[name] = str(error)
    return results


def pml_wrapper(rank: int, world: int, device) -> dict:
    """PML's DistributedLossWrapper and the drop-in, on equal shards (PML's
    gather needs them), in both modes and around several losses: each
    rank's loss and its rows' gradient, or the error raised."""
    from pytorch_metric_learning import losses
    from pytorch_metric_learning.utils.distributed import DistributedLossWrapper

    import circle_loss.pml

    generator = torch.Generator().manual_seed(7)
    features = torch.randn(world * 24, 16, generator=generator, dtype=torch.float64).to(device)
    labels = torch.randint(0, 5, (world * 24,), generator=generator).to(device)
    rows, row_labels = features[rank * 24 : (rank + 1) * 24], labels[rank * 24 : (rank + 1) * 24]
    inner = {
        "CircleLoss": (losses.CircleLoss, circle_loss.pml.CircleLoss),
        "ContrastiveLoss": (losses.ContrastiveLoss, losses.ContrastiveLoss),
        "CrossBatchMemory": (lambda: losses.CrossBatchMemory(losses.CircleLoss(), 16, memory_size=200),
                             lambda: circle_loss.pml.CrossBatchMemory(circle_loss.pml.CircleLoss(), 16, memory_size=200)),
    }
    calls = []
    fused = circle_loss.pml.anchor_loss
    circle_loss.pml.anchor_loss = lambda *args: calls.append(1) or fused(*args)
    results = {}
    for name, (stock_loss, our_loss) in inner.items():
        for efficient in (False, True):
            for label_kind in ("int", "float"):
                y = row_labels if label_kind == "int" else row_labels.double() / 2
                got = []
                calls.clear()
                for wrapper, make in ((DistributedLossWrapper, stock_loss), (circle_loss.pml.DistributedLossWrapper,
                                                                             our_loss)):
                    leaf = rows.clone().requires_grad_()
                    try:
                        loss = wrapper(make(), efficient=efficient)(leaf, y)
                        loss.backward()
                        got.append((loss.detach().cpu(), leaf.grad.cpu()))
                    except (ValueError, TypeError, RuntimeError) as error:
                        got.append(type(error).__name__)
                results[(name, efficient, label_kind)] = (*got, len(calls))
    return results


def ddp_case(form: str, world: int):
    """The documented recipe: a backbone under DistributedDataParallel, the
    form (the class-level head kept outside DDP), a plain step's gradients;
    the global batch of 60 rows and the head's weights from a fixed seed."""
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(60, 12, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 6 if form != "class" else 40, (60,), generator=generator)
    weight = torch.randn(40, 16, generator=generator, dtype=torch.float64)
    torch.manual_seed(3)
    backbone = torch.nn.Linear(12, 16).double()
    if form == "class":
        head = (circle_loss.distributed.ClassCircleLoss(40, 16, gamma=64.0) if world else
                circle_loss.ClassCircleLoss(40, 16, gamma=64.0)).double()
        with torch.no_grad():
            head.weight.copy_(weight[head.class_range[0] : head.class_range[1]] if world else weight)
        loss_of = head
    elif form == "anchor":
        head = None
        criterion = circle_loss.distributed.AnchorCircleLoss() if world else circle_loss.AnchorCircleLoss()
        loss_of = lambda e, y: criterion(torch.nn.functional.normalize(e, dim=1), y)  # noqa: E731
    else:
        head = None
        criterion = circle_loss.distributed.CircleLoss(gamma=64.0) if world else circle_loss.CircleLoss(gamma=64.0)
        loss_of = lambda e, y: criterion(torch.nn.functional.normalize(e, dim=1), y)  # noqa: E731
    return inputs, labels, backbone, head, loss_of


def ddp_training(rank: int, world: int) -> dict:
    """Each form's step under DDP on this rank's rows (uneven, rank 1 empty
    from 3 ranks on): the loss, the backbone's gradients after DDP's
    all-reduce, the head's gradient."""
    sizes = split_sizes(60, world)
    mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    results = {}
    for form in ("loss", "anchor", "class"):
        inputs, labels, backbone, head, loss_of = ddp_case(form, world)
        model = torch.nn.parallel.DistributedDataParallel(backbone)
        loss = loss_of(model(inputs[mine]), labels[mine])
        loss.backward()
        results[form] = dict(loss=loss.detach(), grads=[p.grad.clone() for p in backbone.parameters()],
                             head_grad=None if head is None else head.weight.grad.clone())
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rank", type=int)
    parser.add_argument("world", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("out")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=300)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--refusals", action="store_true",
                        help="instead: rank 1 deviates in each way the ranks must agree on; save every message")
    parser.add_argument("--class-head", action="store_true",
                        help="instead: the sharded class-level head; save each rank's results and errors")
    parser.add_argument("--per-anchor", action="store_true",
                        help="instead: distributed.anchor_loss and its module; save each rank's results")
    parser.add_argument("--pml-wrapper", action="store_true",
                        help="instead: PML's DistributedLossWrapper against the drop-in; save each rank's results")
    parser.add_argument("--mixed-grad", action="store_true",
                        help="instead: rank 1's rows need no gradient, the others' do; save each case's results")
    parser.add_argument("--ddp", action="store_true",
                        help="instead: each form under DistributedDataParallel; save each rank's gradients")
    args = parser.parse_args()
    device = torch.device(args.device, args.rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        args.backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
        world_size=args.world, timeout=datetime.timedelta(seconds=120),
    )
    special = refusals(args.rank, device) if args.refusals else None
    special = mixed_grad(args.rank, args.world, device) if args.mixed_grad else special
    special = class_head(args.rank, args.world, device) if args.class_head else special
    special = per_anchor(args.rank, args.world, device) if args.per_anchor else special
    special = pml_wrapper(args.rank, args.world, device) if args.pml_wrapper else special
    special = ddp_training(args.rank, args.world) if args.ddp else special
    if special is not None:
        torch.save(special, os.path.join(args.out, f"rank{args.rank}.pt"))
        dist.destroy_process_group()
        return
    sizes = split_sizes(args.batch, args.world)
    first = sum(sizes[: args.rank])
    results = {}
    for dtype in (torch.float64, torch.float32):
        features, labels = global_batch(args.batch, args.dim, dtype, device)
        rows = features[first : first + sizes[args.rank]].clone().requires_grad_()
        loss = circle_loss.distributed.loss(rows, labels[first : first + sizes[args.rank]], 0.25, 64.0,
                                            reduce_grads="sum")
        loss.backward()
        with torch.no_grad():
            no_grad_loss = circle_loss.distributed.CircleLoss(0.25, 64.0)(rows, labels[first : first + sizes[args.rank]])
            with torch.autocast(device.type, dtype=torch.bfloat16):
                autocast_loss = circle_loss.distributed.loss(rows, labels[first : first + sizes[args.rank]], 0.25, 64.0)
        results[str(dtype)] = dict(loss=loss.detach().cpu(), no_grad_loss=no_grad_loss.cpu(),
                                   autocast_loss=autocast_loss.cpu(), grad=rows.grad.cpu(), first=first)
    torch.save(results, os.path.join(args.out, f"rank{args.rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
