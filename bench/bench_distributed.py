"""Weak and strong scaling of circle_loss.distributed over 1 .. N ranks.

    torchrun --nproc_per_node=2 bench/bench_distributed.py --per-rank 4096 16384 --global 32768
    torchrun --nproc_per_node=4 bench/bench_distributed.py --backend gloo --dim 128 --per-rank 512 --global 2048

For every rank count W from 1 to the world size, the first W ranks time a
forward+backward step of the global loss (median of --steps after warm-up;
CUDA events on GPU) and record their peak extra memory (GPU only). Weak
scaling keeps B per rank fixed: each rank's work grows as B_rank·B_global, so
the ideal time at W ranks is W times the 1-rank time. Strong scaling keeps
the global B fixed: the ideal speed-up is W. Efficiency = ideal / measured.
Rank 0 prints the table and writes it to --out. On shared multi-GPU machines
keep NVLink multicast off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
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


def measure(per_rank, dim, dtype, device, group, steps):
    """Median seconds of one fwd+bwd step, and peak extra bytes (GPU)."""
    features = torch.nn.functional.normalize(torch.randn(per_rank, dim, device=device), dim=1).to(dtype)
    labels = torch.randint(0, 1000, (per_rank,), device=device)

    def step():
        x = features.detach().requires_grad_()
        circle_loss.distributed.loss(x, labels, group=group).backward()
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
    first = {r["per_rank"] if kind == "weak" else r["global_batch"]: r["seconds"] for r in rows if r["ranks"] == 1}
    lines = [
        f"| {kind} scaling | ranks | B per rank | global B | fwd+bwd step | extra peak per rank | efficiency |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        one = first[r["per_rank"] if kind == "weak" else r["global_batch"]]
        ideal = one * r["ranks"] if kind == "weak" else one / r["ranks"]
        peak = "—" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f} MiB"
        lines.append(f"| | {r['ranks']} | {r['per_rank']} | {r['global_batch']} | {r['seconds'] * 1e3:.2f} ms | "
                     f"{peak} | {ideal / r['seconds']:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    parser.add_argument("--per-rank", type=int, nargs="*", default=[4096, 16384], help="weak scaling: B per rank")
    parser.add_argument("--global", dest="global_batches", type=int, nargs="*", default=[],
                        help="strong scaling: global B, split as evenly as it goes")
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
        for kind, per_rank, global_batch in jobs:
            if rank < ranks:
                seconds, peak = measure(per_rank, args.dim, dtype, device, group, args.steps)
                if rank == 0:
                    row = dict(ranks=ranks, per_rank=per_rank, global_batch=global_batch, seconds=seconds, peak_bytes=peak)
                    (weak if kind == "weak" else strong).append(row)
                    print(f"{kind}: ranks={ranks} B/rank={per_rank} step {seconds * 1e3:.2f} ms", flush=True)
        dist.barrier()
    if rank == 0:
        where = f"{torch.cuda.get_device_name()} x{world}" if device.type == "cuda" else f"CPU, {os.cpu_count()} cores, {world} processes"
        header = (f"{where}, {args.backend}, torch {torch.__version__}, {args.dtype}, D={args.dim}, "
                  f"{datetime.date.today()}")
        text = "\n\n".join([header] + [table(rows, kind) for kind, rows in (("weak", weak), ("strong", strong)) if rows])
        print(text)
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"bench_distributed_{args.backend}_{args.dtype}"
        stem.with_suffix(".md").write_text(text + "\n")
        stem.with_suffix(".json").write_text(json.dumps(dict(weak=weak, strong=strong), indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
