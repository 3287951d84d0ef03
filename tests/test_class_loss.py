"""circle::class_loss, the class-level form (docs/math.md): against the float64
reference written from the math, against fast-reid's CircleSoftmax arithmetic
and against anchor_loss with the class weights; as a custom operator (opcheck,
TorchScript, compile, export); the modules; memory that never holds B × C."""

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import circle_loss
from conftest import backward, make_inputs
from reference import (
    FLOAT32_YARDSTICK_FACTOR,
    TOLERANCE,
    class_reference_and_grads,
    relative_error,
)

OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def make_classes(classes, dim, device, dtype=torch.float32):
    weight = torch.nn.functional.normalize(torch.randn(classes, dim, dtype=torch.float64), dim=1)
    return weight.to(device=device, dtype=dtype)


def run_class(features, labels, weight, margin=0.25, gamma=256.0, weights=None):
    """The op's losses and the gradients of Σ weights_i · L_i."""
    f = features.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    losses = torch.ops.circle.class_loss(f, labels, w, margin, gamma)
    g = torch.ones_like(losses) if weights is None else weights.to(losses.dtype)
    (losses * g).sum().backward()
    return losses.detach(), f.grad, w.grad


def assert_class_matches_reference(features, labels, weight, margin=0.25, gamma=256.0, weights=None):
    dtype = features.dtype
    losses, grad_f, grad_w = run_class(features, labels, weight, margin, gamma, weights)
    ref_losses, ref_f, ref_w = class_reference_and_grads(features, labels, weight, margin, gamma, weights)
    loss_tol, grad_tol = TOLERANCE[dtype]
    if dtype == torch.float32:
        # Below float64 gamma amplifies the rounding of S: held to a multiple
        # of plain float32 PyTorch's own error, as the other forms are.
        _, f32, w32 = class_reference_and_grads(features, labels, weight, margin, gamma, weights, torch.float32)
        grad_tol = max(grad_tol, FLOAT32_YARDSTICK_FACTOR * max(relative_error(f32, ref_f), relative_error(w32, ref_w)))
    assert losses.dtype == dtype and losses.shape == labels.shape
    assert torch.isfinite(losses).all()
    assert relative_error(losses, ref_losses) <= loss_tol, (losses, ref_losses)
    assert relative_error(grad_f, ref_f, floor=1e-30) <= grad_tol
    assert relative_error(grad_w, ref_w, floor=1e-30) <= grad_tol


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("batch,classes,dim", [(1, 1, 4), (1, 2, 4), (5, 3, 8), (37, 300, 16), (300, 1, 8),
                                               (257, 513, 12), (64, 10_000, 8), (520, 260, 3)])
def test_matches_reference(device, dtype, batch, classes, dim):
    features, _ = make_inputs(batch, dim, 1, device, dtype)
    labels = torch.randint(0, classes, (batch,), device=device)
    weights = torch.rand(batch, device=device, dtype=dtype) + 0.5  # an incoming gradient that is not all ones
    assert_class_matches_reference(features, labels, make_classes(classes, dim, device, dtype), 0.25, 64.0, weights)


@pytest.mark.parametrize("margin,gamma", [(0.25, 256.0), (0.1, 16.0), (0.4, -3.0), (0.0, 0.0), (0.35, 64.0)])
def test_margin_and_gamma(device, margin, gamma):
    features, _ = make_inputs(90, 16, 1, device, torch.float64)
    labels = torch.randint(0, 40, (90,), device=device)
    assert_class_matches_reference(features, labels, make_classes(40, 16, device, torch.float64), margin, gamma)


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(device, dtype):
    features, _ = make_inputs(70, 16, 1, device, dtype)
    labels = torch.randint(0, 90, (70,), device=device)
    assert_class_matches_reference(features, labels, make_classes(90, 16, device, dtype), 0.25, 32.0)


def test_labels_outside_the_classes_leave_a_row_without_loss(device):
    # As SPEC: no positive, L_i = 0 and no gradient from that row.
    features, _ = make_inputs(30, 8, 1, device, torch.float64)
    weight = make_classes(20, 8, device, torch.float64)
    labels = torch.randint(0, 20, (30,), device=device)
    labels[::4] = torch.tensor([-1, 20, 1000, -7, 20, 33, -1, 21], device=device)[: len(labels[::4])]
    losses, grad_f, _ = run_class(features, labels, weight)
    assert (losses[::4] == 0).all() and (grad_f[::4] == 0).all()
    assert_class_matches_reference(features, labels, weight)


@pytest.mark.parametrize("label_dtype", [torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8])
def test_any_integer_labels(device, label_dtype):
    features, _ = make_inputs(40, 8, 1, device)
    weight = make_classes(100, 8, device)
    labels = torch.randint(0, 100, (40,), device=device)
    expected = torch.ops.circle.class_loss(features, labels, weight)
    assert torch.equal(torch.ops.circle.class_loss(features, labels.to(label_dtype), weight), expected)


