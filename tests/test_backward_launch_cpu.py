"""The backward's cached fast launch (``plan_backward.launch_backward``) on
the CPU, with the kernels faked: it follows the same guard as the forward's
(first launch and unchecked tritons through the JIT, later ones through the
compiled kernel's launcher), and the launcher gets, position by position, the
arguments the JIT launch bound to the kernel's parameters. The GPU half
(bitwise equal gradients) is tests/test_launch_gpu.py."""
import pytest
import torch

from hopper_flash import launcher, plan, plan_backward
from hopper_flash.kernels import backward as backward_kernels
from launch_fakes import FakeDriver, FakeJIT

ARG_NAMES = backward_kernels.attention_backward_kernel.arg_names
LAUNCH_PARAMS = 9  # grid x/y/z, stream, function, packed metadata, launch metadata, enter and exit hooks


@pytest.fixture
def log(monkeypatch):
    entries = []
    monkeypatch.setattr(backward_kernels, "attention_backward_kernel", FakeJIT(entries))
    monkeypatch.setattr(plan_backward.SmallLaunch, "__call__", lambda self, pointers: None)
    monkeypatch.setattr(plan, "driver", FakeDriver)
    monkeypatch.setattr(plan_backward, "_COMPILED", {})
    monkeypatch.setattr(plan, "sm_count", lambda device=None: 132)  # the persistent grid's size (no GPU here)
    return entries


def call(batch=2, sq=129, sk=200, h=4, hkv=2, d=128, causal=True, deterministic=False):
    q = torch.randn(batch, sq, h, d).to(torch.bfloat16)
    k = torch.randn(batch, sk, hkv, d).to(torch.bfloat16)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)
    plan_backward.launch_backward(q, q, k, k, q, torch.zeros(batch, h, sq), dq, dk, dv, 0.125, causal, deterministic)
    return q, k, dk, dv


@pytest.mark.parametrize("fast", [False, True])
def test_launch_backward_follows_the_guard(monkeypatch, log, fast):
    monkeypatch.setattr(plan_backward, "FAST_LAUNCH", fast)
    for _ in range(3):
        call()
    assert [e[0] for e in log] == (["jit", "fast", "fast"] if fast else ["jit", "jit", "jit"])
    call(deterministic=True)  # another specialisation: compiled (JIT) first
    call(d=64)
    assert [e[0] for e in log[3:]] == ["jit", "jit"]


def test_the_guard_is_the_forwards():
    assert plan_backward.FAST_LAUNCH == plan.FAST_LAUNCH


def test_profiler_hook_takes_the_jit_path(monkeypatch, log):
    monkeypatch.setattr(plan_backward, "FAST_LAUNCH", True)
    monkeypatch.setattr(plan, "_launch_hooked", lambda: True)
    call()
    call()
    assert [e[0] for e in log] == ["jit", "jit"]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fast_arguments_are_the_jit_arguments_in_signature_order(monkeypatch, log, d, deterministic):
    monkeypatch.setattr(plan_backward, "FAST_LAUNCH", True)
    call(d=d, deterministic=deterministic)
    _, _, dk, dv = call(d=d, deterministic=deterministic, sq=300, sk=70, batch=3)
    jit_first = log[0]
    # What a JIT launch of the second call's shapes binds: the same call with the fast path off.
    monkeypatch.setattr(plan_backward, "FAST_LAUNCH", False)
    call(d=d, deterministic=deterministic, sq=300, sk=70, batch=3)
    _, grid, args, kwargs = log[2]
    fast = log[1][1]
    assert jit_first[0] == "jit" and log[1][0] == "fast" and log[2][0] == "jit"
    assert fast[:3] == tuple(grid) and fast[3] == 7  # grid, then the current stream
    bound = dict(zip(ARG_NAMES, args))
    bound.update({name: value for name, value in kwargs.items() if name in ARG_NAMES})
    assert set(bound) == set(ARG_NAMES), "the JIT launch binds every kernel parameter"
    fast_args = fast[LAUNCH_PARAMS:]
    assert len(fast_args) == len(ARG_NAMES)
    for name, got in zip(ARG_NAMES, fast_args):
        want = bound[name]
        if name.endswith("_desc"):
            # Same tensor geometry as the JIT's TensorDescriptor (different calls: fresh tensors).
            assert isinstance(got, launcher.TmaArg), name
            assert tuple(got.shape) == tuple(want.shape) and tuple(got.strides) == tuple(want.strides), name
            assert got.base.dtype == want.base.dtype and got.padding == want.padding, name
        elif name.endswith("_ptr"):
            # sem, the varlen vectors (unused here: the semaphore tensor stands in) and dk/dv: fresh tensors
            assert got.dtype == want.dtype and got.shape == want.shape, name
        else:
            assert got == want, name
    # The fast launch wrote to the caller's dk/dv (its own call's tensors).
    assert fast_args[ARG_NAMES.index("dk_desc")].base is dk and fast_args[ARG_NAMES.index("dv_desc")].base is dv


