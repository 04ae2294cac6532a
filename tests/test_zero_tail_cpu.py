"""The varlen backward's unwritten gradient rows (``plan_backward``'s
``_zero_unwritten``, the plan's ``zero_tails`` and ``zero_tail``) on the CPU.

The gradients are allocated empty; the rows no kernel writes are zeroed
afterwards: with ``seqused`` on a side, that side whole (gaps inside the
slots); without, only the rows past ``cu_seqlens[-1]``, by
``plan_backward.zero_tail`` (``backward_pre._zero_tail_kernel``), run here through Triton's interpreter
(``TRITON_INTERPRET=1``, in a child process: the variable must be set before
the kernel's module is imported) on NaN-filled tensors, packed views
included."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hopper_flash import _triton_support, plan, plan_backward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _no_gpu_sm_count(monkeypatch):
    """The varlen fast plan bounds its persistent grid by the SM count."""
    monkeypatch.setattr(plan, "sm_count", lambda device=None: 132)


def _batch(used_q=None, used_k=None):
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    return plan_backward.VarlenBatch(cu, cu.clone(), used_q, used_k, 4, 4)


class _Recorded:
    """A stand-in for a planned zero-tail launch: records its pointers."""

    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def __call__(self, pointers):
        self.calls.append((self.name, pointers))


@pytest.mark.parametrize("used_q", [None, torch.tensor([2, 4], dtype=torch.int32)], ids=["no-seqused_q", "seqused_q"])
@pytest.mark.parametrize("used_k", [None, torch.tensor([3, 1], dtype=torch.int32)], ids=["no-seqused_k", "seqused_k"])
def test_unwritten_rows_are_zeroed_by_side(used_q, used_k):
    """A side with seqused is zero-filled whole; one without is left to its
    planned tail launch, which gets that side's gradients and cu_seqlens."""
    dq, dk, dv = (torch.full((9, 2, 64), float("nan")) for _ in range(3))
    batch = _batch(used_q, used_k)
    lp = plan_backward._make_plan(dq, dq, dk, dq, torch.zeros(2, 9), dq, dk, 0.125, True, False, None, batch, None)
    assert (lp.zero_tails[0] is None) == (used_q is not None)
    assert (lp.zero_tails[1] is None) == (used_k is not None)
    calls = []
    lp.zero_tails = tuple(None if z is None else _Recorded(calls, name) for z, name in zip(lp.zero_tails, "qk"))
    plan_backward._zero_unwritten(lp, dq, dk, dv, batch)
    expected = []
    if used_q is None:
        expected.append(("q", (dq, dq, batch.cu_seqlens_q)))
        assert bool(dq.isnan().all())  # left to the tail kernel
    else:
        assert bool((dq == 0).all())
    if used_k is None:
        expected.append(("k", (dk, dv, batch.cu_seqlens_k)))
        assert bool(dk.isnan().all()) and bool(dv.isnan().all())
    else:
        assert bool((dk == 0).all()) and bool((dv == 0).all())
    assert len(calls) == len(expected)
    for (name, ptrs), (ename, eptrs) in zip(calls, expected):
        assert name == ename and all(a is b for a, b in zip(ptrs, eptrs))


def test_planned_tail_launch_is_zero_tails():
    """The plan's tail launch is the one ``zero_tail`` makes: same kernel,
    grid and arguments (the interpreter test below runs ``zero_tail``)."""
    dq, dk = torch.empty(9, 2, 64), torch.empty(11, 1, 64)
    batch = _batch()
    lp = plan_backward._make_plan(dq, dq, dk, dq, torch.zeros(2, 9), dq, dk, 0.125, True, False, None, batch, None)
    for planned, (x, pair) in zip(lp.zero_tails, ((dq, False), (dk, True))):
        made = plan_backward.zero_tail_launch(x, pair, batch.batch)
        assert (planned.kernel, planned.grid, planned.ints, planned.constexprs) == (
            made.kernel, made.grid, made.ints, made.constexprs)
        assert made.ints[:2] == (2, x.shape[0])  # sequences, rows


def test_backward_varlen_launches_under_the_device_guard(monkeypatch):
    """backward_varlen runs launch_backward, which zeroes the unwritten rows
    first, under q's device guard (the zeroing starts a kernel: outside the
    guard it would run on whichever GPU is current)."""
    import contextlib

    from hopper_flash import plan

    events = []

    @contextlib.contextmanager
    def guard(t):
        events.append("enter")
        yield
        events.append("exit")

    monkeypatch.setattr(plan, "on_device", guard)
    monkeypatch.setattr(plan_backward, "launch_backward", lambda *a, **kw: events.append("launch"))
    q = torch.randn(7, 2, 64, dtype=torch.bfloat16)
    k, v = torch.randn(9, 1, 64, dtype=torch.bfloat16), torch.randn(9, 1, 64, dtype=torch.bfloat16)
    out, lse = torch.randn_like(q), torch.randn(2, 7)
    plan_backward.backward_varlen(torch.randn_like(q), q, k, v, out, lse, _batch(), 0.125, True)
    assert events == ["enter", "launch", "exit"]


CHILD = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, sys.argv[1])
    import torch
    from hopper_flash import plan, plan_backward

    # The host wrapper itself (grid, arguments, strides in units of 8), with
    # the launch helper reduced to the interpreter's plain call.
    plan.launch_triton = lambda kernel, grid, args, constexprs, num_warps, launch_pdl=False: (
        kernel[grid](*args, **constexprs))
    launch = plan_backward.zero_tail

    failures = []
    for total, ends in ((200, [0, 50, 130]), (200, [0, 200]), (37, [0, 10, 20]), (64, [0, 64]), (130, [0, 0, 0])):
        cu = torch.tensor(ends, dtype=torch.int32)
        end = ends[-1]
        # dq alone, contiguous; dk and dv as views of one packed [total, 2, H, D] gradient.
        dq = torch.full((total, 3, 16), float("nan"))
        packed = torch.full((total, 2, 2, 16), float("nan"))
        dk, dv = packed.unbind(1)
        launch(dq, None, cu)
        launch(dk, dv, cu)
        for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
            if not bool((t[end:] == 0).all()):
                failures.append(f"{name} total={total} end={end}: tail not zero")
            if not bool(t[:end].isnan().all()):
                failures.append(f"{name} total={total} end={end}: a row before the tail was written")
    print("FAILURES", failures)
""")


@pytest.mark.skipif(_triton_support.parse_minor(_triton_support.installed_version()) < (3, 7),
                    reason="triton 3.6's interpreter cannot use a scalar kernel argument as a loop bound under numpy 2")
def test_zero_tail_kernel_zeroes_only_the_rows_past_the_last_sequence():
    r = subprocess.run([sys.executable, "-c", CHILD, ROOT], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "FAILURES []" in r.stdout, r.stdout[-3000:]
