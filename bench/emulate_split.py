"""Emulated split products (cuBLAS TF32 tensor cores on parts exact in TF32) against float64: circle::loss's loss and
gradient from each S, relative errors, and their ratio to plain float32 (SGEMM S). gamma = 256, margin = 0.25."""
import sys
import torch
import torch.nn.functional as F
sys.path.insert(0, "tests")
from reference import reference_loss_and_grad, relative_error


def tf32_round(x):  # to nearest, ties away, as round_to_tf32
    b = x.view(torch.int32)
    finite = (b & 0x7F800000) != 0x7F800000
    r = torch.where(finite, (b + 0x1000) & ~0x1FFF, b)
    return r.view(torch.float32)


def parts(x, kind):
    if kind == "tf32":
        big = tf32_round(x)
        small = tf32_round(x - big)
        return [big, small]
    b1 = x.bfloat16().float()
    r1 = x - b1
    b2 = r1.bfloat16().float()
    b3 = (r1 - b2).bfloat16().float()
    return [b1, b2, b3]


def split_s(f, kind, pairs):
    p = parts(f, kind)
    torch.backends.cuda.matmul.allow_tf32 = True
    s = torch.zeros(f.shape[0], f.shape[0], device=f.device)
    for i, j in pairs:  # small first
        s += p[i] @ p[j].T
    torch.backends.cuda.matmul.allow_tf32 = False
    return s


def loss_grad_from_s(s, labels, f, margin=0.25, gamma=256.0):
    s = s.detach().requires_grad_()
    positive = labels[:, None] == labels[None, :]
    sp, sn = s[positive], s[~positive]
    zp = -gamma * torch.clamp_min(1 + margin - sp.detach(), 0) * (sp - (1 - margin))
    zn = gamma * torch.clamp_min(sn.detach() + margin, 0) * (sn - margin)
    loss = F.softplus(torch.logsumexp(zn, 0) + torch.logsumexp(zp, 0), threshold=40.0)
    (ds,) = torch.autograd.grad(loss, s)
    return loss.detach(), (ds + ds.T) @ f


SCHEMES = {
    "3xTF32": ("tf32", [(1, 0), (0, 1), (0, 0)]),
    "4xTF32": ("tf32", [(1, 1), (1, 0), (0, 1), (0, 0)]),
    "bf16x3, 6": ("bf16", [(1, 1), (0, 2), (2, 0), (1, 0), (0, 1), (0, 0)]),
    "bf16x3, 5": ("bf16", [(0, 2), (2, 0), (1, 0), (0, 1), (0, 0)]),
}
torch.backends.cuda.matmul.allow_tf32 = False
for B, D, classes in ((4500, 30, 2), (4096, 512, 10), (2000, 130, 100), (4096, 2048, 10), (4500, 24, 60)):
    worst = {k: 0.0 for k in SCHEMES}
    for seed in range(4):
        torch.manual_seed(seed)
        f64 = F.normalize(torch.randn(B, D, dtype=torch.float64), dim=1).cuda()
        y = torch.randint(0, classes, (B,)).cuda()
        ref_loss, ref_grad = reference_loss_and_grad(f64, y)
        f = f64.float()
        l0, g0 = loss_grad_from_s(f @ f.T, y, f)
        plain = relative_error(g0, ref_grad)
        row = [f"plain loss {relative_error(l0, ref_loss):.1e} grad {plain:.1e}"]
        for name, (kind, pairs) in SCHEMES.items():
            l, g = loss_grad_from_s(split_s(f, kind, pairs), y, f)
            e = relative_error(g, ref_grad)
            worst[name] = max(worst[name], e / plain)
            row.append(f"{name}: loss {relative_error(l, ref_loss):.1e} grad {e:.1e} ({e / plain:.2f}x)")
        print(f"B={B} D={D} {classes} classes seed {seed} | " + " | ".join(row), flush=True)
    print(f"  worst grad ratio to plain: " + ", ".join(f"{k} {v:.2f}" for k, v in worst.items()), flush=True)
