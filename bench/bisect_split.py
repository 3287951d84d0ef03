"""The failing draw of test_float32_split_tiles_match_reference[4500-30-2-0] (and a D = 512 draw): the op's gradient
error, its LSEs against float64, and the block gradient given float64 scalars: forward's LSE or backward's W?"""
import sys
import torch
import torch.nn.functional as F
sys.path.insert(0, "tests")
import circle_loss  # noqa: F401
from conftest import make_inputs
from reference import reference_loss_and_grad, relative_error

m, g = 0.25, 256.0


def ref_scalars(f, y):
    f = f.double()
    s = f @ f.T
    pos = y[:, None] == y[None, :]
    sp, sn = s[pos], s[~pos]
    zp = -g * torch.clamp_min(1 + m - sp, 0) * (sp - (1 - m))
    zn = g * torch.clamp_min(sn + m, 0) * (sn - m)
    lp, ln = torch.logsumexp(zp, 0), torch.logsumexp(zn, 0)
    z = lp + ln
    return torch.stack([lp, ln, F.softplus(z, threshold=40.0), 2 * torch.sigmoid(z)])


for label, seed, (B, D, C) in (("failing draw", 14458026552316430665, (4500, 30, 2)), ("D=512", 1, (4096, 512, 10)),
                               ("D=30 other", 2, (4500, 30, 2))):
    torch.manual_seed(seed)
    f, y = make_inputs(B, D, C, "cuda")
    ref_loss, ref_grad = reference_loss_and_grad(f, y)
    _, g32 = reference_loss_and_grad(f, y, dtype=torch.float32)
    x = f.clone().requires_grad_()
    loss = torch.ops.circle.loss(x, y)
    (grad,) = torch.autograd.grad(loss, x)
    rs = ref_scalars(f, y)
    sc = torch.ops.circle._lse_finish(torch.ops.circle._lse_partials(f, y, f, y, m, g)[None])
    bg_exact = torch.ops.circle._block_grad(f, y, f, y, rs, m, g)
    bg_own = torch.ops.circle._block_grad(f, y, f, y, sc, m, g)
    print(f"{label}: op grad {relative_error(grad, ref_grad):.2e} (plain float32 {relative_error(g32, ref_grad):.2e}), "
          f"loss {relative_error(loss, ref_loss):.1e} | LSE_P {float(sc[0] - rs[0]):+.2e} LSE_N {float(sc[1] - rs[1]):+.2e} "
          f"2σ(Z) rel {float(sc[3] / rs[3] - 1):+.1e} | block grad, float64 scalars {relative_error(bg_exact, ref_grad):.2e}, "
          f"own scalars {relative_error(bg_own, ref_grad):.2e}", flush=True)
