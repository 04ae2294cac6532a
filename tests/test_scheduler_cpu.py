"""Which work-item order a forward launch takes, on CPU (kernels/scheduler.py):
the static deal or the dynamic order drawn from a counter, the L2 section
size, and the counter the launch hands the kernel. The order itself runs on
the GPU (tests/test_forward_gpu.py::test_dynamic_order*, and every causal
test at 16 or more query tiles), where a skipped or repeated item leaves NaN
in the poisoned output or races."""
import dataclasses
import inspect

import pytest
import torch

from hopper_flash import plan
from launch_fakes import FakeCompiled

SMS = 132


@pytest.fixture(autouse=True)
def h200(monkeypatch):
    monkeypatch.setattr(plan, "sm_count", lambda device=None: SMS)


def prefill_plan(batch, seqlen_q, nheads, causal, seqlen_k=None, nheads_kv=None, head_dim=128, **kw):
    cfg = plan.CONFIGS[head_dim]
    seqlen_k = seqlen_k or seqlen_q
    args = dict(page_size=0, seqused=False, kv_batch=False, num_splits=1, pack_gqa=False, window=None,
                softcap=False, sink="", by_address=False)
    args.update(kw)
    return plan._plan_launch.__wrapped__(0, torch.bfloat16, batch, seqlen_q, nheads, nheads_kv or nheads,
                                         plan.triton_cdiv(seqlen_k, cfg.block_n), cfg, args["page_size"],
                                         args["seqused"], args["kv_batch"], args["num_splits"], args["pack_gqa"],
                                         causal, False, window=args["window"], softcap=args["softcap"],
                                         sink=args["sink"], by_address=args["by_address"])


@pytest.mark.parametrize("batch,seqlen,nheads", [(4, 2048, 32), (4, 8192, 32), (1, 32768, 32), (2, 12345, 16),
                                                 (1, 2048, 9)])
def test_long_causal_prefill_takes_the_dynamic_order(batch, seqlen, nheads):
    lp = prefill_plan(batch, seqlen, nheads, causal=True)
    items = plan.work_items(batch, nheads, seqlen, lp.cfg)
    assert lp.mode.dynamic and lp.constexprs["DYNAMIC"] is True
    assert (lp.n_ctas, lp.pair) == (min(SMS, items), 1)  # one CTA per SM; each draws its next item


@pytest.mark.parametrize("batch,seqlen,nheads,causal", [
    (4, 1024, 32, True),    # 8 query tiles: the static deal's last wave costs as little
    (16, 512, 16, True),    # the CUDA-graph row: no memset in the graph
    (1, 2048, 8, True),     # 128 items: one wave
    (4, 8192, 32, False),   # every item costs the same
])
def test_static_deal_elsewhere(batch, seqlen, nheads, causal):
    lp = prefill_plan(batch, seqlen, nheads, causal=causal)
    assert not lp.mode.dynamic and lp.constexprs["DYNAMIC"] is False


@pytest.mark.parametrize("batch,seqlen,nheads,imbalance", [
    (8, 1408, 32, 1.40),   # 11 tiles: pairs straddle heads, and 11 pairs per two heads divide 132 CTAs
    (4, 1152, 8, 2.14),    # 9 tiles, 144 pairs: 12 CTAs run a second round
    (4, 1920, 32, 1.19),   # 15 tiles
])
def test_short_causal_prefill_dealt_unevenly_takes_the_dynamic_order(batch, seqlen, nheads, imbalance):
    n_tiles = plan.triton_cdiv(seqlen, 128)
    assert plan.static_deal_imbalance(batch * nheads, n_tiles, SMS) == pytest.approx(imbalance, abs=0.01)
    lp = prefill_plan(batch, seqlen, nheads, causal=True)
    assert lp.mode.dynamic and (lp.n_ctas, lp.pair) == (min(SMS, plan.work_items(batch, nheads, seqlen, lp.cfg)), 1)


def test_static_deal_imbalance_by_hand():
    # 2 heads of 3 tiles on 4 SMs: 6 items > 4, so pairs; zig-zag per head
    # (j: 0 1 2 -> bm 2 0 1), pairs of items (0,1) (2,3) (4,5) on CTAs 0 1 2:
    # bm (2,0) (1,2) (0,1), costs bm + 2: 6, 7, 5; the bound is max(18 / 3, 3 + 1) = 6.
    assert plan.static_deal_imbalance(2, 3, 4) == pytest.approx(7 / 6)
    # Balanced: even tile counts whose pairs per head divide the CTA count.
    assert plan.static_deal_imbalance(256, 8, SMS) < plan.STATIC_IMBALANCE_LIMIT


def test_decode_modes_keep_the_static_deal():
    assert not prefill_plan(8, 4096, 32, True, nheads_kv=8, seqused=True).mode.dynamic
    assert not prefill_plan(8, 4096, 32, True, nheads_kv=8, kv_batch=True).mode.dynamic
    split = prefill_plan(1, 1, 32, True, seqlen_k=65536, nheads_kv=8, num_splits=0, pack_gqa=None)
    assert split.mode.split and not split.mode.dynamic


