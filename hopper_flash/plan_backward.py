"""Host-side planning for the attention backward: tile shapes per head dim,
workspaces, TMA descriptors and the three launches (preprocess, main Gluon
kernel, postprocess).

Workspace per call, besides dQ/dK/dV themselves (``Sq_r`` = seqlen_q rounded
up to the query tile), in one fp32 allocation:

* ``dq_accum``: ``[B·H·Sq_r, D]``, where the KV-tile CTAs sum dQ (twice the
  size of a bf16 dQ; zeroed by the preprocess, no memset);
* ``delta`` and ``lse2``: ``[B·H·Sq_r]`` each;

and in deterministic mode int32 semaphores ``[B, H, Sq_r / BLOCK_M]``.

dK and dV need no workspace, also under GQA/MQA: a CTA loops over the query
heads that share its KV head and keeps their sums in registers.

A call's host work is short because the backward of a small batch is short
on the GPU too (B16 H16 S1024 D128 causal: ~0.5 ms): what the three launches
take apart from addresses is planned once per shape (``BackwardPlan``), and
a plan's compiled kernels are launched without lookups.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from . import checks, plan
from .kernels import backward_pre as _pre
from .launcher import KernelLaunch
from .plan import LOG2E, SMEM_BUDGET_BYTES, _descriptor, compile_options, launch_maxnreg, triton_cdiv

@dataclass(frozen=True)
class BackwardConfig:
    """Compile-time shape of one backward specialisation: two consumer
    warpgroups and a producer warp, every head-dim operand one TMA box wide."""

    head_dim: int
    block_m: int = 64  # queries per step (wgmma N of Sᵀ and dPᵀ)
    stages: int = 2  # Q ring depth (and dO's, unless do_stages)
    producer_regs: int = 24
    # How the two consumer warpgroups share a step (kernels/backward.py):
    # False: each owns 64 keys (rows of Sᵀ, dK, dV); True: they share 64
    # keys, and each owns half the queries of Sᵀ and half the head-dim
    # columns of dK, dV and dQ (FA3's d-major D=256 scheme, kept row-major).
    split_d: bool = False
    do_stages: int = 0  # dO ring depth; 0: the same as ``stages``

    @property
    def block_n(self) -> int:
        """Keys per CTA."""
        return 64 if self.split_d else 128

    @property
    def dq_cols(self) -> int:
        """Columns of the fp32 dQ staging tile (one TMA reduce-add)."""
        return min(self.head_dim, 128)

    @property
    def do_ring(self) -> int:
        return self.do_stages or self.stages

    num_warps = 8  # the two consumer warpgroups (the producer warp is a worker)
    # The register cap at launch, as the forward's with two consumer
    # warpgroups (168); setmaxnreg then moves registers between partitions.
    maxnreg = launch_maxnreg(2)

    def shared_bytes(self, elem_bytes: int = 2, deterministic: bool = False) -> int:
        """K, V, the Q and dO rings, two [keys, queries] tiles (dSᵀ stages,
        or Pᵀ and dSᵀ), the fp32 dQ staging (two tiles when the warpgroups
        split the keys, one for split_d and in deterministic mode) and the
        L2/Δ rings."""
        d, bm, bn = self.head_dim, self.block_m, self.block_n
        dq_tiles = 1 if self.split_d or deterministic else 2
        return (elem_bytes * (2 * bn * d + (self.stages + self.do_ring) * bm * d + 2 * bn * bm)
                + 4 * bm * self.dq_cols * dq_tiles + 4 * (self.stages + self.do_ring) * bm)


# - 128: FA3's D=128 causal shape, 128 keys x 64 queries, each of the two
#   warpgroups owning 64 keys (their dK and dV rows stay in registers).
# - 64: the same with 128 queries per step (FA3's D=64 shape): twice the work
#   per step for the same per-step overhead, 12-13% faster than 64 queries
#   on the H200. It fits in registers because the per-query statistics ride
#   in the score accumulators (kernels/backward.py, ``_p_and_ds``).
# - 256: 128 keys' dK + dV would take 256 registers per thread. So a CTA owns
#   64 keys, and its two warpgroups split the head dim of dK, dV and dQ
#   (FA3 computes dKᵀ and dVᵀ, d-major, to the same end): 128 registers for
#   dK + dV, and no GEMM work done twice. Pᵀ then goes through shared memory
#   (each warpgroup needs all of it), and K + V + two Q stages + one dO stage
#   + half of dQ's fp32 staging fill 209 KB (FA3 also has 2 Q, 1 dO stages).
BACKWARD_CONFIGS: dict[int, BackwardConfig] = {
    64: BackwardConfig(head_dim=64, block_m=128),
    128: BackwardConfig(head_dim=128),
    256: BackwardConfig(head_dim=256, stages=2, do_stages=1, split_d=True),
}
BACKWARD_HEAD_DIMS = tuple(sorted(BACKWARD_CONFIGS))

for _cfg in BACKWARD_CONFIGS.values():
    assert _cfg.shared_bytes() <= SMEM_BUDGET_BYTES, _cfg


@lru_cache(maxsize=None)
def kernel_constexprs(cfg: BackwardConfig, causal: bool, deterministic: bool, varlen: bool = False,
                      seqused_q: bool = False, seqused_k: bool = False, window=None, softcap: bool = False,
                      short_rows: bool = False, o_dim: int = 0) -> dict:
    """The constexpr arguments of ``attention_backward_kernel``.
    ``short_rows``: fixed lengths with ``seqlen_q <= PERSISTENT_MAX_SEQLEN_Q``;
    ``o_dim``: varlen's dK/dV head dim where narrower than the kernel's
    (``plan.kernel_head_dim``), else 0 (TMA stores clip the others)."""
    # In the kernel's parameter order: the fast launch passes them positionally.
    return dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        HEAD_DIM=cfg.head_dim,
        STAGES=cfg.stages,
        DO_STAGES=cfg.do_ring,
        IS_CAUSAL=bool(causal),
        DETERMINISTIC=bool(deterministic),
        SPLIT_D=cfg.split_d,
        PRODUCER_REGS=cfg.producer_regs,
        VARLEN=bool(varlen),
        SEQUSED_Q=bool(seqused_q),
        SEQUSED_K=bool(seqused_k),
        WINDOW_LEFT=window[0] if window else -1,
        WINDOW_RIGHT=window[1] if window else -1,
        SOFTCAP=bool(softcap),
        PERSISTENT=persistent_grid(cfg, causal, deterministic, varlen, short_rows),
        O_DIM=o_dim,
    )


# The fast mode at D = 128 runs on a persistent grid (kernels/backward.py)
# where it measured faster: varlen batches (1.0-1.3% on the 512..8192 block),
# and causal fixed-length rows of at most this many queries (S = 1024-4096
# square: 2-6% faster, means of 2-4 timings; S = 8192 within +-2%, non-causal
# 1% slower; non-causal short rows not timed). A tile's work grows with the
# queries, the grid's saving (the next tile's K/V loaded under this one's
# epilogue, no CTA launch) is per tile. D = 64 measured 4-5% slower on the
# varlen block.
# BENCHMARKS.md, forty-first and forty-second sessions.
PERSISTENT_MAX_SEQLEN_Q = 4096


def persistent_grid(cfg: BackwardConfig, causal: bool, deterministic: bool, varlen: bool,
                    short_rows: bool) -> bool:
    """Whether the main kernel runs on the persistent grid (``PERSISTENT``)."""
    fast = not deterministic and cfg.head_dim == 128
    return fast and (bool(varlen) or (bool(causal) and bool(short_rows)))


def block_shapes(cfg: BackwardConfig) -> dict[str, list[int]]:
    """TMA boxes over the rank-4 ``[B, S, H, D]`` views (see plan.block_shapes)."""
    q = [1, cfg.block_m, 1, cfg.head_dim]
    kv = [1, cfg.block_n, 1, cfg.head_dim]
    return {"q": q, "k": kv, "v": kv, "do": q, "dk": kv, "dv": kv, "dq_accum": [cfg.block_m, cfg.dq_cols],
            "lse2": [cfg.block_m], "delta": [cfg.block_m]}


@lru_cache(maxsize=None)
def fp32_smem_layout(block_shape: tuple[int, ...]):
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(block_shape), gl.float32)


def _fp32_descriptor(t: torch.Tensor, block_shape: list[int]):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), block_shape, fp32_smem_layout(tuple(block_shape)))


def kv_tiles(seqlen_k: int, cfg: BackwardConfig) -> int:
    """CTAs per (batch, KV head): one per KV tile."""
    return triton_cdiv(seqlen_k, cfg.block_n)


def grid(batch: int, nheads_kv: int, seqlen_k: int, cfg: BackwardConfig) -> tuple[int, int, int]:
    """One CTA per (KV tile, KV head, batch), all on axis 0
    (the kernel orders them, longest first in L2 sections). Varlen:
    ``seqlen_k`` is ``max_seqlen_k``, ``batch`` the number of sequences."""
    return (kv_tiles(seqlen_k, cfg) * nheads_kv * batch, 1, 1)


def l2_section(seqlen_q: int, head_dim: int, elem_bytes: int, group: int) -> int:
    """(batch, KV head) pairs per L2 section of the grid order: as many as
    keep what their CTAs all re-read in L2 (``plan.heads_in_l2``): the group's
    Q and dO rows and its fp32 dQ accumulator (a power of two, at least 1)."""
    return plan.heads_in_l2(max(1, seqlen_q) * head_dim * (2 * elem_bytes + 4) * group)


@dataclass(frozen=True)
class VarlenBatch:
    """A packed (THD) batch: int32 device prefix sums ``cu_seqlens_*`` [B+1],
    optional live lengths ``seqused_*`` [B], and host-side bounds
    ``max_seqlen_*`` (tile counts only, never read back from the device)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    seqused_q: torch.Tensor | None
    seqused_k: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1


