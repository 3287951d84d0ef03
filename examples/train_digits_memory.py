"""Metric learning with a memory bank: circle_loss.pml.CircleLoss inside
circle_loss.pml.CrossBatchMemory, the drop-ins for pytorch-metric-learning's
classes.

The drop-in for PML's CircleLoss (same constructor, same results) trains a
small embedding network on scikit-learn's handwritten digits with small
batches, each compared with a bank of the embeddings of recent batches, and
measures nearest-neighbour retrieval on a held-out split before and after, as
examples/train_digits.py does: Recall@1 and MAP@R.

Each step compares the batch with the whole bank but each query's own copy
in it, as PML's CrossBatchMemory does; the drop-in makes that one call of the
fused op (the copies left out by position), with PML's results.

    python examples/train_digits_memory.py [--epochs 15] [--memory 512] [--device cuda]

The last line printed is `recall@1 before <x> after <y>`.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import circle_loss.pml
from train_digits import digits_split, make_encoder, retrieval_metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--memory", type=int, default=512, help="rows in the memory bank")
    parser.add_argument("--embedding-dim", type=int, default=32)
    parser.add_argument("--m", type=float, default=0.4)
    parser.add_argument("--gamma", type=float, default=80.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    x_train, x_test, y_train, y_test = digits_split(args.device, args.seed)

    encoder = make_encoder(args.embedding_dim).to(args.device)
    loss_fn = circle_loss.pml.CrossBatchMemory(
        circle_loss.pml.CircleLoss(m=args.m, gamma=args.gamma),
        embedding_size=args.embedding_dim,
        memory_size=args.memory,
    ).to(args.device)
    optimizer = torch.optim.Adam(encoder.parameters(), lr=args.lr)

    with torch.no_grad():
        before = retrieval_metrics(encoder(x_test), y_test)
    start = time.perf_counter()
    steps = 0
    for _ in range(args.epochs):
        permutation = torch.randperm(len(x_train), device=args.device)
        for first in range(0, len(x_train), args.batch_size):
            batch = permutation[first : first + args.batch_size]
            loss = loss_fn(F.normalize(encoder(x_train[batch]), dim=1), y_train[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps += 1
    elapsed = time.perf_counter() - start
    encoder.eval()
    with torch.no_grad():
        after = retrieval_metrics(encoder(x_test), y_test)
    print(f"trained {steps} steps (batch {args.batch_size}, bank {args.memory}) in {elapsed:.1f} s on {args.device}")
    print(f"MAP@R before {before[1]:.4f} after {after[1]:.4f}")
    print(f"recall@1 before {before[0]:.4f} after {after[0]:.4f}")


if __name__ == "__main__":
    main()
