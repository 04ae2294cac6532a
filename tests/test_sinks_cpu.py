"""Attention sinks on the CPU: the sink's gradient (``sinks.sink_grad``)
against autograd through the float64 reference that carries the sink as an
explicit softmax column; the autograd plumbing (``ops.EagerAttention`` /
``EagerVarlenAttention`` and the op's formula, ``ops._backward``) with the
kernels replaced by float64 stand-ins: which output and LSE the backward
gets, and the sink's gradient; the argument checks on every entry point;
and the gradient's Triton kernel compiled for sm_90a. The kernels' own
sink (in their normaliser, ``kernels/softmax.softmax_finish`` and the
combine) is checked on the GPU (tests/test_sinks_gpu.py)."""
import math
from types import SimpleNamespace

import pytest
import torch

import hopper_flash
from hopper_flash import dispatch, ops, plan_backward, sinks
from hopper_flash.reference import attention_reference


def _problem(batch=2, seqlen_q=7, seqlen_k=11, h=4, hkv=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, h, d, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, seqlen_k, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, seqlen_k, hkv, d, generator=gen, dtype=torch.float64)
    s = torch.randn(h, generator=gen, dtype=torch.float64) * 2
    return q, k, v, s


@pytest.mark.parametrize("causal", [True, False])
def test_sink_gradient_is_autograds(causal):
    # seqlen_q 11 > seqlen_k 7: causal, the first four rows see no key.
    q, k, v, s = _problem(seqlen_q=11, seqlen_k=7)
    s = s.requires_grad_()
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, sink=s)
    dout = torch.randn_like(ref_out)
    if causal:
        dout[:, :4] = math.nan  # rows that see no key: their dO must not reach ds
    (expected,) = torch.autograd.grad(ref_out, s, dout.nan_to_num(0.0))
    got = sinks.sink_grad(dout, ref_out.detach(), ref_lse.detach(), s.detach())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_sink_gradient_in_the_varlen_layout():
    q, k, v, s = _problem(batch=1)
    s = s.requires_grad_()
    ref_out, ref_lse = attention_reference(q, k, v, causal=True, sink=s)  # [1, S, H, D], [1, H, S]
    dout = torch.randn_like(ref_out)
    (expected,) = torch.autograd.grad(ref_out, s, dout)
    got = sinks.sink_grad(dout[0], ref_out[0].detach(), ref_lse[0].detach(), s.detach())  # THD [S, H, D], [H, S]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


# ---- the autograd plumbing, the kernels replaced by float64 stand-ins --------


def _forward_stand_in(q, k, v, softmax_scale, causal, return_lse, window=None, softcap=0.0, sink=None):
    """The forward kernels' contract: output and LSE with the sink in the normaliser."""
    return attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, sink=sink)


def _flash_backward(dout, q, k, v, out, lse, softmax_scale, causal, sink=None):
    """A flash backward: P rebuilt from the LSE it is given, Δ from the
    output it is given; GQA heads summed. With ``sink``, a fourth result:
    the sinks' gradient from the same Δ, as the backward's preprocess
    computes it (-sum of exp(s - LSE)·Δ over the rows that saw a key)."""
    delta = (dout * out).sum(-1).transpose(1, 2)
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * softmax_scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq).logical_not(), -math.inf)
    p = torch.exp(s - lse[..., None])
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, vv)
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk) * softmax_scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * softmax_scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
    fold = lambda t: t.view(*k.shape[:3], group, k.shape[3]).sum(3)  # noqa: E731
    if sink is None:
        return dq, fold(dk), fold(dv)
    s_h = sink.detach().view(1, -1, 1)
    dsink = -torch.where(lse > s_h, torch.exp(s_h - lse) * delta, 0.0).sum(dim=(0, 2))
    return dq, fold(dk), fold(dv), dsink


@pytest.fixture
def stand_ins(monkeypatch):
    """The eager forward and backward implementations on float64 math;
    returns the log of backward calls."""
    calls = []

    def backward(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, window=None, softcap=0.0, sink=None):
        calls.append("backward")
        return _flash_backward(dout, q, k, v, out, lse, softmax_scale, causal, sink)

    monkeypatch.setattr(dispatch, "forward_validated", _forward_stand_in)
    monkeypatch.setattr(plan_backward, "backward", backward)
    return calls