def varlen_padded_rows(total_q: int, batch: int, block_m: int) -> int:
    """Rows per head of the varlen fp32 stats and dQ accumulator: sequence
    ``b`` starts at ``(cu_q[b] + b·block_m)`` rounded down to a tile (FA3's
    rule, ``backward.bwd_sequence``), so the last one ends by
    ``total_q + batch·block_m`` rounded up."""
    return triton_cdiv(total_q + batch * block_m, block_m) * block_m


# The forward's guard (``_triton_support.fast_launch_supported``), as its own
# attribute so the backward's fast path can be switched off alone.
FAST_LAUNCH = plan.FAST_LAUNCH

# Compiled main kernels by (device, dtype, causal, deterministic, config). Its
# lengths and head counts are never value-specialised (do_not_specialize) and
# every pointer it gets is a fresh or checked 16-byte aligned allocation, so
# one compiled kernel serves every shape of a key, as in plan._COMPILED.
_COMPILED: dict[tuple, object] = {}


@dataclass(frozen=True)
class SmallLaunch:
    """A plain Triton kernel's launch apart from its pointers (the pre- and
    postprocess): ``kernel[grid](*pointers, *ints, **constexprs)``."""

    kernel: object
    grid: tuple[int, int, int]
    ints: tuple
    constexprs: dict

    @property
    def tail(self) -> tuple:
        """The arguments after the pointers as a compiled kernel's launcher
        takes them: the integers, then the constexpr values."""
        return (*self.ints, *self.constexprs.values())

    def __call__(self, pointers: tuple):
        """Launch (``plan.launch_triton``); returns the compiled kernel's
        ``KernelLaunch`` where one was used or made."""
        return plan.launch_triton(self.kernel, self.grid, (*pointers, *self.ints), self.constexprs, num_warps=4)


