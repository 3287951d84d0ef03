"""CPU: circle::loss's tile-epilogue arithmetic in float32 (log2 units, scaled constants, the LSE offset rounded to
float after ×log2(e)) on an exact S, against float64 and against plain float32 PyTorch: is the epilogue what puts
the float32 split path at ~3.7× plain float32's gradient error? Also the offset carried as a hi/lo pair."""
import math
import sys
import torch
import torch.nn.functional as F
sys.path.insert(0, "tests")
from reference import reference_loss_and_grad, relative_error

LOG2E = 1.4426950408889634
m, gamma = 0.25, 256.0


def f32(x):
    return x.to(torch.float32)


def epilogue_grad(s64, labels, f64, offset_mode):
    s = f32(s64)
    pos = labels[:, None] == labels[None, :]
    one = torch.tensor(1.0, dtype=torch.float32)
    g = f32(torch.tensor(gamma))
    shg = f32(torch.tensor(0.5 * gamma * LOG2E))  # float constants as TileLogit rounds them
    sm = f32(torch.tensor(0.5 * gamma * LOG2E * m))
    s1m = f32(torch.tensor(0.5 * gamma * LOG2E * (1 - m)))
    t = torch.where(pos, f32(torch.tensor(1 + m)) - s, s + f32(torch.tensor(m)))
    v = torch.where(pos, f32(s.double() * -shg.double() + s1m.double()), f32(s.double() * shg.double() - sm.double()))
    ta = t + t.abs()
    u = ta * v  # float32, log2 units
    # LSE per set from these u, as the forward folds them (max in float, sums exact here), in natural units.
    lse = []
    for mask in (pos, ~pos):
        uu = u[mask].double()
        mx = uu.max()
        lse2 = mx + torch.log2(torch.exp2(uu - mx).sum())
        lse.append(float(f32(mx) * f32(torch.tensor(math.log(2.0)))) + math.log(float(torch.exp2(uu - mx).sum())))
    z = lse[0] + lse[1]
    scale = 2.0 / (1.0 + math.exp(-z))  # 2σ(Z)... d softplus(Z)/dZ = σ(Z); the op's 2σ(Z) with ta = 2α
    w = torch.zeros_like(s64)
    for k, mask in enumerate((pos, ~pos)):
        if offset_mode == "float":
            off = f32(torch.tensor(-float(f32(torch.tensor(lse[k]))) )) * f32(torch.tensor(LOG2E))
            e = f32(u + f32(off))
        else:  # hi/lo in float
            exact = -lse[k] * LOG2E
            hi = f32(torch.tensor(exact))
            lo = f32(torch.tensor(exact - float(hi)))
            e = f32(f32(u + hi) + lo)
        sign = -0.5 if k == 0 else 0.5
        w = torch.where(mask, ta.double() * torch.exp2(e.double()) * (sign * scale / 2 * gamma), w)
    return (w + w.T) @ f64


torch.manual_seed(0)
for B, D, classes in ((2000, 512, 10), (2000, 30, 2), (2000, 130, 100)):
    for seed in range(3):
        torch.manual_seed(seed)
        f64 = F.normalize(torch.randn(B, D, dtype=torch.float64), dim=1)
        y = torch.randint(0, classes, (B,))
        ref_loss, ref_grad = reference_loss_and_grad(f64, y)
        _, g32 = reference_loss_and_grad(f64.float(), y, dtype=torch.float32)
        s64 = f64 @ f64.T
        ga = epilogue_grad(s64, y, f64, "float")
        gb = epilogue_grad(s64, y, f64, "hilo")
        plain = relative_error(g32, ref_grad)
        print(f"B={B} D={D} {classes} classes seed {seed}: plain float32 {plain:.1e} | epilogue, float offset "
              f"{relative_error(ga, ref_grad):.1e} | hi/lo offset {relative_error(gb, ref_grad):.1e}", flush=True)
