"""Compile-only checks of the varlen specialisations for sm_90a (no GPU):
the forward kernel's VARLEN mode and the backward kernel's VARLEN mode, for
every head dim and dtype, causal or not, with and without seqused.

Varlen changes addressing, masks and epilogues, not the GEMMs: the HGMMA
count equals the fixed-length kernel's. O and dK/dV are stored from
registers/shared memory with predicated stores (no TMA store: a box would
overwrite the next sequence's rows); loads stay TMA.
"""
import functools

import pytest

from hopper_flash import compile_check, compile_check_backward as ccb
from hopper_flash import plan
from hopper_flash.plan import CONFIGS, Mode
from hopper_flash.plan_backward import BACKWARD_CONFIGS


def _triton_at_least(major, minor):
    import triton

    return tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (major, minor)


FWD_SPECS = [(d, dtype, causal, used) for d in (64, 128, 256) for dtype in ("bfloat16", "float16")
             for causal in (False, True) for used in (False, True)]


def fwd_id(spec):
    d, dtype, causal, used = spec
    return f"d{d}-{dtype}-{'causal' if causal else 'full'}{'-seqused' if used else ''}"


@functools.lru_cache(maxsize=None)
def _fwd(spec):
    d, dtype, causal, used = spec
    return compile_check.census(CONFIGS[d], dtype, causal, True,
                                Mode(varlen=True, seqused=used, seqused_q=used, dynamic=True))


@functools.lru_cache(maxsize=None)
def _fwd_prefill_hgmma(d):
    return compile_check.census(CONFIGS[d], "bfloat16", True, False).sass_counts["HGMMA"]


@pytest.mark.parametrize("spec", FWD_SPECS, ids=fwd_id)
def test_forward_varlen_compiles_without_spills(spec):
    r = _fwd(spec)
    spills = r.stack_bytes or r.local_bytes or r.sass_counts["LDL"] or r.sass_counts["STL"]
    if spills and spec[0] == 256 and r.stack_bytes <= 24 and r.local_bytes == 0:
        # Known, not fixed: D=256 holds O in 128 registers per thread; the varlen
        # epilogue's sequence offset and LSE stride next to the V-tail zeroing
        # call cost 8-16 B of stack (a few LDL/STL) on 3.6; decode's D=256 modes
        # show the same on 3.7+ (tests/test_compile_decode.py).
        pytest.xfail(f"D=256 varlen: {r.stack_bytes} B of stack around the V-tail zeroing call")
    if spills and _triton_at_least(3, 7):
        pytest.xfail("triton 3.7+ spills around the V-tail zeroing (as in the decode modes, "
                     "tests/test_compile_decode.py); triton 3.6, which the H200 runs, does not")
    assert r.stack_bytes == 0 and r.local_bytes == 0, f"stack {r.stack_bytes} B, local {r.local_bytes} B"
    assert r.sass_counts["LDL"] == 0 and r.sass_counts["STL"] == 0, r.sass_counts


@pytest.mark.parametrize("spec", FWD_SPECS, ids=fwd_id)
def test_forward_varlen_instructions(spec):
    r = _fwd(spec)
    counts = r.sass_counts
    assert counts["HGMMA"] == _fwd_prefill_hgmma(spec[0]), "varlen must not change the GEMMs"
    assert counts["UTMALDG"] > 0 and counts["USETMAXREG"] > 0, counts
    assert counts["UTMASTG"] == 0, "varlen O is stored from registers, predicated per sequence"
    assert 0 < r.shared_bytes <= compile_check.SMEM_LIMIT_BYTES


@pytest.mark.parametrize("d,o_dim", [(64, 40), (128, 96), (256, 192)])
def test_forward_varlen_narrower_head_dim(d, o_dim):
    """A head dim the kernels do not have runs on the next one's kernel
    (plan.kernel_head_dim); varlen stores its O by address, O_DIM features
    a row (Mode.o_dim): the same GEMMs, no TMA store, and no more spilled
    than the kernel head dim's own varlen kernel."""
    r = compile_check.census(CONFIGS[d], "bfloat16", True, True,
                             Mode(varlen=True, seqused=True, seqused_q=True, dynamic=True, o_dim=o_dim))
    base = _fwd((d, "bfloat16", True, True))
    assert r.sass_counts["HGMMA"] == _fwd_prefill_hgmma(d)
    assert r.sass_counts["UTMASTG"] == 0 and r.sass_counts["UTMALDG"] > 0
    assert r.stack_bytes <= base.stack_bytes and r.local_bytes <= base.local_bytes
    if not (base.stack_bytes or base.sass_counts["LDL"] or base.sass_counts["STL"]):
        assert r.sass_counts["LDL"] == 0 and r.sass_counts["STL"] == 0, r.sass_counts
    # (Where the kernel head dim's own varlen kernel spills, as D=256 under
    # triton 3.9 does, the narrower one keeps its frame; ptxas may schedule
    # one more reload from it: 30 LDL against 29 at D=256 under 3.9.)
    assert r.sass != base.sass, "O_DIM must reach the epilogue"


