"""Launching a compiled kernel again with little host time.

A decode step or a short prefill runs shorter on the GPU than Triton's own
launch of a compiled kernel (``CompiledKernel.run``, the nvidia driver's
``CudaLauncher``) takes on the host. Per call, that path

* in Python, walks every argument and turns each host tensor descriptor
  into a freshly encoded ``CUtensorMap`` (``fill_tma_descriptor``: a
  ``cuTensorMapEncodeTiled`` call) followed by its shape and strides, and
  asks the allocators for (empty) scratch buffers;
* in C, parses the arguments and, for each tensor, calls its ``data_ptr()``
  and ``cuPointerGetAttribute``, then launches.

On the H200 (B1 decode against 32k keys, fourteenth session,
``scripts/backend_host.py``) that was about half of a forward call's host
time: two launches (the kernel and the split-KV combine) with four
descriptors.

``KernelLaunch`` wraps one compiled kernel and, where it can (``direct``),
calls the C launch function itself:

* with each descriptor's encoded arguments cached by (argument slot,
  address, shape, strides): the encoding is a pure function of those and of
  the kernel's box, swizzle and element type, which are fixed per compiled
  kernel, so a cached entry is exactly what a fresh encoding would give (a
  static KV cache is passed again every step, and the caching allocator
  hands the same addresses back for the per-call tensors; a growing cache
  is a new tensor every step, so a miss costs only the encoding and the
  arguments, with the kernel's part precomputed, ``_Direct.encode``);
* with tensors passed as their addresses (Python ints), which both launch
  functions accept as they are. Callers pass only CUDA tensors that were
  validated already (``hopper_flash.checks``).

Where it cannot (a Triton version whose private calling convention was not
read, scratch buffers, a descriptor kind other than tiled, a stand-in kernel
in the CPU tests), it calls ``CompiledKernel.run`` with light descriptor
objects (``TmaArg``) instead, as before.

Conventions (read in the sources of each version):

* triton 3.6: ``run.launch`` is ``wrap_handle_tensordesc``'s closure over
  the generated C module's ``launch`` (free variable ``launcher``; the bare
  C function when the kernel has no descriptors). It takes
  ``(gx, gy, gz, stream, function, cooperative, pdl, global_scratch,
  profile_scratch, kernel_metadata, launch_metadata, enter_hook, exit_hook,
  *kernel_args)``; descriptors expand to ``[tensor_map, *shape, *strides]``
  with the map from ``utils.fill_tma_descriptor``.
* triton 3.7-3.9: one C launcher for every kernel (``utils.launch``, the
  closure's ``launcher``) taking ``(gx, gy, gz, stream, function,
  cooperative, pdl, kernel_metadata, launch_metadata, enter_hook, exit_hook,
  global_scratch, profile_scratch, arg_annotations, kernel_signature,
  kernel_args)``; the map from ``utils.fill_tma_descriptor_tiled``.

``tests/test_launcher_cpu.py`` checks on the CPU that the direct call hands
the C function what Triton's own wrapper hands it (the installed triton's
real wrapper, a recording stand-in for the C function);
``tests/test_launch_gpu.py`` that both launches agree bit for bit on the GPU.
"""
from __future__ import annotations

import torch

# Encoded descriptors kept per compiled kernel before the cache starts over
# (a decode loop needs a handful; distinct shapes each add one per tensor).
DESCRIPTOR_CACHE_LIMIT = 256


def tma_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides with those of extent-1 axes replaced by the contiguous
    value: the kernel never steps along such an axis, but TMA still wants every
    stride 16-byte aligned, and torch leaves them arbitrary."""
    shape, strides = t.shape, t.stride()
    if 1 not in shape[:-1]:
        return strides
    fixed = list(strides)
    for d in range(len(shape) - 2, -1, -1):
        if shape[d] == 1:
            fixed[d] = fixed[d + 1] * shape[d + 1]
    return tuple(fixed)


class TmaArg:
    """What Triton's launcher reads from a host TensorDescriptor (base, shape,
    strides, padding; round_f32_to_tf32 from triton 3.7 on), without its
    per-call validation: the arguments were validated once already, in
    ``hopper_flash.checks``."""

    __slots__ = ("base", "shape", "strides", "padding", "round_f32_to_tf32")

    def __init__(self, t: torch.Tensor):
        self.base = t
        self.shape = t.shape
        self.strides = tma_strides(t)
        self.padding = "zero"
        self.round_f32_to_tf32 = False


def _free_variables(fn) -> dict:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells:
        return {}
    return dict(zip(code.co_freevars, (c.cell_contents for c in cells)))


class _Direct:
    """The pieces of a direct call to a compiled kernel's C launch function."""

    def __init__(self, c_launch, fill, host_dtypes, meta, new_convention, run):
        self.c_launch = c_launch
        self.fill = fill
        self.host_dtypes = host_dtypes
        self.meta = meta
        # Per descriptor slot, the encoder's arguments after the address that
        # the compiled kernel fixes: swizzle, element size and type, box.
        self.encode = [(m["swizzle"], m["elem_size"], host_dtypes[m["elem_type"]], m["block_size"]) for m in meta]
        self.new_convention = new_convention
        self.cooperative = run.launch_cooperative_grid
        self.pdl = run.launch_pdl
        self.annotations = getattr(run, "arg_annotations", None)
        self.signature = getattr(run, "kernel_signature", None)


