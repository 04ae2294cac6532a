"""flash_attn_with_kvcache's argument checks and the decode heuristics, on CPU:
every bad argument is a ValueError/TypeError naming it, raised before anything
touches a GPU."""
import pytest
import torch

import hopper_flash
from hopper_flash import plan

bf16 = torch.bfloat16


def args(B=2, Sq=1, H=32, Hkv=8, D=128, S=256):
    return torch.zeros(B, Sq, H, D, dtype=bf16), torch.zeros(B, S, Hkv, D, dtype=bf16), \
        torch.zeros(B, S, Hkv, D, dtype=bf16)


def call(q, kc, vc, *a, **kw):
    return hopper_flash.flash_attn_with_kvcache(q, kc, vc, *a, **kw)


@pytest.mark.parametrize("bad,match", [
    (lambda q, kc, vc: (q[0], kc, vc, {}), "q must have 4 dimensions"),
    (lambda q, kc, vc: (q, kc[0], vc, {}), "k_cache must have 4 dimensions"),
    (lambda q, kc, vc: (q.float(), kc, vc, {}), "q.dtype"),
    (lambda q, kc, vc: (q, kc.half(), vc, {}), "k_cache must have q's dtype"),
    (lambda q, kc, vc: (q, kc, vc[:, :100], {}), "k_cache and v_cache must have the same shape"),
    (lambda q, kc, vc: (q[..., :100], kc[..., :100], vc[..., :100], {}), "head dim"),
    (lambda q, kc, vc: (q[:, :, :30], kc, vc, {}), "multiple of k_cache"),
    (lambda q, kc, vc: (q, kc, vc, dict(cache_seqlens=torch.zeros(2, dtype=torch.int64))), "cache_seqlens must have dtype int32"),
    (lambda q, kc, vc: (q, kc, vc, dict(cache_seqlens=torch.zeros(3, dtype=torch.int32))), "cache_seqlens must have shape"),
    (lambda q, kc, vc: (q, kc, vc, dict(cache_seqlens=1.5)), "cache_seqlens must be an int"),
    (lambda q, kc, vc: (q, kc, vc, dict(cache_seqlens=-1)), "cache_seqlens must be >= 0"),
    (lambda q, kc, vc: (q, kc, vc, dict(page_table=torch.zeros(2, 4, dtype=torch.int64))), "page_table must have dtype int32"),
    (lambda q, kc, vc: (q, kc, vc, dict(page_table=torch.zeros(3, 4, dtype=torch.int32))), "page_table must have shape"),
    (lambda q, kc, vc: (q, kc[:, :100], vc[:, :100], dict(page_table=torch.zeros(2, 4, dtype=torch.int32))), "page size"),
    (lambda q, kc, vc: (q, kc, vc, dict(page_table=torch.zeros(2, 4, dtype=torch.int32),
                                        block_table=torch.zeros(2, 4, dtype=torch.int32))), "not both"),
    (lambda q, kc, vc: (q, kc, vc, dict(cache_batch_idx=torch.zeros(2, dtype=torch.int64))), "cache_batch_idx must have dtype int32"),
    (lambda q, kc, vc: (q, kc, vc, dict(k=torch.zeros(2, 1, 8, 128, dtype=bf16))), "k and v must be given together"),
    (lambda q, kc, vc: (q, kc, vc, dict(k=torch.zeros(2, 1, 4, 128, dtype=bf16), v=torch.zeros(2, 1, 4, 128, dtype=bf16))), "k must have shape"),
    (lambda q, kc, vc: (q, kc, vc, dict(num_splits=-1)), "num_splits"),
    (lambda q, kc, vc: (q, kc, vc, dict(pack_gqa=1)), "pack_gqa"),
    (lambda q, kc, vc: (q, kc, vc, dict(causal=1)), "causal"),
    (lambda q, kc, vc: (q, kc, vc, dict(softmax_scale=-1.0)), "softmax_scale"),
    (lambda q, kc, vc: (q, kc, vc, dict(window_size=(4,))), "window_size must be a pair of ints"),
    (lambda q, kc, vc: (q, kc, vc, dict(window_size=(-2, 0))), "window_size entries must be >= 0"),
])
def test_bad_arguments_name_themselves(bad, match):
    q, kc, vc, kw = bad(*args())
    k, v = kw.pop("k", None), kw.pop("v", None)
    with pytest.raises((ValueError, TypeError), match=match):
        call(q, kc, vc, k, v, **kw)