def _assert_varlen_census(r, d):
    """A varlen forward kernel: the prefill kernel's GEMMs, TMA loads, O by
    address (no TMA store), no spills (triton 3.6; 3.7+ spills around the
    V-tail zeroing, as the varlen and decode modes do)."""
    assert r.sass_counts["HGMMA"] == _fwd_prefill_hgmma(d)
    assert r.sass_counts["UTMASTG"] == 0 and r.sass_counts["UTMALDG"] > 0
    spills = r.stack_bytes or r.local_bytes or r.sass_counts["LDL"] or r.sass_counts["STL"]
    if spills and _triton_at_least(3, 7):
        pytest.xfail("triton 3.7+ spills around the V-tail zeroing (as the varlen and decode modes do)")
    assert not spills, (r.stack_bytes, r.local_bytes, r.sass_counts)


# PackGQA in the varlen mode (plan.choose_varlen_pack_gqa: every packable
# group): the group's heads share a tile; pages read by TMA or gathered.
PACKED_SPECS = [(64, True, 4, 0), (128, True, 4, 0), (128, False, 8, 0), (256, True, 4, 0), (128, True, 2, 16),
                (128, True, 4, 4), (64, True, 8, 1)]


@pytest.mark.parametrize("spec", PACKED_SPECS, ids=lambda s: f"d{s[0]}-{'causal' if s[1] else 'full'}-g{s[2]}"
                                                          f"{f'-page{s[3]}' if s[3] else ''}")
def test_forward_varlen_packgqa(spec):
    """Packed varlen kernels: the same GEMMs as prefill, O stored by address,
    no spills (triton 3.6; 3.7+ as the other varlen kernels)."""
    d, causal, group, page = spec
    r = compile_check.census(CONFIGS[d], "bfloat16", causal, True,
                             Mode(varlen=True, pack_g=group, seqused=bool(page), page_size=page,
                                  dynamic=not plan.gathers(page, d)))
    _assert_varlen_census(r, d)


# PackGQA from a packed view in the varlen mode (plan.pack_layout: a group
# that is not a power of two, packed where plan.choose_varlen_view says so):
# (head dim, causal, group, page size, split).
VIEW_SPECS = [(128, True, 5, 0, False), (128, True, 7, 16, False), (64, True, 3, 0, False),
              (128, True, 5, 0, True), (128, True, 5, 4, False), (64, False, 6, 16, True)]


@pytest.mark.parametrize("spec", VIEW_SPECS, ids=lambda s: f"d{s[0]}-{'causal' if s[1] else 'full'}-g{s[2]}view"
                                                        f"{f'-page{s[3]}' if s[3] else ''}{'-split' if s[4] else ''}")
def test_forward_varlen_packed_view(spec):
    """Packed views in the varlen mode: the same GEMMs, O (or the split
    partials) by address, no spills (triton 3.6; 3.7+ as the other varlen
    kernels)."""
    d, causal, group, page, split = spec
    r = compile_check.census(CONFIGS[d], "bfloat16", causal, not split,
                             Mode(varlen=True, pack_g=group, pack_view=True, split=split, seqused=bool(page),
                                  page_size=page, dynamic=not (split or plan.gathers(page, d))))
    _assert_varlen_census(r, d)


# The packed view copied by the kernel itself, row by row from q (plan.Mode.q_rows, the
# default for a contiguous q): (head dim, causal, group, page size, split).
ROWS_SPECS = [(128, True, 5, 0, False), (64, True, 7, 0, False), (128, True, 5, 0, True), (128, False, 7, 16, False),
              (128, True, 5, 4, False), (64, False, 6, 16, True)]


@pytest.mark.parametrize("spec", ROWS_SPECS, ids=lambda s: f"d{s[0]}-{'causal' if s[1] else 'full'}-g{s[2]}rows"
                                                        f"{f'-page{s[3]}' if s[3] else ''}{'-split' if s[4] else ''}")
