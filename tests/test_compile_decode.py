"""Compile-only checks of the forward kernel's decode specialisations and the
split-KV combine kernel for sm_90a (no GPU needed).

Every mode flash_attn_with_kvcache and the decode path of flash_attn_func
launch is compiled: no spills, the same tensor-core work as the prefill
kernel of that head dim (decode modes change addressing and epilogues, not
the GEMMs), TMA loads, TMA stores only where O goes through shared memory
(not for split partials), setmaxnreg, shared memory within the limit.
"""
import functools

import pytest

from hopper_flash import compile_check, plan
from hopper_flash.plan import Mode

C = plan.CONFIGS

# (config, dtype, causal, write_lse, mode). A run without a split compiles
# one kernel launched plainly and another launched dependent
# (plan.launched_dependent: its grid on every SM; Mode.dependent, the
# kernel's DEPENDENT); about half of those here are the dependent form.
SPECS = [
    # flash_attn_func, seqlen_q small next to seqlen_k: PackGQA + split, MHA split.
    (C[128], "bfloat16", True, False, Mode(pack_g=4, split=True)),
    (C[128], "bfloat16", False, True, Mode(split=True)),
    # KV cache: per-batch lengths, PackGQA, split, cache_batch_idx.
    (C[128], "bfloat16", True, False, Mode(seqused=True)),
    (C[128], "bfloat16", True, False, Mode(pack_g=4, split=True, seqused=True)),
    (C[128], "float16", True, True, Mode(pack_g=8, seqused=True, kv_batch=True, dependent=True)),
    (C[64], "bfloat16", True, False, Mode(pack_g=4, split=True, seqused=True)),
    (C[256], "bfloat16", True, True, Mode(pack_g=2, seqused=True, dependent=True)),
    (C[256], "bfloat16", True, False, Mode(pack_g=4, split=True, seqused=True)),
    # Paged K/V through TMA (the page is the batch coordinate).
    (C[128], "bfloat16", True, False, Mode(pack_g=4, split=True, seqused=True, page_size=128)),
    (C[128], "bfloat16", False, False, Mode(pack_g=4, seqused=True, page_size=256, dependent=True)),
    (C[256], "bfloat16", True, False, Mode(pack_g=4, split=True, seqused=True, page_size=64)),
    # Pages shorter than a tile: one TMA box per page (cache_layout.MIN_TMA_PAGE up).
    (C[128], "bfloat16", True, False, Mode(pack_g=4, split=True, seqused=True, page_size=64)),
    (C[128], "float16", True, True, Mode(pack_g=8, seqused=True, page_size=32, dependent=True)),
    (C[64], "bfloat16", True, False, Mode(pack_g=4, split=True, seqused=True, page_size=32)),
    (C[256], "bfloat16", True, False, Mode(pack_g=4, seqused=True, page_size=32)),
    # Pages of 16 keys: eight boxes per 128-key tile (four per 64), the producer with 40 registers.
    (C[128], "bfloat16", True, False, Mode(pack_g=4, split=True, seqused=True, page_size=16)),
    (C[128], "float16", True, True, Mode(pack_g=8, seqused=True, page_size=16, dependent=True)),
    (C[64], "bfloat16", True, False, Mode(pack_g=4, split=True, seqused=True, page_size=16)),
    (C[256], "bfloat16", True, True, Mode(pack_g=4, seqused=True, page_size=16)),
    # Pages under 16 keys gathered row by row (a four-warp producer, cp.async).
    (C[128], "bfloat16", True, False, Mode(pack_g=4, split=True, seqused=True, page_size=1)),
    (C[128], "float16", True, True, Mode(pack_g=8, seqused=True, page_size=8, dependent=True)),
    (C[64], "bfloat16", True, True, Mode(pack_g=4, split=True, seqused=True, page_size=4)),
    # (MHA decode, no PackGQA: where gathering at D=256 spilled its consumers; scripts/gather_census.py)
    (C[128], "bfloat16", False, True, Mode(pack_g=1, split=True, seqused=True, page_size=2)),
    # Sliding windows (window_size): decode with a split cache, and prefill both ways.
    (C[128], "bfloat16", True, True, Mode(pack_g=4, split=True, seqused=True, window_left=4095, window_right=0)),
    (C[128], "bfloat16", True, False, Mode(window_left=1023, window_right=0, dependent=True)),
    (C[128], "float16", False, True, Mode(window_left=100, window_right=37)),
    (C[64], "bfloat16", True, False, Mode(window_left=511, window_right=0)),
    # (the wide D=64 tiles' window: appended below where this triton has them)
    (C[256], "bfloat16", False, False, Mode(window_left=-1, window_right=5)),
    (C[128], "bfloat16", True, True, Mode(varlen=True, seqused=True, dynamic=True, window_left=255, window_right=0, dependent=True)),
    # Logit soft-capping (softcap): prefill, decode, paged, gathered and varlen modes.
    (C[128], "bfloat16", True, False, Mode(softcap=True, dependent=True)),
    (C[128], "float16", False, True, Mode(softcap=True)),
    (C[64], "bfloat16", True, False, Mode(softcap=True)),
    (C[256], "bfloat16", True, False, Mode(softcap=True)),
    (C[128], "bfloat16", True, False, Mode(pack_g=4, split=True, seqused=True, softcap=True)),
    (C[256], "bfloat16", True, False, Mode(pack_g=4, split=True, seqused=True, softcap=True)),
    (C[256], "bfloat16", False, True, Mode(pack_g=2, split=True, seqused=True, softcap=True)),
    (C[128], "bfloat16", True, False, Mode(pack_g=4, seqused=True, page_size=16, softcap=True)),
    (C[64], "bfloat16", True, False, Mode(pack_g=4, split=True, seqused=True, page_size=4, softcap=True)),
    (C[128], "bfloat16", True, True, Mode(varlen=True, seqused=True, dynamic=True, softcap=True, dependent=True)),
    # Attention sinks (the kernel's normaliser; a split run leaves them to the combine).
    (C[128], "bfloat16", True, True, Mode(sink="bfloat16")),
    (C[128], "float16", False, False, Mode(sink="float32")),
    (C[64], "bfloat16", True, True, Mode(sink="float32", dynamic=True, dependent=True)),
    (C[256], "bfloat16", True, True, Mode(sink="float32")),
    (C[256], "bfloat16", False, True, Mode(sink="float32", softcap=True)),
    (C[128], "bfloat16", True, True, Mode(pack_g=4, seqused=True, sink="bfloat16")),
    (C[128], "bfloat16", True, False, Mode(pack_g=4, split=True, seqused=True, sink="float32")),
    (C[64], "bfloat16", True, True, Mode(pack_g=4, seqused=True, page_size=4, sink="float32", dependent=True)),
    (C[128], "bfloat16", True, True, Mode(varlen=True, seqused=True, seqused_q=True, dynamic=True, sink="float16")),
    (C[256], "bfloat16", True, True, Mode(varlen=True, sink="float32", dependent=True)),
    # cache_leftpad: each row's keys from its pad on (LEFTPAD), with split-KV, PackGQA, cache_batch_idx.
    (C[128], "bfloat16", True, False, Mode(pack_g=4, split=True, seqused=True, leftpad=True)),
    (C[128], "float16", True, True, Mode(pack_g=8, seqused=True, kv_batch=True, leftpad=True, dependent=True)),
    (C[64], "bfloat16", True, False, Mode(pack_g=4, split=True, seqused=True, leftpad=True)),
    (C[256], "bfloat16", True, False, Mode(pack_g=4, split=True, seqused=True, leftpad=True)),
    (C[128], "bfloat16", True, True, Mode(pack_g=4, split=True, seqused=True, window_left=4095, window_right=0,
                                          leftpad=True)),
    # PackGQA over groups that are not powers of two (PACK_VIEW: Q packed by the host), O by address; head
    # dims 64 and 128 (plan.VIEW_HEAD_DIMS: at 256 one varlen kernel spilled 16 B).
    (C[128], "bfloat16", True, True, Mode(pack_g=5, pack_view=True, seqused=True, dependent=True)),
    (C[128], "bfloat16", True, False, Mode(pack_g=5, pack_view=True, split=True, seqused=True)),
    (C[128], "float16", True, True, Mode(pack_g=7, pack_view=True, seqused=True, page_size=64)),
    (C[64], "bfloat16", True, True, Mode(pack_g=3, pack_view=True, seqused=True, kv_batch=True, dependent=True)),
    (C[64], "bfloat16", True, True, Mode(pack_g=5, pack_view=True, seqused=True, sink="float32")),
    (C[128], "bfloat16", True, True, Mode(pack_g=5, pack_view=True, seqused=True, leftpad=True)),
    (C[128], "bfloat16", True, True, Mode(pack_g=5, pack_view=True, seqused=True, window_left=4095, window_right=0)),
    (C[128], "bfloat16", True, False, Mode(pack_g=7, pack_view=True, seqused=True, softcap=True, split=True)),
    (C[128], "bfloat16", False, True, Mode(pack_g=12, pack_view=True, dependent=True)),
    (C[64], "bfloat16", True, False, Mode(pack_g=128, pack_view=True, split=True, seqused=True, page_size=16)),
    # One item per CTA (chunked prefill, V_AT_ISSUE) with soft-capping and sinks.
    (C[128], "bfloat16", True, False, Mode(one_item=True, softcap=True)),
    (C[128], "float16", False, True, Mode(one_item=True, softcap=True)),
    (C[128], "bfloat16", True, True, Mode(one_item=True, sink="bfloat16", dependent=True)),
    (C[128], "bfloat16", False, True, Mode(one_item=True, sink="float32", softcap=True)),
]
if 64 in plan.WIDE_CONFIGS:  # none under triton 3.9 (plan.wide_configs)
    SPECS.append((plan.WIDE_CONFIGS[64], "bfloat16", True, False, Mode(window_left=4095, window_right=0)))
    SPECS.append((plan.WIDE_CONFIGS[64], "bfloat16", True, False, Mode(softcap=True)))
    SPECS.append((plan.WIDE_CONFIGS[64], "bfloat16", True, True, Mode(sink="float32", dynamic=True)))


