"""circle_loss.pml.CircleLoss against pytorch-metric-learning's CircleLoss
itself: the same loss and gradients in every way PML users call it."""

import copy
import math
import subprocess
import sys

import pytest
import torch

pml = pytest.importorskip("pytorch_metric_learning")
from pytorch_metric_learning import distances, losses, miners, reducers, regularizers  # noqa: E402

import circle_loss.pml  # noqa: E402
from conftest import make_inputs  # noqa: E402
from reference import relative_error  # noqa: E402

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4}
# PML's softplus is torch's, which returns x itself above x = 20, where the
# op computes softplus exactly: a row whose Z lies just above 20 differs by
# log1p(e^-Z) < e^-20 = 2.1e-9 in its loss (under 1.1e-10 of it) and by as
# much, relatively, in its gradient (slope 1 against σ(Z)). Measured against
# PML, float64 allows that gap.
SOFTPLUS_GAP = math.exp(-20.0)


def loss_tolerance(dtype):
    return TOLERANCE[dtype] + SOFTPLUS_GAP / 20.0


def grad_tolerance(dtype):
    return 10 * TOLERANCE[dtype] + SOFTPLUS_GAP


def compare(make_loss, call, inputs, dtype, fused=True):
    """Runs call(loss, *inputs) with PML's class and with the drop-in, on
    copies of inputs that require grad, and compares results and gradients."""
    results = []
    for cls in (losses.CircleLoss, circle_loss.pml.CircleLoss):
        loss_fn = make_loss(cls)
        leaves = [x.detach().clone().requires_grad_() if x.is_floating_point() else x for x in inputs]
        out = call(loss_fn, *leaves)
        value = out if torch.is_tensor(out) else out["loss"]["losses"]
        (value * torch.linspace(0.5, 1.5, value.numel(), dtype=value.dtype, device=value.device)
         .reshape(value.shape)).sum().backward()
        results.append((value.detach(), [x.grad for x in leaves if x.is_floating_point()]))
    (expected, expected_grads), (got, got_grads) = results
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert relative_error(got, expected) <= loss_tolerance(dtype), (got, expected)
    for g, e in zip(got_grads, expected_grads):
        assert relative_error(g, e) <= grad_tolerance(dtype)


def unnormalised(batch, dim, classes, device, dtype):
    features, labels = make_inputs(batch, dim, classes, device, dtype, normalize=False)
    return features * 3.0, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch,classes", [(2, 2), (3, 2), (64, 4), (300, 10), (257, 2)])