def test_forward_varlen_q_rows(spec):
    """Q by rows: the packed view's kernel without its Q boxes. Each part's
    rows come by cp.async, 16 bytes an instruction, so the producer (one
    warp, or GATHER's warpgroup) issues exactly the Q tile's bytes / 16 per
    thread; the same GEMMs, no spills."""
    d, causal, group, page, split = spec
    fields = dict(varlen=True, pack_g=group, pack_view=True, split=split, seqused=bool(page), page_size=page,
                  dynamic=not (split or plan.gathers(page, d)))
    r = compile_check.census(CONFIGS[d], "bfloat16", causal, not split, Mode(q_rows=True, **fields))
    base = compile_check.census(CONFIGS[d], "bfloat16", causal, not split, Mode(**fields))
    assert r.sass_counts["HGMMA"] == _fwd_prefill_hgmma(d) and r.sass_counts["UTMASTG"] == 0
    assert r.sass_counts["UTMALDG"] < base.sass_counts["UTMALDG"], "Q must not come by TMA"
    producer_threads = 128 if plan.gathers(page, d) else 32
    q_copies = CONFIGS[d].block_m * d * 2 // 16 // producer_threads
    assert r.sass.count("LDGSTS.E") - base.sass.count("LDGSTS.E") == q_copies
    assert r.sass.count("LDGSTSBAR") > base.sass.count("LDGSTSBAR"), "the copies arrive on Q's barriers"
    spills = r.stack_bytes or r.local_bytes or r.sass_counts["LDL"] or r.sass_counts["STL"]
    if spills and _triton_at_least(3, 7):
        pytest.xfail("triton 3.7+ spills around the V-tail zeroing (as the varlen and decode modes do)")
    assert not spills, (r.stack_bytes, r.sass_counts)


# The packed view with the varlen mode's other switches: a window, soft-capping and sinks, per-sequence
# query lengths, a narrower v (o_dim).
VIEW_FEATURE_MODES = [
    (128, True, dict(pack_g=5, pack_view=True, window_left=255, window_right=0)),
    (128, True, dict(pack_g=7, pack_view=True, softcap=True, sink="float32")),
    (64, True, dict(pack_g=5, pack_view=True, seqused=True, seqused_q=True, window_left=100, window_right=0,
                    softcap=True)),
    (128, False, dict(pack_g=5, pack_view=True, o_dim=96)),
    # One query per sequence: q by token (Q_TOKENS), with per-sequence lengths, pages and a split.
    (128, True, dict(pack_g=5, pack_view=True, q_tokens=True, seqused=True, seqused_q=True)),
    (64, True, dict(pack_g=7, pack_view=True, q_tokens=True, seqused=True, page_size=16)),
]


@pytest.mark.parametrize("spec", VIEW_FEATURE_MODES, ids=lambda s: f"d{s[0]}-" + "-".join(
    k for k, on in s[2].items() if on and k not in ("pack_g", "pack_view", "window_right")))
def test_forward_varlen_packed_view_features(spec):
    d, causal, fields = spec
    r = compile_check.census(CONFIGS[d], "bfloat16", causal, True, Mode(varlen=True, dynamic=True, **fields))
    _assert_varlen_census(r, d)


# Split-KV in the varlen mode (the KV cache's mixed route): fp32 partials
# over the packed rows, the static deal; packed and not, pages read by TMA or gathered.
SPLIT_SPECS = [(64, True, 4, 0), (128, True, 4, 0), (128, False, 1, 0), (256, True, 4, 0), (128, True, 4, 16),
               (128, True, 4, 4)]


@pytest.mark.parametrize("spec", SPLIT_SPECS, ids=lambda s: f"d{s[0]}-{'causal' if s[1] else 'full'}-g{s[2]}"
                                                         f"{f'-page{s[3]}' if s[3] else ''}")
def test_forward_varlen_split(spec):
    """Split varlen kernels: the same GEMMs, no TMA store (partials from
    registers), no spills at head dims 64 and 128 (triton 3.6)."""
    d, causal, group, page = spec
    _assert_split_census(d, causal, Mode(varlen=True, split=True, pack_g=group, seqused=bool(page), page_size=page))


