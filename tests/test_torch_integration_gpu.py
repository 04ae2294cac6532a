"""hopper_flash inside PyTorch's machinery on the GPU: torch.compile with
fullgraph, CUDA graph capture and replay, a backward at head dim 256, the SDPA-style
call against the float64 reference, with torch's SDPA as the baseline."""
import pytest
import torch

import hopper_flash
from hopper_flash.reference import assert_judged, attention_reference, rel_fro_err

try:  # pytest's default import mode puts tests/ on sys.path
    from test_forward_gpu import assert_attention_correct
except ImportError:  # --import-mode=importlib, run from the repository root
    from tests.test_forward_gpu import assert_attention_correct

pytestmark = pytest.mark.gpu


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


class TinyAttention(torch.nn.Module):
    def __init__(self, dim=512, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).unbind(2)
        o = hopper_flash.flash_attn_func(q, k, v, causal=True)
        return self.proj(o.reshape(b, s, -1))


@torch.no_grad()
def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    model = TinyAttention().cuda().to(torch.bfloat16)
    x = rand(2, 333, 512)
    eager = model(x)
    from torch._dynamo.utils import counters
    counters.clear()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert torch.equal(out, eager) or rel_fro_err(out, eager) < 1e-3
    x2 = rand(2, 333, 512)  # new values, same shapes: no recompile needed, still right
    assert rel_fro_err(compiled(x2), model(x2)) < 1e-3


@torch.no_grad()
def test_torch_compile_with_lse_and_dynamic_lengths():
    torch._dynamo.reset()

    def f(q, k, v):
        out, lse = hopper_flash.flash_attn_func(q, k, v, causal=True, return_lse=True)
        return out * 2, lse.exp()

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    for s in (200, 517):
        q, k, v = rand(2, s, 4, 128), rand(2, s, 2, 128), rand(2, s, 2, 128)
        (o1, l1), (o2, l2) = cf(q, k, v), f(q, k, v)
        assert rel_fro_err(o1, o2) < 1e-3 and rel_fro_err(l1, l2) < 1e-5


@pytest.mark.parametrize("seqlen", [1000, 2048], ids=["static-deal", "dynamic-order"])
@torch.no_grad()
def test_cuda_graph_replay_on_fresh_inputs(seqlen):
    # 2048: 256 causal items of 16 query tiles, drawn from a counter whose
    # zeroing the graph must capture with the launch (plan.choose_dynamic).
    q, k, v = rand(2, seqlen, 8, 128), rand(2, seqlen, 8, 128), rand(2, seqlen, 8, 128)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (compiles) outside the capture
        hopper_flash.flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = hopper_flash.flash_attn_func(q, k, v, causal=True)
    for _ in range(3):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        eager = hopper_flash.flash_attn_func(q, k, v, causal=True)
        assert torch.equal(static_out, eager)


def test_backward_through_flash_attn_func_at_head_dim_256():
    q = rand(1, 128, 2, 256).requires_grad_()
    k, v = rand(1, 128, 2, 256), rand(1, 128, 2, 256)
    out = hopper_flash.flash_attn_func(q, k, v, causal=True)
    assert_attention_correct(q.detach(), k, v, out.detach(), causal=True)  # the forward is still right
    (dq,) = torch.autograd.grad(out.float().sum(), (q,))  # the backward's accuracy: test_backward_gpu.py
    assert dq.shape == q.shape and torch.isfinite(dq).all()


@torch.no_grad()
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2)])
def test_sdpa_style_call_matches_torch_sdpa(causal, hq, hkv):
    q, k, v = rand(2, hq, 700, 128), rand(2, hkv, 700, 128), rand(2, hkv, 700, 128)
    ours = hopper_flash.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != hq)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hkv != hq)
    assert ours.shape == theirs.shape
    ref, _ = attention_reference(*(x.transpose(1, 2) for x in (q, k, v)), causal=causal)
    assert_judged("sdpa-style", ours, ref.transpose(1, 2), theirs)


