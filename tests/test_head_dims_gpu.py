"""Head dims without kernels of their own, on a Hopper GPU: multiples of 8
below 256 run on the next kernel head dim's kernels (``plan.kernel_head_dim``),
read as they are: TMA reads zeros past the last feature and clips the
stores; the stores by address (varlen's O, dK and dV, the combine, the
backward's pre/postprocess, the KV-cache append) stop at the head dim.
Forward and backward through the public functions, judged against the
float64 reference relative to SDPA's error on the same inputs
(``hopper_flash.reference``); against zero-padding by hand, bit for bit;
decode shapes (split-KV, PackGQA) with a guarded output, the KV cache
(contiguous, paged, appended, rotary), the packed, SDPA-style, torch.compile
and CUDA-graph routes. The varlen function's are in ``test_varlen_gpu.py``."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import hopper_flash
from hopper_flash import dispatch, plan
from hopper_flash.reference import check_attention, check_attention_grads, check_kvcache, random_qkv
from gpu_inputs import capture, nan_tailed_cache, paged_copy, rnd

pytestmark = pytest.mark.gpu

OTHER_HEAD_DIMS = [8, 32, 40, 72, 80, 96, 112, 160, 192, 224]


def judged(verdicts):
    failed = [v.message for v in verdicts if not v]
    assert not failed, "\n".join(failed)


def forward_backward(q, k, v, causal, dout=None, **kw):
    """``(out, lse, (dq, dk, dv), dout)`` through flash_attn_func's autograd
    (``dout`` drawn here unless given)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = hopper_flash.flash_attn_func(*leaves, causal=causal, return_lse=True, **kw)
    if dout is None:
        gen = torch.Generator(device="cuda").manual_seed(7)
        dout = torch.randn(out.shape, generator=gen, device="cuda").to(out.dtype)
    return out.detach(), lse, torch.autograd.grad(out, leaves, dout), dout


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", OTHER_HEAD_DIMS)
def test_forward_and_backward(head_dim, causal):
    q, k, v = random_qkv(2, 257, 300, 8, 2, head_dim, seed=head_dim)
    out, lse, grads, dout = forward_backward(q, k, v, causal)
    assert out.shape == q.shape and out.is_contiguous() and lse.shape == (2, 8, 257)
    judged(check_attention(out, q, k, v, causal=causal, lse=lse))
    judged(check_attention_grads(grads, q, k, v, dout, causal=causal))
    # Zero-padded by hand to the kernel's head dim, the same kernels see the
    # same values in shared memory (TMA's zeros or the padding's): the same
    # bits, forward and backward, cut back. (The backward in deterministic
    # mode: the fast one sums dQ with atomics in whatever order the CTAs
    # arrive, so its bits differ from run to run.)
    pad = plan.kernel_head_dim(head_dim) - head_dim
    out_p, lse_p, grads_p, _ = forward_backward(*(F.pad(t, (0, pad)) for t in (q, k, v)), causal,
                                                softmax_scale=1.0 / math.sqrt(head_dim), dout=F.pad(dout, (0, pad)),
                                                deterministic=True)
    _, _, grads_d, _ = forward_backward(q, k, v, causal, dout=dout, deterministic=True)
    assert torch.equal(out_p[..., :head_dim], out) and torch.equal(lse_p, lse)
    for g, g_p in zip(grads_d, grads_p):
        assert torch.equal(g_p[..., :head_dim], g)


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


@pytest.mark.parametrize("head_dim", [40, 96, 192])
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,nheads,nheads_kv", [
    (1, 1, 4099, 32, 8), (2, 3, 1000, 8, 8), (3, 128, 8192, 32, 8)])
def test_decode_shapes_take_split_and_packgqa(head_dim, batch, seqlen_q, seqlen_k, nheads, nheads_kv):
    """flash_attn_func's decode modes (split-KV with the combine writing only
    the head dim's features, PackGQA) on other head dims."""
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, seed=seqlen_k)
    n = q.numel()
    buf = torch.full((n + 4096,), 12345.0, dtype=q.dtype, device="cuda")
    buf[:n] = float("nan")
    out, lse = dispatch.forward(q, k, v, None, True, True, out=buf[:n].view(q.shape))
    assert (buf[n:] == 12345.0).all(), "a store ran past the output's last feature"
    judged(check_attention(out, q, k, v, causal=True, lse=lse))
    assert torch.equal(out, hopper_flash.flash_attn_func(q, k, v, causal=True))


