"""What only a GPU run can show: no host sync (CUDA-graph capture), bitwise
determinism across calls and streams, reduce-overhead compilation."""

import pytest
import torch

from conftest import make_inputs
from reference import (TOLERANCE, anchor_reference_and_grads, assert_matches_reference, reference_loss_and_grad,
                       relative_error)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Half-precision cases named by their dtype.
BFLOAT16 = pytest.param(torch.bfloat16, id="bfloat16")
FLOAT16 = pytest.param(torch.float16, id="float16")


def loss_and_grad(features, labels):
    loss = torch.ops.circle.loss(features, labels)
    (grad,) = torch.autograd.grad(loss, features)
    return loss, grad


def assert_op_matches_reference(batch, dim, classes, dtype):
    """Loss and gradient of fresh inputs against the reference; the loss-only
    call, whose kernels fold the same partials, gives the same loss bits."""
    features, labels = make_inputs(batch, dim, classes, "cuda", dtype)
    x = features.clone().requires_grad_()
    loss, grad = loss_and_grad(x, labels)
    assert_matches_reference(loss, grad, features, labels)
    with torch.no_grad():
        assert torch.equal(torch.ops.circle.loss(features, labels), loss)


# float32 at 6000: two strips of W; at D = 256: the gradient's products in
# bfloat16 parts (B·B·D ≥ 2^32); bfloat16: the tensor-core tiles
@pytest.mark.parametrize("batch,dim,dtype", [(1, 48, torch.float32), (200, 48, torch.float32),
                                             (700, 48, torch.float32), (6000, 48, torch.float32),
                                             (4500, 256, torch.float32), (4500, 48, torch.bfloat16)])
def test_cuda_graph_capture_and_replay(batch, dim, dtype):
    static_x, static_y = make_inputs(batch, dim, 9, "cuda", dtype)
    static_x.requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            loss_and_grad(static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # raises if anything synchronises with the host
        static_loss, static_grad = loss_and_grad(static_x, static_y)
    for _ in range(2):  # fresh data through the same graph
        x, y = make_inputs(batch, dim, 9, "cuda", dtype)
        with torch.no_grad():
            static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(static_loss, static_grad, x, y)


# the small-batch path, one strip of W, two, float32's products in bfloat16
# parts (B·B·D ≥ 2^32); bfloat16: the tensor-core tiles
@pytest.mark.parametrize("batch,dim,dtype", [(300, 96, torch.float32), (1500, 96, torch.float32),
                                             (6000, 96, torch.float32), (4500, 256, torch.float32),
                                             (4500, 96, torch.bfloat16)])
def test_bitwise_deterministic_across_streams(batch, dim, dtype):
    features, labels = make_inputs(batch, dim, 30, "cuda", dtype)
    features.requires_grad_()
    expected = loss_and_grad(features, labels)
    for _ in range(3):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            loss, grad = loss_and_grad(features, labels)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        assert torch.equal(loss, expected[0]) and torch.equal(grad, expected[1])


def test_reduce_overhead_compile():
    torch._dynamo.reset()
    criterion = torch.compile(torch.ops.circle.loss, mode="reduce-overhead", fullgraph=True)
    features, labels = make_inputs(300, 64, 12, "cuda")
    for _ in range(3):  # recorded into CUDA graphs, then replayed
        x = features.clone().requires_grad_()
        loss = criterion(x, labels)
        loss.backward()
    assert_matches_reference(loss, x.grad, features, labels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_large_batch_matches_reference(dtype):
    features, labels = make_inputs(2100, 256, 40, "cuda", dtype)
    x = features.clone().requires_grad_()
    loss, grad = loss_and_grad(x, labels)
    assert_matches_reference(loss, grad, features, labels)


def test_non_default_device_index_and_non_contiguous():
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    base, labels = make_inputs(333, 40, 7, device)
    features = base.T.contiguous().T.requires_grad_()
    with torch.cuda.device(0):
        loss, grad = loss_and_grad(features, labels)
    assert loss.device == device and grad.device == device
    assert_matches_reference(loss, grad, base, labels)


# Up to 512 rows the op runs its own two kernels (ops/cuda/small_batch.cu),
# beyond that cuBLAS strips. Both sides of the switch, and widths that take
# each of the small path's warps through several chunks of features.
@pytest.mark.parametrize("batch,dim", [(512, 40), (513, 40), (97, 1100), (300, 515)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, BFLOAT16])
@pytest.mark.sanitize
def test_small_batch_path_edges(batch, dim, dtype):
    assert_op_matches_reference(batch, dim, 11, dtype)


# The small path copies rows as 16-byte vectors where they are aligned and
# element by element where not, and tells the two sets' gradient terms apart
# by their sign, which the sign of gamma flips.
@pytest.mark.parametrize("gamma", [64.0, -3.0, 0.0])
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.sanitize
def test_small_batch_alignment_and_gamma_sign(gamma, aligned):
    features, labels = make_inputs(200, 64, 7, "cuda")
    storage = torch.zeros(features.numel() + 1, device="cuda")
    x = (storage[:-1] if aligned else storage[1:]).view_as(features)  # 4 bytes past a 16-byte boundary
    x.copy_(features)
    x.requires_grad_()
    loss = torch.ops.circle.loss(x, labels, 0.25, gamma)
    (grad,) = torch.autograd.grad(loss, x)
    assert_matches_reference(loss, grad, features, labels, gamma=gamma)


# Beyond 64 MiB of S the kernels work in several strips of rows, form each
# strip once, and take negative weights against a running maximum that later
# strips may raise; positive pairs are done class by class. B = 4500 gives 3
# strips in float64; float32 and bfloat16 take the tensor-core tiles, their
# W in one strip.
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, BFLOAT16])
@pytest.mark.sanitize
def test_several_strips_match_reference(dtype):
    assert_op_matches_reference(4500, 24, 60, dtype)


