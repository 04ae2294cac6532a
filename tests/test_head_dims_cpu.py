"""Head dims without kernels of their own, on the CPU: a multiple of 8
below 256 runs on the next kernel head dim's kernels (``plan.kernel_head_dim``),
read as it is, forward and backward, eager, through the ops and through
``flash_attn_with_kvcache``: no copy, no padding. The kernels are replaced
here by a float64 attention that records what it is handed; the numbers
on the GPU are ``tests/test_head_dims_gpu.py``'s."""
import math

import pytest
import torch

import hopper_flash
from hopper_flash import checks, dispatch, plan, plan_backward

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


@pytest.mark.parametrize("head_dim,kernel_dim", [(8, 64), (32, 64), (40, 64), (64, 64), (72, 128), (96, 128),
                                                 (120, 128), (128, 128), (160, 256), (192, 256), (248, 256),
                                                 (256, 256)])
def test_the_next_kernel_head_dim_serves(head_dim, kernel_dim):
    assert plan.kernel_head_dim(head_dim) == kernel_dim
    assert checks.other_head_dim(head_dim) == (head_dim != kernel_dim)


@pytest.mark.parametrize("head_dim", [0, 4, 12, 100, 257, 264, 512])
def test_other_sizes_are_named(head_dim):
    assert not checks.other_head_dim(head_dim)
    q = torch.zeros(2, 3, 4, head_dim, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"head dim \(q.shape\[3\]\) must be one of \(64, 128, 256\) or a multiple "
                                         rf"of 8 below 256 \(run on the next of those\), got {head_dim}$"):
        hopper_flash.flash_attn_func(q, q, q)
    with pytest.raises((ValueError, NotImplementedError), match=rf"got {head_dim}"):
        plan_backward.check_head_dim(head_dim)


@pytest.fixture
def kernels(monkeypatch):
    """The eager forward and backward replaced by float64 attention that
    records the head dims and scale it is handed."""
    from hopper_flash import ops

    log = []
    monkeypatch.setattr(ops, "plain_eager", lambda *t: True)
    monkeypatch.setattr(checks, "check_device", lambda t, name="q": None)
    monkeypatch.setattr(checks, "check_tma_addressable", lambda name, t: None)
    real_check = checks.check_arguments
    # float64 stands in for bf16: the dtype check alone is skipped.
    monkeypatch.setattr(checks, "check_arguments",
                        lambda q, k, v, scale, causal: real_check(*(t.to(torch.bfloat16) for t in (q, k, v)),
                                                                   scale, causal))

    def forward(q, k, v, scale, causal, return_lse, window=None, softcap=0.0, sink=None, **kw):
        log.append(("forward", q.shape[-1], k.shape[-1], v.shape[-1], scale))
        out, lse = attention64(q, k, v, scale, causal)
        return (out, lse) if return_lse else out

    def backward(grad_out, q, k, v, out, lse, scale, causal, deterministic, window=None, softcap=0.0, sink=None):
        log.append(("backward", q.shape[-1], grad_out.shape[-1], scale))
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            return torch.autograd.grad(attention64(*leaves, scale, causal)[0], leaves, grad_out)

    monkeypatch.setattr(dispatch, "forward_validated", forward)
    monkeypatch.setattr(plan_backward, "backward", backward)
    return log


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", [40, 96, 192])
def test_forward_and_backward_see_the_head_dim_as_it_is(kernels, head_dim, causal):
    gen = torch.Generator().manual_seed(head_dim)
    q = torch.randn(2, 7, 4, head_dim, generator=gen, dtype=F64, requires_grad=True)
    k, v = (torch.randn(2, 9, 2, head_dim, generator=gen, dtype=F64, requires_grad=True) for _ in range(2))
    out = hopper_flash.flash_attn_func(q, k, v, causal=causal)
    scale = 1 / math.sqrt(head_dim)
    grad = torch.randn(out.shape, generator=gen, dtype=F64)
    got = torch.autograd.grad(out, (q, k, v), grad)
    assert kernels == [("forward", head_dim, head_dim, head_dim, scale), ("backward", head_dim, head_dim, scale)]
    ref = attention64(q, k, v, scale, causal)[0]
    torch.testing.assert_close(out, ref)
    for g, w in zip(got, torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(g, w)


def test_the_ops_take_other_head_dims():
    """The ops' fakes (torch.compile's trace) take them too, gradients at
    the same head dim."""
    from unittest import mock

    with mock.patch.object(checks, "check_device", lambda t, name="q": None):
        q = torch.empty(2, 64, 4, 96, device="meta", dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(2, 33, 2, 96, device="meta", dtype=torch.bfloat16, requires_grad=True)
        out, lse = torch.ops.hopper_flash.fwd(q, k, k, 0.1, True)
        assert out.shape == q.shape and lse.shape == (2, 4, 64)
        dq, dk = torch.autograd.grad(out.float().sum(), (q, k))
        assert dq.shape == q.shape and dk.shape == k.shape


def test_workspace_and_small_kernels_take_the_kernel_width():
    """dq_accum's rows are the kernel's head dim wide; the pre- and
    postprocess and the varlen tail zeroing read and write the tensor's
    features only (OUT_DIM), native head dims with the kernels they had."""
    assert plan_backward.workspace_bytes(1, 1, 128, 96) == plan_backward.workspace_bytes(1, 1, 128, 128)
    out = torch.empty(2, 128, 4, 96, dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 128)
    pre = plan_backward.preprocess_launch(out, out, lse, 128, 64)
    post = plan_backward.postprocess_launch(out, 128, 0.1, 64)
    tail = plan_backward.zero_tail_launch(out[0], True, 1)
    for launch in (pre, post, tail):
        assert launch.constexprs["HEAD_DIM"] == 128 and launch.constexprs["OUT_DIM"] == 96
    native = torch.empty(2, 128, 4, 128, dtype=torch.bfloat16)
    for launch in (plan_backward.preprocess_launch(native, native, lse, 128, 64),
                   plan_backward.postprocess_launch(native, 128, 0.1, 64)):
        assert launch.constexprs["HEAD_DIM"] == 128 and launch.constexprs["OUT_DIM"] == 0


def test_kvcache_takes_other_head_dims_and_names_the_rest():
    """The KV-cache path runs them as they are (no copy of the cache): a
    well-formed call gets to the device check; a head dim that is not one
    is named."""
    q = torch.zeros(2, 1, 4, 96, dtype=torch.bfloat16)
    kc = torch.zeros(2, 64, 4, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        hopper_flash.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=3)
    kc100 = torch.zeros(2, 64, 4, 100, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"head dim \(q.shape\[3\]\) must be one of \(64, 128, 256\) or a multiple "
                                         r"of 8 below 256 \(run on the next of those\), got 100"):
        hopper_flash.flash_attn_with_kvcache(torch.zeros(2, 1, 4, 100, dtype=torch.bfloat16), kc100, kc100,
                                             cache_seqlens=3)