def _assert_split_census(d, causal, mode):
    """A split varlen kernel's census: the prefill's GEMMs, no TMA store, no
    spills but those measured."""
    r = compile_check.census(CONFIGS[d], "bfloat16", causal, False, mode)
    assert r.sass_counts["HGMMA"] == _fwd_prefill_hgmma(d)
    assert r.sass_counts["UTMASTG"] == 0 and r.sass_counts["UTMALDG"] > 0
    spills = r.stack_bytes or r.local_bytes or r.sass_counts["LDL"] or r.sass_counts["STL"]
    if spills and d == 256 and r.stack_bytes <= 8:
        # Measured under triton 3.6: one value stored in the prologue and
        # reloaded once in each consumer's epilogue, none in the steady loop.
        pytest.xfail(f"D=256 split varlen: {r.stack_bytes} B of stack (epilogue reloads)")
    if spills and _triton_at_least(3, 7):
        pytest.xfail("triton 3.7+ spills around the V-tail zeroing (as the varlen and decode modes do)")
    assert not spills, (r.stack_bytes, r.local_bytes, r.sass_counts)


# Split tables (skewed keys, plan.varlen_split_table): unpaged, PackGQA or not.
TABLE_SPECS = [(64, True, 4), (128, True, 4), (128, True, 1), (128, False, 4), (256, True, 4)]


@pytest.mark.parametrize("spec", TABLE_SPECS, ids=lambda s: f"d{s[0]}-{'causal' if s[1] else 'full'}-g{s[2]}")
def test_forward_varlen_split_table(spec):
    """A split count per sequence (``SPLIT_TABLE``): the uniform split's
    GEMMs and stores, the item's coordinates from the table; no spills
    where the uniform split has none."""
    d, causal, group = spec
    _assert_split_census(d, causal, Mode(varlen=True, split=True, split_table=True, pack_g=group))


# Packed queries over a paged cache (flash_attn_varlen_func's block_table):
# pages read by TMA (one box per page under a tile) or gathered row by row
# (under 16 keys; head dims 64 and 128, the static deal: plan._plan_varlen).
PAGED_SPECS = [(64, 1), (64, 16), (128, 4), (128, 16), (128, 64), (128, 256), (256, 16), (256, 64), (256, 128)]


@functools.lru_cache(maxsize=None)
def _paged(spec):
    d, page = spec
    return compile_check.census(CONFIGS[d], "bfloat16", True, True,
                                Mode(varlen=True, seqused=True, page_size=page,
                                     dynamic=not plan.gathers(page, d)))


@pytest.mark.parametrize("spec", PAGED_SPECS, ids=lambda s: f"d{s[0]}-page{s[1]}")
def test_forward_varlen_over_pages(spec):
    """The varlen kernel reading pages: the same GEMMs as prefill, O stored
    by address, and no spills at head dims 64 and 128."""
    d, page = spec
    r = _paged(spec)
    assert r.sass_counts["HGMMA"] == _fwd_prefill_hgmma(d)
    assert r.sass_counts["UTMASTG"] == 0 and r.sass_counts["UTMALDG"] > 0
    if plan.gathers(page, d):
        assert "LDGSTS" in r.sass, "pages under 16 keys are copied row by row (cp.async)"
    spills = r.stack_bytes or r.local_bytes or r.sass_counts["LDL"] or r.sass_counts["STL"]
    if spills and d == 256:
        # Measured under triton 3.6: 24-32 B of stack at pages of 16-64 keys
        # with the dynamic order, a few reloads inside the steady loop; none
        # at 128 and up. Correct, not tuned (BENCHMARKS.md, fifty-fifth session).
        pytest.xfail(f"D=256 paged varlen: {r.stack_bytes} B of stack")
    if spills and _triton_at_least(3, 7):
        pytest.xfail("triton 3.7+ spills around the V-tail zeroing (as the varlen and decode modes do)")
    assert r.stack_bytes == 0 and r.local_bytes == 0, f"stack {r.stack_bytes} B, local {r.local_bytes} B"
    assert r.sass_counts["LDL"] == 0 and r.sass_counts["STL"] == 0, r.sass_counts


