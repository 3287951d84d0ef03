"""CPU, float64: how the gradient of circle::loss moves when only its LSEs are rounded to float32 (natural units),
or carried as the tile epilogue carries them (the offset -LSE·log2(e) rounded to float32 in log2 units)."""
import math, sys, torch
sys.path.insert(0, "tests")
from conftest import make_inputs
from reference import reference_loss_and_grad, relative_error
LOG2E = 1.4426950408889634
m, g = 0.25, 256.0
for seed, (B, D, C) in ((14458026552316430665, (4500, 30, 2)), (2, (4500, 30, 2)), (1, (4096, 512, 10))):
    torch.manual_seed(seed)
    f, y = make_inputs(B, D, C, "cpu", torch.float64)
    ref_loss, ref_grad = reference_loss_and_grad(f, y)
    _, g32 = reference_loss_and_grad(f.float(), y, dtype=torch.float32)
    s = f @ f.T
    pos = y[:, None] == y[None, :]
    ap = torch.clamp_min(1 + m - s, 0); an = torch.clamp_min(s + m, 0)
    z = torch.where(pos, -g * ap * (s - (1 - m)), g * an * (s - m))
    slope = torch.where(pos, -g * ap, g * an)
    lse = [torch.logsumexp(z[pos], 0).item(), torch.logsumexp(z[~pos], 0).item()]
    Z = lse[0] + lse[1]
    sig = 1 / (1 + math.exp(-Z))
    def grad_with(wexp):
        w = sig * torch.exp(wexp) * slope
        return (w + w.T) @ f
    f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))
    off = torch.where(pos, torch.tensor(lse[0], dtype=torch.float64), torch.tensor(lse[1], dtype=torch.float64))
    e1 = grad_with(z - off)
    off32 = torch.where(pos, torch.tensor(f32(lse[0]), dtype=torch.float64), torch.tensor(f32(lse[1]), dtype=torch.float64))
    e2 = grad_with(z - off32)
    offl2 = torch.where(pos, torch.tensor(f32(f32(-f32(lse[0])) * f32(LOG2E)), dtype=torch.float64), torch.tensor(f32(f32(-f32(lse[1])) * f32(LOG2E)), dtype=torch.float64))
    e3 = grad_with((z * LOG2E + offl2) / LOG2E)
    print(f"seed {seed} {B},{D},{C}: LSE {lse[0]:.1f}/{lse[1]:.1f} | plain f32 {relative_error(g32, ref_grad):.1e} | exact {relative_error(e1, ref_grad):.1e} "
          f"| LSE in float32 {relative_error(e2, ref_grad):.1e} | offset in log2 float32 {relative_error(e3, ref_grad):.1e}", flush=True)
