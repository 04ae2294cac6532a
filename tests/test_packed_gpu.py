"""flash-attn's packed-layout functions on a Hopper GPU: results and
gradients against the float64 reference (``reference.check_attention`` /
``check_attention_grads``, relative to SDPA's error on the same inputs),
and bitwise equal to the unpacked call on the same views: the same kernels
(deterministic mode for the gradients), though under eager autograd the
packed call writes its gradients into the packed tensor's
(``ops.EagerPackedAttention``). Odd lengths, GQA, an empty sequence in a
varlen batch. The CPU half is tests/test_packed_cpu.py."""
import pytest
import torch

import hopper_flash
from hopper_flash.reference import check_attention, check_attention_grads, varlen_spans

pytestmark = pytest.mark.gpu
DEV = "cuda"


def randn(*shape, seed, dtype=torch.bfloat16):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=DEV).to(dtype)


def _assert_all(verdicts):
    assert all(verdicts), "; ".join(v.message for v in verdicts if not v)


def _grad(fn, leaf, dout):
    """``fn(leaf)`` and d(leaf) of ``(fn(leaf) * dout).sum()``."""
    leaf = leaf.detach().requires_grad_()
    out = fn(leaf)
    out.backward(dout)
    return out.detach(), leaf.grad


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seqlen", [1, 129, 1000])
def test_qkvpacked_forward_and_backward(seqlen, causal):
    qkv = randn(2, seqlen, 3, 4, 128, seed=seqlen)
    dout = randn(2, seqlen, 4, 128, seed=seqlen + 1)
    fn = lambda t: hopper_flash.flash_attn_qkvpacked_func(t, causal=causal, deterministic=True)  # noqa: E731
    out, dqkv = _grad(fn, qkv, dout)
    assert "EagerPackedAttention" in type(fn(qkv.detach().requires_grad_()).grad_fn).__name__
    q, k, v = qkv.unbind(2)
    _assert_all(check_attention(out, q, k, v, causal=causal))
    _assert_all(check_attention_grads(dqkv.unbind(2), q, k, v, dout, causal=causal))
    # The same views through flash_attn_func: the same kernels, the same bits.
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref_out = hopper_flash.flash_attn_func(*leaves, causal=causal, deterministic=True)
    ref_out.backward(dout)
    assert torch.equal(out, ref_out.detach())
    for got, want in zip(dqkv.unbind(2), leaves):
        assert torch.equal(got, want.grad)


@pytest.mark.parametrize("causal", [True, False])
def test_kvpacked_gqa_forward_and_backward(causal):
    q = randn(2, 300, 8, 64, seed=1)
    kv = randn(2, 257, 2, 2, 64, seed=2)
    dout = randn(2, 300, 8, 64, seed=3)
    out, lse = hopper_flash.flash_attn_kvpacked_func(q, kv, causal=causal, return_lse=True)
    k, v = kv.unbind(2)
    _assert_all(check_attention(out, q, k, v, causal=causal, lse=lse))
    qg, kvg = q.detach().requires_grad_(), kv.detach().requires_grad_()
    hopper_flash.flash_attn_kvpacked_func(qg, kvg, causal=causal).backward(dout)
    _assert_all(check_attention_grads((qg.grad, *kvg.grad.unbind(2)), q, k, v, dout, causal=causal))


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_qkvpacked_per_sequence_against_the_reference(causal):
    lengths = [0, 1, 129, 1000, 17]
    cu = torch.tensor([0] + lengths, device=DEV).cumsum(0).to(torch.int32)
    qkv = randn(sum(lengths), 3, 4, 128, seed=7)
    out = hopper_flash.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lengths), causal=causal)
    assert out.shape == (sum(lengths), 4, 128)
    for start, n in varlen_spans(cu):
        if n == 0:
            continue
        q, k, v = qkv[None, start:start + n].unbind(2)
        _assert_all(check_attention(out[None, start:start + n], q, k, v, causal=causal))


def test_varlen_kvpacked_gradients_equal_the_unpacked_call():
    lq, lk = [5, 300, 64], [7, 257, 64]
    cq = torch.tensor([0] + lq, device=DEV).cumsum(0).to(torch.int32)
    ck = torch.tensor([0] + lk, device=DEV).cumsum(0).to(torch.int32)
    q = randn(sum(lq), 8, 128, seed=11)
    kv = randn(sum(lk), 2, 2, 128, seed=12)
    dout = randn(sum(lq), 8, 128, seed=13)
    qg, kvg = q.detach().requires_grad_(), kv.detach().requires_grad_()
    out = hopper_flash.flash_attn_varlen_kvpacked_func(qg, kvg, cq, ck, max(lq), max(lk), causal=True,
                                                       deterministic=True)
    out.backward(dout)
    leaves = [t.detach().requires_grad_() for t in (q, *kv.unbind(1))]
    ref = hopper_flash.flash_attn_varlen_func(*leaves, cq, ck, max(lq), max(lk), causal=True, deterministic=True)
    ref.backward(dout)
    assert torch.equal(out.detach(), ref.detach())
    assert torch.equal(qg.grad, leaves[0].grad)
    assert torch.equal(kvg.grad[:, 0], leaves[1].grad) and torch.equal(kvg.grad[:, 1], leaves[2].grad)
