"""The attention backward on a Hopper GPU against float64 autograd gradients.

Fresh random inputs per case; dq/dk/dv buffers poisoned with NaN before the
launch. Each gradient is judged by ``reference.check_attention_grads``: the
float64 textbook backward as the reference, within 2x the error of SDPA's
backward on the same inputs (cuDNN where it expresses the problem, else the
efficient/math kernels), in relative Frobenius norm, max-abs and worst-row
error, plus the judge's floors; or everywhere within the small absolute
floor ``reference.grads_abs_tol`` (where the exact gradient is ~0: one key).
"""
import math

import pytest
import torch

import hopper_flash
from hopper_flash import interface, ops, plan_backward
from hopper_flash.reference import attention_reference_grads, check_attention_grads
from gpu_inputs import capture

pytestmark = pytest.mark.gpu


def _forward(q, k, v, causal):
    """(out, lse) through the public call, without autograd."""
    with torch.no_grad():
        return hopper_flash.flash_attn_func(q, k, v, causal=causal, return_lse=True)


def rel(a, b):
    if not torch.isfinite(a).all():
        return math.inf
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make(batch, sq, sk, h, hkv, d, dtype, seed, packed=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if packed:
        qkv = torch.randn(batch, sq, 3, h, d, generator=gen, device="cuda").to(dtype)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], torch.randn(batch, sq, h, d, generator=gen,
                                                                     device="cuda").to(dtype)
    rnd = lambda s, hh: torch.randn(batch, s, hh, d, generator=gen, device="cuda").to(dtype)  # noqa: E731
    return rnd(sq, h), rnd(sk, hkv), rnd(sk, hkv), rnd(sq, h)


def check(batch, sq, sk, h, hkv, d, causal, dtype=torch.bfloat16, deterministic=False, packed=False, seed=0):
    q, k, v, do = make(batch, sq, sk, h, hkv, d, dtype, seed, packed)
    scale = 1.0 / math.sqrt(d)
    out, lse = _forward(q, k, v, causal)
    dq = torch.full_like(q, float("nan"))
    dk = torch.full(k.shape, float("nan"), dtype=dtype, device="cuda")
    dv = torch.full_like(dk, float("nan"))
    plan_backward.launch_backward(do, q, k, v, out, lse, dq, dk, dv, scale, causal, deterministic)
    verdicts = check_attention_grads((dq, dk, dv), q, k, v, do, causal=causal, softmax_scale=scale)
    assert all(verdicts), "; ".join(v.message for v in verdicts if not v)
    if causal and sq > sk:
        assert (dq[:, :sq - sk] == 0).all(), "rows that see no key must get zero gradient"
    return dq, dk, dv


LENGTHS = [1, 17, 127, 129, 1000, 3001]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seqlen", LENGTHS)
def test_odd_lengths_d128(seqlen, causal):
    check(2, seqlen, seqlen, 2, 2, 128, causal)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sq,sk", [(17, 3001), (3001, 129), (129, 127), (127, 129), (1000, 1), (1, 1000)])
def test_unequal_lengths(sq, sk, causal):
    check(2, sq, sk, 2, 2, 128, causal)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_head_dims_and_dtypes(d, dtype, causal):
    check(3, 1000, 1000, 4, 4, d, causal, dtype)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sq,sk", [(1, 1), (129, 127), (17, 3001), (3001, 129)])
def test_head_dim_256_lengths(sq, sk, causal):
    check(2, sq, sk, 2, 2, 256, causal)


@pytest.mark.parametrize("causal", [True, False])
def test_head_dim_256_gqa_deterministic(causal):
    check(2, 300, 257, 8, 2, 256, causal)
    q, k, v, do = make(1, 700, 700, 4, 2, 256, torch.bfloat16, 5)
    out, lse = _forward(q, k, v, causal)
    first = plan_backward.backward(do, q, k, v, out, lse, 256 ** -0.5, causal, True)
    for _ in range(20):
        again = plan_backward.backward(do, q, k, v, out, lse, 256 ** -0.5, causal, True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    check(1, 700, 700, 4, 2, 256, causal, deterministic=True)


@pytest.mark.parametrize("h,hkv", [(32, 8), (8, 1)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gqa_mqa(h, hkv, causal, d):
    check(2, 257, 300, h, hkv, d, causal)


def test_packed_qkv_views():
    check(2, 513, 513, 4, 4, 128, True, packed=True)


@pytest.mark.parametrize("causal", [True, False])
def test_deterministic_repeats_bitwise(causal):
    q, k, v, do = make(2, 1000, 1000, 4, 4, 128, torch.bfloat16, 3)
    out, lse = _forward(q, k, v, causal)
    first = plan_backward.backward(do, q, k, v, out, lse, 128 ** -0.5, causal, True)
    for _ in range(100):
        again = plan_backward.backward(do, q, k, v, out, lse, 128 ** -0.5, causal, True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    check(2, 1000, 1000, 4, 4, 128, causal, deterministic=True)


def test_autograd_paths_agree():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    ref = attention_reference_grads(q.detach(), k.detach(), v.detach(), torch.ones_like(q.detach()), causal=True)
    g_func = torch.autograd.grad(hopper_flash.flash_attn_func(q, k, v, causal=True).sum(), (q, k, v))
    sdpa = interface.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True)
    g_sdpa = torch.autograd.grad(sdpa.sum(), (q, k, v))
    out, _ = ops.fwd(q, k, v, 128 ** -0.5, True)
    g_op = torch.autograd.grad(out.sum(), (q, k, v))
    from torch.utils.checkpoint import checkpoint

    ck = checkpoint(lambda a, b, c: hopper_flash.flash_attn_func(a, b, c, causal=True), q, k, v, use_reentrant=False)
    g_ck = torch.autograd.grad(ck.sum(), (q, k, v))
    for g in (g_func, g_sdpa, g_op, g_ck):
        for a, r in zip(g, ref):
            assert rel(a, r) < 1e-2


def test_torch_compile_training_step():
    lin = torch.nn.Linear(128, 128, device="cuda", dtype=torch.bfloat16)

    def step(x):
        return hopper_flash.flash_attn_func(lin(x), x, x, causal=True).float().pow(2).mean()

    x = torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.compile(step, fullgraph=True)(x).backward()
    compiled = x.grad.clone()
    x.grad = None
    step(x).backward()
    assert rel(compiled, x.grad) < 1e-2


def test_cuda_graph_forward_backward():
    q, k, v = (torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)

    def step():
        return torch.autograd.grad(hopper_flash.flash_attn_func(q, k, v, causal=True), (q, k, v), do)

    graph, captured = capture(step)
    eager = step()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, eager))


def test_grad_out_checks_and_stride0_grad_out():
    q = torch.randn(1, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = ops.fwd(q, q, q, 0.1, True)
    with pytest.raises(ValueError, match="grad_out must have the output's dtype"):
        ops.bwd(out.float(), q, q, q, out, lse, 0.1, True, False)
    expanded = torch.ones((), device="cuda", dtype=torch.bfloat16).expand(out.shape)  # stride 0: copied
    a = ops.bwd(expanded, q, q, q, out, lse, 0.1, True, False)
    b = ops.bwd(expanded.contiguous(), q, q, q, out, lse, 0.1, True, False)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
