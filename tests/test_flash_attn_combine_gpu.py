"""``flash_attn_combine`` on the GPU, on hopper_flash's own partials:
``flash_attn_func`` over parts of the keys (``return_lse``), merged, judged
against float64 attention over all of them, relative to the error SDPA's
bf16 math makes on the same inputs (``reference.check_attention``); and
captured in a CUDA graph with the attention calls."""
import math

import pytest
import torch

import hopper_flash
from hopper_flash.reference import check_attention

pytestmark = pytest.mark.gpu


def _inputs(seed, seqlen_k=3001):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, 129, 8, 128, generator=g, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(2, seqlen_k, 2, 128, generator=g, device="cuda").to(torch.bfloat16) for _ in "kv")
    return q, k, v


def _merged(q, k, v, bounds):
    parts = [hopper_flash.flash_attn_func(q, k[:, a:b], v[:, a:b], return_lse=True)
             for a, b in zip(bounds, bounds[1:])]
    out_partial = torch.stack([o.float() for o, _ in parts])
    lse_partial = torch.stack([lse for _, lse in parts]).transpose(-1, -2)
    # (float32: the parts' outputs are bf16 already, and one more rounding would
    # only spend the judge's margin on what the CPU tests cover)
    return hopper_flash.flash_attn_combine(out_partial, lse_partial)


@pytest.mark.parametrize("bounds", [[0, 1000, 3001], [0, 1, 129, 2048, 3001], [0, 3001]])
def test_parts_of_the_keys_merge_to_attention_over_all_of_them(bounds):
    q, k, v = _inputs(len(bounds))
    out, lse = _merged(q, k, v, bounds)
    bad = [r.message for r in check_attention(out, q, k, v, causal=False, lse=lse.transpose(1, 2)) if not r]
    assert not bad, bad


def test_merge_under_graph_replay():
    q, k, v = _inputs(7)
    bounds = [0, 1500, 3001]
    _merged(q, k, v, bounds)  # compiled and planned before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = _merged(q, k, v, bounds)
    fresh = _inputs(8)
    for dst, src in zip((q, k, v), fresh):
        dst.copy_(src)
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    bad = [r.message for r in check_attention(out, q, k, v, causal=False, lse=lse.transpose(1, 2)) if not r]
    assert not bad, bad


# The CUDA route's kernel (kernels/combine.py's combine_strided_kernel) on
# FA3's test layout, against the float64 merge row by row: the fp32 merge
# within the standard bound of an fp32 sum of `splits` terms, then one
# rounding to the output's dtype.
_UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


