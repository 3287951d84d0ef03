"""Bad input gets a clear error naming the argument, never a crash or a wrong answer."""

import math
import subprocess
import sys
import textwrap

import pytest
import torch

import circle_loss
from conftest import make_inputs
from reference import anchor_loss_reference, circle_loss_reference, relative_error


def loss(features, labels, margin=0.25, gamma=256.0):
    return torch.ops.circle.loss(features, labels, margin, gamma)


@pytest.mark.parametrize(
    "features,labels,message",
    [
        (torch.randn(4), torch.zeros(4, dtype=torch.long), "features must be a 2-D tensor"),
        (torch.randn(2, 4, 3), torch.zeros(2, dtype=torch.long), "features must be a 2-D tensor"),
        (torch.zeros(4, 3, dtype=torch.long), torch.zeros(4, dtype=torch.long), "features must be float32"),
        (torch.randn(4, 3, dtype=torch.complex64), torch.zeros(4, dtype=torch.long), "features must be float32"),
        (torch.randn(4, 3), torch.zeros(4, 1, dtype=torch.long), "labels must be a 1-D tensor"),
        (torch.randn(4, 3), torch.zeros(4), "labels must have an integer dtype"),
        (torch.randn(4, 3), torch.zeros(4, dtype=torch.bool), "labels must have an integer dtype"),
        (torch.randn(4, 3), torch.zeros(5, dtype=torch.long), "labels must have one entry per row"),
    ],
)
def test_bad_tensors(device, features, labels, message):
    with pytest.raises(RuntimeError, match=message):
        loss(features.to(device), labels.to(device))


