"""Classification-head training with the class-level Circle Loss:
circle_loss.ClassCircleLoss, the paper's head for face recognition and
person re-identification, here on scikit-learn's handwritten digits.

The head holds one weight row (a proxy) per class and scores each embedding
against every class, its own the positive; it is trained with the encoder.
Retrieval is then measured as examples/train_digits.py measures it, on
held-out images and from the embeddings alone (the head is not used at test
time): Recall@1 and MAP@R before and after. Writes a PNG with the loss curve
and a 2-D projection of the test embeddings.

    python examples/train_digits_classes.py [--epochs 30] [--device cuda]

The last line printed is `recall@1 before <x> after <y>`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import circle_loss
from train_digits import digits_split, make_encoder, report, retrieval_metrics, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--embedding-dim", type=int, default=32)
    parser.add_argument("--margin", type=float, default=0.25)
    parser.add_argument("--gamma", type=float, default=64.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("out") / "train_digits_classes.png")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    x_train, x_test, y_train, y_test = digits_split(args.device, args.seed)
    encoder = make_encoder(args.embedding_dim).to(args.device)
    head = circle_loss.ClassCircleLoss(num_classes=10, embedding_size=args.embedding_dim,
                                       margin=args.margin, gamma=args.gamma).to(args.device)
    optimizer = torch.optim.Adam([*encoder.parameters(), *head.parameters()], lr=args.lr)

    with torch.no_grad():
        before = retrieval_metrics(encoder(x_test), y_test)
    losses, elapsed = train(lambda x, y: head(encoder(x), y), optimizer, x_train, y_train, args.epochs,
                            args.batch_size)  # the head normalises both sides
    report(encoder, x_test, y_test, before, losses, elapsed, args)


if __name__ == "__main__":
    main()
