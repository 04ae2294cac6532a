"""``flash_attn_combine`` (FA3's merge of partial attention outputs by their
LSEs) on the CPU: torch ops, so the same code as on the GPU. Judged against
float64 references written out here (a row-by-row merge, and attention over
all the keys against attention over parts of them), never against the
function's own formula."""
import math

import pytest
import torch

import hopper_flash
from hopper_flash import _triton_support
from hopper_flash.reference import attention_reference


def _partials(splits, batch, seqlen, nheads, d, seed=0):
    """FA3's test layout: non-contiguous partials (a transposed O, an LSE
    read from a wider tensor), some rows' later splits empty (-inf) with
    NaN outputs, which must not be read."""
    g = torch.Generator().manual_seed(seed)
    out_partial = torch.randn(splits * 2, batch, nheads, seqlen, d, generator=g).transpose(2, 3)[:splits]
    lse_partial = torch.randn(splits, batch, nheads * 2, seqlen, generator=g).transpose(-1, -2)[:, :, :, :nheads]
    lse_partial[splits // 2:, :max(1, batch // 3)] = -math.inf
    out_partial[splits // 2:, :max(1, batch // 3)] = math.nan
    return out_partial, lse_partial


def _merged_by_rows(out_partial, lse_partial):
    """The merge row by row in float64 (math.fsum over the parts that saw keys)."""
    splits, batch, seqlen, nheads, d = out_partial.shape
    out = torch.zeros(batch, seqlen, nheads, d, dtype=torch.float64)
    lse = torch.full((batch, seqlen, nheads), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for t in range(seqlen):
            for h in range(nheads):
                parts = [(float(lse_partial[s, b, t, h]), out_partial[s, b, t, h].double()) for s in range(splits)
                         if lse_partial[s, b, t, h] > -math.inf]
                if not parts:
                    continue
                top = max(x for x, _ in parts)
                row_lse = top + math.log(math.fsum(math.exp(x - top) for x, _ in parts))
                lse[b, t, h] = row_lse
                for x, o in parts:
                    out[b, t, h] += math.exp(x - row_lse) * o
    return out, lse


@pytest.mark.parametrize("splits,seqlen,d", [(1, 5, 64), (3, 7, 128), (8, 1, 80), (17, 3, 256)])
def test_combine_matches_a_row_by_row_merge(splits, seqlen, d):
    out_partial, lse_partial = _partials(splits, 3, seqlen, 4, d, seed=splits)
    out, lse = hopper_flash.flash_attn_combine(out_partial, lse_partial)
    ref_out, ref_lse = _merged_by_rows(out_partial, lse_partial)
    assert out.dtype == torch.float32 and out.shape == (3, seqlen, 4, d)
    assert lse.dtype == torch.float32 and lse.shape == (3, seqlen, 4)
    assert lse.transpose(1, 2).is_contiguous()  # FA3's layout: [batch, nheads, seqlen] transposed
    assert torch.isfinite(out).all()  # the empty splits' NaN outputs were not read
    assert torch.allclose(out.double(), ref_out, rtol=1e-5, atol=1e-6)
    finite = ref_lse > -math.inf
    assert torch.equal(lse.isfinite(), finite) and torch.allclose(lse.double()[finite], ref_lse[finite], rtol=1e-6)


def test_rows_whose_parts_all_saw_no_key_are_zero_with_lse_minus_inf():
    out_partial, lse_partial = _partials(4, 2, 3, 2, 64)
    lse_partial[:, 1, 2, 0] = -math.inf
    out_partial[:, 1, 2, 0] = math.nan
    out, lse = hopper_flash.flash_attn_combine(out_partial, lse_partial)
    assert (out[1, 2, 0] == 0).all() and lse[1, 2, 0] == -math.inf
    assert torch.isfinite(out).all()


def test_attention_over_parts_of_the_keys_merges_to_attention_over_all_of_them():
    """The use it is for (split-KV, ring attention): each part's output and
    LSE from attention over its keys alone; merged, attention over all keys
    (float64 references throughout; the partials rounded to float32)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 9, 4, 64, generator=g)
    k, v = (torch.randn(2, 300, 2, 64, generator=g) for _ in "kv")
    bounds = [0, 37, 38, 200, 300]  # parts of 37, 1, 162 and 100 keys
    parts = [attention_reference(q, k[:, a:b], v[:, a:b]) for a, b in zip(bounds, bounds[1:])]
    out_partial = torch.stack([o for o, _ in parts]).float()
    lse_partial = torch.stack([lse for _, lse in parts]).float().transpose(-1, -2)  # [splits, B, Sq, H]
    out, lse = hopper_flash.flash_attn_combine(out_partial, lse_partial, out_dtype=torch.bfloat16)
    full_out, full_lse = attention_reference(q, k, v)
    assert out.dtype == torch.bfloat16
    assert (out.double() - full_out).abs().max() <= 2 ** -8 * full_out.abs().max()  # bf16's rounding of the result
    assert torch.allclose(lse.double(), full_lse.transpose(1, 2), rtol=1e-6, atol=1e-6)


def test_it_is_differentiable_as_attention_over_all_keys_is():
    """Gradients through the merge of two parts' attention (float32 torch
    attention, autograd) equal those of attention over all the keys."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 6, 2, 32, generator=g, dtype=torch.float64).float().requires_grad_()
               for _ in range(3))
    dout = torch.randn(1, 6, 2, 32, generator=g)

    def attention(k_part, v_part):
        s = torch.einsum("bqhd,bkhd->bhqk", q, k_part) / math.sqrt(32)
        return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v_part), s.logsumexp(-1)

    parts = [attention(k[:, :2], v[:, :2]), attention(k[:, 2:], v[:, 2:])]
    merged, _ = hopper_flash.flash_attn_combine(torch.stack([o for o, _ in parts]),
                                                torch.stack([lse for _, lse in parts]).transpose(-1, -2))
    grads = torch.autograd.grad((merged * dout).sum(), (q, k, v))
    full, _ = attention(k, v)
    full_grads = torch.autograd.grad((full * dout).sum(), (q, k, v))
    for got, want in zip(grads, full_grads):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_out_is_written_in_place_and_returned(dtype):
    out_partial, lse_partial = _partials(3, 2, 4, 2, 64)
    out = torch.full((2, 4, 2, 64), math.nan, dtype=dtype)
    got, _ = hopper_flash.flash_attn_combine(out_partial, lse_partial, out=out)
    ref, _ = _merged_by_rows(out_partial, lse_partial)
    assert got is out and torch.allclose(out.double(), ref, rtol=1e-2 if dtype != torch.float32 else 1e-5,
                                         atol=1e-2 if dtype != torch.float32 else 1e-6)


