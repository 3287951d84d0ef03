"""circle::loss against the float64 reference written from docs/math.md, forward and gradient."""

import threading

import pytest
import torch

import circle_loss
from conftest import make_inputs
from reference import (
    assert_matches_reference,
    circle_loss_reference,
    reference_loss_and_grad,
)

SHAPES = [  # (B, D, classes): tiny, odd, tile edges and a few tiles
    (1, 8, 1),
    (2, 3, 2),
    (7, 5, 3),
    (33, 17, 5),
    (128, 64, 10),
    (129, 31, 4),
    (300, 96, 16),
    (517, 64, 50),
]


def run_op(features, labels, margin=0.25, gamma=256.0):
    x = features.detach().clone().requires_grad_()
    loss = torch.ops.circle.loss(x, labels, margin, gamma)
    loss.backward()
    return loss, x.grad


@pytest.mark.parametrize("batch,dim,classes", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.sanitize
def test_matches_reference(device, batch, dim, classes, dtype):
    features, labels = make_inputs(batch, dim, classes, device, dtype)
    loss, grad = run_op(features, labels)
    assert loss.dtype == dtype and loss.shape == () and loss.device == features.device
    assert grad.dtype == dtype and grad.shape == features.shape
    assert_matches_reference(loss, grad, features, labels)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch,dim,classes", [(5, 8, 2), (200, 64, 8), (300, 128, 30)])
@pytest.mark.sanitize
def test_half_precision_inputs(device, batch, dim, classes, dtype):
    features, labels = make_inputs(batch, dim, classes, device, dtype)
    loss, grad = run_op(features, labels)
    assert loss.dtype == dtype and grad.dtype == dtype
    # The reference sees the same rounded inputs.
    assert_matches_reference(loss, grad, features, labels)


@pytest.mark.parametrize(
    "layout", ["all_same", "all_distinct", "two_classes", "sorted_few", "negative_labels"]
)
def test_label_layouts(device, layout):
    batch = 150
    features, _ = make_inputs(batch, 40, 1, device)
    labels = {
        "all_same": torch.full((batch,), 3),
        "all_distinct": torch.randperm(batch),
        "two_classes": torch.randint(0, 2, (batch,)),
        "sorted_few": torch.sort(torch.randint(0, 4, (batch,))).values,
        "negative_labels": torch.randint(-5, 0, (batch,)),
    }[layout].to(device)
    loss, grad = run_op(features, labels)
    assert_matches_reference(loss, grad, features, labels)


def class_sizes_labels(sizes):
    """Labels with these class sizes, in random order."""
    labels = torch.cat([torch.full((n,), c) for c, n in enumerate(sizes)])
    return labels[torch.randperm(labels.numel())]


# Batches of several tiles (256 rows on the CPU) with classes that cross tile
# edges, are taller than a tile, or come in runs of small ones: the CPU puts
# rows in class order and takes each tile's positive pairs as the blocks of
# the classes it shares, small classes grouped; rounds of tiles wrap round
# for odd and even tile counts.
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layout", ["one_tall_class", "small_classes", "mixed_sizes", "two_classes"])
@pytest.mark.parametrize("batch", [700, 1100, 1300])
def test_classes_across_tiles(device, dtype, layout, batch):
    features, _ = make_inputs(batch, 16, 1, device, dtype)
    sizes = {
        "one_tall_class": [batch - 300] + [3] * 100,
        "small_classes": torch.randint(1, 9, (batch,)).tolist(),
        "mixed_sizes": [70, 1, 64, 65, 2, 300, 33, 31, 1] * 10,
        "two_classes": [batch // 3, batch - batch // 3],
    }[layout]
    labels = class_sizes_labels(sizes)[:batch].to(device)
    features = features[: labels.numel()]
    loss, grad = run_op(features, labels)
    assert_matches_reference(loss, grad, features, labels)
    with torch.no_grad():
        assert torch.equal(torch.ops.circle.loss(features, labels), loss.detach())


@pytest.mark.parametrize(
    "label_dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
)
def test_label_dtypes(device, label_dtype):
    features, labels = make_inputs(64, 16, 6, device)
    expected = torch.ops.circle.loss(features, labels)
    assert torch.equal(torch.ops.circle.loss(features, labels.to(label_dtype)), expected)


def test_unnormalised_features(device):
    features, labels = make_inputs(90, 24, 6, device, normalize=False)
    features = features * 0.3
    loss, grad = run_op(features, labels, gamma=16.0)
    assert_matches_reference(loss, grad, features, labels, 0.25, 16.0)


def test_non_contiguous_inputs(device):
    base, labels = make_inputs(80, 64, 7, device)
    features = base.T.contiguous().T  # column-major
    strided_labels = torch.stack([labels, labels], 1)[:, 0]
    assert not features.is_contiguous() and not strided_labels.is_contiguous()
    loss, grad = run_op(features, strided_labels)
    assert_matches_reference(loss, grad, base, labels)
    sliced = torch.randn(80, 128, device=device)[:, ::2]
    loss, grad = run_op(sliced, labels, gamma=8.0)
    assert_matches_reference(loss, grad, sliced, labels, 0.25, 8.0)


@pytest.mark.parametrize("margin,gamma", [(0.25, 256.0), (0.4, 64.0), (0.1, 1.0), (0.25, 0.0), (-0.2, 80.0)])
def test_margin_and_gamma(device, margin, gamma):
    features, labels = make_inputs(120, 32, 9, device)
    loss, grad = run_op(features, labels, margin, gamma)
    assert_matches_reference(loss, grad, features, labels, margin, gamma)


def test_huge_gamma_stays_finite(device):
    features, labels = make_inputs(200, 32, 10, device, torch.float64)
    ref_loss, ref_grad = reference_loss_and_grad(features, labels, 0.25, 1e6)
    assert torch.isfinite(ref_loss) and torch.isfinite(ref_grad).all()
    loss, grad = run_op(features, labels, 0.25, 1e6)
    assert_matches_reference(loss, grad, features, labels, 0.25, 1e6)
    loss32, grad32 = run_op(features.float(), labels, 0.25, 1e6)
    assert torch.isfinite(loss32) and torch.isfinite(grad32).all()
    assert abs(loss32.item() - ref_loss.item()) <= 1e-4 * ref_loss.item()


@pytest.mark.parametrize("batch", [0, 1])
@pytest.mark.sanitize
def test_empty_and_single_row_give_zero(device, batch):
    features, labels = make_inputs(batch, 12, 3, device)
    loss, grad = run_op(features, labels)
    assert loss.item() == 0.0 and grad.shape == (batch, 12)
    assert torch.count_nonzero(grad) == 0


@pytest.mark.sanitize
def test_no_negative_pair_gives_zero(device):
    features, _ = make_inputs(40, 12, 1, device)
    loss, grad = run_op(features, torch.zeros(40, dtype=torch.long, device=device))
    assert loss.item() == 0.0 and torch.count_nonzero(grad) == 0


def test_zero_width_features(device):
    features = torch.empty(6, 0, device=device)
    labels = torch.tensor([0, 0, 1, 1, 2, 2], device=device)
    loss, grad = run_op(features, labels)
    ref_loss = circle_loss_reference(features, labels)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    assert grad.shape == (6, 0)


@pytest.mark.sanitize
def test_nan_propagates(device):
    features, labels = make_inputs(20, 8, 3, device)
    features[3, 2] = float("nan")
    loss, grad = run_op(features, labels)
    assert torch.isnan(loss) and torch.isnan(grad).any()


def test_no_grad_and_inference_mode_match_grad_path(device):
    features, labels = make_inputs(150, 32, 8, device)
    loss_with_grad, _ = run_op(features, labels)
    with torch.no_grad():
        assert torch.equal(torch.ops.circle.loss(features, labels), loss_with_grad.detach())
    with torch.inference_mode():
        assert torch.equal(torch.ops.circle.loss(features, labels), loss_with_grad.detach())


def test_backward_scales_with_grad_output(device):
    features, labels = make_inputs(64, 16, 4, device)
    x = features.clone().requires_grad_()
    loss = torch.ops.circle.loss(x, labels)
    (grad,) = torch.autograd.grad(loss, x, torch.tensor(-2.5, device=device))
    _, unit_grad = run_op(features, labels)
    torch.testing.assert_close(grad, -2.5 * unit_grad)


def test_module_and_functional_match_op(device):
    features, labels = make_inputs(50, 16, 4, device)
    module = circle_loss.CircleLoss(margin=0.3, gamma=64.0)
    expected = torch.ops.circle.loss(features, labels, 0.3, 64.0)
    assert torch.equal(module(features, labels), expected)
    assert torch.equal(circle_loss.circle_loss(features, labels, 0.3, 64.0), expected)
    assert torch.equal(circle_loss.circle_loss(features, labels), torch.ops.circle.loss(features, labels))
    assert "margin=0.3" in repr(module)


def test_defaults_come_from_schema():
    assert (circle_loss.DEFAULT_MARGIN, circle_loss.DEFAULT_GAMMA) == (0.25, 256.0)


def test_bitwise_deterministic_across_calls_and_threads(device):
    features, labels = make_inputs(700, 64, 20, device)
    first_loss, first_grad = run_op(features, labels)
    threads = torch.get_num_threads()
    try:
        for n in sorted({1, 2, threads}):
            torch.set_num_threads(n)
            loss, grad = run_op(features, labels)
            assert torch.equal(loss, first_loss) and torch.equal(grad, first_grad), n
    finally:
        torch.set_num_threads(threads)


def test_safe_to_call_from_several_threads(device):
    inputs = [make_inputs(260, 48, 12, device) for _ in range(4)]
    expected = [run_op(*pair) for pair in inputs]
    results = [None] * len(inputs)

    def work(index):
        for _ in range(3):
            results[index] = run_op(*inputs[index])

    workers = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for (loss, grad), (exp_loss, exp_grad) in zip(results, expected):
        assert torch.equal(loss, exp_loss) and torch.equal(grad, exp_grad)
