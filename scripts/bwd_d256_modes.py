"""Usage: PYTHONPATH=PKG python -P scripts/bwd_d256_modes.py

Backward time (ms, do_bench median) of the package on sys.path: D=256
deterministic and default, causal and not, B4 H16 S8192; and a varlen D=256
batch (16 sequences, lengths 512..4096, fixed seed)."""
import torch, hopper_flash
from triton.testing import do_bench
print("pkg", hopper_flash.__file__)
torch.manual_seed(0)
def t(fn):
    return do_bench(fn, warmup=30, rep=150, return_mode="median")
for causal in (True, False):
    q, k, v = (torch.randn(4, 8192, 16, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    for det in (False, True):
        o = hopper_flash.flash_attn_func(q, k, v, causal=causal, deterministic=det)
        g = torch.randn_like(o)
        ms = t(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True))
        fl = 4 * 4 * 16 * 8192 * 8192 * 256 * 2.5 / (2 if causal else 1)
        print(f"D256 causal={causal} det={det}: {ms:.3f} ms {fl / ms / 1e9:.0f} TFLOP/s", flush=True)
lens = torch.randint(512, 4097, (16,), generator=torch.Generator().manual_seed(1))
cu = torch.zeros(17, dtype=torch.int32); cu[1:] = lens.cumsum(0)
cu = cu.cuda(); T = int(lens.sum()); mx = int(lens.max())
fl = sum(4 * 16 * int(L) * int(L) * 256 * 2.5 / 2 for L in lens)
for causal in (True, False):
    q, k, v = (torch.randn(T, 16, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    o = hopper_flash.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=causal)
    g = torch.randn_like(o)
    ms = t(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True))
    print(f"varlen D256 causal={causal}: {ms:.3f} ms {fl * (1 if causal else 2) / ms / 1e9:.0f} TFLOP/s", flush=True)