@pytest.mark.parametrize("name", ["margin", "gamma"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_scalars(device, name, value):
    features, labels = make_inputs(4, 3, 2, device)
    kwargs = {"margin": 0.25, "gamma": 256.0, name: value}
    with pytest.raises(RuntimeError, match=f"{name} must be a finite float"):
        loss(features, labels, **kwargs)


def test_errors_also_on_the_gradient_path(device):
    features = torch.randn(4, 3, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="labels must have one entry per row"):
        loss(features, torch.zeros(3, dtype=torch.long, device=device))


def test_errors_on_meta_tensors():
    with pytest.raises(RuntimeError, match="labels must have one entry per row"):
        loss(torch.empty(4, 3, device="meta"), torch.empty(5, dtype=torch.long, device="meta"))
    assert loss(torch.empty(4, 3, device="meta"), torch.empty(4, dtype=torch.long, device="meta")).shape == ()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("features_device,labels_device", [("cuda", "cpu"), ("cpu", "cuda")])
def test_mixed_devices(features_device, labels_device):
    features, labels = make_inputs(4, 3, 2, "cpu")
    with pytest.raises(RuntimeError, match="labels must be on the same device as features"):
        loss(features.to(features_device), labels.to(labels_device))


def test_double_backward_is_refused(device):
    features, labels = make_inputs(16, 8, 3, device)
    features.requires_grad_()
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(loss(features, labels), features, create_graph=True)


def test_missing_arguments_are_named():
    with pytest.raises(RuntimeError, match="labels"):
        torch.ops.circle.loss(torch.randn(3, 2))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_none_arguments_are_named(device, requires_grad):
    features, labels = make_inputs(4, 3, 2, device)
    features.requires_grad_(requires_grad)
    with pytest.raises(RuntimeError, match="labels must be a tensor of shape"):
        torch.ops.circle.loss(features, None)
    with pytest.raises(RuntimeError, match="features must be a tensor of shape"):
        torch.ops.circle.loss(None, labels)


def test_errors_raised_inside_the_library_reach_python_in_a_fresh_process(device):
    """A library with a private static C++ runtime dies by a signal on its
    first error; this one must raise every error as a RuntimeError."""
    code = f"""
        import math, torch
        torch.ops.load_library({circle_loss.library_path()!r})
        d = {str(device)!r}
        cases = [
            (torch.randn(4, device=d), torch.zeros(4, dtype=torch.long, device=d), 0.25, 64.0),
            (torch.randn(2, 4, 3, device=d), torch.zeros(2, dtype=torch.long, device=d), 0.25, 64.0),
            (torch.randn(4, 3, device=d), torch.zeros(4, 1, dtype=torch.long, device=d), 0.25, 64.0),
            (torch.randn(4, 3, device=d), torch.zeros(5, dtype=torch.long, device=d), 0.25, 64.0),
            (torch.randn(4, 3, device=d), torch.zeros(4, dtype=torch.long, device=d), math.nan, 64.0),
            (torch.randn(4, 3, device=d), torch.zeros(4, dtype=torch.long, device=d), 0.25, math.inf),
        ]
        for requires_grad in (False, True):
            for features, labels, margin, gamma in cases:
                features.requires_grad_(requires_grad)
                try:
                    torch.ops.circle.loss(features, labels, margin, gamma)
                except RuntimeError as error:
                    print("refused:", str(error).splitlines()[0])
        """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    lines = result.stdout.splitlines()
    assert len(lines) == 12 and all(line.startswith("refused: circle::loss: ") for line in lines), lines


# margin and gamma beyond what the accumulation dtype (float32 for float32,
# float16 and bfloat16 features) can hold once multiplied into a logit's
# slope: refused with the parameter named, never a NaN loss.
_FLOAT32_MAX = torch.finfo(torch.float32).max
_BEYOND_FLOAT32 = [3.5e38, 1e39, 1e300, _FLOAT32_MAX, 2e38]


def _all_forms(features, labels, margin, gamma):
    """Calls of circle::loss and of anchor_loss without and with references,
    each once without and once with a gradient wanted."""
    ref, ref_labels = features.flip(0), labels.flip(0)
    calls = []
    for requires_grad in (False, True):
        x = features.detach().clone().requires_grad_(requires_grad)
        calls += [
            lambda x=x: torch.ops.circle.loss(x, labels, margin, gamma),
            lambda x=x: torch.ops.circle.anchor_loss(x, labels, None, None, margin, gamma),
            lambda x=x: torch.ops.circle.anchor_loss(x, labels, ref, ref_labels, margin, gamma),
        ]
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("value", _BEYOND_FLOAT32)
def test_gamma_beyond_the_accumulation_range_is_refused(device, dtype, sign, value):
    features, labels = make_inputs(12, 5, 3, device, dtype)
    for call in _all_forms(features, labels, 0.25, sign * value):
        with pytest.raises(RuntimeError, match=r"circle::(anchor_)?loss: gamma = .* overflows float32"):
            call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("value", [3.5e38, 1e39, 1e300])
def test_margin_beyond_the_accumulation_range_is_refused(device, dtype, sign, value):
    features, labels = make_inputs(12, 5, 3, device, dtype)
    for gamma in (0.0, 256.0):
        for call in _all_forms(features, labels, sign * value, gamma):
            with pytest.raises(RuntimeError, match=r"circle::(anchor_)?loss: (margin must lie within the range of "
                                                   r"float32|gamma = .* overflows float32)"):
                call()


def test_parameter_bounds_follow_the_accumulation_dtype(device):
    # float64 features compute in float64: gamma = 1e39 is an ordinary value
    # there (the float64 reference is about 1e39, finite), 1e308 is not.
    features, labels = make_inputs(12, 5, 3, device, torch.float64)
    for gamma in (1e39, -1e39, 1e300):
        total = torch.ops.circle.loss(features, labels, 0.25, gamma)
        expected = circle_loss_reference(features, labels, 0.25, gamma)
        assert torch.isfinite(total) and torch.allclose(total, expected, rtol=1e-10, atol=0), (gamma, total, expected)
        rows = torch.ops.circle.anchor_loss(features, labels, None, None, 0.25, gamma)
        expected = anchor_loss_reference(features, labels, margin=0.25, gamma=gamma)
        assert torch.allclose(rows, expected, rtol=1e-10, atol=0), (gamma, rows, expected)
    for gamma in (1e308, -1e308):
        with pytest.raises(RuntimeError, match="gamma = .* overflows float64"):
            loss(features, labels, 0.25, gamma)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_largest_accepted_parameters_give_no_nan(device, dtype):
    # At the edge of what is accepted, and with either sign: no loss is NaN.
    # Nor is the gradient of a finite loss up to |gamma| = 1e10, far beyond
    # any use; nearer the edge its terms reach |gamma|·(2 + |margin|) each,
    # and the kernels' sums and shared exp scales may overflow (docs/math.md,
    # "Inputs").
    # (Values there are ill-conditioned, gamma times the rounding of S, so
    # they are compared with the reference at ordinary sizes elsewhere, and
    # for overflow to inf in test_modes.)
    features, labels = make_inputs(40, 6, 3, device, dtype)
    largest = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).max
    for margin in (0.25, -0.25, 2.0, 0.0, 1e10, -1e10):
        edge = largest / (2.0 + abs(margin)) * (1 - 1e-9)  # the product rounds up at the exact quotient
        for gamma in (edge, -edge, edge / 100, 1e10, -1e10, 256.0, -256.0):
            for call in _all_forms(features, labels, margin, gamma):
                value = call()
                assert not torch.isnan(value).any() and (value >= 0).all(), (margin, gamma, value)
                if value.requires_grad and torch.isfinite(value).all() and abs(gamma) <= 1e10:
                    leaf = value.grad_fn.next_functions[0][0].variable
                    (grad,) = torch.autograd.grad(value.sum(), leaf)
                    assert not torch.isnan(grad).any(), (margin, gamma)


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch", [8, 700])  # CUDA's small-batch kernels and its tiles
def test_one_class_gives_zero_at_every_accepted_gamma(device, dtype, batch):
    # Every label equal: no negative pair, so the loss is 0 with a zero
    # gradient (docs/math.md), also where gamma at the edge of its range
    # makes the positive logits overflow to inf (LSE_N + LSE_P = -inf + inf).
    features, _ = make_inputs(batch, 6, 1, device, dtype)
    labels = torch.zeros(batch, dtype=torch.long, device=device)
    largest = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).max
    for gamma in (largest / 2.25 * (1 - 1e-9), 1e38 if dtype != torch.float64 else 1e307, -1e30, 256.0):
        for call in _all_forms(features, labels, 0.25, gamma):
            value = call()
            assert (value == 0).all(), (gamma, value)
            if value.requires_grad:
                leaf = value.grad_fn.next_functions[0][0].variable
                (grad,) = torch.autograd.grad(value.sum(), leaf)
                assert (grad == 0).all(), gamma
