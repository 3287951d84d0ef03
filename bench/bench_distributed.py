"""Weak scaling of circle_loss.distributed: fixed rows per rank, 1..N ranks.

    torchrun --nproc_per_node=2 bench/bench_distributed.py --per-rank 4096 16384

Each rank times forward+backward of the global loss (CUDA events, median of
--steps after warm-up) and its peak memory; rank 0 prints a table and writes
it to --out. Work per rank grows with the global batch (B_rank · B_global · D),
so the ideal time at W ranks is W times the 1-rank time; efficiency = ideal /
measured. Keep NVLink multicast off on shared machines (NCCL_NVLS_ENABLE=0).
"""

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import circle_loss.distributed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--per-rank", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results"))
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300))
    rows = []
    for ranks in range(1, world + 1):
        group = dist.new_group(list(range(ranks)))
        for per_rank in args.per_rank:
            if rank < ranks:
                features = torch.nn.functional.normalize(torch.randn(per_rank, args.dim, device="cuda"), dim=1)
                features = features.to(getattr(torch, args.dtype))
                labels = torch.randint(0, 1000, (per_rank,), device="cuda")
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()

                def step_in_group(features=features, labels=labels):
                    x = features.detach().requires_grad_()
                    circle_loss.distributed.loss(x, labels, group=group).backward()

                for _ in range(2):
                    step_in_group()
                times = []
                for _ in range(args.steps):
                    dist.barrier(group=group)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    step_in_group()
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end) / 1e3)
                seconds = sorted(times)[len(times) // 2]
                peak = torch.cuda.max_memory_allocated() - base
                if rank == 0:
                    rows.append(dict(ranks=ranks, per_rank=per_rank, global_batch=per_rank * ranks,
                                     seconds=seconds, peak_bytes=peak))
                    print(f"ranks={ranks} B/rank={per_rank} step {seconds * 1e3:.2f} ms, extra peak {peak / 2**20:.0f} MiB", flush=True)
        dist.barrier()
    if rank == 0:
        base = {r["per_rank"]: r["seconds"] for r in rows if r["ranks"] == 1}
        lines = ["| ranks | B per rank | global B | fwd+bwd step | extra peak per rank | weak-scaling efficiency |",
                 "|---|---|---|---|---|---|"]
        for r in rows:
            eff = base[r["per_rank"]] * r["ranks"] / r["seconds"]
            lines.append(f"| {r['ranks']} | {r['per_rank']} | {r['global_batch']} | {r['seconds'] * 1e3:.2f} ms | "
                         f"{r['peak_bytes'] / 2**20:.0f} MiB | {eff:.2f} |")
        table = "\n".join(lines)
        print(f"{torch.cuda.get_device_name()} x{world}, torch {torch.__version__}, {args.dtype}, D={args.dim}\n{table}")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_distributed.md").write_text(table + "\n")
        (args.out / "bench_distributed.json").write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