def spec_id(spec):
    cfg, dtype, causal, lse, m = spec
    parts = [f"d{cfg.head_dim}n{cfg.block_n}", dtype, "causal" if causal else "full", "lse" if lse else "nolse",
             f"g{m.pack_g}view" if m.pack_view else f"g{m.pack_g}"]
    parts += [name for name, on in (("split", m.split), ("seqused", m.seqused), ("kvbatch", m.kv_batch)) if on]
    if m.page_size:
        parts.append(f"page{m.page_size}")
    if m.varlen:
        parts.append("varlen")
    if (m.window_left, m.window_right) != (-1, -1):
        parts.append(f"window{m.window_left}_{m.window_right}")
    if m.softcap:
        parts.append("softcap")
    if m.sink:
        parts.append(f"sink_{m.sink}")
    if m.one_item:
        parts.append("one_item")
    if m.leftpad:
        parts.append("leftpad")
    if m.dependent:
        parts.append("dependent")
    if cfg.consumers == 3:
        parts.append("wide")
    return "-".join(parts)


@functools.lru_cache(maxsize=None)
def _census(spec):
    cfg, dtype, causal, lse, mode = spec
    return compile_check.census(cfg, dtype, causal, lse, mode)


@functools.lru_cache(maxsize=None)
def _prefill_hgmma(cfg):
    return compile_check.census(cfg, "bfloat16", True, False).sass_counts["HGMMA"]