def _rot(rows=256, half=64, dtype=bf16):
    return torch.zeros(rows, half, dtype=dtype), torch.zeros(rows, half, dtype=dtype)


NEW = dict(k=torch.zeros(2, 1, 8, 128, dtype=bf16), v=torch.zeros(2, 1, 8, 128, dtype=bf16))


@pytest.mark.parametrize("kw,error,match", [
    (dict(NEW, rotary_cos=_rot()[0]), ValueError, "rotary_cos and rotary_sin must be given together"),
    (dict(NEW, rotary_sin=_rot()[1]), ValueError, "rotary_cos and rotary_sin must be given together"),
    (dict(rotary_cos=_rot()[0], rotary_sin=_rot()[1]), ValueError, "rotary_cos/rotary_sin need the new keys k and v"),
    (dict(NEW, rotary_cos=_rot()[0][None], rotary_sin=_rot()[1][None]), ValueError,
     r"rotary_cos must have 2 dimensions \[seqlen_ro, rotary_dim / 2\]"),
    (dict(NEW, rotary_cos=[[1.0]], rotary_sin=_rot()[1]), TypeError, "rotary_cos must be a torch.Tensor"),
    (dict(NEW, rotary_cos=_rot()[0], rotary_sin=_rot(dtype=torch.float16)[1]), ValueError,
     "rotary_sin must have q's dtype bfloat16 or float32, got float16"),
    (dict(NEW, rotary_cos=_rot()[0], rotary_sin=_rot(half=32)[1]), ValueError,
     "rotary_cos and rotary_sin must have the same shape"),
    (dict(NEW, rotary_cos=_rot(half=65)[0], rotary_sin=_rot(half=65)[1]), ValueError,
     r"rotary_cos.shape\[1\] \(rotary_dim / 2\) must lie in \[1, 64\]"),
    (dict(NEW, rotary_cos=_rot(half=0)[0], rotary_sin=_rot(half=0)[1]), ValueError, r"rotary_cos.shape\[1\]"),
    (dict(NEW, rotary_cos=_rot(rows=255)[0], rotary_sin=_rot(rows=255)[1]), ValueError,
     r"rotary_cos must have at least the cache's capacity \(256\) rows"),
    (dict(NEW, rotary_cos=_rot()[0], rotary_sin=_rot()[1], rotary_interleaved=1), TypeError,
     "rotary_interleaved must be a bool"),
    (dict(alibi_slopes=torch.zeros(32)), NotImplementedError, "alibi_slopes must be None"),
], ids=["cos-alone", "sin-alone", "no-append", "rank", "not-a-tensor", "dtype", "shapes-differ", "wider-than-head",
        "empty", "short-table", "interleaved-int", "alibi"])
def test_rotary_and_flash_attn_options_name_themselves(kw, error, match):
    """flash-attn's rotary arguments are checked by name before anything
    touches a GPU (or the caches); alibi_slopes is accepted only as None
    (cache_leftpad's checks: test_leftpad_cpu.py)."""
    q, kc, vc = args()
    with pytest.raises(error, match=match):
        call(q, kc, vc, cache_seqlens=10, **kw)


def test_rotary_capacity_counts_pages():
    """A paged cache's capacity is max_pages * page_size: the rotary tables
    must cover it, as flash-attn requires."""
    q = torch.zeros(2, 1, 32, 128, dtype=bf16)
    kc = vc = torch.zeros(16, 64, 8, 128, dtype=bf16)
    pt = torch.zeros(2, 4, dtype=torch.int32)
    cos, sin = _rot(rows=255)
    with pytest.raises(ValueError, match=r"capacity \(256\)"):
        call(q, kc, vc, rotary_cos=cos, rotary_sin=sin, cache_seqlens=10, page_table=pt, **NEW)
    cos, sin = _rot(rows=256)
    with pytest.raises(ValueError, match="CUDA"):  # past the rotary checks, to the device's
        call(q, kc, vc, rotary_cos=cos, rotary_sin=sin, cache_seqlens=10, page_table=pt, **NEW)