@pytest.mark.parametrize("nheads,nheads_kv,seqlen_q", [(28, 4, 96), (32, 8, 96)])
def test_split_items_past_one_wave_get_a_cta_each(nheads, nheads_kv, seqlen_q):
    """96 packed 128-row items over 8192 keys: the split rule (FA3's) counts
    4 splits in waves of single items; dealt in pairs, 60 of the 132 CTAs ran
    four items each, as many KV tiles as no split. One CTA per split item
    instead, dealt by the hardware as SMs free up."""
    lp = prefill_plan(4, seqlen_q, nheads, True, seqlen_k=8192, nheads_kv=nheads_kv, num_splits=0, pack_gqa=None,
                       by_address=True)
    items = plan.work_items(4, nheads, seqlen_q, lp.cfg, lp.mode)
    assert lp.mode.pack_g > 1 and items == 96 and lp.num_splits == 4
    assert (lp.n_ctas, lp.pair) == (items * lp.num_splits, 1)
    # Unsplit runs past one wave keep the pairs; split runs within a wave one item per CTA as before.
    assert prefill_plan(4, 8192, 32, False).pair == 2
    one_wave = prefill_plan(1, 1, 32, True, seqlen_k=65536, nheads_kv=8, num_splits=0, pack_gqa=None)
    assert (one_wave.n_ctas, one_wave.pair) == (8 * one_wave.num_splits, 1) and one_wave.n_ctas <= SMS


def test_varlen_always_takes_the_dynamic_order():
    cfg = plan.CONFIGS[128]
    for batch, max_q in [(16, 8192), (2, 1), (1, 100)]:
        lp = plan._plan_varlen.__wrapped__(0, torch.bfloat16, batch, max_q, max_q, 32, 4, cfg, False, False, True,
                                           False)
        items = plan.work_items(batch, 32, max_q, cfg, lp.mode)
        assert lp.mode.dynamic and (lp.n_ctas, lp.pair) == (min(SMS, items), 1)


def test_varlen_packs_gqa_where_the_group_allows_it():
    """FA3's rule for packed batches (their lengths are the device's): PackGQA
    whenever the group is a power of two dividing 64; an item's head is then
    a KV head, and an L2 section counts KV heads."""
    cfg = plan.CONFIGS[128]

    def varlen_plan(nheads, group, pack_gqa=None, max_q=4096):
        return plan._plan_varlen.__wrapped__(0, torch.bfloat16, 16, max_q, 8192, nheads, group, cfg, False, False,
                                             True, False, pack_gqa=pack_gqa)

    packed = varlen_plan(32, 4)
    assert packed.mode.pack_g == 4
    assert packed.n_ctas == min(SMS, plan.work_items(16, 32, 4096, cfg, packed.mode))
    # One section per KV head at most (8 of them), as many as fit L2 (4 MB each at 8192 keys).
    assert packed.section == 8
    assert varlen_plan(32, 4, pack_gqa=False).mode.pack_g == 1
    # Unpacked, a section counts query heads (those sharing a KV head read the same K and V), capped at a sequence's.
    assert varlen_plan(32, 4, pack_gqa=False).section == 32
    assert varlen_plan(2, 1).mode.pack_g == 1
    for group in (3, 6, 128):  # by default a packed view (pack_layout; the launch weighs it first)
        assert (varlen_plan(group * 2, group).mode.pack_g, varlen_plan(group * 2, group).mode.pack_view) == (group, True)
    assert [plan.choose_varlen_pack_gqa(g) for g in (1, 2, 3, 4, 8, 16, 64, 96, 128)] == [False] + [True] * 8


def test_varlen_packs_groups_not_powers_of_two_from_a_packed_view():
    """A group that is not a power of two packs from a packed view of q
    (plan.pack_layout) at head dims 64 and 128, at any query length when
    asked; the items and the skew split's work bound run over KV heads."""
    def varlen_plan(nheads, group, max_q, pack_gqa=True, d=128):
        return plan._plan_varlen.__wrapped__(0, torch.bfloat16, 16, max_q, 8192, nheads, group, plan.CONFIGS[d],
                                             False, True, True, False, pack_gqa=pack_gqa)

    decode = varlen_plan(40, 5, 1)
    assert (decode.mode.pack_g, decode.mode.pack_view, decode.mode.q_tokens) == (5, True, True)
    assert decode.constexprs["Q_TOKENS"] is True and not varlen_plan(40, 5, 2).mode.q_tokens
    assert not varlen_plan(32, 4, 1).mode.q_tokens  # (the box packs q as it is)
    assert plan.work_items(16, 40, 1, plan.CONFIGS[128], decode.mode) == 16 * 8  # (batch, KV head) items
    assert decode.constexprs["PACK_VIEW"] is True and decode.constexprs["PACK_G"] == 5
    assert decode.section <= 8  # sections count KV heads
    assert (varlen_plan(28, 7, 700).mode.pack_g, varlen_plan(28, 7, 700).mode.pack_view) == (7, True)
    assert varlen_plan(12, 3, 32, d=64).mode.pack_view
    assert varlen_plan(40, 5, 1, d=256).mode.pack_g == 1  # head dim 256's view spilled (plan.VIEW_HEAD_DIMS)
    assert varlen_plan(40, 5, 1, pack_gqa=False).mode.pack_g == 1
    assert not varlen_plan(32, 4, 1).mode.pack_view  # a power of two: the box packs it
    if 64 in plan.WIDE_CONFIGS:  # head dim 64's wide tiles: not for a packed view (not yet run on a GPU)
        assert varlen_plan(12, 3, 4096, d=64).cfg is plan.CONFIGS[64]
        assert varlen_plan(8, 4, 4096, d=64).cfg is plan.WIDE_CONFIGS[64]
    # The skew split's work bound: 64 decodes of 1024 keys beside one of 65536, 40/8.
    lens = [1024] * 64 + [65536]
    cfg = plan.CONFIGS[128]
    packed = plan.varlen_skew_splits(sum(lens), len(lens), 1, 65536, 40, 5, cfg, True, None, 0)
    unpacked = plan.varlen_skew_splits(sum(lens), len(lens), 1, 65536, 40, 5, cfg, False, None, 0)
    assert packed > unpacked >= 1  # five times less work per KV tile packed: the long sequence stands out more


