"""The Gluon API differences between the supported triton versions.

hopper_flash supports triton 3.6.x through 3.9.x (every triton that a torch
release >= 2.10 pins, and the newest). Gluon is experimental and renames
things between minor releases; every such difference the kernels meet is
resolved here, once, so kernel code never tests a version.

| what | triton 3.6 / 3.7 | triton 3.8 / 3.9 |
| --- | --- | --- |
| TMA load global -> shared | ``tma.async_copy_global_to_shared`` | ``tma.async_load`` (the old name raises) |
| TMA store shared -> global | ``tma.async_copy_shared_to_global`` | ``tma.async_store`` (the old name raises) |
| barrier over the partition's threads | ``gl.thread_barrier`` | ``gl.barrier`` (the old name is gone) |

The names below are Gluon builtins, re-bound: a ``@gluon.jit`` function calls
``tma_load(desc, coord, bar, buf)`` exactly as it would call the original.
"""
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

# 3.8 added async_load/async_store; 3.9 turned the old names into errors.
HAS_ASYNC_LOAD = hasattr(tma, "async_load")

if HAS_ASYNC_LOAD:
    tma_load = tma.async_load
    tma_store = tma.async_store
else:  # triton 3.6, 3.7
    tma_load = tma.async_copy_global_to_shared
    tma_store = tma.async_copy_shared_to_global

thread_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

__all__ = ["HAS_ASYNC_LOAD", "thread_barrier", "tma_load", "tma_store"]
