"""v's head dim other than q's and k's (FA3's ``hdim_v``: DeepSeek's 192 for
q and k, 128 for v), on the CPU. Both run on the kernels of the wider
(``plan.kernel_head_dim``), read as they are: TMA reads zeros past each
tensor's last feature and clips the stores, so what changes is the host's
part, checked here: the output's shape, the plan's config, the combine's and
the backward's small kernels' widths, the prepared call's output and
descriptors, the ops' fakes, the KV cache's checks and append, and the varlen
backward's dK/dV rows (one pair
of strides in the kernel: written into buffers of the wider head dim). The
numbers on the GPU are tests/test_head_dims_gpu.py's ``test_head_dim_v_*``."""
import math

import pytest
import torch

import hopper_flash
from hopper_flash import checks, dispatch, kvcache, plan, plan_backward
from test_direct_launch_cpu import fakes  # noqa: F401  (a fixture: the kernels' JIT launches logged)
from test_head_dims_cpu import attention64, kernels  # noqa: F401  (a fixture)

F64 = torch.float64
BF16 = torch.bfloat16


@pytest.mark.parametrize("head_dim,head_dim_v,kernel_dim", [(192, 128, 256), (128, 192, 256), (128, 96, 128),
                                                            (64, 128, 128), (96, 64, 128), (256, 64, 256),
                                                            (128, 128, 128), (40, 32, 64)])
def test_the_wider_head_dims_kernels_serve(head_dim, head_dim_v, kernel_dim):
    assert plan.kernel_head_dim(head_dim, head_dim_v) == kernel_dim
    q = torch.empty(2, 3, 4, head_dim, dtype=BF16)
    v = torch.empty(2, 5, 4, head_dim_v, dtype=BF16)
    assert plan.out_shape(q, v) == (2, 3, 4, head_dim_v)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim,head_dim_v", [(192, 128), (64, 128), (96, 40)])
def test_forward_and_backward_take_v_as_it_is(kernels, head_dim, head_dim_v, causal):  # noqa: F811
    gen = torch.Generator().manual_seed(head_dim + head_dim_v)
    q = torch.randn(2, 7, 4, head_dim, generator=gen, dtype=F64, requires_grad=True)
    k = torch.randn(2, 9, 2, head_dim, generator=gen, dtype=F64, requires_grad=True)
    v = torch.randn(2, 9, 2, head_dim_v, generator=gen, dtype=F64, requires_grad=True)
    out = hopper_flash.flash_attn_func(q, k, v, causal=causal)
    assert out.shape == (2, 7, 4, head_dim_v)
    scale = 1 / math.sqrt(head_dim)  # q's head dim, as FA3
    grad = torch.randn(out.shape, generator=gen, dtype=F64)
    got = torch.autograd.grad(out, (q, k, v), grad)
    assert kernels == [("forward", head_dim, head_dim, head_dim_v, scale), ("backward", head_dim, head_dim_v, scale)]
    ref = attention64(q, k, v, scale, causal)[0]
    torch.testing.assert_close(out, ref)
    for g, w, t in zip(got, torch.autograd.grad(ref, (q, k, v), grad), (q, k, v)):
        assert g.shape == t.shape
        torch.testing.assert_close(g, w)


def test_the_ops_fakes_give_v_head_dim_outputs():
    from hopper_flash import ops
    from unittest import mock

    with mock.patch.object(checks, "check_device", lambda t, name="q": None):
        q = torch.empty(2, 64, 4, 192, device="meta", dtype=BF16, requires_grad=True)
        k = torch.empty(2, 33, 2, 192, device="meta", dtype=BF16, requires_grad=True)
        v = torch.empty(2, 33, 2, 128, device="meta", dtype=BF16, requires_grad=True)
        out, lse = torch.ops.hopper_flash.fwd(q, k, v, 0.1, True)
        assert out.shape == (2, 64, 4, 128) and lse.shape == (2, 4, 64)
        dq, dk, dv = torch.autograd.grad(out.float().sum(), (q, k, v))
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        qt, kt, vt = q[0].detach(), k[0].detach(), v[0].detach()  # THD [total, H, D]
        cu = torch.tensor([0, 64], dtype=torch.int32, device="meta")
        cu_k = torch.tensor([0, 33], dtype=torch.int32, device="meta")
        out, lse = ops._varlen_fwd_fake(qt, kt, vt, cu, cu_k, None, None, 64, 33, 0.1, True)
        assert out.shape == (64, 4, 128) and lse.shape == (4, 64)
        grads = ops._varlen_bwd_fake(out, qt, kt, vt, out, lse, cu, cu_k, None, None, 64, 33, 0.1, True, False)
        assert [g.shape for g in grads[:3]] == [qt.shape, kt.shape, vt.shape]


