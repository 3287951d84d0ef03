"""circle::loss (and circle::anchor_loss) in PyTorch's other modes: autocast,
forward-mode AD, and values at the edge of the float range. Each gives the right answer or a
clear error, never a crash or a silent zero."""

import pytest
import torch
from torch.autograd import forward_ad as fwAD

import circle_loss
from conftest import make_inputs
from reference import (
    TOLERANCE,
    anchor_reference_and_grads,
    circle_loss_reference,
    reference_loss_and_grad,
    relative_error,
)

AUTOCAST_DTYPES = [torch.bfloat16, torch.float16]
FEATURE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("autocast_dtype", AUTOCAST_DTYPES)
@pytest.mark.parametrize("dtype", FEATURE_DTYPES)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_autocast_gives_the_loss_of_the_inputs_as_given(device, autocast_dtype, dtype, requires_grad):
    # Batches on both sides of the CUDA small-batch limit.
    for batch in (96, 600):
        features, labels = make_inputs(batch, 32, 6, device, dtype)
        x_plain = features.clone().requires_grad_(requires_grad)
        x_cast = features.clone().requires_grad_(requires_grad)
        plain = torch.ops.circle.loss(x_plain, labels, 0.25, 64.0)
        with torch.autocast(device.type, dtype=autocast_dtype):
            cast = torch.ops.circle.loss(x_cast, labels, 0.25, 64.0)
        assert cast.dtype == dtype
        assert torch.equal(cast, plain)
        if requires_grad:
            plain.backward()
            cast.backward()
            assert torch.equal(x_cast.grad, x_plain.grad)


