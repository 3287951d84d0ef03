"""circle::anchor_loss, the per-anchor form: against its float64 reference
(docs/math.md), as a custom operator (opcheck, TorchScript, compile, export),
and its refusals of bad input."""

import subprocess
import sys
import textwrap

import pytest
import torch

import circle_loss
from conftest import backward, make_inputs
from reference import (
    FLOAT32_YARDSTICK_FACTOR,
    TOLERANCE,
    anchor_reference_and_grads,
    relative_error,
)

# A dtype that takes the tensor-core tiles on CUDA (rows of whole 16-byte chunks).
HALF_PRECISION = pytest.param(torch.bfloat16, id="bfloat16")
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

SHAPES = [  # (B, D, classes, M or None): tiny, odd, tile edges, several tiles
    (1, 8, 1, None),
    (2, 3, 2, None),
    (7, 5, 3, None),
    (33, 17, 5, None),
    (257, 31, 4, None),
    (300, 64, 40, None),
    (600, 16, 2, None),
    (1, 8, 2, 5),
    (40, 12, 4, 300),
    (130, 16, 7, 513),
    (300, 8, 3, 33),
    (1100, 8, 5, 600),  # more row blocks than the gradient's column shares
]


def run_anchor(features, labels, ref=None, ref_labels=None, margin=0.4, gamma=80.0, weights=None,
               ref_self_index=None, ref_grad=True):
    """The op's losses and the gradients of Σ weights_i · L_i (to ref only if ref_grad)."""
    q = features.detach().clone().requires_grad_()
    r = None if ref is None else ref.detach().clone().requires_grad_(ref_grad)
    losses = torch.ops.circle.anchor_loss(q, labels, r, ref_labels, margin, gamma, ref_self_index)
    w = torch.ones_like(losses) if weights is None else weights
    (losses * w).sum().backward()
    return losses, q.grad, (None if r is None else r.grad)


def assert_anchor_matches_reference(features, labels, ref=None, ref_labels=None, margin=0.4, gamma=80.0,
                                    weights=None, ref_self_index=None, ref_grad=True):
    losses, grad_q, grad_r = run_anchor(features, labels, ref, ref_labels, margin, gamma, weights, ref_self_index,
                                        ref_grad)
    dtype = features.dtype
    assert losses.dtype == dtype and losses.shape == (features.shape[0],)
    assert grad_q.dtype == dtype and grad_q.shape == features.shape
    ref_losses, ref_q, ref_r = anchor_reference_and_grads(features, labels, ref, ref_labels, margin, gamma, weights,
                                                          ref_self_index=ref_self_index)
    loss_tol, grad_tol = TOLERANCE[dtype]
    if dtype != torch.float64:
        # Below float64 the gradient's error is set by the rounding of S,
        # which gamma amplifies: bounded by a multiple of plain float32's.
        _, q32, r32 = anchor_reference_and_grads(features, labels, ref, ref_labels, margin, gamma, weights,
                                                 torch.float32, ref_self_index)
        yardstick = max(relative_error(q32, ref_q), 0 if r32 is None else relative_error(r32, ref_r))
        grad_tol = max(grad_tol, FLOAT32_YARDSTICK_FACTOR * yardstick)
    assert torch.isfinite(losses).all()
    assert relative_error(losses, ref_losses) <= loss_tol, relative_error(losses, ref_losses)
    assert relative_error(grad_q, ref_q) <= grad_tol, relative_error(grad_q, ref_q)
    if ref is not None and ref_grad:
        assert grad_r.dtype == dtype and grad_r.shape == ref.shape
        assert relative_error(grad_r, ref_r) <= grad_tol, relative_error(grad_r, ref_r)
    if ref is not None and not ref_grad:
        assert grad_r is None


def make_reference_set(rows, dim, classes, device, dtype):
    return make_inputs(rows, dim, classes, device, dtype) if rows is not None else (None, None)


