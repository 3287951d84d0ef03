import pytest
import torch

import circle_loss  # noqa: F401  (registers torch.ops.circle)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random inputs on every run; a failing test reports its seed
    # (rerun with torch.manual_seed(seed) in place of torch.seed()).
    seed = torch.seed()
    yield seed
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        report.sections.append(("random seed", f"torch.seed() gave {seed}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "call":
        item.report_call = outcome.get_result()


def make_inputs(batch, dim, classes, device, dtype=torch.float32, normalize=True):
    """Random features (optionally L2-normalised, then cast) and labels."""
    features = torch.randn(batch, dim, dtype=torch.float64)
    if normalize and dim > 0:
        features = torch.nn.functional.normalize(features, dim=1)
    labels = torch.randint(0, max(classes, 1), (batch,))
    return features.to(device=device, dtype=dtype), labels.to(device)


def backward(loss, compiled=False):
    """loss.backward(), with compiled=True through compiled autograd (the
    backward graph traced and compiled whole)."""
    if not compiled:
        loss.backward()
        return
    with torch._dynamo.compiled_autograd._enable(torch.compile(fullgraph=True)):
        loss.backward()
