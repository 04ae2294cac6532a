"""Head dims the kernels do not have, on the CPU: without autograd the
public functions hand the forward q, k and v as they are (it runs them on
the next kernel head dim, ``plan.kernel_head_dim``); under autograd (the
ops, whose backward takes the kernels' head dims only) they are zero-padded
to it (``checks.head_dim_padding``) and the output and gradients cut back,
with the scale of the head dim the caller has. The kernels are replaced by
a float64 attention that checks what it is handed; the results are
compared with the same attention on the unpadded inputs, computed here.
The GPU runs are in ``tests/test_head_dims_gpu.py``."""
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
def test_inference_hands_the_kernels_the_head_dim_as_it_is(monkeypatch, head_dim, causal):
    """Without autograd no copy is made: the forward gets q, k, v as they
    are and runs them on the next kernel head dim (plan.kernel_head_dim)."""
    handed = []

    def forward(q, k, v, softmax_scale, causal, return_lse, window=None, softcap=0.0, sink=None,
                any_head_dim=False):
        handed.append((q.shape[-1], k.shape[-1], softmax_scale, any_head_dim))
        out, lse = attention64(q, k, v, 1 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale,
                               causal)
        return (out, lse) if return_lse else out

    monkeypatch.setattr(dispatch, "forward", forward)
    q, k, v = (torch.randn(2, 7, 4, head_dim, dtype=F64) for _ in range(3))
    hopper_flash.flash_attn_func(q, k, v, causal=causal)
    assert handed == [(head_dim, head_dim, None, True)]


@pytest.fixture
def kernels(monkeypatch):
    """The eager autograd path's forward and backward replaced by float64
    attention that checks it is handed the padded tensors; returns what
    each call was handed."""
    from hopper_flash import ops, plan_backward

    log = []
    monkeypatch.setattr(ops, "plain_eager", lambda *t: True)
    monkeypatch.setattr(checks, "check_device", lambda t, name="q": None)
    monkeypatch.setattr(checks, "check_tma_addressable", lambda name, t: None)
    real_scale = checks.check_softmax_scale  # float64 stands in for bf16: the dtype check is skipped
    monkeypatch.setattr(checks, "check_arguments",
                        lambda q, k, v, scale, causal, any_head_dim=False: real_scale(scale, q.shape[-1]))

    def forward(q, k, v, scale, causal, return_lse, window=None, softcap=0.0, sink=None):
        log.append(("forward", q.shape[-1], scale))
        return attention64(q, k, v, scale, causal)

    def backward(grad_out, q, k, v, out, lse, scale, causal, deterministic, window=None, softcap=0.0, sink=None):
        log.append(("backward", q.shape[-1], scale))
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            return torch.autograd.grad(attention64(*leaves, scale, causal)[0], leaves, grad_out)

    monkeypatch.setattr(dispatch, "forward_validated", forward)
    monkeypatch.setattr(plan_backward, "backward", backward)
    return log


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", [40, 96, 192])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_autograd_pads_and_cuts_back(kernels, head_dim, causal, scale):
    """Under autograd the kernels (whose backward takes their own head dims
    only) get q, k, v zero-padded; the output, the LSE and the gradients are
    the unpadded problem's, the scale the caller's head dim's."""
    gen = torch.Generator().manual_seed(head_dim)
    q = torch.randn(2, 7, 4, head_dim, generator=gen, dtype=F64, requires_grad=True)
    k, v = (torch.randn(2, 9, 2, head_dim, generator=gen, dtype=F64, requires_grad=True) for _ in range(2))
    with torch.no_grad():
        v[..., 0] = 1000.0  # the cut keeps v's first features, in order
    out, lse = hopper_flash.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
    want_scale = 1 / math.sqrt(head_dim) if scale is None else scale
    kernel_dim = min(d for d in (64, 128, 256) if d > head_dim)
    assert kernels == [("forward", kernel_dim, want_scale)]
    ref_out, ref_lse = attention64(q, k, v, want_scale, causal)
    assert out.shape == q.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    grad = torch.randn(out.shape, generator=gen, dtype=F64)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref_out, (q, k, v), grad)
    assert kernels[-1] == ("backward", kernel_dim, want_scale)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w)


def test_varlen_inference_and_autograd_routes(monkeypatch, kernels):
    handed = []

    def forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k, softmax_scale, causal, return_lse,
                       check_contract=None, window=None, softcap=0.0, sink=None, any_head_dim=False):
        handed.append((q.shape, k.shape, any_head_dim))
        return torch.zeros_like(q), None

    monkeypatch.setattr(dispatch, "forward_varlen", forward_varlen)
    q = torch.randn(11, 4, 80, dtype=F64)
    k = torch.randn(11, 2, 80, dtype=F64)
    cu = torch.tensor([0, 11], dtype=torch.int32)
    hopper_flash.flash_attn_varlen_func(q, k, k, cu, cu, 11, 11, causal=True)
    assert handed == [((11, 4, 80), (11, 2, 80), True)]  # without autograd: as it is
    real_scale = checks.check_softmax_scale

    seen = {}

    def forward_varlen_validated(q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k, scale, causal, return_lse,
                                 window=None, softcap=0.0, sink=None):
        seen["shapes"] = (q.shape, k.shape, scale)
        out, lse = attention64(q[None], k[None], v[None], scale, causal)
        return out[0], lse[0]

    monkeypatch.setattr(dispatch, "forward_varlen_validated", forward_varlen_validated)
    monkeypatch.setattr(checks, "check_varlen_arguments",
                        lambda q, k, v, cq, ck, mq, mk, uq, uk, scale, causal, any_head_dim=False:
                        (real_scale(scale, q.shape[-1]), mq, mk))
    monkeypatch.setattr(checks, "check_tma_addressable_thd", lambda name, t: None)
    qg = q.clone().requires_grad_()
    out = hopper_flash.flash_attn_varlen_func(qg, k, k, cu, cu, 11, 11, causal=True)
    assert seen["shapes"] == ((11, 4, 128), (11, 2, 128), 1 / math.sqrt(80))  # with autograd: padded
    ref, _ = attention64(q[None], k[None], k[None], 1 / math.sqrt(80), True)
    assert out.shape == q.shape
    torch.testing.assert_close(out, ref[0])


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


def test_kvcache_takes_other_head_dims_and_names_the_rest():
    """The KV-cache path runs other multiples of 8 as they are (no copy of
    the cache): a well-formed call gets to the device check; a head dim
    that is not one is named."""
    q = torch.zeros(2, 1, 4, 96, dtype=torch.bfloat16)
    kc = torch.zeros(2, 64, 4, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        hopper_flash.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=3)
    with pytest.raises(ValueError, match=r"head dim \(q.shape\[3\]\) must be one of \(64, 128, 256\), or a multiple "
                                         r"of 8 below 256 \(run on the next of those\), got 100"):
        kc100 = torch.zeros(2, 64, 4, 100, dtype=torch.bfloat16)
        hopper_flash.flash_attn_with_kvcache(torch.zeros(2, 1, 4, 100, dtype=torch.bfloat16), kc100, kc100,
                                             cache_seqlens=3)