class BackwardPlan:
    """What one backward call's three launches take apart from addresses:
    everything ``launch_backward`` derives from shapes, strides and flags,
    computed once per key (``plan_for``), as the forward's ``LaunchPlan``.

    ``zero_tails``: varlen, per side (dQ; dK and dV), the launch that zeroes
    the gradient rows past ``cu_seqlens[-1]`` (``zero_tail_launch``), or
    None (fixed length; a side with ``seqused``, zero-filled whole; no rows).

    ``compiled`` is filled after a call whose launches all went through
    cached compiled kernels (``KernelLaunch``); later calls of the key then
    launch them directly, without looking them up. That is valid because the
    key holds everything their compiled keys hold: dtypes, constexprs and the
    16-byte alignment of every pointer that is not a fresh allocation.
    """

    __slots__ = ("cfg", "rows", "acc_elems", "stat_elems", "order_elems", "sem_shape", "grid", "ints", "constexprs",
                 "key", "pre", "post", "zero_tails", "compiled", "pre_tail", "post_tail", "zero_tail_args")

    def __init__(self, cfg, rows, sem_shape, grid, ints, constexprs, key, pre, post, zero_tails=(None, None),
                 order_elems=0):
        self.cfg = cfg
        self.rows = rows  # the fp32 statistics' shape; dq_accum's is rows + (head_dim,)
        self.stat_elems = 1
        for r in rows:
            self.stat_elems *= r
        self.acc_elems = self.stat_elems * cfg.head_dim
        self.order_elems = order_elems  # varlen: the sequences' order, then the item counter (int32); fixed: the counter
        self.sem_shape = sem_shape  # deterministic mode's int32 semaphores, else None
        self.grid = grid
        self.ints = ints  # the main kernel's arguments after its pointers, constexpr values last
        self.constexprs = constexprs
        self.key = key  # the compiled main kernel's, less the pointers' alignment
        self.pre: SmallLaunch = pre
        self.post: SmallLaunch = post
        self.zero_tails: tuple = zero_tails
        # (preprocess, main, postprocess, dQ tail, dK/dV tail) KernelLaunch (None: no tail launch)
        self.compiled: tuple | None = None
        self.pre_tail, self.post_tail = pre.tail, post.tail  # built once, not per call
        self.zero_tail_args = tuple(None if z is None else z.tail for z in zero_tails)

    @property
    def workspace_elems(self) -> int:
        """4-byte elements of the one workspace allocation: dq_accum, Δ, L2
        (fp32), then varlen's sequence order and item counter (int32)."""
        return self.acc_elems + 2 * self.stat_elems + self.order_elems


# Plans by key (``_plan_key``); cleared when full, as the launcher's descriptor cache.
_PLANS: dict[tuple, BackwardPlan] = {}
PLAN_CACHE_LIMIT = 1024


def _aligned(t) -> bool:
    return t is None or t.data_ptr() % 16 == 0


def _plan_key(dout, q, k, out, lse, dq, dk, dv, softmax_scale, causal, deterministic, cfg, varlen, window,
              softcap=0.0, sink=""):
    """Everything a plan depends on: shapes; the strides the small kernels
    and the varlen dK/dV rows take; the flags; and the 16-byte alignment of
    every pointer argument that is not a fresh allocation (the compiled
    kernels are specialised on it). The descriptors' tensors are not in it:
    ``KernelLaunch`` caches their encodings by address, shape and strides."""
    key = (q.shape, k.shape, out.shape[-1], dk.shape[-1], q.dtype, q.device.index, out.stride(), dout.stride(),
           dq.stride(), lse.stride(),
           softmax_scale, causal, deterministic, cfg, window, softcap, sink, _aligned(lse), _aligned(dq),
           _aligned(dk), _aligned(dv))
    if varlen is None:
        return key
    return key + (dk.stride(), varlen.batch, varlen.max_seqlen_q, varlen.max_seqlen_k,
                  tuple(_aligned(t) for t in (varlen.cu_seqlens_q, varlen.cu_seqlens_k)),
                  _aligned(varlen.seqused_q) if varlen.seqused_q is not None else None,
                  _aligned(varlen.seqused_k) if varlen.seqused_k is not None else None)


def plan_for(dout, q, k, out, lse, dq, dk, dv, softmax_scale: float, causal: bool, deterministic: bool = False,
             cfg: BackwardConfig | None = None, varlen: VarlenBatch | None = None, window=None,
             softcap: float = 0.0, sink: str = "") -> BackwardPlan:
    """The plan of ``launch_backward``'s call with these arguments (cached);
    ``sink``: the sinks' ``plan.sink_mode`` ("" none)."""
    key = _plan_key(dout, q, k, out, lse, dq, dk, dv, softmax_scale, causal, deterministic, cfg, varlen, window,
                    softcap, sink)
    lp = _PLANS.get(key)
    if lp is None:
        lp = _make_plan(dout, q, k, out, lse, dq, dk, softmax_scale, causal, deterministic, cfg, varlen, window,
                        softcap, bool(sink))
        if len(_PLANS) >= PLAN_CACHE_LIMIT:
            _PLANS.clear()
        _PLANS[key] = lp
    return lp


def softcap_config(cfg: BackwardConfig) -> BackwardConfig:
    """The config a soft-capped backward runs: ``cfg``, but 64-query steps
    where it takes 128 (D = 64): tanh needs the raw scores, so the per-query
    statistics cannot ride in the score accumulators there
    (``kernels/backward.py``, ``_p_and_ds``), and the capped scores stay
    live over the dP wait."""
    return replace(cfg, block_m=64) if cfg.block_m == 128 else cfg


