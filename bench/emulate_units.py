"""CPU: the tile pipeline's float32 arithmetic, log2 units against natural units, for the failing draw of
test_float32_split_tiles_match_reference and others, on S rounded once from float64 and on S from the 3xTF32 split
(float32 GEMMs of the parts); G = (W + Wᵀ)·F in float32 as cuBLAS would."""
import math, sys, torch
sys.path.insert(0, "tests")
from conftest import make_inputs
from reference import reference_loss_and_grad, relative_error
LOG2E = 1.4426950408889634
m, g = 0.25, 256.0
F32 = torch.float32


def c32(v):
    return torch.tensor(v, dtype=F32)


def tf32_round(x):
    bits = x.view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def similarities(f64, split):
    if not split:
        return (f64 @ f64.T).to(F32)
    f = f64.to(F32)
    big = tf32_round(f)
    small = tf32_round(f - big)
    return (small @ big.T + big @ small.T) + big @ big.T


def run(f64, y, units, split=False):
    s = similarities(f64, split)
    pos = y[:, None] == y[None, :]
    unit = LOG2E if units == "log2" else 1.0
    shg, sm, s1m = c32(0.5 * g * unit), c32(0.5 * g * unit * m), c32(0.5 * g * unit * (1 - m))
    t = torch.where(pos, c32(1 + m) - s, s + c32(m))
    # fmaf: the product and sum in float64, rounded once
    v = torch.where(pos, (s.double() * -shg.double() + s1m.double()).to(F32), (s.double() * shg.double() - sm.double()).to(F32))
    ta = t + t.abs()
    u = ta * v
    lse = []
    for mask in (pos, ~pos):
        uu = u[mask]
        mx = uu.max()
        if units == "log2":
            total = torch.exp2((uu - mx).double() ).sum().item()  # terms from float differences
            lse.append(float(mx * c32(math.log(2.0))) + math.log(total))
        else:
            total = torch.exp2(((uu - mx) * c32(LOG2E)).double()).sum().item()
            lse.append(float(mx) + math.log(total))
    z = lse[0] + lse[1]
    scale = 1.0 / (1.0 + math.exp(-z))
    w = torch.zeros_like(s)
    for k, mask in enumerate((pos, ~pos)):
        if units == "log2":
            off = c32(-float(c32(lse[k]))) * c32(LOG2E)
            e = u + off
        else:
            hi = c32(-lse[k]); lo = c32(-lse[k] - float(hi))
            e = ((u + hi) + lo) * c32(LOG2E)
        factor = c32((-0.5 if k == 0 else 0.5) * scale * g)
        w = torch.where(mask, ta * torch.exp2(e) * factor, w)
    return (w + w.T) @ f64.to(F32)


for seed, (B, D, C) in ((14458026552316430665, (4500, 30, 2)), (2, (4500, 30, 2)), (3, (4500, 30, 2)), (1, (4096, 512, 10))):
    torch.manual_seed(seed)
    f, y = make_inputs(B, D, C, "cpu", torch.float64)
    ref_loss, ref_grad = reference_loss_and_grad(f, y)
    _, g32 = reference_loss_and_grad(f.float(), y, dtype=torch.float32)
    cells = []
    for split in (False, True):
        for units in ("log2", "natural"):
            cells.append(f"{'split S' if split else 'S'}, {units} {relative_error(run(f, y, units, split), ref_grad):.1e}")
    print(f"seed {seed} {B},{D},{C}: plain f32 {relative_error(g32, ref_grad):.1e} | " + " | ".join(cells), flush=True)