def test_labels_only(device, dtype, batch, classes):
    x, y = unnormalised(batch, 16, classes, device, dtype)
    compare(lambda cls: cls(), lambda f, x, y: f(x, y), [x, y], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("m,gamma", [(0.4, 80), (0.25, 256), (0.1, 32)])
def test_with_ref_emb(device, dtype, m, gamma):
    x, y = unnormalised(90, 16, 5, device, dtype)
    r, ry = unnormalised(200, 16, 5, device, dtype)
    compare(lambda cls: cls(m=m, gamma=gamma), lambda f, x, r, y, ry: f(x, y, ref_emb=r, ref_labels=ry),
            [x, r, y, ry], dtype)
    # The same tensor as its own reference, with labels that are not `labels`:
    # PML keeps the pairs (i, i) then.
    compare(lambda cls: cls(m=m, gamma=gamma), lambda f, x, y: f(x, y, ref_emb=x, ref_labels=y.clone()), [x, y], dtype)
    # ref_emb given with ref_labels=labels: PML leaves out (i, i) between the two sets.
    r2, _ = unnormalised(90, 16, 5, device, dtype)
    compare(lambda cls: cls(), lambda f, x, r, y: f(x, y, ref_emb=r, ref_labels=y), [x, r2, y], dtype)


@pytest.mark.parametrize(
    "make_reducer",
    [
        reducers.AvgNonZeroReducer,
        reducers.MeanReducer,
        reducers.SumReducer,
        lambda: reducers.ThresholdReducer(low=5.0, high=200.0),
        lambda: reducers.ClassWeightedReducer(torch.linspace(0.5, 2.0, 6)),
        reducers.PerAnchorReducer,
        reducers.DoNothingReducer,
    ],
)
def test_reducers(device, make_reducer):
    x, y = unnormalised(120, 16, 6, device, torch.float64)
    compare(lambda cls: cls(reducer=make_reducer()), lambda f, x, y: f(x, y), [x, y], torch.float64)


def test_miner_goes_through_pml_code(device):
    x, y = unnormalised(100, 16, 5, device, torch.float64)
    miner = miners.MultiSimilarityMiner(epsilon=0.1)
    compare(lambda cls: cls(), lambda f, x, y: f(x, y, miner(x, y)), [x, y], torch.float64)


def test_embedding_regularizer_and_stats(device):
    x, y = unnormalised(80, 16, 4, device, torch.float64)
    compare(lambda cls: cls(embedding_regularizer=regularizers.LpRegularizer()), lambda f, x, y: f(x, y), [x, y],
            torch.float64)
    for cls in (losses.CircleLoss, circle_loss.pml.CircleLoss):
        loss_fn = cls(distance=distances.CosineSimilarity(collect_stats=True))
        loss_fn(x, y)
        assert loss_fn.distance.initial_avg_query_norm == pytest.approx(x.norm(dim=1).mean().item())


def test_normalize_embeddings_off_is_honoured(device):
    x, y = make_inputs(60, 16, 4, device, torch.float64, normalize=False)
    x = x * 0.2  # small dot products, so the unnormalised loss stays finite

    def make(cls):
        loss_fn = cls()
        loss_fn.distance.normalize_embeddings = False
        return loss_fn

    compare(make, lambda f, x, y: f(x, y), [x, y], torch.float64)


def test_other_distances_go_through_pml_code(device):
    x, y = unnormalised(50, 8, 3, device, torch.float64)
    compare(lambda cls: cls(distance=distances.CosineSimilarity(power=2)), lambda f, x, y: f(x, y), [x, y],
            torch.float64)


@pytest.mark.parametrize("symmetric", [True, False])
def test_inside_self_supervised_loss(device, symmetric):
    x, _ = unnormalised(64, 16, 1, device, torch.float64)
    augmented = x + 0.3 * torch.randn_like(x)
    compare(lambda cls: losses.SelfSupervisedLoss(cls(), symmetric=symmetric), lambda f, a, b: f(a, b),
            [x, augmented], torch.float64)


def test_inside_cross_batch_memory(device):
    pml_memory = losses.CrossBatchMemory(losses.CircleLoss(), embedding_size=16, memory_size=100).to(device)
    our_memory = losses.CrossBatchMemory(circle_loss.pml.CircleLoss(), embedding_size=16, memory_size=100).to(device)
    for step in range(4):  # the bank fills and wraps round
        x, y = unnormalised(40, 16, 5, device, torch.float32)
        results = []
        for memory in (pml_memory, our_memory):
            leaf = x.clone().requires_grad_()
            loss = memory(leaf, y)
            loss.backward()
            results.append((loss.detach(), leaf.grad))
        assert relative_error(results[1][0], results[0][0]) <= loss_tolerance(torch.float32)
        assert relative_error(results[1][1], results[0][1]) <= grad_tolerance(torch.float32)


def run_memories(make_pml, make_ours, batches, dtype, device, call=lambda memory, x, y: memory(x, y)):
    """Feeds the same batches to PML's CrossBatchMemory and to the drop-in and
    compares every step's loss and gradient, and the banks after each step."""
    pml_memory, our_memory = make_pml().to(device), make_ours().to(device)
    for batch in batches:
        x, y = unnormalised(batch, 16, 5, device, dtype)
        results = []
        for memory in (pml_memory, our_memory):
            leaf = x.clone().requires_grad_()
            loss = call(memory, leaf, y)
            loss.backward()
            results.append((loss.detach(), leaf.grad))
        assert relative_error(results[1][0], results[0][0]) <= loss_tolerance(dtype), results
        # A batch of one whose negatives all lie below -m (their weights clamp to
        # zero) gets its gradient from the pair with its own copy alone, which
        # PML keeps there. That gradient is zero in exact arithmetic: d(x̂·x̂)/dx̂
        # is radial and the normalisation's backward projects it out. What
        # remains is rounding, about 1e-11 in float32, so such norms count as 1e-6.
        assert relative_error(results[1][1], results[0][1], floor=1e-6) <= grad_tolerance(dtype)
        assert our_memory.queue_idx == pml_memory.queue_idx
        assert torch.equal(our_memory.embedding_memory, pml_memory.embedding_memory)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size,batches", [(100, [40, 40, 40, 40]), (64, [64, 64]), (50, [7, 30, 1, 44, 50]),
                                          (4, [2, 1, 1, 3])])
