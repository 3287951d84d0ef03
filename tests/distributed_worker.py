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
    rows = features.clone().requires_grad_()
    loss = circle_loss.distributed.loss(rows, labels, 0.25, 64.0)
    try:
        torch.autograd.grad(loss, rows, create_graph=True)
        messages["double_backward"] = "no error"
    except RuntimeError as error:
        messages["double_backward"] = str(error)
    return messages


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
    args = parser.parse_args()
    device = torch.device(args.device, args.rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        args.backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
        world_size=args.world, timeout=datetime.timedelta(seconds=120),
    )
    if args.refusals:
        torch.save(refusals(args.rank, device), os.path.join(args.out, f"rank{args.rank}.pt"))
        dist.destroy_process_group()
        return
    sizes = split_sizes(args.batch, args.world)
    first = sum(sizes[: args.rank])
    results = {}
    for dtype in (torch.float64, torch.float32):
        features, labels = global_batch(args.batch, args.dim, dtype, device)
        rows = features[first : first + sizes[args.rank]].clone().requires_grad_()
        loss = circle_loss.distributed.loss(rows, labels[first : first + sizes[args.rank]], 0.25, 64.0)
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