def test_autocast_inside_a_mixed_precision_step(device):
    # The usual pattern: the encoder runs in low precision, the loss takes its output.
    torch.manual_seed(0)
    encoder = torch.nn.Linear(16, 8).to(device)
    x, labels = torch.randn(64, 16, device=device), torch.randint(0, 4, (64,), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        embeddings = torch.nn.functional.normalize(encoder(x), dim=1)
        loss = circle_loss.circle_loss(embeddings, labels, gamma=32.0)
    loss.backward()
    expected = circle_loss_reference(embeddings.detach(), labels, 0.25, 32.0)
    assert relative_error(loss, expected) <= TOLERANCE[embeddings.dtype][0]
    assert torch.isfinite(encoder.weight.grad).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_forward_mode_ad_gives_the_directional_derivative(device, dtype):
    features, labels = make_inputs(120, 16, 5, device, dtype)
    tangent = torch.randn_like(features)
    _, ref_grad = reference_loss_and_grad(features, labels, 0.25, 64.0)
    expected = (ref_grad.cpu() * tangent.double().cpu()).sum()
    tol = 10 * TOLERANCE[dtype][1]
    op = lambda f: torch.ops.circle.loss(f, labels, 0.25, 64.0)  # noqa: E731

    _, jvp = torch.func.jvp(op, (features,), (tangent,))
    assert relative_error(jvp, expected) <= tol
    jacobian = torch.func.jacfwd(op)(features)
    assert relative_error(jacobian, ref_grad) <= tol
    with fwAD.dual_level():
        loss = op(fwAD.make_dual(features, tangent))
        assert relative_error(fwAD.unpack_dual(loss).tangent, expected) <= tol
        # Forward and reverse mode together: the tangent, and a backward that still works.
        x = features.clone().requires_grad_()
        loss = op(fwAD.make_dual(x, tangent))
        assert relative_error(fwAD.unpack_dual(loss).tangent, expected) <= tol
        loss.backward()
    assert relative_error(x.grad, ref_grad) <= TOLERANCE[dtype][1] * 4


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_anchor_forward_mode_ad_against_a_reference_set(device, dtype):
    # Each L_i depends on row i alone: its tangent is <dL_i/dq_i, tangent_i>.
    features, labels = make_inputs(60, 16, 5, device, dtype)
    bank, bank_labels = make_inputs(90, 16, 5, device, dtype)
    copies = torch.arange(60, device=device) + 20  # the bank's rows 20..79 as the anchors' own copies
    tangent = torch.randn_like(features)
    _, row_grads, _ = anchor_reference_and_grads(features, labels, bank, bank_labels, ref_self_index=copies)
    expected = (row_grads * tangent.double()).sum(1)
    tol = 10 * TOLERANCE[dtype][1]
    op = lambda f: torch.ops.circle.anchor_loss(f, labels, bank, bank_labels, 0.4, 80.0, copies)  # noqa: E731

    _, jvp = torch.func.jvp(op, (features,), (tangent,))
    assert jvp.dtype == dtype and relative_error(jvp, expected) <= tol
    jacobian = torch.func.jacfwd(op)(features)  # (B, B, D): row i's gradient on the diagonal block
    assert relative_error(jacobian, torch.diag_embed(row_grads.T).permute(1, 2, 0)) <= tol
    with fwAD.dual_level():
        x = features.clone().requires_grad_()  # forward and reverse mode together
        losses = op(fwAD.make_dual(x, tangent))
        assert relative_error(fwAD.unpack_dual(losses).tangent, expected) <= tol
        losses.sum().backward()
    assert relative_error(x.grad, row_grads) <= TOLERANCE[dtype][1] * 4
    with pytest.raises(RuntimeError, match="does not support forward-mode AD"):  # a tangent of the references
        torch.func.jvp(lambda r: torch.ops.circle.anchor_loss(features, labels, r, bank_labels), (bank,),
                       (torch.randn_like(bank),))


def test_overflowing_logits_give_inf_as_the_reference_does(device):
    features, labels = make_inputs(50, 8, 3, device)
    for gamma in (8e37, 1e38, 1e30):
        loss = torch.ops.circle.loss(features, labels, 0.25, gamma)
        expected = circle_loss_reference(features, labels, 0.25, gamma).to(torch.float32)
        if torch.isinf(expected):
            assert torch.isinf(loss) and loss > 0, (gamma, loss)
        else:
            assert relative_error(loss, expected) <= 1e-4, (gamma, loss, expected)


@pytest.fixture
def two_threads_at_least():
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, 2))
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("two_threads_at_least")
def test_kernels_record_no_autograd_history(device):
    # The CPU kernels run ATen ops on worker threads, which must see the
    # caller's no-grad state: an output that requires grad here would carry a
    # graph of the kernel's own tile GEMMs.
    features, labels = make_inputs(700, 16, 7, device)
    refs, ref_labels = make_inputs(600, 16, 7, device)
    q = features.clone().requires_grad_()
    r = refs.clone().requires_grad_()
    with torch.no_grad():
        outputs = list(torch.ops.circle._loss_with_grad(q, labels, 0.25, 64.0))
        scalars = torch.ops.circle._lse_finish(torch.ops.circle._lse_partials(q, labels, r, ref_labels, 0.25, 64.0)[None])
        outputs.append(torch.ops.circle._block_grad(q, labels, r, ref_labels, scalars, 0.25, 64.0))
        for ref, ref_y in ((None, None), (r, ref_labels)):
            keep = device.type == "cpu"
            losses, row_lse, tiles = torch.ops.circle._anchor_loss_forward(q, labels, ref, ref_y, 0.4, 80.0, None, keep)
            outputs += [losses, row_lse, tiles]
            outputs += torch.ops.circle._anchor_loss_backward(torch.ones_like(losses), q, labels, ref, ref_y, row_lse,
                                                              0.4, 80.0, None, True, tiles if keep and ref is None else None)
        outputs += torch.ops.circle._anchor_loss_with_row_grads(q, labels, r, ref_labels, 0.4, 80.0)
    assert not any(out.requires_grad for out in outputs)


