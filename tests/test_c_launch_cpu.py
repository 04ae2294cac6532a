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
import ctypes
import os
import shutil
import struct
import subprocess
from types import SimpleNamespace

import pytest
import torch
from test_direct_launch_cpu import fakes, remembering  # noqa: F401  (fixtures)

from hopper_flash import c_launch, dispatch, kvcache, launcher, plan

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


_KERNELS: dict = {}


def _compiled(key):
    """The real forward kernel of plan key ``key`` (and for a split mode the
    combine) compiled for sm_90a, with the real kernels restored for the
    compile where a test has patched them out: their signatures and
    descriptor metadata are what the launchers read (the combine's
    signature is the same for every split count)."""
    if key in _KERNELS:
        return _KERNELS[key]
    from hopper_flash import compile_check
    from hopper_flash.kernels import forward

    _, dtype, causal, write_lse, cfg, mode = key
    name = str(dtype).removeprefix("torch.")
    patched = forward.attention_forward_kernel
    forward.attention_forward_kernel = getattr(patched, "real", patched)
    try:
        fwd = compile_check.compile_forward(cfg, name, causal, write_lse, mode)
    finally:
        forward.attention_forward_kernel = patched
    comb = None
    if mode.split:
        constexprs = plan._combine_constexprs(cfg.head_dim, 16, write_lse)
        comb = compile_check.compile_combine(constexprs, name, num_warps=1 if cfg.head_dim <= 128 else 2)
    _KERNELS[key] = fwd, comb
    return fwd, comb


def _kernel_launch(real, calls, fills, pdl, shared, new_convention=False):
    """A KernelLaunch of ``real``'s signature whose Python path records the
    flat argument list and the TMA encoder's arguments, in triton 3.6's
    launcher convention or (``new_convention``) 3.7's generic one."""
    from triton.backends.nvidia import driver as nvidia_driver

    def fill(*a):
        fills.append(a)
        return ("map", len(fills) - 1)
    run = SimpleNamespace(launch_cooperative_grid=False, launch_pdl=pdl)
    meta = list(getattr(real.metadata, "tensordesc_meta", None) or [])
    direct = launcher._Direct(lambda *a: calls.append(a), fill, nvidia_driver.TMA_DTYPE_DEVICE_TO_HOST, meta,
                              new_convention, run)
    compiled = SimpleNamespace(function=0xF00 + len(meta), packed_metadata=(real.metadata.num_warps, 1, shared),
                               src=real.src, metadata=real.metadata)
    return launcher.KernelLaunch(compiled, direct=direct)


def _pack(ty, value, new_convention=False):
    """A parameter as Triton's launcher stores it (3.6's make_launcher, and
    3.7-3.9's generic launcher alike: ints by C type, pointers as 64-bit
    addresses, fp32 as its bits; but an i1 is an int8 in 3.6 and an int32
    from 3.7, whose extractor table lists "i1" under int32)."""
    if ty.startswith("*"):
        return struct.pack("<Q", value or 0)
    if ty == "fp32":
        return struct.pack("<f", value)
    if ty == "i1":
        return struct.pack("<i" if new_convention else "<b", int(value))
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


def _signature(real):
    """The flat argument list's (name, type) pairs: each descriptor as its
    map, four i32 (shape) and four i64 (strides); constexprs stay (they are
    no parameters)."""
    out = []
    for name, ty in real.src.signature.items():
        out += ([(name, "map")] + [(name, "i32")] * 4 + [(name, "i64")] * 4 if ty.startswith("tensordesc")
                else [(name, ty)])
    return out


@pytest.fixture
def prepared(fakes, remembering):  # noqa: F811
    """The stand-in kernels, and CPU calls validated, remembered and prepared as CUDA ones are."""


def _decode_kv(batch, nheads_kv, length, head_dim, dtype=torch.bfloat16):
    """transformers' decode layout: [B, Hkv, L, D] seen as BSHD, in a longer buffer."""
    return torch.randn(batch, nheads_kv, length + 110, head_dim).to(dtype)[:, :, :length].transpose(1, 2)


