"""Prepared calls launched from C (``csrc/prepared_launch.c``).

A prepared forward call (``plan._PreparedLaunch``) keeps its kernels'
arguments as templates. Launching them from Python costs, per call, four TMA
descriptors encoded through Triton's ``fill_tma_descriptor``, two argument
lists of ~45 objects built and parsed back by Triton's launcher: inside a
model's decode step, where every layer runs it cold, about half of the
backend call's host time (BENCHMARKS.md, twenty-fourth session). This module
turns a prepared launch's templates into kernel-parameter storage once, so a
call is one C function taking the values that change.

What the C side must agree with is Triton's launcher for the kernel, which
this module reads rather than restates where it can: the expanded signature
(a host TensorDescriptor with its metadata becomes the map, then its shape as
i32 and its strides as i64; constexprs are no parameters; two null scratch
pointers close the list), the kernel metadata (warps, CTAs, shared memory),
and the launch flags. Both launcher conventions are taken: triton 3.6's
(``_Direct.new_convention`` False; torch 2.10 and 2.11 pin it) and the
generic launcher of 3.7 to 3.9 (torch 2.12 and 2.13 pin 3.7). They hand the
kernel the same parameters (the compiled kernels' parameter lists are the
same under 3.6.0, 3.7.1, 3.8.0 and 3.9.0, read from their PTX on the CPU),
encode maps with the same cuTensorMapEncodeTiled arguments
(``fill_tma_descriptor`` and ``fill_tma_descriptor_tiled``) and launch with
the same attributes for one-CTA clusters under 228 KB of shared memory; they
differ in how an ``i1`` parameter is stored (one byte in 3.6, four from 3.7),
which ``param_size`` follows. The C path is on by default under every
supported triton (``HOPPER_FLASH_C_LAUNCH=0`` turns it off): under 3.6 since
the twenty-fifth session, under 3.7-3.9 since the twenty-seventh, when the
whole GPU suite passed on the H200 under triton 3.7.1 with it forced on and
a model's generation under 3.9.0 ran through it; the whole suite passed
under 3.9.0 with it on in the twenty-eighth, and under 3.8.0 in the
twenty-ninth (BENCHMARKS.md). Wherever anything is unexpected, ``prepare`` returns
None and the Python path runs.

The module is compiled at first use with Triton's own helper (the C compiler
Triton needs for its launchers, Python's headers, Triton's ``cuda.h``) and
opens ``libcuda.so.1`` itself.
"""
from __future__ import annotations

import os
import re
import struct
from functools import cache

# A parameter's kind, as the C side numbers them.
P_CONST, P_VALUE, P_MAP, P_DIM, P_STRIDE = range(5)
LIBCUDA = "libcuda.so.1"

_SIZES = {"i1": 1, "i8": 1, "u1": 1, "u8": 1, "i16": 2, "u16": 2, "fp16": 2, "bf16": 2,
          "i32": 4, "u32": 4, "fp32": 4, "f32": 4, "i64": 8, "u64": 8, "fp64": 8}


def enabled() -> bool:
    return os.environ.get("HOPPER_FLASH_C_LAUNCH", "1") not in ("", "0")


@cache
def module(libcuda: str = LIBCUDA):
    """The compiled module with libcuda opened, or None where it cannot be
    built or loaded (no C compiler, no libcuda): the Python path then runs."""
    try:
        import triton
        from triton.runtime.build import compile_module_from_src

        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, "csrc", "prepared_launch.c")) as f:
            src = f.read()
        include = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")
        mod = compile_module_from_src(src, "hopper_flash_prepared_launch", include_dirs=[include])
    except Exception:  # noqa: BLE001 - any failure leaves the Python path
        return None
    return mod if mod.init(libcuda) else None


