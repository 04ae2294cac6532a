"""Compile-only checks of the shipped forward kernel for sm_90a (no GPU needed).

Each specialisation the public API can launch is compiled once per session
(a few seconds each) and its PTX, SASS and resource usage are checked:
no spills, the Hopper instructions the design relies on are present
(HGMMA/wgmma, TMA loads and stores, setmaxnreg), shared memory fits.
"""
import functools
import os
import re

import pytest

from hopper_flash import compile_check, plan

SPECS = list(compile_check.shipped_specialisations())


def spec_id(spec):
    cfg, dtype, causal, write_lse, mode = spec
    wide = "-wide" if cfg.consumers == 3 else ""
    return (f"d{cfg.head_dim}{wide}-{dtype}-{'causal' if causal else 'full'}-{'lse' if write_lse else 'nolse'}"
            f"{'-dynamic' if mode.dynamic else ''}{'-one-item' if mode.one_item else ''}"
            f"{'-dependent' if mode.dependent else ''}")


@functools.lru_cache(maxsize=None)
def _census(spec):
    return compile_check.census(*spec)


@pytest.fixture(params=SPECS, ids=spec_id)
def report(request):
    return _census(request.param)


def test_specialisations_cover_the_api():
    from hopper_flash import plan

    keys = {(cfg.head_dim, cfg.block_m, dtype, causal, lse, mode.dynamic, mode.one_item, mode.dependent)
            for cfg, dtype, causal, lse, mode in SPECS}
    assert len(keys) == len(SPECS)
    shapes = {(d, plan.CONFIGS[d].block_m) for d in plan.SUPPORTED_HEAD_DIMS}
    shapes |= {(d, cfg.block_m) for d, cfg in plan.WIDE_CONFIGS.items()}
    # The deal: static, the dynamic order (causal), one item per CTA (head dim 128, two consumers); each
    # launched plainly and dependent (plan.launched_dependent), but the dynamic order (always dependent).
    one_item = [(False, True, False), (False, True, True)]
    assert keys == {(d, m, str(t).removeprefix("torch."), c, l, dyn, one, dep) for d, m in shapes
                    for t in plan.SUPPORTED_DTYPES for c in (False, True) for l in (False, True)
                    for dyn, one, dep in ([(False, False, False), (False, False, True)] + [(True, False, True)] * c
                                          + one_item * (d == 128 and m == 128))}


def test_no_spills(report):
    assert report.stack_bytes == 0, f"stack frame {report.stack_bytes} bytes"
    assert report.local_bytes == 0, f"local memory {report.local_bytes} bytes"
    assert report.sass_counts["LDL"] == 0 and report.sass_counts["STL"] == 0, report.sass_counts
    assert not report.spills


def test_wgmma_chains_are_not_serialised(report):
    # When ptxas cannot keep a wgmma chain in flight (its C7514 "Potential
    # Performance Loss: wgmma.mma_async instructions are serialized"), it
    # waits for every wgmma: one WARPGROUP.DEPBAR per HGMMA, a silent 2x on
    # the GEMMs (seen in a backward variant that carried Sᵀ across the step
    # loop). The shipped kernels wait once per group of chained wgmmas:
    # 4-8 DEPBAR against 32-64 HGMMA.
    sass = report.sass
    assert sass.count("WARPGROUP.DEPBAR") * 4 <= sass.count("HGMMA"), "wgmmas serialised"


def test_hopper_instructions_in_sass(report):
    counts = report.sass_counts
    for op in ("HGMMA", "UTMALDG", "UTMASTG", "USETMAXREG"):
        assert counts[op] > 0, f"{op} missing from SASS: {counts}"


def test_shared_memory_fits(report):
    assert 0 < report.shared_bytes <= compile_check.SMEM_LIMIT_BYTES


def test_ptx_register_reallocation_and_wgmma(report):
    assert re.search(r"\bsetmaxnreg\.inc\b", report.ptx)
    assert re.search(r"\bsetmaxnreg\.dec\b", report.ptx)
    assert "wgmma.mma_async" in report.ptx


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_launched_dependent_runs_wait_for_the_grid_before(spec):
    """A run launched by programmatic dependent launch (``Mode.pdl``,
    ``plan.launched_dependent``): every partition must wait for the grid
    before it (``griddepcontrol.wait``) before touching memory, and the run
    lets the grid after it be scheduled once its consumers are done. A run
    launched plainly is the kernel without either."""
    ptx = _census(spec).ptx
    if spec[4].pdl:
        assert ptx.count("griddepcontrol.wait") >= 2
        assert "griddepcontrol.launch_dependents" in ptx
    else:
        assert "griddepcontrol" not in ptx


