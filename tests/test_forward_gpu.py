"""The forward kernel on a Hopper GPU against the float64 reference.

Every check draws fresh random inputs, writes into an output poisoned with NaN
and framed by guard memory, and is judged by ``hopper_flash.reference.judge``:
at most twice the error of PyTorch SDPA's cuDNN backend on the same inputs
(its efficient/math backends with the same mask where cuDNN cannot express the
problem: bottom-right causal with unequal lengths, GQA), in relative
Frobenius norm, max-abs error and worst row, plus a small floor; the LSE to
``LSE_REL_TOL`` relative.
"""
import math

import pytest
import torch

import hopper_flash
from hopper_flash import dispatch, plan
from hopper_flash.reference import check_attention, random_qkv

pytestmark = pytest.mark.gpu

GUARD = 4096  # elements of sentinel before and after the output
SENTINEL = 12345.0


def make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype=torch.bfloat16, seed=0, magnitude=1.0):
    return random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype=dtype, seed=seed,
                      magnitude=magnitude)


def guarded_out(q):
    """An output view framed by sentinel guard regions, its body poisoned with NaN."""
    n = q.numel()
    buf = torch.full((n + 2 * GUARD, ), SENTINEL, dtype=q.dtype, device=q.device)
    buf[GUARD:GUARD + n] = float("nan")
    return buf, buf[GUARD:GUARD + n].view(q.shape)


def assert_guards_intact(buf, n):
    assert (buf[:GUARD] == SENTINEL).all(), "kernel wrote before the output"
    assert (buf[GUARD + n:] == SENTINEL).all(), "kernel wrote past the output"


def assert_attention_correct(q, k, v, out, lse=None, *, causal, scale=None, what="out"):
    """``out`` (and ``lse``) of the problem (q, k, v) judged against the
    float64 reference relative to SDPA's error on the same inputs."""
    failed = [v.message for v in check_attention(out, q, k, v, causal=causal, softmax_scale=scale, lse=lse,
                                                 name=what) if not v]
    assert not failed, "\n".join(failed)


def check_forward(batch, seqlen_q, seqlen_k, nheads, nheads_kv=None, head_dim=128, causal=True,
                  dtype=torch.bfloat16, scale=None, seed=0):
    nheads_kv = nheads_kv or nheads
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, dtype, seed)
    buf, out = guarded_out(q)
    out, lse = dispatch.forward(q, k, v, scale, causal, True, out=out)
    assert_guards_intact(buf, q.numel())
    assert_attention_correct(q, k, v, out, lse, causal=causal, scale=scale)
    return out, lse


SEQLENS = [1, 2, 63, 64, 65, 127, 128, 129, 255, 256, 1000, 2048, 4099]


@pytest.mark.parametrize("seqlen", SEQLENS)
@pytest.mark.parametrize("nheads", [1, 4, 32])
@pytest.mark.parametrize("batch", [1, 3])
def test_causal_bf16_d128(batch, nheads, seqlen):
    check_forward(batch, seqlen, seqlen, nheads, causal=True, seed=batch * 100003 + nheads * 101 + seqlen)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_persistent_odd_item_count(head_dim, causal):
    # 61 query tiles x 5 heads = 305 work items: more than two per SM, so
    # persistent CTAs loop, and odd, so one CTA's last pair is a single item
    # (non-causal; causal draws them in the dynamic order).
    seqlen = 60 * 128 + 1
    assert (plan.triton_cdiv(seqlen, 128) * 5) % 2 == 1
    check_forward(1, seqlen, seqlen, 5, head_dim=head_dim, causal=causal, seed=head_dim + causal)


def test_static_deal_odd_item_count():
    # 7 query tiles x 25 heads = 175 items, dealt statically in zig-zag pairs,
    # the last one single. Non-causal: causal odd counts straddle heads and
    # take the dynamic order (plan.static_deal_imbalance).
    seqlen = 6 * 128 + 1
    items = plan.work_items(1, 25, seqlen, plan.CONFIGS[128])
    assert items % 2 == 1 and not plan.choose_dynamic(items, 7, False, False, plan.sm_count())
    check_forward(1, seqlen, seqlen, 25, causal=False, seed=175)


