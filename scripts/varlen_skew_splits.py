"""Probe (fifty-eighth session): a packed batch whose keys are skewed, many
short decodes beside one long one, timed at explicit split counts. The
varlen split heuristic sees max_seqlen_k and the item count only: 65
sequences x 8 KV heads fill the SMs, so it does not split, and the long
decode's 8 items read 512 KV tiles each while the rest of the GPU idles.

    PYTHONPATH=. python -P scripts/varlen_skew_splits.py      (on the GPU)
"""
import torch
import triton

import hopper_flash

print("hopper_flash from", hopper_flash.__file__, torch.cuda.get_device_name())
for short, n_short, long in ((1024, 64, 65536), (2048, 32, 32768), (512, 128, 131072)):
    lk = [short] * n_short + [long]
    lq = [1] * len(lk)
    cq = torch.tensor([0] + lq, device="cuda").cumsum(0).to(torch.int32)
    ck = torch.tensor([0] + lk, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(sum(lq), 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lk), 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ref = None
    row = []
    for splits in (1, 0, 2, 4, 8, 16):
        fn = lambda: hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, 1, long, causal=True,  # noqa: E731
                                                         num_splits=splits)
        out = fn()
        ref = out if ref is None else ref
        err = (out.float() - ref.float()).abs().max().item()
        us = triton.testing.do_bench(fn, warmup=25, rep=200) * 1e3
        tbs = sum(lk) * 8 * 128 * 4 / (us * 1e-6) / 1e12
        row.append(f"splits={splits}: {us:.1f} us ({tbs:.2f} TB/s, diff {err:.0e})")
    print(f"{n_short} decodes over {short} keys + 1 over {long}, H32/8 D128: " + "; ".join(row), flush=True)
