"""Attention sinks (``sinks.py``) on the CPU: the renormalisation and the
sink's gradient against the float64 reference that carries the sink as an
explicit softmax column, the autograd composition (which output and LSE the
backward gets) with the ops replaced by float64 stand-ins, and the argument
checks on every entry point."""
import math

import pytest
import torch

import hopper_flash
from hopper_flash import ops, sinks
from hopper_flash.reference import attention_reference


def _problem(batch=2, seqlen_q=7, seqlen_k=11, h=4, hkv=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, h, d, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, seqlen_k, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, seqlen_k, hkv, d, generator=gen, dtype=torch.float64)
    s = torch.randn(h, generator=gen, dtype=torch.float64) * 2
    return q, k, v, s


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(7, 11), (11, 7), (1, 5)])
@pytest.mark.parametrize("causal", [True, False])
def test_renormalised_output_and_lse_are_the_sink_softmax(seqlen_q, seqlen_k, causal):
    # (11, 7) causal: the first four rows see no key: zeros and an LSE equal to the sink.
    q, k, v, s = _problem(seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    out, lse = attention_reference(q, k, v, causal=causal)
    got_out, got_lse = sinks.renormalise(out, lse, s)
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, sink=s)
    torch.testing.assert_close(got_out, ref_out, rtol=1e-6, atol=1e-6)  # renormalise works in float32
    torch.testing.assert_close(got_lse.double(), ref_lse, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(got_lse).all()


def test_varlen_layout_renormalises_per_head():
    q, k, v, s = _problem(batch=1)
    out, lse = attention_reference(q, k, v, causal=True)  # [1, S, H, D], [1, H, S]
    got_out, got_lse = sinks.renormalise(out[0], lse[0], s)  # THD [S, H, D], [H, S]
    ref_out, ref_lse = attention_reference(q, k, v, causal=True, sink=s)
    torch.testing.assert_close(got_out, ref_out[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_lse.double(), ref_lse[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_sink_gradient_is_autograds(causal):
    q, k, v, s = _problem(seqlen_q=11, seqlen_k=7)
    s = s.requires_grad_()
    ref_out, _ = attention_reference(q, k, v, causal=causal, sink=s)
    dout = torch.randn_like(ref_out)
    dout[:, :2] = math.nan  # rows that see no key (causal): their dO must not reach ds
    (expected,) = torch.autograd.grad(ref_out, s, dout.nan_to_num(0.0) if causal else dout.nan_to_num(1.0))
    out, lse = attention_reference(q, k, v, causal=causal)
    _, lse_sink = sinks.renormalise(out, lse, s.detach())
    got = sinks.sink_grad(dout if causal else dout.nan_to_num(1.0), out, lse, lse_sink, s.detach())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


# ---- the autograd composition, the ops replaced by float64 stand-ins ----------


def _fwd_stand_in(q, k, v, softmax_scale, causal, deterministic, window_left, window_right, softcap):
    return attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale)


def _bwd_stand_in(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, window_left, window_right,
                  softcap, sink=None):
    """A flash backward: P rebuilt from the LSE it is given, Δ from the
    output it is given, and with ``sink`` both renormalised first, as the
    op's contract says (``backward_pre``: LSE' = logaddexp(LSE, s), Δ' =
    exp(LSE - LSE') · rowsum(dO · out)); GQA heads summed."""
    delta = (dout * out).sum(-1).transpose(1, 2)
    if sink is not None:
        lse_sink = torch.logaddexp(lse, sink.view(1, -1, 1))
        delta = delta * torch.exp(lse - lse_sink)
        lse = lse_sink
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
    return dq, fold(dk), fold(dv)


@pytest.mark.parametrize("causal", [True, False])
def test_sink_attention_hands_the_backward_the_kernels_output_lse_and_sink(monkeypatch, causal):
    """The kernels' backward gets the kernels' own output and LSE and the
    sink (sinks.py): with stand-in ops that honour that contract, the
    composition's gradients (the sink's included) equal autograd through the
    float64 reference with the sink as a column. Handing it the renormalised
    output or LSE, or no sink, fails here."""
    monkeypatch.setattr(ops, "fwd", _fwd_stand_in)
    monkeypatch.setattr(ops, "bwd", _bwd_stand_in)
    q, k, v, s = (t.requires_grad_() for t in _problem(seqlen_q=11, seqlen_k=7))
    out, lse = sinks.SinkAttention.apply(q, k, v, s, 0.25, causal, False, -1, -1, 0.0)
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=0.25, sink=s)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), rtol=1e-6, atol=1e-6)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, s), dout)
    expected = torch.autograd.grad(ref_out, (q, k, v, s), dout)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


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


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_sink_kernels_compile_for_sm90_with_vector_loads(head_dim, dtype):
    """kernels/sink.py's two row passes compile for sm_90a (no GPU needed),
    and with the JIT's 16-byte pointer specialisation their rows move in
    128-bit loads and stores (plain strides had them element by element)."""
    import os
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hopper_flash.compile_check import _bindir
    from hopper_flash.kernels.sink import _INTS, _sink_grad_kernel, _sink_renorm_kernel

    consts = {"BLOCK": 64, "HEAD_DIM": head_dim}
    ints = {n: "i32" for n in _INTS}
    renorm = {"o_ptr": f"*{dtype}", "lse_ptr": "*fp32", "sink_ptr": "*fp32", "o2_ptr": f"*{dtype}",
              "lse2_ptr": "*fp32", **ints, **{n: "constexpr" for n in consts}}
    grad = {"o_ptr": f"*{dtype}", "do_ptr": f"*{dtype}", "lse_ptr": "*fp32", "sink_ptr": "*fp32",
            "part_ptr": "*fp32", **ints, **{n: "constexpr" for n in consts}}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(5)}  # the five pointers
    for kernel, sig in ((_sink_renorm_kernel, renorm), (_sink_grad_kernel, grad)):
        compiled = triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=aligned),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(compiled.asm["cubin"])
        try:
            sass = subprocess.run([os.path.join(_bindir(), "cuobjdump"), "--dump-sass", f.name],
                                  capture_output=True, text=True, check=True).stdout
        finally:
            os.unlink(f.name)
        assert "LDG.E.128" in sass and "LDG.E.U16" not in sass, kernel.__name__


def test_training_only_the_sink_runs_no_attention_backward(monkeypatch):
    calls = []
    monkeypatch.setattr(ops, "fwd", _fwd_stand_in)
    monkeypatch.setattr(ops, "bwd", lambda *a: calls.append(a) or _bwd_stand_in(*a))
    q, k, v, s = _problem()
    s.requires_grad_()
    out, _ = sinks.SinkAttention.apply(q, k, v, s, 0.25, True, False, -1, -1, 0.0)
    (ds,) = torch.autograd.grad(out, s, torch.randn_like(out))
    assert calls == [] and ds.shape == s.shape