def test_equals_anchor_loss_against_the_classes(device):
    features, _ = make_inputs(150, 16, 1, device, torch.float64)
    weight = make_classes(700, 16, device, torch.float64)
    labels = torch.randint(0, 700, (150,), device=device)
    weights = torch.rand(150, device=device, dtype=torch.float64)
    ours = run_class(features, labels, weight, 0.25, 64.0, weights)
    f, w = features.clone().requires_grad_(), weight.clone().requires_grad_()
    theirs = torch.ops.circle.anchor_loss(f, labels, w, torch.arange(700, device=device), 0.25, 64.0)
    (theirs * weights).sum().backward()
    for a, b in zip(ours, (theirs.detach(), f.grad, w.grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def circle_softmax(features, targets, weight, scale, margin):
    """fast-reid's CircleSoftmax, written out: cosine logits, alphas detached,
    the target's logit s_p, the others s_n, then cross-entropy (mean)."""
    sim_mat = F.linear(F.normalize(features), F.normalize(weight))
    alpha_p = torch.clamp_min(-sim_mat.detach() + 1 + margin, min=0.0)
    alpha_n = torch.clamp_min(sim_mat.detach() + margin, min=0.0)
    s_p = scale * alpha_p * (sim_mat - (1 - margin))
    s_n = scale * alpha_n * (sim_mat - margin)
    one_hot = F.one_hot(targets, num_classes=weight.shape[0]).to(sim_mat.dtype)
    return F.cross_entropy(one_hot * s_p + (1.0 - one_hot) * s_n, targets)


@pytest.mark.parametrize("scale,margin", [(64.0, 0.35), (256.0, 0.25), (128.0, 0.25)])
def test_matches_fast_reid_circle_softmax(device, scale, margin):
    torch.manual_seed(torch.seed() % 2**31)
    head = circle_loss.ClassCircleLoss(500, 32, margin=margin, gamma=scale).to(device).double()
    embeddings = torch.randn(96, 32, device=device, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 500, (96,), device=device)
    ours = head(embeddings, labels)
    ours.backward()
    grads = (embeddings.grad.clone(), head.weight.grad.clone())
    embeddings.grad = None
    head.weight.grad = None
    theirs = circle_softmax(embeddings, labels, head.weight, scale, margin)
    theirs.backward()
    assert relative_error(ours, theirs) <= 1e-10
    assert relative_error(grads[0], embeddings.grad) <= 1e-9
    assert relative_error(grads[1], head.weight.grad) <= 1e-9


@pytest.mark.sanitize
def test_gradients_as_asked(device):
    # features alone, weight alone (frozen proxies), both, neither.
    features, _ = make_inputs(40, 8, 1, device, torch.float64)
    weight = make_classes(30, 8, device, torch.float64)
    labels = torch.randint(0, 30, (40,), device=device)
    _, ref_f, ref_w = class_reference_and_grads(features, labels, weight)
    for f_grad, w_grad in [(True, False), (False, True), (True, True), (False, False)]:
        f = features.clone().requires_grad_(f_grad)
        w = weight.clone().requires_grad_(w_grad)
        losses = torch.ops.circle.class_loss(f, labels, w)
        if not (f_grad or w_grad):
            assert losses.grad_fn is None
            continue
        losses.sum().backward()
        assert (f.grad is not None) == f_grad and (w.grad is not None) == w_grad
        if f_grad:
            assert relative_error(f.grad, ref_f) <= 1e-10
        if w_grad:
            assert relative_error(w.grad, ref_w) <= 1e-10


@pytest.mark.parametrize("normalize,indexed", [(False, False), (True, True)])
def test_bitwise_deterministic_for_any_thread_count(device, normalize, indexed):
    features, _ = make_inputs(300, 16, 1, device)
    weight = make_classes(5000, 16, device)
    index = torch.arange(1, 5000, 2, device=device) if indexed else None
    labels = torch.randint(0, 5000 if index is None else len(index), (300,), device=device)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            f, w = features.clone().requires_grad_(), weight.clone().requires_grad_()
            losses = circle_loss.class_loss(f, labels, w, 0.25, 64.0, normalize=normalize, class_index=index)
            losses.sum().backward()
            results.append((losses, f.grad, w.grad))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(device, requires_grad):
    for batch, classes, dim in [(1, 1, 4), (37, 50, 16), (30, 300, 8)]:
        features, _ = make_inputs(batch, dim, 1, device)
        weight = make_classes(classes, dim, device).requires_grad_(requires_grad)
        features.requires_grad_(requires_grad)
        labels = torch.randint(0, classes, (batch,), device=device)
        for args in [(features, labels, weight), (features, labels, weight, 0.3, 32.0)]:
            torch.library.opcheck(torch.ops.circle.class_loss.default, args, test_utils=OPCHECK_TESTS)
        # Raw rows and classes normalised inside, through a class index, with
        # weights of another dtype.
        index = torch.sort(torch.randperm(classes, device=device)[: max(1, classes // 2)])[0]
        positions = torch.randint(0, len(index), (batch,), device=device)
        raw = (3 * features).detach().requires_grad_(requires_grad)
        for w in (weight, weight.detach().double().requires_grad_(requires_grad)):
            torch.library.opcheck(torch.ops.circle.class_loss.default, (raw, positions, w),
                                  {"normalize": True, "class_index": index}, test_utils=OPCHECK_TESTS)


def test_opcheck_internal_ops(device):
    features, _ = make_inputs(40, 8, 1, device)
    weight = make_classes(70, 8, device)
    labels = torch.randint(0, 70, (40,), device=device)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    index = torch.arange(0, 70, 3, device=device)
    for normalize, class_index in ((False, None), (True, index)):
        positions = labels if class_index is None else labels % len(index)
        args = (2 * features, positions, weight, 0.25, 64.0, normalize, class_index)
        torch.library.opcheck(torch.ops.circle._class_loss_forward.default, args, test_utils=tests)
        _, row_lse = torch.ops.circle._class_loss_forward(*args)
        for f_grad in (False, True):
            for w_grad in (False, True):
                torch.library.opcheck(
                    torch.ops.circle._class_loss_backward.default,
                    (torch.rand(40, device=device), *args[:3], row_lse, 0.25, 64.0, normalize, class_index, f_grad,
                     w_grad),
                    test_utils=tests)


def test_module_is_the_mean_of_the_normalised_op(device):
    head = circle_loss.ClassCircleLoss(120, 16, margin=0.3, gamma=64.0).to(device)
    embeddings = torch.randn(50, 16, device=device)
    labels = torch.randint(0, 120, (50,), device=device)
    expected = circle_loss.class_loss(F.normalize(embeddings, dim=1), labels, F.normalize(head.weight, dim=1),
                                      0.3, 64.0).mean()
    torch.testing.assert_close(head(embeddings, labels), expected)
    assert head(embeddings[:0], labels[:0]) == 0  # an empty batch: 0, not the NaN of an empty mean
    assert "num_classes=120, embedding_size=16" in repr(head)


def _single_process_heads(num_classes, dim, device):
    """The single-process head and the PML-shaped one, with the same
    float32 weights (each keeps them in its own layout)."""
    head = circle_loss.ClassCircleLoss(num_classes, dim, margin=0.25, gamma=64.0).to(device)
    pml_head = pytest.importorskip("circle_loss.pml").ClassCircleLoss(num_classes, dim, m=0.25, gamma=64.0).to(device)
    with torch.no_grad():
        pml_head.W.copy_(head.weight.t())
    return head, pml_head


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("autocast", [False, True])
def test_heads_train_float32_weights_from_half_precision_rows(device, dtype, autocast):
    # Mixed precision as face-recognition heads train: the backbone's rows in
    # half precision (or under autocast), the weights float32, their
    # gradient float32; against the float64 head.
    if device.type == "cpu" and dtype == torch.float16 and autocast:
        pytest.skip("CPU autocast runs bfloat16")
    head, pml_head = _single_process_heads(300, 32, device)
    embeddings = torch.randn(80, 32, dtype=torch.float64, device=device)
    labels = torch.randint(0, 300, (80,), device=device)
    exact = circle_loss.ClassCircleLoss(300, 32, margin=0.25, gamma=64.0).to(device).double()
    with torch.no_grad():
        exact.weight.copy_(head.weight)
    rows = embeddings.clone().requires_grad_()
    expected = exact(rows, labels)
    expected.backward()
    for module, weight, to_rows in ((head, head.weight, lambda g: g), (pml_head, pml_head.W, lambda g: g.t())):
        x = embeddings.float().requires_grad_()
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            projected = x @ torch.eye(32, device=device) if autocast else x.to(dtype)
            loss = module(projected, labels)
        loss.backward()
        assert weight.dtype == weight.grad.dtype == torch.float32
        assert relative_error(loss.double(), expected) <= 2 * torch.finfo(dtype).eps  # the returned value's rounding
        assert relative_error(x.grad.double(), rows.grad) <= 2e-2
        assert relative_error(to_rows(weight.grad).double(), exact.weight.grad) <= 2e-2


@pytest.mark.parametrize("embeddings,message", [
    (torch.randn(16), "embeddings must be a 2-D tensor"),
    (torch.randn(()), "embeddings must be a 2-D tensor"),
    (torch.randn(2, 3, 16), "embeddings must be a 2-D tensor"),
    (torch.zeros(4, 16, dtype=torch.long), "embeddings must be float32"),
    (torch.zeros(4, 16, dtype=torch.bool), "embeddings must be float32"),
])
def test_head_names_bad_embeddings(device, embeddings, message):
    head = circle_loss.ClassCircleLoss(10, 16).to(device)
    with pytest.raises(RuntimeError, match=f"circle_loss.ClassCircleLoss: {message}"):
        head(embeddings.to(device), torch.zeros(4, dtype=torch.long, device=device))
    with pytest.raises(torch.jit.Error, match=f"circle_loss.ClassCircleLoss: {message}"):  # TorchScript's type
        torch.jit.script(head)(embeddings.to(device), torch.zeros(4, dtype=torch.long, device=device))


def test_heads_refuse_labels_outside_the_classes(device):
    # A 1-indexed data set's label 10 of 10 classes, or a negative one: the
    # modules refuse them as cross_entropy does (the op itself keeps its rule).
    if device.type == "cuda":
        pytest.skip("on CUDA the refusal is a device-side assert, which ends the process's CUDA context")
    head, pml_head = _single_process_heads(10, 8, device)
    embeddings = torch.randn(4, 8, device=device)
    for labels in ([1, 2, 3, 10], [0, -1, 2, 3], [-100, 2, 3, 11]):
        y = torch.tensor(labels, device=device)
        with pytest.raises(RuntimeError, match=r"circle_loss.ClassCircleLoss: labels must lie in \[0, num_classes = 10\) "
                           r"or equal ignore_index = -100"):
            head(embeddings, y)
        with pytest.raises(torch.jit.Error, match=r"labels must lie in \[0, num_classes = 10\)"):
            torch.jit.script(head)(embeddings, y)
        with pytest.raises(RuntimeError, match=r"circle_loss.pml.ClassCircleLoss: labels must lie in \[0, num_classes = 10\)$"):
            pml_head(embeddings, y)
    with pytest.raises(RuntimeError, match="labels must lie"):
        torch.compile(head, fullgraph=True)(embeddings, torch.tensor([1, 2, 3, 10], device=device))
    with pytest.raises(RuntimeError, match="labels must lie"):
        pml_head(embeddings, torch.tensor([1, 2, 3, -100], device=device))  # PML's heads have no ignore_index


@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_ignored_rows_leave_the_mean(device, ignore_index):
    head = circle_loss.ClassCircleLoss(10, 8, ignore_index=ignore_index).to(device)
    embeddings = torch.randn(12, 8, device=device, requires_grad=True)
    labels = torch.randint(0, 10, (12,), device=device)
    labels[labels == 3] = 4
    labels[::4] = ignore_index
    kept = labels != ignore_index
    losses = circle_loss.class_loss(F.normalize(embeddings, dim=1), labels, F.normalize(head.weight, dim=1),
                                    head.margin, head.gamma)
    expected = losses[kept].mean()
    loss = head(embeddings, labels)
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss, embeddings)
    assert (grad[~kept] == 0).all() and (grad[kept] != 0).any()
    torch.testing.assert_close(torch.jit.script(head)(embeddings, labels), expected)
    everything_ignored = torch.full((12,), ignore_index, device=device)
    assert head(embeddings, everything_ignored) == 0


def test_module_scripted_compiled_exported(device, tmp_path):
    torch._dynamo.reset()
    head = circle_loss.ClassCircleLoss(64, 8, gamma=32.0).to(device)
    embeddings, labels = torch.randn(40, 8, device=device), torch.randint(0, 64, (40,), device=device)
    expected = head(embeddings, labels)
    scripted = torch.jit.script(head)
    torch.testing.assert_close(scripted(embeddings, labels), expected)
    path = tmp_path / "head.pt"
    scripted.save(str(path))
    torch.save({"e": embeddings.cpu(), "y": labels.cpu()}, tmp_path / "inputs.pt")
    code = f"""
        import torch
        torch.ops.load_library({circle_loss.library_path()!r})
        head = torch.jit.load({str(path)!r})
        inputs = torch.load({str(tmp_path / "inputs.pt")!r})
        loss = head(inputs["e"].to({str(device)!r}), inputs["y"].to({str(device)!r}))
        loss.backward()
        print(repr(float(loss)))
        """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == pytest.approx(expected.item(), rel=1e-6)
    compiled = torch.compile(head, fullgraph=True, dynamic=True)
    for batch in (40, 57):
        e, y = torch.randn(batch, 8, device=device), torch.randint(0, 64, (batch,), device=device)
        torch.testing.assert_close(compiled(e, y), head(e, y), rtol=1e-6, atol=0)
    batch = torch.export.Dim("batch", min=2)
    program = torch.export.export(head, (embeddings, labels), dynamic_shapes=({0: batch}, {0: batch}))
    assert [str(n.target) for n in program.graph.nodes if "circle" in str(n.target)] == [
        "circle.class_loss.default"]
    e, y = torch.randn(33, 8, device=device), torch.randint(0, 64, (33,), device=device)
    torch.testing.assert_close(program.module()(e, y), head(e, y))


def test_compiled_autograd(device):
    torch._dynamo.reset()
    features, _ = make_inputs(60, 8, 1, device)
    weight = make_classes(90, 8, device)
    labels = torch.randint(0, 90, (60,), device=device)

    def grads(compiled):
        f, w = features.clone().requires_grad_(), weight.clone().requires_grad_()
        backward(torch.ops.circle.class_loss(f, labels, w).sum(), compiled)
        return f.grad, w.grad

    for a, b in zip(grads(False), grads(True)):
        torch.testing.assert_close(a, b)


def test_torch_func_reverse_mode(device):
    features, _ = make_inputs(30, 8, 1, device, torch.float64)
    weight = make_classes(50, 8, device, torch.float64)
    labels = torch.randint(0, 50, (30,), device=device)
    _, ref_f, ref_w = class_reference_and_grads(features, labels, weight)
    grad_f, grad_w = torch.func.grad(lambda f, w: circle_loss.class_loss(f, labels, w).sum(), argnums=(0, 1))(
        features, weight)
    assert relative_error(grad_f, ref_f) <= 1e-10 and relative_error(grad_w, ref_w) <= 1e-10
    jacobian = torch.func.jacrev(lambda w: circle_loss.class_loss(features, labels, w))(weight)  # (B, C, D)
    assert relative_error(jacobian.sum(0), ref_w) <= 1e-10
    head = circle_loss.ClassCircleLoss(50, 8).to(device).double()
    params = dict(head.named_parameters())
    grads = torch.func.grad(lambda p, e: torch.func.functional_call(head, p, (e, labels)))(params, features)
    assert grads["weight"].shape == (50, 8)
    with pytest.raises(RuntimeError, match="circle::class_loss: torch.func's reverse mode .* Call circle_loss"):
        torch.func.grad(lambda f: torch.ops.circle.class_loss(f, labels, weight).sum())(features)
    with pytest.raises(RuntimeError, match="circle::class_loss does not support double backward"):
        torch.func.grad(lambda f: torch.func.grad(lambda g: circle_loss.class_loss(g, labels, weight).sum())(f).sum())(
            features)
    with pytest.raises(RuntimeError, match="circle::class_loss does not support forward-mode AD"):
        torch.func.jvp(lambda f: torch.ops.circle.class_loss(f, labels, weight), (features,), (features,))


def test_double_backward_is_refused(device):
    features, _ = make_inputs(20, 8, 1, device)
    weight = make_classes(10, 8, device).requires_grad_()
    labels = torch.randint(0, 10, (20,), device=device)
    loss = torch.ops.circle.class_loss(features, labels, weight).sum()
    with pytest.raises(RuntimeError, match="circle::class_loss does not support double backward"):
        torch.autograd.grad(loss, weight, create_graph=True)


@pytest.mark.parametrize(
    "make_args,message",
    [
        (lambda f, y, w: (f, y, w[:, :4]), "weight must have the width D of features"),
        (lambda f, y, w: (f, y, w.long()), "weight must be float32, float64, float16 or bfloat16"),
        (lambda f, y, w: (f, y, w[0]), "weight must be a 2-D tensor"),
        (lambda f, y, w: (f, y, None), "weight must be a tensor"),
        (lambda f, y, w: (f, y[:-1], w), "labels must have one entry per row of features"),
        (lambda f, y, w: (f, y.float(), w), "labels must have an integer dtype"),
        (lambda f, y, w: (f, None, w), "labels must be a tensor"),
        (lambda f, y, w: (f[0], y, w), "features must be a 2-D tensor"),
        (lambda f, y, w: (f.long(), y, w.long()), "features must be float32"),
        (lambda f, y, w: (f, y, w, 0.25, 1e39), "gamma = .* overflows float32"),
        (lambda f, y, w: (f, y, w, float("nan"), 64.0), "margin must be a finite float"),
    ],
)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_bad_input_is_named(device, make_args, message, requires_grad):
    features, _ = make_inputs(10, 8, 1, device)
    weight = make_classes(12, 8, device).requires_grad_(requires_grad)
    labels = torch.randint(0, 12, (10,), device=device)
    with pytest.raises(RuntimeError, match=f"circle::class_loss: {message}"):
        torch.ops.circle.class_loss(*make_args(features, labels, weight))


def test_memory_never_holds_batch_by_classes():
    # B = 256 rows against C = 400 000 classes: a B × C float32 matrix is
    # 410 MB. In a fresh process (so that no earlier peak hides it), forward
    # and backward together must not raise the peak resident memory by a
    # quarter of that.
    code = """
        import resource, torch, circle_loss
        torch.manual_seed(0)
        f = torch.nn.functional.normalize(torch.randn(256, 16), dim=1).requires_grad_()
        w = torch.nn.functional.normalize(torch.randn(400_000, 16), dim=1).requires_grad_()
        y = torch.randint(0, 400_000, (256,))
        circle_loss.class_loss(f[:8], y[:8], w[:1000]).sum().backward()  # warm the allocator and the libraries
        f.grad = w.grad = None
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        circle_loss.class_loss(f, y, w).sum().backward()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((after - before) * 1024)
        # Raw rows and classes normalised inside: beyond dW (C × D), no
        # normalised copy of W and no gradient of one.
        f.grad = w.grad = None
        before = after
        circle_loss.class_loss(3 * f.detach(), y, (2 * w).detach().requires_grad_(), normalize=True).sum().backward()
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
        """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    grown, grown_normalizing = (int(line) for line in out.stdout.split())
    assert grown < 256 * 400_000 * 4 / 4, f"peak grew by {grown / 2**20:.0f} MiB"
    # The scaled W (C × D) is an input of this step; its gradient is dW.
    assert grown_normalizing < 2.5 * 400_000 * 16 * 4, f"peak grew by {grown_normalizing / 2**20:.0f} MiB"


def raw_inputs(batch, classes, dim, device, dtype=torch.float64, degenerate=True):
    """Rows and classes of assorted norms, as normalize=True takes them;
    `degenerate`: a zero row and a class below normalize's eps among them
    (whose gradients, divided by eps, overflow half precision)."""
    features = torch.randn(batch, dim, dtype=torch.float64) * torch.rand(batch, 1, dtype=torch.float64) * 5
    weight = torch.randn(classes, dim, dtype=torch.float64) * torch.rand(classes, 1, dtype=torch.float64) * 5
    if degenerate:
        features[0] = 0
        weight[min(1, classes - 1)] = 1e-14  # divided by eps, no projection
    return features.to(device, dtype), weight.to(device, dtype)


def reference_of_cosines(features, labels, weight, class_index=None, margin=0.25, gamma=64.0, weights=None):
    """The float64 reference of the loss of normalize(features) against
    normalize(weight[class_index]), with its gradients at the raw inputs
    (normalize's own backward, through autograd)."""
    f = features.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    columns = w if class_index is None else w[class_index]
    losses, grad_fn, grad_cn = class_reference_and_grads(F.normalize(f, dim=1), labels, F.normalize(columns, dim=1),
                                                         margin, gamma, weights)
    grad_f, grad_w = torch.autograd.grad([F.normalize(f, dim=1), F.normalize(columns, dim=1)], [f, w],
                                         [grad_fn, grad_cn])
    return losses, grad_f, grad_w


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("batch,classes,dim", [(1, 1, 4), (37, 300, 16), (300, 2, 8), (1100, 700, 12)])
@pytest.mark.parametrize("indexed", [False, True])
def test_normalize_and_class_index_match_the_reference(device, dtype, batch, classes, dim, indexed):
    features, weight = raw_inputs(batch, classes, dim, device, dtype)
    index = torch.sort(torch.randperm(classes, device=device)[: max(1, classes // 3)])[0] if indexed else None
    columns = classes if index is None else len(index)
    labels = torch.randint(0, columns, (batch,), device=device)
    labels[batch // 2] = columns  # outside the columns: no positive, loss 0
    g = torch.rand(batch, dtype=torch.float64, device=device)
    f, w = features.clone().requires_grad_(), weight.clone().requires_grad_()
    losses = circle_loss.class_loss(f, labels, w, 0.25, 64.0, normalize=True, class_index=index)
    (losses * g.to(dtype)).sum().backward()
    ref_losses, ref_f, ref_w = reference_of_cosines(features, labels, weight, index, weights=g)
    loss_tol, grad_tol = TOLERANCE[dtype]
    if dtype == torch.float32:
        grad_tol = max(grad_tol, 1e-4)  # gamma = 64 times float32's rounding of S
    assert losses.dtype == dtype and losses[batch // 2] == 0
    assert relative_error(losses, ref_losses) <= loss_tol
    assert relative_error(f.grad, ref_f, floor=1e-30) <= grad_tol
    assert relative_error(w.grad, ref_w, floor=1e-30) <= grad_tol
    if index is not None:
        outside = torch.ones(classes, dtype=torch.bool, device=device)
        outside[index] = False
        assert (w.grad[outside] == 0).all()


@pytest.mark.parametrize("features_dtype,weight_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                                         (torch.float32, torch.float64), (torch.float64, torch.float32),
                                                         (torch.float32, torch.bfloat16)])
def test_weight_of_another_dtype(device, features_dtype, weight_dtype):
    # The weights enter at least at the rows' precision; each gradient comes
    # back in its own tensor's dtype.
    features, weight = raw_inputs(64, 90, 16, device, features_dtype, degenerate=False)
    weight = weight.to(weight_dtype)
    labels = torch.randint(0, 90, (64,), device=device)
    f, w = features.clone().requires_grad_(), weight.clone().requires_grad_()
    losses = circle_loss.class_loss(f, labels, w, 0.25, 64.0, normalize=True)
    losses.sum().backward()
    assert losses.dtype == features_dtype and f.grad.dtype == features_dtype and w.grad.dtype == weight_dtype
    ref_losses, ref_f, ref_w = reference_of_cosines(features, labels, weight)
    highest = max((features_dtype, weight_dtype), key=lambda d: torch.finfo(d).eps)
    loss_tol, grad_tol = TOLERANCE[highest if highest in (torch.float16, torch.bfloat16) else torch.float32]
    assert relative_error(losses.double(), ref_losses) <= loss_tol
    assert relative_error(f.grad.double(), ref_f, floor=1e-30) <= max(grad_tol, 1e-4)
    assert relative_error(w.grad.double(), ref_w, floor=1e-30) <= max(grad_tol, 1e-4)


@pytest.mark.parametrize("normalize", [False, True])
def test_weight_in_any_layout(device, normalize):
    # PML keeps its class weights as (D, C) and hands the op W.t(): the
    # same losses and gradients as from a contiguous copy, also through an
    # index.
    features, weight = raw_inputs(70, 300, 16, device, torch.float32, degenerate=False)
    labels = torch.randint(0, 100, (70,), device=device)
    index = torch.arange(0, 300, 3, device=device)
    results = []
    for transposed in (False, True):
        stored = weight.t().contiguous().requires_grad_() if transposed else weight.clone().requires_grad_()
        w = stored.t() if transposed else stored
        f = features.clone().requires_grad_()
        losses = circle_loss.class_loss(f, labels, w, 0.25, 64.0, normalize=normalize, class_index=index)
        losses.sum().backward()
        results.append((losses, f.grad, stored.grad.t() if transposed else stored.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make_index,message",
    [
        (lambda c: torch.tensor([0, 2, 2, 5]), r"class_index must be strictly increasing, with entries in \[0, C\) "
                                               r"\(C = 9\), got 2 at position 2 after 2"),
        (lambda c: torch.tensor([3, 1]), ".* got 1 at position 1 after 3"),
        (lambda c: torch.tensor([-1, 4]), ".* got -1 at position 0"),
        (lambda c: torch.tensor([4, 9]), ".* got 9 at position 1 after 4"),
        (lambda c: torch.tensor([[1, 2]]), "class_index must be a 1-D tensor of shape"),
        (lambda c: torch.tensor([1.0, 2.0]), "class_index must have an integer dtype"),
    ],
)
def test_bad_class_index_is_named(make_index, message):
    features, weight = raw_inputs(6, 9, 4, "cpu", torch.float32)
    labels = torch.zeros(6, dtype=torch.long)
    for requires_grad in (False, True):
        with pytest.raises(RuntimeError, match=f"circle::class_loss: {message}"):
            circle_loss.class_loss(features.requires_grad_(requires_grad), labels, weight, normalize=True,
                                   class_index=make_index(9))


def test_bad_class_index_is_a_device_side_assert_on_cuda(device):
    # On CUDA the values are checked on the device, with no host
    # synchronisation: the assert ends the process's CUDA context, so the
    # call runs in a process of its own.
    if device.type != "cuda":
        pytest.skip("on the CPU the index is refused at once (test_bad_class_index_is_named)")
    code = """
        import torch, circle_loss
        f, w = torch.randn(6, 4, device="cuda"), torch.randn(9, 4, device="cuda")
        circle_loss.class_loss(f, torch.zeros(6, dtype=torch.long, device="cuda"), w, normalize=True,
                               class_index=torch.tensor([0, 3, 3], device="cuda"))
        torch.cuda.synchronize()
        """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "device-side assert" in out.stderr, out.stderr


# Partial FC's class sampling (sample_rate < 1).

def test_sampled_classes_obey_the_rule(device):
    from circle_loss import _sampled_classes

    labels = torch.tensor([3, 7, 7, 42, -100, 3], device=device)
    for rate, size in ((0.1, 10), (0.25, 25), (0.02, 3), (1.0, 100)):
        kept, positions = _sampled_classes(labels, 100, rate)
        assert kept.numel() == size and torch.equal(kept, torch.unique(kept))  # exact size, ascending, no duplicates
        assert {3, 7, 42} <= set(kept.tolist())  # every positive
        valid = labels >= 0
        assert torch.equal(kept[positions[valid]], labels[valid]) and (positions[~valid] == -1).all()
    # Where the positives alone exceed int(rate · C), the positives alone.
    kept, _ = _sampled_classes(labels, 100, 0.01)
    assert kept.tolist() == [3, 7, 42]


def test_sampled_negatives_are_uniform(device):
    # 3 positives of 40 classes, 10 kept: 7 drawn from the 37 others, 4000
    # times; a chi-square test of their counts (fixed seed, so deterministic).
    from circle_loss import _sampled_classes

    torch.manual_seed(0)
    labels = torch.tensor([0, 1, 2], device=device)
    counts = torch.zeros(40, dtype=torch.float64)
    draws = 4000
    for _ in range(draws):
        kept, _ = _sampled_classes(labels, 40, 0.25)
        counts[kept.cpu()] += 1
    assert (counts[:3] == draws).all()
    expected = draws * 7 / 37
    chi_square = ((counts[3:] - expected) ** 2 / expected).sum().item()
    assert chi_square < 69.3, chi_square  # the 0.1% point of chi-square with 36 degrees of freedom


@pytest.mark.parametrize("sample_rate", [0.1, 0.3])
def test_sampled_head_matches_the_reference_on_its_kept_classes(device, sample_rate):
    from reference import class_loss_reference

    head = circle_loss.ClassCircleLoss(500, 16, margin=0.25, gamma=64.0, sample_rate=sample_rate).to(device).double()
    embeddings = torch.randn(60, 16, dtype=torch.float64, device=device, requires_grad=True)
    labels = torch.randint(0, 500, (60,), device=device)
    labels[::7] = -100
    loss = head(embeddings, labels)
    loss.backward()
    kept = head.last_kept
    rows = labels != -100
    # int(rate · C) classes, or the positives alone where they are more (51
    # rows may hold 51 distinct labels).
    assert kept.numel() == max(int(sample_rate * 500), labels[rows].unique().numel())
    # The float64 reference: the kept rows against the kept classes alone.
    positions = torch.searchsorted(kept, labels[rows])
    assert torch.equal(kept[positions], labels[rows])
    e = embeddings.detach().clone().requires_grad_()
    w = head.weight.detach().clone().requires_grad_()
    expected = class_loss_reference(F.normalize(e[rows], dim=1), positions, F.normalize(w[kept], dim=1),
                                    0.25, 64.0).mean()
    expected.backward()
    assert relative_error(loss, expected) <= 1e-10
    assert relative_error(embeddings.grad, e.grad) <= 1e-9
    assert relative_error(head.weight.grad, w.grad) <= 1e-9
    others = torch.ones(500, dtype=torch.bool, device=device)
    others[kept] = False
    assert (head.weight.grad[others] == 0).all()  # exactly: a sparse step may skip them


def test_sampled_heads_script_compile_and_refuse_bad_rates(device):
    head = circle_loss.ClassCircleLoss(300, 8, sample_rate=0.2).to(device)
    embeddings, labels = torch.randn(32, 8, device=device), torch.randint(0, 300, (32,), device=device)
    torch.manual_seed(1)
    expected = head(embeddings, labels)
    kept = head.last_kept.clone()
    torch.manual_seed(1)  # torch's generator: the same seed, the same classes
    torch.testing.assert_close(torch.jit.script(head)(embeddings, labels), expected)
    with torch._inductor.config.patch(fallback_random=True):  # eager's random numbers under compile
        torch.manual_seed(1)
        torch.testing.assert_close(torch.compile(head)(embeddings, labels), expected)
    assert torch.equal(head.last_kept, kept)
    pml_head = pytest.importorskip("circle_loss.pml").ClassCircleLoss(300, 8, sample_rate=0.2).to(device)
    with torch.no_grad():
        pml_head.W.copy_(head.weight.t())
    torch.manual_seed(1)
    torch.testing.assert_close(pml_head(embeddings, labels), expected)
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"circle_loss.ClassCircleLoss: sample_rate must lie in \(0, 1\]"):
            circle_loss.ClassCircleLoss(10, 4, sample_rate=bad)
        with pytest.raises(ValueError, match=r"circle_loss.pml.ClassCircleLoss: sample_rate must lie in \(0, 1\]"):
            pml_head.__class__(10, 4, sample_rate=bad)


def test_sampled_head_gives_a_sparse_gradient_when_asked(device):
    # sparse_grad=True: the kept rows' gradient as a sparse tensor (no dense
    # (C, D) one), the dense run's values; SGD steps on it.
    dense = circle_loss.ClassCircleLoss(400, 8, sample_rate=0.1).to(device).double()
    sparse = circle_loss.ClassCircleLoss(400, 8, sample_rate=0.1, sparse_grad=True).to(device).double()
    with torch.no_grad():
        sparse.weight.copy_(dense.weight)
    embeddings, labels = torch.randn(30, 8, dtype=torch.float64, device=device), torch.randint(0, 400, (30,), device=device)
    for head in (dense, sparse):
        torch.manual_seed(2)
        head(embeddings, labels).backward()
    assert sparse.weight.grad.is_sparse and not dense.weight.grad.is_sparse
    assert sparse.weight.grad.coalesce().indices().numel() <= 40  # the kept rows alone
    torch.testing.assert_close(sparse.weight.grad.to_dense(), dense.weight.grad, rtol=1e-12, atol=0)
    before = sparse.weight.detach().clone()
    torch.optim.SGD(sparse.parameters(), lr=0.1).step()
    torch.testing.assert_close(sparse.weight.detach(), before - 0.1 * dense.weight.grad, rtol=1e-12, atol=1e-15)
