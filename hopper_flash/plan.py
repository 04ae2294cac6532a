"""Host-side planning for the forward kernel: tile shapes per head dim, the
launch grid and tile order, TMA descriptors, and the launch itself.

Kept apart from ``hopper_flash.kernels`` (device code) and from
``hopper_flash.interface`` (argument checks), so each can be read alone.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from functools import lru_cache

import torch
from triton import knobs
from triton.runtime.driver import driver

from . import _triton_support, c_launch, ptx_rings
from .launcher import KernelLaunch, tma_strides

LOG2E = math.log2(math.e)

# Query rows per consumer warpgroup (wgmma's M; kernels/forward.py's WG_M).
WG_ROWS = 64


def launch_maxnreg(consumers: int) -> int:
    """The per-thread register cap at launch (``maxnreg``), before setmaxnreg
    moves registers between partitions: the SM's 64K 32-bit registers over
    the consumer warpgroups and the producer's warp, which is rounded up to a
    warpgroup for register allocation (168 with two consumers, 128 with
    three)."""
    return 65536 // ((consumers + 1) * 128) // 8 * 8


_LAUNCH_MAXNREG = launch_maxnreg(2)
# Hopper's opt-in shared memory per block (227 KB), less room for the
# mbarriers and Triton's own slots.
SMEM_BUDGET_BYTES = 227 * 1024 - 1024


@dataclass(frozen=True)
class ForwardConfig:
    """Compile-time shape of one kernel specialisation."""

    head_dim: int
    # Query rows per tile: 64 per consumer warpgroup, two or three of them.
    block_m: int = 128
    block_n: int = 128
    k_stages: int = 2
    v_stages: int = 2
    # setmaxnreg targets: the seed's setreg_inc(232)/setreg_dec(40); Gluon
    # gives the default partition what the workers leave under maxnreg
    # (168 * 3 - 240 - 24 = 240), so both consumers end with 240.
    consumer_regs: int = 240
    producer_regs: int = 24
    num_warps: int = 4  # the default partition: consumer warpgroup 0
    # A grid of at most one CTA per SM that loops over work items
    # (kernels/scheduler.py) instead of the seed's one CTA per item. On the
    # H200 (2026-11-30, B=4 H=32 bf16, quick_bench, now `hopper-flash bench
    # --variant`) it took D=128 causal S=1024 from 0.86x to 1.02x cuDNN and
    # D=64 S=1024 from 0.79x to 0.94x, and was never more than noise slower
    # (BENCHMARKS.md).
    persistent: bool = True
    maxnreg: int = _LAUNCH_MAXNREG
    # Items whose Q a persistent CTA holds: with 2, the next item's Q loads
    # while this one runs, instead of after its last QK (the consumers waited
    # for it at the start of each item: 5% of B4 H32 S2048 causal, 1% at
    # S8192, scripts/timeline.py). Only where O keeps a buffer of its own.
    q_stages: int = 2

    @property
    def consumers(self) -> int:
        """Consumer warpgroups, 64 query rows each."""
        return self.block_m // WG_ROWS

    @property
    def o_in_q(self) -> bool:
        """Stage O in the consumers' Q rows rather than a buffer of its own.

        A non-persistent CTA loads Q once, so its rows are free for O. A
        persistent one wants them back for the next item's Q while the
        epilogue runs, which takes a separate buffer where it fits (not
        for head dim 256)."""
        return not self.persistent or self._tile_bytes(True, self.q_stages) > SMEM_BUDGET_BYTES

    @property
    def q_ring(self) -> int:
        """Q slots the kernel gets (``Q_STAGES``): one where O is staged in Q's rows."""
        return 1 if self.o_in_q else self.q_stages

    def _tile_bytes(self, with_o: bool, q_stages: int, elem_bytes: int = 2) -> int:
        q_rows = self.block_m * (q_stages + (1 if with_o else 0))
        return self.head_dim * elem_bytes * (q_rows + (self.k_stages + self.v_stages) * self.block_n)

    def shared_bytes(self, elem_bytes: int = 2) -> int:
        """Q's ring, the K and V rings, and O unless it is staged in Q's rows."""
        return self._tile_bytes(not self.o_in_q, self.q_ring, elem_bytes=elem_bytes)


# One entry per supported head dim. D=128 is the seed's configuration.
# - 64: the seed's tiles; S and P cost as much as for D=128 but the GEMMs half
#   as much, so this head dim is softmax-bound. Long plain prefill runs
#   WIDE_CONFIGS[64] instead (choose_wide).
# - 256: O alone takes 128 registers per consumer thread and a 128x256 K or V
#   tile 64 KB, so KV tiles are 64 rows: S is 32 registers and two stages of
#   K and V plus Q fit in 192 KB.
CONFIGS: dict[int, ForwardConfig] = {
    64: ForwardConfig(head_dim=64),
    128: ForwardConfig(head_dim=128),
    256: ForwardConfig(head_dim=256, block_n=64),
}
SUPPORTED_HEAD_DIMS = tuple(sorted(CONFIGS))


def kernel_head_dim(head_dim: int, head_dim_v: int | None = None) -> int:
    """The head dim whose kernels serve ``head_dim``: itself where it is one
    of ``SUPPORTED_HEAD_DIMS``, else the next one up (``checks`` admits the
    multiples of 8 below the largest). With ``head_dim_v`` (v's head dim,
    where it differs from q's and k's), the kernels that serve the wider of
    the two: both run on them as they are, as a narrower head dim does. The forward runs such a head dim on
    those kernels as it is: TMA's boxes span the kernel's head dim, read
    zeros past the tensor's last feature (q and k then add nothing to the
    scores, v gives output features nobody reads) and clip the stores there;
    the few stores and loads by address take the narrower width: varlen's O
    (``Mode.o_dim``) and dK/dV (``plan_backward.kernel_constexprs``'s
    ``o_dim``), the combine's and the backward's small kernels' ``OUT_DIM``,
    the append's ``head_dim``. Gathered pages are not served (``gathers``'s
    callers copy them instead)."""
    if head_dim_v is not None and head_dim_v > head_dim:
        head_dim = head_dim_v
    return head_dim if head_dim in CONFIGS else min(d for d in SUPPORTED_HEAD_DIMS if d >= head_dim)


def out_shape(q, v) -> torch.Size:
    """The attention output's shape: q's, with v's head dim (they may
    differ: ``kernel_head_dim``)."""
    return q.shape if q.shape[-1] == v.shape[-1] else torch.Size((*q.shape[:-1], v.shape[-1]))


def narrower_width(head_dim: int, width: int | None = None) -> int:
    """What the kernels storing by address take as a tensor's row width
    (``Mode.o_dim``, the backward's ``o_dim``, the small kernels'
    ``OUT_DIM``): ``head_dim`` where narrower than the kernel's rows
    (``width``; default ``kernel_head_dim(head_dim)``), else 0 (the rows'
    own, and the kernels compiled for the native head dims)."""
    return head_dim if head_dim < (kernel_head_dim(head_dim) if width is None else width) else 0


def wide_configs(triton_version: str) -> dict[int, ForwardConfig]:
    """Three consumer warpgroups on 192-row tiles, per head dim: FA3's tiles
    for head dim 64, where the softmax bounds the step (while one warpgroup
    runs its softmax, two keep the tensor cores busy, and each K/V tile serves
    192 rows). 160 registers per consumer (S 64, P 32, O 32), the producer
    32: 3 x 160 + 32 + the padding warps' share = 4 x 128 at launch.

    Spill-free under triton 3.6-3.8. Under 3.9 (its ptxas) the write-LSE
    kernels spill 88-112 bytes at 160 registers, so there are none there."""
    minor = _triton_support.parse_minor(triton_version)
    if minor is not None and minor >= (3, 9):
        return {}
    return {64: ForwardConfig(head_dim=64, block_m=3 * WG_ROWS, consumer_regs=160, producer_regs=32,
                              maxnreg=launch_maxnreg(3))}


# The wide form of a shipped config, for plain prefill long enough to gain
# from it (choose_wide). Keyed by the config itself: a variant config (the
# test suite's or the benchmark's --variant) has no wide form and runs as given.
WIDE_CONFIGS: dict[int, ForwardConfig] = wide_configs(_triton_support.installed_version())
_WIDE_OF = {CONFIGS[d]: cfg for d, cfg in WIDE_CONFIGS.items()}

# Mean keys per query row from which the wide tiles run: the H200 (D=64, B8
# H32, bf16, tenth/eleventh sessions, BENCHMARKS.md) measured them 9% faster
# non-causal at S8192 and 2% at S2048 but 7% slower at S1024; causal 4-5%
# faster at S8192 (mean 4096 keys per row) but 3% slower at S4096 and 40%
# slower at S1024-2048, where the short causal items cost more than the
# wider tile saves (cause not found: BENCHMARKS.md).
# Only query lengths of at least WIDE_MIN_ROWS were measured (a short query
# leaves most of a 192-row tile empty).
WIDE_MIN_KEYS_FULL = 2048
WIDE_MIN_KEYS_CAUSAL = 4096
WIDE_MIN_ROWS = 2048


def choose_wide(seqlen_q: int, seqlen_k: int, causal: bool) -> bool:
    """Whether plain prefill runs the wide tiles (``WIDE_CONFIGS``): when the
    query is at least ``WIDE_MIN_ROWS`` long and a query row sees, on
    average, at least ``WIDE_MIN_KEYS_*`` keys."""
    if seqlen_q < WIDE_MIN_ROWS:
        return False
    if not causal:
        return seqlen_k >= WIDE_MIN_KEYS_FULL
    # Bottom-right causal: row r sees min(seqlen_k, r + 1 + seqlen_k - seqlen_q) keys.
    first = seqlen_k - seqlen_q + 1
    mean = seqlen_k - (seqlen_q - 1) / 2 if first >= 1 else seqlen_k * (seqlen_k + 1) / (2 * seqlen_q)
    return mean >= WIDE_MIN_KEYS_CAUSAL


SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def config_variant(spec: str) -> dict:
    """Parse ``"field=value,..."`` (ints, ``True``/``False``) into ForwardConfig
    fields: how the test suite, the sanitizer cases and ``hopper-flash bench
    --variant`` name a kernel variant to run instead of the shipped one."""
    fields = dict(item.split("=", 1) for item in spec.split(",") if item)
    return {k: (v == "True") if v in ("True", "False") else int(v) for k, v in fields.items()}


def use_variant(spec: str) -> dict:
    """Replace every head dim's config by its ``spec`` variant; returns the fields."""
    fields = config_variant(spec)
    for head_dim, cfg in CONFIGS.items():
        CONFIGS[head_dim] = replace(cfg, **fields)
    return fields