# torch.func's reverse mode: the package's functions and modules run it (the
# ops' C++ autograd kernels cannot), with the gradients backward() gives.
def _func_cases(features, labels, ref, ref_labels):
    return {
        "circle_loss": lambda f: circle_loss.circle_loss(f, labels, 0.25, 64.0),
        "CircleLoss": lambda f: circle_loss.CircleLoss(0.25, 64.0)(f, labels),
        "anchor_loss": lambda f: circle_loss.anchor_loss(f, labels).sum(),
        "anchor_loss_against_refs": lambda f: circle_loss.anchor_loss(f, labels, ref, ref_labels).sum(),
        "anchor_loss_of_refs": lambda r: circle_loss.anchor_loss(features, labels, r, ref_labels).sum(),
        "AnchorCircleLoss": lambda f: circle_loss.AnchorCircleLoss()(f, labels),
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_func_reverse_mode(device, dtype):
    features, labels = make_inputs(70, 12, 4, device, dtype)
    ref, ref_labels = make_inputs(50, 12, 4, device, dtype)
    # The same kernels, so the same bits; except against references without
    # a gradient on CUDA, where backward() takes the row gradients made in
    # the forward and torch.func the backward kernel, which sum in another
    # order.
    rtol = 0 if device.type == "cpu" else {torch.float64: 1e-12, torch.float32: 1e-5}[dtype]

    def same(a, b):
        return torch.allclose(a, b, rtol=rtol, atol=rtol * b.abs().max().item())

    for name, fn in _func_cases(features, labels, ref, ref_labels).items():
        x = (ref if name == "anchor_loss_of_refs" else features).clone()
        leaf = x.clone().requires_grad_()
        fn(leaf).backward()
        expected = leaf.grad
        assert same(torch.func.grad(fn)(x), expected), name
        value, pullback = torch.func.vjp(fn, x)
        assert torch.equal(value, fn(x)) and same(pullback(torch.ones_like(value))[0], expected), name
        assert same(torch.func.jacrev(fn)(x), expected), name
        batched = torch.func.vmap(torch.func.grad(fn))(torch.stack([x, x.flip(1)]))
        assert same(batched[0], expected), name
        flipped = x.flip(1).clone().requires_grad_()
        fn(flipped).backward()
        assert same(batched[1], flipped.grad), name


def test_torch_func_jacrev_of_the_rows(device):
    # Each row's loss against every feature: the Jacobian (B, B, D), row i's
    # gradient in its own slice, as backward gives it one row at a time.
    features, labels = make_inputs(20, 6, 3, device, torch.float64)
    jacobian = torch.func.jacrev(lambda f: circle_loss.anchor_loss(f, labels))(features)
    for i in (0, 7, 19):
        leaf = features.clone().requires_grad_()
        circle_loss.anchor_loss(leaf, labels)[i].backward()
        assert torch.allclose(jacobian[i], leaf.grad, rtol=1e-12, atol=1e-14)


def test_torch_func_second_derivatives_are_refused(device):
    features, labels = make_inputs(30, 6, 3, device, torch.float64)
    one = torch.ones((), dtype=torch.float64, device=device)
    for name, fn in _func_cases(features, labels, features.flip(0), labels.flip(0)).items():
        op = "circle::loss" if "ircle" in name and "Anchor" not in name else "circle::anchor_loss"
        twice = [
            lambda: torch.func.grad(lambda f: torch.func.grad(fn)(f).sum())(features),
            lambda: torch.func.vjp(lambda f: torch.func.vjp(fn, f)[1](one)[0].sum(), features)[1](one),
            lambda: torch.func.grad(lambda f: torch.func.vmap(torch.func.grad(fn))(torch.stack([f, f])).sum())(features),
        ]
        for call in twice:
            with pytest.raises(RuntimeError, match=f"{op} does not support double backward"):
                call()


def test_torch_func_on_the_raw_ops_names_the_way_out(device):
    features, labels = make_inputs(10, 4, 2, device)
    for op, fn in (("circle::loss", lambda f: torch.ops.circle.loss(f, labels)),
                   ("circle::anchor_loss", lambda f: torch.ops.circle.anchor_loss(f, labels).sum())):
        with pytest.raises(RuntimeError, match=f"{op}: torch.func's reverse mode .* Call circle_loss"):
            torch.func.grad(fn)(features)


def test_torch_func_forward_over_reverse_is_refused(device):
    features, labels = make_inputs(12, 4, 2, device, torch.float64)
    for op, fn in (("circle::loss", lambda f: circle_loss.circle_loss(f, labels)),
                   ("circle::anchor_loss", lambda f: circle_loss.anchor_loss(f, labels).sum())):
        with pytest.raises(RuntimeError, match=f"{op}: forward-mode AD .* of a reverse-mode torch.func transform"):
            torch.func.hessian(fn)(features)