# The positive pairs' kernel loads rows 16 bytes at a time where every row
# starts on a 16-byte boundary and holds whole 16-byte runs, one value at a
# time elsewhere (here rows of 248 bytes); two classes give each block of
# rows a span that several CTAs share.
@pytest.mark.sanitize
def test_several_strips_rows_of_partial_runs():
    assert_op_matches_reference(4500, 31, 2, torch.float64)


# float32 at the default precision takes the tensor-core tiles too, each
# feature split into two TF32 parts (TileFeatures in ops/cuda/mma_tiles.cuh),
# and is held to float32's tolerance at gamma = 256, which TF32 products
# alone miss by far (test_several_strips_with_tf32 below). The split pads
# its rows to whole 16-byte chunks, so widths that are no multiple of 4
# (30, 61) and rows that start off a 16-byte boundary (offset) take the
# tiles as well; 6000 rows: two strips of W; two classes: many positive
# pairs; B·B·D ≥ 2^32 (4500 × 256): the gradient's products in bfloat16 parts.
@pytest.mark.parametrize("batch,dim,classes,offset", [(600, 8, 13, 0), (1027, 200, 13, 0), (6000, 30, 2, 0),
                                                      (900, 61, 7, 1), (6000, 24, 60, 1), (4500, 256, 13, 0),
                                                      (4500, 250, 2, 1)])
@pytest.mark.sanitize
def test_float32_split_tiles_match_reference(batch, dim, classes, offset):
    from test_anchor_loss import assert_anchor_matches_reference

    features, labels = make_inputs(batch, dim, classes, "cuda")
    storage = torch.zeros(features.numel() + offset, device="cuda")
    x = storage[offset:].view_as(features)
    x.copy_(features)
    loss, grad = loss_and_grad(x.requires_grad_(), labels)
    assert_matches_reference(loss, grad, features, labels)
    assert_anchor_matches_reference(x.detach(), labels)


