"""Metric learning on real data with circle_loss.CircleLoss.

Trains a small embedding network on scikit-learn's handwritten digits (1 797
8×8 images that ship inside scikit-learn: no download) and measures
nearest-neighbour retrieval on a held-out split before and after:
Recall@1 (is the nearest other test image of the same digit?) and MAP@R.
Writes a PNG with the loss curve and a 2-D projection of the test embeddings.

    python examples/train_digits.py [--epochs 30] [--compile] [--device cuda]

The last line printed is `recall@1 before <x> after <y>`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import circle_loss


def retrieval_metrics(embeddings: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """Recall@1 and MAP@R of cosine nearest-neighbour retrieval, each query
    against every other item."""
    e = F.normalize(embeddings.double(), dim=1)
    similarity = e @ e.T
    similarity.fill_diagonal_(-float("inf"))
    order = similarity.argsort(dim=1, descending=True)
    relevant = labels[order] == labels[:, None]  # (N, N), ranked
    recall_at_1 = relevant[:, 0].double().mean().item()
    # MAP@R: precision at each relevant rank among the first R, R = class size - 1.
    r = (labels[:, None] == labels[None, :]).sum(1) - 1
    ranks = torch.arange(1, len(labels) + 1, device=labels.device)
    within_r = ranks[None, :] <= r[:, None]
    hits = relevant & within_r
    precision_at_k = hits.cumsum(1).double() / ranks[None, :]
    map_at_r = ((precision_at_k * hits).sum(1) / r.clamp_min(1)).mean().item()
    return recall_at_1, map_at_r


def digits_split(device, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as (x_train, x_test, y_train, y_test) on device,
    pixels scaled to [0, 1], 30% held out, stratified by digit."""
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data / 16.0, digits.target, test_size=0.3, random_state=seed, stratify=digits.target
    )
    as_features = lambda a: torch.tensor(a, dtype=torch.float32, device=device)  # noqa: E731
    as_labels = lambda a: torch.tensor(a, device=device)  # noqa: E731
    return as_features(x_train), as_features(x_test), as_labels(y_train), as_labels(y_test)


def make_encoder(embedding_dim: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, embedding_dim),
    )


def plot(losses, embeddings, labels, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    e = F.normalize(embeddings.double(), dim=1).cpu()
    _, _, v = torch.pca_lowrank(e, q=2, center=True)
    xy = (e - e.mean(0)) @ v[:, :2]
    fig, (ax_loss, ax_emb) = plt.subplots(1, 2, figsize=(11, 4.5))
    ax_loss.plot(losses)
    ax_loss.set(xlabel="step", ylabel="circle loss", title="training loss", yscale="log")
    scatter = ax_emb.scatter(xy[:, 0], xy[:, 1], c=labels.cpu(), cmap="tab10", s=8)
    ax_emb.legend(*scatter.legend_elements(), title="digit", fontsize=7, loc="best")
    ax_emb.set(title="test embeddings (PCA of the normalised embeddings)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def train(loss_of_batch, optimizer, x_train, y_train, epochs: int, batch_size: int,
          progress: bool = True) -> tuple[list[float], float]:
    """Shuffled minibatch steps of loss_of_batch(inputs, labels) with a
    progress bar: each step's loss, and the seconds it all took."""
    losses = []
    start = time.perf_counter()
    steps_per_epoch = -(-len(x_train) // batch_size)
    with tqdm(total=epochs * steps_per_epoch, desc="training", unit="step", disable=not progress) as bar:
        for epoch in range(epochs):
            permutation = torch.randperm(len(x_train), device=x_train.device)
            for first in range(0, len(x_train), batch_size):
                batch = permutation[first : first + batch_size]
                loss = loss_of_batch(x_train[batch], y_train[batch])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                bar.set_postfix(epoch=epoch, loss=f"{losses[-1]:.3f}")
                bar.update()
    return losses, time.perf_counter() - start


def report(encoder, x_test, y_test, before, losses, elapsed, args) -> None:
    """Retrieval after training, the plot, and the lines the tests read."""
    encoder.eval()
    with torch.no_grad():
        test_embeddings = encoder(x_test)
    after = retrieval_metrics(test_embeddings, y_test)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(losses, test_embeddings, y_test, args.out)
    print(f"trained {args.epochs} epochs in {elapsed:.1f} s on {args.device}; plot: {args.out}")
    print(f"MAP@R before {before[1]:.4f} after {after[1]:.4f}")
    print(f"recall@1 before {before[0]:.4f} after {after[0]:.4f}")


def arguments(doc: str, batch_size: int, plot_name: str) -> argparse.ArgumentParser:
    """The options the digits examples share."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--embedding-dim", type=int, default=32)
    parser.add_argument("--margin", type=float, default=0.25)
    parser.add_argument("--gamma", type=float, default=64.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("out") / plot_name)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main() -> None:
    parser = arguments(__doc__, 256, "train_digits.png")
    parser.add_argument("--compile", action="store_true", help="run the training step under torch.compile(fullgraph=True)")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    x_train, x_test, y_train, y_test = digits_split(args.device, args.seed)

    encoder = make_encoder(args.embedding_dim).to(args.device)
    criterion = circle_loss.CircleLoss(margin=args.margin, gamma=args.gamma)
    optimizer = torch.optim.Adam(encoder.parameters(), lr=args.lr)

    def loss_of_batch(inputs, labels):
        return criterion(F.normalize(encoder(inputs), dim=1), labels)

    if args.compile:
        loss_of_batch = torch.compile(loss_of_batch, fullgraph=True, dynamic=True)

    with torch.no_grad():
        before = retrieval_metrics(encoder(x_test), y_test)

    losses, elapsed = train(loss_of_batch, optimizer, x_train, y_train, args.epochs, args.batch_size)

    report(encoder, x_test, y_test, before, losses, elapsed, args)


if __name__ == "__main__":
    main()