@pytest.mark.parametrize("d,o_dim", [(64, 40), (128, 96), (256, 192)])
def test_backward_varlen_narrower_head_dim(d, o_dim):
    """The backward of a head dim without kernels of its own: the next
    one's kernel, varlen storing dK/dV O_DIM features a row
    (plan_backward.kernel_constexprs): the same GEMMs, no more stack than
    the kernel head dim's own varlen kernel."""
    r = ccb.census(BACKWARD_CONFIGS[d], "bfloat16", True, False, varlen=True, seqused=True, o_dim=o_dim)
    base = _bwd((d, "bfloat16", True, False, True))
    assert r.sass_counts["HGMMA"] == base.sass_counts["HGMMA"]
    assert r.sass_counts["UTMASTG"] == 0 and "UTMAREDG" in r.sass
    # (Measured: D=64 40 B of stack against its own kernel's 32 under triton
    # 3.6, the others equal; under 3.9 all equal.)
    assert r.local_bytes == 0 and r.stack_bytes <= BWD_STACK_ALLOWANCE[d], f"stack frame {r.stack_bytes} bytes"
    assert r.sass != base.sass, "O_DIM must reach the dK/dV stores"


def test_backward_small_kernels_with_a_narrower_head_dim_compile():
    """The pre/postprocess and the varlen tail zeroing with OUT_DIM (rows of
    the kernel's head dim, features stored to the tensor's)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hopper_flash.kernels import backward_pre as pre

    for kernel in (pre._bwd_preprocess_kernel, pre._bwd_postprocess_kernel, pre._zero_tail_kernel):
        names = kernel.arg_names
        consts = {"BLOCK": 64, "HEAD_DIM": 128, "BLOCK_M": 64, "VARLEN": True, "SEQUSED": False, "SINK": False,
                  "PAIR": True, "OUT_DIM": 96}
        consts = {n: v for n, v in consts.items() if n in names}
        sig = {n: ("constexpr" if n in consts else "fp32" if n == "scale"
                   else ("*fp32" if n in ("lse_ptr", "delta_ptr", "lse2_ptr", "acc_ptr", "sink_ptr", "part_ptr")
                         else "*i32" if n in ("cu_ptr", "used_ptr", "order_ptr") else "*bf16")
                   if n.endswith("_ptr") else "i32") for n in names}
        compiled = triton.compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4})
        assert compiled.asm["cubin"], kernel


BWD_SPECS = [(d, dtype, causal, det, used) for d in (64, 128, 256) for dtype in ("bfloat16", "float16")
             for causal in (False, True) for det in (False, True) for used in (False, True)
             if dtype == "bfloat16" or (not det and not used)]
# As tests/test_compile_backward.py, plus what the varlen tail zeroing adds
# (its loads run beside the Sᵀ accumulator). Measured (stack bytes, local
# accesses between the first and last wgmma): D=64 causal 40-72 under
# triton 3.6 (up to 10 accesses in the step, reloaded loop scalars; 0 under
# 3.9); D=128 0-24; D=256 16-32 (3.6) and 40-112 (3.9, 13 accesses causal),
# and 344 for its deterministic mode under 3.6 (the semaphore spin, as in
# the fixed-length kernel).
BWD_STACK_ALLOWANCE = {64: 72, 128: 32, 256: 640}


def bwd_id(spec):
    d, dtype, causal, det, used = spec
    return (f"d{d}-{dtype}-{'causal' if causal else 'full'}{'-det' if det else ''}"
            f"{'-seqused' if used else ''}")


@functools.lru_cache(maxsize=None)
def _bwd(spec):
    d, dtype, causal, det, used = spec
    return ccb.census(BACKWARD_CONFIGS[d], dtype, causal, det, varlen=True, seqused=used)


@functools.lru_cache(maxsize=None)
def _bwd_fixed_hgmma(d):
    return ccb.census(BACKWARD_CONFIGS[d], "bfloat16", True, False).sass_counts["HGMMA"]


@pytest.mark.parametrize("spec", BWD_SPECS, ids=bwd_id)
def test_backward_varlen_compiles(spec):
    r = _bwd(spec)
    assert r.local_bytes == 0
    assert r.stack_bytes <= BWD_STACK_ALLOWANCE[spec[0]], f"stack frame {r.stack_bytes} bytes"
    counts = r.sass_counts
    assert counts["HGMMA"] == _bwd_fixed_hgmma(spec[0]), "varlen must not change the GEMMs"
    assert counts["UTMALDG"] > 0 and counts["USETMAXREG"] > 0, counts
    assert counts["UTMASTG"] == 0, "varlen dK/dV are stored predicated per sequence, not by TMA"
    assert "UTMAREDG" in r.sass, "dQ is still summed with the TMA reduce-add"
    assert 0 < r.shared_bytes <= compile_check.SMEM_LIMIT_BYTES


@pytest.mark.parametrize("sink", ["", "fp32", "bf16"], ids=["no-sink", "sink-fp32", "sink-bf16"])
@pytest.mark.parametrize("varlen,seqused", [(False, False), (True, False), (True, True)],
                         ids=["fixed", "varlen", "varlen-seqused"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_backward_pre_and_postprocess_compile(varlen, seqused, head_dim, sink):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hopper_flash.kernels.backward_pre import _bwd_postprocess_kernel, _bwd_preprocess_kernel

    flags = {"BLOCK": 64, "HEAD_DIM": head_dim, "BLOCK_M": 64, "VARLEN": varlen, "SEQUSED": seqused}
    pre_flags = {**flags, "SINK": bool(sink), "OUT_DIM": 0}  # (the sinks' gradient partials: backward_pre)
    flags["OUT_DIM"] = 0  # (the kernel head dim's own; test_backward_small_kernels_with_a_narrower_head_dim)
    pre = {"o_ptr": "*bf16", "do_ptr": "*bf16", "lse_ptr": "*fp32", "delta_ptr": "*fp32", "lse2_ptr": "*fp32",
           "acc_ptr": "*fp32", "cu_ptr": "*i32", "used_ptr": "*i32", "sink_ptr": "*" + (sink or "fp32"),
           "part_ptr": "*fp32", "order_ptr": "*i32", **{n: "i32" for n in (
               "so8_b", "so8_s", "so8_h", "sdo8_b", "sdo8_s", "sdo8_h", "slse_b", "slse_h", "seqlen_q",
               "seqlen_q_rounded", "num_heads")}, **{n: "constexpr" for n in pre_flags}}
    post = {"acc_ptr": "*fp32", "dq_ptr": "*bf16", "cu_ptr": "*i32", "used_ptr": "*i32",
            **{n: "i32" for n in ("sdq8_b", "sdq8_s", "sdq8_h", "seqlen_q", "seqlen_q_rounded", "num_heads")},
            "scale": "fp32", **{n: "constexpr" for n in flags}}
    for kernel, sig, consts in ((_bwd_preprocess_kernel, pre, pre_flags), (_bwd_postprocess_kernel, post, flags)):
        compiled = triton.compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4})
        assert compiled.asm["cubin"]


# Head dim 64's wide tiles in the varlen mode (plan._plan_varlen: unpaged,
# unsplit, no window, max_seqlen_q >= WIDE_MIN_ROWS): PackGQA or not,
# per-sequence lengths, soft-capping and sinks. (A window with PackGQA and
# per-sequence lengths spilled 232 B on these tiles: the plan keeps 128 rows there.)
# (Padded packs keep 128 rows: plan._plan_varlen.)
WIDE_SPECS = [(1, False, True, {}), (4, False, True, {}), (8, True, True, {}), (4, True, False, {}),
              (8, True, True, dict(softcap=True, sink="bfloat16")), (4, True, True, dict(o_dim=40))]


@pytest.mark.parametrize("spec", WIDE_SPECS, ids=lambda s: f"g{s[0]}{'-seqused' if s[1] else ''}"
                                                        f"-{'causal' if s[2] else 'full'}"
                                                        + "".join(f"-{k}" for k in s[3]))
def test_forward_varlen_wide_tiles(spec):
    """The wide varlen kernels: the wide prefill kernel's GEMMs, O stored by
    address, no spills (triton 3.6; 3.9 has no wide tiles)."""
    if 64 not in plan.WIDE_CONFIGS:
        pytest.skip("no wide tiles under this triton (plan.wide_configs)")
    group, used, causal, extra = spec
    wide = plan.WIDE_CONFIGS[64]
    r = compile_check.census(wide, "bfloat16", causal, True,
                             Mode(varlen=True, pack_g=group, seqused=used, seqused_q=used, dynamic=True, **extra))
    assert r.sass_counts["HGMMA"] == compile_check.census(wide, "bfloat16", True, False).sass_counts["HGMMA"]
    assert r.sass_counts["UTMASTG"] == 0 and r.sass_counts["UTMALDG"] > 0
    spills = r.stack_bytes or r.local_bytes or r.sass_counts["LDL"] or r.sass_counts["STL"]
    if spills and _triton_at_least(3, 7):
        pytest.xfail("triton 3.7+ spills around the V-tail zeroing (as the varlen and decode modes do)")
    assert not spills, (r.stack_bytes, r.local_bytes, r.sass_counts)