def test_short_causal_prefill_unevenly_dealt_takes_the_dynamic_order():
    # 11 query tiles x 32 heads x 2: odd, so the static deal's pairs would straddle heads.
    seqlen = 10 * 128 + 77
    items = plan.work_items(2, 32, seqlen, plan.CONFIGS[128])
    assert plan.choose_dynamic(items, 11, True, False, plan.sm_count())
    check_forward(2, seqlen, seqlen, 32, causal=True, seed=1357)


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,nheads,nheads_kv,head_dim", [
    (3, 3001, 3001, 5, 5, 128),        # 15 heads: one L2 section, partly filled
    (1, 16384, 16384, 12, 12, 128),    # three sections of 4 heads
    (2, 2100, 3001, 8, 2, 128),        # more keys than queries; GQA sections
    (2, 3001, 2100, 8, 8, 128),        # more queries than keys: rows that see no key
    (2, 3073, 3073, 9, 9, 64),         # D=64: 25 tiles of 128 rows
    (1, 4099, 4099, 6, 3, 256),
])
def test_dynamic_order(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim):
    """Causal prefill whose items come from the counter (scheduler.py): every
    item runs exactly once (a skipped one leaves the output's NaN poison)."""
    cfg = plan.CONFIGS[head_dim]
    items = plan.work_items(batch, nheads, seqlen_q, cfg)
    assert plan.choose_dynamic(items, plan.triton_cdiv(seqlen_q, cfg.block_m), True, False, plan.sm_count())
    check_forward(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim=head_dim, causal=True,
                  seed=seqlen_q + 3 * seqlen_k + head_dim)


@pytest.mark.parametrize("batch,seqlen,nheads,nheads_kv", [(4, 2048, 32, 8), (2, 3001, 16, 16)])
def test_dynamic_order_is_deterministic(batch, seqlen, nheads, nheads_kv):
    """Which CTA draws an item varies run to run; what the item computes does
    not, and every call runs every item. Each call writes into an output
    poisoned with NaN: a fresh ``torch.empty`` would usually get the last
    call's block back from the caching allocator, where an item skipped by
    a lost draw would leave correct values behind."""
    q, k, v = make_qkv(batch, seqlen, seqlen, nheads, nheads_kv, 128, seed=11 + seqlen)
    assert plan.choose_dynamic(plan.work_items(batch, nheads, seqlen, plan.CONFIGS[128]),
                               plan.triton_cdiv(seqlen, plan.CONFIGS[128].block_m), True, False, plan.sm_count())
    first = [t.clone() for t in dispatch.forward(q, k, v, None, True, True, out=guarded_out(q)[1])]
    assert_attention_correct(q, k, v, *first, causal=True)
    for _ in range(20):
        again = dispatch.forward(q, k, v, None, True, True, out=guarded_out(q)[1])
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.parametrize("seqlen", [1, 63, 128, 129, 1000, 4099])
@pytest.mark.parametrize("batch,nheads", [(1, 1), (3, 4)])
def test_noncausal_bf16_d128(batch, nheads, seqlen):
    check_forward(batch, seqlen, seqlen, nheads, causal=False, seed=seqlen + 7)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(100, 300), (300, 100), (129, 1), (1, 129), (128, 1000),
                                               (1000, 128), (777, 2049), (2049, 777)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_unequal_lengths(seqlen_q, seqlen_k, causal):
    check_forward(2, seqlen_q, seqlen_k, 4, causal=causal, seed=seqlen_q * 7 + seqlen_k)