def test_varlen_view_where_the_decodes_reads_outweigh_the_copy():
    """choose_varlen_view's model of a serving batch (one-query decodes and
    chunks of max_seqlen_q queries): pack where the K/V bytes saved on the
    decodes exceed the bytes of copying q."""
    def mix(decodes, chunk, group, decode_keys=4500, paged=False):
        keys = decodes * decode_keys + chunk + 1024
        return plan.choose_varlen_view(decodes + chunk, decodes + 1, chunk, max(chunk + 1024, 8000),
                                       0 if paged else keys, group)

    assert plan.choose_varlen_view(64, 64, 1, 8000, 64 * 4500, 5)  # decodes only
    assert plan.choose_varlen_view(64, 64, 1, 1, 64, 7)  # one query per sequence: no copy to outweigh
    for group in (3, 5, 6, 7):
        assert mix(64, 512, group) and mix(16, 4096, group) and mix(256, 8192, group)
        assert not mix(0, 8192, group)  # prefill only: the copy buys nothing
        assert mix(1, 4096, group, decode_keys=65536) and not mix(1, 4096, group, decode_keys=2048)
    # Pages (k's rows unknown): decodes taken at half the longest key count.
    assert mix(64, 512, 5, paged=True)
    # Prefill batches of one length: never.
    assert not plan.choose_varlen_view(16 * 4300, 16, 8192, 8192, 16 * 4300, 7)


def test_rows_of_q_needs_adjacent_heads_of_the_kernels_head_dim():
    cfg = plan.CONFIGS[128]
    q = torch.zeros(40, 12, 128, dtype=torch.bfloat16)
    assert plan.rows_of_q(q, cfg) and plan.q_row_heads(q) == 12
    qkv = torch.zeros(40, 3, 12, 128, dtype=torch.bfloat16)
    assert plan.rows_of_q(qkv[:, 0], cfg)  # flash_attn_varlen_qkvpacked_func's q: tokens 36 heads apart
    assert plan.q_row_heads(qkv[:, 0]) == 36
    fused = torch.zeros(40, (12 + 2 * 4) * 128, dtype=torch.bfloat16)  # a fused QKV projection's output
    assert plan.rows_of_q(fused[:, :12 * 128].view(40, 12, 128), cfg)
    assert plan.q_row_heads(fused[:, :12 * 128].view(40, 12, 128)) == 20
    # Heads interleaved with something else, or tokens not a whole number of head dims apart: the copy.
    assert not plan.rows_of_q(torch.zeros(40, 12, 2, 128, dtype=torch.bfloat16)[:, :, 0], cfg)
    assert not plan.rows_of_q(torch.zeros(40, 12 * 128 + 8, dtype=torch.bfloat16)[:, :12 * 128].view(40, 12, 128),
                              cfg)
    assert not plan.rows_of_q(torch.zeros(40, 12, 96, dtype=torch.bfloat16), cfg)  # a narrower head dim
    assert plan.rows_of_q(q[1:], cfg)  # a view at a 16-byte multiple
    assert not plan.rows_of_q(q.view(-1)[4:4 + 39 * 12 * 128].view(39, 12, 128), cfg)  # 8 bytes off: cp.async's 16


def test_rows_of_q_takes_a_fixed_length_q_of_evenly_spaced_tokens():
    cfg = plan.CONFIGS[128]
    q = torch.zeros(3, 17, 40, 128, dtype=torch.bfloat16)
    assert plan.rows_of_q(q, cfg)
    assert not plan.rows_of_q(torch.zeros(3, 40, 17, 128, dtype=torch.bfloat16).transpose(1, 2), cfg)  # BHSD
    qkv = torch.zeros(3, 17, 3, 40, 128, dtype=torch.bfloat16)[:, :, 0]  # qkv-packed: tokens 120 heads apart
    assert plan.rows_of_q(qkv, cfg) and plan.q_row_heads(qkv) == 120
    # The kernel takes batch b's tokens to follow batch b - 1's: a batch stride of its own is copied.
    assert not plan.rows_of_q(torch.zeros(3, 20, 40, 128, dtype=torch.bfloat16)[:, :17], cfg)
    assert plan.rows_of_q(torch.zeros(1, 20, 40, 128, dtype=torch.bfloat16)[:, :17], cfg)  # (one batch)