# With TF32 allowed, float32 products keep 10 bits of their inputs, so S is
# off by about 1e-3 relative and gamma amplifies that into the logits: the op
# then takes the tensor-core tiles as float16/bfloat16 do (rows of whole
# 16-byte chunks; D = 30 takes cuBLAS's TF32 strips in two passes), every
# weight against the LSE of the same S, and is held to TF32's accuracy at a
# moderate gamma. D = 256 (B·B·D ≥ 2^32): the gradient's products run in
# float16 (test_tf32_products_in_float16).
@pytest.mark.parametrize("classes,dim", [(2, 24), (60, 24), (60, 30), (60, 256)])
@pytest.mark.sanitize
def test_several_strips_with_tf32(classes, dim, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    features, labels = make_inputs(4500, dim, classes, "cuda")
    x = features.clone().requires_grad_()
    loss = torch.ops.circle.loss(x, labels, 0.25, 32.0)
    (grad,) = torch.autograd.grad(loss, x)
    ref_loss, ref_grad = reference_loss_and_grad(features, labels, 0.25, 32.0)
    assert relative_error(loss, ref_loss) <= 1e-2
    assert relative_error(grad, ref_grad) <= 5e-2
    with torch.no_grad():
        assert torch.equal(torch.ops.circle.loss(features, labels, 0.25, 32.0), loss)


# With TF32 allowed, the products of W·F from B·M·D ≥ 2^32 on take W and F in
# float16, brought into its range by powers of two (HalfProducts in
# ops/cuda/float32_split.cuh). Features of four bits, k/64 for |k| ≤ 8, make
# S exact in TF32, so that what parts the ops from float64 is the products'
# rounding, held to TF32's 11 bits (2^-11 an operand, and room for the
# exps' rounding): on the whole gradient, and on each row of at least a
# hundredth of the largest row's norm. Features scaled to 2^-10 spread the
# weights over all pairs, each far below float16's normal range unless W is
# scaled; scaled to 2^3 they put them on a few pairs.
HALF_PRODUCT_SCALES = [2.0 ** -10, 1.0, 2.0 ** 3]


def four_bit_features(batch, dim, scale):
    return torch.randint(-8, 9, (batch, dim), device="cuda").float() * (scale / 64)


def assert_gradient_within_tf32(grad, ref_grad):
    assert relative_error(grad, ref_grad) <= 2e-3
    row_norms = ref_grad.double().norm(dim=1)
    rows = row_norms >= 1e-2 * row_norms.max()
    row_errors = (grad.double() - ref_grad.double())[rows].norm(dim=1) / row_norms[rows]
    assert row_errors.max().item() <= 1e-2


@pytest.mark.parametrize("scale", HALF_PRODUCT_SCALES)
def test_tf32_products_in_float16(scale, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    features = four_bit_features(4500, 256, scale)
    labels = torch.randint(0, 60, (4500,), device="cuda")
    x = features.clone().requires_grad_()
    loss = torch.ops.circle.loss(x, labels, 0.25, 32.0)
    (grad,) = torch.autograd.grad(loss, x)
    ref_loss, ref_grad = reference_loss_and_grad(features, labels, 0.25, 32.0)
    assert relative_error(loss, ref_loss) <= TOLERANCE[torch.float32][0]
    assert_gradient_within_tf32(grad, ref_grad)
    features[7, 5] = float("nan")  # no scale hides it
    loss, grad = loss_and_grad(features.requires_grad_(), labels)
    assert torch.isnan(loss) and torch.isnan(grad).any()


# The same for anchor_loss, whose weights differ from row to row by the
# incoming gradient and σ(Z_i): without references (each entry carries both
# of its pairs) and with a memory bank (dR = Wᵀ Q too).
@pytest.mark.parametrize("refs", [None, 140_000])
@pytest.mark.parametrize("scale", HALF_PRODUCT_SCALES)
def test_anchor_tf32_products_in_float16(scale, refs, monkeypatch):
    from test_anchor_loss import run_anchor

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    batch, dim, classes = (4500, 256, 60) if refs is None else (1000, 64, 4)
    features = four_bit_features(batch, dim, scale)
    labels = torch.randint(0, classes, (batch,), device="cuda")
    ref, ref_labels = (None, None) if refs is None else (four_bit_features(refs, dim, scale),
                                                         torch.randint(0, classes, (refs,), device="cuda"))
    weights = torch.rand(batch, device="cuda")
    losses, grad_q, grad_r = run_anchor(features, labels, ref, ref_labels, 0.4, 32.0, weights)
    ref_losses, ref_q, ref_r = anchor_reference_and_grads(features, labels, ref, ref_labels, 0.4, 32.0, weights)
    assert relative_error(losses, ref_losses) <= TOLERANCE[torch.float32][0]
    assert_gradient_within_tf32(grad_q, ref_q)
    if ref is not None:
        assert_gradient_within_tf32(grad_r, ref_r)


# The float16 copies take their scale from the largest finite row norm: a
# row of infinities gets a loss that is not finite and leaves the other
# rows' scale, so that features up to 2^16, past float16's range unless
# scaled, still give every other row its loss to float32's tolerance.
def test_tf32_float16_scale_skips_non_finite_rows(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    features = four_bit_features(1000, 64, 2.0 ** 19)
    labels = torch.randint(0, 4, (1000,), device="cuda")
    ref = four_bit_features(140_000, 64, 2.0 ** 19)
    ref_labels = torch.randint(0, 4, (140_000,), device="cuda")
    ref_losses = anchor_reference_and_grads(features, labels, ref, ref_labels, 0.4, 32.0)[0]
    features[7] = float("inf")
    losses = torch.ops.circle.anchor_loss(features, labels, ref, ref_labels, 0.4, 32.0)
    others = torch.arange(1000, device="cuda") != 7
    assert not torch.isfinite(losses[7])
    assert relative_error(losses[others], ref_losses[others]) <= TOLERANCE[torch.float32][0]


# The float16 copies and products take their scales on the device: captured into one
# CUDA graph, both ops replay fresh inputs to the eager results bit for bit,
# and calls on other streams repeat them.
def test_tf32_products_capture_and_determinism(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    x, y = make_inputs(4500, 256, 9, "cuda")
    x.requires_grad_()

    def both():
        return (*loss_and_grad(x, y), *anchor_loss_and_grads(x, y))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            both()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # raises if anything synchronises with the host
        captured = both()
    for _ in range(2):
        fresh_x, fresh_y = make_inputs(4500, 256, 9, "cuda")
        with torch.no_grad():
            x.copy_(fresh_x)
        y.copy_(fresh_y)
        graph.replay()
        torch.cuda.synchronize()
        eager = both()
        assert all(torch.equal(a, b) for a, b in zip(captured, eager))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            again = both()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(again, eager))


# The tensor-core gradients hold only W: where the whole width leaves a
# strip fewer than 2048 rows (float16/bfloat16: B > 32 768), strips of 2048
# rows are cut into chunks of 32 768 columns. B = 33 000: 17 strips, the
# first in two chunks (32 768 and 232 columns); the symmetric product
# mirrors each chunk's part right of the diagonal block, and the block ops
# (rows 4096 of the batch against all of it, two strips of two chunks) add
# a strip's chunks without a mirror. Their rows are held to the tolerance
# relative to the whole gradient, as the op is: with gamma = 256 a few rows
# carry it, and the rest, made of weights among float16's subnormals, can
# differ far more relative to their own small norm.
@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16])
def test_column_chunks_match_reference(dtype):
    batch = 33_000
    features, labels = make_inputs(batch, 24, 60, "cuda", dtype)
    x = features.clone().requires_grad_()
    loss, grad = loss_and_grad(x, labels)
    assert_matches_reference(loss, grad, features, labels)
    rows = 4096
    scalars = torch.ops.circle._lse_finish(
        torch.ops.circle._lse_partials(features, labels, features, labels, 0.25, 256.0)[None])
    block_grad = torch.ops.circle._block_grad(features[:rows], labels[:rows], features, labels, scalars, 0.25, 256.0)
    assert relative_error(block_grad, grad[:rows], floor=grad.double().norm().item()) <= TOLERANCE[dtype][1]


# 6000 rows: two strips of W in float32, for the op and the block gradient.
def test_block_ops_over_several_strips():
    features, labels = make_inputs(6000, 24, 60, "cuda")
    loss, grad = torch.ops.circle._loss_with_grad(features, labels, 0.25, 256.0)
    partials = torch.ops.circle._lse_partials(features, labels, features, labels, 0.25, 256.0)
    scalars = torch.ops.circle._lse_finish(partials[None])
    block_grad = torch.ops.circle._block_grad(features, labels, features, labels, scalars, 0.25, 256.0)
    loss_tol, grad_tol = TOLERANCE[torch.float32]
    assert relative_error(scalars[2], loss) <= loss_tol
    assert relative_error(block_grad, grad) <= grad_tol


# float16/bfloat16 batches beyond the small path form S on the tensor cores,
# 128 × 128 a tile and 64 features a stage (ops/cuda/mma_tiles.cuh): rows and
# features that end inside a tile or a stage are zero-filled, and the weights
# of a strip whose width is no multiple of 8 are stored element by element.
# Widths that are no multiple of 8, and rows that start off a 16-byte
# boundary, take the cuBLAS strips instead.
@pytest.mark.parametrize("batch,dim", [(600, 8), (1000, 72), (1027, 200), (700, 100), (4500, 24)])
@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16])
@pytest.mark.sanitize
def test_tensor_core_tiles_match_reference(batch, dim, dtype):
    assert_op_matches_reference(batch, dim, 13, dtype)


