"""Ground-truth gradients of attention (pure PyTorch autograd in float64 or
float32), with the kernel's conventions: BSHD, GQA by head groups,
bottom-right causal, rows that see no key give output 0 (and zero gradient)."""
from __future__ import annotations

import math

import torch


def attention_math(q, k, v, softmax_scale=None, causal=False, dtype=torch.float64):
    """Differentiable attention in ``dtype``; rows with no visible key -> 0."""
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    group = nheads // nheads_kv
    qt = q.to(dtype).transpose(1, 2)
    kt = k.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    vt = v.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    s = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(seqlen_q, device=q.device)[:, None]
        j = torch.arange(seqlen_k, device=q.device)[None, :]
        hidden = j > i + (seqlen_k - seqlen_q)
        s = s.masked_fill(hidden, -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    out = torch.matmul(p.to(vt.dtype), vt)
    return out.transpose(1, 2)


def attention_grads(q, k, v, grad_out, softmax_scale=None, causal=False, dtype=torch.float64):
    """(dq, dk, dv) of ``attention_math`` in ``dtype``."""
    q_, k_, v_ = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    out = attention_math(q_, k_, v_, softmax_scale, causal, dtype)
    return torch.autograd.grad(out, (q_, k_, v_), grad_out.to(dtype))