@dataclass(frozen=True)
class Mode:
    """The decode / KV-cache switches of the forward kernel (kernels/forward.py).

    ``Mode()`` is plain prefill over exact-length BSHD K and V."""

    # PackGQA: the query rows of the pack_g heads sharing a KV head share one
    # tile (1 = off). A power of two dividing 64 is loaded from q as it is
    # (the box [1, 64 / g, g, D]); any other group from q packed by the host
    # (``pack_view``).
    pack_g: int = 1
    # PackGQA from Q packed by the host (``packed_q``: ``[B, Sq * g, Hkv,
    # D]``; kernels/forward.py, ``PACK_VIEW``), O stored by address.
    pack_view: bool = False
    # A packed view of a packed batch with one query per sequence
    # (``max_seqlen_q`` 1): q restrided by token, ``[total_q, g, Hkv, D]``,
    # no copy (``kernel_q``; kernels/forward.py, ``Q_TOKENS``).
    q_tokens: bool = False
    # A packed view copied by the kernel, row by row from q itself (of the
    # kernel's head dim, a token's heads adjacent, its tokens a whole number
    # of head dims apart: ``rows_of_q``; kernels/forward.py, ``Q_ROWS``): no
    # packed copy of q, at any query length of a packed batch, past one
    # query per row of a fixed-length one.
    q_rows: bool = False
    # Split-KV: fp32 partials merged by kernels/combine.py.
    split: bool = False
    # A split count per sequence (varlen, skewed keys): the items run over a
    # device-written table (kernels/split_table.py, varlen_split_table).
    split_table: bool = False
    # Per-batch key lengths from an int32 device tensor; K/V a cache whose
    # tail past the live length is never trusted.
    seqused: bool = False
    # cache_batch_idx: batch b reads cache row kv_batch[b].
    kv_batch: bool = False
    # Paged K/V [num_pages, page_size, Hkv, D]: page_size a multiple of block_n, a power of two
    # from 16 up dividing it (one TMA box per page, plan.block_shapes), or a smaller power of two
    # (GATHER_PAGE: tiles copied row by row); 0 = not paged.
    page_size: int = 0
    # Packed (THD) batches: per-sequence offsets from cu_seqlens (flash_attn_varlen_func);
    # ``seqused`` then means seqused_k, ``seqused_q`` the query side's.
    varlen: bool = False
    seqused_q: bool = False
    # Work items drawn from an atomic counter, longest first (kernels/scheduler.py); see choose_dynamic.
    dynamic: bool = False
    # Sliding window (flash-attn's window_size, causal folded in as right = 0): row r sees keys
    # r + off - window_left .. r + off + window_right; -1 leaves a side unbounded.
    window_left: int = -1
    window_right: int = -1
    # Logit soft-capping (flash-attn's softcap > 0; kernel_scales gives the scalars).
    softcap: bool = False
    # Attention sinks (flash-attn's learnable_sink, sinks.py): the dtype the
    # kernels read them in (sink_arg; "" for none). The kernel's normaliser
    # takes them, or (split) the combine's.
    sink: str = ""
    # Every CTA of the launch runs exactly one work item: plain prefill dealt
    # statically with no more items than SMs (chunked prefill's short query
    # against a long cache). Set only for the configs whose kernel reads it
    # (takes_one_item; kernels/forward.py, ``V_AT_ISSUE``), for at most
    # ONE_ITEM_MAX_KV_TILES KV tiles, and not with soft-capping or sinks
    # (_plan_launch).
    one_item: bool = False
    # Varlen's O, stored by address, where its head dim is narrower than the
    # kernel's (kernel_head_dim); 0: the kernel's. The other modes' O and
    # partials need none (a TMA store clips; the partials are the kernel's).
    o_dim: int = 0
    # flash-attn's cache_leftpad (with seqused, no pages): batch b's keys
    # start at row leftpad[b] of its cache row (the kernel's cu_k_ptr).
    leftpad: bool = False
    # Launched by programmatic dependent launch (launched_dependent). A
    # split run is launched so whether or not this is set (``pdl``).
    dependent: bool = False

    @property
    def pdl(self) -> bool:
        """Launched by programmatic dependent launch: the kernel's
        ``DEPENDENT`` (its partitions wait for the grid before it) and the
        launch's ``launch_pdl`` (forward_compile_options)."""
        return self.split or self.dependent

    @property
    def box_g(self) -> int:
        """Heads in a Q/O TMA box (``block_shapes``): the group where the box
        packs it, else 1 (a packed view's box is the plain one)."""
        return 1 if self.pack_view else self.pack_g

    @property
    def kernel_sink(self) -> bool:
        """The forward kernel's ``SINK``: a split run's sink is the combine's."""
        return bool(self.sink) and not self.split


PREFILL = Mode()


def kernel_scales(softmax_scale: float, softcap: float = 0.0) -> tuple[float, float]:
    """The forward kernel's ``(qk_scale, softmax_scale)`` scalars:
    ``(scale * log2(e), scale)``, or with logit soft-capping at ``softcap``
    (``Mode.softcap``; the scores are ``cap * tanh(scale * s / cap)``)
    ``(scale / cap, cap)``: tanh's argument scale, and the scale of its output
    (kernels/softmax.py)."""
    if softcap:
        return softmax_scale / softcap, softcap
    return softmax_scale * LOG2E, softmax_scale


# Pages shorter than this many keys are loaded as more TMA boxes per KV tile
# than the producer's 24 registers hold the page lookups of (register_split).
SMALL_PAGE_KEYS = 32
# Pages shorter than this many keys are gathered row by row by a producer
# warpgroup (kernels/forward.py, Mode.GATHER): a box per page would be 16 or
# more per tile (pages of 8 spilled the producer even at 56 registers).
GATHER_PAGE = 16


def gathers(page_size: int, head_dim: int) -> bool:
    """Whether a paged cache of ``page_size`` keys per page is gathered by
    the kernel: head dims 64 and 128 (at 256, with the LSE, ptxas spills a
    value across the four-warp producer's entry; those pages stay copied)."""
    return 0 < page_size < GATHER_PAGE and head_dim <= 128