def test_tma_copies_are_rank_4(report):
    """The rank-4 [B, S, H, D] descriptor keeps tail tiles inside their batch
    (TMA clips and zero-fills at the sequence end); a flattened 2-D/3-D
    descriptor would read the next batch's rows instead."""
    ranks = set(re.findall(r"cp\.async\.bulk\.tensor\.(\d)d\.", report.ptx))
    assert ranks == {"4"}, f"bulk tensor copy ranks in PTX: {sorted(ranks)}"
    # The load's destination is spelled shared::cluster by triton 3.6 and
    # shared::cta from 3.7 on (the same copy into this CTA's shared memory).
    assert re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::(cluster|cta)\.global", report.ptx), "no 4-D TMA load"
    assert re.search(r"cp\.async\.bulk\.tensor\.4d\.global\.shared::cta", report.ptx), "no 4-D TMA store"


def test_output_written_only_by_tma_unless_lse(report):
    """O goes out through TMA stores; the only plain global stores are the LSE's."""
    has_st_global = bool(re.search(r"\bst\.global\b", report.ptx))
    assert has_st_global == report.write_lse


@pytest.mark.parametrize("spec", [s for s in SPECS if s[2]], ids=spec_id)
def test_causal_specialisation_differs_from_full(spec):
    cfg, dtype, _, write_lse, _ = spec
    assert _census(spec).ptx != _census((cfg, dtype, False, write_lse, plan.PREFILL)).ptx


@pytest.mark.parametrize("spec", [s for s in SPECS if s[4].dynamic], ids=spec_id)
def test_dynamic_order_draws_items_from_a_counter(spec):
    """The dynamic order's producer draws items with a global atomic and hands
    them to the consumers through shared memory; the static deal has no
    atomic at all (LSE stores aside, its only global writes are TMA)."""
    cfg, dtype, causal, write_lse, _ = spec
    assert re.search(r"\batom\.global\.(relaxed\.)?(gpu\.)?(relaxed\.)?add\.(u|s)32\b", _census(spec).ptx), \
        "no 32-bit atomic add in the dynamic order's PTX"
    assert not re.search(r"\batom\.", _census((cfg, dtype, causal, write_lse, plan.PREFILL)).ptx)


def test_planned_shared_memory_matches_the_compiler(report):
    """plan.ForwardConfig.shared_bytes (tiles only) decides where O is staged;
    the compiler adds only mbarriers and warp-specialize slots on top."""
    cfg = plan.WIDE_CONFIGS[report.head_dim] if report.block_m == 192 else plan.CONFIGS[report.head_dim]
    assert cfg.block_m == report.block_m
    assert 0 <= report.shared_bytes - cfg.shared_bytes() <= 1024


@pytest.mark.skipif(bool(os.environ.get("HOPPER_FLASH_TEST_CONFIG")),
                    reason="checks the shipped configs; HOPPER_FLASH_TEST_CONFIG replaced them")
def test_o_gets_its_own_buffer_where_it_fits():
    # A persistent CTA reloads Q while the epilogue runs, so O moves out of the
    # Q rows when shared memory allows: for head dims 64 and 128, not 256.
    assert {d: cfg.o_in_q for d, cfg in plan.CONFIGS.items()} == {64: False, 128: False, 256: True}
    assert all(cfg.persistent for cfg in plan.CONFIGS.values())
    assert all(cfg.shared_bytes() <= plan.SMEM_BUDGET_BYTES for cfg in plan.CONFIGS.values())


def test_offset_start_only_where_every_consumer_runs_every_item():
    """The offset start (kernels/forward.py) makes consumer c wait for consumer
    c - 1's first QK of each item. Idle consumers (PackGQA and per-batch
    lengths: rows with no query) and skipped items (varlen) never take a
    turn, so the hand-off would hang there; causal items measured slower
    with it (BENCHMARKS.md). So: plain non-causal prefill only."""
    from hopper_flash.kernels.forward import _offset_start

    assert _offset_start(False, 1, False, False, False)
    for causal, pack_g, split, seqused, varlen in [(True, 1, False, False, False), (False, 4, False, False, False),
                                                   (False, 1, True, False, False), (False, 1, False, True, False),
                                                   (False, 1, False, False, True)]:
        assert not _offset_start(causal, pack_g, split, seqused, varlen)


@pytest.mark.parametrize("head_dim", sorted(plan.CONFIGS))
def test_offset_start_hand_off_is_compiled_in_for_non_causal_prefill_only(head_dim):
    """The hand-off is two mbarrier waits per item (one per neighbouring pair
    of consumers): the non-causal prefill kernel has them, the causal one
    does not (the two differ otherwise only in their masks)."""
    cfg = plan.CONFIGS[head_dim]
    waits = {causal: len(re.findall(r"mbarrier\.try_wait", _census((cfg, "bfloat16", causal, False, plan.PREFILL)).ptx))
             for causal in (False, True)}
    assert waits[False] == waits[True] + 2 * (cfg.consumers - 1), waits