@pytest.mark.parametrize("nheads,nheads_kv", [(32, 8), (8, 1), (6, 2)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gqa(nheads, nheads_kv, causal):
    check_forward(2, 513, 513, nheads, nheads_kv, causal=causal, seed=nheads * 31 + nheads_kv)


@pytest.mark.parametrize("scale", [0.05, 0.3])
def test_custom_scale(scale):
    check_forward(2, 300, 300, 4, causal=True, scale=scale, seed=int(scale * 1000))


def test_deterministic():
    q, k, v = make_qkv(3, 1000, 1000, 8, 8, 128, seed=5)
    a, lse_a = hopper_flash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    b, lse_b = hopper_flash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.equal(a, b) and torch.equal(lse_a, lse_b)


@pytest.mark.parametrize("head_dim,causal", [(64, False), (128, True), (128, False), (256, True), (256, False)])
def test_error_is_cudnns(head_dim, causal):
    """The judge lets a result err up to twice SDPA cuDNN's error; the kernel
    makes the same error as cuDNN (and FA3): the exact running max and FA3's
    order of operations. Over 8M outputs the relative Frobenius error is a
    stable statistic (ours and cuDNN's differ by under 0.5% on the bench
    rows), so it must stay within 1% of cuDNN's on the same inputs. FA4's
    lazy rescale (a stale reference max; ``git show 4328e42:scripts/
    variants/fwd-lazy-rescale.patch``) passes the judge but not this: 2-4%
    larger (BENCHMARKS.md, fifteenth session)."""
    q, k, v = make_qkv(2, 2048, 2048, 16, 16, head_dim, seed=head_dim + causal)
    out = hopper_flash.flash_attn_func(q, k, v, causal=causal)
    (verdict,) = check_attention(out, q, k, v, causal=causal)
    assert verdict, verdict.message
    assert verdict.rel_fro <= 1.01 * verdict.baseline_rel_fro, verdict.message


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_lone_row_max_moves_on_the_last_tile(head_dim, causal):
    """A row whose maximum jumps on the last KV tile visited (tile 0) while
    the rows around it keep theirs: the output must be rescaled for that row
    alone. Head ``h`` picks rows ``64 + 16 m + h`` (one row in each 16-row
    group, the rows of one warp in the wgmma layout; over 16 heads every
    position in a warp's rows), and key ``m`` becomes 10 times that row's
    query direction: the row's scaled score there is ~10 against at most ~4
    elsewhere (its output follows that key's value), while another row's
    score with it stays ~N(0, 100 / head_dim), so those rarely move."""
    nheads, seqlen = 16, 2048
    q, k, v = make_qkv(1, seqlen, seqlen, nheads, nheads, head_dim, seed=7 * head_dim + causal)
    for h in range(nheads):
        for m in range(8):
            row = 64 + 16 * m + h
            k[0, m, h] = (10.0 * q[0, row, h].float() / q[0, row, h].float().norm()).to(k.dtype)
    buf, out = guarded_out(q)
    out, lse = dispatch.forward(q, k, v, None, causal, True, out=out)
    assert_guards_intact(buf, q.numel())
    assert_attention_correct(q, k, v, out, lse, causal=causal)


def test_large_magnitude_is_finite():
    # q.k up to ~1e4 before scaling: the exp2 argument stays <= 0, no overflow.
    q, k, v = make_qkv(2, 1000, 1000, 4, 4, 128, seed=9, magnitude=30.0)
    s = torch.einsum("bqhd,bkhd->bhqk", q[:1, :64].float(), k[:1].float())
    assert s.abs().max() > 1e3
    out, lse = hopper_flash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.isfinite(out).all()
    assert_attention_correct(q, k, v, out, lse, causal=True)


def test_packed_qkv_views_need_no_copy():
    b, s, h, d = 2, 300, 4, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(dim=2)
    assert not q.is_contiguous()
    out = hopper_flash.flash_attn_func(q, k, v, causal=True)
    assert_attention_correct(q, k, v, out, causal=True)


def test_bhsd_transposed_views():
    # A [B, H, S, D] tensor viewed as BSHD has head stride S*D: still TMA-addressable.
    b, s, h, d = 2, 257, 4, 128
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    out = hopper_flash.flash_attn_func(q, k, v, causal=True)
    assert_attention_correct(q, k, v, out, causal=True)


def test_zero_length_kv_gives_zeros():
    q = torch.randn(1, 5, 2, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 0, 2, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = hopper_flash.flash_attn_func(q, k, k, causal=False, return_lse=True)
    assert (out == 0).all() and (lse == -math.inf).all()


def test_empty_batch():
    q = torch.randn(0, 5, 2, 128, device="cuda", dtype=torch.bfloat16)
    out = hopper_flash.flash_attn_func(q, q, q, causal=True)
    assert out.shape == q.shape


def test_misaligned_pointer_is_rejected():
    base = torch.randn(2 * 64 * 2 * 128 + 1, device="cuda", dtype=torch.bfloat16)
    q = base[1:].view(2, 64, 2, 128)
    with pytest.raises(ValueError, match="q's data pointer must be 16-byte aligned"):
        hopper_flash.flash_attn_func(q, q, q, causal=True)


# ---- Head dims 64 and 256, fp16, and their combinations with the other axes.

@pytest.mark.parametrize("seqlen", [1, 65, 129, 1000, 2049])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_head_dims(head_dim, causal, seqlen):
    check_forward(2, seqlen, seqlen, 4, head_dim=head_dim, causal=causal, seed=head_dim + seqlen)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(191, 191), (192, 192), (193, 193), (385, 385), (577, 577),
                                               (200, 700), (700, 200), (64, 320), (130, 194), (250, 315),
                                               (193, 320), (385, 513), (577, 640), (1000, 1063)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_head_dim_64_tile_edges(wide_tiles, causal, seqlen_q, seqlen_k):
    """The wide tiles, 64 rows per consumer warpgroup: lengths at the edges
    of a tile and of each consumer's rows, and diagonals that leave one or two
    consumers' first KV tiles entirely masked (those warpgroups pass them
    unread: ``OWN_DIAGONAL``), at offsets ``seqlen_k - seqlen_q`` of 0, 63,
    64, 65, 127 and 128 keys."""
    check_forward(2, seqlen_q, seqlen_k, 3, head_dim=64, causal=causal, seed=seqlen_q * 7 + seqlen_k)
    assert wide_tiles == [192]


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,nheads,nheads_kv,dtype", [
    (2, 3073, 3073, 9, 9, torch.bfloat16),     # 17 tiles of 192 rows: the dynamic order
    (1, 1000, 1000, 3, 3, torch.bfloat16),     # 18 items, fewer than the SMs: the static deal
    (2, 1500, 2500, 8, 2, torch.float16),      # GQA, more keys than queries
    (2, 2500, 1500, 8, 1, torch.bfloat16),     # MQA, rows that see no key
])
def test_wide_tiles_causal_orders(wide_tiles, batch, seqlen_q, seqlen_k, nheads, nheads_kv, dtype):
    check_forward(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim=64, causal=True, dtype=dtype,
                  seed=seqlen_q + seqlen_k)
    assert wide_tiles == [192]


# Enough heads that no split-KV is chosen (a decode mode, on two consumers).
@pytest.mark.parametrize("seqlen,causal,nheads,rows", [(2100, False, 40, 192), (1000, False, 40, 128),
                                                       (8200, True, 2, 192), (4100, True, 8, 128)])
def test_head_dim_64_takes_the_wide_tiles_for_long_prefill(planned_rows, seqlen, causal, rows, nheads):
    """The shipped rule (plan.choose_wide) end to end, wide tiles or not."""
    if not plan.WIDE_CONFIGS:
        pytest.skip("no wide tiles under this triton (plan.wide_configs)")
    seen = planned_rows
    check_forward(1, seqlen, seqlen, nheads, head_dim=64, causal=causal, seed=seqlen + causal)
    assert seen == [rows]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fp16(head_dim, causal):
    check_forward(2, 777, 777, 4, head_dim=head_dim, causal=causal, dtype=torch.float16, seed=head_dim)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(100, 300), (300, 100), (1, 129), (129, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_head_dims_unequal_gqa(head_dim, dtype, seqlen_q, seqlen_k):
    check_forward(2, seqlen_q, seqlen_k, 8, 2, head_dim=head_dim, causal=True, dtype=dtype,
                  seed=seqlen_q * 3 + seqlen_k)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_head_dims_deterministic(head_dim):
    q, k, v = make_qkv(2, 1000, 1000, 4, 4, head_dim, seed=11)
    a = hopper_flash.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(a, hopper_flash.flash_attn_func(q, k, v, causal=True))