@pytest.mark.parametrize("splits,d", [(1, 64), (2, 128), (3, 80), (17, 256), (133, 128)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_the_kernel_route_matches_a_row_by_row_merge(splits, d, out_dtype):
    from hopper_flash import combine
    from test_flash_attn_combine_cpu import _merged_by_rows, _partials

    out_partial, lse_partial = _partials(splits, 3, 37, 4, d, seed=splits + d)
    want, want_lse = _merged_by_rows(out_partial, lse_partial)
    # The sum's magnitude: the standard bound on an fp32 sum of `splits` terms scales with it.
    size, _ = _merged_by_rows(out_partial.abs(), lse_partial)
    o, lse = (torch.empty_strided(t.shape, t.stride(), device="cuda").copy_(t) for t in (out_partial, lse_partial))
    assert combine._kernel_route(o, lse, None)
    out, got_lse = hopper_flash.flash_attn_combine(o, lse, out_dtype=out_dtype)
    assert out.dtype == out_dtype and got_lse.transpose(1, 2).is_contiguous()
    err = (out.double().cpu() - want).abs()
    assert (err <= want.abs() * _UNIT[out_dtype] + size * (splits + 8) * 2.0 ** -24 + 1e-7).all(), float(err.max())
    live = want_lse > -math.inf
    assert torch.equal(got_lse.isfinite().cpu(), live)
    assert ((got_lse.double().cpu()[live] - want_lse[live]).abs() <= 1e-5).all()
    assert (out.cpu()[~live] == 0).all()


def test_the_kernel_route_writes_into_a_strided_out():
    from test_flash_attn_combine_cpu import _merged_by_rows, _partials

    out_partial, lse_partial = _partials(4, 2, 9, 3, 128, seed=3)
    want, _ = _merged_by_rows(out_partial, lse_partial)
    wide = torch.full((2, 9, 3, 256), math.nan, dtype=torch.bfloat16, device="cuda")
    out = wide[..., 64:192]  # rows 512 bytes apart: a slice of a wider tensor
    got, _ = hopper_flash.flash_attn_combine(out_partial.cuda(), lse_partial.cuda(), out=out)
    assert got.data_ptr() == out.data_ptr()
    assert ((got.double().cpu() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-6).all()
    assert wide[..., :64].isnan().all() and wide[..., 192:].isnan().all()  # nothing written outside it


def test_gradients_take_the_torch_route_on_the_gpu():
    from hopper_flash import combine

    g = torch.Generator(device="cuda").manual_seed(0)
    o = torch.randn(3, 2, 5, 4, 64, generator=g, device="cuda", requires_grad=True)
    lse = torch.randn(3, 2, 5, 4, generator=g, device="cuda", requires_grad=True)
    assert not combine._kernel_route(o, lse, None)
    out, out_lse = hopper_flash.flash_attn_combine(o, lse)
    (out.sum() + out_lse.sum()).backward()
    with torch.no_grad():
        again, again_lse = hopper_flash.flash_attn_combine(o, lse)  # the kernel's
    assert torch.allclose(again, out, rtol=1e-6, atol=1e-6) and torch.allclose(again_lse, out_lse, rtol=1e-6)
    # d(sum lse)/d lse_s is each part's weight: the weights of a row sum to 1.
    assert torch.allclose(lse.grad.sum(0), torch.ones_like(lse.grad[0]), rtol=1e-6)


def test_the_kernel_route_past_two_to_the_31_elements():
    """Partials of 3 x 2**30 elements (12 GiB): the last split's offset is
    past 2**31, so an int32 offset would read the wrong rows. Rows at both
    ends judged against a float64 merge of their own parts."""
    splits, seqlen, heads, d = 3, 65536, 128, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    o = torch.randn(splits, 1, seqlen, heads, d, generator=g, device="cuda")
    lse = torch.randn(splits, 1, seqlen, heads, generator=g, device="cuda")
    assert o.stride(0) * (splits - 1) >= 2**31
    out, got_lse = hopper_flash.flash_attn_combine(o, lse)
    for l in (0, seqlen - 1):
        parts = lse[:, 0, l].double()  # [splits, heads]
        want_lse = torch.logsumexp(parts, dim=0)
        want = (torch.exp(parts - want_lse)[..., None] * o[:, 0, l].double()).sum(0)
        assert torch.allclose(out[0, l].double(), want, rtol=1e-5, atol=1e-5)
        assert torch.allclose(got_lse[0, l].double(), want_lse, rtol=0, atol=1e-5)
    del o, lse, out
    torch.cuda.empty_cache()


def test_compiled_calls_take_the_torch_route_and_agree():
    """Under torch.compile (fullgraph) the merge is traced as torch ops (the
    kernel route is for eager calls); both are judged against the float64
    merge by the bound the kernel route's own test uses."""
    from hopper_flash import combine
    from test_flash_attn_combine_cpu import _merged_by_rows, _partials

    splits = 5
    out_partial, lse_partial = _partials(splits, 2, 33, 4, 128, seed=21)
    want, want_lse = _merged_by_rows(out_partial, lse_partial)
    size, _ = _merged_by_rows(out_partial.abs(), lse_partial)
    o, lse = out_partial.cuda(), lse_partial.cuda()
    assert combine._kernel_route(o, lse, None)
    compiled = torch.compile(lambda a, b: hopper_flash.flash_attn_combine(a, b, out_dtype=torch.bfloat16),
                             fullgraph=True)
    for out, got_lse in (hopper_flash.flash_attn_combine(o, lse, out_dtype=torch.bfloat16), compiled(o, lse)):
        err = (out.double().cpu() - want).abs()
        assert (err <= want.abs() * 2.0 ** -8 + size * (splits + 8) * 2.0 ** -24 + 1e-7).all(), float(err.max())
        live = want_lse > -math.inf
        assert torch.equal(got_lse.isfinite().cpu(), live)
        assert ((got_lse.double().cpu()[live] - want_lse[live]).abs() <= 1e-5).all()
