"""Side-by-side benchmark of torch.ops.circle.loss and torch.ops.circle.anchor_loss
against the eager reference and torch.compile of it, forward and
forward+backward, over B and the label distribution.

    python bench/bench.py                      # CPU, or CUDA when present
    python bench/bench.py --device cuda --sizes 256 4096 16384 65536 --classes 2 10 100 1000 B

Every (B, classes) also times the GEMM F·Fᵀ of the same size and dtype, and
the table gives each op's time in GEMM-equivalents: its time over the GEMM's,
the two timed in alternating blocks of about 20 ms each, so that machine
drift within the run, and a GPU's clock, which falls as a GEMM at full rate
runs on, are the same for both. That is the figure that says how near the
op runs to the rate of the matrix product it cannot do without. "--classes
B" draws B classes for a batch of B (almost every label distinct).
"--sorted-labels" puts the rows in label order, as a sampler that emits each
class's rows together and the classes in order would: the tensor-core tiles
then find most of their pairs in one set and skip the label compares.

Prints a table (median times, speed-ups over eager, extra peak memory) and
writes it as CSV, JSON and a PNG plot under --out. On CUDA it also measures a
trivial x.sum().backward() and the op's forward+backward replayed from a CUDA
graph. Timings come from torch.utils.benchmark (median of many runs); nothing
here asserts a timing.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import circle_loss  # noqa: F401  (registers torch.ops.circle)

MARGIN, GAMMA = circle_loss.DEFAULT_MARGIN, circle_loss.DEFAULT_GAMMA


def eager_reference(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What users write today (docs/math.md): B×B similarities, boolean indexing."""
    s = features @ features.T
    positive = labels[:, None] == labels[None, :]
    sp, sn = s[positive], s[~positive]
    alpha_p = torch.clamp_min(1 + MARGIN - sp.detach(), 0)
    alpha_n = torch.clamp_min(sn.detach() + MARGIN, 0)
    zp = -GAMMA * alpha_p * (sp - (1 - MARGIN))
    zn = GAMMA * alpha_n * (sn - MARGIN)
    return F.softplus(torch.logsumexp(zn, 0) + torch.logsumexp(zp, 0))


