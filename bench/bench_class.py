"""Side-by-side benchmark of the class-level form: circle_loss.ClassCircleLoss
(normalise both sides, circle_loss.class_loss, the mean)
against the eager CircleSoftmax users write (fast-reid's arithmetic: the B×C
cosine logits, detached alphas, one-hot mix, cross-entropy) and
torch.compile of it, and, where installed, the fused linear cross-entropy
heads users have for plain softmax (Cut Cross-Entropy's
linear_cross_entropy, Liger-Kernel's fused linear cross entropy: no circle
arithmetic, no normalisation, the floor a fused circle head should meet),
forward and forward+backward (gradients to the embeddings and the class
weights), with extra peak memory, each one's time in GEMM-equivalents: over
that of the GEMM X·Wᵀ of the same size, the two timed in alternating blocks.

    python bench/bench_class.py                                   # CPU defaults
    python bench/bench_class.py --device cuda --batch 1024 --dim 512 --classes 100000 1000000 --dtype bfloat16

Prints a Markdown table and writes it with the raw rows (JSON) under --out.
Timings are torch.utils.benchmark medians; nothing here asserts a timing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import circle_loss  # noqa: E402
# bench/bench.py, beside this script: timing, memory and table helpers
from bench import _status_bytes, bench_arguments, environment, measure_call, report  # noqa: E402
from bench import format_memory, format_time, gemm_equivalents  # noqa: E402

MARGIN, GAMMA = circle_loss.CLASS_DEFAULT_MARGIN, circle_loss.CLASS_DEFAULT_GAMMA


# The module's own arithmetic, its weight replaced by each call's w.
HEAD = circle_loss.ClassCircleLoss(1, 1, MARGIN, GAMMA)


def class_op(x, y, w):
    return torch.func.functional_call(HEAD, {"weight": w}, (x, y))


def circle_softmax(x, y, w):
    """The eager head as fast-reid writes it: B×C logits and their copies."""
    sim = F.linear(F.normalize(x), F.normalize(w))
    alpha_p = torch.clamp_min(-sim.detach() + 1 + MARGIN, min=0.0)
    alpha_n = torch.clamp_min(sim.detach() + MARGIN, min=0.0)
    s_p = GAMMA * alpha_p * (sim - (1 - MARGIN))
    s_n = GAMMA * alpha_n * (sim - MARGIN)
    one_hot = F.one_hot(y, num_classes=w.shape[0]).to(sim.dtype)
    return F.cross_entropy(one_hot * s_p + (1.0 - one_hot) * s_n, y)


def op_alone(x, y, w):
    """The op on inputs already normalised (run() normalises them first)."""
    return circle_loss.class_loss(x, y, w, MARGIN, GAMMA).mean()


def fused_softmax_heads() -> dict:
    """The fused plain-softmax heads that are installed (both run on CUDA
    only: Triton kernels), as (x, y, w) -> the mean cross-entropy of x·wᵀ."""
    heads = {}
    try:
        from cut_cross_entropy import linear_cross_entropy

        heads["Cut Cross-Entropy"] = lambda x, y, w: linear_cross_entropy(x, w, y)
    except ImportError:
        pass
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        heads["Liger fused CE"] = lambda x, y, w: liger_fused_linear_cross_entropy(x, w, y)
    except ImportError:
        pass
    return heads


def sampled_head(rate: float, sparse_grad: bool = False):
    """The module with Partial FC's sampling at `rate`, its weight each call's w."""
    head = circle_loss.ClassCircleLoss(1, 1, MARGIN, GAMMA, sample_rate=rate, sparse_grad=sparse_grad)
    return lambda x, y, w: torch.func.functional_call(head, {"weight": w}, (x, y))


def methods(device: str = "cpu", sample_rates=(), contenders: bool = True) -> dict:
    ours = {"class_loss": class_op, "op alone": op_alone,  # op alone: forward+backward only
            **{f"sample_rate {rate:g}": sampled_head(rate) for rate in sample_rates},
            **{f"sample_rate {rate:g} sparse": sampled_head(rate, True) for rate in sample_rates}}
    if not contenders:
        return ours
    return {
        **ours,
        "eager CircleSoftmax": circle_softmax,
        "compiled CircleSoftmax": torch.compile(circle_softmax, dynamic=False),
        **(fused_softmax_heads() if device == "cuda" else {}),
    }


# The methods whose times are also given in GEMM-equivalents.
IN_GEMMS = ("class_loss", "op alone", "Cut Cross-Entropy", "Liger fused CE")


def make_inputs(batch, classes, dim, device, dtype):
    x = torch.randn(batch, dim, device=device, dtype=dtype)
    w = torch.randn(classes, dim, device=device, dtype=dtype)
    return x, torch.randint(0, classes, (batch,), device=device), w


def step_of(fn, mode):
    if mode == "fwd":
        def forward(x, y, w):
            with torch.no_grad():
                return fn(x, y, w)
        return forward
    return lambda x, y, w: torch.autograd.grad(fn(x, y, w), [x, w])


def cpu_extra_peak_bytes(method, mode, batch, classes, dim, dtype) -> int:
    """Peak resident memory of one step beyond the inputs, in a fresh process."""
    cmd = [sys.executable, __file__, "--cpu-memory-probe", method, mode, str(batch), str(classes), str(dim), dtype]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    return int(out.stdout.split()[-1]) if out.returncode == 0 else -1


def cpu_memory_probe(method, mode, batch, classes, dim, dtype) -> None:
    rates = [float(method.split()[1])] if method.startswith("sample_rate") else []
    step = step_of(methods("cpu", rates)[method], mode)
    x, y, w = make_inputs(batch, classes, dim, "cpu", getattr(torch, dtype))
    x.requires_grad_(mode == "fwd+bwd")
    w.requires_grad_(mode == "fwd+bwd")
    step(x, y, w)  # first-use allocations (and compilation)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_bytes("VmRSS")
    step(x, y, w)
    print(_status_bytes("VmHWM") - base)


def run(args) -> list[dict]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    rows = []
    for classes in args.classes:
        x, y, w = make_inputs(args.batch, classes, args.dim, device, dtype)
        gemm = lambda a=x, b=w: a @ b.T  # noqa: E731
        normalised = (F.normalize(x, dim=1), y, F.normalize(w, dim=1))
        for name, fn in methods(device.type, args.sample_rate, not args.no_contenders).items():
            for mode in ("fwd", "fwd+bwd"):
                row = dict(method=name, B=args.batch, C=classes, D=args.dim, dtype=args.dtype, mode=mode)
                if name == "op alone" and mode == "fwd":
                    continue
                if name.endswith("CircleSoftmax") and args.batch * classes > args.max_eager_pairs:
                    row["skipped"] = "--max-eager-pairs"
                    rows.append(row)
                    continue
                raw = normalised if name == "op alone" else (x, y, w)
                inputs = (raw[0].clone().requires_grad_(), y, raw[2].clone().requires_grad_()) if mode == "fwd+bwd" \
                    else raw
                call = lambda s=step_of(fn, mode), i=inputs: s(*i)  # noqa: E731
                cpu_peak = None if args.no_cpu_memory or name == "op alone" else (
                    lambda n=name, m=mode: cpu_extra_peak_bytes(n, m, args.batch, classes, args.dim, args.dtype))
                try:
                    rows.append(measure_call(row, call, device, args.min_run_time, f"B={args.batch} C={classes}",
                                             cpu_peak, gemm if name in IN_GEMMS else None))
                except Exception as error:  # a contender that refuses the dtype or the size
                    if name in ("class_loss", "op alone"):
                        raise
                    rows.append({**row, "skipped": f"{type(error).__name__}: {str(error)[:120]}"})
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        del x, w
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def speedup(slow, fast) -> str:
    if not slow or not fast or "seconds" not in slow or "seconds" not in fast:
        return "—"
    return f"{slow['seconds'] / fast['seconds']:.1f}×"


def table(rows) -> str:
    by_key = {(r["method"], r["C"], r["mode"]): r for r in rows}
    fused = [name for name in ("Cut Cross-Entropy", "Liger fused CE") if any(r["method"] == name for r in rows)]
    lines = [
        "| B | C | D | mode | ClassCircleLoss | in GEMMs | op alone in GEMMs | eager CircleSoftmax | compiled | "
        "eager / ours | compiled / ours | our extra peak | eager extra peak | compiled extra peak |"
        + "".join(f" {name} | in GEMMs | its extra peak |" for name in fused),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|---|---|" * len(fused),
    ]
    for classes in sorted({r["C"] for r in rows}):
        for mode in ("fwd", "fwd+bwd"):
            ours, alone, eager, compiled = (by_key.get((m, classes, mode)) for m in
                                            ("class_loss", "op alone", "eager CircleSoftmax", "compiled CircleSoftmax"))
            others = [by_key.get((name, classes, mode)) for name in fused]
            lines.append(
                f"| {ours['B']} | {classes} | {ours['D']} | {mode} | {format_time(ours)} | {gemm_equivalents(ours)} | "
                f"{gemm_equivalents(alone) if alone else '—'} | "
                f"{format_time(eager)} | {format_time(compiled)} | {speedup(eager, ours)} | {speedup(compiled, ours)} | "
                f"{format_memory(ours)} | {format_memory(eager)} | {format_memory(compiled)} |"
                + "".join(f" {format_time(o)} | {gemm_equivalents(o) if o else '—'} | {format_memory(o)} |"
                          for o in others)
            )
    return "\n".join(lines)


def sampling_table(rows) -> str:
    """The module exact and with each sample_rate: time, speed-up, extra peak."""
    rates = sorted({r["method"] for r in rows if r["method"].startswith("sample_rate")})
    if not rates:
        return ""
    by_key = {(r["method"], r["C"], r["mode"]): r for r in rows}
    lines = ["| B | C | D | mode | exact | extra peak |" + "".join(f" {name} | speed-up | extra peak |" for name in rates),
             "|---|---|---|---|---|---|" + "---|---|---|" * len(rates)]
    for classes in sorted({r["C"] for r in rows}):
        for mode in ("fwd", "fwd+bwd"):
            exact = by_key[("class_loss", classes, mode)]
            cells = "".join(f" {format_time(o)} | {speedup(exact, o)} | {format_memory(o)} |"
                            for o in (by_key.get((name, classes, mode)) for name in rates))
            lines.append(f"| {exact['B']} | {classes} | {exact['D']} | {mode} | {format_time(exact)} | "
                         f"{format_memory(exact)} |{cells}")
    return "\n".join(lines)


def main() -> None:
    parser = bench_arguments(__doc__, dim=256, probe_fields=6)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--classes", type=int, nargs="+", default=[1000, 10_000, 65_536, 262_144, 1_000_000])
    parser.add_argument("--max-eager-pairs", type=int, default=512 * 262_144,
                        help="largest B·C at which the eager head's B×C matrices are attempted")
    parser.add_argument("--sample-rate", type=float, nargs="*", default=[],
                        help="also the module with Partial FC's class sampling at these rates")
    parser.add_argument("--no-contenders", action="store_true",
                        help="the library's own rows alone (no eager, compiled or fused heads)")
    args = parser.parse_args()
    if args.cpu_memory_probe:
        method, mode, batch, classes, dim, dtype = args.cpu_memory_probe
        cpu_memory_probe(method, mode, int(batch), int(classes), int(dim), dtype)
        return
    torch.manual_seed(0)
    rows = run(args)
    env = environment(args)
    md = table(rows) if not args.no_contenders else ""
    md = "\n\n".join(part for part in (md, sampling_table(rows)) if part)
    stem = args.out / f"bench_class_{args.device}_{args.dtype}"
    report(stem, env, rows, md)
    print(f"\nwritten: {stem}.{{json,md}}")


if __name__ == "__main__":
    main()
