"""Online softmax in base 2 with the softmax scale folded into the exponent.

``qk_scale = softmax_scale * log2(e)`` (the seed's 0.12751743 for head dim 128),
so ``exp(scale * (s - m)) == exp2(s * qk_scale - m * qk_scale)`` and each score
costs one FFMA and one MUFU.EX2. ``scores_max`` holds the running row maximum of
the *unscaled* scores, ``logsum`` the running row sums of probabilities, kept
per thread (FA3's way): ``[rows, 4]``, one partial per lane of the quad that
shares a row in the wgmma accumulator layout, summed across the quad only in
``softmax_finish``, so a step's row sum costs no shuffles.

A row that has seen only masked scores has ``scores_max == -inf``; its scaled
maximum is taken as 0 so that ``exp2(-inf - 0) = 0`` instead of NaN. Such a row
ends with ``logsum == 0`` and is written as zeros (LSE -inf).

Lazy rescaling (FlashAttention-4's conditional rescale; ``softmax_step_lazy``,
which the forward uses at head dims 128 and 256): ``scores_max`` is then not
the running maximum but a row's *reference*, which moves to the running
maximum only when a tile's maximum exceeds it by more than
``RESCALE_THRESHOLD`` (log2 units, i.e. after ``qk_scale``). P and the row sum
are always taken against the same reference, and O is rescaled by
``exp2((m_old - m_new) * qk_scale)`` exactly when the reference moves, so the
result is the same softmax up to fp32 rounding: ``O = acc / logsum`` and
``LSE = m_ref * softmax_scale + log(logsum)`` hold for whatever reference a
row ends with. A row whose reference stays put gets a factor of exactly 1.0,
so the caller may skip the O multiply on steps where no row of its
warpgroup moved.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# How far (log2 units) a tile's row maximum may exceed the row's reference
# before the reference moves; FA4 uses 8.0 for 16-bit inputs. Against a stale
# reference every probability is at most 2^8 = 256: exact in bf16 and fp16
# (fp16's largest finite value is 65504 = 2^15.999), and the fp32 row sum and
# O accumulator grow by at most 256x against the exact-max form (a row sum of
# at most 256 * seqlen_k; |O| at most 256 * max|V| before the final
# 1 / logsum), nowhere near fp32's 3.4e38 for fp16 inputs (256 * 65504 * 2^31
# keys ~ 3.6e16). Precision is unchanged: P only moves up by a power of two
# in [1, 256] (bf16/fp16 relative precision is the same at every normal
# magnitude; fewer tiny P values underflow).
RESCALE_THRESHOLD = gl.constexpr(8.0)


@gluon.jit
def _scaled_max(scores_max, qk_scale):
    return gl.where(scores_max == -float("inf"), 0.0, scores_max * qk_scale)


@gluon.jit
def _lane_sums(p):
    """Per-thread partial row sums of ``p`` ([M, N], wgmma accumulator layout,
    where lane ``l`` of a quad holds columns ``8j + 2l`` and ``8j + 2l + 1``):
    ``[M, 4]``, the quad's lanes along dim 1."""
    M: gl.constexpr = p.shape[0]
    N: gl.constexpr = p.shape[1]
    return gl.sum(gl.sum(gl.reshape(p, [M, N // 8, 4, 2]), axis=3), axis=1)


@gluon.jit
def softmax_first(s, qk_scale):
    """First (diagonal) tile: no running state to rescale yet."""
    scores_max = gl.max(s, axis=1)
    m_scaled = _scaled_max(scores_max, qk_scale)
    p = gl.exp2(s * qk_scale - m_scaled[:, None])
    logsum = _lane_sums(p)
    return p, scores_max, logsum


@gluon.jit
def softmax_step(s, scores_max_prev, logsum, qk_scale):
    """Later tiles, in FA3's order: rescale the carried row sums before the
    exponentials, add the new partial sums after them. Returns the probabilities,
    the new running state and ``scores_scale``, the factor the caller applies to
    the output accumulator."""
    scores_max = gl.maximum(scores_max_prev, gl.max(s, axis=1))
    m_scaled = _scaled_max(scores_max, qk_scale)
    scores_scale = gl.exp2(scores_max_prev * qk_scale - m_scaled)
    sum_row_layout: gl.constexpr = gl.SliceLayout(1, logsum.type.layout)
    logsum = logsum * gl.convert_layout(scores_scale, sum_row_layout)[:, None]
    p = gl.exp2(s * qk_scale - m_scaled[:, None])
    logsum = logsum + _lane_sums(p)
    return p, scores_max, logsum, scores_scale


@gluon.jit
def softmax_step_lazy(s, scores_max_prev, qk_scale):
    """Later tiles, with the lazy rescale. ``scores_max_prev`` is each row's
    reference (module docstring); it moves to this tile's row maximum only
    where that lies more than ``RESCALE_THRESHOLD`` above it (log2 units). A
    row that has seen only masked keys (reference -inf) moves as soon as it
    sees a finite score (the gap is +inf); a row still fully masked compares
    NaN > threshold, false, and keeps -inf. Returns the probabilities against
    the new reference, the new reference, this tile's per-thread row sums
    (``_lane_sums``) and ``moved``, the rows whose reference moved. The
    carried row sums and O are rescaled by the caller, with
    ``rescale_factor``, only when some row moved."""
    tile_max = gl.max(s, axis=1)
    moved = (tile_max - scores_max_prev) * qk_scale > RESCALE_THRESHOLD
    scores_max = gl.where(moved, tile_max, scores_max_prev)
    m_scaled = _scaled_max(scores_max, qk_scale)
    p = gl.exp2(s * qk_scale - m_scaled[:, None])
    return p, scores_max, _lane_sums(p), moved


@gluon.jit
def rescale_factor(scores_max_prev, scores_max, moved, qk_scale):
    """The factor that takes the carried row sums and O from the old
    reference to the new one: ``exp2((m_old - m_new) * qk_scale)`` where the
    reference moved (0 for a row leaving -inf), exactly 1.0 where it stayed."""
    m_scaled = _scaled_max(scores_max, qk_scale)
    return gl.where(moved, gl.exp2(scores_max_prev * qk_scale - m_scaled), 1.0)


@gluon.jit
def rescale_sums(logsum, scores_scale, row_sum):
    """``logsum * scores_scale + row_sum`` for the per-thread row sums
    (``[rows, 4]``) and a per-row factor."""
    sum_row_layout: gl.constexpr = gl.SliceLayout(1, logsum.type.layout)
    return logsum * gl.convert_layout(scores_scale, sum_row_layout)[:, None] + row_sum


@gluon.jit
def softmax_finish(scores_max, logsum, softmax_scale):
    """Reciprocal row sums for the output, and the natural-log LSE.

    Rows that saw no key (``logsum == 0``) get a factor 0, so their output is 0
    rather than 0 * inf, and an LSE of -inf."""
    logsum = gl.convert_layout(gl.sum(logsum, axis=1), scores_max.type.layout)
    empty = logsum == 0.0
    inv_logsum = gl.where(empty, 0.0, 1.0 / logsum)
    lse = gl.where(empty, -float("inf"), scores_max * softmax_scale + gl.log(logsum))
    return inv_logsum, lse