def test_cpu_tensors_are_refused():
    q, kc, vc = args()
    with pytest.raises(ValueError, match="CUDA"):
        call(q, kc, vc, cache_seqlens=10)


def test_split_heuristic_follows_wave_efficiency():
    # FA3's rule: no split once the items nearly fill the GPU or the keys are few.
    assert plan.choose_num_splits(tiles=128, n_blocks=64, sms=132) == 1
    assert plan.choose_num_splits(tiles=8, n_blocks=4, sms=132) == 1
    # B=8, Hkv=8, one packed tile each: 64 items -> 2 splits fill 128 of 132 SMs.
    assert plan.choose_num_splits(tiles=64, n_blocks=128, sms=132) == 2
    # B=1: 8 items -> within 0.85 of the best wave efficiency (FA3's rule: 15
    # splits on 120 SMs), then as full a single wave as keeps 16 KV tiles a
    # split: 16 splits on 128 SMs at 512 tiles, FA3's 15 at 128 tiles.
    assert plan.choose_num_splits(tiles=8, n_blocks=512, sms=132) == 16
    assert plan.choose_num_splits(tiles=8, n_blocks=128, sms=132) == 15
    # One item: FA3's rule (109 splits) unless the keys fill 128 splits of 16 tiles.
    assert plan.choose_num_splits(tiles=1, n_blocks=512, sms=132) == 109
    assert plan.choose_num_splits(tiles=1, n_blocks=2048, sms=132) == 128
    # 20 items: 6 splits (120 CTAs) is already the fullest single wave.
    assert plan.choose_num_splits(tiles=20, n_blocks=512, sms=132) == 6
    # Past one wave the rule is FA3's: 50 items -> 5 splits (1.9 waves).
    assert plan.choose_num_splits(tiles=50, n_blocks=512, sms=132) == 5


def test_a_window_bounds_the_tiles_the_split_heuristic_divides():
    cfg = plan.CONFIGS[128]
    # One query row, a 4096-key window: 33 tiles of 128 keys at most (an unaligned window straddles one more).
    assert plan.window_tiles(4095, 0, 1, cfg) == 33
    # A 128-row chunk adds its rows; a right side adds its keys.
    assert plan.window_tiles(4095, 0, 1000, cfg) == 34
    assert plan.window_tiles(100, 300, 4, cfg) == 5
    # B=1 decode at 65536 keys: the window's 33 tiles, not the cache's 512, are split.
    assert plan.choose_num_splits(tiles=8, n_blocks=33, sms=132) <= 33


def test_pack_gqa_heuristic():
    assert plan.choose_pack_gqa(1, 4) and plan.choose_pack_gqa(4, 8)
    assert not plan.choose_pack_gqa(4096, 4)  # full tiles either way
    assert not plan.choose_pack_gqa(1, 1)  # MHA
    assert plan.choose_pack_gqa(1, 3) and plan.choose_pack_gqa(1, 128)  # any group (a packed view past the box)
    assert plan.choose_pack_gqa(48, 5) and not plan.choose_pack_gqa(128, 5)  # 240 rows fill 2 tiles; 128 fill 1