@pytest.fixture(params=SPECS, ids=spec_id)
def spec(request):
    return request.param


def test_no_spills(spec):
    import triton

    r = _census(spec)
    spills = r.stack_bytes or r.local_bytes or r.sass_counts["LDL"] or r.sass_counts["STL"]
    cfg, dtype, causal, lse, mode = spec
    if spills and spec[-1].seqused and tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7):
        pytest.xfail("triton 3.7+ (seen on 3.9) hoists the V-tail zeroing's shared-memory addresses to the "
                     "kernel entry and spills them (~56 B of stack); triton 3.6, which the H200 runs, keeps them "
                     "in registers")
    if spills and mode.sink:
        # Sinks add no spill: triton 3.7+ spills some modes without them too
        # (head dim 256 varlen: 64 B under 3.9; test_compile_varlen xfails it).
        from dataclasses import replace

        plain = _census((cfg, dtype, causal, lse, replace(mode, sink="")))
        assert r.stack_bytes <= plain.stack_bytes and r.local_bytes <= plain.local_bytes, (r.stack_bytes,
                                                                                           plain.stack_bytes)
        return
    if mode.softcap and cfg.head_dim == 256 and mode.split and not causal:
        # tanh's scale and the capped scores cost the full-attention D = 256
        # split mode a stack slot under triton 3.6 (8 B, 5 LDL + 2 STL);
        # pinned so it cannot grow unnoticed.
        assert r.stack_bytes <= 8 and r.local_bytes == 0, f"stack {r.stack_bytes} B, local {r.local_bytes} B"
        return
    assert r.stack_bytes == 0 and r.local_bytes == 0, f"stack {r.stack_bytes} B, local {r.local_bytes} B"
    assert r.sass_counts["LDL"] == 0 and r.sass_counts["STL"] == 0, r.sass_counts