def test_fused_cross_batch_memory(device, dtype, size, batches, monkeypatch):
    calls = []

    def recording(*args):
        calls.append(args[-1])
        return circle_loss.anchor_loss(*args)

    monkeypatch.setattr(circle_loss.pml, "anchor_loss", recording)
    run_memories(lambda: losses.CrossBatchMemory(losses.CircleLoss(), embedding_size=16, memory_size=size),
                 lambda: circle_loss.pml.CrossBatchMemory(circle_loss.pml.CircleLoss(), embedding_size=16,
                                                          memory_size=size),
                 batches, dtype, device)
    # Every step with more than two pairs ran on the op, its queries' copies
    # left out by position; PML's code gave the others its already-reduced
    # zero. PML keeps a lone query's pair with its copy (its removal takes a
    # batch of one for one that wraps round the bank), and so does the drop-in.
    filled = [min(size, sum(batches[: k + 1])) for k in range(len(batches))]
    pairs = [b * m - (b if b > 1 else 0) for b, m in zip(batches, filled)]
    assert len(calls) == sum(n > 2 for n in pairs)
    assert [c is None for c in calls] == [b == 1 for b, n in zip(batches, pairs) if n > 2]


def test_fused_cross_batch_memory_with_enqueue_mask(device):
    def call(memory, x, y):
        mask = torch.arange(len(x), device=device) % 3 == 0  # a third to the bank, the rest as queries
        return memory(x, y, enqueue_mask=mask)

    run_memories(lambda: losses.CrossBatchMemory(losses.CircleLoss(), embedding_size=16, memory_size=60),
                 lambda: circle_loss.pml.CrossBatchMemory(circle_loss.pml.CircleLoss(), embedding_size=16,
                                                          memory_size=60),
                 [30, 30, 30], torch.float64, device, call)


@pytest.mark.parametrize("case", ["miner", "distance", "pml_loss"])
def test_cross_batch_memory_cases_through_pml_code(device, case):
    def make(loss_cls, memory_cls):
        distance = distances.CosineSimilarity(power=2) if case == "distance" else distances.CosineSimilarity()
        loss = (losses.CircleLoss if case == "pml_loss" else loss_cls)(distance=distance)
        miner = miners.MultiSimilarityMiner(epsilon=0.1) if case == "miner" else None
        return memory_cls(loss, embedding_size=16, memory_size=80, miner=miner)

    run_memories(lambda: make(losses.CircleLoss, losses.CrossBatchMemory),
                 lambda: make(circle_loss.pml.CircleLoss, circle_loss.pml.CrossBatchMemory),
                 [30, 30, 30], torch.float64, device)


def test_fused_path_is_taken_where_the_op_is_exact():
    loss_fn = circle_loss.pml.CircleLoss()
    x, y = make_inputs(10, 4, 2, "cpu")
    r, ry = make_inputs(12, 4, 2, "cpu")
    assert loss_fn._fused_call(x, y, None, x, y) is not None
    assert loss_fn._fused_call(x, y, None, r, ry) is not None
    assert loss_fn._fused_call(x, y, None, r[:10], y) is not None  # (i, i) across two sets, left out by position
    assert loss_fn._fused_call(x, y, None, r[:10], None) is not None  # ref_emb alone: the same pairs
    assert loss_fn._fused_call(x, y, None, r, None) is None  # PML's own columns [0, B) of ref_emb
    assert loss_fn._fused_call(x, y, (y, y, y, y), x, y) is None  # a miner's pairs
    assert loss_fn._fused_call(x, y.to(torch.complex64), None, x, y.to(torch.complex64)) is None
    x2, y2 = x[:2], y[:2]
    assert loss_fn._fused_call(x2, y2, None, x2, y2) is None  # PML's zero for <= 2 pairs