# name: (q, k, v, causal, return_lse, the mode's split)
CASES = {
    # the backend's decode call; batch 1 has an extent-1 axis, whose stride TMA gets as the contiguous one
    "decode-b2": lambda: (torch.randn(2, 1, 8, 128).to(torch.bfloat16), _decode_kv(2, 2, 8190, 128),
                          _decode_kv(2, 2, 8190, 128), True, False, True),
    "decode-b1": lambda: (torch.randn(1, 1, 8, 128).to(torch.bfloat16), _decode_kv(1, 2, 8190, 128),
                          _decode_kv(1, 2, 8190, 128), True, False, True),
    "decode-d256-fp16-lse": lambda: (torch.randn(1, 1, 16, 256).to(torch.float16),
                                     _decode_kv(1, 4, 5000, 256, torch.float16),
                                     _decode_kv(1, 4, 5000, 256, torch.float16), True, True, True),
    "decode-d64": lambda: (torch.randn(2, 1, 8, 64).to(torch.bfloat16), _decode_kv(2, 2, 3000, 64),
                           _decode_kv(2, 2, 3000, 64), True, False, True),
    # v's head dim other than q's and k's: v's and out's maps 128 wide on head dim 256's kernel
    "decode-dv-192-128": lambda: (torch.randn(2, 1, 8, 192).to(torch.bfloat16), _decode_kv(2, 2, 3000, 192),
                                  _decode_kv(2, 2, 3000, 128), True, True, True),
    # prefill: O through its map (no combine), with the LSE; and the dynamic order's item counter
    "prefill-lse": lambda: (*(torch.randn(2, 130, 8, 128).to(torch.bfloat16) for _ in range(3)), False, True, False),
    "prefill-dynamic": lambda: (*(torch.randn(4, 2048, 32, 128).to(torch.bfloat16) for _ in range(3)), True, False,
                                False),
}


def _kv_case(layout, return_lse):
    """flash_attn_with_kvcache's decode call (prepared, ``kvcache``): lengths
    per row, and cache rows or pages (their addresses patched in per call)."""
    def make():
        q = torch.randn(2, 1, 8, 128).to(torch.bfloat16)
        kw = dict(cache_seqlens=torch.tensor([5000, 17], dtype=torch.int32))
        if layout == "pages":
            k, v = (torch.randn(2 * 64 + 5, 128, 2, 128).to(torch.bfloat16) for _ in "kv")
            kw["page_table"] = torch.randperm(2 * 64 + 5)[:128].view(2, 64).to(torch.int32)
        elif layout == "leftpad":  # flash-attn's cache_leftpad (the backend's padded decode steps)
            k, v = (torch.randn(2, 8190, 2, 128).to(torch.bfloat16) for _ in "kv")
            kw["cache_leftpad"] = torch.tensor([1000, 3], dtype=torch.int32)
        else:
            k, v = (torch.randn(3, 8190, 2, 128).to(torch.bfloat16) for _ in "kv")
            kw["cache_batch_idx"] = torch.tensor([2, 0], dtype=torch.int32)
        return q, k, v, True, return_lse, True, kw
    return make


KV_CASES = {"kvcache-rows": _kv_case("rows", False), "kvcache-pages-lse": _kv_case("pages", True),
            "kvcache-leftpad": _kv_case("leftpad", False)}


def _flat(call, new_convention):
    """The flat argument list of a recorded launcher call: after 13 leading
    arguments in 3.6's convention, the last argument in 3.7's."""
    return list(call[-1]) if new_convention else list(call[13:])


