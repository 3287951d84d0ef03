"""Weak and strong scaling of circle_loss.distributed over 1 .. N ranks, for
the three forms, and PML's DistributedLossWrapper against the drop-in.

    torchrun --nproc_per_node=2 bench/bench_distributed.py --per-rank 4096 16384 --global 32768
    torchrun --nproc_per_node=2 bench/bench_distributed.py --backend gloo --per-rank 1024 2048 4096 --pml-wrapper 2048
    torchrun --nproc_per_node=2 bench/bench_distributed.py --forms class --classes 2000000 --per-rank 1024

For every rank count W from 1 to the world size, the first W ranks time a
forward+backward step (median of --steps after warm-up) of each form in
--forms: `loss` (distributed.loss, the global form), `anchor`
(distributed.AnchorCircleLoss, the per-anchor form) and `class`
(distributed.ClassCircleLoss with --classes classes split over the W
ranks), and record their peak extra memory (GPU only). Weak scaling keeps B
per rank fixed: each rank's work for the pair-wise forms grows as
B_rank·B_global, so the ideal time at W ranks is W times the 1-rank time;
for the class-level head (B_global × C / W a rank) the ideal is the 1-rank
time. Strong scaling keeps the global B fixed: the ideal speed-up is W for
the pair-wise forms. Efficiency = ideal / measured. With --pml-wrapper B,
all ranks also time PML's DistributedLossWrapper around PML's CircleLoss
against circle_loss.pml's around the drop-in, B rows a rank, both
`efficient` modes. Rank 0 prints the tables and writes them to --out. On
shared multi-GPU machines keep NVLink multicast off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import circle_loss.distributed


def loss_of(form, dim, classes, group, sample_rate=1.0):
    """form -> fn(x, labels) -> the scalar loss of a step."""
    if form == "loss":
        return lambda x, y: circle_loss.distributed.loss(x, y, group=group)
    if form == "anchor":
        return circle_loss.distributed.AnchorCircleLoss(group=group)
    return circle_loss.distributed.ClassCircleLoss(classes, dim, sample_rate=sample_rate, group=group)


def measure(loss_fn, per_rank, dim, dtype, device, group, steps, classes=1000):
    """Median seconds of one fwd+bwd step of loss_fn, and peak extra bytes (GPU)."""
    features = torch.nn.functional.normalize(torch.randn(per_rank, dim, device=device), dim=1).to(dtype)
    labels = torch.randint(0, classes, (per_rank,), device=device)
    if isinstance(loss_fn, torch.nn.Module):
        loss_fn.to(device=device, dtype=dtype)

    def step():
        x = features.detach().requires_grad_()
        loss_fn(x, labels).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        dist.barrier(group=group)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None
    return sorted(times)[len(times) // 2], peak


def table(rows, kind):
    first = {(r["form"], r["per_rank"] if kind == "weak" else r["global_batch"]): r["seconds"]
             for r in rows if r["ranks"] == 1}
    lines = [
        f"| {kind} scaling | form | ranks | B per rank | global B | fwd+bwd step | extra peak per rank | efficiency |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        one = first[(r["form"], r["per_rank"] if kind == "weak" else r["global_batch"])]
        # The class-level head's work a rank is B_global × C / W: flat under weak scaling.
        grows = r["form"] != "class"
        ideal = (one * r["ranks"] if grows else one) if kind == "weak" else one / r["ranks"]
        peak = "—" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f} MiB"
        lines.append(f"| | {r['form']} | {r['ranks']} | {r['per_rank']} | {r['global_batch']} | "
                     f"{r['seconds'] * 1e3:.2f} ms | {peak} | {ideal / r['seconds']:.2f} |")
    return "\n".join(lines)


def pml_wrapper_rows(per_rank, dim, dtype, device, steps):
    """Every rank: PML's DistributedLossWrapper around PML's CircleLoss, and
    circle_loss.pml's around the drop-in, in both modes; rank 0's times."""
    from pytorch_metric_learning import losses
    from pytorch_metric_learning.utils.distributed import DistributedLossWrapper

    import circle_loss.pml

    rows = []
    for efficient in (False, True):
        for name, wrapper in (("PML", DistributedLossWrapper(losses.CircleLoss(), efficient=efficient)),
                              ("drop-in", circle_loss.pml.DistributedLossWrapper(circle_loss.pml.CircleLoss(),
                                                                                 efficient=efficient))):
            seconds, peak = measure(wrapper, per_rank, dim, dtype, device, None, steps, classes=100)
            rows.append(dict(wrapper=name, efficient=efficient, per_rank=per_rank, seconds=seconds, peak_bytes=peak))
    return rows


def wrapper_table(rows):
    by = {(r["wrapper"], r["efficient"]): r for r in rows}
    lines = ["| DistributedLossWrapper | B per rank | PML | drop-in | PML / drop-in |", "|---|---|---|---|---|"]
    for efficient in (False, True):
        pml, ours = by[("PML", efficient)], by[("drop-in", efficient)]
        lines.append(f"| efficient={efficient} | {pml['per_rank']} | {pml['seconds'] * 1e3:.1f} ms | "
                     f"{ours['seconds'] * 1e3:.1f} ms | {pml['seconds'] / ours['seconds']:.1f}× |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    parser.add_argument("--per-rank", type=int, nargs="*", default=[4096, 16384], help="weak scaling: B per rank")
    parser.add_argument("--global", dest="global_batches", type=int, nargs="*", default=[],
                        help="strong scaling: global B, split as evenly as it goes")
    parser.add_argument("--forms", nargs="+", default=["loss", "anchor", "class"], choices=["loss", "anchor", "class"])
    parser.add_argument("--classes", type=int, default=65536, help="the class-level head's classes, all ranks")
    parser.add_argument("--sample-rate", type=float, default=1.0,
                        help="the class-level head's Partial FC sampling (1: exact)")
    parser.add_argument("--pml-wrapper", type=int, default=0, metavar="B",
                        help="also time PML's DistributedLossWrapper against the drop-in, B rows a rank")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results"))
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=600))
    dtype = getattr(torch, args.dtype)
    weak, strong = [], []
    for ranks in range(1, world + 1):
        group = dist.new_group(list(range(ranks)))
        jobs = [("weak", b, b * ranks) for b in args.per_rank]
        # Strong scaling: the global batch exactly, the remainder on the first ranks.
        jobs += [("strong", g // ranks + (rank < g % ranks), g) for g in args.global_batches]
        for form in args.forms:
            for kind, per_rank, global_batch in jobs:
                if rank < ranks:
                    loss_fn = loss_of(form, args.dim, args.classes, group, args.sample_rate)
                    seconds, peak = measure(loss_fn, per_rank, args.dim, dtype, device, group, args.steps,
                                            args.classes if form == "class" else 1000)
                    if rank == 0:
                        row = dict(form=form, ranks=ranks, per_rank=per_rank, global_batch=global_batch,
                                   seconds=seconds, peak_bytes=peak,
                                   **({"sample_rate": args.sample_rate} if form == "class" else {}))
                        (weak if kind == "weak" else strong).append(row)
                        print(f"{kind} {form}: ranks={ranks} B/rank={per_rank} step {seconds * 1e3:.2f} ms", flush=True)
        dist.barrier()
    wrapper = pml_wrapper_rows(args.pml_wrapper, args.dim, dtype, device, args.steps) if args.pml_wrapper else []
    if rank == 0:
        where = f"{torch.cuda.get_device_name()} x{world}" if device.type == "cuda" else f"CPU, {os.cpu_count()} cores, {world} processes"
        header = (f"{where}, {args.backend}, torch {torch.__version__}, {args.dtype}, D={args.dim}, "
                  f"{datetime.date.today()}")
        text = "\n\n".join([header] + [table(rows, kind) for kind, rows in (("weak", weak), ("strong", strong)) if rows]
                             + ([wrapper_table(wrapper)] if wrapper else []))
        print(text)
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"bench_distributed_{args.backend}_{args.dtype}"
        stem.with_suffix(".md").write_text(text + "\n")
        stem.with_suffix(".json").write_text(json.dumps(dict(weak=weak, strong=strong, pml_wrapper=wrapper), indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