def contiguous_pools(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether paged K and V pools can be gathered from in place: the kernel
    reads pool rows as ``(page * page_size + key) * Hkv + head``, so a
    strided pool (a slice of a wider one) cannot (``cache_layout.page_plan``
    copies those first; ``launch_forward`` refuses them)."""
    return k.is_contiguous() and v.is_contiguous()


def register_split(cfg: ForwardConfig, mode: Mode = PREFILL) -> tuple[int, int]:
    """``(CONSUMER_REGS, PRODUCER_REGS)`` for a config in a mode: the
    config's, except for pages of fewer than ``SMALL_PAGE_KEYS`` keys, where
    the producer issues a box per page (eight per 128-key tile at 16 keys)
    and spilled at 24 registers (8-24 bytes at head dims 128 and 256 on the
    CPU census), or gathers rows (a warpgroup of address arithmetic): it
    gets 16 more and each consumer 8 fewer, the same total
    under the launch's maxnreg (consumer 0, the default partition, gets what
    the workers leave: 168 * 3 - 232 - 40 = 232), spill-free at every head
    dim."""
    if 0 < mode.page_size < SMALL_PAGE_KEYS:
        return cfg.consumer_regs - 8, cfg.producer_regs + 16
    return cfg.consumer_regs, cfg.producer_regs


@lru_cache(maxsize=None)
def kernel_constexprs(cfg: ForwardConfig, causal: bool, write_lse: bool, mode: Mode = PREFILL) -> dict:
    """The constexpr arguments of ``attention_forward_kernel`` for a config."""
    consumer_regs, producer_regs = register_split(cfg, mode)
    return dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        HEAD_DIM=cfg.head_dim,
        K_STAGES=cfg.k_stages,
        V_STAGES=cfg.v_stages,
        IS_CAUSAL=bool(causal),
        WRITE_LSE=bool(write_lse),
        CONSUMER_REGS=consumer_regs,
        PRODUCER_REGS=producer_regs,
        PERSISTENT=cfg.persistent,
        O_IN_Q=cfg.o_in_q,
        PACK_G=mode.pack_g,
        SPLIT=mode.split,
        SEQUSED=mode.seqused,
        KV_BATCH=mode.kv_batch,
        PAGE_SIZE=mode.page_size,
        VARLEN=mode.varlen,
        SEQUSED_Q=mode.seqused_q,
        DYNAMIC=mode.dynamic,
        Q_STAGES=cfg.q_ring,
        WINDOW_LEFT=mode.window_left,
        WINDOW_RIGHT=mode.window_right,
        SOFTCAP=mode.softcap,
        SINK=mode.kernel_sink,
        RING_PTX=ptx_rings.version_for(cfg.head_dim),
        ONE_ITEM=mode.one_item,
        O_DIM=mode.o_dim,
        LEFTPAD=mode.leftpad,
        PACK_VIEW=mode.pack_view,
        Q_TOKENS=mode.q_tokens,
        Q_ROWS=mode.q_rows,
        SPLIT_TABLE=mode.split_table,
        DEPENDENT=mode.pdl,
    )


def block_shapes(cfg: ForwardConfig, pack_g: int = 1, page_size: int = 0) -> dict[str, list[int]]:
    """TMA boxes over the rank-4 ``[B, S, H, D]`` view: one head, ``rows`` of
    the sequence, the whole head dim. Q and O move per consumer warpgroup (64
    rows); under PackGQA a Q/O box holds ``64 / g`` query rows of ``g``
    adjacent heads, which in BSHD is exactly the packed (head-fastest) tile
    (``pack_g``: 1 for the plain box, also that of a packed view, ``Mode.box_g``).
    K and V move a tile at a time, or a page at a time where pages are
    shorter than a tile (``page_size``; the kernel then loads one box per
    page of a tile); gathered pages (``gathers``) keep a tile's box, which
    then only lays out the tile in shared memory."""
    kv_rows = min(cfg.block_n, page_size) if page_size and not gathers(page_size, cfg.head_dim) else cfg.block_n
    return {
        "q": [1, WG_ROWS // pack_g, pack_g, cfg.head_dim],
        "k": [1, kv_rows, 1, cfg.head_dim],
        "v": [1, kv_rows, 1, cfg.head_dim],
        "o": [1, WG_ROWS // pack_g, pack_g, cfg.head_dim],
    }


@lru_cache(maxsize=None)
def _smem_layout(block_shape: tuple[int, ...], gl_dtype_name: str):
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(block_shape), getattr(gl, gl_dtype_name))


_GL_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def smem_layout(block_shape, torch_dtype):
    return _smem_layout(tuple(block_shape), _GL_DTYPE[torch_dtype])


# Work items (query tiles x heads x batch) are numbered in int32 inside the
# kernel, and the non-persistent grid has one CTA per item on grid axis x,
# whose CUDA limit is the same number.
MAX_WORK_ITEMS = 2**31 - 1


def work_items(batch: int, nheads: int, seqlen_q: int, cfg: ForwardConfig, mode: Mode = PREFILL,
               num_splits: int = 1) -> int:
    """(query tile, split, head, batch) items; under PackGQA a head is a KV head."""
    return triton_cdiv(seqlen_q * mode.pack_g, cfg.block_m) * num_splits * (nheads // mode.pack_g) * batch


def deal(items: int, cfg: ForwardConfig, device: int | None = None) -> tuple[int, int]:
    """(grid size, items dealt per turn) for ``items`` work items.

    Non-persistent: one CTA per item. Persistent: one per SM of ``device``
    (default: the current one), at most one per group of items dealt
    together. Items are dealt singly when there are no more than SMs: each
    SM gets one item, where pairs would have left half of them idle (128
    items on 64 of 132 SMs). With more items than SMs they go in zig-zag
    pairs even below two per SM: a CTA with two single items could get the
    two longest causal tiles (2n tile-steps), a pair costs n + 1."""
    if not cfg.persistent:
        return items, 1
    sms = sm_count(device)
    pair = 2 if items > sms else 1
    return min(sms, triton_cdiv(items, pair)), pair


# A split run gets one CTA per split item up to this many per SM: deal_split.
SPLIT_GRID_MAX_WAVES = 8


def deal_split(items: int, cfg: ForwardConfig, device: int | None = None) -> tuple[int, int]:
    """``deal`` for the ``items`` of a split-KV run: one CTA per item, dealt
    by the hardware as SMs free up, up to ``SPLIT_GRID_MAX_WAVES`` per SM
    (past that, each CTA's start is a cost, and in the varlen mode most
    such items have no rows); else ``deal``. The split rule
    (``choose_num_splits``, FA3's) counts waves of single items; dealt in
    pairs, 96 packed 128-row items split 4 ways ran
    two pairs (64 KV tiles) on 60 of 132 SMs, as long as no split at all
    (H28/4 at 96 queries over 8192 keys: 134.5 us split, 105.6 unsplit on an
    H100, BENCHMARKS.md sixty-third session). In the varlen mode the static
    deal's fixed stride also put three long decodes' 96 split items on 33 of
    the 132 SMs (their live tiles lie ``max_seqlen_q``'s tile count apart):
    313 -> 229 us on an H100 (fifty-seventh session)."""
    if cfg.persistent and items <= SPLIT_GRID_MAX_WAVES * sm_count(device):
        return items, 1
    return deal(items, cfg, device)


# ---- Decode heuristics (FA3's rules, shared/notes/varlen-decode.md §5-6) ----

def packable(group: int) -> bool:
    """Whether the TMA box ``[1, 64/g, g, D]`` packs a group from q as it is
    (a power of two dividing 64, g > 1). Other groups pack from a packed
    view (``packed_q``, ``Mode.pack_view``)."""
    return 1 < group <= 64 and not group & (group - 1)


def packs_by_view(group: int) -> bool:
    """Whether a group packs only from a packed view of q (``pack_layout``):
    more than one head, no TMA box over it (``packable``). The launchers ask
    it before reading q's layout (``rows_of_q``): host time per call."""
    return group > 1 and not packable(group)


def choose_pack_gqa(seqlen_q: int, group: int, block_m: int = 128) -> bool:
    """Pack when the query tiles fill better packed: fill(Sq) < 0.9 fill(Sq * g)
    (FA3's rule), for any group g > 1."""
    if group <= 1:
        return False

    def fill(rows):
        return rows / (triton_cdiv(rows, block_m) * block_m)

    return fill(seqlen_q) < 0.9 * fill(seqlen_q * group)


def choose_varlen_pack_gqa(group: int) -> bool:
    """PackGQA for a packed (varlen) batch, whose query lengths the host does
    not know: FA3's rule, always (g > 1). A decode-like sequence (a few query
    rows) then reads each K/V tile once per KV head instead of once per
    query head; a long one costs about the same. (A group that is not a
    power of two packs from a copy of q: ``launch_forward_varlen`` weighs
    it first, ``choose_varlen_view``.)"""
    return group > 1


def choose_varlen_view(total_q: int, batch: int, max_seqlen_q: int, max_seqlen_k: int, total_k: int,
                       group: int) -> bool:
    """Whether a packed batch (host values only) packs a group that is not
    a power of two, whose pack reads a packed copy of q (``packed_q``):
    where the K/V bytes the pack saves on the batch's decode steps exceed
    the copy's. The batch is modelled as a serving engine's: chunks of
    ``max_seqlen_q`` queries (as many as the query rows beyond one per
    sequence allow) and one-query decodes over the mean key count
    (``total_k``: k's rows; 0 where paged, then half of ``max_seqlen_k``).
    Per query head and 4·D bytes: unpacked, a decode step reads each of
    its keys' K and V row, packed ``1/g`` of them; the copy reads and
    writes each query row of q once. A chunk's K/V reads hide under its
    tensor work packed or not (FA3 packs every varlen batch). One query
    per sequence needs no copy (``Mode.q_tokens``): always. A q the kernel
    reads row by row (``Mode.q_rows``) needs none either, but the rule
    still weighs the copy there (``VIEW_ROWS_ALWAYS`` aside): the model
    takes a prefill batch of varied lengths for chunks beside decodes, and
    such batches ran 5-12% slower packed at head dim 64 (seventy-first
    session)."""
    if max_seqlen_q <= 1:
        return True
    chunks = min(batch, max(0, total_q - batch) // max(1, max_seqlen_q - 1))
    decodes = batch - chunks
    decode_keys = total_k / batch if total_k else max_seqlen_k / 2
    return decodes * decode_keys * (group - 1) / group > total_q


# The head dim at which a causal packed batch whose q the kernel reads by
# rows (Mode.q_rows) packs a group that is not a power of two whatever its
# lengths, as FA3 packs every varlen batch (presumably since a tile of
# 128 / g queries of g heads wastes less of the causal diagonal than 128
# queries of one head; not traced).
# On an H100, 16 prefill sequences of 512..8192 tokens (no decode) at 40/8
# and 28/4 ran packed 1.07x and 1.04x faster than the default unpacked
# (6914 / 5887 us against 7385 / 6120, three processes each), and on
# another such batch 0.995x and 1.047x (one process; seventy-first
# session, BENCHMARKS.md). Head dim 64 ran 0.88-0.95x packed (its long
# unpacked batches take the 192-row wide tiles, a packed view does not),
# non-causal head dim 128 1.00x and 1.07x: both keep choose_varlen_view.
VIEW_ROWS_ALWAYS = 128

# Head dims whose kernels take a packed view without spilling (the compile
# census, triton 3.6: head dim 256's varlen kernel with a group of 5, the LSE
# and the dynamic order spilled 16 B; its groups that are not powers of two
# stay unpacked).
VIEW_HEAD_DIMS = (64, 128)


def pack_layout(pack_gqa: bool | None, group: int, seqlen_q: int, cfg: ForwardConfig, by_address: bool = True,
                varlen: bool = False) -> tuple[int, bool]:
    """``(Mode.pack_g, Mode.pack_view)`` of a launch: PackGQA as asked
    (``pack_gqa``; None: ``choose_pack_gqa``, or ``choose_varlen_pack_gqa``
    for a packed batch), a power-of-two group dividing 64 from q as it is,
    any other from a packed view of q where O can be stored by address
    (``by_address``: a contiguous O of the kernel's head dim; always in a
    packed batch) and the head dim's kernels take it (``VIEW_HEAD_DIMS``).
    ``(1, False)``: unpacked."""
    if pack_gqa is None:
        pack_gqa = choose_varlen_pack_gqa(group) if varlen else choose_pack_gqa(seqlen_q, group, cfg.block_m)
    if pack_gqa and packable(group):
        return group, False
    if pack_gqa and group > 1 and (by_address or varlen) and cfg.head_dim in VIEW_HEAD_DIMS:
        return group, True
    return 1, False


def packed_q(q: torch.Tensor, group: int) -> torch.Tensor:
    """Q as a packed view's kernel reads it (``Mode.pack_view``): ``[B, Sq *
    g, Hkv, D]``, row ``s * g + j`` of KV head ``hk`` being query ``s`` of
    head ``hk * g + j``. At one query per row that is q itself, restrided
    (``(H·D, D, g·D, 1)`` for a contiguous q); longer blocks take a copy."""
    batch, seqlen_q, nheads, head_dim = q.shape
    if seqlen_q == 1:  # a decode step's: one view op (host time of every step), not three
        sb, _, sh, sd = q.stride()
        return q.as_strided((batch, group, nheads // group, head_dim), (sb, sh, group * sh, sd))
    return q.unflatten(2, (nheads // group, group)).transpose(2, 3).reshape(batch, seqlen_q * group, -1, head_dim)


def kernel_q(q: torch.Tensor, mode: Mode) -> torch.Tensor:
    """The tensor of the kernel's Q descriptor: q, or its packed view (a
    packed batch's ``[1, total_q, H, D]`` by token with ``Mode.q_tokens``:
    ``[total_q, g, Hkv, D]``, no copy; with ``Mode.q_rows`` q itself, the
    kernel reading the packed rows from it)."""
    if mode.q_tokens:
        return packed_q(q.transpose(0, 1), mode.pack_g)
    if mode.q_rows:  # the kernel copies the packed rows; the descriptor only lays out its parts
        return q
    return packed_q(q, mode.pack_g) if mode.pack_view else q


def rows_of_q(q: torch.Tensor, cfg: ForwardConfig) -> bool:
    """Whether a kernel can copy a packed view's rows from q itself
    (``Mode.q_rows``): q ``[total_q, H, D]`` (a packed batch) or ``[B, Sq,
    H, D]`` of the kernel's head dim, 16-byte aligned (its cp.async width),
    a token's heads adjacent and its tokens a whole number of head dims
    apart (``q_row_heads``; a fixed-length batch's rows one after another):
    contiguous, or a slice of a fused QKV projection's output. Others (heads
    interleaved with something else, a transposed layout) take the packed
    copy (``packed_q``)."""
    head_dim = q.shape[-1]
    if head_dim != cfg.head_dim or q.stride(-1) != 1 or q.stride(-2) != head_dim or q.data_ptr() % 16:
        return False
    if q.stride(-3) % head_dim or q.stride(-3) >= 1 << 24:  # (a part's row offsets are int32: 65 tokens' worth)
        return False
    return q.dim() == 3 or q.shape[0] == 1 or q.stride(0) == q.shape[1] * q.stride(1)


def q_row_heads(q: torch.Tensor) -> int:
    """The kernel's ``q_heads`` for ``Mode.q_rows``: q's token stride in head
    dims (its head count where contiguous; ``rows_of_q``)."""
    return q.stride(-3) // q.shape[-1]


def choose_dynamic(items: int, n_tiles: int, causal: bool, varlen: bool, sms: int) -> bool:
    """Whether a persistent launch draws its work items from a counter
    (kernels/scheduler.py) instead of the static deal.

    Varlen batches always (their items differ in cost with the sequences'
    lengths, and one order keeps one specialisation); causal prefill where
    items differ in cost and there is more than one wave, with at least 16
    query tiles (costs 1..16+ KV tiles), or fewer where the static deal would
    load its busiest CTA ``STATIC_IMBALANCE_LIMIT`` times the best any order
    could (``static_deal_imbalance``). Otherwise a static deal's last wave
    costs little, and the counter's per-call zeroing (a memset launch) would
    cost more than it gains on calls this short."""
    if varlen:
        return True
    if items <= sms or not causal:
        return False
    return n_tiles >= 16 or static_deal_imbalance(items // n_tiles, n_tiles, sms) > STATIC_IMBALANCE_LIMIT


STATIC_IMBALANCE_LIMIT = 1.1


def static_deal_imbalance(heads: int, n_tiles: int, sms: int) -> float:
    """The static deal's busiest CTA over the best any order could do (the
    mean load per CTA, or the longest item), for ``heads`` (head, batch)
    pairs of ``n_tiles`` causal query tiles each, on a square causal cost
    model: tile ``bm`` costs its ``bm + 1`` KV-tile steps plus about one step
    of prologue and epilogue. The deal (scheduler.work_coords) gives CTA
    ``c`` the item pairs ``c, c + ctas, ...``, zig-zag inside a head. It goes
    wrong in two ways: with an odd tile count pairs straddle heads, and when
    the pairs per two heads divide the CTA count those pairs all land on the
    same CTAs (11 tiles on 132 SMs: 1.4x; wide tiles at B8 H32 S2048, 11
    tiles of 192 rows, measured 527 us static against 386 us in the dynamic
    order on the H200, the model's 1.37x); and a last round of pairs that
    few CTAs run (B4 H8 at 9 tiles: 2.1x)."""
    items = n_tiles * heads
    pair = 2 if items > sms else 1
    ctas = min(sms, triton_cdiv(items, pair))
    i = torch.arange(items)
    j = i % n_tiles
    bm = torch.where(j % 2 == 0, n_tiles - 1 - j // 2, j // 2) if pair == 2 else n_tiles - 1 - j
    load = torch.zeros(ctas, dtype=torch.float64).index_add_(0, (i // pair) % ctas, (bm + 2).to(torch.float64))
    return load.max().item() / max(load.sum().item() / ctas, n_tiles + 1)


# Bytes of K and V that an L2 section of heads may hold (FA3's figure, of the H200's 50 MB).
L2_SECTION_BYTES = 32 * 1024 * 1024


def heads_in_l2(head_bytes: int) -> int:
    """The largest power of two of heads whose ``head_bytes`` each fit in
    ``L2_SECTION_BYTES`` together; at least 1."""
    fit = max(1, L2_SECTION_BYTES // max(1, head_bytes))
    return 1 << (fit.bit_length() - 1)


def l2_section(seqlen_k: int, head_dim: int, elem_bytes: int, group: int) -> int:
    """Query heads per section of the dynamic order: as many KV heads as keep
    their K and V in L2 (``heads_in_l2``), times the heads that share one KV
    head (they read the same K and V)."""
    return heads_in_l2(max(1, seqlen_k) * 2 * head_dim * elem_bytes) * group


def window_tiles(window_left: int, window_right: int, seqlen_q: int, cfg: ForwardConfig) -> int:
    """KV tiles a query tile can read under a sliding window whose left side
    is bounded: its rows' keys span ``left + rows + right`` columns."""
    span = window_left + min(seqlen_q, cfg.block_m) + max(window_right, 0)
    return triton_cdiv(span, cfg.block_n) + 1


def choose_num_splits(tiles: int, n_blocks: int, sms: int) -> int:
    """Split count for ``tiles`` (query tile, head, batch) items over
    ``n_blocks`` KV tiles: none when the items (nearly) fill the GPU or the
    keys are few; else the smallest count whose wave efficiency is within
    0.85 of the best (FA3's rule), raised, where that count runs in one
    partial wave, to the most that still fit in one (``_fill_splits``)."""
    if tiles >= 0.8 * sms or n_blocks <= 4:
        return 1
    max_splits = min(128, sms, n_blocks)
    effs = []
    for s in range(1, max_splits + 1):
        waves = tiles * s / sms
        effs.append(waves / math.ceil(waves))
    best = max(effs)
    splits = next(s for s, e in enumerate(effs, 1) if e >= 0.85 * best)
    return max(splits, _fill_splits(tiles, n_blocks, sms, max_splits)) if tiles * splits <= sms else splits


# KV tiles each split must keep for the single-wave fill (_fill_splits).
FILL_MIN_TILES_PER_SPLIT = 16


def _fill_splits(tiles: int, n_blocks: int, sms: int, max_splits: int) -> int:
    """The most splits of ``tiles`` items that fit one wave, where each
    split keeps at least ``FILL_MIN_TILES_PER_SPLIT`` KV tiles; else 0.
    Timed on the H200 (BENCHMARKS.md, twenty-third session,
    ``scripts/decode_splits.py --fill``): B=1, 8 KV heads at 65536 keys, 16
    splits (32 tiles each, 128 SMs) ran 2.5% faster than FA3's 15 (120
    SMs); where the splits were shorter (4 to 15 tiles: fewer heads, or
    16384 keys) the fuller wave gained nothing, and at 4 tiles a split it
    lost 4%."""
    fill = min(max_splits, sms // tiles)
    return fill if n_blocks >= FILL_MIN_TILES_PER_SPLIT * fill else 0


@lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def sm_count(device: int | None = None) -> int:
    return _sm_count(torch.cuda.current_device() if device is None else device)


_CURRENT_DEVICE = contextlib.nullcontext()


# torch.cuda.current_device() without its lazy-init check (a CUDA tensor to
# launch on means CUDA is initialised): two Python frames fewer per launch.
# CPU builds of torch have no _cuda_getDevice and keep the public function.
current_device = getattr(torch._C, "_cuda_getDevice", None) or (lambda: torch.cuda.current_device())


def on_device(t: torch.Tensor):
    """A guard making ``t``'s device current for a launch, or none where it
    is current already (the common case, and autograd's device thread): the
    guard's switch and restore are host time on every call."""
    device = t.device
    return _CURRENT_DEVICE if device.index == current_device() else torch.cuda.device(device)


# The dtypes the kernels read attention sinks in (others become float32).
SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def sink_in_place(sink: torch.Tensor) -> bool:
    """Whether the kernels read ``sink`` (``[H]``) where it is: one of
    ``SINK_DTYPES``, contiguous and 16-byte aligned (Triton specialises
    pointers on it, and the compiled kernels are cached without that bit)."""
    return sink.dtype in SINK_DTYPES and sink.is_contiguous() and sink.data_ptr() % 16 == 0


def sink_arg(sink: torch.Tensor | None) -> torch.Tensor | None:
    """Attention sinks as the kernels read them: ``sink`` itself where
    ``sink_in_place``, else a float32 copy that is (a model's bf16 sinks are
    read as they are: no conversion launch per call)."""
    if sink is None:
        return None
    sink = sink.detach()
    if sink_in_place(sink):
        return sink
    copy = sink.float().contiguous()
    return copy if copy.data_ptr() % 16 == 0 else copy.clone()


def sink_mode(sink: torch.Tensor | None) -> str:
    """``Mode.sink`` for a ``sink_arg``'s result."""
    return "" if sink is None else str(sink.dtype).removeprefix("torch.")


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _descriptor(t: torch.Tensor, block_shape: list[int]):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(tma_strides(t)), block_shape, smem_layout(block_shape, t.dtype))


def _launch_hooked() -> bool:
    """True when a profiler put a launch hook on Triton (a HookChain in 3.6)."""
    hook = knobs.runtime.launch_enter_hook
    return bool(getattr(hook, "calls", hook))


# Whether later launches may call the compiled kernel's launcher directly
# (a private triton interface; _triton_support says on which versions its
# calling convention was checked). Elsewhere every launch goes through the JIT.
FAST_LAUNCH = _triton_support.fast_launch_supported()


def compile_options(cfg, launch_pdl: bool = False) -> dict:
    """Triton compile options of a config (forward, or the backward's
    ``plan_backward.BackwardConfig``), for the launches and the compile checks.

    ``enable_fp_fusion`` is spelled out: triton 3.6-3.9 fuse multiply-adds by
    default (what the kernels were tuned and checked with), 3.9 warns that the
    default turns to off in 3.10 unless it is given.

    ``launch_pdl``: launch by programmatic dependent launch; every path keeps
    the compiled kernel's flag (Triton's launcher, ``launcher.KernelLaunch``,
    the C launch). Only for a kernel that waits for the grid before it
    (``griddepcontrol.wait``) before its first global access: the forward's
    split runs (``kernels/forward.py``, ``_wait_prior_grid``)."""
    return dict(num_warps=cfg.num_warps, maxnreg=cfg.maxnreg, enable_fp_fusion=True, launch_pdl=launch_pdl)


def forward_compile_options(cfg: "ForwardConfig", mode: "Mode") -> dict:
    """The forward kernel's compile options for a run in ``mode``, for its
    launches (``_jit_launch``) and the compile checks alike: launched by
    programmatic dependent launch where ``mode.pdl`` (its kernel's
    ``DEPENDENT``: every partition waits for the grid before it,
    ``kernels/forward.py``), plainly otherwise."""
    return compile_options(cfg, launch_pdl=mode.pdl)


def launched_dependent(split: bool, n_ctas: int, sms: int) -> bool:
    """Whether a forward run is launched by programmatic dependent launch
    (``Mode.pdl``): a split run always (its combine, and the next call's
    split grid behind that combine, launch early: 0.7-1.2 us of a one-query
    decode call, H100, seventy-fifth session), any other run where its grid
    has a CTA on every SM. Under graph replay on H100s such grids gained
    (B64 one-query decode -0.8 to -0.9%, B16 H16 S512 prefill -2 to -3%),
    while grids of 128 CTAs on 132 SMs (the 128- and 512-query chunk rows)
    lost up to 1.6% launched so (seventy-seventh session) and are launched
    plainly (level with the kernel before this rule, seventy-eighth;
    BENCHMARKS.md). A run launched plainly compiles without the waits
    (``DEPENDENT``): that kernel, instruction for instruction."""
    return split or n_ctas >= sms


# Compiled kernels by (device, dtype, head dim, causal, lse, config). The
# kernel's run-time arguments are never value-specialised (see
# ``attention_forward_kernel``), so one entry serves every shape.
_COMPILED: dict[tuple, object] = {}


def _jit_launch(lp: LaunchPlan, cfg: ForwardConfig, args: tuple) -> KernelLaunch:
    """The forward kernel through triton's regular launch path, whose first
    call of a specialisation compiles it: under the ring rewrite its
    ``RING_PTX`` names (``ptx_rings``), as ``compile_check`` compiles it."""
    from .kernels.forward import attention_forward_kernel

    with ptx_rings.compiling(lp.constexprs["RING_PTX"]):
        return KernelLaunch(attention_forward_kernel[(lp.n_ctas, 1, 1)](
            *args, **lp.constexprs, **forward_compile_options(cfg, lp.mode)))


@dataclass(frozen=True)
class LaunchPlan:
    """Everything about a launch that depends only on shapes and flags."""

    cfg: ForwardConfig
    mode: Mode
    num_splits: int
    n_ctas: int
    pair: int
    section: int  # query heads per L2 section of the dynamic order (mode.dynamic)
    key: tuple
    constexprs: dict
    constexpr_values: tuple
    # mode.split_table: the table's entries (the kernel's num_splits; num_splits
    # above is the largest count, the partials' and the combine's).
    split_entries: int = 0


def takes_one_item(cfg: ForwardConfig) -> bool:
    """Whether ``cfg``'s kernel reads ``Mode.one_item`` (kernels/forward.py,
    ``V_AT_ISSUE``): head dim 128 on two consumers, persistent. Other
    configs never get the flag, so they compile no second kernel for it."""
    return cfg.head_dim == 128 and cfg.consumers == 2 and cfg.persistent


# The longest items (KV tiles) a one-item launch takes V_AT_ISSUE for
# (Mode.one_item): 128 queries on 4096 / 8192 / 16384 keys gained 8% / 5% /
# 0.3-2.9% on the H200, the gain shrinking with the length (forty-seventh
# session); on 32768 and 65536 keys the cap lifted lost 1.4-4.9%
# (forty-eighth session), so longer items keep the other form.
ONE_ITEM_MAX_KV_TILES = 128


@lru_cache(maxsize=4096)
def _plan_launch(device, dtype, batch, seqlen_q, nheads, nheads_kv, n_blocks, cfg, page_size, seqused, kv_batch,
                 num_splits, pack_gqa, causal, write_lse, window=None, softcap=False, sink="",
                 leftpad=False, by_address=False, q_rows=False) -> LaunchPlan:
    """Mode, split count and grid for a launch. Cached, and keyed by the KV
    tile count rather than the key length: a decode loop grows the cache by
    one key per step, and this is host time on every step. ``window``:
    ``(left, right)`` of a sliding window (``checks.window_bounds``) or None;
    ``softcap``: whether scores are soft-capped (``Mode.softcap``); ``sink``:
    the attention sinks' dtype, "" for none (``Mode.sink``); ``leftpad``:
    ``Mode.leftpad``; ``by_address``: whether O can take a packed view's
    stores by address (contiguous, the kernel's head dim; ``launch_forward``);
    ``q_rows``: whether a packed view may be copied by the kernel from q
    itself (``Mode.q_rows``: more than one query per row, ``rows_of_q``)."""
    group = nheads // nheads_kv
    pack_g, pack_view = pack_layout(pack_gqa, group, seqlen_q, cfg, by_address)
    tiles = work_items(batch, nheads, seqlen_q, cfg, Mode(pack_g=pack_g))
    window_left, window_right = window or (-1, -1)
    if num_splits == 0:
        # Under a window a query tile reads at most the window's tiles, not the whole cache.
        read = n_blocks if window_left < 0 else min(n_blocks, window_tiles(window_left, window_right, seqlen_q, cfg))
        num_splits = choose_num_splits(tiles, read, sm_count(device))
    num_splits = max(1, min(num_splits, n_blocks))
    sms = sm_count(device)
    plain = pack_g == 1 and num_splits == 1 and not (seqused or kv_batch or page_size)
    if plain and cfg in _WIDE_OF and choose_wide(seqlen_q, n_blocks * cfg.block_n, causal):
        # The decode modes keep cfg: a decode tile has few live rows, and their
        # per-batch state does not fit three consumers' 160 registers (D=64
        # PackGQA + split + per-batch lengths spilled 8 bytes).
        cfg = _WIDE_OF[cfg]
        tiles = work_items(batch, nheads, seqlen_q, cfg)
    # Causal wide tiles take the dynamic order whenever the items outnumber
    # the SMs: dealt statically they measured up to 1.5x slower at S1024-2048
    # (the dynamic order recovered most of it, BENCHMARKS.md).
    dynamic = (cfg.persistent and plain
               and (choose_dynamic(tiles, triton_cdiv(seqlen_q, cfg.block_m), causal, False, sms)
                    or (causal and cfg.consumers == 3 and tiles > sms)))
    if dynamic:
        n_ctas, pair = min(sms, tiles), 1
    else:
        n_ctas, pair = (deal_split if num_splits > 1 else deal)(tiles * num_splits, cfg, device)
    one_item = (plain and not dynamic and tiles <= n_ctas and takes_one_item(cfg)
                and n_blocks <= ONE_ITEM_MAX_KV_TILES)
    mode = Mode(pack_g=pack_g, pack_view=pack_view, q_rows=pack_view and q_rows, split=num_splits > 1,
                seqused=seqused, kv_batch=kv_batch,
                page_size=page_size, dynamic=dynamic, window_left=window_left, window_right=window_right,
                softcap=bool(softcap), sink=sink, one_item=one_item, leftpad=leftpad,
                dependent=launched_dependent(num_splits > 1, n_ctas, sms))
    section = l2_section(n_blocks * cfg.block_n, cfg.head_dim, dtype.itemsize, group)
    kernel_lse = write_lse and not mode.split  # the combine writes the LSE of a split run
    constexprs = kernel_constexprs(cfg, causal, kernel_lse, mode)
    return LaunchPlan(cfg, mode, num_splits, n_ctas, pair, section, (device, dtype, causal, kernel_lse, cfg, mode),
                      constexprs, tuple(constexprs.values()))


def gathered_pools(k, v, page_size: int, cfg: ForwardConfig, caller: str):
    """``(k, v, gather)`` for a launch over page pools of ``page_size``
    keys: where the kernel gathers the pages row by row (``gathers``), the
    pools themselves as ``gather`` and ``k``, ``v`` viewed as one sequence
    ``[1, pages * page_size, Hkv, D]`` (its K/V descriptors then only lay out
    the tiles); otherwise ``k``, ``v`` as given and None. A gathered row is
    the kernel's head dim wide (past a narrower tensor's features it would
    read the next head's) from contiguous pools: others are refused (their
    callers copy them first, ``cache_layout.page_plan``)."""
    if not gathers(page_size, cfg.head_dim):
        return k, v, None
    if k.shape[3] != cfg.head_dim or v.shape[3] != cfg.head_dim:
        raise ValueError(f"{caller}: gathered pages (page_size {page_size}) need a kernel head dim, "
                         f"got {k.shape[3]}; copy them first")
    if not contiguous_pools(k, v):
        raise ValueError(f"{caller}: gathered pages (page_size {page_size}) need contiguous k and v pools; "
                         f"copy them first")
    return k.view(1, -1, *k.shape[2:]), v.view(1, -1, *v.shape[2:]), (k, v)


def launch_forward(q, k, v, out, lse, softmax_scale: float, causal: bool, cfg: ForwardConfig | None = None,
                   *, seqused_k=None, kv_batch=None, page_table=None, num_splits: int = 1,
                   pack_gqa: bool | None = False, window: tuple[int, int] | None = None,
                   softcap: float = 0.0, sink: torch.Tensor | None = None,
                   leftpad: torch.Tensor | None = None) -> LaunchPlan | None:
    """Launch the forward kernel on the current stream of q's device.
    Returns the plan where the launch was direct (``_launch_forward_direct``;
    ``PreparedForward`` replays it), else None.

    Arguments are assumed validated (``hopper_flash.interface``): BSHD,
    supported dtype and head dim, TMA-compatible strides, non-empty, and q's
    device current.

    Decode modes: ``seqused_k`` (int32 [B], live keys per batch; k and v are
    then a cache of any length), ``kv_batch`` (int32 [B], cache row per
    batch), ``page_table`` (int32 [B, max_pages]; k and v are
    [num_pages, page_size, Hkv, D] with page_size a multiple of block_n or
    a power of two of at least 32 dividing it),
    ``num_splits`` (0: heuristic) and ``pack_gqa`` (None: heuristic).
    ``window``: a sliding window's ``(left, right)``, from
    ``checks.window_bounds`` (None: none); each distinct window is a
    specialisation of its own (compiled on first use). ``softcap``: logit
    soft-capping at that cap (0: none; ``kernel_scales``). ``sink``:
    attention sinks, one logit per query head (``sink_arg``'s ``[H]``),
    in every row's normaliser (``sinks.py``); None: none. ``leftpad``
    (int32 [B], with ``seqused_k``, no pages): batch ``b``'s keys start at
    row ``leftpad[b]`` of its cache row and number ``seqused_k[b] -
    leftpad[b]`` (flash-attn's ``cache_leftpad``).

    The first launch of a specialisation goes through Triton's JIT (compile,
    cache). Later launches skip the JIT (``launcher.KernelLaunch``: the
    compiled kernel's own launcher, or its C launch function with cached TMA
    descriptors): the JIT's per-call argument specialisation and descriptor
    checks cost more host time than a short attention call takes on the GPU.
    Those launchers are private to triton: on versions where their calling
    convention was not checked (``FAST_LAUNCH`` false) every launch takes
    the JIT's.
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    device = q.device.index
    paged = page_table is not None
    # Paged: the page table's extent bounds the key length; seqused_k holds the lengths.
    seqlen_k = page_table.shape[1] * k.shape[1] if paged else k.shape[1]
    page_size = k.shape[1] if paged else 0
    cfg = cfg or CONFIGS[kernel_head_dim(head_dim, v.shape[3])]
    k, v, gather = gathered_pools(k, v, page_size, cfg, "launch_forward")
    write_lse = lse is not None
    # At one query per row the packed view is q restrided (packed_q), no copy to spare.
    q_rows = seqlen_q > 1 and packs_by_view(nheads // k.shape[2]) and rows_of_q(q, cfg)
    lp = _plan_launch(device, q.dtype, batch, seqlen_q, nheads, k.shape[2], triton_cdiv(seqlen_k, cfg.block_n), cfg,
                      page_size, seqused_k is not None, kv_batch is not None, num_splits, pack_gqa,
                      bool(causal), write_lse, window, softcap > 0, sink_mode(sink), leftpad is not None,
                      out.shape[3] == cfg.head_dim and out.is_contiguous(), q_rows)
    cfg, mode, num_splits = lp.cfg, lp.mode, lp.num_splits
    qd = kernel_q(q, mode)  # the Q descriptor's tensor (q keeps the kernel's scalars)
    kernel = _COMPILED.get(lp.key)
    page_stride = page_table.stride(0) if paged else 0
    if kernel is not None and kernel.direct is not None and FAST_LAUNCH and not _launch_hooked():
        _launch_forward_direct(kernel, lp, q, qd, k, v, out, lse, softmax_scale, seqused_k, kv_batch, page_table,
                               seqlen_k, page_stride, gather, softcap, sink, leftpad)
        return lp
    if mode.split:
        part, n_o = _partials(lp, q)
        o_part, lse_part = _partial_views(part, n_o, lp, q)
    else:
        o_part = lse_part = out
    args = _kernel_args(lp, q, seqlen_k, k.shape[2], softmax_scale, out, lse, seqused_k, kv_batch, page_table,
                        page_stride, o_part, lse_part, _item_counter(q.device) if mode.dynamic else None, gather,
                        softcap, sink, leftpad, q)
    if kernel is None or not FAST_LAUNCH or _launch_hooked():
        # First launch, an unchecked triton, or a profiler hook is installed
        # (it wants the JIT's launch metadata): take Triton's regular path.
        blocks = block_shapes(cfg, mode.box_g, mode.page_size)
        descs = (_descriptor(qd, blocks["q"]), _descriptor(k, blocks["k"]), _descriptor(v, blocks["v"]),
                 _descriptor(out, blocks["o"]))
        _COMPILED[lp.key] = _jit_launch(lp, cfg, (*descs, *args))
    else:
        kernel((lp.n_ctas, 1, 1), driver.active.get_current_stream(device), (qd, k, v, out),
               (*args, *lp.constexpr_values))
    if mode.split:
        combine = launch_combine(o_part, lse_part, out, lse, sink)
        if combine is not None:
            _COMBINE_OF[_combine_key(lp, out, lse)] = combine
    return None


def _partials_size(lp: LaunchPlan, q) -> tuple[int, int]:
    """A split launch's partials' element counts: fp32 O [splits, B, Sq, H,
    D] (D the kernel's head dim), then LSE [splits, B, H, Sq], in one
    allocation. Returns O's and the whole's."""
    batch, seqlen_q, nheads, _ = q.shape
    n_o = lp.num_splits * batch * seqlen_q * nheads * lp.cfg.head_dim
    return n_o, n_o + lp.num_splits * batch * nheads * seqlen_q


def _partials(lp: LaunchPlan, q) -> tuple[torch.Tensor, int]:
    """A split launch's partials (``_partials_size``), and O's element count."""
    n_o, n_part = _partials_size(lp, q)
    return q.new_empty(n_part, dtype=torch.float32), n_o


def _partial_views(part: torch.Tensor, n_o: int, lp: LaunchPlan, q) -> tuple[torch.Tensor, torch.Tensor]:
    """``_partials``'s O and LSE as the combine reads them."""
    batch, seqlen_q, nheads, _ = q.shape
    return (part[:n_o].view(lp.num_splits, batch, seqlen_q, nheads, lp.cfg.head_dim),
            part[n_o:].view(lp.num_splits, batch, nheads, seqlen_q))


def _kernel_args(lp: LaunchPlan, q, seqlen_k: int, nheads_kv: int, softmax_scale: float, out, lse, seqused_k,
                 kv_batch, page_table, page_stride: int, o_part, lse_part, sched, gather=None,
                 softcap: float = 0.0, sink=None, leftpad=None, q_ptr=None) -> tuple:
    """``attention_forward_kernel``'s arguments after its descriptors and
    before its constexprs, for the fixed-length modes: the pointers (tensors,
    or addresses on the direct path; ``out`` stands in for those the mode
    does not read, None marking them; ``gather``: the page pools a gathering
    launch copies from; ``q_ptr``: what the kernel's q pointer takes under
    ``Mode.q_rows``: q, its address, or a prepared launch's slot), then the
    scalars. The one statement of that order for ``launch_forward``'s two
    paths."""
    batch, seqlen_q, nheads, _ = q.shape
    k_pool, v_pool = gather if gather is not None else (out, out)
    return (lse if lse is not None else out, seqused_k if seqused_k is not None else out,
            kv_batch if kv_batch is not None else out, page_table if page_table is not None else out,
            o_part, lse_part, out, leftpad if leftpad is not None else out, out,  # cu_q, cu_k (or leftpad), used_q
            sched if sched is not None else out, q_ptr if lp.mode.q_rows else out, k_pool, v_pool,
            sink if sink is not None else out,
            seqlen_q, seqlen_k, nheads, nheads // nheads_kv, batch, *kernel_scales(softmax_scale, softcap),
            lp.num_splits, lp.pair, page_stride, 0, lp.section, q_row_heads(q) if lp.mode.q_rows else 0)


# The split-KV combine's compiled launch per forward plan, for the direct
# path. ``launch_triton``'s key for it holds the device, the dtypes, the head
# dim (``lp.key``), the split count's power of two (``S_MAX``; ``lp.key``'s
# mode says only "split"), whether an LSE is written, and the alignment of
# ``out`` and ``lse`` (the partials are a fresh allocation, 16-byte aligned).
_COMBINE_OF: dict[tuple, KernelLaunch] = {}


def _combine_key(lp: LaunchPlan, out, lse) -> tuple:
    # out's head dim: narrower ones (kernel_head_dim) share lp.key but not the combine (OUT_DIM).
    return (lp.key, lp.num_splits, out.shape[-1], out.data_ptr() % 16 == 0,
            None if lse is None else lse.data_ptr() % 16 == 0)


def _launch_forward_direct(kernel: KernelLaunch, lp: LaunchPlan, q, qd, k, v, out, lse, softmax_scale: float,
                           seqused_k, kv_batch, page_table, seqlen_k: int, page_stride: int, gather=None,
                           softcap: float = 0.0, sink=None, leftpad=None) -> None:
    """``launch_forward`` once its kernel is compiled and can be called
    directly (``KernelLaunch.direct``): the same launch with every pointer
    passed as an address, so the split partials need no views, and the
    combine (once it has run through ``launch_combine``) launched directly
    too (``qd``: the Q descriptor's tensor, ``kernel_q``). This is the host
    time of every decode step; keep it short."""
    split = lp.mode.split
    stream = driver.active.get_current_stream(q.device.index)
    out_ptr = out.data_ptr()
    if split:
        part, n_o = _partials(lp, q)
        o_part = part.data_ptr()
        lse_part = o_part + 4 * n_o
    else:
        o_part = lse_part = out_ptr
    lse_ptr = lse.data_ptr() if lse is not None else None
    sink_ptr = sink.data_ptr() if sink is not None else None
    args = _kernel_args(lp, q, seqlen_k, k.shape[2], softmax_scale, out_ptr, lse_ptr,
                        seqused_k.data_ptr() if seqused_k is not None else None,
                        kv_batch.data_ptr() if kv_batch is not None else None,
                        page_table.data_ptr() if page_table is not None else None, page_stride, o_part, lse_part,
                        _item_counter(q.device).data_ptr() if lp.mode.dynamic else None,
                        None if gather is None else (gather[0].data_ptr(), gather[1].data_ptr()), softcap, sink_ptr,
                        leftpad.data_ptr() if leftpad is not None else None,
                        q.data_ptr() if lp.mode.q_rows else None)
    kernel.launch_addresses((lp.n_ctas, 1, 1), stream, (qd, k, v, out), (*args, *lp.constexpr_values))
    if not split:
        return
    combine = _COMBINE_OF.get(_combine_key(lp, out, lse))
    if combine is None or combine.direct is None:
        combine = launch_combine(*_partial_views(part, n_o, lp, q), out, lse, sink)
        if combine is not None:
            _COMBINE_OF[_combine_key(lp, out, lse)] = combine
        return
    batch, seqlen_q, nheads, _ = q.shape
    combine.launch_addresses((batch * seqlen_q * nheads, 1, 1), stream, (),
                             (*_combine_args(o_part, lse_part, out_ptr, lse_ptr, lp.num_splits, q.shape, out.stride(),
                                             sink_ptr),
                              *_combine_constexprs(lp.cfg.head_dim, lp.num_splits, lse is not None,
                                                   sink_ptr is not None, out.shape[3]).values()))


class _Slot:
    """A per-call value's place in a prepared launch's argument template."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


# The per-call values a prepared launch patches into its templates, in the
# order of ``_PreparedLaunch.__call__``'s ``values`` (then a KV cache call's
# lengths, cache rows, page table and left pads, ``CacheLayout``; last q's
# address, which ``Mode.q_rows`` reads as a pointer too).
_OUT, _LSE, _O_PART, _LSE_PART, _SEQLEN_K, _SCHED, _SEQUSED, _KV_BATCH, _PAGES, _LEFTPAD, _Q = (
    _Slot(i) for i in range(11))


@dataclass(frozen=True)
class CacheLayout:
    """What a prepared ``flash_attn_with_kvcache`` launch fixes of its cache
    (``kvcache.prepared_call``'s signature holds the shapes it comes from):
    the kernel's key length (the page table's width times the page size; 0
    for a contiguous cache, whose capacity each call passes, as
    ``flash_attn_func``'s prepared calls pass k's length), whether the cache
    rows, the page table and left pads (``cache_leftpad``) are read, and the
    page table's row stride. Per call the addresses change: the lengths',
    the rows', the table's, the pads'.

    ``chunk``: a chunked decode step's (FA3's ``attention_chunk``, one query
    per row; ``kvcache.kvcache_forward_validated``): each call first derives
    its rows' last chunks from its own lengths (``chunked.last_chunk_leftpad``,
    a contiguous cache's left pads; ``chunked.last_chunk_pages``, a paged
    cache's lengths and a table ``chunk_width`` pages wide) and the launch
    reads those. 0: none."""

    seqlen_k: int
    kv_batch: bool
    paged: bool
    page_stride: int
    leftpad: bool = False
    chunk: int = 0
    chunk_width: int = 0


def _slots(template) -> tuple[tuple[int, int], ...]:
    return tuple((i, a.index) for i, a in enumerate(template) if isinstance(a, _Slot))


class _PreparedLaunch:
    """One KV tile count's launches for a prepared call: the forward kernel's
    and (split-KV) the combine's arguments after the descriptors, built once
    by ``_kernel_args`` and ``_combine_args`` (the one statement of their
    order) with ``_Slot`` placeholders where a call's own values go (its
    output, LSE, partials, key length, item counter). A call copies the
    templates, patches those in and hands the lists to the C launch
    function: the direct launch of ``_launch_forward_direct`` without
    rebuilding the same arguments every call."""

    __slots__ = ("lp", "kernel", "combine", "template", "slots", "combine_grid", "combine_template",
                 "combine_slots", "n_o", "n_part", "current_stream", "c_state", "c_launch", "out_strides", "q_view",
                 "cache")

    def __init__(self, lp: LaunchPlan, kernel: KernelLaunch, combine: KernelLaunch | None, q, nheads_kv: int,
                 softmax_scale: float, return_lse: bool, softcap: float = 0.0, sink: int | None = None,
                 head_dim_v: int | None = None, kv_rows: int | None = None, cache: CacheLayout | None = None):
        self.lp, self.kernel, self.combine, self.cache = lp, kernel, combine, cache
        self.current_stream = driver.active.get_current_stream
        batch, seqlen_q, nheads, head_dim = q.shape
        head_dim_v = head_dim if head_dim_v is None else head_dim_v  # v's and out's
        # Prepared calls allocate out contiguous (PreparedForward.__call__).
        self.out_strides = (seqlen_q * nheads * head_dim_v, nheads * head_dim_v, head_dim_v, 1)
        lse = _LSE if return_lse else None
        split = lp.mode.split
        if cache is None:
            seqlen_k, seqused, kv_batch, pages, page_stride, leftpad = _SEQLEN_K, None, None, None, 0, None
        else:
            seqlen_k, seqused, page_stride = cache.seqlen_k or _SEQLEN_K, _SEQUSED, cache.page_stride
            kv_batch, pages = _KV_BATCH if cache.kv_batch else None, _PAGES if cache.paged else None
            leftpad = _LEFTPAD if cache.leftpad else None
        args = _kernel_args(lp, q, seqlen_k, nheads_kv, softmax_scale, _OUT, lse, seqused, kv_batch, pages,
                            page_stride, _O_PART if split else _OUT, _LSE_PART if split else _OUT,
                            _SCHED if lp.mode.dynamic else None, softcap=softcap, sink=sink, leftpad=leftpad,
                            q_ptr=_Q)
        self.template = [*args, *lp.constexpr_values]
        self.slots = _slots(self.template)
        if split:
            self.n_o, self.n_part = _partials_size(lp, q)
            self.combine_grid = (batch * seqlen_q * nheads, 1, 1)
            self.combine_template = [*_combine_args(_O_PART, _LSE_PART, _OUT, lse, lp.num_splits, q.shape,
                                                    self.out_strides, sink),
                                     *_combine_constexprs(lp.cfg.head_dim, lp.num_splits, return_lse,
                                                          sink is not None, head_dim_v).values()]
            self.combine_slots = _slots(self.combine_template)
        kv_rows = batch if kv_rows is None else kv_rows
        self.c_state = self._c_state(q, nheads_kv, head_dim_v, kv_rows) if c_launch.enabled() else None
        self.c_launch = c_launch.module().launch if self.c_state is not None else None
        # Whether a call builds q's packed view (kernel_q): the C launch takes
        # q's address alone, which at one query per row is the view's too
        # (packed_q restrides q), so there only a copy is built per call;
        # with Mode.q_rows the kernel reads q itself.
        self.q_view = lp.mode.pack_view and not lp.mode.q_rows and (seqlen_q > 1 or self.c_state is None)

    def _c_state(self, q, nheads_kv: int, head_dim_v: int, kv_rows: int):
        """The templates as ``c_launch``'s state, or None (the Python path).
        The descriptors' tensors: q and out fixed by the signature (out
        contiguous, ``head_dim_v`` wide), k and v of ``[kv_rows, length,
        heads, dim]`` (a cache's rows or pages, else the batch) with the
        length and the strides given per call."""
        kernel, lp = self.kernel, self.lp
        if kernel.direct is None or len(kernel.direct.encode) != 4:
            return None
        batch, seqlen_q, nheads, head_dim = q.shape
        k_shape, v_shape = (kv_rows, 0, nheads_kv, head_dim), (kv_rows, 0, nheads_kv, head_dim_v)
        qd = kernel_q(q, lp.mode)
        layouts = ((tuple(qd.shape), tma_strides(qd)), (k_shape, (0,) * 4), (v_shape, (0,) * 4),
                   ((batch, seqlen_q, nheads, head_dim_v), self.out_strides))
        descs = [(slot, enc[2], enc[1], enc[0], list(enc[3]), list(shape), list(strides))
                 for slot, (enc, (shape, strides)) in enumerate(zip(kernel.direct.encode, layouts))]
        leading = 9 * len(descs)  # per descriptor: the map, its shape, its strides
        specs = [c_launch.launch_spec(kernel, (lp.n_ctas, 1, 1), [None] * leading + self.template,
                                      [(leading + i, which) for i, which in self.slots], descs)]
        if self.combine is not None:
            specs.append(c_launch.launch_spec(self.combine, self.combine_grid, self.combine_template,
                                              self.combine_slots, []))
        return c_launch.prepare(specs)

    def __call__(self, q, k, v, out, lse, seqlen_k: int, device_index: int, cache=None) -> None:
        """``cache``: a KV cache call's ``(lengths, rows, pages, left pads)``
        addresses (None where the layout reads none), with ``seqlen_k`` k's
        own length."""
        kernel, lp = self.kernel, self.lp
        stream = self.current_stream(device_index)
        out_ptr = out.data_ptr()
        if self.combine is not None:
            part = q.new_empty(self.n_part, dtype=torch.float32)
            o_part = part.data_ptr()
            lse_part = o_part + 4 * self.n_o
        else:
            o_part = lse_part = out_ptr
        lse_ptr = lse.data_ptr() if lse is not None else None
        sched = _item_counter(q.device).data_ptr() if lp.mode.dynamic else None
        if self.q_view:
            q = packed_q(q, lp.mode.pack_g)
        if self.c_state is not None:
            self.c_launch(self.c_state, stream, q.data_ptr(), k.data_ptr(), v.data_ptr(), out_ptr, lse_ptr, o_part,
                          lse_part, seqlen_k, sched, k.stride(), v.stride(), *(() if cache is None else (cache,)))
            return
        values = (out_ptr, lse_ptr, o_part, lse_part, seqlen_k, sched, *(cache or (None, None, None, None)),
                  q.data_ptr() if lp.mode.q_rows else None)
        flat = [*kernel._descriptor_args(0, q), *kernel._descriptor_args(1, k), *kernel._descriptor_args(2, v),
                *kernel._descriptor_args(3, out)]
        base = len(flat)
        flat.extend(self.template)
        for i, which in self.slots:
            flat[base + i] = values[which]
        kernel.launch_flat((lp.n_ctas, 1, 1), stream, flat)
        if self.combine is not None:
            flat = list(self.combine_template)
            for i, which in self.combine_slots:
                flat[i] = values[which]
            self.combine.launch_flat(self.combine_grid, stream, flat)


class PreparedForward:
    """Eager ``flash_attn_func`` calls prepared once per argument signature
    (``dispatch.forward``: arguments of this signature, ``checks._signature``,
    passed ``checks.validate``), and ``flash_attn_with_kvcache``'s
    (``cache``; their signature is ``kvcache.prepared_key``): per call,
    allocate the outputs and launch with a plan found before
    (``_PreparedLaunch``), skipping the checks, the plan lookup and the
    argument building. A signature leaves the key length
    free (a decode step grows the cache by one key), and the plan depends on
    it through the KV tile count only, so the launches are kept by that
    count (``add``, after a direct launch): a call whose count has none
    returns None and takes the full path, which adds it. It stands only
    while what it was built from does (``usable``): the compiled-kernel
    table (tests replace it to force the JIT), the head dim's config
    (``use_variant``), and no profiler hook; and a launch only while its
    kernels' direct launches do."""

    __slots__ = ("table", "config", "head_dim", "block_n", "softmax_scale", "softcap", "return_lse", "lse_shape",
                 "launches", "device_index", "sink", "out_shape", "cache")

    def __init__(self, q, softmax_scale: float, return_lse: bool, softcap: float = 0.0, sink: int | None = None,
                 head_dim_v: int | None = None, cache: CacheLayout | None = None):
        self.table = _COMPILED
        self.cache = cache  # a flash_attn_with_kvcache call's (kvcache.prepared_call), else None
        self.device_index = q.device.index  # the signature holds the device
        # v's head dim where it differs from q's (the signature holds both): out's.
        self.out_shape = None if head_dim_v in (None, q.shape[3]) else (*q.shape[:3], head_dim_v)
        self.head_dim = kernel_head_dim(q.shape[3], head_dim_v)
        self.config = CONFIGS.get(self.head_dim)
        self.block_n = self.config.block_n  # launch_forward counts KV tiles of the head dim's config
        self.softmax_scale = softmax_scale
        self.softcap = softcap
        self.return_lse = return_lse
        # Attention sinks: their address (the signature's key holds it: the
        # kernels read the sinks where they are, ``sink_in_place``), or None.
        self.sink = sink
        self.lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if return_lse else None
        self.launches: dict[int, _PreparedLaunch] = {}

    def add(self, lp: LaunchPlan, q, k, out, lse) -> None:
        """Prepare the launches of ``lp``, just launched directly on these
        arguments (``out`` and ``lse`` fresh, as a prepared call's are), for
        key lengths of its KV tile count; not while a split's combine has no
        direct launch yet (the next full call gives it one)."""
        combine = None
        if lp.mode.split:
            combine = _COMBINE_OF.get(_combine_key(lp, out, lse))
            if combine is None or combine.direct is None:
                return
        if len(self.launches) >= _PREPARED_LIMIT:
            self.launches.clear()
        self.launches[triton_cdiv(k.shape[1], self.block_n)] = _PreparedLaunch(
            lp, self.table[lp.key], combine, q, k.shape[2], self.softmax_scale, self.return_lse, self.softcap,
            self.sink, out.shape[3], k.shape[0], self.cache)

    def usable(self) -> bool:
        return (self.table is _COMPILED and FAST_LAUNCH and CONFIGS.get(self.head_dim) is self.config
                and not _launch_hooked())

    def launch_for(self, k) -> _PreparedLaunch | None:
        """The launch prepared for ``k``'s KV tile count, or None where this
        call cannot serve (not ``usable``, or no launch for that count)."""
        launch = self.launches.get(-(-k.shape[1] // self.block_n))  # triton_cdiv
        if launch is None or launch.kernel.direct is None or not self.usable():
            return None
        return launch

    def __call__(self, q, k, v, cache=None, launch=None):
        """The outputs, or None where this call cannot serve (``launch_for``).
        Every line is host time of every layer of a decode step, run cold
        between the layer's other code: the fewer Python frames the better.
        ``cache``: a KV cache call's addresses (``_PreparedLaunch.__call__``);
        ``launch``: ``launch_for(k)``, where the caller has it already."""
        seqlen_k = k.shape[1]
        if launch is None:
            launch = self.launch_for(k)
            if launch is None:
                return None
        # empty_like: half torch.empty's host time; q's layout is BSHD, not its memory order
        if self.out_shape is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        else:
            out = q.new_empty(self.out_shape)
        lse = None if self.lse_shape is None else q.new_empty(self.lse_shape, dtype=torch.float32)
        device = self.device_index
        if current_device() == device:  # on_device's test, without a guard to enter and leave
            launch(q, k, v, out, lse, seqlen_k, device, cache)
        else:
            with on_device(q):
                launch(q, k, v, out, lse, seqlen_k, device, cache)
        return out if lse is None else (out, lse)


# Prepared eager calls by argument signature (``dispatch.forward``'s key).
_PREPARED: dict[tuple, PreparedForward] = {}
_PREPARED_LIMIT = 1024
# KV cache call signatures met once (``sighted``): prepared at the second.
_SIGHTED: dict[tuple, None] = {}


def sighted(key) -> bool:
    """Whether ``key`` was met before; records it if not. A KV cache call
    is prepared at its signature's second launch, not its first: a
    signature met once (a page table one page wider each time, say) would
    otherwise build a prepared launch per call that nothing reuses (on the
    CPU stand-in 81 against 23 us a call, when growing caches were new
    signatures; their length is free now, ``kvcache.prepared_key``)."""
    if key in _SIGHTED:
        return True
    if len(_SIGHTED) >= _PREPARED_LIMIT:
        _SIGHTED.clear()
    _SIGHTED[key] = None
    return False


def prepared(key) -> PreparedForward | None:
    """The prepared call for ``key``, or None; it returns None itself where
    it is no longer usable."""
    try:
        return _PREPARED.get(key)
    except TypeError:  # an unhashable argument value: the checks will name it
        return None


def remember_prepared(key, lp: LaunchPlan, q, k, out, lse, softmax_scale: float, softcap: float = 0.0,
                      sink: torch.Tensor | None = None, cache: CacheLayout | None = None) -> None:
    """After a direct launch of ``lp`` on arguments of signature ``key``
    (``out`` and ``lse`` allocated for the call; ``sink`` the attention
    sinks it read in place, whose address the key holds; ``cache``: a KV
    cache call's layout): prepare the signature's calls for this key
    length's KV tile count."""
    call = _PREPARED.get(key)
    if call is None or not call.usable():
        if len(_PREPARED) >= _PREPARED_LIMIT:
            _PREPARED.clear()
        call = _PREPARED[key] = PreparedForward(q, softmax_scale, lse is not None, softcap,
                                                None if sink is None else sink.data_ptr(), out.shape[3], cache)
    call.add(lp, q, k, out, lse)


def _item_counter(device: torch.device) -> torch.Tensor:
    """A zeroed int32 for the dynamic order's item counter, fresh per call
    (FA3 does the same): a counter kept across calls would need resetting by
    the kernel, and two launches on different streams, or a CUDA graph and an
    eager call, could then share it. The zeroing is a memset on the current
    stream, so it is captured with the launch."""
    return torch.zeros(1, dtype=torch.int32, device=device)


# Compiled plain-Triton kernels (the split-KV combine, the backward's pre- and
# postprocess) by what Triton specialises on: see launch_triton.
_TRITON_COMPILED: dict[tuple, object] = {}


def launch_triton(kernel, grid: tuple[int, int, int], args: tuple, constexprs: dict,
                  num_warps: int, launch_pdl: bool = False) -> KernelLaunch:
    """Launch a plain Triton kernel whose integer arguments are all
    ``do_not_specialize`` (so one compiled kernel serves every value) on the
    current stream of the first argument's device. As the forward's launch:
    the first launch of a key goes through Triton's JIT, later ones call the
    compiled kernel's launcher (``FAST_LAUNCH``, no profiler hook). The key
    holds what Triton still specialises on: the tensors' dtypes and 16-byte
    pointer alignment, and the constexprs. The first argument is a tensor.
    ``launch_pdl``: launch by programmatic dependent launch (the kernel
    waits for the grid before it with ``gdc_wait``); the compiled kernel
    keeps it, so its direct launches do too. Returns the compiled kernel's
    ``KernelLaunch``."""
    device = args[0].device.index
    # id(kernel): the kernels are module globals, and hashing a JITFunction
    # computes its cache key in Python on every call.
    key = (id(kernel), device, num_warps, launch_pdl, *constexprs.values(),
           *[(a.dtype, a.data_ptr() % 16 == 0) for a in args if isinstance(a, torch.Tensor)])
    compiled = _TRITON_COMPILED.get(key)
    if compiled is None or not FAST_LAUNCH or _launch_hooked():
        compiled = _TRITON_COMPILED[key] = KernelLaunch(kernel[grid](*args, **constexprs, num_warps=num_warps,
                                                                     launch_pdl=launch_pdl, enable_fp_fusion=True))
        return compiled
    compiled(grid, driver.active.get_current_stream(device), (), (*args, *constexprs.values()))
    return compiled


def launch_combine(o_part, lse_part, out, lse, sink=None) -> KernelLaunch:
    """Merge split partials ``o_part`` [splits, B, Sq, H, D] fp32 and
    ``lse_part`` [splits, B, H, Sq] into ``out`` (BSHD, head dim contiguous)
    and ``lse`` [B, H, Sq] (or None), with attention sinks ``sink``
    (``sink_arg``'s ``[H]``) or None. Returns the combine's ``KernelLaunch``."""
    from .kernels.combine import combine_kernel

    num_splits, batch, seqlen_q, nheads, head_dim = o_part.shape
    args = _combine_args(o_part, lse_part, out, lse, num_splits, out.shape, out.stride(), sink)
    return launch_triton(combine_kernel, (batch * seqlen_q * nheads, 1, 1), args,
                         _combine_constexprs(head_dim, num_splits, lse is not None, sink is not None, out.shape[-1]),
                         num_warps=1 if head_dim <= 128 else 2, launch_pdl=True)


def _combine_args(o_part, lse_part, out, lse, num_splits: int, out_shape, out_strides, sink=None) -> tuple:
    """``combine_kernel``'s arguments before its constexprs (tensors, or
    addresses on the direct path): the LSE goes to ``lse``, or (not asked
    for) to the partials' own slot; the sinks (unused without) alias the
    partials' LSE. The one statement of their order (``launch_combine``,
    ``_launch_forward_direct``, ``_PreparedLaunch``)."""
    batch, seqlen_q, nheads, _ = out_shape
    return (o_part, lse_part, out, lse if lse is not None else lse_part, sink if sink is not None else lse_part,
            num_splits, batch, seqlen_q, nheads, out_strides[0], out_strides[1], out_strides[2])


@lru_cache(maxsize=None)
def _combine_constexprs(head_dim: int, num_splits: int, write_lse: bool, sink: bool = False,
                        out_dim: int | None = None) -> dict:
    """The combine kernel's constexprs, in its parameter order: launched
    dependent on the split grid (``launch_combine``'s ``launch_pdl``).
    ``head_dim``: the partials' (the kernel's); ``out_dim``: the output's,
    where narrower (``kernel_head_dim``)."""
    return dict(HEAD_DIM=head_dim, S_MAX=max(16, 1 << (num_splits - 1).bit_length()), WRITE_LSE=write_lse,
                DEPENDENT=True, SINK=sink, OUT_DIM=0 if out_dim is None else narrower_width(out_dim, head_dim))


def varlen_total_q_key(total_q: int, nheads: int, cfg: ForwardConfig, device) -> int:
    """``total_q`` as ``_plan_varlen``'s split heuristic needs it (a key of
    its plan cache): past ``sms * block_m / nheads`` rows the live items'
    bound reaches one per SM, and the heuristic's answer no longer depends
    on the rows, so every larger count shares that one plan."""
    return min(total_q, triton_cdiv(sm_count(device) * cfg.block_m, max(1, nheads)))


# The skewed-keys split (varlen_skew_splits): split when the longest
# sequence's KV tiles exceed SKEW_RATIO times the mean per-SM load, into
# pieces of at least SKEW_MIN_TILES tiles, at most SKEW_MAX_SPLITS.
SKEW_RATIO = 2
SKEW_MIN_TILES = 16
SKEW_MAX_SPLITS = 32


def varlen_skew_splits(total_k: int, batch: int, max_seqlen_q: int, max_seqlen_k: int, nheads: int, group: int,
                       cfg: ForwardConfig, pack_gqa, window, device) -> int:
    """Splits for a packed batch whose keys are skewed: many short sequences
    beside a long one fill the SMs with items, so FA3's rule does not split,
    while the long sequence's items read ``max_seqlen_k``'s tiles alone
    (64 decodes over 1024 keys beside one over 65536: 520 items, the long
    one's 8 read 512 tiles each while the mean per SM is 66).

    Host values only. The work is bounded above by ``ceil(max_seqlen_q * G
    / block_m)`` query tiles per sequence and item head times each
    sequence's KV tiles, whose sum is at most ``ceil(total_k / block_n) +
    batch`` (``total_k``: k's rows, unpaged); when the longest sequence's
    tiles exceed ``SKEW_RATIO`` times that bound's share per SM, its items
    are split into about the share (every sequence's are: the split count is
    one per launch). 1: no split. An upper bound on the work errs towards
    not splitting (a prefill chunk's query tiles count for every sequence)."""
    if window is not None or total_k <= 0 or max_seqlen_k <= SKEW_RATIO * SKEW_MIN_TILES * cfg.block_n:
        return 1  # (the last: the share is at least SKEW_MIN_TILES)
    pack_g, _ = pack_layout(pack_gqa, group, max_seqlen_q, cfg, varlen=True)
    n_blocks = triton_cdiv(max(1, max_seqlen_k), cfg.block_n)
    q_tiles = triton_cdiv(max(1, max_seqlen_q) * pack_g, cfg.block_m)
    work = q_tiles * (triton_cdiv(total_k, cfg.block_n) + batch) * (nheads // pack_g)
    share = max(work / sm_count(device), SKEW_MIN_TILES)
    if n_blocks <= SKEW_RATIO * share:
        return 1
    return max(1, min(math.ceil(n_blocks / share), n_blocks // SKEW_MIN_TILES, SKEW_MAX_SPLITS))


def split_table_blocks(max_seqlen_k: int, num_splits: int, cfg: ForwardConfig) -> int:
    """The KV tiles per split of a split table (``Mode.split_table``): the
    longest sequence's tiles over the launch's split count, so that it gets
    that count and a sequence of ``t`` tiles ``ceil(t / blocks)``."""
    return triton_cdiv(triton_cdiv(max(1, max_seqlen_k), cfg.block_n), num_splits)


def varlen_split_table(total_k: int, batch: int, max_seqlen_k: int, num_splits: int, cfg: ForwardConfig) -> int:
    """The entries of a split table for a skewed packed batch split at most
    ``num_splits`` ways (``varlen_skew_splits``), or 0 for a uniform split
    (a batch or a count the table's encoding cannot hold). Host values
    only: sequence ``b``'s ``t_b = ceil(len_b / block_n)`` KV tiles give
    ``max(1, ceil(t_b / blocks))`` entries (``split_table_blocks``), fewer
    than ``t_b / blocks + 1``, and the ``t_b`` sum to less than ``total_k /
    block_n + batch`` (``total_k``: k's rows, which the lengths' sum does
    not pass, flash-attn's contract): so at most ``batch + (total_k /
    block_n + batch) / blocks`` entries, rounded up to a multiple of at
    least 16 and at most an eighth of it, so that a serving loop's totals
    share a few plans (``_plan_varlen`` keys on the count; a new one costs
    about 10 us of host time). The kernel runs nothing for the entries past
    the last (kernels/split_table.py)."""
    from .kernels.split_table import MAX_BATCH, MAX_SPLITS

    if num_splits <= 1 or num_splits > MAX_SPLITS or batch >= MAX_BATCH:
        return 0
    blocks = split_table_blocks(max_seqlen_k, num_splits, cfg)
    entries = batch + (total_k // cfg.block_n + batch) // blocks + 1
    grain = max(16, 1 << max(0, entries.bit_length() - 4))
    return triton_cdiv(entries, grain) * grain


@lru_cache(maxsize=4096)
def _plan_varlen(device, dtype, batch, max_seqlen_q, max_seqlen_k, nheads, group, cfg, seqused_q, seqused_k, causal,
                 write_lse, window=None, softcap=False, sink="", o_dim=0, page_size=0, pack_gqa=None,
                 num_splits=1, total_q=0, skew_splits=1, split_entries=0, q_rows=False) -> LaunchPlan:
    """``_plan_launch`` for a packed batch: the grid covers ``max_seqlen_q``
    for every sequence (items past a sequence's rows exit at once).
    ``o_dim``: ``Mode.o_dim``; ``page_size``: paged K/V (``Mode.page_size``,
    with ``seqused_k``); ``pack_gqa``: PackGQA (``pack_layout``; None:
    ``choose_varlen_pack_gqa``); ``num_splits``: KV splits (0: FA3's rule,
    ``choose_num_splits``, on the items and KV tiles the host bounds
    know: ``max_seqlen_q`` for every sequence, ``max_seqlen_k`` keys, and
    with ``total_q`` (q's rows, ``varlen_total_q_key``) a bound on the
    live items that FA3's rule lacks: a few long decodes beside a prefill
    chunk look like ``batch`` chunks to ``max_seqlen_q`` alone), and
    ``skew_splits`` (``varlen_skew_splits``) where that rule does not split,
    each sequence then split into its own count by a table of
    ``split_entries`` entries where that is not 0 (``varlen_split_table``,
    ``Mode.split_table``); ``q_rows``: a packed view may be copied by the
    kernel from q itself (``Mode.q_rows``; ``rows_of_q``)."""
    sms = sm_count(device)
    pack_g, pack_view = pack_layout(pack_gqa, group, max_seqlen_q, cfg, varlen=True)
    pack = Mode(pack_g=pack_g)
    items = work_items(batch, nheads, max_seqlen_q, cfg, pack)
    item_heads = nheads // pack_g
    n_blocks = triton_cdiv(max(1, max_seqlen_k), cfg.block_n)
    if num_splits == 0:
        read = n_blocks if window is None or window[0] < 0 else min(
            n_blocks, window_tiles(window[0], window[1], max_seqlen_q, cfg))
        # Sequence b has ceil(len_q(b) * G / block_m) live query tiles per
        # item head, and a sum of ceilings is at most the ceiling of the sum
        # plus batch - 1: at most this many items have rows to compute.
        live = items if not total_q else min(
            items, (triton_cdiv(total_q * pack_g, cfg.block_m) + batch - 1) * item_heads)
        num_splits = choose_num_splits(live, read, sms)
        if num_splits == 1:
            num_splits = skew_splits
        else:
            split_entries = 0  # FA3's rule splits every sequence alike
    else:
        split_entries = 0
    num_splits = max(1, min(num_splits, n_blocks))
    split = num_splits > 1
    table = split and split_entries > 0
    # Head dim 64's 192-row tiles (three consumers, WIDE_CONFIGS) for
    # unpaged, unsplit launches without a window whose longest query reaches
    # WIDE_MIN_ROWS, the fixed-length rule's row bound (a host bound; the
    # keys' bound of choose_wide needs lengths only the device has). Batches
    # of 512-8192 tokens: 4-8% faster forward; of 128-1024 and 256-2048 the
    # rule keeps 128 rows, where the wide tiles measured 5-12% slower, as
    # did pages of 16 keys read in place (3-4%; fifty-seventh and
    # fifty-eighth sessions, BENCHMARKS.md). A window with PackGQA and
    # per-sequence lengths spills 232 bytes on the wide tiles.
    # A packed view (choose_varlen_view beside a long chunk) keeps 128 rows:
    # its wide kernels have not run on a GPU.
    if (cfg in _WIDE_OF and page_size == 0 and not split and window is None
            and max_seqlen_q >= WIDE_MIN_ROWS and not pack_view):
        cfg = _WIDE_OF[cfg]
        items = work_items(batch, nheads, max_seqlen_q, cfg, pack)
    # Gathered pages take the static deal: their four-warp producer has only
    # ever run it (the decode modes), never the dynamic order's draws; so
    # do split runs (the dynamic order has no split coordinate).
    dynamic = (cfg.persistent and not gathers(page_size, cfg.head_dim) and not split
               and choose_dynamic(items, triton_cdiv(max_seqlen_q * pack_g, cfg.block_m), causal, True, sms))
    window_left, window_right = window or (-1, -1)
    # One query per sequence: q by token, no copy (the host's bound; a
    # longer sequence breaks flash-attn's contract on max_seqlen_q anyway).
    q_tokens = pack_view and max_seqlen_q == 1
    mode = Mode(pack_g=pack_g, pack_view=pack_view, q_tokens=q_tokens, q_rows=pack_view and not q_tokens and q_rows,
                split=split,
                split_table=table, seqused=seqused_k, varlen=True,
                seqused_q=seqused_q, dynamic=dynamic, window_left=window_left, window_right=window_right,
                softcap=bool(softcap), sink=sink, o_dim=o_dim, page_size=page_size)
    if dynamic:
        n_ctas, pair = min(sms, items), 1
    elif table:
        # A split table's entries take the place of the batch and the split,
        # one CTA per item whatever the waves: the table puts the longest
        # items first and the hardware deals the rest as SMs free up. The
        # static deal past deal_split's waves gave the long sequence's CTAs
        # their share of the short items too: 128 decodes over 512 keys
        # beside one over 131072, 1280 items, 363 -> 291 us; 1024 over 256
        # beside one over 65536, 9216 items (70 waves), 850 -> 546 us (H100,
        # BENCHMARKS.md, seventieth session).
        n_ctas, pair = work_items(split_entries, nheads, max_seqlen_q, cfg, pack), 1
    else:
        # Split: items past a sequence's rows exit at once (deal_split).
        n_ctas, pair = (deal_split if split else deal)(items * num_splits, cfg, device)
    mode = replace(mode, dependent=launched_dependent(split, n_ctas, sms))
    # No more heads to a section than a sequence has: most sections then lie
    # inside one sequence, whose dead items (query tiles past its rows) run
    # contiguously there and are skipped with one atomic
    # (forward._skip_dead_run; a section across two sequences draws them
    # one by one). Under PackGQA an item's head is a KV head, whose query
    # heads are already in its tile.
    section = min(l2_section(max_seqlen_k, cfg.head_dim, dtype.itemsize, group // pack_g), item_heads)
    kernel_lse = write_lse and not split  # the combine writes the LSE of a split run
    constexprs = kernel_constexprs(cfg, causal, kernel_lse, mode)
    return LaunchPlan(cfg, mode, num_splits, n_ctas, pair, section, (device, dtype, causal, kernel_lse, cfg, mode),
                      constexprs, tuple(constexprs.values()), split_entries if table else 0)


def _split_table(lp: LaunchPlan, cfg: ForwardConfig, batch: int, max_seqlen_k: int, cu_k, seqused_k,
                 lse_part) -> torch.Tensor:
    """A split table's launch (``Mode.split_table``): the table of
    ``lp.split_entries`` int32 entries, written on the device by
    ``kernels/split_table.py`` from the key lengths (``seqused_k``, else
    ``cu_k``'s differences; contiguous int32), which also fills
    ``lse_part`` (contiguous) with -inf; stream-ordered before the forward
    kernel that reads both."""
    from .kernels.split_table import FILL_BLOCK, split_table_kernel

    table = torch.empty(lp.split_entries, dtype=torch.int32, device=lse_part.device)
    n_lse = lse_part.numel()
    launch_triton(split_table_kernel, (1 + triton_cdiv(n_lse, FILL_BLOCK), 1, 1),
                  (cu_k, seqused_k if seqused_k is not None else cu_k, table, lse_part, batch, lp.split_entries,
                   split_table_blocks(max_seqlen_k, lp.num_splits, cfg), lp.num_splits, n_lse),
                  dict(BLOCK_N=cfg.block_n, SEQUSED=seqused_k is not None, BLOCK_B=128,
                       S_MAX=max(2, 1 << (lp.num_splits - 1).bit_length()), FILL=FILL_BLOCK), num_warps=4)
    return table


def launch_forward_varlen(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q: int,
                          max_seqlen_k: int, softmax_scale: float, causal: bool,
                          cfg: ForwardConfig | None = None, window: tuple[int, int] | None = None,
                          softcap: float = 0.0, sink: torch.Tensor | None = None,
                          page_table: torch.Tensor | None = None, pack_gqa: bool | None = None,
                          num_splits: int = 1) -> None:
    """Launch the forward kernel's VARLEN mode on THD tensors (``window``,
    ``softcap`` and ``sink`` as in ``launch_forward``; ``pack_gqa``: PackGQA,
    None for ``choose_varlen_pack_gqa``; ``num_splits``: KV splits, 0 for
    the heuristic, merged by the combine kernel: the packed rows are its
    one sequence of ``total_q`` rows).

    Arguments are assumed validated (``checks.check_varlen_arguments``):
    q ``[total_q, H, D]``, k/v ``[total_k, Hkv, D]`` (v's head dim may
    differ; TMA-addressable views), ``out`` contiguous like q with v's head dim, ``lse`` None or contiguous fp32 ``[H, total_q]``,
    int32 ``cu_seqlens_*`` [B+1] and ``seqused_*`` [B] on q's device, q's
    device current. With ``page_table`` (int32 ``[B, max_pages]``, vLLM's
    layout) k and v are page pools ``[num_pages, page_size, Hkv, D]`` as in
    ``launch_forward`` and sequence ``b``'s keys are the first
    ``seqused_k[b]`` of its row (``seqused_k`` required; ``cu_seqlens_k``
    unread, may be None). Nothing is read back from the device."""
    total_q, nheads, head_dim = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    device = q.device.index
    write_lse = lse is not None
    paged = page_table is not None
    cfg = cfg or CONFIGS[kernel_head_dim(head_dim, v.shape[-1])]
    page_size = k.shape[1] if paged else 0
    assert not paged or (seqused_k is not None and k.dim() == 4)
    k, v, gather = gathered_pools(k, v, page_size, cfg, "launch_forward_varlen")
    k_pool, v_pool = gather if gather is not None else (out, out)  # (out: no page pools to gather)
    nheads_kv = k.shape[-2]
    group = nheads // nheads_kv
    viewed = packs_by_view(group)
    q_rows = viewed and rows_of_q(q, cfg)
    if pack_gqa is None and viewed:
        # (Resolved here, before the cached plan: its key has no room for q's rows.)
        pack_gqa = (q_rows and causal and cfg.head_dim == VIEW_ROWS_ALWAYS) or choose_varlen_view(
            total_q, batch, int(max_seqlen_q), int(max_seqlen_k), 0 if paged else k.shape[0], group)
    skew = varlen_skew_splits(k.shape[0], batch, int(max_seqlen_q), int(max_seqlen_k), nheads, group, cfg, pack_gqa,
                              window, device) if num_splits == 0 and not paged else 1
    lp = _plan_varlen(device, q.dtype, batch, int(max_seqlen_q), int(max_seqlen_k), nheads, group, cfg,
                      seqused_q is not None, seqused_k is not None, bool(causal), write_lse, window, softcap > 0,
                      sink_mode(sink), narrower_width(out.shape[2], cfg.head_dim), page_size, pack_gqa,
                      int(num_splits), varlen_total_q_key(total_q, nheads, cfg, device) if num_splits == 0 else 0,
                      skew, varlen_split_table(k.shape[0], batch, int(max_seqlen_k), skew, cfg) if skew > 1 else 0,
                      q_rows)
    assert out.is_contiguous() and (lse is None or lse.is_contiguous())
    cfg = lp.cfg  # the plan may widen the tiles (head dim 64's WIDE_CONFIGS)
    split = lp.mode.split
    q4, o4 = q.unsqueeze(0), out.unsqueeze(0)
    if split:
        # The fixed-length launch's partials with the packed rows as one
        # sequence: fp32 O [splits, 1, total_q, H, D], LSE [splits, 1, H,
        # total_q], one allocation. Rows in no sequence (past seqused_q) get
        # none from the kernel: O 0 and LSE -inf there, which the combine
        # turns into 0 and -inf.
        o_part, lse_part = _partial_views(*_partials(lp, q4), lp, q4)
        # A split table's launch fills the partial LSEs (below); so do these
        # two for rows in no sequence, which get nothing from the kernel.
        if seqused_q is not None and not lp.mode.split_table:
            o_part.zero_()
            lse_part.fill_(-math.inf)
        o_ptr, lse_part_ptr, kernel_lse = o_part, lse_part, out
    else:
        o_ptr, lse_part_ptr, kernel_lse = out, out, lse if write_lse else out
    cu_q = cu_seqlens_q.contiguous()
    cu_k = cu_seqlens_k.contiguous() if cu_seqlens_k is not None else cu_q  # (paged: unread)
    used_q = seqused_q.contiguous() if seqused_q is not None else cu_q
    used_k = seqused_k.contiguous() if seqused_k is not None else cu_k
    # A split table and the partial LSEs -inf: a sequence with fewer splits
    # leaves slots unwritten (rows past seqused_q none at all), whose outputs
    # the combine then never reads.
    table = _split_table(lp, cfg, batch, int(max_seqlen_k), cu_k, used_k if seqused_k is not None else None,
                         lse_part) if lp.mode.split_table else None
    # o_part_ptr carries O itself (row-predicated stores, not a TMA box), or the split partials.
    sched = _item_counter(q.device) if lp.mode.dynamic else table if lp.mode.split_table else out
    ptrs = (kernel_lse, used_k, out, page_table if paged else out, o_ptr, lse_part_ptr, cu_q, cu_k, used_q,
            sched, q if lp.mode.q_rows else out, k_pool, v_pool, sink if sink is not None else out)
    scalars = (int(max_seqlen_q), int(max_seqlen_k), nheads, group, batch,
               *kernel_scales(softmax_scale, softcap), lp.split_entries or lp.num_splits, lp.pair,
               page_table.stride(0) if paged else 0, total_q, lp.section, q_row_heads(q) if lp.mode.q_rows else 0)
    k4, v4 = (k, v) if k.dim() == 4 else (k.unsqueeze(0), v.unsqueeze(0))
    qd = kernel_q(q4, lp.mode)  # (q4 keeps the partials' shape)
    # Triton specialises pointer arguments on 16-byte alignment: a cu_seqlens
    # view at an odd offset must not reuse a kernel compiled for aligned ones.
    key = lp.key + tuple(t.data_ptr() % 16 == 0 for t in ptrs)
    kernel = _COMPILED.get(key)
    if kernel is None or not FAST_LAUNCH or _launch_hooked():
        blocks = block_shapes(cfg, lp.mode.box_g, page_size)
        descs = (_descriptor(qd, blocks["q"]), _descriptor(k4, blocks["k"]), _descriptor(v4, blocks["v"]),
                 _descriptor(o4, blocks["o"]))
        _COMPILED[key] = _jit_launch(lp, cfg, (*descs, *ptrs, *scalars))
    else:
        kernel((lp.n_ctas, 1, 1), driver.active.get_current_stream(device), (qd, k4, v4, o4),
               (*ptrs, *scalars, *lp.constexpr_values))
    if split:
        launch_combine(o_part, lse_part, o4, lse.unsqueeze(0) if write_lse else None, sink)
