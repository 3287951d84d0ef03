"""Bad input gets a clear error naming the argument, never a crash or a wrong answer."""

import math
import subprocess
import sys
import textwrap

import pytest
import torch

import circle_loss
from conftest import make_inputs


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
