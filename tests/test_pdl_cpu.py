"""Which launches are programmatic dependent launches (no GPU).

A split run, and any other forward run whose grid has a CTA on every SM
(``plan.launched_dependent``; a grid that leaves SMs idle measured slower
so), is launched dependent on the kernel before it. Its kernel is compiled
with ``DEPENDENT``, so that every partition waits with
``griddepcontrol.wait`` before any global access
(``tests/test_compile_decode.py`` and ``test_compile_sm90.py`` check the
PTX). The backward's kernels have no wait, so a programmatic launch of one
would race the kernel before it: they are launched plainly.
"""
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from hopper_flash import plan
from hopper_flash.kernels import forward


def _launch_flags(batch, seqlen_q, seqlen_k, heads, heads_kv, seqused):
    """(mode.split, CTAs, the launch_pdl the forward's JIT launch passes) for a plan on a 132-SM GPU;
    the kernel's DEPENDENT constexpr must agree with the launch."""
    cfg = plan.CONFIGS[128]
    with mock.patch.object(plan, "sm_count", lambda device=None: 132):
        lp = plan._plan_launch.__wrapped__(0, torch.bfloat16, batch, seqlen_q, heads, heads_kv,
                                           plan.triton_cdiv(seqlen_k, cfg.block_n), cfg, 0, seqused, False, 0, None,
                                           True, False)
    seen = {}

    class FakeKernel:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.update(kwargs)
                return SimpleNamespace()
            return run

    with mock.patch.object(forward, "attention_forward_kernel", FakeKernel()), \
            mock.patch.object(plan, "KernelLaunch", lambda run: run):
        plan._jit_launch(lp, lp.cfg, ())
    assert seen["DEPENDENT"] == seen["launch_pdl"], "a kernel launched dependent waits for the grid before it"
    return lp.mode.split, lp.n_ctas, seen["launch_pdl"]


@pytest.mark.parametrize("shape,expected", [
    ((8, 1, 4096, 32, 8, True), (True, 128, True)),       # one-query decode: split (2), launched dependent
    ((1, 1, 65536, 32, 8, False), (True, 128, True)),     # split, fixed lengths
    ((64, 1, 2048, 32, 8, True), (False, 132, True)),     # enough items for every SM: no split, dependent
    ((4, 2048, 2048, 32, 32, False), (False, 132, True)),  # prefill on every SM
    ((4, 128, 8192, 32, 8, False), (False, 128, False)),  # a chunk, one item a CTA on 128 of 132 SMs: plainly
    ((4, 128, 8192, 32, 8, True), (False, 128, False)),   # the same through the KV cache's lengths
    ((2, 512, 32768, 32, 8, False), (False, 128, False)),  # two items a CTA on 128 SMs: plainly
])
def test_which_forward_runs_are_launched_dependent(shape, expected):
    assert _launch_flags(*shape) == expected


def test_the_rule():
    assert plan.launched_dependent(True, 8, 132)  # split: always
    assert plan.launched_dependent(False, 132, 132)
    assert not plan.launched_dependent(False, 131, 132)


def test_backward_options_are_never_dependent():
    from hopper_flash import plan_backward
    assert plan.compile_options(plan_backward.BACKWARD_CONFIGS[128])["launch_pdl"] is False
