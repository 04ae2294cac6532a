"""Online softmax in base 2 with the softmax scale folded into the exponent.

``qk_scale = softmax_scale * log2(e)`` (the seed's 0.12751743 for head dim 128),
so ``exp(scale * (s - m)) == exp2(s * qk_scale - m * qk_scale)`` and each score
costs one FFMA and one MUFU.EX2. ``scores_max`` holds the running row maximum of
the *unscaled* scores, ``logsum`` the running row sum of probabilities.

A row that has seen only masked scores has ``scores_max == -inf``; its scaled
maximum is taken as 0 so that ``exp2(-inf - 0) = 0`` instead of NaN. Such a row
ends with ``logsum == 0`` and is written as zeros (LSE -inf).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _scaled_max(scores_max, qk_scale):
    return gl.where(scores_max == -float("inf"), 0.0, scores_max * qk_scale)


@gluon.jit
def softmax_first(s, qk_scale):
    """First (diagonal) tile: no running state to rescale yet."""
    scores_max = gl.max(s, axis=1)
    m_scaled = _scaled_max(scores_max, qk_scale)
    p = gl.exp2(s * qk_scale - m_scaled[:, None])
    logsum = gl.sum(p, axis=1)
    return p, scores_max, logsum


@gluon.jit
def softmax_step(s, scores_max_prev, logsum, qk_scale):
    """Later tiles, in FA3's order: rescale the carried row sum before the
    exponentials, add the new partial sum after them. Returns the probabilities,
    the new running state and ``scores_scale``, the factor the caller applies to
    the output accumulator."""
    scores_max = gl.maximum(scores_max_prev, gl.max(s, axis=1))
    m_scaled = _scaled_max(scores_max, qk_scale)
    scores_scale = gl.exp2(scores_max_prev * qk_scale - m_scaled)
    logsum = logsum * scores_scale
    p = gl.exp2(s * qk_scale - m_scaled[:, None])
    logsum = logsum + gl.sum(p, axis=1)
    return p, scores_max, logsum, scores_scale


@gluon.jit
def softmax_finish(scores_max, logsum, softmax_scale):
    """Reciprocal row sums for the output, and the natural-log LSE.

    Rows that saw no key (``logsum == 0``) get a factor 0, so their output is 0
    rather than 0 * inf, and an LSE of -inf."""
    empty = logsum == 0.0
    inv_logsum = gl.where(empty, 0.0, 1.0 / logsum)
    lse = gl.where(empty, -float("inf"), scores_max * softmax_scale + gl.log(logsum))
    return inv_logsum, lse