def test_it_traces_whole_under_torch_compile():
    out_partial, lse_partial = _partials(3, 2, 4, 2, 64)
    compiled = torch.compile(hopper_flash.flash_attn_combine, fullgraph=True, backend="aot_eager")
    out, lse = compiled(out_partial, lse_partial)
    ref_out, ref_lse = hopper_flash.flash_attn_combine(out_partial, lse_partial)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def _bad(case):
    out_partial, lse_partial = _partials(3, 2, 4, 2, 64)
    kw = {}
    if case == "partial-dtype":
        out_partial = out_partial.bfloat16()
    elif case == "lse-dtype":
        lse_partial = lse_partial.double()
    elif case == "partial-rank":
        out_partial = out_partial[0]
    elif case == "lse-shape":
        lse_partial = lse_partial[:, :, :3]
    elif case == "no-splits":
        out_partial, lse_partial = out_partial[:0], lse_partial[:0]
    elif case == "lse-device":
        lse_partial = lse_partial.to("meta")
    elif case == "out-dtype":
        kw["out_dtype"] = torch.int8
    elif case == "out-shape":
        kw["out"] = torch.empty(2, 4, 2, 32)
    elif case == "out-mismatch":
        kw.update(out=torch.empty(2, 4, 2, 64), out_dtype=torch.bfloat16)
    elif case == "out-type":
        kw["out"] = [0.0]
    return out_partial, lse_partial, kw


