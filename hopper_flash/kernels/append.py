"""The KV cache's append, with rotary embedding on the way.

``flash_attn_with_kvcache(q, k_cache, v_cache, k, v, ...)`` writes the new
keys and values ``k``, ``v`` ``[B, S_new, Hkv, D]`` (v's head dim may differ:
``head_dim_v``) into the caches at each
row's live length: token ``j`` of batch entry ``b`` goes to cache position
``pos = cache_seqlens[b] + j``, in cache row ``cache_batch_idx[b]`` (or
``b``), or, paged, in page ``page_table[b, pos // page_size]`` at row
``pos % page_size``. One program per (token, block of heads) copies the
token's heads of K and V.

Rotary embedding (``ROTARY``, flash-attn's ``rotary_cos``/``rotary_sin``
``[seqlen_ro, rotary_dim / 2]``): the first ``rotary_dim`` features of each
new key are rotated at its cache position before they are written, and the
queries are rotated into a new tensor the attention then reads. Query row
``i`` of batch entry ``b`` sits at position ``cache_seqlens[b] + i`` under a
causal or local mask (``Q_POS_STEP``) and at ``cache_seqlens[b]`` otherwise,
as in flash-attn. Pairs are features ``(2t, 2t + 1)`` (``INTERLEAVED``,
GPT-J) or ``(t, t + rotary_dim / 2)`` (GPT-NeoX); feature ``d`` of pair
``t`` becomes

    x[d] * cos[pos, t] - x[partner] * sin[pos, t]   (first of its pair)
    x[d] * cos[pos, t] + x[partner] * sin[pos, t]   (second of its pair)

in float32, then one rounding to the tensor's dtype. Features from
``rotary_dim`` on are copied as they are. The programs past the keys' rows
(``ROTARY`` only) each rotate one query token's heads.

The lengths after the append (``SEQUSED_OUT``): the program of each batch
entry's first new token writes ``cache_seqlens[b] + S_new`` to
``seqused_ptr``, the vector the attention then reads, so a decode step with
an append runs two kernels of its own (this one and the attention's) rather
than three (a torch add between them).

Plain Triton: a decode step appends a handful of tokens, so the kernel is
one launch in place of the indexed writes' several and need only be simple
and correct. Positions, pages and rows are the caller's contract
(``kvcache.py``); a position past ``rotary_cos``'s last row reads the last
row (no read out of bounds; flash-attn requires ``seqlen_ro`` to cover the
cache).
"""
import triton
import triton.language as tl