def test_fixed_length_launch_reads_q_by_rows_past_one_query(monkeypatch):
    """launch_forward asks for Q by rows (``Mode.q_rows``) where a packed
    view would copy q: more than one query per row, a group that is not a
    power of two, q contiguous. At one query per row the view is q itself
    (``packed_q`` restrides it), and a power of two needs no view."""
    seen = []

    class Stop(Exception):
        pass

    signature = inspect.signature(plan._plan_launch.__wrapped__)

    def fake_plan(*args, **kwargs):
        seen.append(signature.bind(*args, **kwargs).arguments.get("q_rows", False))
        raise Stop

    monkeypatch.setattr(plan, "_plan_launch", fake_plan)

    def launch(sq, h, hkv, strided=False):
        q = torch.zeros(2, sq, h, 128, dtype=torch.bfloat16)
        if strided:  # heads interleaved with other features: a copy
            q = torch.zeros(2, sq, h, 2, 128, dtype=torch.bfloat16)[:, :, :, 0]
        k = torch.zeros(2, 1000, hkv, 128, dtype=torch.bfloat16)
        with pytest.raises(Stop):
            plan.launch_forward(q, k, k, torch.empty(2, sq, h, 128, dtype=torch.bfloat16), None, 0.1, True,
                                pack_gqa=True)
        return seen.pop()

    assert launch(4, 40, 8) and launch(300, 28, 4)
    assert not launch(1, 40, 8)  # one query per row: q restrided, no copy
    assert not launch(4, 32, 8)  # a power of two: Q's box packs it
    assert not launch(4, 40, 8, strided=True)  # the kernel needs a token's heads adjacent: a copy