def test_packed_q_is_the_kernels_packed_view():
    """plan.packed_q: row s * g + j of KV head hk is query s of head hk * g + j,
    q itself at one query per row (no copy)."""
    q = torch.randn(3, 7, 40, 16)
    view = plan.packed_q(q, 5)
    assert view.shape == (3, 35, 8, 16)
    for b, s, h in ((0, 0, 0), (1, 3, 17), (2, 6, 39), (2, 5, 4)):
        assert torch.equal(view[b, s * 5 + h % 5, h // 5], q[b, s, h])
    one = torch.randn(4, 1, 28, 64)
    view = plan.packed_q(one, 7)
    assert view.data_ptr() == one.data_ptr() and view.stride() == (28 * 64, 64, 7 * 64, 1)
    assert torch.equal(view[3, 6, 2], one[3, 0, 2 * 7 + 6])
    wide = torch.randn(2, 1, 28 + 12, 64)[:, :, 5:33]  # q a slice of a fused projection's heads
    view = plan.packed_q(wide, 7)
    assert view.shape == (2, 7, 4, 64) and view.data_ptr() == wide.data_ptr()
    for b, h in ((0, 0), (1, 27), (1, 9)):
        assert torch.equal(view[b, h % 7, h // 7], wide[b, 0, h])
    assert plan.kernel_q(q, plan.Mode(pack_g=4)) is q and plan.kernel_q(q, plan.Mode()) is q
    # A packed batch with one query per sequence, by token: [total_q, g, Hkv, D], no copy.
    thd = torch.randn(9, 40, 16)
    tokens = plan.kernel_q(thd.unsqueeze(0), plan.Mode(pack_g=5, pack_view=True, q_tokens=True, varlen=True))
    assert tokens.shape == (9, 5, 8, 16) and tokens.data_ptr() == thd.data_ptr()
    assert torch.equal(tokens[7, 3, 6], thd[7, 6 * 5 + 3])


def test_groups_not_powers_of_two_pack_from_a_packed_view(monkeypatch):
    """A group that is no power of two dividing 64 packs from q packed by
    the host (plan.Mode.pack_view) where the fill rule packs, O can be stored
    by address and the head dim is 64 or 128; the items run over the KV
    heads, whose query rows the packed view holds undivided."""
    monkeypatch.setattr(plan, "sm_count", lambda device=None: 132)
    plan_of = plan._plan_launch.__wrapped__
    cfg = plan.CONFIGS[128]

    def mode(seqlen_q=1, nheads=40, nheads_kv=8, by_address=True, cfg=cfg, pack_gqa=None, batch=4):
        lp = plan_of(0, torch.bfloat16, batch, seqlen_q, nheads, nheads_kv, 32, cfg, 0, True, False, 1, pack_gqa,
                     True, False, None, False, "", False, by_address)
        return lp.mode

    assert (mode().pack_g, mode().pack_view) == (5, True)
    assert plan.work_items(4, 40, 1, cfg, mode()) == 4 * 8  # one item per (batch, KV head)
    assert plan.work_items(4, 40, 48, cfg, mode(seqlen_q=48)) == 4 * 8 * 2  # 240 packed rows: 2 tiles, not 3
    assert (mode(nheads=28, nheads_kv=4).pack_g, mode(nheads=28, nheads_kv=4).pack_view) == (7, True)
    assert (mode(nheads=5, nheads_kv=1).pack_g, mode(nheads=128, nheads_kv=1).pack_g) == (5, 128)
    assert (mode(nheads=32).pack_g, mode(nheads=32).pack_view) == (4, False)  # a power of two: the box packs it
    assert mode(by_address=False).pack_g == 1  # O not storable by address (a narrower v, a strided out)
    assert mode(cfg=plan.CONFIGS[256]).pack_g == 1  # head dim 256's view spilled (plan.VIEW_HEAD_DIMS)
    assert mode(seqlen_q=128).pack_g == 1  # full tiles either way
    assert mode(pack_gqa=True, seqlen_q=128).pack_view  # asked for
    assert mode(pack_gqa=False).pack_g == 1
    constexprs = plan.kernel_constexprs(cfg, True, False, mode())
    assert constexprs["PACK_G"] == 5 and constexprs["PACK_VIEW"] is True
    assert plan.kernel_constexprs(cfg, True, False, mode(nheads=32))["PACK_VIEW"] is False
    assert plan.block_shapes(cfg, mode().box_g)["q"] == [1, 64, 1, 128]
    assert plan.block_shapes(cfg, mode(nheads=32).box_g)["q"] == [1, 16, 4, 128]


def test_grid_deals_singly_below_two_items_per_sm(monkeypatch):
    monkeypatch.setattr(plan, "sm_count", lambda device=None: 132)
    cfg = plan.CONFIGS[128]
    assert plan.deal(128, cfg) == (128, 1)  # the 128 items: every SM busy, not 64
    assert plan.deal(132, cfg) == (132, 1)
    assert plan.deal(200, cfg) == (100, 2)  # above one per SM: balanced zig-zag pairs
    assert plan.deal(264, cfg) == (132, 2)
    assert plan.deal(1000, cfg) == (132, 2)


def test_a_window_reaches_the_device_check():
    q, kc, vc = args()
    with pytest.raises(ValueError, match="CUDA"):
        call(q, kc, vc, cache_seqlens=10, causal=True, window_size=(4, 0))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_pages_of_16_keys_and_more_are_read_by_tma_on_the_contiguous_tiles(head_dim):
    """Which paged caches the kernel reads in place (cache_layout.page_plan) and
    with what TMA box (plan.block_shapes): whole tiles for pages of a tile or
    more, one page per box for 16 keys up to half a tile, and a gathered
    copy below 16."""
    from hopper_flash import cache_layout

    cfg = plan.CONFIGS[head_dim]
    tile = {64: 128, 128: 128, 256: 64}[head_dim]  # the configs' KV tile (plan.CONFIGS)
    box_rows = {16: 16, 32: 32, 64: 64, 128: tile, 256: tile, 512: tile}  # a page, or a whole tile
    for page_size in (1, 2, 4, 8):
        assert not cache_layout.page_plan(page_size, head_dim), page_size  # (no pools: by TMA only)
        # Gathered in the kernel from contiguous pools at head dims 64 and 128,
        # copied first from strided ones (and at 256).
        pool = torch.empty(3, page_size, 2, head_dim)
        assert cache_layout.page_plan(page_size, head_dim, pool, pool) == (head_dim <= 128), (page_size, head_dim)
        assert not cache_layout.page_plan(page_size, head_dim, pool[:, :, :1], pool[:, :, :1])
        assert plan.block_shapes(cfg, 1, page_size)["k"] == [1, tile if head_dim <= 128 else page_size, 1, head_dim]
    for page_size, rows in box_rows.items():
        assert cache_layout.page_plan(page_size, head_dim), page_size
        boxes = plan.block_shapes(cfg, 1, page_size)
        assert boxes["k"] == boxes["v"] == [1, rows, 1, head_dim], page_size
    assert plan.block_shapes(cfg)["k"] == [1, tile, 1, head_dim]  # contiguous caches: one box per tile


def test_pages_of_16_keys_move_registers_to_the_producer():
    # Eight page boxes per tile spilled the producer's 24 registers; pages of
    # 16 keys take 8 from each consumer warpgroup for it (16 more), so the
    # launch's register file is shared out as before: 2 x 240 + 24 = 2 x 232 + 40.
    cfg = plan.CONFIGS[128]
    regs = {ps: plan.register_split(cfg, plan.Mode(pack_g=4, seqused=True, page_size=ps)) for ps in (16, 32, 128)}
    assert regs == {16: (232, 40), 32: (240, 24), 128: (240, 24)}
    assert plan.register_split(cfg) == (240, 24)
    consts = plan.kernel_constexprs(cfg, True, False, plan.Mode(pack_g=4, seqused=True, page_size=16))
    assert (consts["CONSUMER_REGS"], consts["PRODUCER_REGS"]) == (232, 40)


def test_host_and_kernel_agree_on_page_and_row_constants():
    """plan.py keeps clear of the kernels' module, so it restates two of
    their constants: the smallest page read by TMA (smaller ones are
    gathered) and the rows per consumer warpgroup. They must not drift."""
    from hopper_flash.kernels import forward

    assert plan.GATHER_PAGE == forward.GATHER_MIN_PAGE.value
    assert plan.WG_ROWS == forward.WG_M.value


def test_launch_forward_refuses_gathered_pages_from_strided_pools():
    """The gathering kernel reads pool rows as if the pools were contiguous;
    kvcache copies strided pools first, and plan.launch_forward (its own
    entry point) refuses them rather than read the wrong rows."""
    q = torch.randn(1, 1, 4, 128, dtype=torch.bfloat16)
    pool = torch.randn(3, 8, 4, 128, dtype=torch.bfloat16)[:, :, :2]  # a slice of a wider pool
    table = torch.zeros(1, 3, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous k and v"):
        plan.launch_forward(q, pool, pool, torch.empty_like(q), None, 1.0, True, seqused_k=lens, page_table=table)