@pytest.mark.parametrize("head_dim", [40, 80, 96, 192])
@pytest.mark.parametrize("page_size", [0, 1, 16, 128], ids=["contiguous", "page1", "page16", "page128"])
def test_kvcache_append_and_pages(head_dim, page_size):
    """flash_attn_with_kvcache on other head dims: the append (masked at the
    head dim, nothing written past a row's features), NaN tails, pages read
    by TMA (16, 128) or copied (1: gathering reads whole kernel rows, so
    such pages are copied first)."""
    lens, cap, B, s_new = [0, 500, 1300], 2048, 3, 2
    kc, vc = nan_tailed_cache(B, cap, 8, head_dim, lens, seed=head_dim)
    q = rnd(B, s_new, 32, head_dim, seed=1)
    kn, vn = rnd(B, s_new, 8, head_dim, seed=2), rnd(B, s_new, 8, head_dim, seed=3)
    cs = torch.tensor(lens, dtype=torch.int32, device="cuda")
    if page_size:
        kp, vp, pt = paged_copy(kc, vc, page_size, [cap] * B, seed=4)
        out = hopper_flash.flash_attn_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=cs, page_table=pt, causal=True)
        kc = kp[pt.long()].reshape(B, cap, 8, head_dim)
        vc = vp[pt.long()].reshape(B, cap, 8, head_dim)
    else:
        out = hopper_flash.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=cs, causal=True)
    for b, L in enumerate(lens):
        assert torch.equal(kc[b, L:L + s_new], kn[b]) and torch.equal(vc[b, L:L + s_new], vn[b])
        assert torch.isnan(kc[b, L + s_new:]).all(), "the append wrote past its rows"
    failed = [v.message for v in check_kvcache(out, q, kc, vc, [L + s_new for L in lens], causal=True) if not v]
    assert not failed, "\n".join(failed)


def test_kvcache_rotary_and_splits():
    """Rotary embedding and an explicit split count on head dim 96."""
    B, cap, D = 2, 4096, 96
    lens = [4000, 17]
    kc, vc = nan_tailed_cache(B, cap, 2, D, lens, seed=11)
    q, kn, vn = rnd(B, 1, 16, D, seed=12), rnd(B, 1, 2, D, seed=13), rnd(B, 1, 2, D, seed=14)
    angle = torch.rand(cap, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(15)) * 6.3
    cos, sin = torch.cos(angle), torch.sin(angle)
    cs = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = hopper_flash.flash_attn_with_kvcache(q, kc, vc, kn, vn, rotary_cos=cos, rotary_sin=sin, cache_seqlens=cs,
                                               causal=True, num_splits=7)
    from rotary_ref import rotate64
    q_rot = rotate64(q, cos, sin, cs.long()[:, None, None], True).to(q.dtype)
    failed = [v.message for v in check_kvcache(out, q_rot, kc, vc, [L + 1 for L in lens], causal=True) if not v]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("head_dim", [40, 96])
