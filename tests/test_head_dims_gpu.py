"""Head dims the kernels do not have, on a Hopper GPU: multiples of 8 below
256 run on the next kernel head dim with q, k and v zero-padded
(``checks.head_dim_padding``). Forward and backward through the public
functions (autograd), judged against the float64 reference relative to
SDPA's error on the same inputs (``hopper_flash.reference``); the packed,
SDPA-style, torch.compile and CUDA-graph routes too. The varlen function's
are in ``test_varlen_gpu.py``."""
import pytest
import torch

import hopper_flash
from hopper_flash.reference import check_attention, check_attention_grads, random_qkv
from gpu_inputs import capture

pytestmark = pytest.mark.gpu

OTHER_HEAD_DIMS = [8, 32, 40, 72, 80, 96, 112, 160, 192, 224]


def judged(verdicts):
    failed = [v.message for v in verdicts if not v]
    assert not failed, "\n".join(failed)


def forward_backward(q, k, v, causal, dout_seed=7, **kw):
    """``(out, lse, (dq, dk, dv), dout)`` through flash_attn_func's autograd."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = hopper_flash.flash_attn_func(*leaves, causal=causal, return_lse=True, **kw)
    gen = torch.Generator(device="cuda").manual_seed(dout_seed)
    dout = torch.randn(out.shape, generator=gen, device="cuda").to(out.dtype)
    return out, lse, torch.autograd.grad(out, leaves, dout), dout


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", OTHER_HEAD_DIMS)
def test_forward_and_backward(head_dim, causal):
    q, k, v = random_qkv(2, 257, 300, 8, 2, head_dim, seed=head_dim)
    out, lse, grads, dout = forward_backward(q, k, v, causal)
    assert out.shape == q.shape and out.is_contiguous() and lse.shape == (2, 8, 257)
    judged(check_attention(out, q, k, v, causal=causal, lse=lse))
    judged(check_attention_grads(grads, q, k, v, dout, causal=causal))


@pytest.mark.parametrize("head_dim", [40, 96, 192])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 4099), (3001, 129), (127, 1000)])
def test_odd_lengths_fp16_and_decode_shapes(head_dim, seqlen_q, seqlen_k):
    q, k, v = random_qkv(1, seqlen_q, seqlen_k, 4, 4, head_dim, dtype=torch.float16, seed=seqlen_q)
    out, lse = hopper_flash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    judged(check_attention(out, q, k, v, causal=True, lse=lse))


def test_window_softcap_and_scale_pass_through():
    q, k, v = random_qkv(2, 500, 500, 4, 4, 80, seed=3)
    out = hopper_flash.flash_attn_func(q, k, v, causal=True, window_size=(100, 0), softcap=20.0, softmax_scale=0.2)
    judged(check_attention(out, q, k, v, causal=True, window=(100, 0), softcap=20.0, softmax_scale=0.2))


def test_packed_and_sdpa_routes():
    gen = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(2, 300, 3, 4, 96, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_()
    out = hopper_flash.flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = (t.detach() for t in qkv.unbind(2))
    judged(check_attention(out, q, k, v, causal=True))
    dout = torch.randn(out.shape, generator=gen, device="cuda").to(out.dtype)
    (dqkv,) = torch.autograd.grad(out, (qkv,), dout)
    judged(check_attention_grads(tuple(dqkv.unbind(2)), q, k, v, dout, causal=True))
    bhsd = [t.transpose(1, 2) for t in (q, k, v)]
    sdpa = hopper_flash.scaled_dot_product_attention(*bhsd, is_causal=True)
    judged(check_attention(sdpa.transpose(1, 2), q, k, v, causal=True))


def test_torch_compile_and_cuda_graph():
    q, k, v = random_qkv(2, 333, 333, 4, 2, 72, seed=9)
    eager = hopper_flash.flash_attn_func(q, k, v, causal=True)
    compiled = torch.compile(lambda a, b, c: hopper_flash.flash_attn_func(a, b, c, causal=True), fullgraph=True)
    assert torch.equal(compiled(q, k, v), eager)
    graph, out = capture(lambda: hopper_flash.flash_attn_func(q, k, v, causal=True))
    q.copy_(random_qkv(2, 333, 333, 4, 2, 72, seed=10)[0])
    graph.replay()
    assert torch.equal(out, hopper_flash.flash_attn_func(q, k, v, causal=True))
