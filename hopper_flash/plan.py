"""Host-side planning for the forward kernel: tile shapes per head dim, the
launch grid and tile order, TMA descriptors, and the launch itself.

Kept apart from ``hopper_flash.kernels`` (device code) and from
``hopper_flash.interface`` (argument checks), so each can be read alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

LOG2E = math.log2(math.e)

# Threads in the launch: two consumer warpgroups + the producer's warp, which
# is rounded up to a warpgroup for register allocation.
_LAUNCH_THREADS = 3 * 128
# The SM's register file is 64K 32-bit registers; `maxnreg` is the per-thread
# cap at launch, before setmaxnreg moves registers between partitions.
_LAUNCH_MAXNREG = 65536 // _LAUNCH_THREADS // 8 * 8  # 168


@dataclass(frozen=True)
class ForwardConfig:
    """Compile-time shape of one kernel specialisation."""

    head_dim: int
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
    maxnreg: int = _LAUNCH_MAXNREG

    def shared_bytes(self, elem_bytes: int = 2) -> int:
        tile = self.head_dim * elem_bytes
        return tile * (self.block_m + (self.k_stages + self.v_stages) * self.block_n + self.block_m)


# One entry per supported head dim. D=128 is the seed's configuration.
CONFIGS: dict[int, ForwardConfig] = {
    128: ForwardConfig(head_dim=128),
}
SUPPORTED_HEAD_DIMS = tuple(sorted(CONFIGS))
SUPPORTED_DTYPES = (torch.bfloat16, )


def kernel_constexprs(cfg: ForwardConfig, causal: bool, write_lse: bool) -> dict:
    """The constexpr arguments of ``attention_forward_kernel`` for a config."""
    return dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        HEAD_DIM=cfg.head_dim,
        K_STAGES=cfg.k_stages,
        V_STAGES=cfg.v_stages,
        IS_CAUSAL=bool(causal),
        WRITE_LSE=bool(write_lse),
        CONSUMER_REGS=cfg.consumer_regs,
        PRODUCER_REGS=cfg.producer_regs,
    )


def block_shapes(cfg: ForwardConfig) -> dict[str, list[int]]:
    """TMA boxes over the rank-4 ``[B, S, H, D]`` view: one head, ``rows`` of
    the sequence, the whole head dim. O is stored per consumer warpgroup."""
    return {
        "q": [1, cfg.block_m, 1, cfg.head_dim],
        "k": [1, cfg.block_n, 1, cfg.head_dim],
        "v": [1, cfg.block_n, 1, cfg.head_dim],
        "o": [1, cfg.block_m // 2, 1, cfg.head_dim],
    }


@lru_cache(maxsize=None)
def _smem_layout(block_shape: tuple[int, ...], gl_dtype_name: str):
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(block_shape), getattr(gl, gl_dtype_name))


_GL_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def smem_layout(block_shape, torch_dtype):
    return _smem_layout(tuple(block_shape), _GL_DTYPE[torch_dtype])


def grid(batch: int, nheads: int, seqlen_q: int, cfg: ForwardConfig) -> tuple[int, int, int]:
    """One CTA per (query tile, head, batch); the kernel reverses the tile axis."""
    return (triton_cdiv(seqlen_q, cfg.block_m), nheads, batch)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _descriptor(t: torch.Tensor, block_shape: list[int]):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), block_shape, smem_layout(block_shape, t.dtype))


def launch_forward(q, k, v, out, lse, softmax_scale: float, causal: bool) -> None:
    """Launch the forward kernel on the current stream of q's device.

    Arguments are assumed validated (``hopper_flash.interface``): BSHD,
    supported dtype and head dim, TMA-compatible strides, non-empty.
    """
    from .kernels.forward import attention_forward_kernel

    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    cfg = CONFIGS[head_dim]
    blocks = block_shapes(cfg)
    q_desc = _descriptor(q, blocks["q"])
    k_desc = _descriptor(k, blocks["k"])
    v_desc = _descriptor(v, blocks["v"])
    o_desc = _descriptor(out, blocks["o"])
    write_lse = lse is not None
    attention_forward_kernel[grid(batch, nheads, seqlen_q, cfg)](
        q_desc, k_desc, v_desc, o_desc, lse if write_lse else out,
        seqlen_q, seqlen_k, nheads, nheads // nheads_kv,
        softmax_scale * LOG2E, softmax_scale,
        **kernel_constexprs(cfg, causal, write_lse),
        num_warps=cfg.num_warps, maxnreg=cfg.maxnreg,
    )