@pytest.mark.parametrize("causal", [True, False])
def test_eager_attention_with_a_sink_has_the_reference_gradients(stand_ins, causal):
    """The backward runs on the forward's own (sink-normalised) output and
    LSE and the sink's gradient comes from them: every gradient, the sink's
    included, equals autograd through the float64 reference with the sink
    as a column."""
    q, k, v, s = (t.requires_grad_() for t in _problem(seqlen_q=11, seqlen_k=7))
    out, lse = ops.EagerAttention.apply(q, k, v, 0.25, causal, False, None, 0.0, s)
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=0.25, sink=s)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse.detach(), rtol=1e-6, atol=1e-6)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, s), dout)
    expected = torch.autograd.grad(ref_out, (q, k, v, s), dout)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_the_ops_autograd_formula_gives_the_sinks_gradient(monkeypatch):
    """``hopper_flash::fwd``'s registered backward (``ops._backward``) with
    the backward op replaced: dq, dk, dv from the saved output and LSE, and
    the sink's gradient, as the reference's."""
    monkeypatch.setattr(ops, "bwd", lambda dout, q, k, v, out, lse, scale, causal, det, wl, wr, cap, sink:
                        _flash_backward(dout, q, k, v, out, lse, scale, causal, sink))
    q, k, v, s = (t.requires_grad_() for t in _problem(seqlen_q=5, seqlen_k=9))
    ref_out, ref_lse = attention_reference(q, k, v, causal=True, softmax_scale=0.25, sink=s)
    ctx = SimpleNamespace(needs_input_grad=(True,) * 3 + (False,) * 6 + (True,))
    ctx.save_for_backward = lambda *t: setattr(ctx, "saved_tensors", tuple(x.detach() for x in t))
    ops._setup_context(ctx, (q, k, v, 0.25, True, False, -1, -1, 0.0, s), (ref_out.detach(), ref_lse.detach()))
    dout = torch.randn_like(ref_out)
    grads = ops._backward(ctx, dout, None)
    assert len(grads) == 10
    expected = torch.autograd.grad(ref_out, (q, k, v, s), dout)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), (*grads[:3], grads[9]), expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_frozen_sinks_ask_the_backward_for_no_gradient(monkeypatch):
    """Sinks that need no gradient are not handed to the backward (no
    partial sums for nothing), and their gradient slot is None."""
    seen = []

    def backward(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, window=None, softcap=0.0, sink=None):
        seen.append(sink)
        return _flash_backward(dout, q, k, v, out, lse, softmax_scale, causal, sink)

    monkeypatch.setattr(dispatch, "forward_validated", _forward_stand_in)
    monkeypatch.setattr(plan_backward, "backward", backward)
    q, k, v, s = _problem()
    q.requires_grad_()
    out, _ = ops.EagerAttention.apply(q, k, v, 0.25, True, False, None, 0.0, s)
    out.backward(torch.randn_like(out))
    assert seen == [None] and q.grad is not None and s.grad is None
    s.requires_grad_()
    out, _ = ops.EagerAttention.apply(q, k, v, 0.25, True, False, None, 0.0, s)
    out.backward(torch.randn_like(out))
    assert seen[1] is s and s.grad is not None


def test_training_only_the_sink_runs_no_attention_backward(stand_ins):
    q, k, v, s = _problem()
    s.requires_grad_()
    out, _ = ops.EagerAttention.apply(q, k, v, 0.25, True, False, None, 0.0, s)
    (ds,) = torch.autograd.grad(out, s, torch.randn_like(out))
    assert stand_ins == [] and ds.shape == s.shape


# ---- how the kernels take the sinks (host side) -----------------------------


def test_sinks_are_read_in_place_in_their_own_dtype_or_copied_to_float32():
    from hopper_flash import plan

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        s = torch.randn(8, dtype=dtype)
        got = plan.sink_arg(s)
        assert got.data_ptr() == s.data_ptr() and got.dtype == dtype and not got.requires_grad
        assert plan.sink_mode(got) == str(dtype).removeprefix("torch.")
    for s in (torch.randn(8, dtype=torch.float64), torch.randn(16, dtype=torch.bfloat16)[::2],
              torch.randn(9)[1:]):  # another dtype, strided, off 16-byte alignment
        got = plan.sink_arg(s)
        assert got.dtype == torch.float32 and got.is_contiguous() and got.data_ptr() % 16 == 0
        assert torch.equal(got, s.float())
    assert plan.sink_arg(None) is None and plan.sink_mode(None) == ""


def test_a_prepared_calls_key_holds_the_sinks_address_dtype_and_size():
    s = torch.randn(8, dtype=torch.bfloat16)
    assert dispatch._sink_key(None) is None
    assert dispatch._sink_key(s) == (s.data_ptr(), -1, torch.bfloat16, 8)
    # Sinks the kernels would read from a copy are never prepared (the copy is per call).
    assert dispatch._sink_key(s.double()) is False and dispatch._sink_key(torch.randn(16)[::2]) is False


# ---- argument checks ---------------------------------------------------------


def _bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


BAD_SINKS = [
    ([0.0] * 4, TypeError, "learnable_sink must be a torch.Tensor"),
    (torch.zeros(4, dtype=torch.int32), ValueError, "learnable_sink must be a floating-point tensor"),
    (torch.zeros(3), ValueError, r"learnable_sink must have shape \[nheads\] = \(4,\)"),
    (torch.zeros(1, 4), ValueError, r"learnable_sink must have shape \[nheads\]"),
    (torch.zeros(4, device="meta"), ValueError, "learnable_sink must be on q's device"),
]


