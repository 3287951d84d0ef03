"""Side-by-side benchmark of the per-anchor form: torch.ops.circle.anchor_loss
against circle::loss on the same inputs, and the drop-in
circle_loss.pml.CircleLoss against pytorch-metric-learning's CircleLoss,
forward and forward+backward, with extra peak memory, and anchor_loss's time
in GEMM-equivalents: over that of the GEMM Q·Rᵀ of the same size, the two
timed in alternating blocks.

    python bench/bench_anchor.py                       # CPU, or CUDA when present
    python bench/bench_anchor.py --device cuda --sizes 256 4096 16384 --refs 256:65536 --classes 10 100

Each --refs entry B:M is B queries against M references (anchor_loss with a
reference set; PML with ref_emb). Each --banks entry B:M is a step of PML's
CrossBatchMemory: B queries against a full bank of M rows that holds them,
their own copies left out, the bank detached; there circle_loss.pml's
CrossBatchMemory and CircleLoss run against PML's, beside the op called
directly (anchor_loss with ref_self_index). Prints Markdown tables and writes
them with the raw rows (JSON) under --out. Timings are torch.utils.benchmark
medians; nothing here asserts a timing.
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
from bench import _status_bytes, bench_arguments, cuda_extra_peak_bytes, environment, median_seconds  # noqa: E402
from bench import format_memory, format_row, format_time, gemm_equivalents, measure_call, report  # noqa: E402

MARGIN, GAMMA = circle_loss.ANCHOR_DEFAULT_MARGIN, circle_loss.ANCHOR_DEFAULT_GAMMA


def methods():
    """name -> fn(x, labels, ref, ref_labels) -> scalar loss. x and ref are raw
    embeddings; every method normalises them as PML's CosineSimilarity does."""
    criterion = circle_loss.AnchorCircleLoss(MARGIN, GAMMA)

    def anchor(x, y, r, ry):
        return criterion(F.normalize(x, dim=1), y, None if r is None else F.normalize(r, dim=1), ry)

    def global_op(x, y, r, ry):
        return torch.ops.circle.loss(F.normalize(x, dim=1), y, MARGIN, GAMMA)

    found = {"anchor_loss": anchor, "circle::loss": global_op}
    try:
        from pytorch_metric_learning import losses

        from circle_loss import pml as drop_in

        def call(loss_fn):
            return lambda x, y, r, ry: loss_fn(x, y) if r is None else loss_fn(x, y, ref_emb=r, ref_labels=ry)

        found["drop-in"] = call(drop_in.CircleLoss(m=MARGIN, gamma=GAMMA))
        found["PML"] = call(losses.CircleLoss(m=MARGIN, gamma=GAMMA))
    except ImportError:
        print("pytorch-metric-learning not installed: drop-in and PML not run")
    return found


def make_raw_inputs(batch, refs, dim, classes, device, dtype):
    """Raw (unnormalised) embeddings and labels, and a reference set of refs rows."""
    x = torch.randn(batch, dim, device=device, dtype=dtype)
    y = torch.randint(0, classes, (batch,), device=device)
    if refs is None:
        return x, y, None, None
    return x, y, torch.randn(refs, dim, device=device, dtype=dtype), torch.randint(0, classes, (refs,), device=device)


def step_of(fn, mode):
    if mode == "fwd":
        def forward(x, y, r, ry):
            with torch.no_grad():
                return fn(x, y, r, ry)
        return forward

    def forward_backward(x, y, r, ry):
        leaves = [t for t in (x, r) if t is not None]
        return torch.autograd.grad(fn(x, y, r, ry), leaves)
    return forward_backward