@pytest.mark.parametrize("batch,dim,classes,refs", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.sanitize
def test_matches_reference(device, batch, dim, classes, refs, dtype):
    features, labels = make_inputs(batch, dim, classes, device, dtype)
    ref, ref_labels = make_reference_set(refs, dim, classes, device, dtype)
    weights = torch.rand(batch, device=device, dtype=dtype)  # the incoming gradient is a vector
    assert_anchor_matches_reference(features, labels, ref, ref_labels, weights=weights)
    if ref is not None:  # references that need no gradient: row gradients made in the forward
        assert_anchor_matches_reference(features, labels, ref, ref_labels, weights=weights, ref_grad=False)


@pytest.mark.parametrize("margin,gamma", [(0.25, 256.0), (0.1, 16.0), (0.4, -3.0), (0.0, 0.0)])
def test_margin_and_gamma(device, margin, gamma):
    features, labels = make_inputs(200, 16, 5, device, torch.float64)
    ref, ref_labels = make_inputs(90, 16, 5, device, torch.float64)
    assert_anchor_matches_reference(features, labels, margin=margin, gamma=gamma)
    assert_anchor_matches_reference(features, labels, ref, ref_labels, margin=margin, gamma=gamma)


def memory_bank(features, labels, size, first):
    """A bank of `size` rows (features' dtype) that holds the batch from row
    `first` on, wrapping around as a queue does, other rows drawn at random:
    (bank, bank_labels, the position of each anchor's copy)."""
    batch, dim = features.shape
    bank, bank_labels = make_inputs(size, dim, int(labels.max()) + 1, features.device, features.dtype)
    position = (first + torch.arange(batch, device=features.device)) % size
    bank[position] = features
    bank_labels[position] = labels
    return bank, bank_labels, position


@pytest.mark.parametrize("batch,size,first", [(1, 4, 3), (30, 64, 50), (257, 300, 0), (300, 300, 7), (40, 700, 500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ref_grad", [False, True])
@pytest.mark.sanitize
def test_self_copies_in_a_memory_bank_are_left_out(device, batch, size, first, dtype, ref_grad):
    features, labels = make_inputs(batch, 24, 5, device, dtype)
    bank, bank_labels, position = memory_bank(features, labels, size, first)
    weights = torch.rand(batch, device=device, dtype=dtype)
    assert_anchor_matches_reference(features, labels, bank, bank_labels, weights=weights, ref_self_index=position,
                                    ref_grad=ref_grad)


def test_module_takes_the_self_index_scripted_too(device):
    features, labels = make_inputs(40, 16, 4, device)
    bank, bank_labels, position = memory_bank(features, labels, 100, 70)
    losses = circle_loss.anchor_loss(features, labels, bank, bank_labels, 0.3, 64.0, ref_self_index=position)
    expected = losses.sum() / (losses > 0).sum().clamp_min(1)
    module = circle_loss.AnchorCircleLoss(margin=0.3, gamma=64.0)
    for criterion in (module, torch.jit.script(module)):
        torch.testing.assert_close(criterion(features, labels, bank, bank_labels, position), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.sanitize
def test_self_copies_half_precision(device, dtype):
    features, labels = make_inputs(200, 64, 8, device, dtype)
    bank, bank_labels, position = memory_bank(features, labels, 500, 400)
    assert_anchor_matches_reference(features, labels, bank, bank_labels, ref_self_index=position, ref_grad=False)


def test_self_index_outside_the_reference_set_leaves_nothing_out(device):
    features, labels = make_inputs(50, 8, 4, device)
    ref, ref_labels = make_inputs(70, 8, 4, device)
    outside = torch.tensor([-1, 70, -5, 1000, 2**40], device=device).repeat(10)
    op = torch.ops.circle.anchor_loss
    assert torch.equal(op(features, labels, ref, ref_labels, ref_self_index=outside), op(features, labels, ref, ref_labels))
    # Leaving a row's only positive out empties its positive set: that row's loss is 0.
    labels = torch.arange(50, device=device)
    ref_labels = torch.cat([labels, labels.new_full((20,), 1000)])
    losses = op(features, labels, ref, ref_labels, ref_self_index=torch.arange(50, device=device, dtype=torch.int32))
    assert (op(features, labels, ref, ref_labels) > 0).all()
    assert torch.equal(losses, torch.zeros_like(losses))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("refs", [None, 150])
@pytest.mark.sanitize
def test_half_precision_inputs(device, dtype, refs):
    features, labels = make_inputs(200, 64, 8, device, dtype)
    ref, ref_labels = make_reference_set(refs, 64, 8, device, dtype)
    assert_anchor_matches_reference(features, labels, ref, ref_labels)


@pytest.mark.parametrize("dtype", [torch.float64, HALF_PRECISION])
@pytest.mark.parametrize("layout", ["all_same", "all_distinct", "singletons_and_pairs", "ref_disjoint"])
@pytest.mark.sanitize
def test_rows_with_an_empty_set_give_zero(device, layout, dtype):
    # bfloat16 rows of whole 16-byte chunks take the tensor-core weights on CUDA.
    batch = 60
    labels = {
        "all_same": torch.zeros(batch, dtype=torch.long),
        "all_distinct": torch.arange(batch),
        "singletons_and_pairs": torch.arange(batch) // 2 + (torch.arange(batch) >= 30) * 100 * torch.arange(batch),
        "ref_disjoint": torch.zeros(batch, dtype=torch.long),
    }[layout].to(device)
    features, _ = make_inputs(batch, 8, 1, device, torch.float64)
    features = features.to(dtype)
    if layout == "ref_disjoint":
        ref, ref_labels = make_inputs(20, 8, 1, device, dtype)
        ref_labels = ref_labels + 1  # every pair negative: no row has a positive
        losses, grad_q, grad_r = run_anchor(features, labels, ref, ref_labels)
        assert torch.equal(grad_r, torch.zeros_like(grad_r))
        _, detached_grad_q, _ = run_anchor(features, labels, ref, ref_labels, ref_grad=False)
        assert torch.equal(detached_grad_q, torch.zeros_like(grad_q))
    else:
        losses, grad_q, _ = run_anchor(features, labels)
        assert_anchor_matches_reference(features, labels)
    if layout != "singletons_and_pairs":
        assert torch.equal(losses, torch.zeros_like(losses))
        assert torch.equal(grad_q, torch.zeros_like(grad_q))


@pytest.mark.sanitize
def test_empty_inputs(device):
    features, labels = make_inputs(0, 8, 1, device)
    losses, grad_q, _ = run_anchor(features, labels)
    assert losses.shape == (0,) and grad_q.shape == (0, 8)
    ref, ref_labels = make_inputs(0, 8, 1, device)
    features, labels = make_inputs(5, 8, 2, device)
    losses, grad_q, grad_r = run_anchor(features, labels, ref, ref_labels)
    assert torch.equal(losses, torch.zeros(5, device=device)) and grad_r.shape == (0, 8)
    assert torch.equal(grad_q, torch.zeros_like(grad_q))
    losses, grad_q, _ = run_anchor(features, labels, ref, ref_labels, ref_grad=False)
    assert torch.equal(losses, torch.zeros(5, device=device)) and torch.equal(grad_q, torch.zeros_like(grad_q))
    features, labels = make_inputs(0, 8, 1, device)
    ref, ref_labels = make_inputs(6, 8, 2, device)
    losses, grad_q, _ = run_anchor(features, labels, ref, ref_labels, ref_grad=False)
    assert losses.shape == (0,) and grad_q.shape == (0, 8)


@pytest.mark.parametrize("dtype", [torch.float32, HALF_PRECISION])
@pytest.mark.sanitize
def test_nan_propagates(device, dtype):
    features, labels = make_inputs(40, 8, 3, device, dtype)
    features[3, 2] = float("nan")
    losses = torch.ops.circle.anchor_loss(features, labels)
    assert torch.isnan(losses[3])


# The CPU kernels sum a tile's exps against one shift per set where every
# row's and column's largest logit lies near it, and against each row's and
# column's own where they lie far apart (ops/cpu/anchor_loss_cpu.cpp); the
# CUDA tensor-core tiles against each share of a row's or column's own: here
# a positive pair of opposite rows in different tiles (z ≈ 1000, about 250
# elsewhere). Each row's loss is held to the reference, not only the norm.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, HALF_PRECISION])
def test_tiles_of_far_apart_logits(device, dtype):
    features, labels = make_inputs(300, 16, 3, device, torch.float64)
    labels[280] = labels[0]
    features[280] = -features[0]
    features = features.to(dtype)
    assert_anchor_matches_reference(features, labels, margin=0.25, gamma=256.0)
    losses = torch.ops.circle.anchor_loss(features, labels, None, None, 0.25, 256.0)
    ref_losses = anchor_reference_and_grads(features, labels, margin=0.25, gamma=256.0)[0]
    row_errors = (losses.double() - ref_losses).abs() / ref_losses.abs().clamp_min(1.0)
    assert row_errors.max() <= TOLERANCE[dtype][0], row_errors.max()


def test_bitwise_deterministic_for_any_thread_count(device):
    features, labels = make_inputs(700, 32, 6, device)
    ref, ref_labels = make_inputs(300, 32, 6, device)
    bank, bank_labels = make_inputs(1500, 32, 6, device)  # few queries, many references: shares of columns
    threads = torch.get_num_threads()
    results = []
    for n in ([1, threads] if device.type == "cpu" else [threads, threads]):
        torch.set_num_threads(n)
        try:
            results.append(run_anchor(features, labels) + run_anchor(features, labels, ref, ref_labels)
                           + run_anchor(features[:100], labels[:100], bank, bank_labels)
                           + run_anchor(features[:100], labels[:100], bank, bank_labels, ref_grad=False))
        finally:
            torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert a is None or torch.equal(a, b)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(device, requires_grad):
    for batch, dim, classes, refs in [(1, 4, 1, None), (37, 16, 5, None), (30, 8, 3, 45)]:
        features, labels = make_inputs(batch, dim, classes, device)
        ref, ref_labels = make_reference_set(refs, dim, classes, device, torch.float32)
        features.requires_grad_(requires_grad)
        if ref is not None:
            ref.requires_grad_(requires_grad)
        calls = [(features, labels, ref, ref_labels), (features, labels, ref, ref_labels, 0.25, 32.0)]
        if ref is not None:
            calls.append((features, labels, ref, ref_labels, 0.4, 80.0, torch.arange(batch, device=device) % refs))
            # references that need no gradient, as a memory bank's
            calls.append((features, labels, ref.detach(), ref_labels, 0.4, 80.0, torch.arange(batch, device=device) % refs))
        for args in calls:
            torch.library.opcheck(torch.ops.circle.anchor_loss.default, args, test_utils=OPCHECK_TESTS)


def test_opcheck_internal_ops(device):
    features, labels = make_inputs(40, 8, 4, device)
    ref, ref_labels = make_inputs(25, 8, 4, device)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    position = torch.arange(40, device=device) % 25
    keep = device.type == "cpu"  # the diagonal tiles are the CPU kernels' alone
    for r, rl, index in [(None, None, None), (ref, ref_labels, None), (ref, ref_labels, position)]:
        args = (features, labels, r, rl, 0.4, 80.0, index, keep)
        torch.library.opcheck(torch.ops.circle._anchor_loss_forward.default, args, test_utils=tests)
        _, row_lse, diagonal_tiles = torch.ops.circle._anchor_loss_forward(*args)
        assert diagonal_tiles.shape == ((40 if keep and r is None else 0), 256)
        grad = torch.rand(40, device=device)
        for ref_grad in [False, True]:
            for tiles in ([None, diagonal_tiles] if keep and r is None else [None]):
                torch.library.opcheck(torch.ops.circle._anchor_loss_backward.default,
                                      (grad, features, labels, r, rl, row_lse, 0.4, 80.0, index, ref_grad, tiles),
                                      test_utils=tests)
        if r is not None:
            torch.library.opcheck(torch.ops.circle._anchor_loss_with_row_grads.default, args[:-1], test_utils=tests)


@pytest.mark.parametrize("batch", [1, 200, 600])
def test_kept_diagonal_tiles_are_the_tiles_of_s(batch):
    # The forward's diagonal tiles, which the backward reads in place of
    # forming them again, hold S on each block of 256 rows, zeros past a
    # short last block, and give the backward's gradient bit for bit.
    features, labels = make_inputs(batch, 24, 5, "cpu", torch.float64)
    _, row_lse, tiles = torch.ops.circle._anchor_loss_forward(features, labels, None, None, 0.4, 80.0, None, True)
    similarities = features @ features.T
    for first in range(0, batch, 256):
        rows = min(256, batch - first)
        block = tiles[first:first + rows]
        assert torch.allclose(block[:, :rows], similarities[first:first + rows, first:first + rows], rtol=0, atol=1e-14)
        assert torch.equal(block[:, rows:], torch.zeros_like(block[:, rows:]))
    grad = torch.rand(batch, dtype=torch.float64)
    kept = tiles.clone()
    with_tiles = torch.ops.circle._anchor_loss_backward(grad, features, labels, None, None, row_lse, 0.4, 80.0,
                                                        None, False, tiles)
    without = torch.ops.circle._anchor_loss_backward(grad, features, labels, None, None, row_lse, 0.4, 80.0)
    assert torch.equal(with_tiles[0], without[0])
    assert torch.equal(tiles, kept)  # read, not written


@pytest.mark.parametrize("ref_grad", [False, True])
def test_torch_compile_with_self_index(device, ref_grad):
    torch._dynamo.reset()

    def step(x, labels, bank, bank_labels, position):
        losses = circle_loss.anchor_loss(x, labels, bank, bank_labels, ref_self_index=position)
        return losses.sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for batch in (20, 33, 47):
        features, labels = make_inputs(batch, 16, 4, device)
        bank, bank_labels, position = memory_bank(features, labels, 90, 80)
        x_eager, x_comp = features.clone().requires_grad_(), features.clone().requires_grad_()
        bank_eager, bank_comp = bank.clone().requires_grad_(ref_grad), bank.clone().requires_grad_(ref_grad)
        eager = step(x_eager, labels, bank_eager, bank_labels, position)
        eager.backward()
        loss = compiled(x_comp, labels, bank_comp, bank_labels, position)
        loss.backward()
        torch.testing.assert_close(loss, eager, rtol=1e-6, atol=0)
        assert relative_error(x_comp.grad, x_eager.grad) <= TOLERANCE[torch.float32][1]
        if ref_grad:
            assert relative_error(bank_comp.grad, bank_eager.grad) <= TOLERANCE[torch.float32][1]
        else:
            assert bank_comp.grad is None


@pytest.mark.parametrize("case", ["self", "reference", "bank"])
def test_compiled_autograd(device, case):
    # Both autograd Functions are traceable: compiled autograd runs their
    # backward in its graph. "bank": references that need no gradient.
    torch._dynamo.reset()
    features, labels = make_inputs(90, 16, 6, device)
    ref, ref_labels = make_inputs(70, 16, 6, device)
    weights = torch.linspace(0.5, 1.5, 90, device=device)

    def grads(compiled):
        x = features.clone().requires_grad_()
        r = ref.clone().requires_grad_(case == "reference")
        args = (x, labels) if case == "self" else (x, labels, r, ref_labels)
        backward((torch.ops.circle.anchor_loss(*args) * weights).sum(), compiled)
        return x.grad, r.grad

    (x_eager, r_eager), (x_comp, r_comp) = grads(False), grads(True)
    torch.testing.assert_close(x_comp, x_eager)
    if case == "reference":
        torch.testing.assert_close(r_comp, r_eager)
    else:
        assert r_comp is None


@pytest.mark.parametrize("with_ref", [False, True])
def test_torch_compile_fullgraph_dynamic(device, with_ref):
    torch._dynamo.reset()
    criterion = circle_loss.AnchorCircleLoss(margin=0.3, gamma=64.0)

    def step(x, labels, r, ref_labels):
        n = torch.nn.functional.normalize
        return criterion(n(x, dim=1), labels, None if r is None else n(r, dim=1), ref_labels)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for batch in (64, 97, 150):
        features, labels = make_inputs(batch, 24, 6, device, normalize=False)
        ref, ref_labels = make_inputs(batch + 10, 24, 6, device, normalize=False) if with_ref else (None, None)
        x_eager, x_comp = features.clone().requires_grad_(), features.clone().requires_grad_()
        eager = step(x_eager, labels, ref, ref_labels)
        eager.backward()
        loss = compiled(x_comp, labels, ref, ref_labels)
        loss.backward()
        torch.testing.assert_close(loss, eager, rtol=1e-6, atol=0)
        assert relative_error(x_comp.grad, x_eager.grad) <= TOLERANCE[torch.float32][1]


def test_torch_export_keeps_one_node(device):
    class Model(torch.nn.Module):
        def forward(self, x, labels, ref, ref_labels):
            return circle_loss.anchor_loss(x, labels, ref, ref_labels)

    batch = torch.export.Dim("batch", min=2)
    refs = torch.export.Dim("refs", min=2)
    features, labels = make_inputs(50, 8, 4, device)
    ref, ref_labels = make_inputs(70, 8, 4, device)
    program = torch.export.export(Model(), (features, labels, ref, ref_labels),
                                  dynamic_shapes=({0: batch}, {0: batch}, {0: refs}, {0: refs}))
    nodes = [n for n in program.graph.nodes if n.op == "call_function"]
    assert [str(n.target) for n in nodes] == ["circle.anchor_loss.default"]
    features, labels = make_inputs(80, 8, 4, device)
    ref, ref_labels = make_inputs(33, 8, 4, device)
    torch.testing.assert_close(program.module()(features, labels, ref, ref_labels),
                               circle_loss.anchor_loss(features, labels, ref, ref_labels))


class Scripted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(10, 6)
        self.criterion = circle_loss.AnchorCircleLoss(margin=0.3, gamma=64.0)

    def forward(self, x: torch.Tensor, labels: torch.Tensor, bank: torch.Tensor, bank_labels: torch.Tensor):
        e = torch.nn.functional.normalize(self.linear(x), dim=1)
        return self.criterion(e, labels) + self.criterion(e, labels, bank, bank_labels)


def test_torchscript_saved_and_run_in_fresh_process(tmp_path, device):
    torch.manual_seed(0)
    module = Scripted().to(device)
    scripted = torch.jit.script(module)
    x, labels = torch.randn(25, 10, device=device), torch.arange(25, device=device) % 4
    bank, bank_labels = make_inputs(40, 6, 4, device)
    expected = module(x, labels, bank, bank_labels)
    torch.testing.assert_close(scripted(x, labels, bank, bank_labels), expected)
    path = tmp_path / "scripted.pt"
    scripted.save(str(path))
    torch.save({"x": x.cpu(), "labels": labels.cpu(), "bank": bank.cpu(), "bank_labels": bank_labels.cpu()},
               tmp_path / "inputs.pt")
    code = f"""
        import torch
        torch.ops.load_library({circle_loss.library_path()!r})
        model = torch.jit.load({str(path)!r})
        d = {str(device)!r}
        inputs = {{k: v.to(d) for k, v in torch.load({str(tmp_path / "inputs.pt")!r}).items()}}
        loss = model(inputs["x"], inputs["labels"], inputs["bank"], inputs["bank_labels"])
        loss.backward()
        print(repr(float(loss)))
        """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize(
    "make_args,message",
    [
        (lambda f, y, r, ry: (f, y, r, None), "ref_features and ref_labels must be given together"),
        (lambda f, y, r, ry: (f, y, None, ry), "ref_features and ref_labels must be given together"),
        (lambda f, y, r, ry: (f, y, r[:, :4], ry), "ref_features must have the width D of features"),
        (lambda f, y, r, ry: (f, y, r.double(), ry), "ref_features must have the dtype of features"),
        (lambda f, y, r, ry: (f, y, r, ry[:-1]), "ref_labels must have one entry per row of ref_features"),
        (lambda f, y, r, ry: (f, y, r, ry.float()), "ref_labels must have an integer dtype"),
        (lambda f, y, r, ry: (f, y, r[0], ry), "ref_features must be a 2-D tensor"),
        (lambda f, y, r, ry: (f[0], y, r, ry), "features must be a 2-D tensor"),
        (lambda f, y, r, ry: (f, y[:-1], r, ry), "labels must have one entry per row of features"),
        (lambda f, y, r, ry: (f, None, r, ry), "labels must be a tensor"),
        (lambda f, y, r, ry: (f, y, None, None, 0.4, 80.0, y), "ref_self_index names rows of ref_features"),
        (lambda f, y, r, ry: (f, y, r, ry, 0.4, 80.0, y[:, None]), "ref_self_index must be a 1-D tensor"),
        (lambda f, y, r, ry: (f, y, r, ry, 0.4, 80.0, y.float()), "ref_self_index must have an integer dtype"),
        (lambda f, y, r, ry: (f, y, r, ry, 0.4, 80.0, ry), "ref_self_index must have one entry per row of features"),
    ],
)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_bad_input_is_named(device, make_args, message, requires_grad):
    features, labels = make_inputs(10, 8, 3, device)
    ref, ref_labels = make_inputs(12, 8, 3, device)
    features.requires_grad_(requires_grad)
    with pytest.raises(RuntimeError, match=f"circle::anchor_loss: {message}"):
        torch.ops.circle.anchor_loss(*make_args(features, labels, ref, ref_labels))


@pytest.mark.parametrize("name", ["margin", "gamma"])
def test_non_finite_scalars(device, name):
    features, labels = make_inputs(4, 3, 2, device)
    kwargs = {"margin": 0.4, "gamma": 80.0, name: float("inf")}
    with pytest.raises(RuntimeError, match=f"circle::anchor_loss: {name} must be a finite float"):
        torch.ops.circle.anchor_loss(features, labels, **kwargs)


def test_bad_diagonal_tiles_are_named(device):
    features, labels = make_inputs(10, 8, 3, device)
    ref, ref_labels = make_inputs(12, 8, 3, device)
    _, row_lse, _ = torch.ops.circle._anchor_loss_forward(features, labels, None, None, 0.4, 80.0)
    grad = torch.ones(10, device=device)
    prefix = "circle::_anchor_loss_backward: diagonal_tiles"
    for tiles, refs, message in [
        (torch.zeros(10, 8, device=device), (None, None), r"must have shape \(B, 256\) with B = 10"),
        (torch.zeros(10, 256, device=device, dtype=torch.float64), (None, None), "must be Float, got Double"),
        (torch.zeros(10, 256, device=device), (ref, ref_labels), "are tiles of S .* made without a reference set"),
    ]:
        with pytest.raises(RuntimeError, match=f"{prefix} {message}"):
            torch.ops.circle._anchor_loss_backward(grad, features, labels, *refs, row_lse, 0.4, 80.0, None, False,
                                                   tiles)
    if device.type == "cuda":
        with pytest.raises(RuntimeError, match="diagonal_tiles are kept by the CPU kernels only"):
            torch.ops.circle._anchor_loss_forward(features, labels, None, None, 0.4, 80.0, None, True)
        with pytest.raises(RuntimeError, match="diagonal_tiles are kept by the CPU kernels only"):
            torch.ops.circle._anchor_loss_backward(grad, features, labels, None, None, row_lse, 0.4, 80.0, None,
                                                   False, torch.zeros(10, 256, device=device))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reference_on_another_device():
    features, labels = make_inputs(10, 8, 3, "cuda")
    ref, ref_labels = make_inputs(12, 8, 3, "cpu")
    with pytest.raises(RuntimeError, match="ref_features must be on the device of features"):
        torch.ops.circle.anchor_loss(features, labels, ref, ref_labels)
    ref, ref_labels = ref.cuda(), ref_labels.cuda()
    with pytest.raises(RuntimeError, match="ref_self_index must be on the device of features"):
        torch.ops.circle.anchor_loss(features, labels, ref, ref_labels, ref_self_index=torch.arange(10))


def test_double_backward_and_forward_ad_are_refused(device):
    features, labels = make_inputs(16, 8, 3, device)
    x = features.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(torch.ops.circle.anchor_loss(x, labels).sum(), x, create_graph=True)
    ref, ref_labels = make_inputs(20, 8, 3, device)
    with pytest.raises(RuntimeError, match="does not support double backward"):  # the bank's path
        torch.autograd.grad(torch.ops.circle.anchor_loss(x, labels, ref, ref_labels).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="does not support forward-mode AD"):
        torch.func.jvp(lambda f: torch.ops.circle.anchor_loss(f, labels), (features,), (torch.randn_like(features),))


def test_autocast_leaves_the_op_alone(device):
    features, labels = make_inputs(300, 16, 5, device)
    plain = torch.ops.circle.anchor_loss(features, labels)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        cast = torch.ops.circle.anchor_loss(features, labels)
    assert torch.equal(cast, plain)


@pytest.mark.parametrize("label_dtype", [torch.int8, torch.uint8, torch.int32, torch.int64])
def test_any_integer_labels(device, label_dtype):
    features, labels = make_inputs(90, 8, 4, device)
    ref, ref_labels = make_inputs(40, 8, 4, device)
    op = torch.ops.circle.anchor_loss
    expected = (op(features, labels), op(features, labels, ref, ref_labels))
    got = (op(features, labels.to(label_dtype)), op(features, labels.to(label_dtype), ref, ref_labels.to(label_dtype)))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