def _plain(x):
    """A launch argument as comparable data: descriptors by geometry, tensors
    by dtype and shape (the workspace is a fresh allocation per call)."""
    if isinstance(x, launcher.TmaArg):
        return ("desc", x.base.dtype, tuple(x.shape), tuple(x.strides), x.padding)
    if isinstance(x, torch.Tensor):
        return ("tensor", x.dtype, tuple(x.shape))
    return x


@pytest.mark.parametrize("deterministic", [False, True])
def test_planned_launches_take_what_the_looked_up_ones_take(monkeypatch, deterministic):
    """Once a plan knows its three compiled kernels (``BackwardPlan.compiled``)
    its calls launch them directly: the same kernels, with the arguments the
    per-launch lookups give on the same tensors."""
    from hopper_flash.kernels import backward_pre

    log = []
    monkeypatch.setattr(backward_kernels, "attention_backward_kernel", FakeJIT(log))
    monkeypatch.setattr(backward_pre, "_bwd_preprocess_kernel", FakeJIT(log))
    monkeypatch.setattr(backward_pre, "_bwd_postprocess_kernel", FakeJIT(log))
    monkeypatch.setattr(plan, "driver", FakeDriver)
    monkeypatch.setattr(plan, "_TRITON_COMPILED", {})
    monkeypatch.setattr(plan, "FAST_LAUNCH", True)
    monkeypatch.setattr(plan, "_launch_hooked", lambda: False)
    monkeypatch.setattr(plan_backward, "_COMPILED", {})
    monkeypatch.setattr(plan_backward, "_PLANS", {})
    monkeypatch.setattr(plan_backward, "FAST_LAUNCH", True)
    monkeypatch.setattr(plan, "sm_count", lambda device=None: 132)
    q = torch.randn(2, 129, 4, 128).to(torch.bfloat16)
    k = torch.randn(2, 200, 2, 128).to(torch.bfloat16)
    lse = torch.zeros(2, 4, 129)
    grads = [torch.empty_like(t) for t in (q, k, k)]

    def call():
        plan_backward.launch_backward(q, q, k, k, q, lse, *grads, 0.125, True, deterministic)

    call()
    assert [e[0] for e in log] == ["jit"] * 3
    (lp,) = plan_backward._PLANS.values()
    assert lp.compiled is not None
    call()  # the plan's kernels, launched directly
    monkeypatch.setattr(plan_backward, "_PLANS", {})
    call()  # a new plan: every kernel looked up again
    assert [e[0] for e in log[3:]] == ["fast"] * 6
    planned, looked_up = log[3:6], log[6:9]
    for (_, a), (_, b) in zip(planned, looked_up):
        assert [_plain(x) for x in a] == [_plain(x) for x in b]
    # The caller's gradients are written, not copies.
    main_args = planned[1][1][LAUNCH_PARAMS:]
    assert main_args[ARG_NAMES.index("dk_ptr")] is grads[1] and main_args[ARG_NAMES.index("dv_ptr")] is grads[2]
    assert planned[2][1][LAUNCH_PARAMS + 1] is grads[0]  # the postprocess's dq