def test_softcap_runs_tanh_on_the_sfu(spec):
    # One MUFU.TANH per score (softmax.softcap), and none without softcap.
    assert ("MUFU.TANH" in _census(spec).sass) == spec[-1].softcap


def test_sinks_are_loaded_where_the_kernel_takes_them(spec):
    # The kernel's normaliser reads its sinks (one fp32 load per row) only in
    # a sink mode that is not split (the combine takes a split run's).
    mode = spec[-1]
    assert mode.kernel_sink == (bool(mode.sink) and not mode.split)
    constexprs = plan.kernel_constexprs(*(spec[i] for i in (0, 2, 3)), mode)
    assert constexprs["SINK"] == mode.kernel_sink


def _steady_steps(sass):
    """The innermost loops holding HGMMA and MUFU.EX2: the steady steps (the
    outer ones are the item loops, epilogue included)."""
    loops = compile_check.steady_loops(compile_check.instructions(sass))
    inner = [body for body in loops
             if not any(o is not body and body[0][0] <= o[0][0] and o[-1][0] <= body[-1][0] for o in loops)]
    return sorted([[text for _, text in body] for body in inner], key=len)


def test_a_sink_costs_the_steady_state_nothing(spec):
    # The sink is read once per item, in the epilogue: the steady steps do
    # the same arithmetic as the same mode's without it. ptxas may keep the
    # wgmma descriptors in uniform registers differently with the sink's
    # argument: uniform-datapath moves come and go (16 more UMOV in a step of
    # 595 at head dim 128 fp16 non-causal under triton 3.9 since
    # MAX_BEFORE_PV, 7 of 564 before it), so the step's length is compared
    # without them, and its work instruction by instruction.
    cfg, dtype, causal, lse, mode = spec
    if not mode.sink:
        return
    from collections import Counter
    from dataclasses import replace

    work = ("HGMMA", "MUFU.EX2", "FFMA", "FMUL", "FADD", "FMNMX", "F2FP", "SHFL", "SYNCS", "BAR")
    steps = [_steady_steps(_census(s).sass) for s in (spec, (cfg, dtype, causal, lse, replace(mode, sink="")))]
    assert steps[0] and len(steps[0]) == len(steps[1])
    for with_sink, without in zip(*steps):
        vector = [[t for t in body if not t.split(" ", 2)[t.startswith("@")].startswith("U")]
                  for body in (with_sink, without)]
        assert abs(len(vector[0]) - len(vector[1])) <= len(vector[1]) // 50, (len(vector[0]), len(vector[1]))
        assert len(with_sink) - len(vector[0]) <= 2 * (len(without) - len(vector[1])) + 8, \
            (len(with_sink), len(without))
        count = [Counter(op for t in body for op in work if op in t.split(" ", 2)[t.startswith("@")])
                 for body in (with_sink, without)]
        assert count[0] == count[1]


