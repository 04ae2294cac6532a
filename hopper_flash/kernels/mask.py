"""Which key columns a query row may see, and which KV tiles need a mask.

Causal attention is aligned to the bottom-right corner, as in flash-attn >= 2.1:
query row ``r`` sees key ``c`` iff ``c <= r + (seqlen_k - seqlen_q)``. Keys at or
past ``seqlen_k`` (the zero-filled tail of the last TMA tile) are never seen.

The kernel walks KV tiles from the highest index (the diagonal) down to 0, so
the tiles that need a mask come first: the diagonal tile, a second one when the
diagonal is not aligned to the tile grid, and (non-causal) the tail tile, which
is also the highest tile. Every later tile is fully visible and skips the mask.

A sliding window (flash-attn's ``window_size=(left, right)``, compile-time
``WINDOW_LEFT``/``WINDOW_RIGHT``, -1 for no bound on that side) lets row ``r``
see key ``c`` iff ``r + off - left <= c <= r + off + right`` (``off = seqlen_k -
seqlen_q``; the host folds ``causal`` into ``right = 0``). A query tile then
reads KV tiles ``[lo, hi)`` instead of ``[0, hi)``, and the tiles at the
window's left edge, visited last, are masked too. Without a window the code
below is what it was without one.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


# ---- The forward's tiles: rows are queries, columns are keys. Under PackGQA
# (``PACK_G`` > 1) tile row ``p`` is query row ``p // PACK_G`` of head
# ``hk * PACK_G + p % PACK_G``: the causal row is the packed row divided by the
# group size. ``PACK_G == 1`` is the plain tile. ----


@gluon.jit
def kv_tile_count(bm, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  IS_CAUSAL: gl.constexpr, PACK_G: gl.constexpr):
    """Number of KV tiles query tile ``bm`` reads: tiles ``0 .. n_kv - 1``.

    Never less than 1: a query tile whose rows see no key at all still runs one
    fully-masked tile, which the softmax turns into zero output and -inf LSE.
    """
    if IS_CAUSAL:
        last_row = ((bm + 1) * BLOCK_M - 1) // PACK_G
        last_key = gl.minimum(last_row + 1 + (seqlen_k - seqlen_q), seqlen_k)
        n_kv = gl.maximum(gl.cdiv(gl.maximum(last_key, 0), BLOCK_N), 1)
    else:
        n_kv = gl.maximum(gl.cdiv(seqlen_k, BLOCK_N), 1)
    return n_kv


@gluon.jit
def kv_window_tiles(bm, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, PACK_G: gl.constexpr,
                    WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr):
    """KV tiles ``[lo, hi)`` that query tile ``bm`` reads under a sliding
    window: from the first row's leftmost key to the last live row's
    rightmost one. A tile none of whose rows sees a key still runs one tile
    (tile 0), which the window's own mask hides entirely."""
    off = seqlen_k - seqlen_q
    first_row = (bm * BLOCK_M) // PACK_G
    last_row = gl.minimum(((bm + 1) * BLOCK_M - 1) // PACK_G, seqlen_q - 1)
    if WINDOW_LEFT >= 0:
        first_key = gl.maximum(first_row + off - WINDOW_LEFT, 0)
    else:
        first_key = first_row * 0
    if WINDOW_RIGHT >= 0:
        last_key = gl.minimum(last_row + off + WINDOW_RIGHT, seqlen_k - 1)
    else:
        last_key = seqlen_k - 1 + first_row * 0
    empty = last_key < first_key
    lo = gl.where(empty, 0, first_key // BLOCK_N)
    hi = gl.where(empty, 1, last_key // BLOCK_N + 1)
    return lo, hi


@gluon.jit
def kv_split_range(bm, split, n_splits, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   IS_CAUSAL: gl.constexpr, PACK_G: gl.constexpr, WINDOW_LEFT: gl.constexpr = -1,
                   WINDOW_RIGHT: gl.constexpr = -1):
    """KV tiles ``[n_lo, n_hi)`` of split ``split`` of query tile ``bm``, and
    the key length to mask with. Each split takes a contiguous run of
    ``cdiv(n, n_splits)`` tiles. A split left without tiles still runs one
    tile (tile 0), masked entirely (returned length 0): it writes O = 0 and
    LSE = -inf, which the combine gives weight 0."""
    if WINDOW_LEFT >= 0 or WINDOW_RIGHT >= 0:
        lo, hi = kv_window_tiles(bm, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, PACK_G, WINDOW_LEFT, WINDOW_RIGHT)
        per = gl.cdiv(hi - lo, n_splits)
        n_lo = lo + split * per
        n_hi = gl.minimum(n_lo + per, hi)
    else:
        n_kv = kv_tile_count(bm, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL, PACK_G)
        per = gl.cdiv(n_kv, n_splits)
        n_lo = split * per
        n_hi = gl.minimum(n_lo + per, n_kv)
    empty = n_lo >= n_hi
    n_lo = gl.where(empty, 0, n_lo)
    n_hi = gl.where(empty, 1, n_hi)
    seqlen_k = gl.where(empty, 0, seqlen_k)
    return n_lo, n_hi, seqlen_k


@gluon.jit
def tile_needs_mask(n, bm, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    IS_CAUSAL: gl.constexpr, PACK_G: gl.constexpr, WINDOW_LEFT: gl.constexpr = -1,
                    WINDOW_RIGHT: gl.constexpr = -1):
    """True when some (row, column) pair of KV tile ``n`` x query tile ``bm``
    is hidden. The backward asks the same of its transposed tiles (KV tile
    ``n`` x query tile ``m``, ``PACK_G`` 1). Keys past ``seqlen_k`` are
    zero-filled by TMA but must still be masked: a score of 0 is not a hidden
    one."""
    crosses_tail = (n + 1) * BLOCK_N > seqlen_k
    if WINDOW_LEFT >= 0 or WINDOW_RIGHT >= 0:
        needs = crosses_tail
        off = seqlen_k - seqlen_q
        if WINDOW_RIGHT >= 0:
            needs = needs | ((n + 1) * BLOCK_N - 1 > (bm * BLOCK_M) // PACK_G + off + WINDOW_RIGHT)
        if WINDOW_LEFT >= 0:
            needs = needs | (n * BLOCK_N < ((bm + 1) * BLOCK_M - 1) // PACK_G + off - WINDOW_LEFT)
    elif IS_CAUSAL:
        crosses_diagonal = (n + 1) * BLOCK_N - 1 > (bm * BLOCK_M) // PACK_G + (seqlen_k - seqlen_q)
        needs = crosses_diagonal | crosses_tail
    else:
        needs = crosses_tail
    return needs


@gluon.jit
def _hidden(keys, queries, seqlen_q, seqlen_k, IS_CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr,
            WINDOW_RIGHT: gl.constexpr):
    """True where query ``queries`` does not see key ``keys`` (index tensors
    that broadcast to the tile, in either orientation): keys past
    ``seqlen_k``, then the window's bounds or the bottom-right causal
    diagonal (``off = seqlen_k - seqlen_q``). The forward's and the
    backward's masks both come from here."""
    hidden = keys >= seqlen_k
    if WINDOW_LEFT >= 0 or WINDOW_RIGHT >= 0:
        if WINDOW_RIGHT >= 0:
            hidden = hidden | (keys > queries + (seqlen_k - seqlen_q + WINDOW_RIGHT))
        if WINDOW_LEFT >= 0:
            hidden = hidden | (keys < queries + (seqlen_k - seqlen_q - WINDOW_LEFT))
    elif IS_CAUSAL:
        hidden = hidden | (keys > queries + (seqlen_k - seqlen_q))
    return hidden


@gluon.jit
def apply_mask(s, row0, col0, seqlen_q, seqlen_k, IS_CAUSAL: gl.constexpr, PACK_G: gl.constexpr,
               WINDOW_LEFT: gl.constexpr = -1, WINDOW_RIGHT: gl.constexpr = -1):
    """Set hidden scores of the tile ``s`` (rows from the packed row ``row0``,
    columns from ``col0``) to -inf."""
    rows = (row0 + gl.arange(0, s.shape[0], layout=gl.SliceLayout(1, s.type.layout))) // PACK_G
    cols = col0 + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
    hidden = _hidden(cols[None, :], rows[:, None], seqlen_q, seqlen_k, IS_CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    return gl.where(hidden, -float("inf"), s)


# ---- The backward's transposed tiles: rows are keys, columns are queries. ----


@gluon.jit
def apply_mask_keys_by_queries(st, key0, query0, seqlen_q, seqlen_k, IS_CAUSAL: gl.constexpr,
                               WINDOW_LEFT: gl.constexpr = -1, WINDOW_RIGHT: gl.constexpr = -1):
    """Set hidden scores of the transposed tile ``st`` (rows = keys from
    ``key0``, columns = queries from ``query0``) to -inf."""
    keys = key0 + gl.arange(0, st.shape[0], layout=gl.SliceLayout(1, st.type.layout))
    queries = query0 + gl.arange(0, st.shape[1], layout=gl.SliceLayout(0, st.type.layout))
    hidden = _hidden(keys[:, None], queries[None, :], seqlen_q, seqlen_k, IS_CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    return gl.where(hidden, -float("inf"), st)
