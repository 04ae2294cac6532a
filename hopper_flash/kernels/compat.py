"""The Gluon API differences between the supported triton versions.

hopper_flash supports triton 3.6.x through 3.9.x (every triton that a torch
release >= 2.10 pins, and the newest). Gluon is experimental and renames
things between minor releases; every such difference the kernels meet is
resolved here, once, so kernel code never tests a version.

| what | triton 3.6 / 3.7 | triton 3.8 / 3.9 |
| --- | --- | --- |
| TMA load global -> shared | ``tma.async_copy_global_to_shared`` | ``tma.async_load`` (the old name raises) |
| TMA store shared -> global | ``tma.async_copy_shared_to_global`` | ``tma.async_store`` (the old name raises) |
| cp.async global -> shared | ``async_copy.async_copy_global_to_shared`` | ``async_copy.async_load`` (3.9: the old name raises) |
| barrier over the partition's threads | ``gl.thread_barrier`` | ``gl.barrier`` (the old name is gone) |
| TMA reduce-add shared -> global | no Gluon builtin; the builder's ``create_async_tma_reduce`` backs ``tma_atomic_add`` below | ``tma.async_atomic_add`` |
| aggregates (structs a jit function takes and passes on) | ``triton.language.core._aggregate`` | ``gluon.aggregate`` |
| a shared buffer seen as another dtype/shape/layout | ``desc._reinterpret(dtype, shape, layout)`` | 3.9: ``desc.reinterpret(...)`` (the private name is gone) |

The names below are Gluon builtins, re-bound: a ``@gluon.jit`` function calls
``tma_load(desc, coord, bar, buf)`` exactly as it would call the original.
"""
from triton.experimental.gluon.language.nvidia.ampere import async_copy as _async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma

# 3.8 added async_load/async_store; 3.9 turned the old names into errors.
HAS_ASYNC_LOAD = hasattr(tma, "async_load")

if HAS_ASYNC_LOAD:
    tma_load = tma.async_load
    tma_store = tma.async_store
    cp_async_load = _async_copy.async_load
else:  # triton 3.6, 3.7
    tma_load = tma.async_copy_global_to_shared
    tma_store = tma.async_copy_shared_to_global
    cp_async_load = _async_copy.async_copy_global_to_shared


if hasattr(tma, "async_atomic_add"):  # triton >= 3.8
    tma_atomic_add = tma.async_atomic_add
else:  # triton 3.6, 3.7: the same op through the Gluon builder (cp.reduce.async.bulk.tensor .add)
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin as _builtin

    @_builtin
    def tma_atomic_add(tensor_desc, coord, src, _semantic=None):
        """Add the shared-memory tile ``src`` into global memory at ``coord``
        (``tensor_desc``'s box), atomically per element; completes like a TMA
        store (``tma.store_wait``)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)


from triton.experimental import gluon as _gluon
from triton.experimental.gluon import language as _gl

if "read_only" in getattr(tma.store_wait, "__wrapped__", tma.store_wait).__code__.co_varnames:  # triton >= 3.8

    @_gluon.jit
    def tma_store_wait_complete():
        """Wait until this thread's TMA stores/reduces are complete in global
        memory (not only done reading shared memory), e.g. before a release
        that lets another CTA read the result."""
        tma.store_wait(0, read_only=False)
else:  # triton 3.6, 3.7: store_wait is always the .read variant

    @_gluon.jit
    def tma_store_wait_complete():
        """See the triton >= 3.8 definition."""
        _gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; mov.u32 $0, 0;", "=r", [], dtype=_gl.int32,
                                   is_pure=False, pack=1)

try:  # the public name (triton 3.9)
    from triton.experimental.gluon import aggregate
except ImportError:  # triton 3.6 (and the releases between): the same decorator, private
    from triton.language.core import _aggregate as aggregate



@_gluon.constexpr_function
def init_fields(obj, args, constexpr=False):
    """Set an aggregate's fields from its constructor's arguments:
    ``init_fields(self, locals())`` as the constructor's first line (every
    argument but ``self`` is a field of the same name). ``constexpr``: the
    fields are ``gl.constexpr`` (the arguments arrive unwrapped)."""
    for name, value in args.items():
        if name != "self":
            setattr(obj, name, _gl.constexpr(value) if constexpr else value)


# bar.sync over the calling partition's warps (all warps outside warp_specialize).
thread_barrier = _gl.barrier if hasattr(_gl, "barrier") else _gl.thread_barrier

from triton.experimental.gluon.language._core import builtin as _builtin_any  # noqa: E402
from triton.experimental.gluon.language._core import shared_memory_descriptor as _smem  # noqa: E402

_REINTERPRET = getattr(_smem, "reinterpret", None) or _smem._reinterpret  # 3.9 made it public


@_builtin_any
def smem_reinterpret(buf, dtype, shape, layout, _semantic=None):
    """``buf`` (a shared memory descriptor) as ``dtype``, ``shape`` and
    ``layout``: the same bytes, another view."""
    return _REINTERPRET(buf, dtype, shape, layout, _semantic=_semantic)


__all__ = ["HAS_ASYNC_LOAD", "aggregate", "cp_async_load", "init_fields", "smem_reinterpret", "tma_load", "tma_store",
           "tma_atomic_add", "tma_store_wait_complete", "thread_barrier"]
