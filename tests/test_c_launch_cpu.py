"""Prepared calls launched from C (``hopper_flash/c_launch.py``,
``csrc/prepared_launch.c``) on the CPU machine, against a stand-in libcuda
(``tests/csrc/libcuda_standin.c``: the TMA encoder writes its arguments into
the map, the launch records its configuration).

The Python path (``KernelLaunch.launch_flat`` handing Triton's launcher a
flat argument list, descriptors encoded by Triton's ``fill_tma_descriptor``)
runs on the GPU in every decode test; the C path must hand the driver the
same thing. So a call goes through each on the same tensors, with the real
forward and combine kernels' signatures (compiled for sm_90a here): every
kernel parameter the C path wrote is compared with the flat list's entry,
packed as Triton's launcher packs it (stated here from its source, not
taken from the module under test), and every encoded map with the
encoder's arguments as Triton's ``fill_tma_descriptor`` derives them. The
GPU half (outputs through the C path bit-equal to the Python path's, graph
capture) is in tests/test_decode_gpu.py."""
import contextlib
import ctypes
import os
import shutil
import struct
import subprocess
from types import SimpleNamespace

import pytest
import torch
from test_direct_launch_cpu import fakes  # noqa: F401  (a fixture)

from hopper_flash import c_launch, checks, dispatch, launcher, plan

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                reason="no C compiler")


class Recorded(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3), ("shared", ctypes.c_uint32),
                ("stream", ctypes.c_uint64), ("function", ctypes.c_uint64), ("n_attrs", ctypes.c_uint32),
                ("attr_ids", ctypes.c_uint32 * 4), ("attr_values", ctypes.c_int32 * 4), ("params", ctypes.c_uint64)]


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("libcuda") / "libcuda_standin.so")
    cc = shutil.which("gcc") or shutil.which("cc")
    subprocess.check_call([cc, "-shared", "-fPIC", "-O1", "-o", path, os.path.join(HERE, "csrc", "libcuda_standin.c")])
    lib = ctypes.CDLL(path)
    mod = c_launch.module(path)
    assert mod is not None, "the C launch module did not build or load"

    def launches():
        out = (Recorded * 16)()
        return list(out[:lib.standin_launches(out, 16)])
    lib.standin_reset(0, 0)
    return SimpleNamespace(path=path, lib=lib, mod=mod, launches=launches)


@pytest.fixture(scope="module")
def kernels():
    """The real kernels of the case under test compiled for sm_90a (before
    any test patches them out): their signatures and descriptor metadata are
    what the launchers read (the combine's signature is the same for every
    split count)."""
    return _compiled(plan.CONFIGS[128], plan.Mode(pack_g=4, split=True))


def _compiled(cfg, mode, dtype="bfloat16"):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hopper_flash import compile_check
    from hopper_flash.kernels.combine import combine_kernel

    fwd = compile_check.compile_forward(cfg, dtype, True, False, mode)
    sig = {"o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
           "n_splits": "i32", "batch": "i32", "seqlen_q": "i32", "num_heads": "i32",
           "stride_ob": "i32", "stride_oq": "i32", "stride_oh": "i32",
           "HEAD_DIM": "constexpr", "S_MAX": "constexpr", "WRITE_LSE": "constexpr", "DEPENDENT": "constexpr"}
    constexprs = plan._combine_constexprs(cfg.head_dim, 16, False)
    comb = triton.compile(ASTSource(combine_kernel, sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 1})
    return fwd, comb


def _kernel_launch(real, calls, fills, pdl, shared):
    """A KernelLaunch of ``real``'s signature whose Python path records the
    flat argument list and the TMA encoder's arguments."""
    from triton.backends.nvidia import driver as nvidia_driver

    def fill(*a):
        fills.append(a)
        return ("map", len(fills) - 1)
    run = SimpleNamespace(launch_cooperative_grid=False, launch_pdl=pdl)
    meta = list(getattr(real.metadata, "tensordesc_meta", None) or [])
    direct = launcher._Direct(lambda *a: calls.append(a), fill, nvidia_driver.TMA_DTYPE_DEVICE_TO_HOST, meta,
                              False, run)
    compiled = SimpleNamespace(function=0xF00 + len(meta), packed_metadata=(real.metadata.num_warps, 1, shared),
                               src=real.src, metadata=real.metadata)
    return launcher.KernelLaunch(compiled, direct=direct)