def cpu_extra_peak_bytes(method, mode, batch, refs, dim, dtype, classes) -> int:
    """Peak resident memory of one step beyond the inputs, in a fresh process."""
    cmd = [sys.executable, __file__, "--cpu-memory-probe", method, mode, str(batch), str(refs or 0), str(dim),
           dtype, str(classes)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    return int(out.stdout.split()[-1]) if out.returncode == 0 else -1


def cpu_memory_probe(method, mode, batch, refs, dim, dtype, classes) -> None:
    step = step_of(methods()[method], mode)
    x, y, r, ry = make_raw_inputs(batch, refs or None, dim, classes, "cpu", getattr(torch, dtype))
    x.requires_grad_(mode == "fwd+bwd")
    if r is not None:
        r.requires_grad_(mode == "fwd+bwd")
    step(x, y, r, ry)  # first-use allocations
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_bytes("VmRSS")
    step(x, y, r, ry)
    print(_status_bytes("VmHWM") - base)


def run(args) -> list[dict]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    found = methods()
    shapes = [(b, None) for b in args.sizes] + [tuple(int(v) for v in spec.split(":")) for spec in args.refs]
    rows = []
    for classes in args.classes:
        for batch, refs in shapes:
            x, y, r, ry = make_raw_inputs(batch, refs, args.dim, classes, device, dtype)
            leaves = (x.clone().requires_grad_(), y, None if r is None else r.clone().requires_grad_(), ry)
            gemm = (lambda a=x.detach(), b=(x if r is None else r).detach(): a @ b.T)
            for name, fn in found.items():
                if name == "circle::loss" and refs is not None:
                    continue  # the global op has no reference set
                if name == "PML" and batch * (refs or batch) > args.max_pml_pairs:
                    rows.append(dict(method=name, B=batch, M=refs, classes=classes, mode="fwd+bwd",
                                     skipped="--max-pml-pairs"))
                    continue
                for mode in ("fwd", "fwd+bwd"):
                    row = dict(method=name, B=batch, M=refs, classes=classes, D=args.dim, dtype=args.dtype, mode=mode)
                    step = step_of(fn, mode)
                    inputs = leaves if mode == "fwd+bwd" else (x, y, r, ry)
                    call = (lambda s=step, i=inputs: s(*i))
                    cpu_peak = None if args.no_cpu_memory else (
                        lambda n=name, m=mode: cpu_extra_peak_bytes(n, m, batch, refs, args.dim, args.dtype, classes))
                    rows.append(measure_call(row, call, device, args.min_run_time, anchor_shape(row), cpu_peak,
                                             gemm if name == "anchor_loss" else None))
            if device.type == "cuda":
                rows.append(op_alone_peak(batch, refs, classes, x, y, r, ry, args))
                print(format_row(rows[-1], anchor_shape(rows[-1])), flush=True)
            del x, r, leaves, gemm
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def bank_methods(size, dim, found):
    """name -> fn(x, labels, bank, bank_labels, copies) -> scalar loss: one
    CrossBatchMemory step, queries x (raw) against a full bank (raw, detached)
    whose rows `copies` hold them."""
    def op(x, y, bank, bank_labels, copies):
        losses = circle_loss.anchor_loss(F.normalize(x, dim=1), y, F.normalize(bank, dim=1), bank_labels, MARGIN, GAMMA,
                                         ref_self_index=copies)
        return losses.sum() / (losses > 0).sum().clamp_min(1)

    bank_fns = {"anchor_loss, bank": op}
    if "PML" not in found:
        return bank_fns
    from pytorch_metric_learning import losses

    from circle_loss import pml as drop_in

    def memory_step(memory_cls, loss_cls):
        memory = memory_cls(loss_cls(m=MARGIN, gamma=GAMMA), embedding_size=dim, memory_size=size)

        def step(x, y, bank, bank_labels, copies):
            # Each call enqueues its batch: refill the bank so every step sees the same one.
            memory.embedding_memory, memory.label_memory = bank.clone(), bank_labels.clone()
            memory.has_been_filled, memory.queue_idx = True, int(copies[0])
            return memory(x, y)
        return step

    bank_fns["drop-in CrossBatchMemory"] = memory_step(drop_in.CrossBatchMemory, drop_in.CircleLoss)
    bank_fns["PML CrossBatchMemory"] = memory_step(losses.CrossBatchMemory, losses.CircleLoss)
    return bank_fns


def run_banks(args, found) -> list[dict]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    rows = []
    for classes in args.classes:
        for spec in args.banks:
            batch, size = (int(v) for v in spec.split(":"))
            x, y, bank, bank_labels = make_raw_inputs(batch, size, args.dim, classes, device, dtype)
            copies = torch.arange(size - batch // 2, size - batch // 2 + batch, device=device) % size  # wraps round
            bank[copies], bank_labels[copies] = x, y
            gemm = (lambda a=x, b=bank: a @ b.T)
            for name, fn in bank_methods(size, args.dim, found).items():
                if name.startswith("PML") and batch * size > args.max_pml_pairs:
                    continue
                for mode in ("fwd", "fwd+bwd"):
                    row = dict(method=name, B=batch, M=size, classes=classes, D=args.dim, dtype=args.dtype, mode=mode,
                               bank=True)
                    query = x.clone().requires_grad_(mode == "fwd+bwd")
                    if mode == "fwd":
                        call = (lambda f=fn, q=query: f(q, y, bank, bank_labels, copies).detach())
                    else:
                        call = (lambda f=fn, q=query: torch.autograd.grad(f(q, y, bank, bank_labels, copies), [q]))
                    rows.append(measure_call(row, call, device, args.min_run_time, anchor_shape(row),
                                             gemm=gemm if name == "anchor_loss, bank" else None))
            del x, bank, gemm
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def op_alone_peak(batch, refs, classes, x, y, r, ry, args) -> dict:
    """Extra peak memory of the op's forward+backward alone, on inputs already
    normalised: what the op itself holds beyond its inputs, gradients included."""
    q = F.normalize(x, dim=1).requires_grad_()
    ref = None if r is None else F.normalize(r, dim=1).requires_grad_()
    leaves = [q] if ref is None else [q, ref]
    step = lambda: torch.autograd.grad(torch.ops.circle.anchor_loss(q, y, ref, ry).sum(), leaves)  # noqa: E731
    step()
    return dict(method="anchor_loss op alone", B=batch, M=refs, classes=classes, D=args.dim, dtype=args.dtype,
                mode="fwd+bwd", seconds=median_seconds(step, args.min_run_time), peak_bytes=cuda_extra_peak_bytes(step))


def anchor_shape(row) -> str:
    return f"B={row['B']}" + (f" M={row['M']}" if row.get("M") else "")


def ratio(num, den):
    if not num or not den or "seconds" not in num or "seconds" not in den:
        return "—"
    return f"{num['seconds'] / den['seconds']:.2f}×"


def bank_table(rows) -> str:
    by_key = {(r["method"], r["B"], r["M"], r["classes"], r["mode"]): r for r in rows}
    lines = [
        "| CrossBatchMemory step: B | bank M | classes | mode | anchor_loss, bank | in GEMMs | drop-in | PML | "
        "PML / drop-in | drop-in extra peak | PML extra peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for batch, size, classes in sorted({(r["B"], r["M"], r["classes"]) for r in rows}):
        for mode in ("fwd", "fwd+bwd"):
            get = lambda name: by_key.get((name, batch, size, classes, mode))  # noqa: E731
            op, drop, pml = get("anchor_loss, bank"), get("drop-in CrossBatchMemory"), get("PML CrossBatchMemory")
            lines.append(
                f"| {batch} | {size} | {classes} | {mode} | {format_time(op)} | {gemm_equivalents(op)} | "
                f"{format_time(drop)} | {format_time(pml)} | {ratio(pml, drop)} | {format_memory(drop)} | "
                f"{format_memory(pml)} |"
            )
    return "\n".join(lines)


def table(rows) -> str:
    by_key = {(r["method"], r["B"], r.get("M"), r["classes"], r["mode"]): r for r in rows}

    lines = [
        "| B | M | classes | mode | anchor_loss | circle::loss | anchor / circle::loss | anchor in GEMMs | "
        "drop-in | PML | PML / drop-in | anchor extra peak | PML extra peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["B"], r.get("M") or 0, r["classes"]) for r in rows if r["method"] == "anchor_loss"})
    for batch, refs, classes in keys:
        m = refs or None
        for mode in ("fwd", "fwd+bwd"):
            get = lambda name: by_key.get((name, batch, m, classes, mode))  # noqa: E731
            anchor, glob, drop, pml = get("anchor_loss"), get("circle::loss"), get("drop-in"), get("PML")
            if pml is None:
                pml = by_key.get(("PML", batch, m, classes, "fwd+bwd")) if mode == "fwd+bwd" else None
            lines.append(
                f"| {batch} | {refs or '—'} | {classes} | {mode} | {format_time(anchor)} | {format_time(glob)} | {ratio(anchor, glob)} | "
                f"{gemm_equivalents(anchor)} | {format_time(drop)} | {format_time(pml)} | {ratio(pml, drop)} | {format_memory(anchor)} | "
                f"{format_memory(pml)} |"
            )
    alone = [r for r in rows if r["method"] == "anchor_loss op alone"]
    if alone:
        lines += ["", "| anchor_loss alone, fwd+bwd on normalised inputs | classes | time | extra peak (gradients included) |",
                  "|---|---|---|---|"]
        lines += [f"| B = {r['B']}" + (f", M = {r['M']}" if r.get("M") else "") + f" | {r['classes']} | {format_time(r)} | {format_memory(r)} |"
                  for r in alone]
    return "\n".join(lines)


def main() -> None:
    parser = bench_arguments(__doc__, dim=512, probe_fields=7)
    parser.add_argument("--sizes", type=int, nargs="*")
    parser.add_argument("--refs", nargs="*", help="B:M shapes with a reference set")
    parser.add_argument("--banks", nargs="*", help="B:M CrossBatchMemory steps (B queries, a bank of M)")
    parser.add_argument("--classes", type=int, nargs="+", default=[100])
    parser.add_argument("--max-pml-pairs", type=int, default=16384 * 16384,
                        help="largest B·M at which PML's B×M matrices are attempted")
    args = parser.parse_args()
    if args.cpu_memory_probe:
        method, mode, batch, refs, dim, dtype, classes = args.cpu_memory_probe
        cpu_memory_probe(method, mode, int(batch), int(refs), int(dim), dtype, int(classes))
        return
    cuda = args.device == "cuda"
    if args.sizes is None:
        args.sizes = [256, 4096, 16384] if cuda else [256, 1024, 2048]
    if args.refs is None:
        args.refs = ["256:65536"]
    if args.banks is None:
        args.banks = ["256:65536", "1024:65536"] if cuda else ["256:8192"]
    torch.manual_seed(0)
    rows = run(args)
    bank_rows = run_banks(args, methods())
    rows += bank_rows
    env = environment(args)
    md = table([r for r in rows if not r.get("bank")]) + "\n\n" + bank_table(bank_rows)
    stem = args.out / f"bench_anchor_{args.device}_{args.dtype}"
    report(stem, env, rows, md)
    print(f"\nwritten: {stem}.{{json,md}}")


if __name__ == "__main__":
    main()