def test_varlen_launch_resolves_the_packed_view_from_q_rows(monkeypatch):
    """launch_forward_varlen resolves pack_gqa=None for a group that is not
    a power of two before the cached plan (whose key lacks q's rows), and
    leaves it None (FA3's rule, pack_layout) for a power of two."""
    seen = []

    class Stop(Exception):
        pass

    signature = inspect.signature(plan._plan_varlen.__wrapped__)

    def fake_plan(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        seen.append((bound["pack_gqa"], bound.get("q_rows", False)))
        raise Stop

    monkeypatch.setattr(plan, "_plan_varlen", fake_plan)
    monkeypatch.setattr(plan, "varlen_skew_splits", lambda *a, **k: 1)
    monkeypatch.setattr(plan, "varlen_total_q_key", lambda *a, **k: 0)

    def launch(lq, lk, h, hkv, strided=False, causal=True, d=128):
        q = torch.zeros(sum(lq), h, d, dtype=torch.bfloat16)
        if strided:  # heads interleaved with other features: the kernel cannot read its rows, the view copies it
            q = torch.zeros(sum(lq), h, 2, d, dtype=torch.bfloat16)[:, :, 0]
        k = torch.zeros(sum(lk), hkv, d, dtype=torch.bfloat16)
        cq = torch.tensor([0] + lq).cumsum(0).to(torch.int32)
        ck = torch.tensor([0] + lk).cumsum(0).to(torch.int32)
        with pytest.raises(Stop):
            plan.launch_forward_varlen(q, k, k, torch.empty_like(q), None, cq, ck, None, None, max(lq), max(lk),
                                       0.1, causal, num_splits=0)
        return seen.pop()

    assert launch([1] * 64 + [512], [4500] * 64 + [1536], 40, 8) == (True, True)
    # Prefill alone: packed by rows at head dim 128 under a causal mask (VIEW_ROWS_ALWAYS), else as
    # choose_varlen_view weighs a copy of q, read by rows or not.
    assert launch([4096] * 16, [5120] * 16, 40, 8) == (True, True)
    assert launch([4096] * 16, [5120] * 16, 40, 8, strided=True) == (False, False)
    assert launch([4096] * 16, [5120] * 16, 40, 8, causal=False) == (False, True)
    assert launch([4096] * 16, [5120] * 16, 40, 8, d=64) == (False, True)
    assert launch([1] * 64 + [512], [4500] * 64 + [1536], 32, 8) == (None, False)  # (a power of two: no view)
    # A few decodes beside a long chunk: packed at head dim 128 under a causal mask when the kernel reads
    # q's rows; not worth a copy of q, nor (the same rule) at head dim 64.
    assert launch([1] * 4 + [8000], [900] * 4 + [8000], 40, 8) == (True, True)
    assert launch([1] * 4 + [8000], [900] * 4 + [8000], 40, 8, strided=True) == (False, False)
    assert launch([1] * 4 + [8000], [900] * 4 + [8000], 40, 8, d=64) == (False, True)
    # A prefill batch of varied lengths, which choose_varlen_view's model takes for chunks beside decodes.
    lens = [512 + 480 * i for i in range(16)]
    assert launch(lens, lens, 40, 8, d=64) == (False, True)
    assert launch(lens, lens, 40, 8) == (True, True)


def test_l2_section_holds_32_mb_of_kv_per_section():
    # bf16, D=128: one KV head of S keys is S * 512 bytes of K and V.
    assert plan.l2_section(8192, 128, 2, 1) == 8     # 4 MB per head
    assert plan.l2_section(8192, 128, 2, 4) == 32    # GQA 32/8: four query heads read each KV head
    assert plan.l2_section(12345, 128, 2, 1) == 4    # 6 MB: 5 would fit, rounded down to a power of two
    assert plan.l2_section(2048, 64, 2, 1) == 64     # 0.5 MB per head
    assert plan.l2_section(10**7, 256, 2, 1) == 1    # never less than one head
    assert plan.l2_section(0, 128, 2, 1) >= 1


def test_dynamic_launch_gets_a_fresh_zeroed_counter_and_the_section(monkeypatch):
    from hopper_flash.kernels import forward as fk

    launches = []
    names = fk.attention_forward_kernel.arg_names

    class FakeJIT:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, dict(zip(names, args)), kwargs))
                return FakeCompiled([])
            return launch

    monkeypatch.setattr(fk, "attention_forward_kernel", FakeJIT())
    monkeypatch.setattr(plan, "_COMPILED", {})
    # Both launches through the (fake) JIT; the fast path takes the same pointer arguments.
    monkeypatch.setattr(plan, "FAST_LAUNCH", False)
    monkeypatch.setattr(plan, "_plan_launch", plan._plan_launch.__wrapped__)
    q = torch.randn(2, 2048, 16, 128).to(torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    for _ in range(2):
        plan.launch_forward(q, k, v, torch.empty_like(q), None, 0.1, True)
    (grid0, a0, kw0), (grid1, a1, kw1) = launches
    assert kw0["DYNAMIC"] is True and grid0 == (SMS, 1, 1)
    for a in (a0, a1):
        assert a["sched_ptr"].dtype == torch.int32 and a["sched_ptr"].shape == (1,)
        assert int(a["sched_ptr"][0]) == 0
        assert a["section"] == plan.l2_section(2048, 128, 2, 1)
    # Never one counter shared by two launches (streams, graphs).
    assert a0["sched_ptr"] is not a1["sched_ptr"]


def test_backward_grid_is_one_axis_in_l2_sections():
    from hopper_flash import plan_backward as pb

    cfg = pb.BACKWARD_CONFIGS[128]
    assert pb.grid(4, 32, 8192, cfg) == (64 * 32 * 4, 1, 1)  # no 65535 cap on heads or batch any more
    assert pb.grid(70000, 1, 128, cfg) == (70000, 1, 1)
    d256 = pb.BACKWARD_CONFIGS[256]
    assert d256.block_n == 64 and pb.kv_tiles(300, d256) == 5  # one CTA per 64-key tile, all 256 columns
    # Q and dO (bf16) and the fp32 dQ accumulator of one KV head's group: 8 MB at S=8192, D=128.
    assert pb.l2_section(8192, 128, 2, 1) == 4
    assert pb.l2_section(8192, 128, 2, 4) == 1     # GQA 32/8: 32 MB per KV head
    assert pb.l2_section(1024, 128, 2, 1) == 32
    assert pb.l2_section(10**7, 256, 2, 8) == 1


# ---- The wide tiles (plan.WIDE_CONFIGS): three consumers on 192 rows, for long plain prefill at head dim 64.

needs_wide = pytest.mark.skipif(not plan.WIDE_CONFIGS, reason="no wide tiles under this triton")


@pytest.mark.parametrize("seqlen_q,seqlen_k,causal,wide", [
    (8192, 8192, False, True), (2048, 2048, False, True), (1024, 1024, False, False),  # measured 9% / 2% / -7%
    (8192, 8192, True, True), (4096, 4096, True, False), (2048, 2048, True, False),    # 4-5% / -3% / -35%
    (1024, 4096, True, False),   # chunked prefill: 3584 keys per row on average (measured -13%)
    (1024, 8192, True, False),   # 7680, but query lengths under WIDE_MIN_ROWS were not measured
    (2048, 6144, True, True),    # 5120
    (1, 65536, True, False),     # decode-shaped: one live row per tile
    (8192, 1024, True, False),   # more queries than keys: 64 keys per row on average
])
def test_choose_wide_by_mean_keys_per_row(seqlen_q, seqlen_k, causal, wide):
    assert plan.choose_wide(seqlen_q, seqlen_k, causal) is wide


@needs_wide
def test_long_head_dim_64_prefill_plans_the_wide_tiles():
    lp = prefill_plan(8, 8192, 32, False, head_dim=64)
    wide = plan.WIDE_CONFIGS[64]
    assert lp.cfg is wide and lp.constexprs["BLOCK_M"] == 192 and lp.cfg.consumers == 3
    assert lp.cfg.maxnreg == 128 and lp.cfg.consumer_regs == 160
    assert lp.n_ctas == min(SMS, plan.work_items(8, 32, 8192, wide))
    assert prefill_plan(8, 1024, 32, False, head_dim=64).cfg is plan.CONFIGS[64]
    assert prefill_plan(8, 8192, 32, False, head_dim=128).cfg is plan.CONFIGS[128]


@needs_wide
def test_wide_causal_takes_the_dynamic_order_past_one_wave():
    # 11 query tiles of 192 rows (under choose_dynamic's 16), 2816 items: wide
    # causal items dealt statically measured up to 1.5x slower, so the counter deals them.
    lp = prefill_plan(8, 2048, 32, True, seqlen_k=6144, head_dim=64)
    assert lp.cfg.consumers == 3 and lp.mode.dynamic
    one_wave = prefill_plan(1, 8192, 2, True, head_dim=64)  # 86 items
    assert one_wave.cfg.consumers == 3 and not one_wave.mode.dynamic and one_wave.pair == 1


@needs_wide
def test_decode_modes_and_variants_keep_their_tiles():
    for kw in (dict(seqused=True), dict(kv_batch=True), dict(num_splits=4), dict(pack_gqa=True)):
        lp = prefill_plan(2, 64, 32, True, seqlen_k=65536, nheads_kv=8, head_dim=64, **kw)
        assert lp.cfg is plan.CONFIGS[64], kw
    variant = dataclasses.replace(plan.CONFIGS[64], k_stages=3)
    lp = plan._plan_launch.__wrapped__(0, torch.bfloat16, 8, 8192, 32, 32, 64, variant, 0, False, False, 1, False,
                                       False, False)
    assert lp.cfg is variant


def test_no_wide_tiles_under_triton_3_9():
    # Its ptxas spills the write-LSE kernels at 160 registers (tenth session's census).
    assert plan.wide_configs("3.9.0") == {}
    assert set(plan.wide_configs("3.6.0")) == {64}


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,nheads,nheads_kv,causal,one", [
    (4, 128, 8192, 32, 8, True, True),      # issue 10's chunked row: 128 items on 132 SMs
    (1, 2048, 2048, 8, 8, True, True),      # 128 items: one wave
    (1, 4096, 4096, 4, 4, False, True),     # non-causal, 128 items
    (4, 256, 8192, 17, 17, True, False),    # 136 items: pairs on 68 CTAs
    (2, 512, 32768, 32, 8, True, False),    # 256 items dealt in pairs
    (4, 8192, 8192, 32, 32, True, False),   # the dynamic order
    (4, 8192, 8192, 32, 32, False, False),  # static, 64 items per SM
])
def test_one_item_per_cta_at_head_dim_128(batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal, one):
    """``Mode.one_item`` (the kernel's ``ONE_ITEM``, which moves head dim
    128's V wait to FA3's place) is set exactly when every CTA of a plain
    launch runs one work item."""
    lp = prefill_plan(batch, seqlen_q, nheads, causal=causal, seqlen_k=seqlen_k, nheads_kv=nheads_kv)
    items = plan.work_items(batch, nheads, seqlen_q, lp.cfg)
    assert (items <= SMS and not lp.mode.dynamic) == one
    assert lp.mode.one_item is one and lp.constexprs["ONE_ITEM"] is one
    if one:
        assert (lp.n_ctas, lp.pair) == (items, 1)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_one_item_only_where_the_kernel_reads_it(head_dim):
    """Other head dims compile no second kernel for one-item launches."""
    lp = prefill_plan(1, 2048, 8, causal=True, head_dim=head_dim)
    assert plan.work_items(1, 8, 2048, lp.cfg) <= SMS
    assert not lp.mode.one_item