# Rows in label order make most tiles all one set, which the loss pass and
# both ops' weights pass tell from the ranges of the tile's label ids and
# reduce without comparing labels: all negative pairs, all positive ones
# (one class, and runs longer than a tile), labels past 32 bits (ids by
# first position), and descending ones.
@pytest.mark.parametrize("order", ["3 classes", "one class", "wide labels", "descending"])
@pytest.mark.parametrize("dtype", [BFLOAT16])
@pytest.mark.sanitize
def test_tensor_core_tiles_in_label_order(order, dtype):
    from test_anchor_loss import assert_anchor_matches_reference

    features, labels = make_inputs(1300, 40, {"one class": 1}.get(order, 3), "cuda", dtype)
    labels = labels.sort(descending=order == "descending").values
    if order == "wide labels":
        labels = labels * 2**32 - 5
    x = features.clone().requires_grad_()
    loss, grad = loss_and_grad(x, labels)
    assert_matches_reference(loss, grad, features, labels)
    with torch.no_grad():
        assert torch.equal(torch.ops.circle.loss(features, labels), loss)
    assert_anchor_matches_reference(features, labels)


@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16])
def test_tensor_core_tiles_unaligned_rows(dtype):
    features, labels = make_inputs(900, 64, 7, "cuda", dtype)
    storage = torch.zeros(features.numel() + 1, device="cuda", dtype=dtype)
    x = storage[1:].view_as(features)  # 2 bytes past a 16-byte boundary
    x.copy_(features)
    x.requires_grad_()
    loss, grad = loss_and_grad(x, labels)
    assert_matches_reference(loss, grad, features, labels)