def test_a_split_decode_launch_reads_and_writes_v_width(fakes):  # noqa: F811
    # q and k 192 wide, v 128: head dim 256's kernel and plan; its descriptors
    # over the tensors as they are; the combine reads partials of the
    # kernel's width and writes 128 features a row.
    q = torch.randn(2, 1, 8, 192).to(BF16)
    k = torch.randn(2, 8192, 2, 192).to(BF16)
    v = torch.randn(2, 8192, 2, 128).to(BF16)
    out = torch.empty(2, 1, 8, 128, dtype=BF16)
    plan.launch_forward(q, k, v, out, None, 0.1, True, num_splits=0, pack_gqa=None)
    (_, _, args, _), (_, _, c_args, c_kwargs) = fakes
    [key] = plan._COMPILED
    assert key[4] is plan.CONFIGS[256] and key[5].split
    assert [tuple(d.base.shape) for d in args[:4]] == [q.shape, k.shape, v.shape, out.shape]
    assert [d.block_shape[-1] for d in args[:4]] == [256] * 4
    assert c_args[0].shape[-1] == 256 and c_args[2] is out
    assert c_kwargs["HEAD_DIM"] == 256 and c_kwargs["OUT_DIM"] == 128


def test_a_prepared_call_allocates_and_describes_v_width(fakes):  # noqa: F811
    q = torch.randn(2, 1, 8, 192).to(BF16)
    call = plan.PreparedForward(q, 0.1, False, head_dim_v=128)
    assert call.out_shape == (2, 1, 8, 128) and call.head_dim == 256
    assert plan.PreparedForward(q, 0.1, False, head_dim_v=192).out_shape is None  # empty_like(q)
    k = torch.randn(2, 8192, 2, 192).to(BF16)
    v = torch.randn(2, 8192, 2, 128).to(BF16)
    out = torch.empty(2, 1, 8, 128, dtype=BF16)
    lp = plan.launch_forward(q, k, v, out, None, 0.1, True, num_splits=0, pack_gqa=None)
    assert lp is None  # the first launch: the JIT's
    lp = plan._plan_launch(None, BF16, 2, 1, 8, 2, 8192 // 64, plan.CONFIGS[256], 0, False, False, 0, None, True,
                           False)
    launch = plan._PreparedLaunch(lp, plan._COMPILED[next(iter(plan._COMPILED))], object(), q, 2, 0.1, False,
                                  head_dim_v=128)
    assert launch.out_strides == (8 * 128, 8 * 128, 128, 1)
    names = plan._combine_constexprs(256, lp.num_splits, False, False, 128)  # their order in the template's tail
    template = dict(zip(names, launch.combine_template[-len(names):]))
    assert template["OUT_DIM"] == 128 and template["HEAD_DIM"] == 256


def _bwd_args(q_dim, v_dim, varlen=False):
    k_shape = (40, 2) if varlen else (2, 40, 2)
    q_shape = (50, 4) if varlen else (2, 25, 4)
    q = torch.randn(*q_shape, q_dim).to(BF16)
    k = torch.randn(*k_shape, q_dim).to(BF16)
    v = torch.randn(*k_shape, v_dim).to(BF16)
    out = torch.randn(*q_shape, v_dim).to(BF16)
    lse = torch.zeros(4, 50) if varlen else torch.zeros(2, 4, 25)
    return q, k, v, out, lse


@pytest.mark.parametrize("q_dim,v_dim", [(192, 128), (128, 192), (96, 64)])
def test_the_backward_plan_takes_the_wider_kernel_and_each_tensors_width(monkeypatch, q_dim, v_dim):
    monkeypatch.setattr(plan, "sm_count", lambda device=None: 132)
    q, k, v, out, lse = _bwd_args(q_dim, v_dim)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    lp = plan_backward.plan_for(out, q, k, out, lse, dq, dk, dv, 0.1, True)
    width = plan.kernel_head_dim(q_dim, v_dim)
    assert lp.cfg.head_dim == width
    # The preprocess reads O and dO (v's width) and zeroes dq_accum rows (the
    # kernel's); the postprocess writes dQ (q's width) from those rows.
    assert lp.pre.constexprs["HEAD_DIM"] == lp.post.constexprs["HEAD_DIM"] == width
    assert lp.pre.constexprs["OUT_DIM"] == (v_dim if v_dim < width else 0)
    assert lp.post.constexprs["OUT_DIM"] == (q_dim if q_dim < width else 0)
    # Another v width is another plan.
    narrow = 64 if v_dim != 64 else 32
    other = torch.randn(*out.shape[:-1], narrow).to(BF16)
    v_other = torch.randn(*v.shape[:-1], narrow).to(BF16)
    assert plan_backward.plan_for(other, q, k, other, lse, dq, dk, v_other, 0.1, True) is not lp


