"""Head dims the kernels do not have (``checks.head_dim_padding``), on the CPU:
the public functions hand the kernels q, k and v zero-padded to the next
kernel head dim and cut the output back, with the scale of the head dim
the caller has. The kernels are replaced by a float64 attention that checks
what it is handed; the results are compared with the same attention on the
unpadded inputs, computed here. The GPU runs are in
``tests/test_head_dims_gpu.py``."""
import math

import pytest
import torch

import hopper_flash
from hopper_flash import checks, dispatch

F64 = torch.float64


def attention64(q, k, v, scale, causal):
    """(out, lse) of BSHD q, k, v in float64 (GQA by repetition; causal
    bottom-right)."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq).logical_not(), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v.double()), torch.logsumexp(s, -1)


@pytest.mark.parametrize("head_dim,kernel_dim", [(8, 64), (32, 64), (40, 64), (72, 128), (80, 128), (96, 128),
                                                 (120, 128), (160, 256), (192, 256), (248, 256)])
def test_padding_reaches_the_next_kernel_head_dim(head_dim, kernel_dim):
    q = torch.empty(2, 3, 4, head_dim, dtype=torch.bfloat16)
    assert checks.head_dim_padding(q, q, q, 4) == kernel_dim - head_dim
    assert checks.head_dim_padding(q[0], q[0], q[0], 3) == kernel_dim - head_dim


@pytest.mark.parametrize("shapes", [(64, 64, 64), (100, 100, 100), (96, 80, 80), (96, 96, 80), (264, 264, 264),
                                    (0, 0, 0)])
def test_no_padding_where_native_or_malformed(shapes):
    """The kernels' own head dims, and anything the checks must name (a head
    dim not a multiple of 8 or past 256, k or v unlike q), are not padded."""
    q, k, v = (torch.empty(2, 3, 4, d) for d in shapes)
    assert checks.head_dim_padding(q, k, v, 4) == 0


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", [40, 96, 192])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_flash_attn_func_pads_and_cuts_back(monkeypatch, head_dim, causal, scale):
    handed = []

    def kernel(q, k, v, softmax_scale, causal, return_lse, window=None, softcap=0.0, sink=None):
        handed.append((q.shape[-1], softmax_scale))
        d = head_dim
        assert torch.equal(k[..., d:], torch.zeros_like(k[..., d:])) and torch.equal(q[..., d:], 0 * q[..., d:])
        out, lse = attention64(q, k, v, softmax_scale, causal)
        return (out, lse) if return_lse else out

    monkeypatch.setattr(dispatch, "forward", kernel)
    gen = torch.Generator().manual_seed(head_dim)
    q = torch.randn(2, 7, 4, head_dim, generator=gen, dtype=F64)
    k, v = (torch.randn(2, 9, 2, head_dim, generator=gen, dtype=F64) for _ in range(2))
    v[..., 0] = 1000.0  # the output keeps v's features in order: the cut keeps the first ones
    out, lse = hopper_flash.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
    want_scale = 1 / math.sqrt(head_dim) if scale is None else scale
    kernel_dim = min(d for d in (64, 128, 256) if d > head_dim)
    assert handed == [(kernel_dim, want_scale)]
    ref_out, ref_lse = attention64(q, k, v, want_scale, causal)
    assert out.shape == q.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    assert torch.equal(hopper_flash.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal), out)


def test_varlen_pads_and_cuts_back(monkeypatch):
    handed = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k, softmax_scale, causal, return_lse,
               check_contract=None, window=None, softcap=0.0, sink=None):
        handed.append((q.shape, k.shape, softmax_scale, max_q, max_k))
        out, lse = attention64(q[None], k[None], v[None], softmax_scale, causal)  # one sequence
        return out[0], lse[0]

    monkeypatch.setattr(dispatch, "forward_varlen", kernel)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(11, 4, 80, generator=gen, dtype=F64)
    k, v = (torch.randn(11, 2, 80, generator=gen, dtype=F64) for _ in range(2))
    cu = torch.tensor([0, 11], dtype=torch.int32)
    out, lse = hopper_flash.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, causal=True, return_lse=True)
    assert handed == [((11, 4, 128), (11, 2, 128), 1 / math.sqrt(80), 11, 11)]
    ref_out, ref_lse = attention64(q[None], k[None], v[None], 1 / math.sqrt(80), True)
    assert out.shape == q.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref_out[0])
    torch.testing.assert_close(lse, ref_lse[0])


def test_autograd_through_the_op_gives_unpadded_gradients(monkeypatch):
    """Under autograd the padded tensors go through the op (its fake on meta
    tensors here); the gradients come back at the caller's head dim."""
    monkeypatch.setattr(checks, "check_device", lambda t, name="q": None)  # meta tensors stand in for CUDA ones
    q = torch.empty(2, 64, 4, 96, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(2, 33, 2, 96, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out = hopper_flash.flash_attn_func(q, k, k, causal=True)
    assert out.shape == q.shape
    dq, dk = torch.autograd.grad(out.float().sum(), (q, k))
    assert dq.shape == q.shape and dk.shape == k.shape


def test_kvcache_refuses_other_head_dims():
    """The KV-cache path would copy the whole cache to pad it: it names the
    head dims it runs instead."""
    q = torch.zeros(2, 1, 4, 96, dtype=torch.bfloat16)
    kc = torch.zeros(2, 64, 4, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"head dim \(q.shape\[3\]\) must be one of \(64, 128, 256\) \(the KV-cache "
                                         r"path runs the kernels' own head dims only\), got 96"):
        hopper_flash.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=3)
