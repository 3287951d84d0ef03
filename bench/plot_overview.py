"""The README's plot: forward+backward time over the batch size on the H200,
this library against the code users write, from the bench's recorded
results (no timing here). Left, the global form: circle::loss against the
eager reference and torch.compile of it (bench/results/bench_cuda_float32.json);
right, the per-anchor form: anchor_loss and the PML drop-in against
pytorch-metric-learning's CircleLoss, 100 classes
(bench/results/bench_anchor_cuda_float32.json).

    python bench/plot_overview.py [--out bench/results/overview_cuda_float32.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).with_name("results")


def series(rows, method, **match):
    points = sorted((r["B"], r["seconds"]) for r in rows
                    if r["method"] == method and r["mode"] == "fwd+bwd" and "seconds" in r
                    and all(r.get(k) == v for k, v in match.items()))
    return [b for b, _ in points], [s * 1e3 for _, s in points]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / "overview_cuda_float32.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    glob = json.loads((RESULTS / "bench_cuda_float32.json").read_text())
    anchor = json.loads((RESULTS / "bench_anchor_cuda_float32.json").read_text())
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for name, label, style in (("op", "circle::loss (this library)", "o-"), ("eager", "eager PyTorch", "s--"),
                               ("compile", "torch.compile of it", "^--")):
        left.plot(*series(glob["rows"], name, classes="100"), style, label=label)
    for name, label, style in (("anchor_loss", "anchor_loss (this library)", "o-"),
                               ("drop-in", "circle_loss.pml.CircleLoss", "D-"), ("PML", "PML CircleLoss", "s--")):
        right.plot(*series(anchor["rows"], name, classes=100, M=None), style, label=label)
    for ax, title in ((left, "global form"), (right, "per-anchor form (PML's)")):
        ax.set(xscale="log", yscale="log", xlabel="batch size B", title=title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    left.set_ylabel("forward+backward, ms")
    env = glob["environment"]
    fig.suptitle(f"{env['gpu']}, float32, D = 512, {env['date']}, torch {env['torch']} "
                 "(missing points: out of memory or not run)", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