@pytest.mark.parametrize("convention", ["3.6", "3.7+"])
@pytest.mark.parametrize("case", list(CASES) + list(KV_CASES))
def test_the_c_launch_hands_the_driver_what_the_python_path_does(standin, prepared, monkeypatch, case, convention):
    new = convention == "3.7+"
    monkeypatch.setattr(c_launch, "module", lambda libcuda=None: standin.mod)
    if case in KV_CASES:
        q, k, v, causal, return_lse, split, kv_kw = KV_CASES[case]()
        monkeypatch.setattr(kvcache, "validate_kvcache", lambda *a, **kw: 0.1)  # (CPU tensors)

        def run():
            return kvcache.flash_attn_with_kvcache(q, k, v, **kv_kw, softmax_scale=0.1, causal=causal,
                                                   return_softmax_lse=return_lse)
    else:
        q, k, v, causal, return_lse, split = CASES[case]()

        def run():
            return dispatch.forward(q, k, v, 0.1, causal, return_lse)
    monkeypatch.setenv("HOPPER_FLASH_C_LAUNCH", "0")
    run()  # compiles (JIT stand-ins)
    [key] = plan._COMPILED
    assert key[5].split == split  # the case under test
    if case == "prefill-dynamic":
        assert key[5].dynamic
    fwd, comb = _compiled(key)
    calls, fills, c_calls = [], [], []
    plan._COMPILED[key] = _kernel_launch(fwd, calls, fills, False, 123456, new)
    if split:
        [c_key] = plan._COMBINE_OF
        plan._COMBINE_OF[c_key] = _kernel_launch(comb, c_calls, [], True, 0, new)
    res_py = run()  # direct: the Python path, prepared after it
    assert len(calls) == 1 and len(c_calls) == int(split) and len(fills) == 4
    [call] = plan._PREPARED.values()
    [(tiles, launch)] = call.launches.items()
    assert launch.c_state is None  # prepared while the C path was off
    monkeypatch.setenv("HOPPER_FLASH_C_LAUNCH", "1")
    call.launches[tiles] = type(launch)(launch.lp, launch.kernel, launch.combine, q, k.shape[2], 0.1, return_lse,
                                        head_dim_v=v.shape[3], kv_rows=k.shape[0], cache=call.cache)
    assert (call.cache is not None) == (case in KV_CASES)
    state = call.launches[tiles].c_state
    assert state is not None, "no C state"
    standin.lib.standin_reset(0, 0)
    res_c = run()  # the prepared call, launched from C
    assert len(calls) == 1 and len(c_calls) == int(split), "the prepared call took the Python path"
    rec = standin.launches()
    assert len(rec) == 1 + int(split)
    (out_py, lse_py), (out_c, lse_c) = [r if return_lse else (r, None) for r in (res_py, res_c)]

    # Each call's own buffers (out, LSE, partials, item counter) stand where
    # the other had its own: rename the Python call's to the C call's.
    f_sig = _signature(fwd)
    f_params = standin.mod.params(state, 0)
    flat = _flat(calls[0], new)
    assert len(flat) == len(f_sig)
    c_index = [i for i, (_, ty) in enumerate(f_sig) if ty != "constexpr"]
    assert len(f_params) == len(c_index)
    c_value = {f_sig[i][0]: struct.unpack("<Q", f_params[j])[0] for j, i in enumerate(c_index)
               if f_sig[i][1].startswith("*")}
    py_value = {name: flat[i] for i, (name, ty) in enumerate(f_sig) if ty.startswith("*")}
    rename = {out_py.data_ptr(): out_c.data_ptr()}
    if lse_py is not None:
        rename[lse_py.data_ptr()] = lse_c.data_ptr()
    for name in ("o_part_ptr", "lse_part_ptr", "sched_ptr"):
        rename.setdefault(py_value[name], c_value[name])
    # (a buffer of the call's own: partials of a split, the dynamic order's counter)
    for name, own in (("o_part_ptr", split), ("sched_ptr", key[5].dynamic)):
        assert (c_value[name] not in (0, out_c.data_ptr())) == own, name
    if split:
        assert c_value["lse_part_ptr"] - c_value["o_part_ptr"] == py_value["lse_part_ptr"] - py_value["o_part_ptr"]

    def expected(sig, flat, maps):
        got = []
        for (_, ty), value in zip(sig, flat):
            if ty == "constexpr":
                continue
            got.append(maps.pop(0) if ty == "map" else
                       _pack(ty, rename.get(value, value) if ty.startswith("*") else value, new))
        return got

    # The forward kernel: its maps as the encoder's arguments, the rest byte for byte.
    maps_py = []
    for slot in range(4):
        args = list(fills[slot])
        args[0] = (q, k, v, out_c)[slot].data_ptr()
        maps_py.append(_expected_map(args))
    for i, (got, exp) in enumerate(zip(f_params, expected(f_sig, flat, maps_py))):
        if isinstance(exp, dict):
            assert _decoded_map(got) == exp, f"map of parameter {i}"
        else:
            assert got[:len(exp)] == exp, f"parameter {i}"
    f = rec[0]
    lp = call.launches[tiles].lp
    assert list(f.grid) == [lp.n_ctas, 1, 1] and list(f.block) == [32 * fwd.metadata.num_warps, 1, 1]
    assert f.shared == 123456 and f.stream == 7 and f.n_attrs == 0
    assert f.function == plan._COMPILED[key].function
    if split:
        # The combine: byte for byte, by PDL (attribute 6), reading the forward's partials.
        c_params = standin.mod.params(state, 1)
        want = expected(_signature(comb), _flat(c_calls[0], new), [])
        assert [g[:len(e)] for g, e in zip(c_params, want)] == want
        assert struct.unpack("<Q", c_params[0])[0] == c_value["o_part_ptr"]
        c = rec[1]
        batch, seqlen_q, nheads, _ = q.shape
        assert list(c.grid) == [batch * seqlen_q * nheads, 1, 1]
        assert c.n_attrs == 1 and c.attr_ids[0] == 6 and c.attr_values[0] == 1