# The tiles' loss pass alone, under the sanitizers, with labels that fit in
# 32 bits and ones that do not (test_tensor_core_tiles_wide_labels).
@pytest.mark.sanitize
def test_tensor_core_loss_pass():
    for dtype in (torch.float16, torch.bfloat16):
        features, labels = make_inputs(1027, 72, 5, "cuda", dtype)
        for wide in (False, True):
            labels = labels * 2**32 + 7 if wide else labels
            with torch.no_grad():
                loss = torch.ops.circle.loss(features, labels)
            assert_matches_reference(loss, None, features, labels)


# The tiles compare labels as 32-bit ids: a label's own value where every
# label of the tile fits in 32 bits, else its first position in the tile.
# Labels k·2^32 + 7 share their low words and differ above them; with -1 and
# 2^31 beside small ones, and with every label fitting, both ways are taken
# by both ops.
@pytest.mark.parametrize("labels_kind", ["low words alike", "signs and 2^31", "fitting"])
@pytest.mark.parametrize("dtype", [BFLOAT16])
@pytest.mark.sanitize
def test_tensor_core_tiles_wide_labels(labels_kind, dtype):
    from test_anchor_loss import assert_anchor_matches_reference

    features, classes = make_inputs(1027, 72, 9, "cuda", dtype)
    labels = {
        "low words alike": classes * 2**32 + 7,
        "signs and 2^31": torch.where(classes % 3 == 0, -1 - classes, classes + (classes % 3 == 1) * 2**31),
        "fitting": classes - 4,
    }[labels_kind]
    assert torch.equal(labels[:, None] == labels, classes[:, None] == classes)  # the same pairs
    x = features.clone().requires_grad_()
    loss, grad = loss_and_grad(x, labels)
    assert_matches_reference(loss, grad, features, labels)
    assert_anchor_matches_reference(features, labels)