@pytest.mark.parametrize("case,name", [("partial-dtype", "out_partial"), ("lse-dtype", "lse_partial"),
                                       ("partial-rank", "out_partial"), ("lse-shape", "lse_partial"),
                                       ("no-splits", "out_partial"), ("lse-device", "lse_partial"),
                                       ("out-dtype", "out_dtype"), ("out-shape", "out"), ("out-mismatch", "out"),
                                       ("out-type", "out")])
def test_bad_arguments_are_refused_by_name(case, name):
    out_partial, lse_partial, kw = _bad(case)
    with pytest.raises((TypeError, ValueError), match=name):
        hopper_flash.flash_attn_combine(out_partial, lse_partial, **kw)


# The Triton kernel the CUDA route takes (kernels/combine.py's
# combine_strided_kernel): compiled for sm_90a here, and run through Triton's
# interpreter on FA3's layout (a child process: TRITON_INTERPRET must be set
# before the kernel's module is imported). Its GPU runs are in
# tests/test_flash_attn_combine_gpu.py.

@pytest.mark.parametrize("head_dim,out", [(64, "bf16"), (80, "fp16"), (128, "bf16"), (128, "fp32"), (256, "bf16")])
def test_strided_combine_kernel_compiles_for_sm90_with_vector_loads(head_dim, out):
    import triton

    from hopper_flash.compile_check import compile_triton, read_census
    from hopper_flash.kernels.combine import combine_strided_kernel

    names = combine_strided_kernel.arg_names
    pointers = {"o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "out_ptr": f"*{out}", "lse_ptr": "*fp32"}
    d_pow2 = max(16, triton.next_power_of_2(head_dim))
    consts = {"HEAD_DIM": head_dim, "D_POW2": d_pow2, "BLOCK_M": max(1, min(64, 2048 // d_pow2)), "VEC": 4,
              "OUT_VEC": 4 if out == "fp32" else 8}
    sig = {n: pointers.get(n, "constexpr" if n in consts else "i32") for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(4)}  # the JIT's 16-byte pointer specialisation
    compiled = compile_triton(combine_strided_kernel, sig, consts, num_warps=4, attrs=aligned)
    report = read_census(compiled, ("LDG.E.128",), head_dim=head_dim, block_m=consts["BLOCK_M"], dtype=out,
                         causal=False, write_lse=True)
    assert not report.spills
    sass = report.sass
    # The partials' rows in 128-bit loads (with the offsets' hint; element by element without it).
    assert "LDG.E.128" in sass


_STRIDED_CHILD = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, sys.argv[1])
import torch, triton
from hopper_flash.kernels.combine import combine_strided_kernel
cases = torch.load(sys.argv[2])
results = []
for o, lse, out_dtype in cases:
    splits, b, l, h, d = o.shape
    out = torch.full((b, l, h, d), float("nan"), dtype=out_dtype)
    lse_out = torch.full((b, h, l), float("nan")).transpose(1, 2)
    d_pow2 = max(16, triton.next_power_of_2(d)); block_m = max(1, min(64, 2048 // d_pow2))
    rows = b * l * h
    combine_strided_kernel[(triton.cdiv(rows, block_m),)](
        o, lse, out, lse_out, splits, rows, l, h, *o.stride()[:4], *lse.stride(), *out.stride()[:3],
        *lse_out.stride(), HEAD_DIM=d, D_POW2=d_pow2, BLOCK_M=block_m, VEC=1, OUT_VEC=1)
    results.append((out, lse_out))
torch.save(results, sys.argv[3])
"""


@pytest.mark.skipif(_triton_support.parse_minor(_triton_support.installed_version()) < (3, 7),
                    reason="triton 3.6's interpreter cannot use a scalar kernel argument as a loop bound under numpy 2")
def test_strided_combine_kernel_in_the_interpreter(tmp_path):
    import subprocess
    import sys

    shapes = [(1, 2, 3, 4, 64), (2, 3, 129, 4, 128), (5, 2, 7, 3, 80), (37, 1, 3, 2, 256)]
    cases = [(*_partials(*shape, seed=i), dtype) for i, (shape, dtype) in
             enumerate(zip(shapes, (torch.float32, torch.bfloat16, torch.float16, torch.float32)))]
    # A live part that attended a NaN: its row must come out NaN (LSE too), as the reference's.
    nan_o, nan_lse = _partials(3, 2, 5, 2, 64, seed=9)
    nan_lse[0, 1, 2, 1] = math.nan
    cases.append((nan_o, nan_lse, torch.float32))
    torch.save(cases, tmp_path / "cases.pt")
    root = __file__.rsplit("/tests/", 1)[0]
    subprocess.run([sys.executable, "-c", _STRIDED_CHILD, root, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
                   check=True, capture_output=True, text=True, timeout=600)
    results = torch.load(tmp_path / "out.pt")
    nan_out, nan_lse_out = results.pop()
    nan_case = cases.pop()
    assert nan_out[1, 2, 1].isnan().all() and nan_lse_out[1, 2, 1].isnan()
    others = torch.ones(2, 5, 2, dtype=torch.bool)
    others[1, 2, 1] = False
    want, want_lse = _merged_by_rows(*nan_case[:2])  # (its NaN part skipped: only the other rows are compared)
    assert torch.allclose(nan_out[others].double(), want[others], rtol=1e-5, atol=1e-6)
    assert torch.allclose(nan_lse_out[others].double(), want_lse[others], rtol=0, atol=1e-5)
    for (o, lse, dtype), (out, lse_out) in zip(cases, results):
        want, want_lse = _merged_by_rows(o, lse)
        size, _ = _merged_by_rows(o.abs(), lse)  # an fp32 sum's error bound scales with this
        assert out.dtype == dtype and not out.isnan().any()
        ulp = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
        # The fp32 merge, then one conversion (the interpreter truncates where the GPU rounds: two units).
        bound = want.abs() * 2 * ulp + size * (o.shape[0] + 8) * 2.0 ** -24 + 1e-7
        assert ((out.double() - want).abs() <= bound).all()
        live = torch.isfinite(want_lse)
        assert torch.allclose(lse_out.double()[live], want_lse[live], rtol=0, atol=1e-5)
        assert (lse_out[~live] == -math.inf).all()


def test_nan_in_a_live_part_reaches_the_result():
    """A part that attended a NaN (its LSE or its output NaN, the LSE not
    -inf) makes its row NaN, as attention over all the keys would be; other
    rows are untouched. (Only a part that saw no key, LSE -inf, is skipped.)"""
    g = torch.Generator().manual_seed(11)
    o, lse = torch.randn(3, 1, 2, 2, 8, generator=g), torch.randn(3, 1, 2, 2, generator=g)
    lse[1, 0, 0, 0] = math.nan
    o[2, 0, 1, 1, 3] = math.nan
    out, out_lse = hopper_flash.flash_attn_combine(o, lse)
    assert out[0, 0, 0].isnan().all() and out_lse[0, 0, 0].isnan()
    assert out[0, 1, 1, 3].isnan() and torch.isfinite(out[0, 1, 1, [0, 1, 2, 4, 5, 6, 7]]).all()
    assert torch.isfinite(out[0, 0, 1]).all() and torch.isfinite(out[0, 1, 0]).all()