def circle_op(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.ops.circle.loss(features, labels, MARGIN, GAMMA)


def anchor_op(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The per-anchor form on the same inputs, averaged as a reducer would."""
    return torch.ops.circle.anchor_loss(features, labels, None, None, MARGIN, GAMMA).mean()


def gemm(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The yardstick: the similarity matrix that the ops never hold whole."""
    return features @ features.T


OPS = {"op": circle_op, "anchor": anchor_op}


def make_inputs(batch, dim, classes, device, dtype, sorted_labels=False):
    """Random L2-normalised features and labels, in the argument order of the
    tests' make_inputs (tests/conftest.py); sorted_labels: labels ascending."""
    features = F.normalize(torch.randn(batch, dim, device=device), dim=1).to(dtype)
    labels = torch.randint(0, classes, (batch,), device=device)
    if sorted_labels:
        labels = labels.sort().values
    return features, labels


def forward_backward(fn):
    def step(features, labels):
        (grad,) = torch.autograd.grad(fn(features, labels), features)
        return grad

    return step


def forward_backward_graph(features, labels) -> torch.cuda.CUDAGraph:
    """The op's forward+backward captured in a CUDA graph, after a few calls on
    a side stream, as capture wants (features must require grad)."""
    step = forward_backward(circle_op)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(features, labels)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(features, labels)
    return graph


def timer_of(stmt_fn) -> benchmark.Timer:
    # Timer runs single-threaded unless told otherwise.
    return benchmark.Timer(stmt="fn()", globals={"fn": stmt_fn}, num_threads=torch.get_num_threads())


def median_seconds(stmt_fn, min_run_time) -> float:
    return timer_of(stmt_fn).blocked_autorange(min_run_time=min_run_time).median


def paired_median_seconds(stmt_fn, yardstick_fn, min_run_time, block_seconds=0.02) -> tuple[float, float]:
    """Medians of stmt_fn and of the yardstick, timed in alternating blocks
    of about block_seconds each, so that both see the machine in the same
    state: on a shared VM the GEMM's own time drifts by tens of percent
    within a run, and a GPU kept busy for longer runs at lower clocks, so
    blocks of unequal length (blocked_autorange's, sized by powers of ten)
    would time the two in different states. Each side's repetitions a block
    come from a timing of one call."""
    timers = (timer_of(stmt_fn), timer_of(yardstick_fn))
    numbers = []
    for timer in timers:
        timer.timeit(1)  # warm-up
        numbers.append(max(1, round(block_seconds / timer.timeit(1).median)))
    times = ([], [])
    while sum(times[0]) * numbers[0] < min_run_time or len(times[0]) < 5:
        for timer, number, samples in zip(timers, numbers, times):
            samples.append(timer.timeit(number).median)
    return statistics.median(times[0]), statistics.median(times[1])


def cuda_extra_peak_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def cpu_extra_peak_bytes(method, mode, batch, dim, dtype, classes) -> int:
    """Peak resident memory of one step above what the inputs and a warmed-up
    process take, measured in a fresh process."""
    cmd = [sys.executable, __file__, "--cpu-memory-probe", method, mode, str(batch), str(dim), dtype, str(classes)]
    # Blocks of 64 KiB and up are mapped and unmapped one by one, so the
    # resident size follows what is live rather than what the heap keeps.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if out.returncode != 0:
        return -1
    return int(out.stdout.split()[-1])


def cpu_memory_probe(method, mode, batch, dim, dtype, classes) -> None:
    fn = {**OPS, "eager": eager_reference}[method]
    if mode == "fwd+bwd":
        fn = forward_backward(fn)
    features, labels = make_inputs(batch, dim, classes, "cpu", getattr(torch, dtype))
    features.requires_grad_(mode == "fwd+bwd")
    fn(features, labels)  # first-use allocations (thread pools, BLAS buffers)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set size (Linux >= 4.0)
    base = _status_bytes("VmRSS")
    fn(features, labels)
    print(_status_bytes("VmHWM") - base)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise LookupError(field)


def is_out_of_memory(error: Exception) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def class_counts(spec: str, batch: int) -> int:
    return batch if spec == "B" else int(spec)


def yardstick_fits(features, labels) -> bool:
    """Whether F·Fᵀ fits in memory (B×B: 256 GiB in float32 at B = 262144,
    past an H200's); where it does not, the ops are timed alone."""
    try:
        gemm(features, labels)
        return True
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        if features.device.type == "cuda":
            torch.cuda.empty_cache()
        return False


def measure(name, fn, mode, features, labels, classes, with_memory, args) -> dict:
    """One row: fn's median time in mode ("fwd" under no_grad, or "fwd+bwd")
    and, with_memory, its extra peak memory (labels drawn from `classes`)."""
    device = features.device
    row = dict(method=name, B=features.size(0), D=args.dim, dtype=args.dtype, mode=mode)
    step = fn if mode == "fwd" else forward_backward(fn)
    x = features if mode == "fwd" else features.detach().clone().requires_grad_()
    call = (lambda: step(x, labels))
    try:
        with torch.no_grad() if mode == "fwd" else torch.enable_grad():
            call()  # warm-up (and compilation)
            if name in OPS and yardstick_fits(features, labels):
                # The op's time in GEMM-equivalents: against F·Fᵀ timed beside it.
                row["seconds"], row["gemm_seconds"] = paired_median_seconds(
                    call, lambda: gemm(features, labels), args.min_run_time)
            else:
                row["seconds"] = median_seconds(call, args.min_run_time)
            if device.type == "cuda" and with_memory:
                row["peak_bytes"] = cuda_extra_peak_bytes(call)
        if device.type == "cpu" and with_memory and name in (*OPS, "eager"):
            row["peak_bytes"] = cpu_extra_peak_bytes(name, mode, row["B"], args.dim, args.dtype, classes)
    except Exception as error:  # an OOM is a result; anything else is not
        if not is_out_of_memory(error):
            raise
        row["skipped"] = "out of memory"
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def run(args) -> list[dict]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    compiled_reference = torch.compile(eager_reference, dynamic=False)
    references = {"eager": eager_reference, "compile": compiled_reference}
    rows = []
    for spec in args.classes:
        # Peak memory hardly depends on the labels: measured at the first distribution only.
        with_memory = args.memory and spec == args.classes[0]
        for batch in args.sizes:
            classes = class_counts(spec, batch)
            features, labels = make_inputs(batch, args.dim, classes, device, dtype, args.sorted_labels)
            todo = [(name, fn, ("fwd", "fwd+bwd")) for name, fn in OPS.items()]
            if batch <= args.max_reference_batch:
                todo += [(name, fn, ("fwd", "fwd+bwd")) for name, fn in references.items()]
            for name, fn, modes in todo:
                for mode in modes:
                    row = measure(name, fn, mode, features, labels, classes, with_memory, args) | dict(classes=spec)
                    rows.append(row)
                    print(format_row(row), flush=True)
            del features
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if device.type == "cuda":
        rows += cuda_floors(args, dtype)
    return rows


def cuda_floors(args, dtype) -> list[dict]:
    """Floors of the CUDA op measured in this run: a trivial backward, and the
    op's forward+backward replayed from a CUDA graph (no launch overhead)."""
    rows = []
    x = torch.randn(256, 512, device="cuda", requires_grad=True)
    trivial = lambda: torch.autograd.grad(x.sum(), x)  # noqa: E731
    trivial()
    rows.append(dict(method="x.sum().backward()", B=256, D=512, mode="fwd+bwd",
                     seconds=median_seconds(trivial, args.min_run_time)))
    for batch in [b for b in args.sizes if b <= 4096]:
        f, labels = make_inputs(batch, args.dim, class_counts(args.classes[0], batch), "cuda", dtype)
        graph = forward_backward_graph(f.requires_grad_(), labels)
        rows.append(dict(method="op (CUDA graph replay)", B=batch, D=args.dim, dtype=args.dtype,
                         mode="fwd+bwd", seconds=median_seconds(graph.replay, args.min_run_time)))
    for row in rows:
        print(format_row(row), flush=True)
    return rows


def measure_call(row, call, device, min_run_time, shape, cpu_peak=None, gemm=None) -> dict:
    """row with the median time of call() and its extra peak memory (on CUDA,
    or from cpu_peak() on CPU), or why it was skipped; printed as it lands,
    its sizes named by shape. With gemm, call() is timed beside it, for its
    time in GEMM-equivalents."""
    try:
        call()
        if gemm is not None:
            row["seconds"], row["gemm_seconds"] = paired_median_seconds(call, gemm, min_run_time)
        else:
            row["seconds"] = median_seconds(call, min_run_time)
        if device.type == "cuda":
            row["peak_bytes"] = cuda_extra_peak_bytes(call)
        elif cpu_peak is not None:
            row["peak_bytes"] = cpu_peak()
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        row["skipped"] = "out of memory"
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(format_row(row, shape), flush=True)
    return row


def format_row(row, shape=None) -> str:
    """A measured row as one line of progress; shape: how to name its sizes (default B=...)."""
    shape = shape or f"B={row['B']}"
    head = f"{row['method']:>24} {shape:<16} classes={row.get('classes', '—'):<5} {row['mode']:<8}"
    if "skipped" in row:
        return f"{head} skipped: {row['skipped']}"
    mem = row.get("peak_bytes")
    mem_s = "" if mem is None else f"  extra peak {mem / 2**20:10.1f} MiB"
    return f"{head} {row['seconds'] * 1e3:10.3f} ms{mem_s}"


def format_time(r) -> str:
    """A row's median time for a table: µs below a millisecond."""
    if r is None:
        return "—"
    if "skipped" in r:
        return r["skipped"]
    s = r["seconds"]
    return f"{s * 1e6:.0f} µs" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def format_memory(r) -> str:
    if r is None or r.get("peak_bytes") is None or r["peak_bytes"] < 0:
        return "—"
    return f"{r['peak_bytes'] / 2**20:.1f} MiB"


def gemm_equivalents(row) -> str:
    """An op row's time over that of the GEMM F·Fᵀ timed beside it."""
    if not row or "seconds" not in row or "gemm_seconds" not in row:
        return "—"
    return f"{row['seconds'] / row['gemm_seconds']:.2f}"


def table(rows) -> str:
    """Markdown table: one line per (B, classes, mode): both ops in time and
    in GEMM-equivalents, against eager and compile; the GEMM column is the
    F·Fᵀ timed beside circle::loss in that line."""
    by_key = {(r["method"], r["B"], r.get("classes"), r["mode"]): r for r in rows}

    def speedup(a, b):
        if not a or not b or "seconds" not in a or "seconds" not in b:
            return "—"
        return f"{b['seconds'] / a['seconds']:.1f}×"

    lines = [
        "| B | classes | mode | op | op in GEMMs | anchor_loss | anchor in GEMMs | eager | compile | "
        "op vs eager | op vs compile | GEMM F·Fᵀ | op extra peak | eager extra peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["B"], r["classes"]) for r in rows if r["method"] == "op"},
                  key=lambda k: (k[0], k[1] == "B", int(k[1]) if k[1] != "B" else 0))
    for batch, classes in keys:
        for mode in ("fwd", "fwd+bwd"):
            op, anchor, eager, comp = (by_key.get((m, batch, classes, mode)) for m in ("op", "anchor", "eager", "compile"))
            gemm_beside_op = {"seconds": op["gemm_seconds"]} if op and "gemm_seconds" in op else None
            lines.append(
                f"| {batch} | {classes} | {mode} | {format_time(op)} | {gemm_equivalents(op)} | "
                f"{format_time(anchor)} | {gemm_equivalents(anchor)} | {format_time(eager)} | {format_time(comp)} | "
                f"{speedup(op, eager)} | {speedup(op, comp)} | {format_time(gemm_beside_op)} | {format_memory(op)} | "
                f"{format_memory(eager)} |"
            )
    extras = [r for r in rows if r["method"] not in ("op", "anchor", "eager", "compile")]
    if extras:
        lines += ["", "| floor | B | time |", "|---|---|---|"]
        lines += [f"| {r['method']} | {r['B']} | {format_time(r)} |" for r in extras]
    return "\n".join(lines)


def gemm_table(rows) -> str:
    """Markdown table of both ops in GEMM-equivalents (time over that of
    F·Fᵀ timed beside it), one line per (B, mode), one column per label
    distribution."""
    by_key = {(r["method"], r["B"], r.get("classes"), r["mode"]): r for r in rows}
    distributions = list(dict.fromkeys(r["classes"] for r in rows if r["method"] == "op"))
    lines = [
        "| B | mode | " + " | ".join(f"{c} classes" for c in distributions) + " |",
        "|---|---|" + "---|" * len(distributions),
    ]
    for batch in sorted({r["B"] for r in rows if r["method"] == "op"}):
        for mode in ("fwd", "fwd+bwd"):
            cells = [f"{gemm_equivalents(by_key.get(('op', batch, c, mode)))} / "
                     f"{gemm_equivalents(by_key.get(('anchor', batch, c, mode)))}"
                     for c in distributions]
            lines.append(f"| {batch} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    first = rows[0].get("classes")  # one label distribution: the first one run
    styles = (("op", "o-"), ("anchor", "d-."), ("eager", "s--"), ("compile", "^:"))
    timed = [r for r in rows if "seconds" in r and r.get("classes") == first]
    measured = [r for r in timed if r["mode"] == "fwd+bwd" and r.get("peak_bytes") not in (None, -1)]
    # A memory panel only where memory was measured (--no-memory leaves none).
    fig, axes = plt.subplots(1, 2 if measured else 1, figsize=(11 if measured else 6, 4.2), squeeze=False)
    ax_t = axes[0][0]
    for method, style in styles:
        for mode, alpha in (("fwd", 0.5), ("fwd+bwd", 1.0)):
            pts = [r for r in timed if r["method"] == method and r["mode"] == mode]
            if pts:
                ax_t.loglog([r["B"] for r in pts], [r["seconds"] * 1e3 for r in pts], style,
                            alpha=alpha, label=f"{method} {mode}")
    ax_t.set(xlabel="B", ylabel="median time (ms)", title=f"time ({first} classes)")
    if measured:
        ax_m = axes[0][1]
        for method, style in styles:
            mem = [r for r in measured if r["method"] == method]
            if mem:
                ax_m.loglog([r["B"] for r in mem], [max(r["peak_bytes"], 1) / 2**20 for r in mem], style,
                            label=method)
        ax_m.set(xlabel="B", ylabel="extra peak memory, fwd+bwd (MiB)", title="memory")
    for ax in axes[0]:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def environment(args) -> dict:
    env = dict(
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        torch=torch.__version__,
        python=platform.python_version(),
        device=args.device,
        threads=torch.get_num_threads(),
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        command=" ".join([Path(sys.executable).name] + sys.argv),
    )
    if args.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    else:
        env["cpu"] = platform.processor() or platform.machine()
        env["cores"] = os.cpu_count()
    return env


def bench_arguments(description: str, dim: int, probe_fields: int = 0) -> argparse.ArgumentParser:
    """The options every bench script takes; each adds its own shapes. With
    probe_fields, the CPU memory probes': each runs in a fresh process of the
    script, called with that many fields."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dim", type=int, default=dim)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"])
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds per measurement")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results"))
    if probe_fields:
        parser.add_argument("--no-cpu-memory", action="store_true", help="skip the fresh-process memory probes")
        parser.add_argument("--cpu-memory-probe", nargs=probe_fields, help=argparse.SUPPRESS)
    return parser


def report(stem: Path, env: dict, rows: list, md: str) -> None:
    """Prints the environment and the tables, and writes them to stem.json
    (with the rows) and stem.md."""
    header = " ".join(f"{k}={v}" for k, v in env.items())
    print()
    print(header)
    print(md)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(dict(environment=env, rows=rows), indent=1))
    stem.with_suffix(".md").write_text(header + "\n\n" + md + "\n")


def main() -> None:
    parser = bench_arguments(__doc__, dim=512)
    parser.add_argument("--sizes", type=int, nargs="+")
    parser.add_argument("--classes", nargs="+", default=["100"],
                        help="label distributions: class counts, or B for as many classes as rows")
    parser.add_argument("--sorted-labels", action="store_true",
                        help="rows in label order (results named *_sorted)")
    parser.add_argument("--no-memory", dest="memory", action="store_false",
                        help="skip the peak-memory measurements (on CPU, a fresh process each)")
    parser.add_argument("--max-reference-batch", type=int, default=32768,
                        help="largest B at which the B×B-memory reference is attempted")
    parser.add_argument("--matmul-precision", default="highest", choices=["highest", "high", "medium"],
                        help="torch.set_float32_matmul_precision: 'high' lets float32 GEMMs use TF32")
    parser.add_argument("--cpu-memory-probe", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cpu_memory_probe:
        method, mode, batch, dim, dtype, classes = args.cpu_memory_probe
        cpu_memory_probe(method, mode, int(batch), int(dim), dtype, int(classes))
        return
    if args.sizes is None:
        args.sizes = [256, 4096, 16384, 65536] if args.device == "cuda" else [256, 1024, 2048]
    for spec in args.classes:
        if spec != "B" and not (spec.isdigit() and int(spec) > 0):
            parser.error(f"--classes: expected positive class counts or B, got {spec!r}")
    torch.set_float32_matmul_precision(args.matmul_precision)
    torch.manual_seed(0)
    rows = run(args)
    env = environment(args)
    md = table(rows) + "\n\nGEMM-equivalents, circle::loss / anchor_loss:\n\n" + gemm_table(rows)
    precision = "" if args.matmul_precision == "highest" else f"_{args.matmul_precision}"
    order = "_sorted" if args.sorted_labels else ""
    stem = args.out / f"bench_{args.device}_{args.dtype}{precision}{order}"
    report(stem, env, rows, md)
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, stem.with_suffix(".png"))
    print(f"\nwritten: {stem}.{{json,csv,md,png}}")


if __name__ == "__main__":
    main()