def test_decode_modes_keep_one_item_off():
    """PackGQA, split-KV and cache lengths are not plain launches."""
    lp = prefill_plan(8, 1, 32, causal=True, seqlen_k=16384, nheads_kv=8, pack_gqa=True, num_splits=4,
                      seqused=True)
    assert lp.mode.split and not lp.mode.one_item


@pytest.mark.parametrize("extra", [{"softcap": True}, {"sink": "bfloat16"}, {"softcap": True, "sink": "float32"},
                                   {"window": (1023, 0)}])
def test_one_item_with_softcap_sinks_and_windows(extra):
    """Soft-capping, sinks and windows do not change which launches run one
    item per CTA (test_softcap_gpu and test_sinks_gpu run those kernels on
    chunked prefill's shape and check that they did)."""
    lp = prefill_plan(4, 128, 32, causal=True, seqlen_k=8192, nheads_kv=8, **extra)
    assert lp.mode.one_item and lp.n_ctas == 128
    assert lp.mode.softcap == extra.get("softcap", False) and lp.mode.sink == extra.get("sink", "")


def test_one_item_up_to_the_timed_length():
    """One-item launches take V_AT_ISSUE up to the longest items timed
    (plan.ONE_ITEM_MAX_KV_TILES KV tiles), the other form beyond."""
    tiles = plan.ONE_ITEM_MAX_KV_TILES
    assert prefill_plan(4, 128, 32, causal=True, seqlen_k=tiles * 128, nheads_kv=8).mode.one_item
    longer = prefill_plan(4, 128, 32, causal=True, seqlen_k=tiles * 128 + 1, nheads_kv=8)
    assert not longer.mode.one_item and not longer.mode.dynamic and longer.n_ctas == 128


