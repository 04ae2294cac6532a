"""Barrier rings: slot and phase bookkeeping for the K and V pipelines.

The seed keeps one monotonically increasing ``pipe_order`` counter per ring;
``event.at(order)`` means slot ``order % STAGES`` waited at parity
``(order // STAGES) & 1``. The producer waits on the *empty* barrier of a slot
with the opposite parity, because a freshly initialised mbarrier counts as
having completed the phase before phase 0: the first pass through the ring
finds every slot empty without anyone having arrived.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def ring_slot(order, STAGES: gl.constexpr):
    return order % STAGES


@gluon.jit
def ring_phase(order, STAGES: gl.constexpr):
    return (order // STAGES) & 1


@gluon.jit
def wait_full(full_bars, order, STAGES: gl.constexpr):
    """Consumer side: block until the TMA load into this slot has landed."""
    mbarrier.wait(full_bars.index(ring_slot(order, STAGES)), ring_phase(order, STAGES))


@gluon.jit
def wait_empty(empty_bars, order, STAGES: gl.constexpr):
    """Producer side: block until every consumer released this slot."""
    mbarrier.wait(empty_bars.index(ring_slot(order, STAGES)), ring_phase(order, STAGES) ^ 1)


@gluon.jit
def release(empty_bars, order, STAGES: gl.constexpr):
    """Consumer side: this warpgroup no longer reads the slot.

    The arrive is issued by one thread of the warpgroup. That is enough: a
    wgmma is warpgroup-collective, so once ``warpgroup_mma_wait`` returned in
    this thread the whole group's reads of the slot are complete.
    """
    mbarrier.arrive(empty_bars.index(ring_slot(order, STAGES)), count=1)


# The two ring operations of a consumer step whose every use of the slot is
# a warpgroup wgmma (the forward's K and V tiles). triton 3.6's membar pass
# puts a 128-thread named barrier before each of them, four per forward step;
# ``hopper_flash.ptx_rings`` removes those from the PTX, found by these two
# functions' source lines. Without them:
# - a warp that passed ``wait_landed`` can be at most one phase ahead of the
#   others on that barrier: the slot is refilled only after ``release_read``,
#   which thread 0 issues after its wait for a wgmma that every warp of the
#   warpgroup must have issued, so after every warp passed its own wait (a
#   parity wait must not fall two phases behind);
# - ``release_read`` is thread 0's arrive after its own wgmma wait, and a
#   wgmma is warpgroup-collective: its reads of the slot are complete for
#   every warp (FA3's consumers release so, one thread per warpgroup).
# A loop that waits and releases without a wgmma between (``_pass_kv``) has
# no such bound and keeps ``wait_full`` and ``release``.


@gluon.jit
def wait_landed(full_bars, order, STAGES: gl.constexpr):
    """``wait_full`` before a wgmma reads the slot (see above)."""
    mbarrier.wait(full_bars.index(ring_slot(order, STAGES)), ring_phase(order, STAGES))


@gluon.jit
def release_read(empty_bars, order, STAGES: gl.constexpr):
    """``release`` after this warpgroup's wait for the wgmma that read the slot (see above)."""
    mbarrier.arrive(empty_bars.index(ring_slot(order, STAGES)), count=1)


@gluon.jit
def release_each(empty_bars, order, STAGES: gl.constexpr):
    """Consumer side, every thread: this thread no longer reads the slot (the
    slot's empty barrier counts one arrive per consumer thread).

    ``release``'s ``mbarrier.arrive`` is issued by thread 0 alone, so triton
    3.6 puts a barrier of the partition's warps before it (its membar pass:
    thread 0 may publish only once every thread is done), and another after
    it. ``cp.async.mbarrier.arrive.noinc`` arrives once per executing thread,
    with nothing to order before it (no cp.async is in flight, so the arrive
    is immediate): callers that have just passed a barrier of their own save
    the two. The backward's split-keys step uses it (BENCHMARKS.md,
    nineteenth session).
    """
    async_copy.mbarrier_arrive(empty_bars.index(ring_slot(order, STAGES)), increment_count=False)