def test_a_refused_encode_or_launch_raises(standin, prepared, monkeypatch):
    # The driver's error comes back as a Python error naming the call, not a silent skip.
    monkeypatch.setattr(c_launch, "module", lambda libcuda=None: standin.mod)
    q = torch.randn(2, 1, 8, 128).to(torch.bfloat16)
    k = torch.randn(2, 8190, 2, 128).to(torch.bfloat16)
    dispatch.forward(q, k, k, 0.1, True, False)  # compiles (JIT stand-ins)
    [key] = plan._COMPILED
    [c_key] = plan._COMBINE_OF
    fwd, comb = _compiled(key)
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


def test_an_i1_parameter_is_stored_as_each_launcher_stores_it():
    # Triton 3.6's make_launcher stores an i1 in an int8, 3.7's generic
    # launcher in an int32 (its extractor table lists "i1" with "i32"); every
    # other scalar type keeps its C size under both.
    assert c_launch.param_size("i1", False) == 1 and c_launch.param_size("i1", True) == 4
    for ty, size in (("i32", 4), ("i64", 8), ("fp32", 4), ("fp16", 2), ("bf16", 2), ("i8", 1)):
        assert c_launch.param_size(ty, False) == c_launch.param_size(ty, True) == size
    assert c_launch.param_size("tuple", True) is None
    assert c_launch._const_bits("i1", True, 4) == 1 and c_launch._const_bits("i32", -1, 4) == 0xFFFFFFFF


@pytest.mark.parametrize("new_convention", [False, True])
def test_both_conventions_take_the_c_path_unless_turned_off(monkeypatch, new_convention):
    # Under triton 3.6 and 3.7-3.9 alike the C path is on by default and off
    # with HOPPER_FLASH_C_LAUNCH=0 (c_launch's docstring). Whether
    # launch_spec goes on to read the kernel's signature tells which.
    read = []
    monkeypatch.setattr(c_launch, "expanded_signature", lambda compiled: read.append(compiled))
    kernel = SimpleNamespace(direct=SimpleNamespace(new_convention=new_convention), compiled="kernel")
    for env in (None, "1"):
        if env is None:
            monkeypatch.delenv("HOPPER_FLASH_C_LAUNCH", raising=False)
        else:
            monkeypatch.setenv("HOPPER_FLASH_C_LAUNCH", env)
        read.clear()
        assert c_launch.enabled()
        assert c_launch.launch_spec(kernel, (1, 1, 1), [], [], []) is None  # (the stand-in signature reads None)
        assert read == ["kernel"], env
    monkeypatch.setenv("HOPPER_FLASH_C_LAUNCH", "0")
    assert not c_launch.enabled()