def test_varlen_split_kv_where_the_host_bounds_leave_the_gpu_idle():
    """Split-KV in the varlen mode (the KV cache's mixed route asks for the
    heuristic, num_splits=0): FA3's rule on the items and KV tiles the host
    bounds know. A split run takes the static deal (the dynamic order has no
    split coordinate) and leaves the LSE to the combine."""
    cfg = plan.CONFIGS[128]

    def varlen_plan(batch, max_q, max_k, num_splits, write_lse=True, nheads=32, group=4):
        return plan._plan_varlen.__wrapped__(0, torch.bfloat16, batch, max_q, max_k, nheads, group, cfg, False, True,
                                             True, write_lse, num_splits=num_splits)

    few_long = varlen_plan(3, 1, 65536, 0)  # three decodes over 64k keys: 24 packed items
    assert few_long.mode.split and few_long.num_splits > 1 and not few_long.mode.dynamic
    assert few_long.constexprs["WRITE_LSE"] is False
    assert few_long.n_ctas <= SMS and few_long.n_ctas >= 24 * few_long.num_splits // 2
    assert varlen_plan(3, 1, 65536, 5).num_splits == 5  # an explicit count is honoured
    assert varlen_plan(3, 1, 300, 64).num_splits == 3  # at most one split per KV tile
    assert not varlen_plan(64, 1, 65536, 0).mode.split  # 512 items fill the GPU
    assert not varlen_plan(3, 1, 500, 0).mode.split  # four KV tiles are too few to split
    plain = varlen_plan(16, 4096, 4096, 1)
    assert not plain.mode.split and plain.mode.dynamic and plain.constexprs["WRITE_LSE"] is True


def test_varlen_split_heuristic_bounds_the_live_items_by_the_rows_of_q():
    """Three decodes over long caches beside a 256-query chunk: max_seqlen_q
    alone (FA3's rule) sees four 256-query sequences, 256 items, and does not
    split; q's 259 rows bound the live items at (ceil(259 * 4 / 128) + 3) * 8
    = 96 of the 132 SMs, and the keys are split. Enough rows to fill the GPU
    leave the plan unsplit, and every row count past the point where the
    bound reaches one item per SM shares one plan-cache key."""
    cfg = plan.CONFIGS[128]

    def varlen_plan(total_q, max_q=256, batch=4, max_k=60000):
        return plan._plan_varlen.__wrapped__(0, torch.bfloat16, batch, max_q, max_k, 32, 4, cfg, False, True,
                                             True, False, num_splits=0, total_q=total_q)

    assert not varlen_plan(0).mode.split  # rows unknown: max_seqlen_q's bound, 256 items
    mixed = varlen_plan(259)
    assert mixed.mode.split and mixed.num_splits == plan.choose_num_splits(96, 469, SMS) > 1
    # One CTA per split item (256 items: 8 query tiles x 8 KV heads x 4 sequences), the hardware's deal.
    assert (mixed.n_ctas, mixed.pair) == (256 * mixed.num_splits, 1)
    many = varlen_plan(259, max_q=8192)  # a loose max_seqlen_q: too many empty items for a CTA each
    assert many.mode.split and many.n_ctas <= SMS and many.pair == 2
    assert not varlen_plan(256 * 4).mode.split  # four full chunks: 256 live items
    assert not varlen_plan(259, max_k=500).mode.split  # too few KV tiles to split
    key = plan.varlen_total_q_key
    assert key(259, 32, cfg, 0) == 259
    cap = key(10 ** 6, 32, cfg, 0)
    assert cap == key(cap + 1, 32, cfg, 0) and cap * 32 >= SMS * cfg.block_m
    for batch, max_q in ((1, 1), (3, 200), (4, 256), (64, 16), (1, 8192)):  # the cap's plan is every larger count's
        assert varlen_plan(cap, max_q, batch).num_splits == varlen_plan(4 * cap, max_q, batch).num_splits