def _label_variants(batch, device):
    """Labels as PML users pass them: every dtype PML compares with ==,
    fractional and signed-zero floats, NaN (which matches nothing)."""
    base = torch.randint(0, 4, (batch,), device=device)
    fractional = torch.tensor([0.5, 0.7, -0.0, 0.0, 1e-3], device=device)[torch.randint(0, 5, (batch,))]
    with_nan = base.double()
    with_nan[::7] = math.nan
    variants = {str(dtype): base.to(dtype) for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8,
                                                       torch.float16, torch.bfloat16, torch.float32, torch.float64)}
    variants.update(bool=base > 1, fractional=fractional, fractional_float16=fractional.half(), nan=with_nan)
    return variants


def _run_both(call, inputs):
    """call(loss_fn, *leaves) with PML's class and with the drop-in: both
    raise the same type of error, or give the same losses and gradients."""
    outcomes = []
    for cls in (losses.CircleLoss, circle_loss.pml.CircleLoss):
        leaves = [x.detach().clone().requires_grad_() if x.dtype == torch.float64 else x for x in inputs]
        try:
            loss = call(cls(), *leaves)
            loss.backward()
            outcomes.append((loss.detach(), [x.grad for x in leaves if x.requires_grad]))
        except Exception as error:  # noqa: BLE001  (PML raises several types)
            outcomes.append(type(error))
    (expected, got) = outcomes
    if isinstance(expected, type) or isinstance(got, type):
        assert expected == got, outcomes
        return False
    assert relative_error(got[0], expected[0]) <= loss_tolerance(torch.float64), outcomes
    for g, e in zip(got[1], expected[1]):
        assert (g is None) == (e is None)
        if e is not None:
            assert relative_error(g, e, floor=1e-12) <= grad_tolerance(torch.float64)
    return True


@pytest.mark.parametrize("mode", ["labels", "ref_emb_and_labels", "ref_emb_alone", "ref_emb_alone_longer",
                                  "ref_emb_alone_shorter", "ref_labels_is_labels", "ref_labels_of_other_dtype"])