def plant_pair(features, first, second, similarity):
    """Makes rows first and second unit vectors whose dot product is similarity."""
    base = torch.nn.functional.normalize(features[first], dim=0)
    other = features[second] - (features[second] @ base) * base
    other = torch.nn.functional.normalize(other, dim=0)
    features[first] = base
    features[second] = similarity * base + (1 - similarity**2) ** 0.5 * other


@pytest.mark.parametrize("layout", ["two classes", "one class", "largest logit in the last strip", "nan"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.sanitize
def test_several_strips_edge_cases(layout, dtype):
    batch = 4500
    classes = {"two classes": 2, "one class": 1}.get(layout, 60)
    features, labels = make_inputs(batch, 64, classes, "cuda", torch.float64)
    if layout == "largest logit in the last strip":
        # Negative pairs far above the rest (s ≈ 0.66 at most at D = 64), one in
        # the first strip and one, whose logit is 3 higher, only in the last:
        # the first strip's weights are rescaled by exp(-3), not ignored.
        labels[:2] = torch.tensor([0, 1])
        labels[-2:] = torch.tensor([0, 1])
        plant_pair(features, 0, 1, 0.9)
        plant_pair(features, batch - 2, batch - 1, (0.9**2 + 3 / 256.0) ** 0.5)
    if layout == "nan":
        features[batch - 7, 5] = float("nan")
    features = features.to(dtype)
    x = features.clone().requires_grad_()
    loss, grad = loss_and_grad(x, labels)
    if layout == "nan":
        assert torch.isnan(loss) and torch.isnan(grad).any()
    elif layout == "one class":
        assert loss.item() == 0 and torch.count_nonzero(grad).item() == 0
    else:
        assert_matches_reference(loss, grad, features, labels)


# circle::anchor_loss over several strips. float64 forms S in cuBLAS's
# strips, with per-row states: without a reference set B = 4500 gives 3 (S
# from each strip's first row on, the mirrored pairs reduced by column);
# against M = 140 000 references a strip holds 128 of the 300 rows. The other
# dtypes' forward on the tensor-core tiles keeps only their partial states,
# in strips of at most 64 Mi entries of S: B = 9000 takes two, 1000 rows
# against M = 140 000 three; their backward holds W in strips of 2048 rows cut
# into column chunks where the whole width would leave fewer than 2048 (B >
# 16 384 in float32, 32 768 in float16/bfloat16): B = 33 000 (as for
# circle::loss above) and 1000 rows against M = 140 000, one strip of several.
def anchor_loss_and_grads(features, labels, ref=None, ref_labels=None):
    losses = torch.ops.circle.anchor_loss(features, labels, ref, ref_labels)
    weights = torch.linspace(0.5, 1.5, losses.numel(), device=losses.device, dtype=losses.dtype)
    inputs = [features] if ref is None or not ref.requires_grad else [features, ref]
    return (losses, *torch.autograd.grad((losses * weights).sum(), inputs))


SEVERAL_STRIPS = [  # (B, M or None, whether only the tiles' dtypes need the case)
    pytest.param(4500, None, False, marks=pytest.mark.sanitize, id="self"),
    pytest.param(300, 140_000, False, marks=pytest.mark.sanitize, id="reference"),
    pytest.param(9000, None, True, id="self, tile strips"),
    pytest.param(33_000, None, True, id="self, column chunks"),
    pytest.param(1000, 140_000, True, id="reference, tile strips"),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, FLOAT16, BFLOAT16])
@pytest.mark.parametrize("batch,refs,tile_strips", SEVERAL_STRIPS)
def test_anchor_loss_over_several_strips(dtype, batch, refs, tile_strips):
    from test_anchor_loss import assert_anchor_matches_reference, memory_bank

    if tile_strips and dtype == torch.float64:
        pytest.skip("float64 takes no tiles")
    features, labels = make_inputs(batch, 24, 60 if refs is None else 4, "cuda", dtype)
    if refs is None:
        assert_anchor_matches_reference(features, labels, weights=torch.rand(batch, device="cuda", dtype=dtype))
    else:
        ref, ref_labels, position = memory_bank(features, labels, refs, refs - batch // 2)
        assert_anchor_matches_reference(features, labels, ref, ref_labels)
        assert_anchor_matches_reference(features, labels, ref, ref_labels, ref_grad=False)
        assert_anchor_matches_reference(features, labels, ref, ref_labels, ref_self_index=position)


# anchor_loss's tile weights take one exp an entry for both of a pair's
# anchors where a tile's LSEs and incoming gradients allow it, two where
# they do not (AnchorWeightRule): the same gradient, to the tolerance of
# gradients of scale 1, for gradients scaled by 2^-100 to 2^60, for
# gradients spread over 2^-60..1 within tiles, and for labels of B classes,
# whose positive sets of one or two pairs have LSEs far apart.
@pytest.mark.parametrize("dtype,batch,dim", [(torch.bfloat16, 600, 64), (torch.float32, 4500, 16)])
@pytest.mark.parametrize("classes", [10, "B"])
def test_anchor_tile_weights_at_any_gradient_scale(dtype, batch, dim, classes):
    from test_anchor_loss import assert_anchor_matches_reference, run_anchor
    from reference import FLOAT32_YARDSTICK_FACTOR

    features, labels = make_inputs(batch, dim, batch if classes == "B" else classes, "cuda", dtype)
    weights = torch.rand(batch, device="cuda", dtype=torch.float64) + 0.5
    spread = weights * torch.exp2(-60 * torch.rand(batch, device="cuda", dtype=torch.float64))
    assert_anchor_matches_reference(features, labels, weights=spread.to(dtype))
    ref_losses, ref_q, _ = anchor_reference_and_grads(features, labels, weights=weights.to(dtype))
    q32 = anchor_reference_and_grads(features, labels, weights=weights.to(dtype), dtype=torch.float32)[1]
    grad_tol = max(TOLERANCE[dtype][1], FLOAT32_YARDSTICK_FACTOR * relative_error(q32, ref_q))
    for exponent in [-100, -30, 0, 60]:
        losses, grad_q, _ = run_anchor(features, labels, weights=(weights * 2.0**exponent).to(dtype))
        assert relative_error(losses, ref_losses) <= TOLERANCE[dtype][0]
        assert relative_error(grad_q.double() * 2.0**-exponent, ref_q) <= grad_tol, exponent


# anchor_loss with TF32 allowed multiplies float32 in TF32 on the tiles (D = 30:
# cuBLAS's strips), held to TF32's accuracy at a moderate gamma; from B·M·D ≥
# 2^32 (D = 256, and the references at D = 64) the products run in float16
# (test_anchor_tf32_products_in_float16).
@pytest.mark.parametrize("batch,dim,refs", [(4500, 24, None), (4500, 30, None), (1000, 24, 140_000),
                                            (4500, 256, None), (1000, 64, 140_000)])
def test_anchor_loss_with_tf32(batch, dim, refs, monkeypatch):
    from test_anchor_loss import memory_bank, run_anchor

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    features, labels = make_inputs(batch, dim, 60 if refs is None else 4, "cuda")
    ref, ref_labels = (None, None) if refs is None else memory_bank(features, labels, refs, refs - batch // 2)[:2]
    weights = torch.rand(batch, device="cuda")
    losses, grad_q, grad_r = run_anchor(features, labels, ref, ref_labels, 0.4, 32.0, weights)
    ref_losses, ref_q, ref_r = anchor_reference_and_grads(features, labels, ref, ref_labels, 0.4, 32.0, weights)
    assert relative_error(losses, ref_losses) <= 1e-2
    assert relative_error(grad_q, ref_q) <= 5e-2
    if ref is not None:
        assert relative_error(grad_r, ref_r) <= 5e-2


# (B, M or None, whether the references need a gradient, dtype, D): cuBLAS's
# strips for float64 and against a bank (references that need no gradient),
# the tensor-core tiles otherwise, float32 split into TF32 parts, and at
# B·B·D ≥ 2^32 the gradient's products in bfloat16 parts.
ANCHOR_CASES = {"small": (200, None, False, torch.float32, 16),
                "self strips": (4500, None, False, torch.float64, 16),
                "reference strips": (300, 140_000, True, torch.float64, 16),
                "bank strips": (300, 140_000, False, torch.float32, 16),
                "self split tiles": (4500, None, False, torch.float32, 16),
                "self split tiles, products in parts": (4500, None, False, torch.float32, 256),
                "self tiles": (9000, None, False, torch.bfloat16, 16),
                "reference tiles": (1000, 140_000, True, torch.bfloat16, 16)}


def anchor_case_inputs(batch, refs, ref_grad, dtype, dim):
    """Features (requiring grad) and labels, and a reference set where refs is given."""
    x, y = make_inputs(batch, dim, 7, "cuda", dtype)
    r, ry = make_inputs(refs, dim, 7, "cuda", dtype) if refs else (None, None)
    x.requires_grad_()
    if r is not None:
        r.requires_grad_(ref_grad)
    return x, y, r, ry


@pytest.mark.parametrize("case", list(ANCHOR_CASES))
def test_anchor_loss_graph_capture_and_replay(case):
    batch, refs, ref_grad, dtype, dim = ANCHOR_CASES[case]
    x, y, r, ry = anchor_case_inputs(batch, refs, ref_grad, dtype, dim)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            anchor_loss_and_grads(x, y, r, ry)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # raises if anything synchronises with the host
        captured = anchor_loss_and_grads(x, y, r, ry)
    for _ in range(2):  # fresh data through the same graph
        with torch.no_grad():
            x.copy_(make_inputs(batch, dim, 7, "cuda", dtype)[0])
        y.copy_(make_inputs(batch, dim, 7, "cuda", dtype)[1])
        graph.replay()
        torch.cuda.synchronize()
        eager = anchor_loss_and_grads(x, y, r, ry)
        assert all(torch.equal(a, b) for a, b in zip(captured, eager))


@pytest.mark.parametrize("case", list(ANCHOR_CASES))
def test_anchor_loss_bitwise_deterministic_across_streams(case):
    batch, refs, ref_grad, dtype, dim = ANCHOR_CASES[case]
    x, y, r, ry = anchor_case_inputs(batch, refs, ref_grad, dtype, dim)
    expected = anchor_loss_and_grads(x, y, r, ry)
    for _ in range(3):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            got = anchor_loss_and_grads(x, y, r, ry)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
