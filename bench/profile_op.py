"""Where one call of torch.ops.circle.loss (--op anchor: anchor_loss) spends
its time: host-side ATen ops and launches, and the GPU kernels, from
torch.profiler. With --graph, the kernels of forward+backward replayed from a
CUDA graph, back to back as the graph-replay figure runs them (eager calls
leave the GPU idle between them).

    python bench/profile_op.py --sizes 256 16384
    python bench/profile_op.py --sizes 256 512 --graph
    python bench/profile_op.py --op anchor --sizes 4096 16384 [--refs 65536]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from bench import forward_backward_graph, make_inputs  # bench/bench.py, beside this script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 16384])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--graph", action="store_true", help="profile CUDA-graph replays of forward+backward")
    parser.add_argument("--op", default="loss", choices=["loss", "anchor"])
    parser.add_argument("--refs", type=int, help="anchor: this many reference rows")
    args = parser.parse_args()
    if args.graph:
        return profile_graph_replays(args)
    for batch in args.sizes:
        features, labels = make_inputs(batch, args.dim, 100, "cuda", getattr(torch, args.dtype))
        leaf = features.clone().requires_grad_()
        refs = make_inputs(args.refs, args.dim, 100, "cuda", getattr(torch, args.dtype)) if args.refs else None

        def op(x):
            if args.op == "loss":
                return torch.ops.circle.loss(x, labels)
            return torch.ops.circle.anchor_loss(x, labels, *(refs or (None, None))).mean()

        def forward():
            with torch.no_grad():
                op(features)

        def forward_backward():
            torch.autograd.grad(op(leaf), leaf)

        for name, step in (("fwd", forward), ("fwd+bwd", forward_backward)):
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(args.calls):
                    step()
                torch.cuda.synchronize()
            averages = prof.key_averages()
            shape = f"B={batch}" + (f" M={args.refs}" if refs else "")
            print(f"\n=== {args.op} {shape} D={args.dim} {args.dtype} {name}, {args.calls} calls ===")
            print(averages.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
            print(averages.table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=60))


def profile_graph_replays(args) -> None:
    for batch in args.sizes:
        features, labels = make_inputs(batch, args.dim, 100, "cuda", getattr(torch, args.dtype))
        graph = forward_backward_graph(features.clone().requires_grad_(), labels)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                graph.replay()
            torch.cuda.synchronize()
        print(f"\n=== B={batch} D={args.dim} {args.dtype} fwd+bwd graph replay, {args.calls} replays ===")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=60))


if __name__ == "__main__":
    main()
