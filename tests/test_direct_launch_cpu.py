"""``plan.launch_forward``'s direct path on the CPU: once the forward kernel
and the split-KV combine have been compiled (here: stand-ins), later calls
pass every pointer as an address (``KernelLaunch.launch_addresses``) instead
of tensors and views. Each launch must hand the C launch function what the
first, tensor-passing launch handed the JIT, tensor for address; the split
partials, a fresh allocation per call, may sit elsewhere, but in the same
layout (O's partials first, the LSEs ``4 * splits * B * Sq * H * D`` bytes
after them), and the combine must read exactly what the kernel wrote.
The GPU half (the decode outputs through this path, graph replay with
changing lengths) is tests/test_decode_gpu.py, whose calls after the first
take it."""
import contextlib
from types import SimpleNamespace

import pytest
import torch

from hopper_flash import checks, dispatch, launcher, plan
from hopper_flash.kernels import combine, forward
from launch_fakes import FakeDriver, FakeJIT

META = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [1, 64, 1, 128], "fp4_padded": False}


def _recording_launch(calls: list, descriptors: int) -> launcher.KernelLaunch:
    """A compiled kernel whose C launch function (triton 3.6's convention)
    records the kernel arguments, and whose TMA encoder returns a marker."""
    run = SimpleNamespace(launch_cooperative_grid=False, launch_pdl=False)
    direct = launcher._Direct(lambda *a: calls.append(a[13:]), lambda *a: "map", {10: 9}, [META] * descriptors,
                              False, run)
    compiled = SimpleNamespace(function=1, packed_metadata=(4, 1, 1))
    return launcher.KernelLaunch(compiled, direct=direct)


def _addresses(args) -> list:
    return [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]


@pytest.fixture
def fakes(monkeypatch):
    log = []
    monkeypatch.setattr(forward, "attention_forward_kernel", FakeJIT(log, forward.attention_forward_kernel))
    monkeypatch.setattr(combine, "combine_kernel", FakeJIT(log, combine.combine_kernel))
    monkeypatch.setattr(plan, "driver", FakeDriver)
    monkeypatch.setattr(plan, "sm_count", lambda device=None: 132)
    monkeypatch.setattr(plan, "FAST_LAUNCH", True)
    monkeypatch.setattr(plan, "_launch_hooked", lambda: False)
    for name in ("_COMPILED", "_TRITON_COMPILED", "_COMBINE_OF"):
        monkeypatch.setattr(plan, name, {})
    return log