def test_instructions(spec):
    cfg, _, _, _, mode = spec
    counts = _census(spec).sass_counts
    assert counts["HGMMA"] == _prefill_hgmma(cfg), "decode modes must not change the GEMMs"
    assert counts["UTMALDG"] > 0 and counts["USETMAXREG"] > 0, counts
    if mode.split:
        assert counts["UTMASTG"] == 0, "split partials are stored from registers"
    elif mode.varlen:
        assert counts["UTMASTG"] == 0, "varlen O goes out in row-predicated stores (a box would cross sequences)"
    elif mode.pack_view:
        assert counts["UTMASTG"] == 0, "a packed view's O goes out by address (no box is its tile)"
    else:
        assert counts["UTMASTG"] > 0, "O goes out through a TMA store"
    # A run launched by programmatic dependent launch (Mode.pdl: every split
    # run, others where plan.launched_dependent says) waits for the grid
    # before it in every partition (one wait each: the consumers and the
    # producer), and lets the grid after it be scheduled (a split run at
    # its start, for its combine; another once its consumers are past their
    # last item). A run launched plainly has neither.
    ptx = _census(spec).ptx
    if mode.pdl:
        assert "griddepcontrol.launch_dependents" in ptx
        assert ptx.count("griddepcontrol.wait") >= 2, "every partition waits for the prior grid"
    else:
        assert "griddepcontrol" not in ptx, "a run launched plainly is the kernel without the waits"


def test_shared_memory_fits(spec):
    assert 0 < _census(spec).shared_bytes <= compile_check.SMEM_LIMIT_BYTES


def test_combine_kernel_compiles():
    for sink, out_dim in ((False, 0), (True, 0), (False, 96)):
        k = compile_check.compile_combine({"HEAD_DIM": 128, "S_MAX": 16, "WRITE_LSE": True, "DEPENDENT": True,
                                           "SINK": sink, "OUT_DIM": out_dim})
        assert "ex2.approx" in k.asm["ptx"] or "ex2" in k.asm["ptx"]
        # Launched dependent on the split grid: it must wait for that grid's partials.
        assert "griddepcontrol.wait" in k.asm["ptx"]


