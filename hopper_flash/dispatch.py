"""Validated eager entry points: check the arguments, allocate the outputs,
launch the planned kernel.

The public API (``interface``) calls these directly when neither autograd nor
torch.compile is involved, and the custom ops (``ops``) call them as their
real implementations. Both sit above this module; it imports only
``checks`` and ``plan``, so there is no import cycle.
"""
from __future__ import annotations

import math

import torch

from . import checks, plan


def forward(q, k, v, softmax_scale, causal, return_lse, out=None):
    """Validated forward; ``out`` lets tests hand in a poisoned buffer.

    Returns ``(out, lse)`` when ``return_lse`` else ``out``."""
    softmax_scale = checks.validate(q, k, v, softmax_scale, causal)
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    causal = bool(causal)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must match q's shape, dtype and device, got {tuple(out.shape)} {out.dtype} "
                         f"on {out.device}")
    else:
        checks.check_tma_addressable("out", out)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device) if return_lse else None
    if out.numel() == 0:
        pass  # nothing to compute: no launch
    elif seqlen_k == 0:
        out.zero_()  # no key at all: zero output, -inf LSE, no launch
        if lse is not None:
            lse.fill_(-math.inf)
    else:
        # num_splits=0, pack_gqa=None: the decode heuristics (split-KV,
        # PackGQA) take over when seqlen_q is small next to seqlen_k; large
        # problems get the plain prefill kernel.
        if q.device.index != torch.cuda.current_device():
            with torch.cuda.device(q.device):
                plan.launch_forward(q, k, v, out, lse, softmax_scale, causal, num_splits=0, pack_gqa=None)
        else:
            plan.launch_forward(q, k, v, out, lse, softmax_scale, causal, num_splits=0, pack_gqa=None)
    return (out, lse) if return_lse else out