def direct_parts(compiled, utils=None) -> _Direct | None:
    """How to call ``compiled``'s C launch function directly, or None where
    this module does not know its convention (module docstring)."""
    from . import _triton_support

    if _triton_support.parse_minor(_triton_support.installed_version()) not in _triton_support.DIRECT_LAUNCH_MINORS:
        return None
    run = getattr(compiled, "run", None)
    need = ("launch", "global_scratch_size", "profile_scratch_size", "launch_cooperative_grid", "launch_pdl")
    if run is None or not all(hasattr(run, a) for a in need):
        return None
    if run.global_scratch_size or run.profile_scratch_size or getattr(run, "gsan_enabled", False):
        return None
    new_convention = hasattr(run, "arg_annotations")
    if new_convention and not hasattr(run, "kernel_signature"):
        return None
    free = _free_variables(run.launch)
    c_launch = free.get("launcher", run.launch)
    if not callable(c_launch) or _free_variables(c_launch):
        return None  # a Python wrapper we do not know
    meta = getattr(compiled.metadata, "tensordesc_meta", None) or []
    for m in meta:
        if m is None or m.get("fp4_padded") or m.get("is_im2col"):
            return None
    if utils is None:
        from triton.runtime.driver import driver

        utils = driver.active.utils
    from triton.backends.nvidia import driver as nvidia_driver

    fill = getattr(utils, "fill_tma_descriptor_tiled" if new_convention else "fill_tma_descriptor", None)
    if meta and fill is None:
        return None
    return _Direct(c_launch, fill, nvidia_driver.TMA_DTYPE_DEVICE_TO_HOST, meta, new_convention, run)


class KernelLaunch:
    """Later launches of one compiled kernel (``compiled``: what the JIT's
    first ``kernel[grid](...)`` returned)."""

    def __init__(self, compiled, direct: _Direct | None | bool = True):
        self.compiled = compiled
        self.function = compiled.function
        self.packed_metadata = compiled.packed_metadata
        self.direct = direct_parts(compiled) if direct is True else (direct or None)
        self._descriptors: dict[tuple, tuple] = {}
        self._layouts: dict[int, tuple] = {}
        # Positions of the tensor arguments in ``args``: taken from the first
        # direct call (every call site passes tensors in the same parameters;
        # anything else fails loudly, in ``data_ptr`` or in the C parser).
        self._tensor_slots: tuple[int, ...] | None = None

    def _descriptor_args(self, slot: int, t: torch.Tensor) -> tuple:
        shape, strides, address = t.shape, t.stride(), t.data_ptr()
        key = (slot, address, shape, strides)
        args = self._descriptors.get(key)
        if args is None:
            # A miss is on every call's path too: a decode step's K/V move
            # (a growing cache is a new tensor every step), in the same
            # layout for every layer of the step (``_layouts``: the last per slot).
            layout = self._layouts.get(slot)
            if layout is None or layout[0] != shape or layout[1] != strides:
                layout = self._layouts[slot] = self._layout(slot, t)
            args = (self.direct.fill(address, *layout[2]), *layout[3])
            if len(self._descriptors) >= DESCRIPTOR_CACHE_LIMIT:
                self._descriptors.clear()
            self._descriptors[key] = args
        return args

    def _layout(self, slot: int, t: torch.Tensor) -> tuple:
        """What a descriptor of ``slot`` takes from ``t`` but its address:
        the shape and strides it was made for, the encoder's arguments after
        the address (the kernel's box, swizzle and element type, the shape
        and TMA strides), and the kernel arguments after the map."""
        strides = tma_strides(t)
        return (t.shape, t.stride(), (*self.direct.encode[slot], list(t.shape), list(strides), 0),
                (*t.shape, *strides))

    def __call__(self, grid: tuple[int, int, int], stream: int, descs: tuple, args: tuple) -> None:
        """Launch on ``stream`` with kernel arguments ``(*descs, *args)``:
        ``descs`` the tensors behind the kernel's leading descriptor
        parameters (TMA-ready views), ``args`` the rest in parameter order,
        constexpr values included (tensors for pointers)."""
        d = self.direct
        if d is None:
            self.compiled.run(grid[0], grid[1], grid[2], stream, self.function, self.packed_metadata, None, None,
                              None, *(TmaArg(t) for t in descs), *args)
            return
        slots = self._tensor_slots
        if slots is None:
            slots = self._tensor_slots = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        args = list(args)
        for i in slots:
            args[i] = args[i].data_ptr()
        self.launch_addresses(grid, stream, descs, args)

    def launch_addresses(self, grid: tuple[int, int, int], stream: int, descs: tuple, args: tuple) -> None:
        """``__call__`` for a caller that passes every pointer argument as its
        address (an int) already: no per-argument conversion, and pointers
        that are not a tensor's start (a partials buffer's second half) need
        no view. Only where ``direct`` is set (``CompiledKernel.run`` wants
        tensors for the pointers the JIT specialised on alignment)."""
        flat = []
        for slot, t in enumerate(descs):
            flat.extend(self._descriptor_args(slot, t))
        flat.extend(args)
        self.launch_flat(grid, stream, flat)

    def launch_flat(self, grid: tuple[int, int, int], stream: int, flat: list) -> None:
        """Launch with the kernel's arguments flattened as the C launch
        function takes them: each descriptor's encoded arguments
        (``_descriptor_args``), then the rest, pointers as addresses. For a
        caller that keeps the flattened list as a template (``plan.PreparedForward``)."""
        d = self.direct
        if d.new_convention:
            d.c_launch(grid[0], grid[1], grid[2], stream, self.function, d.cooperative, d.pdl, self.packed_metadata,
                       None, None, None, None, None, d.annotations, d.signature, flat)
        else:
            d.c_launch(grid[0], grid[1], grid[2], stream, self.function, d.cooperative, d.pdl, None, None,
                       self.packed_metadata, None, None, None, *flat)