@pytest.mark.parametrize("seqused", [False, True], ids=["tails", "seqused"])
def test_planned_varlen_launches_take_what_the_looked_up_ones_take(monkeypatch, seqused):
    """Varlen adds the zeroing of the rows no kernel writes: without
    ``seqused`` two planned tail launches (dQ; dK and dV) before the
    preprocess, launched from the plan like the other three; with it, whole
    zero fills and no tail launch."""
    from hopper_flash.kernels import backward_pre

    log = []
    for name in ("_bwd_preprocess_kernel", "_bwd_postprocess_kernel", "_zero_tail_kernel"):
        monkeypatch.setattr(backward_pre, name, FakeJIT(log))
    monkeypatch.setattr(backward_kernels, "attention_backward_kernel", FakeJIT(log))
    monkeypatch.setattr(plan, "driver", FakeDriver)
    monkeypatch.setattr(plan, "_TRITON_COMPILED", {})
    monkeypatch.setattr(plan, "FAST_LAUNCH", True)
    monkeypatch.setattr(plan, "_launch_hooked", lambda: False)
    monkeypatch.setattr(plan_backward, "_COMPILED", {})
    monkeypatch.setattr(plan_backward, "_PLANS", {})
    monkeypatch.setattr(plan_backward, "FAST_LAUNCH", True)
    monkeypatch.setattr(plan, "sm_count", lambda device=None: 132)  # the persistent grid's bound
    q = torch.randn(40, 4, 128).to(torch.bfloat16)
    k = torch.randn(70, 2, 128).to(torch.bfloat16)
    cu_q = torch.tensor([0, 17, 33], dtype=torch.int32)
    cu_k = torch.tensor([0, 30, 61], dtype=torch.int32)
    used = torch.tensor([10, 12], dtype=torch.int32) if seqused else None
    varlen = plan_backward.VarlenBatch(cu_q, cu_k, used, used, 20, 31)
    lse = torch.zeros(4, 40)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, k)]

    def call():
        plan_backward.launch_backward(q, q, k, k, q, lse, *grads, 0.125, True, False, varlen=varlen)

    n = 3 if seqused else 5
    call()
    assert [e[0] for e in log] == ["jit"] * n
    if seqused:
        assert all(bool((g == 0).all()) for g in grads)
    else:
        # dQ's tail, then dK/dV's, then the preprocess: the tails are
        # zeroed before anything else runs.
        assert log[0][2][:3] == (grads[0], grads[0], cu_q) and log[1][2][:3] == (grads[1], grads[2], cu_k)
    (lp,) = plan_backward._PLANS.values()
    assert lp.compiled is not None
    call()  # the plan's kernels, launched directly
    monkeypatch.setattr(plan_backward, "_PLANS", {})
    call()  # a new plan: every kernel looked up again
    assert [e[0] for e in log[n:]] == ["fast"] * (2 * n)
    planned, looked_up = log[n:2 * n], log[2 * n:3 * n]
    for (_, a), (_, b) in zip(planned, looked_up):
        assert [_plain(x) for x in a] == [_plain(x) for x in b]
    if not seqused:
        assert planned[0][1][LAUNCH_PARAMS:LAUNCH_PARAMS + 3] == (grads[0], grads[0], cu_q)
        assert planned[1][1][LAUNCH_PARAMS:LAUNCH_PARAMS + 3] == (grads[1], grads[2], cu_k)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sq", [129, 4096, 4097])
def test_persistent_grid_only_on_short_causal_rows_at_d128(monkeypatch, log, d, causal, deterministic, sq):
    # The fast mode at D = 128 runs causal rows of at most 4096 queries on a
    # persistent grid (at most one CTA per SM: 5 here) that draws its items
    # from a counter; everything else launches one CTA per item.
    monkeypatch.setattr(plan, "sm_count", lambda device=None: 5)
    monkeypatch.setattr(plan_backward, "_PLANS", {})  # plans cache the grid
    call(batch=2, sq=sq, sk=200, h=4, hkv=2, d=d, causal=causal, deterministic=deterministic)
    _, grid, args, kwargs = log[0]
    bound = dict(zip(ARG_NAMES, args))
    bound.update({name: value for name, value in kwargs.items() if name in ARG_NAMES})
    items = -(-200 // plan_backward.BACKWARD_CONFIGS[d].block_n) * 2 * 2  # KV tiles x KV heads x batch
    persistent = d == 128 and causal and not deterministic and sq <= 4096
    assert bound["PERSISTENT"] is persistent
    assert tuple(grid) == ((5 if persistent else items), 1, 1)
    # The counter: one int32 of the workspace, after Δ and L2.
    assert bound["order_ptr"].dtype == torch.int32 and bound["order_ptr"].numel() == 1
    assert bound["order_ptr"].data_ptr() == bound["delta_desc"].base.data_ptr() + 8 * bound["delta_desc"].base.numel()
