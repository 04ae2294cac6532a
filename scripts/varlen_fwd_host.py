"""Host time of one ``flash_attn_varlen_func`` forward call, as transformers'
continuous batching makes it per layer (``paged|hopper_flash``): a few
decodes beside a short prefill chunk, small enough that the GPU runs behind
the host (``host_timing.host_us``: back-to-back calls, wall time per call).
Run it once per package to compare (``PYTHONPATH=PKG python -P
scripts/varlen_fwd_host.py``); the header says which package ran. The CPU
stand-in of the same call: ``scripts/host_standin.py --varlen``.

    PYTHONPATH=. python -P scripts/varlen_fwd_host.py      (on the GPU)
"""
import os
import sys

import torch

import hopper_flash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_timing import host_us  # noqa: E402

print("hopper_flash from", hopper_flash.__file__)
lq, lk = [1] * 8 + [32], [256] * 8 + [288]
cq = torch.tensor([0] + lq, device="cuda").cumsum(0).to(torch.int32)
ck = torch.tensor([0] + lk, device="cuda").cumsum(0).to(torch.int32)
q = torch.randn(sum(lq), 32, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(sum(lk), 8, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
for splits in (0, 1):
    us = host_us(lambda: hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, 32, 288, causal=True,
                                                             num_splits=splits))
    print(f"8 decodes over 256 keys + a 32-query chunk, H32/8 D128, num_splits={splits}: {us:.1f} us per call")
