"""Which launches are programmatic dependent launches (no GPU).

Every forward run's kernel is launched dependent on the kernel before it
(its partitions wait with ``griddepcontrol.wait`` before any global
access: ``tests/test_compile_decode.py`` and ``test_compile_sm90.py``
check the PTX), so the kernel before lets it be scheduled early. The
backward's kernels have no wait, so a programmatic launch of one would
race the kernel before it: they are launched plainly.
"""
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from hopper_flash import plan
from hopper_flash.kernels import forward


def _launch_flags(batch, seqlen_q, seqlen_k, heads, heads_kv, seqused):
    """(mode.split, the launch_pdl the forward's JIT launch passes) for a plan on a 132-SM GPU."""
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
    return lp.mode.split, seen["launch_pdl"]


@pytest.mark.parametrize("shape,split", [
    ((8, 1, 4096, 32, 8, True), True),      # one-query decode: split
    ((1, 1, 65536, 32, 8, False), True),    # split, fixed lengths
    ((64, 1, 2048, 32, 8, True), False),    # decode with enough items: no split
    ((4, 128, 8192, 32, 8, False), False),  # a chunk on a long cache (one item per CTA)
    ((4, 2048, 2048, 32, 32, False), False),  # prefill
])
def test_every_forward_run_is_launched_dependent(shape, split):
    assert _launch_flags(*shape) == (split, True)


def test_backward_options_are_never_dependent():
    from hopper_flash import plan_backward
    assert plan.compile_options(plan_backward.BACKWARD_CONFIGS[128])["launch_pdl"] is False
