"""Where one call of torch.ops.circle.loss spends its time: host-side ATen ops
and launches, and the GPU kernels, from torch.profiler.

    python bench/profile_op.py --sizes 256 16384
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from bench import make_inputs  # bench/bench.py, beside this script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 16384])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    for batch in args.sizes:
        features, labels = make_inputs(batch, args.dim, getattr(torch, args.dtype), "cuda", classes=100)
        leaf = features.clone().requires_grad_()

        def forward():
            with torch.no_grad():
                torch.ops.circle.loss(features, labels)

        def forward_backward():
            torch.autograd.grad(torch.ops.circle.loss(leaf, labels), leaf)

        for name, step in (("fwd", forward), ("fwd+bwd", forward_backward)):
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(args.calls):
                    step()
                torch.cuda.synchronize()
            averages = prof.key_averages()
            print(f"\n=== B={batch} D={args.dim} {args.dtype} {name}, {args.calls} calls ===")
            print(averages.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
            print(averages.table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=60))


if __name__ == "__main__":
    main()