@pytest.mark.skipif(64 not in plan.WIDE_CONFIGS, reason="no wide tiles under this triton")
def test_varlen_head_dim_64_takes_the_wide_tiles_for_long_unpaged_unsplit_batches():
    """Head dim 64's 192-row tiles in the varlen mode: only where the
    longest query reaches WIDE_MIN_ROWS, with K/V unpaged, the keys unsplit
    and no window; every other launch keeps the 128-row config."""
    cfg, wide = plan.CONFIGS[64], plan.WIDE_CONFIGS[64]

    def varlen_plan(max_q, d_cfg=cfg, window=None, page_size=0, num_splits=1, seqused_k=False):
        return plan._plan_varlen.__wrapped__(0, torch.bfloat16, 16, max_q, 8192, 32, 4, d_cfg, False, seqused_k,
                                             True, True, window=window, page_size=page_size,
                                             num_splits=num_splits)

    long = varlen_plan(plan.WIDE_MIN_ROWS)
    assert long.cfg == wide and long.mode.dynamic
    # The dynamic order's CTAs count the wide items (192 rows of 4 packed heads).
    assert long.n_ctas == min(SMS, plan.work_items(16, 32, plan.WIDE_MIN_ROWS, wide, long.mode))
    assert varlen_plan(plan.WIDE_MIN_ROWS - 1).cfg == cfg
    assert varlen_plan(8192, window=(256, 0)).cfg == cfg
    assert varlen_plan(8192, page_size=256, seqused_k=True).cfg == cfg
    assert varlen_plan(8192, num_splits=4).cfg == cfg
    assert varlen_plan(8192, d_cfg=plan.CONFIGS[128]).cfg == plan.CONFIGS[128]


def test_varlen_splits_skewed_keys_the_item_count_hides():
    """Many short decodes beside one long one (varlen_skew_splits): the
    items fill the SMs, so FA3's rule does not split, but the long decode's
    items would read all of its KV tiles alone; the keys are split into
    pieces about the mean per-SM load. Even keys, a prefill chunk's query
    tiles, a window or unknown totals leave the launch unsplit."""
    cfg = plan.CONFIGS[128]

    def skew(lens_k, max_q=1, window=None, total_k=None):
        total_k = sum(lens_k) if total_k is None else total_k
        return plan.varlen_skew_splits(total_k, len(lens_k), max_q, max(lens_k), 32, 4, cfg, None, window, 0)

    # 64 decodes over 1024 keys + one over 65536: (1024 + 65) tiles x 8 KV heads over 132 SMs, 66 each;
    # the long decode's 512 tiles in 8 pieces.
    assert skew([1024] * 64 + [65536]) == 8
    assert skew([512] * 128 + [131072]) == 11
    assert skew([4096] * 64) == 1  # even keys
    assert skew([1024] * 64 + [65536], max_q=512) == 1  # a chunk's 16 query tiles a sequence: no skew shown
    assert skew([1024] * 64 + [65536], window=(4096, 0)) == 1
    assert skew([1024] * 64 + [65536], total_k=0) == 1  # paged: total unknown
    assert skew([100] * 2 + [2000]) == 1  # 16 KV tiles: too few to split past SKEW_MIN_TILES

    def varlen_plan(skew_splits, num_splits=0, split_entries=0):
        return plan._plan_varlen.__wrapped__(0, torch.bfloat16, 65, 1, 65536, 32, 4, cfg, False, False, True,
                                             False, num_splits=num_splits, total_q=65, skew_splits=skew_splits,
                                             split_entries=split_entries)

    assert not varlen_plan(1).mode.split  # 520 items: FA3's rule leaves the keys whole
    skewed = varlen_plan(8)
    assert skewed.mode.split and skewed.num_splits == 8 and not skewed.mode.split_table
    assert varlen_plan(8, num_splits=1).num_splits == 1  # an explicit count is honoured

    # A split count per sequence (varlen_split_table): the long decode's 512
    # tiles in 8 pieces of 64, each short one whole; 64 + 8 entries fit the
    # bound's 65 + (1024 + 65) // 64 + 1 = 83, rounded up to 96 (a multiple of
    # 16), one CTA per (entry, KV head).
    entries = plan.varlen_split_table(64 * 1024 + 65536, 65, 65536, 8, cfg)
    assert plan.split_table_blocks(65536, 8, cfg) == 64 and entries == 96
    table = varlen_plan(8, split_entries=entries)
    assert table.mode.split and table.mode.split_table and table.num_splits == 8
    assert table.split_entries == 96 and (table.n_ctas, table.pair) == (96 * 8, 1)
    # Only the skew rule's split takes a table: an explicit count splits every sequence alike.
    assert not varlen_plan(8, num_splits=4, split_entries=entries).mode.split_table

    # Past deal_split's waves a table still runs one CTA per item, not the
    # persistent static deal: 128 decodes over 512 keys beside one over
    # 131072 (11 splits, 160 entries x 8 KV heads = 1280 items, 9.7 waves).
    entries = plan.varlen_split_table(128 * 512 + 131072, 129, 131072, 11, cfg)
    assert entries == 160 and entries * 8 > plan.SPLIT_GRID_MAX_WAVES * SMS
    wide = plan._plan_varlen.__wrapped__(0, torch.bfloat16, 129, 1, 131072, 32, 4, cfg, False, False, True, False,
                                         num_splits=0, total_q=129, skew_splits=11, split_entries=entries)
    assert wide.mode.split_table and (wide.n_ctas, wide.pair) == (160 * 8, 1)
    # A uniform split of as many items takes the static deal (deal_split).
    assert plan.deal_split(160 * 8, cfg) == (SMS, 2)