def _make_plan(dout, q, k, out, lse, dq, dk, softmax_scale, causal, deterministic, cfg, varlen, window, softcap=0.0,
               sink=False):
    if varlen is None:
        batch, seqlen_q, nheads, head_dim = q.shape
        seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    else:
        batch = varlen.batch
        _, nheads, head_dim = q.shape
        nheads_kv = k.shape[1]
        seqlen_q, seqlen_k = varlen.max_seqlen_q, varlen.max_seqlen_k
    # v's head dim (out's) may differ from q's: the kernels of the wider.
    cfg = cfg or BACKWARD_CONFIGS[plan.kernel_head_dim(head_dim, out.shape[-1])]
    if softcap:
        cfg = softcap_config(cfg)
    m_tiles = triton_cdiv(seqlen_q, cfg.block_m)
    if varlen is None:
        seqlen_q_rounded = m_tiles * cfg.block_m
        stat_rows = batch * nheads * seqlen_q_rounded
    else:
        seqlen_q_rounded = varlen_padded_rows(q.shape[0], batch, cfg.block_m)
        stat_rows = nheads * seqlen_q_rounded
    # The dQ reduce addresses dq_accum as 2-D rows in int32 TMA coordinates.
    # One CTA per (KV tile, KV head, batch) on grid axis x, numbered in int32.
    ctas = grid(batch, nheads_kv, seqlen_k, cfg)[0]
    if ctas > 2**31 - 1:
        raise ValueError(f"the backward launches one CTA per KV tile, KV head and batch: {ctas} CTAs for "
                         f"batch ({batch}) x nheads_kv ({nheads_kv}) x seqlen_k ({seqlen_k}) exceed 2**31 - 1")
    if stat_rows >= 2**31:
        raise ValueError(f"batch ({batch}) x nheads ({nheads}) x seqlen_q ({seqlen_q}) is too large for the "
                         f"backward's dQ accumulator (2**31 rows)")
    # Per (batch, head) rows of seqlen_q_rounded; varlen: per head, the padded total (one "batch").
    rows = (batch, nheads, seqlen_q_rounded) if varlen is None else (nheads, seqlen_q_rounded)
    sem_shape = rows[:-1] + (seqlen_q_rounded // cfg.block_m,) if deterministic else None
    if varlen is None:
        small = None
        stride_kv = (0, 0)
    else:
        small = (varlen.seqused_q is not None, batch, varlen.max_seqlen_q)
        assert dk.stride(2) == 1
        stride_kv = (dk.stride(0), dk.stride(1))
    section = l2_section(seqlen_q, head_dim, q.element_size(), nheads // nheads_kv)
    scalars = (seqlen_q, seqlen_k, seqlen_q_rounded, nheads, nheads // nheads_kv, kv_tiles(seqlen_k, cfg), batch,
               section, (softcap if softcap else softmax_scale) * LOG2E, softmax_scale)
    constexprs = kernel_constexprs(cfg, causal, deterministic, varlen is not None,
                                   varlen is not None and varlen.seqused_q is not None,
                                   varlen is not None and varlen.seqused_k is not None, window, softcap > 0,
                                   varlen is None and seqlen_q <= PERSISTENT_MAX_SEQLEN_Q,
                                   plan.narrower_width(dk.shape[-1], cfg.head_dim) if varlen is not None else 0)
    key = (q.device.index, q.dtype, bool(causal), bool(deterministic), cfg, tuple(constexprs.values()))
    zero_tails = (None, None)
    if varlen is not None:
        zero_tails = (None if varlen.seqused_q is not None else zero_tail_launch(dq, False, batch),
                      None if varlen.seqused_k is not None else zero_tail_launch(dk, True, batch))
    if constexprs["PERSISTENT"]:  # at most one CTA per SM, each looping over items
        ctas = min(ctas, plan.sm_count(q.device.index))
    return BackwardPlan(cfg, rows, sem_shape, (ctas, 1, 1), (*stride_kv, *scalars, *constexprs.values()),
                        constexprs, key,
                        preprocess_launch(out, dout, lse, seqlen_q_rounded, cfg.block_m, small, sink, cfg.head_dim),
                        postprocess_launch(dq, seqlen_q_rounded, softmax_scale, cfg.block_m, small, cfg.head_dim),
                        zero_tails,
                        1 if varlen is None else batch + 1)


def launch_backward(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale: float, causal: bool,
                    deterministic: bool = False, cfg: BackwardConfig | None = None,
                    varlen: VarlenBatch | None = None, window: tuple[int, int] | None = None,
                    softcap: float = 0.0, sink: torch.Tensor | None = None) -> torch.Tensor | None:
    """Compute dq, dk, dv (written in place; any TMA-addressable BSHD views).
    With attention sinks ``sink`` (``[H]``; ``out`` and ``lse`` the forward's
    sink-normalised ones) also the sinks' gradient, returned in ``sink``'s
    dtype (the preprocess's partial sums, ``backward_pre``); else None.

    Arguments are assumed validated: BSHD, same dtype, supported head dim,
    ``lse`` the forward's fp32 ``[B, H, Sq]`` (contiguous), non-empty, and
    q's device current.

    ``window``: the forward's sliding window (``checks.window_bounds``), or None;
    ``softcap``: the forward's logit soft-capping (0.0: none).

    With ``varlen``: THD ``[total, H, D]`` tensors, ``lse`` ``[H, total_q]``
    (contiguous); rows of dq/dk/dv outside every sequence's live part are
    zeroed first (``_zero_unwritten``); dk/dv with equal strides and a
    contiguous head dim.

    Three launches: the preprocess (Δ, L2, and dq_accum zeroed), the main
    Gluon kernel, the postprocess (dQ from dq_accum); varlen adds the
    zeroing's (up to two small launches). What they take apart
    from addresses is the call's ``BackwardPlan`` (cached by shapes, strides
    and flags). The main kernel launches as the forward's does
    (``plan.launch_forward``): the first launch of a specialisation through
    Triton's JIT, later ones through ``launcher.KernelLaunch`` (cached
    descriptors, a direct call), where ``FAST_LAUNCH`` (the same
    triton-version guard) allows and no profiler hook is installed. The
    pre/postprocess kernels are plain Triton kernels with unspecialised
    integers, launched the same way (``plan.launch_triton``). Once a plan's
    three compiled kernels are known, its calls launch them without the
    lookups (``BackwardPlan.compiled``).
    """
    sink_in = plan.sink_arg(sink)
    lp = plan_for(dout, q, k, out, lse, dq, dk, dv, softmax_scale, causal, deterministic, cfg, varlen, window,
                  softcap, plan.sink_mode(sink_in))
    dev = q.device
    # One allocation: dq_accum [rows, D] (zeroed by the preprocess), then Δ
    # and L2, then (varlen) the order in which the main kernel takes the
    # sequences, then (every mode) its persistent grid's item counter (both
    # written by the preprocess; the counter is read only on that grid).
    ws = torch.empty(lp.workspace_elems, dtype=torch.float32, device=dev)
    acc_end, n = lp.acc_elems, lp.stat_elems
    dq_accum = ws[:acc_end].view(-1, lp.cfg.head_dim)
    delta, lse2 = ws[acc_end:acc_end + n], ws[acc_end + n:acc_end + 2 * n]
    sem = delta if lp.sem_shape is None else torch.zeros(lp.sem_shape, dtype=torch.int32, device=dev)
    if varlen is None:
        descs = (q, k, v, dout, dk, dv, dq_accum, lse2, delta)
        cu_q = cu_k = used_q = used_k = sem  # never read
        order = ws[acc_end + 2 * n:].view(torch.int32)  # the persistent grid's item counter
        small = (delta, delta)  # never read (fp32 in every mode: one compiled pre/postprocess)
    else:
        # THD as [1, total, H, D]: the sequence start is a row coordinate.
        # dK and dV rows share one pair of strides (the plan's stride_kv).
        assert dk.stride() == dv.stride()
        descs = (*(t.unsqueeze(0) for t in (q, k, v, dout, dk, dv)), dq_accum, lse2, delta)
        cu_q, cu_k = varlen.cu_seqlens_q, varlen.cu_seqlens_k
        used_q = varlen.seqused_q if varlen.seqused_q is not None else cu_q
        used_k = varlen.seqused_k if varlen.seqused_k is not None else cu_k
        small = (cu_q, used_q)
        order = ws[acc_end + 2 * n:].view(torch.int32)  # the sequences' order, then the item counter
    ptrs = (sem, cu_q, cu_k, used_q, used_k, order, dk, dv)
    part, sink_ptrs = _sink_partials(lp.pre, sink_in, delta)
    pre_ptrs = (out, dout, lse, delta, lse2, dq_accum, *small, *sink_ptrs, order)
    post_ptrs = (dq_accum, dq, *small)
    fast = FAST_LAUNCH and not plan._launch_hooked()
    if lp.compiled is not None and fast:
        stream = plan.driver.active.get_current_stream(dev.index)
        pre, main, post, *_ = lp.compiled
        if varlen is not None:
            _zero_unwritten(lp, dq, dk, dv, varlen, stream)
        pre(lp.pre.grid, stream, (), pre_ptrs + lp.pre_tail)
        main(lp.grid, stream, descs, ptrs + lp.ints)
        post(lp.post.grid, stream, (), post_ptrs + lp.post_tail)
        return _sink_sum(part, sink)

    zeros = (None, None) if varlen is None else _zero_unwritten(lp, dq, dk, dv, varlen)
    pre = lp.pre(pre_ptrs)
    # Varlen's int32 vectors are the caller's tensors: Triton specialises
    # pointers on 16-byte alignment, so that is part of the key.
    key = lp.key + tuple(t.data_ptr() % 16 == 0 for t in ptrs)
    main = _COMPILED.get(key)
    if main is None or not fast:
        from .kernels.backward import attention_backward_kernel

        blocks = block_shapes(lp.cfg)
        names = ("q", "k", "v", "do", "dk", "dv", "dq_accum", "lse2", "delta")
        tmas = [_descriptor(t, blocks[name]) for name, t in zip(names[:6], descs[:6])]
        tmas += [_fp32_descriptor(t, blocks[name]) for name, t in zip(names[6:], descs[6:])]
        main = _COMPILED[key] = KernelLaunch(attention_backward_kernel[lp.grid](
            *tmas, *ptrs, *lp.ints[:-len(lp.constexprs)], **lp.constexprs, **compile_options(lp.cfg)))
    else:
        main(lp.grid, plan.driver.active.get_current_stream(dev.index), descs, (*ptrs, *lp.ints))
    post = lp.post(post_ptrs)
    launched = (pre, main, post, *(z for z, planned in zip(zeros, lp.zero_tails) if planned is not None))
    if fast and all(isinstance(x, KernelLaunch) for x in launched):
        lp.compiled = (pre, main, post, *zeros)
    return _sink_sum(part, sink)


def _sink_partials(pre: SmallLaunch, sink: torch.Tensor | None, stats: torch.Tensor):
    """``(part, pointers)``: with sinks (a ``plan.sink_arg``), the buffer of
    the preprocess's partial sums, ``[H, B, blocks]`` (varlen: B sequences;
    each head's partials contiguous: torch's reduction over an inner axis is
    one short kernel, over the outer two it took 15 us on the H200), and the
    pointers ``(sink, part)`` the preprocess takes; without, None and two
    pointers it never reads."""
    if sink is None:
        return None, (stats, stats)
    part = torch.empty((pre.grid[1], pre.grid[2] * pre.grid[0]), dtype=torch.float32, device=stats.device)
    return part, (sink, part)


def _sink_sum(part: torch.Tensor | None, sink: torch.Tensor | None) -> torch.Tensor | None:
    """ds from the preprocess's partials (summed in a fixed order)."""
    return None if part is None else part.sum(dim=1).to(sink.dtype)


def _strides8(*strides: int) -> tuple[int, ...]:
    """Strides in units of 8 elements (see the kernels' ``*8`` parameters)."""
    assert all(st % 8 == 0 for st in strides), strides
    return tuple(st // 8 for st in strides)


def preprocess_launch(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, seqlen_q_rounded: int,
                      block_m: int, varlen=None, sink: bool = False, width: int | None = None) -> SmallLaunch:
    """The preprocess's launch; its pointers are ``(out, dout, lse, delta,
    lse2, dq_accum, cu_seqlens_q, seqused_q, sink, part, order)`` (``sink``: the
    sinks' partial gradients into ``part``, ``[batch, grid[0], H]``; varlen:
    the sequences' order for the main kernel into ``order``, int32 ``[batch]``). Fixed length: BSHD
    ``out``/``dout``, ``lse [B, H, Sq]``, stats ``[B, H, seqlen_q_rounded]``.
    ``varlen = (seqused_q given, batch, max_seqlen_q)``: THD ``out``/``dout``,
    ``lse [H, total_q]``, stats ``[H, seqlen_q_rounded]`` (the padded total).
    ``out`` and ``dout`` are TMA-addressable (strides multiples of 16 bytes
    on every axis of extent above 1); dq_accum's rows are the stats', each
    ``width`` features (the main kernel's head dim; default ``out``'s
    ``plan.kernel_head_dim``)."""
    block = 64
    assert block_m % block == 0 and seqlen_q_rounded % block == 0
    if varlen is None:
        batch, seqlen_q, nheads, head_dim = out.shape
        strides = (*_strides8(*plan.tma_strides(out)[:3], *plan.tma_strides(dout)[:3]), lse.stride(0), lse.stride(1))
        m_blocks = seqlen_q_rounded // block
    else:
        _, batch, max_seqlen_q = varlen
        _, nheads, head_dim = out.shape
        seqlen_q = 0
        so, sdo = plan.tma_strides(out), plan.tma_strides(dout)
        strides = (0, *_strides8(so[0], so[1]), 0, *_strides8(sdo[0], sdo[1]), 0, lse.stride(0))
        # (At least one block: block 0's programs write the order.)
        m_blocks = max(1, triton_cdiv(max_seqlen_q, block_m)) * (block_m // block)
    width = width or plan.kernel_head_dim(head_dim)
    return SmallLaunch(_pre._bwd_preprocess_kernel, (m_blocks, nheads, batch),
                       (*strides, seqlen_q, seqlen_q_rounded, nheads),
                       dict(BLOCK=block, HEAD_DIM=width, BLOCK_M=block_m,
                            VARLEN=varlen is not None, SEQUSED=varlen is not None and varlen[0], SINK=bool(sink),
                            OUT_DIM=plan.narrower_width(head_dim, width)))


def postprocess_launch(dq: torch.Tensor, seqlen_q_rounded: int, scale: float, block_m: int,
                       varlen=None, width: int | None = None) -> SmallLaunch:
    """The postprocess's launch; its pointers are ``(dq_accum, dq,
    cu_seqlens_q, seqused_q)``, ``dq_accum`` ``[rows, D]`` (fixed: rows =
    B·H·seqlen_q_rounded; varlen: H·seqlen_q_rounded). ``dq`` has a
    contiguous head dim and strides that are multiples of 8 elements (a view
    of a packed gradient will do). ``varlen`` and ``width`` (dq_accum's row)
    as ``preprocess_launch``'s."""
    block = 64
    if varlen is None:
        batch, seqlen_q, nheads, head_dim = dq.shape
        strides = _strides8(dq.stride(0), dq.stride(1), dq.stride(2))
        m_blocks = triton_cdiv(seqlen_q, block)
    else:
        _, batch, max_seqlen_q = varlen
        _, nheads, head_dim = dq.shape
        seqlen_q = 0
        strides = (0, *_strides8(dq.stride(0), dq.stride(1)))
        m_blocks = triton_cdiv(max_seqlen_q, block)
    width = width or plan.kernel_head_dim(head_dim)
    return SmallLaunch(_pre._bwd_postprocess_kernel, (m_blocks, nheads, batch),
                       (*strides, seqlen_q, seqlen_q_rounded, nheads, scale),
                       dict(BLOCK=block, HEAD_DIM=width, BLOCK_M=block_m,
                            VARLEN=varlen is not None, SEQUSED=varlen is not None and varlen[0],
                            OUT_DIM=plan.narrower_width(head_dim, width)))


def _small_varlen(varlen):
    """``(cu_seqlens_q, seqused_q, batch, max_seqlen_q)`` as the launches take it."""
    return None if varlen is None else (varlen[1] is not None, varlen[2], varlen[3])


def _small_ptrs(stats: torch.Tensor, varlen):
    if varlen is None:
        return (stats, stats)  # never read
    cu, used = varlen[0], varlen[1]
    return (cu, cu if used is None else used)


def bwd_preprocess(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
                   lse2: torch.Tensor, dq_accum: torch.Tensor, block_m: int, varlen=None,
                   sink: torch.Tensor | None = None, order: torch.Tensor | None = None) -> torch.Tensor | None:
    """The preprocess alone (for scripts and tests): stats ``delta``/``lse2``
    of ``seqlen_q_rounded`` rows per head (their last axis) and ``dq_accum``
    zeroed on the same rows. ``varlen = (cu_seqlens_q, seqused_q, batch,
    max_seqlen_q)``; see ``preprocess_launch``. With ``sink``, returns the
    sinks' gradient (as ``launch_backward``). ``order`` (a scratch tensor if
    None): int32, varlen ``[batch + 1]``, the sequences' order and the main
    kernel's item counter, zeroed; fixed lengths ``[1]``, the counter."""
    launch = preprocess_launch(out, dout, lse, delta.shape[-1], block_m, _small_varlen(varlen), sink is not None,
                               dq_accum.shape[-1])
    part, sink_ptrs = _sink_partials(launch, plan.sink_arg(sink), delta)
    if varlen is None:
        order = torch.empty(1, dtype=torch.int32, device=delta.device) if order is None else order
    elif order is None:
        order = torch.empty(varlen[2] + 1, dtype=torch.int32, device=delta.device)
    launch((out, dout, lse, delta, lse2, dq_accum, *_small_ptrs(delta, varlen), *sink_ptrs, order))
    return _sink_sum(part, sink)


def bwd_postprocess(dq_accum: torch.Tensor, dq: torch.Tensor, scale: float, block_m: int, varlen=None) -> None:
    """The postprocess alone (for scripts): ``dq_accum`` ``[rows, D]``, see
    ``postprocess_launch``; ``varlen`` as ``bwd_preprocess``'s."""
    width = plan.kernel_head_dim(dq.shape[-1])  # dq_accum's rows
    per_head = dq.shape[0] * dq.shape[2] if varlen is None else dq.shape[1]
    launch = postprocess_launch(dq, dq_accum.numel() // (width * per_head), scale, block_m,
                                _small_varlen(varlen))
    launch((dq_accum, dq, *_small_ptrs(dq_accum, varlen)))


def zero_tail_launch(x: torch.Tensor, pair: bool, batch: int) -> SmallLaunch | None:
    """The launch that zeroes the rows of a THD gradient ``x`` (and, with
    ``pair``, of a second one with x's strides) from ``cu_seqlens[-1]`` to
    their end, on the device (``backward_pre._zero_tail_kernel``): no kernel
    of the backward writes them, and the host never learns how many there
    are. Its pointers are ``(x, y or x, cu_seqlens)``, ``cu_seqlens`` int32
    ``[batch + 1]``. ``x`` has a contiguous head dim. None when ``x`` has no
    rows."""
    total, nheads, head_dim = x.shape
    if total == 0:
        return None
    assert x.stride(2) == 1
    block = 64
    return SmallLaunch(_pre._zero_tail_kernel, (triton_cdiv(total, block), 1, 1),
                       (batch, total, *_strides8(x.stride(0), x.stride(1)), nheads),
                       dict(BLOCK=block, HEAD_DIM=plan.kernel_head_dim(head_dim), PAIR=pair,
                            OUT_DIM=plan.narrower_width(head_dim)))


def zero_tail(x: torch.Tensor, y: torch.Tensor | None, cu_seqlens: torch.Tensor) -> None:
    """``zero_tail_launch``'s launch alone (for scripts and tests)."""
    launch = zero_tail_launch(x, y is not None, cu_seqlens.shape[0] - 1)
    if launch is not None:
        assert y is None or y.stride() == x.stride()
        launch((x, x if y is None else y, cu_seqlens))


def workspace_bytes(batch: int, nheads: int, seqlen_q: int, head_dim: int, deterministic: bool = False) -> int:
    """Bytes of fp32/int32 workspace one backward call allocates (fixed
    lengths): dq_accum, Δ and L2, the persistent grid's item counter (one
    int32, zeroed every call, read only on that grid) and, deterministic,
    the semaphores."""
    cfg = BACKWARD_CONFIGS[plan.kernel_head_dim(head_dim)]  # dq_accum's rows are the kernel's head dim wide
    m_tiles = triton_cdiv(seqlen_q, cfg.block_m)
    rows = batch * nheads * m_tiles * cfg.block_m
    return 4 * rows * (cfg.head_dim + 2) + 4 + (4 * batch * nheads * m_tiles if deterministic else 0)


__all__ = ["BackwardConfig", "BACKWARD_CONFIGS", "BACKWARD_HEAD_DIMS", "block_shapes", "grid",
           "kernel_constexprs", "launch_backward", "workspace_bytes"]


def check_head_dim(head_dim: int, head_dim_v: int | None = None) -> None:
    """The backward's head dims: its kernels' own, and the multiples of 8
    below the largest, run on the next one's (``plan.kernel_head_dim``), as
    the forward's; v's (``head_dim_v``) may differ from q's."""
    for d in (head_dim,) if head_dim_v is None else (head_dim, head_dim_v):
        if d not in BACKWARD_CONFIGS and not checks.other_head_dim(d):
            raise NotImplementedError(f"hopper_flash's backward supports head dims {BACKWARD_HEAD_DIMS} and the "
                                      f"multiples of 8 below {max(BACKWARD_HEAD_DIMS)}, got {d}")


def _tma_addressable(t: torch.Tensor) -> bool:
    """The rules ``interface`` applies to q/k/v (``checks.tma_problem``)."""
    return checks.tma_problem("grad_out", t) is None


def check_grad_out_meta(grad_out, out: torch.Tensor) -> None:
    """``grad_out`` must have ``out``'s shape, dtype and device (also checked
    on fake tensors, at trace time)."""
    if not isinstance(grad_out, torch.Tensor):
        raise TypeError(f"grad_out must be a torch.Tensor, got {type(grad_out).__name__}")
    if grad_out.shape != out.shape:
        raise ValueError(f"grad_out must have the output's shape {tuple(out.shape)}, got {tuple(grad_out.shape)}")
    if grad_out.dtype != out.dtype:
        raise ValueError(f"grad_out must have the output's dtype {out.dtype}, got {grad_out.dtype}")
    if grad_out.device != out.device:
        raise ValueError(f"grad_out must be on the output's device {out.device}, got {grad_out.device}")


def check_grad_out(grad_out, out: torch.Tensor) -> torch.Tensor:
    """``grad_out`` as the kernel takes it: checked by ``check_grad_out_meta``;
    a layout TMA cannot address (e.g. the stride-0 expansion that
    ``out.sum().backward()`` produces, or a view starting off a 16-byte
    boundary) is copied into fresh contiguous memory. (``.contiguous()``
    would return a misaligned but contiguous view unchanged.)"""
    check_grad_out_meta(grad_out, out)
    if grad_out.numel() and not _tma_addressable(grad_out):
        grad_out = grad_out.clone(memory_format=torch.contiguous_format)
    return grad_out


def _gradients(q, k, v, grads, alloc):
    """``grads``, or fresh ``alloc`` (``torch.empty`` / ``torch.zeros``) tensors shaped like q, k and v."""
    if grads is not None:
        return grads
    return tuple(alloc(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def backward(grad_out, q, k, v, out, lse, softmax_scale: float, causal: bool, deterministic: bool = False,
             grads=None, window=None, softcap: float = 0.0, sink: torch.Tensor | None = None):
    """dq, dk, dv (contiguous BSHD, like q, k, v) of the attention that
    produced ``out`` and ``lse`` from ``q, k, v`` (already validated by the
    forward). ``grad_out`` is checked here (see ``check_grad_out``).
    ``grads``: ``(dq, dk, dv)`` to write instead, shaped like q, k, v, with
    TMA-addressable strides (views of one packed gradient, say).
    ``sink``: the forward's attention sinks (``[H]``; ``out`` and ``lse``
    sink-normalised): a fourth result, their gradient (``launch_backward``)."""
    check_head_dim(q.shape[3], v.shape[3])
    grad_out = check_grad_out(grad_out, out)
    dq, dk, dv = _gradients(q, k, v, grads, torch.empty)
    if q.numel() == 0 or k.numel() == 0:
        for g in (dq, dk, dv):
            g.zero_()
        return _with_sink((dq, dk, dv), sink)
    if not _tma_addressable(out):
        out = out.clone(memory_format=torch.contiguous_format)  # see check_grad_out
    lse = lse.contiguous()
    with plan.on_device(q):
        ds = launch_backward(grad_out, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, deterministic,
                             window=window, softcap=softcap, sink=sink)
    return _with_sink((dq, dk, dv), sink, ds)


def _with_sink(grads: tuple, sink: torch.Tensor | None, ds: torch.Tensor | None = None) -> tuple:
    """``grads``, and with sinks their gradient ``ds`` (zeros where nothing
    ran: no row saw a key, so none adds to it)."""
    if sink is None:
        return grads
    return (*grads, torch.zeros_like(sink) if ds is None else ds)


def _zero_unwritten(lp: BackwardPlan, dq, dk, dv, varlen: VarlenBatch, stream=None) -> tuple:
    """Zero the gradient rows the varlen kernels do not write. Every row of
    a sequence's live part is written (the postprocess writes dQ's, zeros
    where no key is seen; a KV tile that no query sees stores zero dK and
    dV), and without ``seqused`` the sequences tile the tensor up to
    ``cu_seqlens[-1]``: only the rows past it are left (K/V buffers longer
    than the batch; for q the contract has none), zeroed on the device by
    the plan's launches (``BackwardPlan.zero_tails``). With ``seqused`` the
    gaps inside the slots are not written either: that side is zero-filled
    whole.

    ``stream``: the plan's compiled launches are known (``lp.compiled``);
    launch them directly on it. Returns what each side's launch returned
    (None where it launched nothing), for ``lp.compiled``.

    This leans on the caller's contract (``interface.flash_attn_varlen_func``):
    a sequence longer than ``max_seqlen_*`` or a ``cu_seqlens[0]`` other than
    0 leaves rows unwritten, which now hold whatever the allocation held
    rather than zeros (``check_contract=True`` catches both)."""
    if varlen.seqused_q is not None:
        dq.zero_()
    if varlen.seqused_k is not None:
        dk.zero_()
        dv.zero_()
    sides = ((dq, dq, varlen.cu_seqlens_q), (dk, dv, varlen.cu_seqlens_k))
    launched = []
    for i, (launch, ptrs) in enumerate(zip(lp.zero_tails, sides)):
        if launch is None:
            launched.append(None)
        elif stream is not None:
            launched.append(lp.compiled[3 + i])
            launched[-1](launch.grid, stream, (), ptrs + lp.zero_tail_args[i])
        else:
            launched.append(launch(ptrs))
    return tuple(launched)


def check_grad_out_thd(grad_out, out: torch.Tensor) -> torch.Tensor:
    """``check_grad_out`` for THD tensors."""
    check_grad_out_meta(grad_out, out)
    if grad_out.numel() and not _tma_addressable(grad_out.unsqueeze(0)):
        grad_out = grad_out.clone(memory_format=torch.contiguous_format)
    return grad_out


def backward_varlen(grad_out, q, k, v, out, lse, varlen: VarlenBatch, softmax_scale: float, causal: bool,
                    deterministic: bool = False, grads=None, window=None, softcap: float = 0.0,
                    sink: torch.Tensor | None = None):
    """dq, dk, dv (contiguous THD, like q, k, v) of a varlen forward; rows
    outside every sequence's live part get zero gradients. ``grads``:
    ``(dq, dk, dv)`` to write instead, of any content (dk and dv with equal
    strides; views of one packed gradient, say). ``sink`` as ``backward``'s.

    Where v's head dim differs from k's, the kernel's dK and dV rows (one
    pair of strides, stored by address) are written into two buffers of the
    wider head dim, and the narrower gradient is copied out of its buffer."""
    check_head_dim(q.shape[2], v.shape[2])
    grad_out = check_grad_out_thd(grad_out, out)
    dq, dk, dv = _gradients(q, k, v, grads, torch.empty)
    if q.numel() == 0 or k.numel() == 0:
        for g in (dq, dk, dv):
            g.zero_()
        return _with_sink((dq, dk, dv), sink)
    if not _tma_addressable(out.unsqueeze(0)):
        out = out.clone(memory_format=torch.contiguous_format)  # see check_grad_out
    lse = lse.contiguous()
    dk_w, dv_w = dk, dv
    if dk.shape[2] != dv.shape[2]:
        wide = (*dk.shape[:2], max(dk.shape[2], dv.shape[2]))
        dk_w = dk if dk.shape == wide else torch.empty(wide, dtype=dk.dtype, device=dk.device)
        dv_w = dv if dv.shape == wide else torch.empty(wide, dtype=dv.dtype, device=dv.device)
    with plan.on_device(q):
        ds = launch_backward(grad_out, q, k, v, out, lse, dq, dk_w, dv_w, softmax_scale, causal, deterministic,
                             varlen=varlen, window=window, softcap=softcap, sink=sink)
    if dk_w is not dk:
        dk.copy_(dk_w[..., :dk.shape[2]])
    if dv_w is not dv:
        dv.copy_(dv_w[..., :dv.shape[2]])
    return _with_sink((dq, dk, dv), sink, ds)
