"""Rotary embedding in float64 for the tests (CPU and GPU): flash-attn's
``rotary_cos``/``rotary_sin`` ``[seqlen_ro, rotary_dim / 2]`` applied as
complex products, feature pairs ``x0 + i x1`` times ``cos + i sin``, written
independently of ``kernels/append.py`` (which adds and subtracts products of
partner features). Imported as ``from rotary_ref import rotate64``."""
import torch


def rotate64(x, cos, sin, pos, interleaved):
    """``x`` [..., D] rotated at positions ``pos`` (an integer tensor that
    broadcasts against x's dims but the last, e.g. [B, S, 1] for [B, S, H,
    D]), in float64. Pairs are features ``(2t, 2t + 1)`` when
    ``interleaved`` (GPT-J), else ``(t, t + rotary_dim / 2)`` (GPT-NeoX);
    features from ``rotary_dim`` on are returned as they are."""
    half = cos.shape[1]
    c, s = cos.double()[pos.long()], sin.double()[pos.long()]  # [..., half]
    x = x.double()
    if interleaved:
        pairs = x[..., :2 * half].reshape(*x.shape[:-1], half, 2)
    else:
        pairs = torch.stack((x[..., :half], x[..., half:2 * half]), dim=-1)
    r = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * torch.complex(c, s))
    rotated = r.reshape(*x.shape[:-1], 2 * half) if interleaved else torch.cat((r[..., 0], r[..., 1]), dim=-1)
    return torch.cat((rotated, x[..., 2 * half:]), dim=-1)