@pytest.mark.parametrize("head_dim,dtype", [(64, "bf16"), (128, "bf16"), (128, "fp16"), (256, "bf16")])
def test_append_kernel_compiles(head_dim, dtype):
    """The KV cache's append (``kernels/append.py``) for sm_90a in every
    mode it is launched in: plain, through cache_batch_idx, paged, and with
    rotary embedding either pairing and either query position rule, its
    tables in the queries' dtype or float32. No local memory."""
    import itertools

    from hopper_flash.kernels.append import append_kernel

    names = append_kernel.arg_names
    pointers = {"k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "q_ptr", "q_out_ptr"}
    flags = ("PAGED", "BATCH_IDX", "ROTARY", "INTERLEAVED", "Q_POS_STEP")
    for paged, batch_idx, rotary, interleaved, step, table in itertools.product(
            (False, True), (False, True), (False, True), (False, True), (False, True), (dtype, "fp32")):
        if (paged and batch_idx) or (not rotary and (interleaved or step or table == "fp32")):
            continue  # never launched so
        sig = {n: (f"*{dtype}" if n in pointers else f"*{table}" if n in ("cos_ptr", "sin_ptr")
                   else "*i32" if n.endswith("_ptr") else "i32") for n in names}
        # SEQUSED_OUT: launched on whenever a token is appended (off only for none: one store fewer).
        consts = dict(zip(flags, (paged, batch_idx, rotary, interleaved, step)),
                      HEAD_DIM=head_dim, BLOCK_H=max(1, 2048 // head_dim), SEQUSED_OUT=True)
        sig.update({n: "constexpr" for n in consts})
        k = compile_check.compile_triton(append_kernel, sig, consts, num_warps=4,
                                         enable_fp_fusion=True)  # as plan.launch_triton
        assert ".local" not in k.asm["ptx"], (consts, table)
        assert ("fma.rn.f32" in k.asm["ptx"] or "mul.f32" in k.asm["ptx"]) == rotary, consts


# Fixed-length packed views copied by the kernel from q itself, row by row (plan.Mode.q_rows: more
# than one query per row at a group that is not a power of two, q contiguous): (head dim, causal,
# group, the rest of the mode). Chunked prefill over a cache, drafts, split-KV, pages read in place
# and gathered (a four-warp producer), cache_leftpad, and prefill without a cache.
FIXED_ROWS_SPECS = [
    (128, True, 5, dict(seqused=True)),
    (128, True, 7, dict(seqused=True, split=True)),
    (64, True, 5, dict(seqused=True, page_size=64)),
    (128, True, 3, dict(seqused=True, page_size=4)),
    (128, True, 5, dict(seqused=True, leftpad=True, kv_batch=True)),
    (128, False, 5, dict()),
    (64, True, 6, dict(seqused=True, split=True, page_size=16)),
]


@pytest.mark.parametrize("spec", FIXED_ROWS_SPECS,
                         ids=lambda s: f"d{s[0]}-{'causal' if s[1] else 'full'}-g{s[2]}rows-"
                                       + "-".join(k for k, on in s[3].items() if on) or "plain")
def test_fixed_length_q_rows(spec):
    """Q by rows outside the varlen mode: the packed view's kernel without
    its Q boxes. Each part's rows come by cp.async, 16 bytes an instruction,
    so the producer (one warp, or a gathering launch's warpgroup) issues
    exactly the Q tile's bytes / 16 per thread more than the kernel that
    loads a packed copy; the same GEMMs, no spills (triton 3.6)."""
    import triton

    d, causal, group, fields = spec
    cfg = plan.CONFIGS[d]
    lse = not fields.get("split", False)
    base_mode = Mode(pack_g=group, pack_view=True, **fields)
    r = compile_check.census(cfg, "bfloat16", causal, lse, Mode(q_rows=True, pack_g=group, pack_view=True, **fields))
    base = _census((cfg, "bfloat16", causal, lse, base_mode))
    assert r.sass_counts["HGMMA"] == base.sass_counts["HGMMA"]
    assert r.sass_counts["UTMALDG"] < base.sass_counts["UTMALDG"], "Q must not come by TMA"
    producer_threads = 128 if plan.gathers(fields.get("page_size", 0), d) else 32
    q_copies = cfg.block_m * d * 2 // 16 // producer_threads
    assert r.sass.count("LDGSTS.E") - base.sass.count("LDGSTS.E") == q_copies
    assert r.sass.count("LDGSTSBAR") > base.sass.count("LDGSTSBAR"), "the copies arrive on Q's barriers"
    spills = r.stack_bytes or r.local_bytes or r.sass_counts["LDL"] or r.sass_counts["STL"]
    if spills and tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7):
        pytest.xfail("triton 3.7+ spills around the V-tail zeroing (as the decode modes do)")
    assert not spills, (r.stack_bytes, r.local_bytes, r.sass_counts["LDL"], r.sass_counts["STL"])