def test_sink_gradient_alone(head_dim):
    """Sinks trained with q, k and v frozen (``sinks.sink_grad``'s kernel,
    rows masked at the head dim) against the sinks' gradient of the whole
    backward (the preprocess's partial sums)."""
    q, k, v = random_qkv(2, 300, 300, 8, 2, head_dim, seed=21)
    sink = rnd(8, seed=22, dtype=torch.float32)
    dout = rnd(2, 300, 8, head_dim, seed=23)
    s1 = sink.clone().requires_grad_()
    out = hopper_flash.flash_attn_func(q, k, v, causal=True, learnable_sink=s1)
    (alone,) = torch.autograd.grad(out, (s1,), dout)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    s2 = sink.clone().requires_grad_()
    out2 = hopper_flash.flash_attn_func(*leaves, causal=True, learnable_sink=s2)
    assert torch.equal(out, out2)
    whole = torch.autograd.grad(out2, (*leaves, s2), dout)[3]
    assert torch.isfinite(alone).all()
    torch.testing.assert_close(alone, whole, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- v's head dim other than q's and k's
#
# FA3's hdim_v (DeepSeek's 192 for q and k, 128 for v): both run on the
# kernels of the wider, read as they are. The check: padded by hand with
# zeros to one head dim (what TMA reads past the narrower tensor's features
# anyway), the same kernels see the same shared memory, so the outputs and
# gradients are the same bits, cut back; and the padded call is judged
# against the float64 reference.

HEAD_DIMS_V = [(192, 128), (128, 64), (64, 128), (96, 40)]


def _pad_to(t, width):
    return F.pad(t, (0, width - t.shape[-1]))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim,head_dim_v", HEAD_DIMS_V)
def test_head_dim_v_forward_and_backward(head_dim, head_dim_v, causal):
    q, k, _ = random_qkv(2, 257, 300, 8, 2, head_dim, seed=head_dim)
    v = rnd(2, 300, 2, head_dim_v, seed=head_dim_v)
    out, lse, grads, dout = forward_backward(q, k, v, causal)
    assert out.shape == (2, 257, 8, head_dim_v) and out.is_contiguous() and lse.shape == (2, 8, 257)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    judged(check_attention(out, q, k, v, causal=causal, lse=lse))
    judged(check_attention_grads(grads, q, k, v, dout, causal=causal))
    # Bit for bit against zero-padding by hand (the backward in deterministic
    # mode: the fast one's dQ atomics sum in the order the CTAs arrive).
    width = max(head_dim, head_dim_v)
    padded = [_pad_to(t, width) for t in (q, k, v)]
    out_p, lse_p, grads_p, _ = forward_backward(*padded, causal, softmax_scale=1.0 / math.sqrt(head_dim),
                                                dout=_pad_to(dout, width), deterministic=True)
    _, _, grads_d, _ = forward_backward(q, k, v, causal, dout=dout, deterministic=True)
    assert torch.equal(out_p[..., :head_dim_v], out) and torch.equal(lse_p, lse)
    for g, g_p in zip(grads_d, grads_p):
        assert torch.equal(g_p[..., :g.shape[-1]], g)


@pytest.mark.parametrize("head_dim,head_dim_v", [(192, 128), (64, 128)])
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,nheads,nheads_kv", [
    (1, 1, 4099, 32, 8), (2, 3, 1000, 8, 8), (3, 128, 8192, 32, 8)])
def test_head_dim_v_decode_shapes_and_prepared_calls(head_dim, head_dim_v, batch, seqlen_q, seqlen_k, nheads,
                                                    nheads_kv):
    """Split-KV (the combine writes v's features), PackGQA, and the prepared
    call (the third call of a signature) with its own output width."""
    q, k, _ = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, seed=seqlen_k)
    v = rnd(batch, seqlen_k, nheads_kv, head_dim_v, seed=seqlen_q)
    shape = (batch, seqlen_q, nheads, head_dim_v)
    n = math.prod(shape)
    buf = torch.full((n + 4096,), 12345.0, dtype=q.dtype, device="cuda")
    buf[:n] = float("nan")
    out, lse = dispatch.forward(q, k, v, None, True, True, out=buf[:n].view(shape))
    assert (buf[n:] == 12345.0).all(), "a store ran past the output's last feature"
    width = max(head_dim, head_dim_v)
    padded = [_pad_to(t, width) for t in (q, k, v)]
    out_p = hopper_flash.flash_attn_func(*padded, causal=True, softmax_scale=1.0 / math.sqrt(head_dim))
    assert torch.equal(out_p[..., :head_dim_v], out)
    judged(check_attention(out_p, *padded, causal=True, softmax_scale=1.0 / math.sqrt(head_dim)))
    # The second call launches directly and prepares the signature; the third and fourth take the prepared call.
    calls = [hopper_flash.flash_attn_func(q, k, v, causal=True) for _ in range(4)]
    for c in calls:
        assert c.shape == shape and torch.equal(c, out)