@pytest.mark.parametrize("head_dim", [128, 96])
@pytest.mark.parametrize("with_lse", [False, True])
def test_split_decode_direct_launch_matches_the_first(fakes, with_lse, head_dim):
    batch, nheads, nheads_kv, seqlen_k = 2, 8, 2, 8192
    q = torch.randn(batch, 1, nheads, head_dim).to(torch.bfloat16)
    k = torch.randn(batch, seqlen_k, nheads_kv, head_dim).to(torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    lse = torch.empty(batch, nheads, 1) if with_lse else None
    plan.launch_forward(q, k, v, out, lse, 0.1, True, num_splits=0, pack_gqa=None)
    (_, grid, jit_args, jit_kwargs), (_, c_grid, c_args, c_kwargs) = fakes
    [key] = plan._COMPILED
    splits = c_args[5]  # (o_part, lse_part, out, lse, sink, n_splits, ...): plan._combine_args
    assert key[5].split and splits > 1  # the case under test: split-KV, the combine after it
    # From now on both launches are direct.
    calls, c_calls = [], []
    plan._COMPILED[key] = _recording_launch(calls, 4)
    [c_key] = plan._COMBINE_OF
    plan._COMBINE_OF[c_key] = _recording_launch(c_calls, 0)
    plan.launch_forward(q, k, v, out, lse, 0.1, True, num_splits=0, pack_gqa=None)
    assert len(calls) == len(c_calls) == 1

    # The kernel: four descriptors (map, shape, strides), then its arguments.
    descs = jit_args[:4]
    flat = list(calls[0])
    n_desc = sum(1 + len(d.shape) + len(d.strides) for d in descs)
    assert flat[:n_desc:9] == ["map"] * 4
    names = forward.attention_forward_kernel.real.arg_names
    first = _addresses(jit_args[4:]) + [jit_kwargs[name] for name in names[len(jit_args):]]
    got = flat[n_desc:]
    names = names[4:]
    assert len(got) == len(first) == len(names)
    o_slot, lse_slot = names.index("o_part_ptr"), names.index("lse_part_ptr")
    n_o = splits * batch * 1 * nheads * 128  # the kernel's head dim (96 runs on 128's kernel)
    assert got[lse_slot] - got[o_slot] == 4 * n_o == first[lse_slot] - first[o_slot]
    for i, name in enumerate(names):
        if i not in (o_slot, lse_slot):
            assert got[i] == first[i], name

    # The combine reads the partials the kernel wrote, and writes out / lse.
    c_names = combine.combine_kernel.real.arg_names
    c_first = _addresses(c_args) + [c_kwargs[n] for n in c_names[len(c_args):]]
    c_got = list(c_calls[0])
    assert len(c_got) == len(c_first) == len(c_names)
    assert c_got[0] == got[o_slot] and c_got[1] == got[lse_slot]
    assert c_got[2] == c_first[2] == out.data_ptr()
    # The LSE goes to lse, or (not asked for) the kernel reads its own partials' slot.
    assert c_got[3] == (lse.data_ptr() if with_lse else c_got[1])
    assert c_first[3] == (lse.data_ptr() if with_lse else c_first[1])
    # No sinks: their unread pointer aliases the partials' LSE.
    assert c_got[4] == c_got[1] and c_first[4] == c_first[1]
    assert c_got[5:] == c_first[5:]


@pytest.mark.parametrize("case", ["static", "dynamic", "seqused"])
def test_unsplit_direct_launch_matches_the_first(fakes, case):
    # Plain prefill dealt statically (B2 H8 S130) or drawn from the counter
    # (B4 H32 S2048 causal: a fresh zeroed counter per call, so its address
    # may move), and a KV-cache call with per-batch lengths and cache rows.
    batch, nheads, seqlen = (4, 32, 2048) if case == "dynamic" else (2, 8, 130)
    q = torch.randn(batch, seqlen, nheads, 128).to(torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    out = torch.empty_like(q)
    lse = torch.empty(batch, nheads, seqlen)
    extra = {}
    if case == "seqused":
        extra = dict(seqused_k=torch.tensor([100, 7], dtype=torch.int32),
                     kv_batch=torch.tensor([1, 0], dtype=torch.int32))
    plan.launch_forward(q, k, v, out, lse, 0.1, True, **extra)
    [(_, grid, jit_args, jit_kwargs)] = fakes
    [key] = plan._COMPILED
    assert key[5].dynamic == (case == "dynamic") and not key[5].split
    calls = []
    plan._COMPILED[key] = _recording_launch(calls, 4)
    plan.launch_forward(q, k, v, out, lse, 0.1, True, **extra)
    names = forward.attention_forward_kernel.real.arg_names
    first = _addresses(jit_args[4:]) + [jit_kwargs[name] for name in names[len(jit_args):]]
    got = list(calls[0])[sum(1 + len(d.shape) + len(d.strides) for d in jit_args[:4]):]
    names = names[4:]
    assert len(got) == len(first) == len(names)
    for i, name in enumerate(names):
        if name != "sched_ptr" or case != "dynamic":
            assert got[i] == first[i], name
    assert got[names.index("lse_ptr")] == lse.data_ptr()
    assert got[names.index("o_part_ptr")] == out.data_ptr()
    if case == "seqused":
        assert got[names.index("seqused_ptr")] == extra["seqused_k"].data_ptr()
        assert got[names.index("kv_batch_ptr")] == extra["kv_batch"].data_ptr()


class _TaggingJIT:
    """A kernel whose compiled form remembers the constexprs it was compiled
    with, and whose direct launches (``launcher.direct_parts`` patched)
    record them beside the constexpr values the launch passed."""

    def __init__(self, log, real):
        self.log, self.real = log, real

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("jit", self.real.__name__))
            return SimpleNamespace(function=1, packed_metadata=(4, 1, 1), compiled_with=kwargs,
                                   arg_names=self.real.arg_names, log=self.log)
        return launch


def _direct_parts(compiled, utils=None):
    names = compiled.arg_names

    def c_launch(*a):
        args = a[13:]
        if names[0] == "q_desc":  # the forward: descriptors expand; its scalars and constexprs close the list
            compiled.log.append(("direct", "forward", args[names.index("seqlen_q") - len(names):]))
        else:
            compiled.log.append((compiled.compiled_with, dict(zip(names, args))))
    run = SimpleNamespace(launch_cooperative_grid=False, launch_pdl=False)
    return launcher._Direct(c_launch, lambda *a: "map", {10: 9}, [META] * 4, False, run)


def test_the_combine_is_compiled_per_split_bound(fakes, monkeypatch):
    # The combine specialises on S_MAX, the split count's power of two (at
    # least 16): a direct launch must not reuse one compiled for fewer splits.
    log = []
    monkeypatch.setattr(forward, "attention_forward_kernel", _TaggingJIT(log, forward.attention_forward_kernel.real))
    monkeypatch.setattr(combine, "combine_kernel", _TaggingJIT(log, combine.combine_kernel.real))
    monkeypatch.setattr(launcher, "direct_parts", _direct_parts)
    q = torch.randn(1, 1, 8, 128).to(torch.bfloat16)
    k = torch.randn(1, 8192, 2, 128).to(torch.bfloat16)
    out = torch.empty_like(q)
    for splits in (4, 4, 4, 20, 20, 20, 40, 40, 4):
        plan.launch_forward(q, k, k, out, None, 0.1, True, num_splits=splits, pack_gqa=None)
    direct = [(entry[0]["S_MAX"], entry[1]["S_MAX"], entry[1]["n_splits"]) for entry in log
              if isinstance(entry[0], dict)]
    assert direct == [(16, 16, 4)] * 2 + [(32, 32, 20)] * 2 + [(64, 64, 40), (16, 16, 4)]


def test_a_narrower_head_dim_gets_its_own_combine(fakes, monkeypatch):
    # Head dim 96 runs on head dim 128's kernel and plan (plan.kernel_head_dim):
    # its combine writes 96 features a row (OUT_DIM), so a direct launch must
    # not reuse head dim 128's, nor 128's reuse it; both read partials of the
    # kernel's width.
    log = []
    monkeypatch.setattr(forward, "attention_forward_kernel", _TaggingJIT(log, forward.attention_forward_kernel.real))
    monkeypatch.setattr(combine, "combine_kernel", _TaggingJIT(log, combine.combine_kernel.real))
    monkeypatch.setattr(launcher, "direct_parts", _direct_parts)
    runs = []
    for head_dim in (128, 128, 96, 96, 128, 96):
        q = torch.randn(1, 1, 8, head_dim).to(torch.bfloat16)
        k = torch.randn(1, 8192, 2, head_dim).to(torch.bfloat16)
        out = torch.empty_like(q)
        plan.launch_forward(q, k, k, out, None, 0.1, True, num_splits=4, pack_gqa=None)
        runs.append(head_dim)
    direct = [(entry[0]["OUT_DIM"], entry[1]["OUT_DIM"], entry[1]["HEAD_DIM"]) for entry in log
              if isinstance(entry[0], dict)]
    assert direct == [(0, 0, 128), (96, 96, 128), (0, 0, 128), (96, 96, 128)]
    assert [e[1] for e in log if e[0] == "jit"].count("attention_forward_kernel") == 1  # one forward kernel


@pytest.fixture
def remembering(monkeypatch):
    """Validation passes for CPU tensors and is remembered, and calls are
    prepared, as for CUDA ones on the GPU machine; no device switch."""
    monkeypatch.setattr(checks, "check_device", lambda t, name="q": None)
    monkeypatch.setattr(checks, "_PASSED", {})
    monkeypatch.setattr(checks, "_PASSED_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(plan, "_PREPARED", {})
    monkeypatch.setattr(plan, "_SIGHTED", {})
    monkeypatch.setattr(plan, "on_device", lambda t: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # a CPU tensor's device index


@pytest.fixture
def tagged(fakes, remembering, monkeypatch):
    """Every launch after a kernel's first (JIT) one is direct; the log says
    which path each took. Validation passes for CPU tensors and is
    remembered, as for CUDA ones on the GPU machine; the calls counted."""
    log = []
    monkeypatch.setattr(forward, "attention_forward_kernel", _TaggingJIT(log, forward.attention_forward_kernel.real))
    monkeypatch.setattr(combine, "combine_kernel", _TaggingJIT(log, combine.combine_kernel.real))
    monkeypatch.setattr(launcher, "direct_parts", _direct_parts)
    real = checks.validate
    monkeypatch.setattr(checks, "validate", lambda *a: log.append(("validate",)) or real(*a))
    return log


def _paths(log):
    return [entry[0] if isinstance(entry[0], str) else "direct" for entry in log]


@pytest.mark.parametrize("return_lse", [False, True])
def test_a_launched_signature_is_prepared_and_replayed(tagged, return_lse):
    q = torch.randn(2, 1, 8, 128).to(torch.bfloat16)
    k = torch.randn(2, 8192, 2, 128).to(torch.bfloat16)
    v = torch.randn_like(k)
    results = [dispatch.forward(q, k, v, None, True, return_lse) for _ in range(4)]
    # 1: validated, both kernels compiled (JIT); 2: validated (remembered),
    # launched directly, prepared; 3 and 4: the prepared call, no validation.
    assert _paths(tagged) == (["validate", "jit", "jit", "validate", "direct", "direct"]
                              + ["direct", "direct"] * 2)
    assert len(plan._PREPARED) == 1
    forward_launches = [entry[2] for entry in tagged if entry[:2] == ("direct", "forward")]
    combines = [entry[1] for entry in tagged if isinstance(entry[0], dict)]
    # The same scalars and constexprs every time; the combine's split count and strides too.
    assert forward_launches[0] == forward_launches[1] == forward_launches[2]
    assert all({n: c[n] for n in c if not n.endswith("_ptr")} == {n: combines[0][n] for n in c if not n.endswith("_ptr")}
               for c in combines)
    for result in results[2:]:
        out, lse = result if return_lse else (result, None)
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
        assert (lse is None) == (not return_lse)
        if return_lse:
            assert lse.shape == (2, 8, 1) and lse.dtype == torch.float32
    assert combines[-1]["WRITE_LSE"] == return_lse


def test_a_growing_cache_keeps_its_prepared_call(tagged):
    # transformers' decode: k/v [B, Hkv, L, D] seen as BSHD, one key longer
    # every step. The prepared call serves every length of one KV tile count
    # (the plan depends on nothing else) with the length it is given; a new
    # count takes the full path once.
    q = torch.randn(2, 1, 8, 128).to(torch.bfloat16)
    cache = torch.randn(2, 2, 8300, 128).to(torch.bfloat16)
    block_n = plan.CONFIGS[128].block_n
    lengths = [63 * block_n - 3, 63 * block_n - 2, 63 * block_n - 1, 63 * block_n, 63 * block_n + 1,
               63 * block_n + 2]
    paths = []
    for length in lengths:
        tagged.clear()
        kv = cache[:, :, :length].transpose(1, 2)
        dispatch.forward(q, kv, kv, None, True, False)
        paths.append(_paths(tagged))
        forward_launches = [entry[2] for entry in tagged if entry[:2] == ("direct", "forward")]
        if forward_launches:
            assert forward_launches[0][1] == length  # seqlen_k
    assert paths[0] == ["validate", "jit", "jit"]
    assert paths[1] == ["validate", "direct", "direct"]  # the class passed before: prepared now
    assert paths[2] == paths[3] == ["direct", "direct"]
    assert paths[4][0] == "validate"  # 64 tiles: the full path, once
    assert paths[5] == ["direct", "direct"]
    [call] = plan._PREPARED.values()
    assert sorted(call.launches) == [63, 64]


@pytest.mark.parametrize("return_lse", [False, True])
def test_a_prepared_launch_hands_over_what_the_direct_launch_does(fakes, remembering, return_lse):
    # The prepared call's templates (plan._PreparedLaunch) against
    # _launch_forward_direct on the same tensors: the same flattened
    # arguments for both kernels, but for the call's own output, LSE and
    # partials, which are where the direct launch puts its own.
    q = torch.randn(2, 1, 8, 128).to(torch.bfloat16)
    k = torch.randn(2, 8192, 2, 128).to(torch.bfloat16)
    v = torch.randn_like(k)
    dispatch.forward(q, k, v, 0.1, True, return_lse)  # compiles (JIT stand-ins)
    [key] = plan._COMPILED
    [c_key] = plan._COMBINE_OF
    calls, c_calls = [], []
    plan._COMPILED[key] = _recording_launch(calls, 4)
    plan._COMBINE_OF[c_key] = _recording_launch(c_calls, 0)
    outs = [dispatch.forward(q, k, v, 0.1, True, return_lse) for _ in range(2)]  # direct, then prepared
    assert len(plan._PREPARED) == 1 and len(calls) == len(c_calls) == 2

    def own(i):
        out, lse = outs[i] if return_lse else (outs[i], None)
        o_part = c_calls[i][0]
        return {out.data_ptr(): "out", o_part: "o_part", c_calls[i][1]: "lse_part",
                **({lse.data_ptr(): "lse"} if lse is not None else {})}

    def named(flat, i):
        names = own(i)
        return [names.get(a, a) if isinstance(a, int) and not isinstance(a, bool) else a for a in flat]
    assert named(calls[1], 1) == named(calls[0], 0)
    assert named(c_calls[1], 1) == named(c_calls[0], 0)
    assert "out" in named(calls[1], 1) and "o_part" in named(c_calls[1], 1)


def test_the_backend_takes_the_prepared_call(tagged):
    # transformers' decode call: the first goes through flash_attn_func (its
    # checks, the JIT, then a direct launch that prepares); later ones take
    # the prepared call without the checks.
    from hopper_flash.integrations import transformers as hft

    class Module(torch.nn.Module):
        is_causal = True

    query = torch.randn(2, 8, 1, 128).to(torch.bfloat16)
    cache = torch.randn(2, 2, 8192, 128).to(torch.bfloat16)
    results = []
    with torch.inference_mode():
        for _ in range(4):
            tagged.clear()
            results.append(hft.hopper_flash_attention_forward(Module(), query, cache, cache, None,
                                                              scaling=0.1)[0])
    assert _paths(tagged) == ["direct", "direct"]
    assert len(plan._PREPARED) == 1
    assert results[-1].shape == (2, 1, 8, 128) and results[-1].is_contiguous()


def test_a_prepared_call_never_skips_a_check_that_differs(tagged):
    q = torch.randn(2, 1, 8, 128).to(torch.bfloat16)
    k = torch.randn(2, 8192, 2, 128).to(torch.bfloat16)
    for _ in range(3):
        dispatch.forward(q, k, k, None, True, False)
    assert len(plan._PREPARED) == 1
    with pytest.raises(TypeError, match=r"^causal must be a bool"):
        dispatch.forward(q, k, k, None, 1, False)
    with pytest.raises(TypeError, match=r"^softmax_scale must be a positive float"):
        dispatch.forward(q, k, k, [0.1], True, False)  # unhashable: no key at all


def test_a_prepared_call_stands_only_while_its_sources_do(tagged, monkeypatch):
    q = torch.randn(2, 1, 8, 128).to(torch.bfloat16)
    k = torch.randn(2, 8192, 2, 128).to(torch.bfloat16)
    for _ in range(3):
        dispatch.forward(q, k, k, None, True, False)
    tagged.clear()
    # A profiler hook wants Triton's own launch (the JIT's path, here its compiled forms).
    monkeypatch.setattr(plan, "_launch_hooked", lambda: True)
    dispatch.forward(q, k, k, None, True, False)
    assert "validate" in _paths(tagged)
    monkeypatch.setattr(plan, "_launch_hooked", lambda: False)
    # A new compiled-kernel table (the tests' way to force the JIT) is compiled into again.
    tagged.clear()
    monkeypatch.setattr(plan, "_COMPILED", {})
    dispatch.forward(q, k, k, None, True, False)
    assert _paths(tagged)[:2] == ["validate", "jit"]
    # Another config for the head dim (use_variant).
    for _ in range(2):
        dispatch.forward(q, k, k, None, True, False)
    tagged.clear()
    monkeypatch.setitem(plan.CONFIGS, 128, plan.replace(plan.CONFIGS[128]))
    dispatch.forward(q, k, k, None, True, False)
    assert "validate" in _paths(tagged)