@triton.jit
def _rotated(row_ptr, live, x, pos, cos_ptr, sin_ptr, stride_ro, seqlen_ro, rotary_half,
             HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """``x`` [BLOCK_H, HEAD_DIM], loaded from the pointers ``row_ptr`` where
    ``live``, rotated at position ``pos``, in float32."""
    d = tl.arange(0, HEAD_DIM)
    rotary_dim = 2 * rotary_half
    if INTERLEAVED:
        pair = d // 2
        partner = d ^ 1
        first = (d % 2) == 0
    else:
        pair = tl.where(d < rotary_half, d, d - rotary_half)
        partner = tl.where(d < rotary_half, d + rotary_half, d - rotary_half)
        first = d < rotary_half
    rotated = d < rotary_dim
    pair = tl.where(rotated, pair, 0)
    partner = tl.where(rotated, partner, d)
    at = tl.minimum(pos, seqlen_ro - 1).to(tl.int64) * stride_ro
    cos = tl.load(cos_ptr + at + pair, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + at + pair, mask=rotated, other=0.0).to(tl.float32)
    sin = tl.where(first, -sin, sin)
    # The partner features: the same row read again at the partner's offset
    # (an L1 hit), instead of a shuffle across the tile.
    x_partner = tl.load(row_ptr + (partner - d)[None, :], mask=live).to(tl.float32)
    return x.to(tl.float32) * cos[None, :] + x_partner * sin[None, :]


@triton.jit(do_not_specialize=["batch", "s_new", "seqlen_q", "n_kv_heads", "n_heads", "head_dim", "head_dim_v",
                               "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh",
                               "stride_cb", "stride_cs", "stride_ch", "stride_db", "stride_ds", "stride_dh",
                               "stride_pt", "page_size",
                               "stride_qb", "stride_qs", "stride_qh", "stride_ob", "stride_os", "stride_oh",
                               "stride_ro", "seqlen_ro", "rotary_half"])
def append_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, seqlens_ptr, batch_idx_ptr, page_table_ptr,
                  seqused_ptr, q_ptr, q_out_ptr, cos_ptr, sin_ptr,
                  batch, s_new, seqlen_q, n_kv_heads, n_heads, head_dim, head_dim_v,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  stride_cb, stride_cs, stride_ch, stride_db, stride_ds, stride_dh,
                  stride_pt, page_size,
                  stride_qb, stride_qs, stride_qh, stride_ob, stride_os, stride_oh,
                  stride_ro, seqlen_ro, rotary_half,
                  HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, PAGED: tl.constexpr, BATCH_IDX: tl.constexpr,
                  ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, Q_POS_STEP: tl.constexpr,
                  SEQUSED_OUT: tl.constexpr = False):
    # Strides are in elements, the head dim's is 1. k/v: the new tokens;
    # cache (c: k_cache, d: v_cache): rows (or pages), positions (or rows of
    # a page), heads; q/out: the queries and their rotated copy. HEAD_DIM:
    # a power of two, the rows' features masked at ``head_dim`` (v's at ``head_dim_v``).
    pid = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM)
    features = (d < head_dim)[None, :]
    n_k_rows = batch * s_new
    if pid < n_k_rows:
        b = pid // s_new
        j = pid - b * s_new
        pos = tl.load(seqlens_ptr + b) + j
        if SEQUSED_OUT:  # once per batch entry: its first token's first block of heads
            tl.store(seqused_ptr + b, pos + s_new, mask=(j == 0) & (tl.program_id(1) == 0))
        if PAGED:
            row = tl.load(page_table_ptr + b.to(tl.int64) * stride_pt + pos // page_size)
            pos_in = pos % page_size
        else:
            if BATCH_IDX:
                row = tl.load(batch_idx_ptr + b)
            else:
                row = b
            pos_in = pos
        live = (heads < n_kv_heads)[:, None] & features
        live_v = (heads < n_kv_heads)[:, None] & (d < head_dim_v)[None, :]
        src_k = k_ptr + b.to(tl.int64) * stride_kb + j.to(tl.int64) * stride_ks + \
            (heads.to(tl.int64) * stride_kh)[:, None] + d[None, :]
        src_v = v_ptr + b.to(tl.int64) * stride_vb + j.to(tl.int64) * stride_vs + \
            (heads.to(tl.int64) * stride_vh)[:, None] + d[None, :]
        dst_k = k_cache_ptr + row.to(tl.int64) * stride_cb + pos_in.to(tl.int64) * stride_cs + \
            (heads.to(tl.int64) * stride_ch)[:, None] + d[None, :]
        dst_v = v_cache_ptr + row.to(tl.int64) * stride_db + pos_in.to(tl.int64) * stride_ds + \
            (heads.to(tl.int64) * stride_dh)[:, None] + d[None, :]
        k = tl.load(src_k, mask=live)
        if ROTARY:
            k = _rotated(src_k, live, k, pos, cos_ptr, sin_ptr, stride_ro, seqlen_ro, rotary_half,
                         HEAD_DIM, INTERLEAVED)
        tl.store(dst_k, k.to(k_cache_ptr.dtype.element_ty), mask=live)
        tl.store(dst_v, tl.load(src_v, mask=live_v), mask=live_v)
    elif ROTARY:
        r = pid - n_k_rows
        b = r // seqlen_q
        i = r - b * seqlen_q
        pos = tl.load(seqlens_ptr + b)
        if Q_POS_STEP:
            pos += i
        live = (heads < n_heads)[:, None] & features
        src_q = q_ptr + b.to(tl.int64) * stride_qb + i.to(tl.int64) * stride_qs + \
            (heads.to(tl.int64) * stride_qh)[:, None] + d[None, :]
        x = _rotated(src_q, live, tl.load(src_q, mask=live), pos, cos_ptr, sin_ptr, stride_ro, seqlen_ro, rotary_half,
                     HEAD_DIM, INTERLEAVED)
        dst_q = q_out_ptr + b.to(tl.int64) * stride_ob + i.to(tl.int64) * stride_os + \
            (heads.to(tl.int64) * stride_oh)[:, None] + d[None, :]
        tl.store(dst_q, x.to(q_out_ptr.dtype.element_ty), mask=live)
