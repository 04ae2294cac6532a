"""Smallest end-to-end check: one launch, compared with the float32 reference."""
import torch

import hopper_flash
from hopper_flash.reference import attention_reference

for (b, s, h, causal) in [(1, 128, 1, True), (2, 1000, 3, True), (2, 300, 2, False)]:
    q, k, v = (torch.randn(b, s, h, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = hopper_flash.flash_attn_func(q, k, v, causal=causal)
    torch.cuda.synchronize()
    ref, _ = attention_reference(q, k, v, causal=causal, dtype=torch.float32)
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    print(f"smoke b={b} s={s} h={h} causal={causal}: rel err {rel:.2e}", flush=True)
