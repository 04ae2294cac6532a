"""Diagnose the windowed backward's dK row error (bench FAIL, B1 H32 S16384
D128 causal window (4095, 0)): every key row of every head against a float64
reference, beside a bf16 math-path baseline, and the repeatability of dK."""
import sys
import torch
import hopper_flash as hf

S = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
H, D, W = 32, 128, 4095
dev = "cuda"
from hopper_flash.reference import random_qkv, attention_reference_grads
q, k, v = random_qkv(1, S, S, H, H, D, dtype=torch.bfloat16, seed=0, device=dev)  # the bench's inputs
gen = torch.Generator(device=dev).manual_seed(1)
do = torch.randn(1, S, H, D, generator=gen, device=dev).to(torch.bfloat16)
scale = D ** -0.5


def ours(det=False):
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = hf.flash_attn_func(qq, kk, vv, causal=True, window_size=(W, 0), deterministic=det)
    o.backward(do)
    return qq.grad, kk.grad, vv.grad


runs = [ours() for _ in range(3)]
det = ours(True)
for name, i in (("dq", 0), ("dk", 1), ("dv", 2)):
    same = all(torch.equal(runs[0][i], r[i]) for r in runs[1:])
    print(f"{name}: 3 runs bitwise equal: {same}; det vs default max diff "
          f"{(det[i].float() - runs[0][i].float()).abs().max().item():.3e}")
i = torch.arange(S, device=dev)
vis = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - W)
worst = []
o_ours, lse_o = hf.flash_attn_func(q, k, v, causal=True, window_size=(W, 0), return_lse=True)
lse_ref, p_last, dp_last, d_ours, ds_last = (torch.zeros(H, dtype=torch.float64, device=dev) for _ in range(5))
for h in range(H):
    Q, K, V, DO = (t[0, :, h].double() for t in (q, k, v, do))
    s = (Q @ K.T) * scale
    s.masked_fill_(~vis, float("-inf"))
    lse_ref[h] = torch.logsumexp(s[S - 1], -1)
    p = torch.softmax(s, -1); del s
    p_last[h] = p[S - 1, S - 1]
    o = p @ V
    dp = DO @ V.T
    dd = (DO * o).sum(-1, keepdim=True)
    dp_last[h] = dp[S - 1, S - 1]
    d_ours[h] = (DO[S - 1] * o_ours[0, S - 1, h].double()).sum()
    ds = p * (dp - dd); del dp
    ds_last[h] = ds[S - 1, S - 1]
    dk_ref = scale * ds.T @ Q
    # bf16 baseline
    Qb, Kb, Vb, DOb = (t[0, :, h] for t in (q, k, v, do))
    pb = p.to(torch.bfloat16); dsb = ds.to(torch.bfloat16); del p, ds
    dk_b = (scale * (dsb.T.float() @ Qb.float())).to(torch.bfloat16).double()
    rn = dk_ref.norm(dim=-1)
    for tag, x in (("ours", runs[0][1][0, :, h].double()), ("det", det[1][0, :, h].double()), ("base", dk_b)):
        rr = (x - dk_ref).norm(dim=-1) / rn
        j = int(rr.argmax())
        worst.append((float(rr[j]), tag, h, j, float(rn[j])))
    del dsb, pb
    if h in (17, 26):
        j = S - 1
        dk_o = runs[0][1][0, j, h].double()
        ds_ours = float((dk_o * Q[j]).sum() / (scale * (Q[j] * Q[j]).sum()))
        print(f"h{h} last key: P={float(p_last[h]):.6e} dP={float(dp_last[h]):.6e} D={float(dd[j]):.6e} "
              f"D(ours O)={float(d_ours[h]):.6e} lse_ref={float(lse_ref[h]):.8f} lse_ours={float(lse_o[0, h, j]):.8f} "
              f"dS_ref={float(ds_last[h]):.6e} dS_ours~{ds_ours:.6e}")
    if h == 17:
        kr = torch.tensor([511], device=dev)
        lib = attention_reference_grads(q, k, v, do, causal=True, softmax_scale=scale, rows=kr, key_rows=kr,
                                        window=(W, 0))[1][0, 0, h]
        print("h17 key 511: ref", dk_ref[511, :4].tolist(), "lib ref", lib[:4].tolist(),
              "ours", runs[0][1][0, 511, h, :4].tolist(), "refnorm", float(rn[511]),
              "ours rel", float((runs[0][1][0, 511, h].double() - dk_ref[511]).norm() / rn[511]),
              "lib-vs-ref rel", float((lib - dk_ref[511]).norm() / rn[511]))
worst.sort(reverse=True)
for tag in ("ours", "det", "base"):
    w = [x for x in worst if x[1] == tag][:6]
    print(tag, " ".join(f"h{h} row{j} rel={r:.2e} refnorm={n:.2e}" for r, _, h, j, n in w))
