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

Logit soft-capping (flash-attn's ``softcap``, Gemma 2's attention) replaces a
score ``scale * s`` by ``cap * tanh(scale * s / cap)``. The kernels apply
``softcap`` to the raw scores before the mask, with ``scale / cap`` as its
argument scale, and then run the softmax above on ``t = tanh(...)`` with
``cap`` in place of ``softmax_scale`` (``qk_scale = cap * log2(e)``): the same
instructions plus one MUFU.TANH per score. The backward's chain rule adds a
factor ``1 - t^2`` to dS (``softcap_grad``); dQ and dK keep ``softmax_scale``,
since d(cap * tanh(scale * s / cap))/ds = scale * (1 - t^2).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def softcap(s, arg_scale):
    """``tanh(s * arg_scale)`` elementwise, by the SFU's ``tanh.approx.f32``
    (FA3's choice; its relative error, about 2^-11, is below the bf16 rounding
    of the scores it replaces)."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [s * arg_scale], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def softcap_grad(x, t):
    """``x * (1 - t^2)``, the chain rule's factor for capped scores ``t``
    (the backward applies it to P before P's product with dP - Δ). ``t`` is
    taken after the mask: masked entries hold -inf, clamped to -1 here so
    that their factor is 0, not 0 * inf = NaN (tanh's output is in [-1, 1]
    elsewhere)."""
    t = gl.maximum(t, -1.0)
    return x * (1.0 - t * t)


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
def _row_max(s, TREE: gl.constexpr):
    """Row maxima of ``s`` ([M, N], wgmma accumulator layout, as in
    ``_lane_sums``), then across the quad.

    ``gl.max`` over a row chains a thread's elements under triton 3.6 and
    3.7 (3.8 and later lower an in-thread reduction as a tree themselves):
    at N = 128 two dependent chains of 32 ``FMNMX`` (one per row a thread
    holds) between QK's wait and the first exponential. ``TREE`` reduces
    them as a tree instead (the pairs, then halves, quarters, and a chain
    of N / 32): the same instruction count, up to eight independent
    ``FMNMX`` at a time; under 3.8 and later it compiles to what
    ``gl.max`` gives there anyway.
    Head dims 128 and 256 take it (+1.9-2.8% at D=128 causal on the H200;
    level at D=256, -0.6 to +0.6% in two screens; BENCHMARKS.md,
    forty-sixth session); head dim 64 keeps the chain (its two-consumer
    tiles ran 3.4% slower with the tree, its wide tiles level)."""
    if TREE:
        M: gl.constexpr = s.shape[0]
        N: gl.constexpr = s.shape[1]
        x = gl.max(gl.reshape(s, [M, 2, 2, N // 32, 4, 2]), axis=5)
        x = gl.max(x, axis=1)
        x = gl.max(x, axis=1)
        x = gl.max(x, axis=1)
        return gl.convert_layout(gl.max(x, axis=1), gl.SliceLayout(1, s.type.layout))
    else:
        return gl.max(s, axis=1)


@gluon.jit
def softmax_first(s, qk_scale, TREE: gl.constexpr):
    """First (diagonal) tile: no running state to rescale yet. ``TREE``:
    ``_row_max``."""
    scores_max = _row_max(s, TREE)
    m_scaled = _scaled_max(scores_max, qk_scale)
    p = gl.exp2(s * qk_scale - m_scaled[:, None])
    logsum = _lane_sums(p)
    return p, scores_max, logsum


@gluon.jit
def softmax_max(s, scores_max_prev, qk_scale, TREE: gl.constexpr):
    """Later tiles, first half (``softmax_step`` is both; the forward's
    ``MAX_BEFORE_PV`` places work between them): the new running row maximum,
    its scaled form for ``softmax_exp`` and ``scores_scale``, the factor for
    the carried state."""
    scores_max = gl.maximum(scores_max_prev, _row_max(s, TREE))
    m_scaled = _scaled_max(scores_max, qk_scale)
    scores_scale = gl.exp2(scores_max_prev * qk_scale - m_scaled)
    return scores_max, m_scaled, scores_scale


@gluon.jit
def softmax_exp(s, m_scaled, scores_scale, logsum, qk_scale):
    """Later tiles, second half, in FA3's order: the carried row sums
    rescaled before the exponentials, the new partial sums added after them.
    Returns the probabilities and the new row sums."""
    sum_row_layout: gl.constexpr = gl.SliceLayout(1, logsum.type.layout)
    logsum = logsum * gl.convert_layout(scores_scale, sum_row_layout)[:, None]
    p = gl.exp2(s * qk_scale - m_scaled[:, None])
    logsum = logsum + _lane_sums(p)
    return p, logsum


@gluon.jit
def softmax_step(s, scores_max_prev, logsum, qk_scale, TREE: gl.constexpr):
    """Later tiles, in FA3's order: rescale the carried row sums before the
    exponentials, add the new partial sums after them. Returns the probabilities,
    the new running state and ``scores_scale``, the factor the caller applies to
    the output accumulator."""
    scores_max, m_scaled, scores_scale = softmax_max(s, scores_max_prev, qk_scale, TREE)
    p, logsum = softmax_exp(s, m_scaled, scores_scale, logsum, qk_scale)
    return p, scores_max, logsum, scores_scale


@gluon.jit
def softmax_finish(scores_max, logsum, softmax_scale, sink, SINK: gl.constexpr):
    """Reciprocal row sums for the output, and the natural-log LSE.

    Rows that saw no key (``logsum == 0``) get a factor 0, so their output is 0
    rather than 0 * inf, and an LSE of -inf.

    ``SINK``: ``sink`` (natural-log units, one per row: its head's
    ``learnable_sink``) joins each row's normaliser as a key with no value
    (``sinks.py``): with ``m`` the row's maximum logit and ``hi = max(m, sink)``
    the sum becomes ``logsum * exp(m - hi) + exp(sink - hi)``, the output factor
    ``exp(m - hi) / sum`` and the LSE ``hi + log(sum)``. Taken against ``hi``
    so that neither exponential overflows however far the sink is from the
    scores; a row that saw no key (``m = -inf``) gets a factor 0 and the sink
    as its LSE."""
    logsum = gl.convert_layout(gl.sum(logsum, axis=1), scores_max.type.layout)
    if SINK:
        m = scores_max * softmax_scale  # -inf stays -inf: the scale is positive
        hi = gl.maximum(m, sink)
        keep = gl.exp2((m - hi) * LOG2E)
        logsum = logsum * keep + gl.exp2((sink - hi) * LOG2E)
        inv_logsum = keep / logsum
        lse = hi + gl.log(logsum)
    else:
        empty = logsum == 0.0
        inv_logsum = gl.where(empty, 0.0, 1.0 / logsum)
        lse = gl.where(empty, -float("inf"), scores_max * softmax_scale + gl.log(logsum))
    return inv_logsum, lse