@pytest.mark.parametrize("q_dim,v_dim", [(192, 128), (128, 192)])
def test_the_varlen_backward_writes_dk_and_dv_rows_of_one_width(monkeypatch, q_dim, v_dim):
    # The kernel stores dK and dV rows by address with one pair of strides:
    # both go into buffers of the wider head dim, the narrower copied out.
    q, k, v, out, lse = _bwd_args(q_dim, v_dim, varlen=True)
    seen = {}

    def launch(dout, q_, k_, v_, out_, lse_, dq, dk, dv, *args, **kwargs):
        seen.update(dk=dk, dv=dv)
        assert dk.shape == dv.shape == (40, 2, max(q_dim, v_dim)) and dk.stride() == dv.stride()
        dq.fill_(1)
        dk.copy_(torch.arange(dk.numel()).view(dk.shape))
        dv.copy_(-torch.arange(dv.numel()).view(dv.shape))

    monkeypatch.setattr(plan_backward, "launch_backward", launch)
    monkeypatch.setattr(plan, "on_device", lambda t: __import__("contextlib").nullcontext())
    cu = torch.tensor([0, 50], dtype=torch.int32)
    cu_k = torch.tensor([0, 40], dtype=torch.int32)
    batch = plan_backward.VarlenBatch(cu, cu_k, None, None, 50, 40)
    dq, dk, dv = plan_backward.backward_varlen(out, q, k, v, out, lse, batch, 0.1, True)
    assert dk.shape == k.shape and dv.shape == v.shape and dk.is_contiguous() and dv.is_contiguous()
    torch.testing.assert_close(dk, seen["dk"][..., :q_dim])
    torch.testing.assert_close(dv, seen["dv"][..., :v_dim])
    assert (seen["dk"] if q_dim > v_dim else seen["dv"]).data_ptr() == (dk if q_dim > v_dim else dv).data_ptr()


def test_the_varlen_forward_stores_o_at_v_width(fakes):  # noqa: F811
    q = torch.randn(50, 4, 192).to(BF16)
    k = torch.randn(40, 2, 192).to(BF16)
    v = torch.randn(40, 2, 128).to(BF16)
    out = torch.empty(50, 4, 128, dtype=BF16)
    cu, cu_k = torch.tensor([0, 50], dtype=torch.int32), torch.tensor([0, 40], dtype=torch.int32)
    plan.launch_forward_varlen(q, k, v, out, None, cu, cu_k, None, None, 50, 40, 0.1, True)
    [(_, _, args, kwargs)] = fakes
    assert kwargs["HEAD_DIM"] == 256 and kwargs["O_DIM"] == 128
    assert tuple(args[3].base.shape) == (1, 50, 4, 128)


def test_the_kv_cache_takes_v_head_dim():
    """A well-formed call gets to the device check; v's new tokens must have
    v_cache's head dim, and v_cache's must be one the kernels serve; the
    op's fake output has v's head dim."""
    q = torch.zeros(2, 1, 4, 192, dtype=BF16)
    kc = torch.zeros(2, 64, 4, 192, dtype=BF16)
    vc = torch.zeros(2, 64, 4, 128, dtype=BF16)
    kn, vn = torch.zeros(2, 1, 4, 192, dtype=BF16), torch.zeros(2, 1, 4, 128, dtype=BF16)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        hopper_flash.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=3)
    with pytest.raises(ValueError, match=r"v must have shape \[batch, seqlen_new, nheads_kv, headdim\] = "
                                         r"\(2, seqlen_new, 4, 128\), got \(2, 1, 4, 192\)"):
        hopper_flash.flash_attn_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=3)
    with pytest.raises(ValueError, match=r"head dim \(v_cache.shape\[3\]\) must be one of"):
        hopper_flash.flash_attn_with_kvcache(q, kc, torch.zeros(2, 64, 4, 100, dtype=BF16), cache_seqlens=3)
    with pytest.raises(ValueError, match="k_cache and v_cache must have the same shape but for the head dim"):
        hopper_flash.flash_attn_with_kvcache(q, kc, torch.zeros(2, 65, 4, 128, dtype=BF16), cache_seqlens=3)
    meta = [t.to("meta") for t in (q, kc, vc)]
    out, lse = kvcache._fwd_kvcache_fake(*meta, None, None, None, None, None, 0.1, True, 0, -1)
    assert out.shape == (2, 1, 4, 128) and lse.shape == (2, 4, 1)


def test_the_append_masks_k_and_v_at_their_own_head_dims():
    q = torch.zeros(2, 1, 4, 64, dtype=BF16)
    kc, vc = torch.zeros(2, 64, 2, 64, dtype=BF16), torch.zeros(2, 64, 2, 128, dtype=BF16)
    kn, vn = torch.zeros(2, 1, 2, 64, dtype=BF16), torch.zeros(2, 1, 2, 128, dtype=BF16)
    seqlens = torch.zeros(2, dtype=torch.int32)
    grid, args, constexprs = kvcache.append_launch(kc, vc, kn, vn, seqlens, None, None, q)
    from hopper_flash.kernels.append import append_kernel

    bound = dict(zip(append_kernel.arg_names, args))
    assert constexprs["HEAD_DIM"] == 128 and bound["head_dim"] == 64 and bound["head_dim_v"] == 128


def test_dispatch_checks_a_given_out_against_v_width():
    q = torch.zeros(1, 3, 2, 192, dtype=BF16)
    k = torch.zeros(1, 5, 2, 192, dtype=BF16)
    v = torch.zeros(1, 5, 2, 128, dtype=BF16)
    with pytest.raises(ValueError, match=r"out must have shape \(1, 3, 2, 128\)"):
        dispatch.forward_validated(q, k, v, 0.1, False, False, out=torch.zeros_like(q))