def test_drop_in_accepts_what_pml_accepts(device, mode, monkeypatch):
    # PML's input handling (BaseMetricLossFunction.forward, c_f.set_ref_emb,
    # get_matches_and_diffs) across label dtypes and reference modes: the
    # drop-in runs the op wherever it is exact and agrees with stock PML
    # everywhere, errors included.
    calls = []
    monkeypatch.setattr(circle_loss.pml, "anchor_loss", lambda *a: calls.append(a) or circle_loss.anchor_loss(*a))
    batch = 30
    x, _ = unnormalised(batch, 8, 1, device, torch.float64)
    r, _ = unnormalised({"ref_emb_alone_longer": 40, "ref_emb_alone_shorter": 20}.get(mode, batch), 8, 1, device,
                        torch.float64)
    for name, y in _label_variants(batch, device).items():
        ry = _label_variants(batch, device)[name]
        calls.clear()
        if mode == "labels":
            fused = _run_both(lambda f, x: f(x, y), [x])
        elif mode == "ref_emb_and_labels":
            fused = _run_both(lambda f, x, r: f(x, y, ref_emb=r, ref_labels=ry), [x, r])
        elif mode == "ref_emb_alone_shorter" and device.type == "cuda":
            # Stock PML indexes out of bounds on the device here, an assert
            # that ends the process's use of CUDA; the drop-in raises the
            # IndexError PML raises on the CPU.
            with pytest.raises(IndexError, match="ref_emb has 20 rows, fewer than the 30"):
                circle_loss.pml.CircleLoss()(x, y, ref_emb=r)
            fused = False
        elif mode.startswith("ref_emb_alone"):
            fused = _run_both(lambda f, x, r: f(x, y, ref_emb=r), [x, r])
        elif mode == "ref_labels_is_labels":
            fused = _run_both(lambda f, x, r: f(x, y, ref_emb=r, ref_labels=y), [x, r])
        else:
            other = ry.double() if not ry.is_floating_point() else ry.to(torch.int64)
            fused = _run_both(lambda f, x, r: f(x, y, ref_emb=r, ref_labels=other), [x, r])
        expected_calls = 0 if mode in ("ref_emb_alone_longer", "ref_emb_alone_shorter") else 1
        assert len(calls) == (expected_calls if fused else 0), (name, mode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_cross_batch_memory_with_floating_labels(device, dtype):
    # PML keeps the bank's labels in the labels' dtype; fractional ones are
    # classes of their own.
    def call(memory, x, y):
        return memory(x, (y.to(dtype) + 0.5) / 4)

    run_memories(lambda: losses.CrossBatchMemory(losses.CircleLoss(), embedding_size=16, memory_size=50),
                 lambda: circle_loss.pml.CrossBatchMemory(circle_loss.pml.CircleLoss(), embedding_size=16,
                                                          memory_size=50),
                 [20, 20, 20], torch.float64, device, call)


def test_class_name_and_pickling():
    loss_fn = circle_loss.pml.CircleLoss(m=0.3, gamma=64)
    assert type(loss_fn).__name__ == "CircleLoss"
    assert isinstance(loss_fn, losses.CircleLoss)
    clone = copy.deepcopy(loss_fn)
    assert clone.m == 0.3 and clone.gamma == 64


def test_import_circle_loss_does_not_need_pml():
    code = (
        "import sys; sys.modules['pytorch_metric_learning'] = None\n"
        "import circle_loss\n"
        "try:\n    import circle_loss.pml\nexcept ImportError:\n    print('pml optional')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "pml optional", out.stderr


def test_class_level_head_is_a_pml_classification_loss(device):
    # circle_loss.pml.ClassCircleLoss against the loss written from the math
    # on PML's own pieces: W (embedding_size, num_classes), cosine
    # normalisation of rows and classes, a miner's weights, the reducer,
    # PML's weight regularizer.
    from reference import class_loss_reference

    loss_fn = circle_loss.pml.ClassCircleLoss(40, 16, m=0.3, gamma=32,
                                              weight_regularizer=regularizers.RegularFaceRegularizer()).to(device)
    loss_fn.W.data = loss_fn.W.data.double()
    embeddings = torch.randn(64, 16, device=device, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 40, (64,), device=device)
    loss = loss_fn(embeddings, labels)
    loss.backward()
    rows = torch.nn.functional.normalize(embeddings.detach(), dim=1)
    classes = torch.nn.functional.normalize(loss_fn.W.detach().T, dim=1)
    expected = class_loss_reference(rows, labels, classes, 0.3, 32.0).mean()
    expected = expected + regularizers.RegularFaceRegularizer()(loss_fn.W.detach().T)
    assert relative_error(loss.detach(), expected) <= 1e-10
    assert loss_fn.W.grad is not None and embeddings.grad is not None
    # A miner's pairs weight the rows as PML weights its classification losses.
    miner_pairs = miners.MultiSimilarityMiner(epsilon=0.1)(embeddings.detach(), labels)
    weighted = circle_loss.pml.ClassCircleLoss(40, 16, m=0.3, gamma=32).to(device)
    weighted.W.data = loss_fn.W.data.clone()
    from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
    weights = lmu.convert_to_weights(miner_pairs, labels, dtype=torch.float64)
    expected = (class_loss_reference(rows, labels, classes, 0.3, 32.0) * weights).mean()
    assert relative_error(weighted(embeddings, labels, miner_pairs).detach(), expected) <= 1e-10
    assert loss_fn.get_logits(embeddings).shape == (64, 40)
    with pytest.raises(ValueError):
        loss_fn(embeddings, labels, ref_emb=embeddings)  # no ref_emb, as PML's classification losses