def _pack(ty, value):
    """A parameter as Triton 3.6's launcher stores it (make_launcher: ints by
    C type, pointers as 64-bit addresses, fp32 as its bits, bf16 truncated)."""
    if ty.startswith("*"):
        return struct.pack("<Q", value or 0)
    if ty == "fp32":
        return struct.pack("<f", value)
    if ty == "i1":
        return struct.pack("<b", int(value))
    if ty == "i32":
        return struct.pack("<i", value)
    if ty == "i64":
        return struct.pack("<q", value)
    raise AssertionError(f"type {ty} not in this test's table")


def _expected_map(fill_args):
    """What Triton's fill_tma_descriptor hands cuTensorMapEncodeTiled for
    these arguments (address, swizzle, elem_size, elem_type, block, shape,
    strides, padding): innermost axis first, byte strides but the
    innermost's, unit element strides, no interleave (0), 128-byte L2
    promotion (2), the OOB fill of ``padding`` (0: none)."""
    address, swizzle, elem_size, elem_type, block, shape, strides, padding = fill_args
    rank = len(shape)
    return {"elem_type": elem_type, "rank": rank, "address": address, "dims": list(reversed(shape)),
                "strides": [elem_size * s for s in reversed(strides[:-1])], "box": list(reversed(block)),
                "unit": 1, "interleave": 0, "swizzle": swizzle, "l2": 2, "oob": 0 if padding == 0 else 1}


def _decoded_map(raw):
    v = struct.unpack_from("<iiQ4Q3Q4I5i", raw)
    return {"elem_type": v[0], "rank": v[1], "address": v[2], "dims": list(v[3:7]), "strides": list(v[7:10]),
                "box": list(v[10:14]), "unit": v[14], "interleave": v[15], "swizzle": v[16], "l2": v[17], "oob": v[18]}


def _signature_types(real):
    """The flat argument list's types: each descriptor as its map, four i32
    (shape) and four i64 (strides); constexprs stay (they are no
    parameters)."""
    types = []
    for ty in real.src.signature.values():
        types += ["map"] + ["i32"] * 4 + ["i64"] * 4 if ty.startswith("tensordesc") else [ty]
    return types