@torch.no_grad()
def test_sdpa_style_call_with_unequal_lengths_non_causal():
    q, k, v = rand(2, 4, 300, 64), rand(2, 4, 1000, 64), rand(2, 4, 1000, 64)
    ours = hopper_flash.scaled_dot_product_attention(q, k, v, scale=0.2)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.2)
    ref, _ = attention_reference(*(x.transpose(1, 2) for x in (q, k, v)), softmax_scale=0.2)
    assert_judged("sdpa-style", ours, ref.transpose(1, 2), theirs)


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_eager_backward_skips_the_op_and_matches_it(varlen, monkeypatch):
    # A plain eager backward calls the implementation without the op's
    # dispatch (host time); its gradients must be the op's, bit for bit
    # (deterministic mode), and the op must not be called.
    from hopper_flash import ops
    torch.manual_seed(0)
    q, k, v = (rand(2, 129, 4, 128) for _ in range(3))
    g = rand(2, 129, 4, 128)
    if varlen:
        cu = torch.tensor([0, 100, 258], device="cuda", dtype=torch.int32)
        q, k, v, g = (x.reshape(258, 4, 128) for x in (q, k, v, g))
        fwd = lambda q, k, v: hopper_flash.flash_attn_varlen_func(q, k, v, cu, cu, 158, 158, causal=True,
                                                                  deterministic=True, return_lse=True)
        op = torch.ops.hopper_flash.varlen_bwd
        op_args = lambda o, lse: (g, q, k, v, o, lse, cu, cu, None, None, 158, 158, 128 ** -0.5, True, True)
        name = "varlen_bwd"
    else:
        fwd = lambda q, k, v: hopper_flash.flash_attn_func(q, k, v, causal=True, deterministic=True,
                                                           return_lse=True)
        op = torch.ops.hopper_flash.bwd
        op_args = lambda o, lse: (g, q, k, v, o, lse, 128 ** -0.5, True, True)
        name = "bwd"
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = fwd(*leaves)
    called = []
    real = getattr(ops, name)
    monkeypatch.setattr(ops, name, lambda *a: called.append(1) or real(*a))
    grads = torch.autograd.grad(out, leaves, g)
    assert not called, "the eager backward went through the op"
    with torch.no_grad():
        expected = op(*op_args(out.detach(), lse))
    for got, want in zip(grads, expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_eager_autograd_skips_the_ops_and_matches_them(varlen, monkeypatch):
    # flash_attn_func / flash_attn_varlen_func under eager autograd use
    # ops.EagerAttention / EagerVarlenAttention (no op dispatch): outputs and
    # gradients bitwise equal to the registered ops' (deterministic mode),
    # and neither op is called.
    from hopper_flash import ops
    torch.manual_seed(1)
    q, k, v, g = (rand(2, 129, 4, 128) for _ in range(4))
    cu = torch.tensor([0, 100, 258], device="cuda", dtype=torch.int32)
    if varlen:
        q, k, v, g = (x.reshape(258, 4, 128) for x in (q, k, v, g))
        ours = lambda *t: hopper_flash.flash_attn_varlen_func(*t, cu, cu, 158, 158, causal=True, deterministic=True)
        op = lambda *t: torch.ops.hopper_flash.varlen_fwd(*t, cu, cu, None, None, 158, 158, 128 ** -0.5, True,
                                                          True)[0]
        names = ("varlen_fwd", "varlen_bwd")
    else:
        ours = lambda *t: hopper_flash.flash_attn_func(*t, causal=True, deterministic=True)
        op = lambda *t: torch.ops.hopper_flash.fwd(*t, 128 ** -0.5, True, True)[0]
        names = ("fwd", "bwd")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want_out = op(*leaves)
    want = torch.autograd.grad(want_out, leaves, g)
    called = []
    for name in names:
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _r=real: called.append(1) or _r(*a))
    out = ours(*leaves)
    assert "Eager" in type(out.grad_fn).__name__
    got = torch.autograd.grad(out, leaves, g)
    assert not called, "eager autograd went through an op"
    assert torch.equal(out, want_out)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