@pytest.mark.parametrize("head_dim,head_dim_v", [(192, 128), (128, 192)])
def test_head_dim_v_varlen(head_dim, head_dim_v):
    lens_q, lens_k = [0, 1, 127, 300, 129], [5, 1, 200, 300, 1000]
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32, device="cuda")
    q = rnd(sum(lens_q), 8, head_dim, seed=1)
    k = rnd(sum(lens_k), 2, head_dim, seed=2)
    v = rnd(sum(lens_k), 2, head_dim_v, seed=3)
    dout = rnd(sum(lens_q), 8, head_dim_v, seed=4)

    def run(q, k, v, dout, **kw):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = hopper_flash.flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                       return_lse=True, **kw)
        return out.detach(), lse, torch.autograd.grad(out, leaves, dout)

    out, lse, grads = run(q, k, v, dout, deterministic=True)  # (the fast dQ's atomics: no fixed bits)
    assert out.shape == (sum(lens_q), 8, head_dim_v) and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    width = max(head_dim, head_dim_v)
    out_p, lse_p, grads_p = run(*(_pad_to(t, width) for t in (q, k, v, dout)),
                                softmax_scale=1.0 / math.sqrt(head_dim), deterministic=True)
    assert torch.equal(out_p[..., :head_dim_v], out) and torch.equal(lse_p, lse)
    for g, g_p in zip(grads, grads_p):
        assert torch.equal(g_p[..., :g.shape[-1]], g)


def test_head_dim_v_torch_compile():
    q, k, _ = random_qkv(2, 333, 333, 4, 2, 192, seed=9)
    v = rnd(2, 333, 2, 128, seed=10)
    eager = hopper_flash.flash_attn_func(q, k, v, causal=True)
    compiled = torch.compile(lambda a, b, c: hopper_flash.flash_attn_func(a, b, c, causal=True), fullgraph=True)
    assert torch.equal(compiled(q, k, v), eager)


@pytest.mark.parametrize("head_dim,head_dim_v", [(192, 128), (64, 128)])
@pytest.mark.parametrize("page_size", [0, 1, 16], ids=["contiguous", "page1", "page16"])
def test_head_dim_v_kvcache(head_dim, head_dim_v, page_size):
    """flash_attn_with_kvcache with v_cache narrower or wider than k_cache:
    the append writes each at its own width (NaN tails past the new rows
    untouched), pages read by TMA or (1 key) copied first; the same bits as
    v padded by hand, whose call is judged."""
    lens, cap, B, s_new = [0, 500, 1300], 2048, 3, 2
    kc, _ = nan_tailed_cache(B, cap, 8, head_dim, lens, seed=head_dim)
    _, vc = nan_tailed_cache(B, cap, 8, head_dim_v, lens, seed=head_dim_v)
    q = rnd(B, s_new, 32, head_dim, seed=1)
    kn, vn = rnd(B, s_new, 8, head_dim, seed=2), rnd(B, s_new, 8, head_dim_v, seed=3)
    cs = torch.tensor(lens, dtype=torch.int32, device="cuda")
    width = max(head_dim, head_dim_v)
    scale = 1.0 / math.sqrt(head_dim)

    def run(kc, vc, kn, vn, q):
        if page_size:
            kp, vp, pt = paged_copy(kc, vc, page_size, [cap] * B, seed=4)
            out = hopper_flash.flash_attn_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=cs, page_table=pt,
                                                       causal=True, softmax_scale=scale)
            return out, kp[pt.long()].reshape(kc.shape), vp[pt.long()].reshape(vc.shape)
        kc, vc = kc.clone(), vc.clone()
        out = hopper_flash.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=cs, causal=True,
                                                   softmax_scale=scale)
        return out, kc, vc

    out, kc1, vc1 = run(kc, vc, kn, vn, q)
    assert out.shape == (B, s_new, 32, head_dim_v)
    for b, L in enumerate(lens):
        assert torch.equal(kc1[b, L:L + s_new], kn[b]) and torch.equal(vc1[b, L:L + s_new], vn[b])
        assert torch.isnan(vc1[b, L + s_new:]).all() and torch.isnan(kc1[b, L + s_new:]).all()
    out_p, kc_p, vc_p = run(*(_pad_to(t, width) for t in (kc, vc, kn, vn, q)))
    if page_size != 1:  # (pages of 1 key: ours are copied, the padded call's may be gathered by the kernel)
        assert torch.equal(out_p[..., :head_dim_v], out)
    # Judged as v padded by hand (its extra features give exact zeros in both).
    failed = [v.message for v in check_kvcache(_pad_to(out, width), _pad_to(q, width), kc_p, vc_p,
                                               [L + s_new for L in lens], causal=True, softmax_scale=scale) if not v]
    assert not failed, "\n".join(failed)