def expanded_signature(compiled) -> list[tuple] | None:
    """The compiled kernel's parameters as Triton's launcher expands them
    (``make_launcher``'s ``_expand_signature``, for descriptors with
    metadata), one entry per item of the flattened argument list that
    ``KernelLaunch.launch_flat`` passes, constexprs included: ``("map", d)``
    for descriptor ``d``, then ``("dim", d, axis, type)`` per axis of its
    shape and ``("stride", d, axis, type)`` per axis of its strides, and
    ``("arg", type)`` for the rest. None where the signature holds something
    this module does not take (tuples, a descriptor without metadata, one
    not of rank 4)."""
    src = getattr(compiled, "src", None)
    signature = getattr(src, "signature", None)
    if not isinstance(signature, dict):
        return None
    meta = list(getattr(compiled.metadata, "tensordesc_meta", None) or [])
    out, d = [], 0
    for ty in signature.values():
        if not isinstance(ty, str):
            return None
        if ty.startswith("tensordesc"):
            match = re.match(r"tensordesc<([^[>]*)\[([^]]*)\]", ty)
            if match is None or d >= len(meta) or meta[d] is None or match.group(2).count(",") != 3:
                return None
            out += [("map", d)] + [("dim", d, a, "i32") for a in range(4)] + [("stride", d, a, "i64") for a in range(4)]
            d += 1
        else:
            out.append(("arg", ty))
    return out if d == len(meta) else None


def param_size(ty: str, new_convention: bool) -> int | None:
    """Bytes Triton's launcher stores a parameter of type ``ty`` in: 8 for
    a pointer, a scalar's C type's size, but an ``i1``, which 3.7's generic
    launcher extracts as an int32 (3.6 as an int8). None for a type not in
    the table."""
    if ty.startswith("*"):
        return 8
    if ty == "i1" and new_convention:
        return 4
    return _SIZES.get(ty)


def _const_bits(ty: str, value, size: int | None = None) -> int | None:
    """A constant argument's bits as Triton's launcher packs it (an integer
    in ``size`` bytes, default its type's), or None."""
    if ty.startswith("*"):
        return 0 if value is None else value if isinstance(value, int) and not isinstance(value, bool) else None
    if value is None or ty not in _SIZES:
        return None
    if ty in ("fp32", "f32"):
        return struct.unpack("<I", struct.pack("<f", value))[0]
    if ty == "bf16":
        return struct.unpack("<I", struct.pack("<f", value))[0] >> 16  # truncated, as Triton's pack_bf16
    if ty == "fp16":
        return struct.unpack("<H", struct.pack("<e", value))[0]
    if ty == "fp64":
        return struct.unpack("<Q", struct.pack("<d", value))[0]
    if isinstance(value, int):  # bools too
        return int(value) & ((1 << (8 * (size or _SIZES[ty]))) - 1)
    return None


def launch_spec(kernel, grid, flat: list, slots, descs) -> tuple | None:
    """``make``'s spec of one launch: ``flat`` the argument list that
    ``launch_flat`` would take (descriptor entries may be placeholders),
    ``slots`` its ``(index, value index)`` pairs of per-call values (the
    order of ``plan._Slot``), ``descs`` per descriptor ``(tensor, elem_type,
    elem_size, swizzle, box, shape, strides)`` (``tensor``: 0 q, 1 k, 2 v,
    3 out; k's and v's length and strides come with each call). None where
    anything is unexpected."""
    d = kernel.direct
    if d is None:
        return None
    entries = expanded_signature(kernel.compiled)
    if entries is None or len(entries) != len(flat):
        return None
    num_warps, num_ctas, shared = kernel.packed_metadata
    if num_ctas != 1:
        return None
    slot_of = dict(slots)
    params, n_maps = [], 0
    for i, e in enumerate(entries):
        if e[0] == "map":
            n_maps += 1
            params.append((P_MAP, 128, e[1], 0, 0))
        elif e[0] in ("dim", "stride"):
            params.append((P_DIM if e[0] == "dim" else P_STRIDE, _SIZES[e[3]], e[1], e[2], 0))
        elif e[1] == "constexpr":
            continue
        else:
            size = param_size(e[1], d.new_convention)
            if size is None:
                return None
            if i in slot_of:
                params.append((P_VALUE, size, slot_of[i], 0, 0))
            else:
                bits = _const_bits(e[1], flat[i], size)
                if bits is None:
                    return None
                params.append((P_CONST, size, 0, 0, bits))
    if n_maps != len(descs):
        return None
    return (kernel.function, tuple(grid), 32 * num_warps, shared, bool(d.pdl), bool(d.cooperative), params,
            list(descs))


def prepare(specs):
    """The C state for these launch specs, or None."""
    if not enabled() or any(s is None for s in specs):
        return None
    mod = module()
    if mod is None:
        return None
    return mod.make(specs)