@pytest.fixture
def prepared(fakes, monkeypatch):  # noqa: F811
    monkeypatch.setattr(checks, "check_device", lambda t, name="q": None)
    monkeypatch.setattr(checks, "_PASSED", {})
    monkeypatch.setattr(checks, "_PASSED_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(plan, "_PREPARED", {})
    monkeypatch.setattr(plan, "on_device", lambda t: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)


@pytest.mark.parametrize("batch", [2, 1])
def test_the_c_launch_hands_the_driver_what_the_python_path_does(kernels, standin, prepared, monkeypatch, batch):
    monkeypatch.setattr(c_launch, "module", lambda libcuda=None: standin.mod)
    # transformers' decode layout: k/v [B, Hkv, L, D] seen as BSHD, strides of a longer buffer
    # (batch 1: an extent-1 axis, whose stride TMA gets as the contiguous one).
    q = torch.randn(batch, 1, 8, 128).to(torch.bfloat16)
    k = torch.randn(batch, 2, 8300, 128).to(torch.bfloat16)[:, :, :8190].transpose(1, 2)
    v = torch.randn(batch, 2, 8300, 128).to(torch.bfloat16)[:, :, :8190].transpose(1, 2)
    monkeypatch.setenv("HOPPER_FLASH_C_LAUNCH", "0")
    dispatch.forward(q, k, v, 0.1, True, False)  # compiles (JIT stand-ins)
    [key] = plan._COMPILED
    [c_key] = plan._COMBINE_OF
    mode = key[5]
    assert mode == plan.Mode(pack_g=4, split=True)  # the case under test
    fwd, comb = kernels
    calls, fills, c_calls = [], [], []
    plan._COMPILED[key] = _kernel_launch(fwd, calls, fills, False, 123456)
    plan._COMBINE_OF[c_key] = _kernel_launch(comb, c_calls, [], True, 0)
    out_py = dispatch.forward(q, k, v, 0.1, True, False)  # direct: the Python path, prepared after it
    assert len(calls) == len(c_calls) == 1 and len(fills) == 4
    [call] = plan._PREPARED.values()
    [launch] = call.launches.values()
    assert launch.c_state is None  # prepared while the C path was off
    monkeypatch.setenv("HOPPER_FLASH_C_LAUNCH", "1")
    [(tiles, launch)] = call.launches.items()
    call.launches[tiles] = type(launch)(launch.lp, launch.kernel, launch.combine, q, k.shape[2], 0.1, False)
    assert call.launches[tiles].c_state is not None, "no C state for the decode launch"
    standin.lib.standin_reset(0, 0)
    out_c = dispatch.forward(q, k, v, 0.1, True, False)  # the prepared call, launched from C
    assert len(calls) == len(c_calls) == 1, "the prepared call took the Python path"
    rec = standin.launches()
    assert len(rec) == 2
    state = call.launches[tiles].c_state

    # Per-call values: this call's out and partials stand where the Python call had its own.
    params_f = standin.mod.params(state, 0)
    params_c = standin.mod.params(state, 1)
    c_types = [t for t in _signature_types(comb) if t != "constexpr"]
    o_part_c = struct.unpack("<Q", params_c[0])[0]
    lse_part_c = struct.unpack("<Q", params_c[1])[0]
    o_part_py, lse_part_py = c_calls[0][13], c_calls[0][14]
    rename = {out_py.data_ptr(): out_c.data_ptr(), o_part_py: o_part_c, lse_part_py: lse_part_c}

    def expected(types, flat, maps):
        got = []
        for ty, value in zip(types, flat):
            if ty == "constexpr":
                continue
            if ty == "map":
                got.append(maps.pop(0))
            else:
                got.append(_pack(ty, rename.get(value, value) if ty.startswith("*") else value))
        return got

    # The forward kernel: its maps as the encoder's arguments, the rest byte for byte.
    f_types = _signature_types(fwd)
    flat = list(calls[0][13:])
    assert len(flat) == len(f_types)
    maps_py = []
    for slot, t in enumerate((q, k, v, out_py)):
        args = list(fills[slot])
        args[0] = {0: q.data_ptr(), 1: k.data_ptr(), 2: v.data_ptr(), 3: out_c.data_ptr()}[slot]
        maps_py.append(_expected_map(args))
    want = expected(f_types, flat, maps_py)
    assert len(params_f) == len(want)
    for i, (got, exp) in enumerate(zip(params_f, want)):
        if isinstance(exp, dict):
            assert _decoded_map(got) == exp, f"map of parameter {i}"
        else:
            assert got[:len(exp)] == exp, f"parameter {i}"
    # The combine.
    want_c = expected(c_types, list(c_calls[0][13:]), [])
    assert [g[:len(e)] for g, e in zip(params_c, want_c)] == want_c

    # The launches: grid, block, shared memory, stream, function, the combine by PDL (attribute 6).
    f, c = rec
    lp = call.launches[tiles].lp
    assert list(f.grid) == [lp.n_ctas, 1, 1] and list(f.block) == [32 * fwd.metadata.num_warps, 1, 1]
    assert f.shared == 123456 and f.stream == 7 and f.n_attrs == 0
    assert f.function == plan._COMPILED[key].function
    assert list(c.grid) == [batch * 1 * 8, 1, 1] and c.n_attrs == 1 and c.attr_ids[0] == 6 and c.attr_values[0] == 1
    assert out_c.shape == q.shape and out_c.data_ptr() != 0



def test_a_refused_encode_or_launch_raises(kernels, standin, prepared, monkeypatch):
    # The driver's error comes back as a Python error naming the call, not a silent skip.
    monkeypatch.setattr(c_launch, "module", lambda libcuda=None: standin.mod)
    q = torch.randn(2, 1, 8, 128).to(torch.bfloat16)
    k = torch.randn(2, 8190, 2, 128).to(torch.bfloat16)
    dispatch.forward(q, k, k, 0.1, True, False)  # compiles (JIT stand-ins)
    [key] = plan._COMPILED
    [c_key] = plan._COMBINE_OF
    fwd, comb = kernels
    plan._COMPILED[key] = _kernel_launch(fwd, [], [], False, 1000)
    plan._COMBINE_OF[c_key] = _kernel_launch(comb, [], [], True, 0)
    dispatch.forward(q, k, k, 0.1, True, False)  # direct, and prepared with its C state
    [call] = plan._PREPARED.values()
    assert all(launch.c_state is not None for launch in call.launches.values())
    try:
        standin.lib.standin_reset(1, 0)
        with pytest.raises(RuntimeError, match="cuTensorMapEncodeTiled failed: encode refused"):
            dispatch.forward(q, k, k, 0.1, True, False)
        standin.lib.standin_reset(0, 1)
        with pytest.raises(RuntimeError, match="cuLaunchKernelEx failed: launch refused"):
            dispatch.forward(q, k, k, 0.1, True, False)
    finally:
        standin.lib.standin_reset(0, 0)