@pytest.mark.parametrize("sink, error, message", BAD_SINKS, ids=["list", "int", "length", "rank", "device"])
def test_bad_sink_is_refused_by_name_everywhere(sink, error, message):
    q, k = _bf16(2, 8, 4, 64), _bf16(2, 8, 2, 64)
    with pytest.raises(error, match=message):
        hopper_flash.flash_attn_func(q, k, k, learnable_sink=sink)
    with pytest.raises(error, match=message):
        hopper_flash.flash_attn_func(q.requires_grad_(), k, k, learnable_sink=sink)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(error, match=message):
        hopper_flash.flash_attn_varlen_func(q[0], k[0], k[0], cu, cu, 5, 5, learnable_sink=sink)
    cache = _bf16(2, 16, 2, 64)
    before = cache.clone()
    with pytest.raises(error, match=message):
        hopper_flash.flash_attn_with_kvcache(q.detach(), cache, cache.clone(), k.detach()[:, :1],
                                             k.detach()[:, :1], cache_seqlens=3, learnable_sink=sink)
    assert torch.equal(cache, before)  # refused before the append


def test_a_good_sink_reaches_the_device_check():
    """The sink passes its checks; the CPU tensors are refused next, by q's device check."""
    q, k = _bf16(2, 8, 4, 64), _bf16(2, 8, 2, 64)
    with pytest.raises(ValueError, match="must be a CUDA tensor on a Hopper GPU"):
        hopper_flash.flash_attn_func(q, k, k, learnable_sink=torch.zeros(4))


@pytest.mark.parametrize("head_dim", [64, 128, 256, 96])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_sink_gradient_kernel_compiles_for_sm90_with_vector_loads(head_dim, dtype):
    """kernels/sink.py's row pass compiles for sm_90a (no GPU needed), and
    with the JIT's 16-byte pointer specialisation its rows move in 128-bit
    loads (plain strides had them element by element)."""
    import os
    import subprocess
    import tempfile

    from hopper_flash.compile_check import _bindir, compile_triton
    from hopper_flash.kernels.sink import _INTS, _sink_grad_kernel

    from hopper_flash import plan
    # (96: rows of head dim 128's width, masked at 96)
    consts = {"BLOCK": 64, "HEAD_DIM": plan.kernel_head_dim(head_dim), "OUT_DIM": plan.narrower_width(head_dim)}
    ints = {n: "i32" for n in _INTS}
    grad = {"o_ptr": f"*{dtype}", "do_ptr": f"*{dtype}", "lse_ptr": "*fp32", "sink_ptr": "*fp32",
            "part_ptr": "*fp32", **ints, **{n: "constexpr" for n in consts}}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(5)}  # the five pointers
    compiled = compile_triton(_sink_grad_kernel, grad, consts, num_warps=4, attrs=aligned)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        sass = subprocess.run([os.path.join(_bindir(), "cuobjdump"), "--dump-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    assert "LDG.E.128" in sass and "LDG.E.U16" not in sass


_SINK_CHILD = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, sys.argv[1])
import torch
from hopper_flash import plan, sinks
# The interpreter runs CPU tensors through the JIT: take the kernel's path
# (sinks._fused is False off the GPU) and launch it the JIT's way.
sinks._fused = lambda *tensors: True
plan.launch_triton = lambda kernel, grid, args, constexprs, num_warps, launch_pdl=False: \\
    kernel[grid](*args, **constexprs, num_warps=num_warps)
torch.save([sinks.sink_grad(*case) for case in torch.load(sys.argv[2])], sys.argv[3])
"""


def test_sink_gradient_kernel_on_other_head_dims(tmp_path):
    """kernels/sink.py through Triton's interpreter: head dims without
    kernels of their own (rows of the next power of two, masked at the head
    dim; NaN past it in the tensors' memory must not reach the sums) give
    torch's formula (``sink_grad``'s path off the GPU)."""
    import os
    import subprocess
    import sys

    from hopper_flash import _triton_support
    if _triton_support.parse_minor(_triton_support.installed_version()) < (3, 7):
        pytest.skip("triton 3.6's interpreter cannot use a scalar kernel argument under numpy 2")
    gen = torch.Generator().manual_seed(3)
    cases = []
    for d, layout in ((96, "bshd"), (40, "thd"), (64, "bshd")):
        shape = (2, 33, 4) if layout == "bshd" else (45, 4)
        # Rows of a wider buffer whose extra features hold NaN: a read past the head dim poisons the sum.
        out = torch.full((*shape, d + 8), float("nan")).to(torch.bfloat16)[..., :d]
        dout = torch.full((*shape, d + 8), float("nan")).to(torch.bfloat16)[..., :d]
        out.copy_(torch.randn(*shape, d, generator=gen))
        dout.copy_(torch.randn(*shape, d, generator=gen))
        lse = torch.randn(2, 4, 33, generator=gen) if layout == "bshd" else torch.randn(4, 45, generator=gen)
        sink = torch.randn(4, generator=gen)
        cases.append((dout, out, lse, sink))
    torch.save(cases, tmp_path / "cases.pt")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", _SINK_CHILD, root, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
                   check=True, capture_output=True, text=True, timeout=600)
    for case, got in zip(cases, torch.load(tmp_path / "out.pt")):
        want = sinks.sink_grad(*case)  # torch's ops (CPU tensors)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
