"""circle_loss.distributed in real multi-process runs (gloo on CPU, NCCL on two
GPUs): every rank gets the global batch's loss, and the ranks' gradients put
together are the whole batch's gradient, both as the float64 reference has them."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import circle_loss
import circle_loss.distributed
from distributed_worker import MIXED_GRAD_CASES, ddp_case, global_batch, mixed_grad_sizes, split_sizes
from reference import assert_matches_reference, reference_loss_and_grad, relative_error

WORKER = Path(__file__).with_name("distributed_worker.py")


def free_port() -> int:
    # Port 0: the kernel picks one no other run holds right now.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world, out_dir, extra=()):
    port = free_port()
    # NVLink multicast stays off: on shared machines it can take the GPUs down.
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(port), str(out_dir), *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


def check_against_reference(results, world, device):
    # Against the float64 reference, not the single-process op: in float32 two
    # exact implementations differ by their own rounding, amplified by gamma.
    sizes = split_sizes(300, world)
    assert (0 in sizes) == (world >= 3)
    for dtype in (torch.float64, torch.float32):
        features, labels = global_batch(300, 32, dtype, device)
        grads = []
        for r, result in enumerate(results):
            got = result[str(dtype)]
            assert torch.equal(got["loss"], results[0][str(dtype)]["loss"])  # every rank: the same bits
            assert torch.equal(got["no_grad_loss"], got["loss"])
            assert torch.equal(got["autocast_loss"], got["loss"])  # autocast leaves the op's arithmetic alone
            assert got["grad"].shape == (sizes[r], 32)
            grads.append(got["grad"].to(device))
        loss = results[0][str(dtype)]["loss"].to(device)
        assert_matches_reference(loss, torch.cat(grads), features, labels, 0.25, 64.0)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_ranks_match_reference(world, tmp_path):
    check_against_reference(run_ranks(world, tmp_path), world, "cpu")


@pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(), reason="needs 2 GPUs and NCCL")
def test_nccl_ranks_match_reference(tmp_path):
    results = run_ranks(2, tmp_path, extra=("--backend", "nccl", "--device", "cuda"))
    check_against_reference(results, 2, "cuda")


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
def test_ranks_that_disagree_all_get_the_same_clear_error(tmp_path):
    results = run_ranks(2, tmp_path, extra=("--refusals",))
    expected = {
        "dim": "D by rank: [8, 16]",
        "dtype": "dtype by rank: ['torch.float32', 'torch.float64']",
        "margin": "margin by rank: [0.25, 0.3]",
        "gamma": "gamma by rank: [64.0, 32.0]",
        "labels": "bad input on rank(s) [1]",
        "double_backward": "does not support double backward",
        "reduce_grads loss": "reduce_grads by rank: ['mean', 'sum']",
        "reduce_grads anchor_loss": "reduce_grads by rank: ['mean', 'sum']",
        "reduce_grads_invalid loss": "bad input on rank(s) [1]",
        "reduce_grads_invalid anchor_loss": "bad input on rank(s) [1]",
    }
    own_error = {"labels": "labels must have one entry per row",
                 "reduce_grads_invalid loss": "reduce_grads must be 'mean'",
                 "reduce_grads_invalid anchor_loss": "reduce_grads must be 'mean'"}
    for name, text in expected.items():
        for rank, messages in enumerate(results):
            wanted = own_error[name] if rank == 1 and name in own_error else text
            assert wanted in messages[name], (name, rank, messages[name])


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_disagree_on_needing_a_gradient_all_finish(world, tmp_path):
    # Rank 1's rows need no gradient (a plain empty shard, rows without
    # requires_grad, a call under no_grad) while the other ranks' do: every
    # rank returns the global loss and the others get their rows' gradient,
    # where a rank that skipped the gradient's ring would leave them waiting.
    results = run_ranks(world, tmp_path, extra=("--mixed-grad",))
    sizes = mixed_grad_sizes(world)
    features, labels = global_batch(sum(sizes), 8, torch.float64, "cpu")
    expected_loss, expected_grad = reference_loss_and_grad(features, labels, 0.25, 64.0)
    for case in MIXED_GRAD_CASES:
        for rank, result in enumerate(results):
            loss, grad = result[case]
            assert torch.allclose(loss, expected_loss, rtol=1e-10, atol=0), (case, rank, loss, expected_loss)
            if rank == 1:
                assert grad is None, case
            else:
                first = sum(sizes[:rank])
                assert torch.allclose(grad, expected_grad[first : first + sizes[rank]], rtol=1e-8, atol=1e-12), case


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_class_head_matches_the_single_process_head(world, tmp_path):
    results = run_ranks(world, tmp_path, extra=("--class-head",))
    sizes = mixed_grad_sizes(world)
    generator = torch.Generator().manual_seed(99)
    embeddings = torch.randn(sum(sizes), 16, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 1000, (sum(sizes),), generator=generator)
    weight = torch.randn(1000, 16, generator=generator, dtype=torch.float64)
    ranges = [result[str(torch.float64)]["class_range"] for result in results]
    assert ranges == [(int(s[0]), int(s[-1]) + 1) if len(s) else ranges[r]
                      for r, s in enumerate(torch.tensor_split(torch.arange(1000), world))]
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
        head = circle_loss.ClassCircleLoss(1000, 16, margin=0.25, gamma=64.0).to(dtype)
        with torch.no_grad():
            head.weight.copy_(weight)
        rows = embeddings.to(dtype).clone().requires_grad_()
        expected = head(rows, labels)
        expected.backward()
        grads = torch.cat([result[str(dtype)]["grad"] for result in results])
        weight_grads = torch.cat([result[str(dtype)]["weight_grad"] for result in results])
        for result in results:
            assert torch.equal(result[str(dtype)]["loss"], results[0][str(dtype)]["loss"])  # the same bits
            assert relative_error(result[str(dtype)]["loss"], expected) <= tol
        assert relative_error(grads, rows.grad) <= 10 * tol
        assert relative_error(weight_grads, head.weight.grad) <= 10 * tol
    # Rows labelled ignore_index leave the mean; bfloat16 rows train float32 weights.
    ignored = labels.clone()
    ignored[::3] = -100
    head = circle_loss.ClassCircleLoss(1000, 16, margin=0.25, gamma=64.0).double()
    with torch.no_grad():
        head.weight.copy_(weight)
    rows = embeddings.clone().requires_grad_()
    expected = head(rows, ignored)
    expected.backward()
    for dtype, tol in ((torch.float64, 1e-10), (torch.bfloat16, 2 * torch.finfo(torch.bfloat16).eps)):
        got = [result[f"ignored {dtype}"] for result in results]
        weight_dtype = "torch.float64" if dtype == torch.float64 else "torch.float32"
        assert all(g["weight_dtype"] == weight_dtype for g in got)  # its gradient in its own dtype
        assert relative_error(got[0]["loss"], expected) <= tol
        assert relative_error(torch.cat([g["grad"] for g in got]), rows.grad) <= 10 * tol
        assert relative_error(torch.cat([g["weight_grad"] for g in got]).double(), head.weight.grad) <= 10 * tol
    # Partial FC on every shard against the float64 reference on the union of
    # the kept classes: every positive kept, int(0.3 · shard) classes a shard.
    from reference import class_loss_reference

    sampled = labels % 150
    got = [result["sampled"] for result in results]
    shards = torch.tensor_split(torch.arange(1000), world)
    positives = [len(set(sampled.tolist()) & set(shard.tolist())) for shard in shards]  # where many, them alone
    assert [len(g["kept"]) for g in got] == [max(int(0.3 * len(s)), p) for s, p in zip(shards, positives)]
    kept = torch.cat([g["kept"] for g in got])
    assert set(sampled.tolist()) <= set(kept.tolist()) and len(set(kept.tolist())) == len(kept)
    e = embeddings.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    expected = class_loss_reference(F.normalize(e, dim=1), torch.searchsorted(kept, sampled),
                                    F.normalize(w[kept], dim=1), 0.25, 64.0).mean()
    expected.backward()
    for g in got:
        assert relative_error(g["loss"], expected) <= 1e-10
    assert relative_error(torch.cat([g["grad"] for g in got]), e.grad) <= 1e-9
    assert torch.equal(torch.cat([g["weight_grad"] for g in got]) != 0, w.grad != 0)  # the kept rows alone
    assert relative_error(torch.cat([g["weight_grad"] for g in got]), w.grad) <= 1e-9
    # Alike seeds, shards apart; the default generators still in step.
    initial = torch.cat([result["initial"]["weight"] for result in results])
    assert initial.shape == (1001, 16) and torch.unique(initial, dim=0).shape[0] == 1001
    assert all(torch.equal(result["initial"]["next_draw"], results[0]["initial"]["next_draw"]) for result in results)
    messages = [result["messages"] for result in results]
    for name, text in (("num_classes", "num_classes by rank"), ("margin", "margin by rank"), ("width", "D by rank")):
        for rank in range(world):
            assert text in messages[rank][name], (name, rank, messages[rank][name])
    # Bad input on rank 1 alone: its own error there, the others told where to look.
    for name, text in (("1-D", "embeddings must be a 2-D tensor"), ("empty", "embeddings must be a 2-D tensor"),
                       ("integer", "embeddings must be float32"), ("label", "labels must lie in [0, num_classes = 40)")):
        for rank in range(world):
            expected_text = f"rank 1: {text}" if rank == 1 else "bad input on rank(s) [1]"
            assert expected_text in messages[rank][name], (name, rank, messages[rank][name])


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
@pytest.mark.parametrize("world", [2, 3, 4])
def test_per_anchor_ranks_match_the_single_process_op(world, tmp_path):
    results = run_ranks(world, tmp_path, extra=("--per-anchor",))
    sizes = mixed_grad_sizes(world)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
        features, labels = global_batch(sum(sizes), 8, dtype, "cpu")
        incoming = torch.linspace(0.5, 1.5, sum(sizes), dtype=dtype)
        x = features.clone().requires_grad_()
        expected = circle_loss.anchor_loss(x, labels, margin=0.4, gamma=80.0)
        (expected * incoming).sum().backward()
        losses = torch.cat([r[str(dtype)]["losses"] for r in results])
        grads = torch.cat([r[str(dtype)]["grad"] for r in results])
        assert relative_error(losses, expected) <= tol
        assert relative_error(grads, x.grad) <= 10 * tol
        assert torch.equal(torch.cat([r[str(dtype)]["no_grad"] for r in results]), losses)
        x = features.clone().requires_grad_()
        mean = circle_loss.AnchorCircleLoss(0.4, 80.0)(x, labels)
        mean.backward()
        for r in results:
            assert torch.equal(r[str(dtype)]["mean"], results[0][str(dtype)]["mean"])  # the same bits on every rank
            assert relative_error(r[str(dtype)]["mean"], mean) <= tol
        assert relative_error(torch.cat([r[str(dtype)]["mean_grad"] for r in results]), x.grad) <= 10 * tol
    for r in results:  # the same clear error on every rank, never a hang
        assert "needs a gradient by rank: [True, False" in r["disagreement"], r["disagreement"]
        assert "margin by rank: [0.4, 0.5" in r["margin"], r["margin"]
        assert "D by rank: [8, 4" in r["width"], r["width"]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
@pytest.mark.parametrize("world", [2, 3])
def test_pml_wrapper_drop_in_matches_stock(world, tmp_path):
    pytest.importorskip("pytorch_metric_learning")
    results = run_ranks(world, tmp_path, extra=("--pml-wrapper",))
    for result in results:
        for case, (stock, ours, fused_calls) in result.items():
            # The drop-in CircleLoss runs the op in both modes (inside
            # CrossBatchMemory too, which PML refuses with efficient=True);
            # other losses never reach it.
            name, efficient, _ = case
            refused = name == "CrossBatchMemory" and efficient
            assert (fused_calls > 0) == (name != "ContrastiveLoss" and not refused), (case, fused_calls)
            assert isinstance(stock, str) == refused, (case, stock)
            if isinstance(stock, str) or isinstance(ours, str):
                assert stock == ours, (case, stock, ours)  # the same error
                continue
            assert relative_error(ours[0], stock[0]) <= 1e-10, (case, ours[0], stock[0])
            assert relative_error(ours[1], stock[1], floor=1e-12) <= 1e-8, case


def test_bad_input_is_refused_before_any_collective():
    # No process group at all: the checks must fire first.
    with pytest.raises(RuntimeError, match="labels must have one entry per row"):
        circle_loss.distributed.loss(torch.randn(4, 3), torch.zeros(5, dtype=torch.long))
    with pytest.raises(RuntimeError, match="gamma must be a finite float"):
        circle_loss.distributed.loss(torch.randn(4, 3), torch.zeros(4, dtype=torch.long), gamma=float("inf"))


# float16/bfloat16: on CUDA the blocks' rectangular products run on the
# tensor-core tiles (ops/cuda/mma_tiles.cuh), rows and columns ending mid-tile.
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.sanitize
def test_block_ops_compose_to_the_op(device, dtype):
    features, labels = global_batch(130, 16, dtype, device)
    halves = [(features[:50], labels[:50]), (features[50:], labels[50:])]
    partials = torch.stack([torch.ops.circle._lse_partials(r, rl, c, cl, 0.25, 64.0)
                            for r, rl in halves for c, cl in halves])
    scalars = torch.ops.circle._lse_finish(partials)
    grad = torch.cat([sum(torch.ops.circle._block_grad(r, rl, c, cl, scalars, 0.25, 64.0) for c, cl in halves)
                      for r, rl in halves])
    assert_matches_reference(scalars[2].to(dtype), grad.to(dtype), features, labels, 0.25, 64.0)


def test_block_ops_opcheck(device):
    rows, row_labels = global_batch(40, 8, torch.float32, device)
    cols, col_labels = rows[:25].clone(), row_labels[:25].clone()
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.circle._lse_partials.default, (rows, row_labels, cols, col_labels, 0.25, 64.0), test_utils=tests)
    partials = torch.ops.circle._lse_partials(rows, row_labels, cols, col_labels, 0.25, 64.0)
    scalars = torch.ops.circle._lse_finish(partials[None])
    torch.library.opcheck(torch.ops.circle._lse_finish.default, (partials[None],), test_utils=tests)
    torch.library.opcheck(torch.ops.circle._block_grad.default, (rows, row_labels, cols, col_labels, scalars, 0.25, 64.0), test_utils=tests)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
@pytest.mark.parametrize("world", [2, 3])
def test_ddp_recipe_trains_as_one_process(world, tmp_path):
    # Backbone under DDP, the form (the class-level head outside DDP), a
    # plain backward: after DDP's all-reduce every rank's backbone gradient
    # is the single process's on the whole batch (reduce_grads="mean", the
    # default), the head's the single head's, the loss the global loss.
    results = run_ranks(world, tmp_path, extra=("--ddp",))
    for form in ("loss", "anchor", "class"):
        inputs, labels, backbone, head, loss_of = ddp_case(form, 0)
        expected = loss_of(backbone(inputs), labels)
        expected.backward()
        for result in results:
            got = result[form]
            assert relative_error(got["loss"], expected) <= 1e-12, form
            for mine, theirs in zip(got["grads"], backbone.parameters()):
                assert relative_error(mine, theirs.grad) <= 1e-10, form
        if head is not None:
            assert relative_error(torch.cat([r[form]["head_grad"] for r in results]), head.weight.grad) <= 1e-10
