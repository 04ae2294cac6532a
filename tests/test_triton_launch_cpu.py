"""``plan.launch_triton`` (the cached launch of the plain Triton kernels: the
split-KV combine and the backward's pre/postprocess) on the CPU, with the
kernels faked: the first launch of a key goes through the JIT, later ones
through the compiled kernel's launcher with the same arguments in the
kernel's parameter order, and everything Triton would still specialise on is
in the key. The GPU half (gradients and decode outputs through the fast
path) is the GPU suite, which runs every call twice or more."""
import pytest
import torch

from hopper_flash import plan, plan_backward
from hopper_flash.kernels import backward_pre, combine
from launch_fakes import FakeDriver, FakeJIT

KERNELS = {
    "preprocess": backward_pre._bwd_preprocess_kernel,
    "postprocess": backward_pre._bwd_postprocess_kernel,
    "combine": combine.combine_kernel,
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_integer_parameter_is_unspecialised(name):
    # One compiled kernel must serve every length and stride: an integer the
    # JIT specialised (== 1, divisible by 16) would make the cached kernel
    # wrong for other values, which the launch key does not hold.
    kernel = KERNELS[name]
    for p in kernel.params:
        if p.is_constexpr or p.name.endswith("_ptr") or p.name == "scale":
            continue
        assert p.do_not_specialize, f"{name}: {p.name} is specialised by the JIT"


@pytest.fixture
def log(monkeypatch):
    entries = []
    for name, real in (("_bwd_preprocess_kernel", backward_pre._bwd_preprocess_kernel),
                       ("_bwd_postprocess_kernel", backward_pre._bwd_postprocess_kernel)):
        monkeypatch.setattr(backward_pre, name, FakeJIT(entries, real))
    monkeypatch.setattr(plan, "driver", FakeDriver)
    monkeypatch.setattr(plan, "FAST_LAUNCH", True)
    monkeypatch.setattr(plan, "_TRITON_COMPILED", {})
    monkeypatch.setattr(plan, "_launch_hooked", lambda: False)
    return entries


def _bound(kernel, args, kwargs):
    """Parameter name -> value, as the JIT binds a launch."""
    names = kernel.arg_names
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    assert len(bound) == len(names)
    return bound


def _check_fast_equals_jit(log, kernel):
    (_, grid, jit_args, jit_kwargs), (_, fast) = log[0], log[1]
    assert tuple(fast[:3]) == tuple(grid) and fast[3] == 7 and fast[6:9] == (None, None, None)
    fast_bound = dict(zip(kernel.arg_names, fast[9:]))
    assert len(fast[9:]) == len(kernel.arg_names)
    jit_bound = _bound(kernel, jit_args, jit_kwargs)
    for name in kernel.arg_names:
        assert fast_bound[name] is jit_bound[name] or fast_bound[name] == jit_bound[name], name
    assert jit_kwargs["num_warps"] == 4


def test_preprocess_fast_launch_binds_what_the_jit_binds(log):
    out = torch.randn(2, 129, 4, 128).to(torch.bfloat16)
    dout = torch.randn(2, 129, 4, 128).to(torch.bfloat16)
    lse = torch.randn(2, 4, 129)
    delta, lse2 = torch.empty(2, 4, 192), torch.empty(2, 4, 192)
    acc = torch.empty(2, 4, 192, 128)
    counter = torch.empty(1, dtype=torch.int32)  # the persistent grid's item counter
    for _ in range(2):
        plan_backward.bwd_preprocess(out, dout, lse, delta, lse2, acc, 64, order=counter)
    assert [e[0] for e in log] == ["jit", "fast"]
    _check_fast_equals_jit(log, backward_pre._bwd_preprocess_kernel.real)
    jit = _bound(backward_pre._bwd_preprocess_kernel.real, log[0][2], log[0][3])
    # Strides in units of 8 elements (BSHD: the sequence stride is H * D).
    assert (jit["so8_b"], jit["so8_s"], jit["so8_h"]) == (129 * 4 * 16, 4 * 16, 16)
    assert jit["HEAD_DIM"] == 128 and jit["VARLEN"] is False


def test_postprocess_fast_launch_and_key(log):
    dq = torch.empty(2, 129, 4, 64).to(torch.bfloat16)
    acc = torch.zeros(2 * 4 * 192, 64)
    plan_backward.bwd_postprocess(acc, dq, 0.125, 64)
    plan_backward.bwd_postprocess(acc, dq, 0.125, 64)
    assert [e[0] for e in log] == ["jit", "fast"]
    _check_fast_equals_jit(log, backward_pre._bwd_postprocess_kernel.real)
    # Another head dim (a constexpr) or a pointer off 16-byte alignment is another compile.
    plan_backward.bwd_postprocess(torch.zeros(2 * 4 * 192, 128), torch.empty(2, 129, 4, 128).to(torch.bfloat16),
                                  0.125, 64)
    odd = torch.zeros(2 * 4 * 192 * 64 + 1)[1:].view(2 * 4 * 192, 64)
    plan_backward.bwd_postprocess(odd, dq, 0.125, 64)
    assert [e[0] for e in log] == ["jit", "fast", "jit", "jit"]


def test_strides_must_be_16_byte_multiples():
    with pytest.raises(AssertionError):
        plan_backward._strides8(128, 12)
    assert plan_backward._strides8(1024, 128, 8) == (128, 16, 1)