def _step_loop(sass: str):
    """The innermost loop holding both wgmmas and exponentials: the steady step."""
    loops = compile_check.steady_loops(compile_check.instructions(sass))
    assert loops, "no loop with HGMMA and MUFU.EX2 in the SASS"
    return min(loops, key=len)


def test_softmax_runs_beside_pv_where_the_kernel_asks_for_it(report):
    """Where each specialisation's step waits for PV (kernels/forward.py's
    docstring), which ptxas hoists to the top of its basic block:

    * ``PV_AFTER_SOFTMAX`` (head dim 256): after every exponential, all of
      them issued while PV is in flight;
    * ``MAX_BEFORE_PV`` (head dim 128, the three-consumer tiles): after the
      row maximum, every FMNMX of the step issued with PV in flight, the
      exponentials mostly after it (ptxas pulls a few up);
    * the plain form (head dim 64, two consumers): right after QK's wait,
      before the row maximum (triton 3.6's ptxas)."""
    body = _step_loop(report.sass)
    exps = sum("MUFU.EX2" in text for _, text in body)
    maxes = sum("FMNMX" in text for _, text in body)
    exps_early = compile_check.exps_in_flight(body)
    maxes_early = compile_check.issued_in_flight(body, "FMNMX")
    if report.head_dim == 256:
        assert exps_early == exps > 0, f"{exps_early} of {exps} exponentials issued with PV in flight"
    elif report.head_dim == 128 or report.block_m == 192:
        assert maxes_early == maxes > 0, f"{maxes_early} of {maxes} FMNMX before the PV wait"
        assert exps_early < exps // 4, f"{exps_early} of {exps} exponentials before the PV wait"
    else:
        assert maxes_early < maxes // 4 and exps_early < exps, \
            f"{maxes_early} of {maxes} FMNMX, {exps_early} of {exps} exponentials: the plain form's PV wait moved " \
            "(update the docstring)"


def test_row_maximum_is_a_tree_at_head_dims_128_and_256(report):
    """``softmax._row_max``: at head dims 128 and 256 a thread's part of the
    row maximum is reduced as a tree (the longest dependent FMNMX chain in
    the step is the tree's depth plus the quad's two shuffle rounds and the
    running maximum: under 10), where ``gl.max``'s chain is 32 long at 128
    keys a tile under triton 3.6 and 3.7 (34 with the shuffles). Head dim
    64 keeps ``gl.max`` (its two-consumer tiles ran slower with the tree,
    BENCHMARKS.md, forty-sixth session), and what ``gl.max`` compiles to
    depends on the triton: 3.6 and 3.7 chain a thread's elements (PTX
    depth 34), 3.8 and 3.9 already reduce them as a tree (depth 8), so it
    is not asserted."""
    if report.head_dim < 128:
        pytest.skip("head dim 64 keeps gl.max, whose shape is the triton version's")
    chain = compile_check.dependent_chain(_step_loop(report.sass), "FMNMX")
    assert chain < 10, f"a chain of {chain} dependent FMNMX in the step"


def test_steady_steps_have_no_ring_barriers(report):
    # hopper_flash.ptx_rings takes out the named barriers triton's membar
    # pass puts before the steady step's K/V waits and releases (four per
    # consumer step under triton 3.6, 4 -> 0 at head dim 128; BENCHMARKS.md,
    # thirty-eighth session), except at head dim 256, which keeps them
    # (thirty-ninth). A step with a BAR.SYNC left means the rewrite found
    # nothing: moved source lines, lost line information, or its safety net
    # refusing a kernel it used to take.
    from hopper_flash import ptx_rings
    from hopper_flash.compile_check import instructions, steady_loops

    if not ptx_rings.ACTIVE:
        pytest.skip("HOPPER_FLASH_RING_BARRIERS=1 keeps triton's barriers")
    loops = steady_loops(instructions(report.sass))
    spans = [(body[0][0], body[-1][0]) for body in loops]
    # A consumer's step loop: one with no other loop inside it (the item loop holds it).
    steps = [body for body, (lo, hi) in zip(loops, spans)
             if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in spans)]
    assert steps
    for body in steps:
        bars = [t for _, t in body if "BAR.SYNC" in t]
        if report.head_dim == 256:  # keeps triton's (ptx_rings.version_for)
            assert bars
        else:
            assert not bars
