"""The backward's preprocess (``kernels/backward_pre._bwd_preprocess_kernel``)
through Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, in a child
process: the variable must be set before the kernel's module is imported),
by its host wrapper ``plan_backward.bwd_preprocess``, against float64
statistics computed here from the same inputs.

What it checks: on the fixed-length batch, Δ = rowsum(dO·O) and L2 =
LSE·log2(e) on every live row, padding rows L2 = +inf and Δ = 0, dq_accum's
rows zeroed, the persistent grid's item counter zeroed (the varlen
statistics' padded layout is the GPU tests' business); and on every batch, with attention sinks (fp32 or bf16, read in
their dtype), the sinks' gradient from the per-block partials, ds_h = -sum exp(s_h - LSE')·Δ over the rows whose LSE'
exceeds s_h. The rows that saw no key (LSE' = s_h exactly) get NaN in dO:
they must add nothing. Fixed-length and varlen batches (with an empty
sequence, and with ``seqused_q`` shorter than the slots, whose gaps hold
NaN too), statistics and accumulator poisoned with NaN first."""
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hopper_flash import _triton_support

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(
    _triton_support.parse_minor(_triton_support.installed_version()) < (3, 7),
    reason="triton 3.6's interpreter cannot use a scalar kernel argument under numpy 2")

# The children's common start: the interpreter, the checkout first on the
# path, and plan.launch_triton calling the kernel directly.
PROLOGUE = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, sys.argv[1])
    import torch
    from hopper_flash import plan, plan_backward
    plan.launch_triton = lambda kernel, grid, args, constexprs, num_warps, launch_pdl=False: (
        kernel[grid](*args, **constexprs))
""")

CHILD = PROLOGUE + textwrap.dedent("""
    results = []
    for out, dout, lse, sink, rows, varlen in torch.load(sys.argv[2]):
        nan = float("nan")
        delta, lse2 = torch.full(rows, nan), torch.full(rows, nan)
        acc = torch.full(rows + (out.shape[-1],), nan)
        # Fixed lengths: the main kernel's persistent-grid item counter, poisoned.
        counter = torch.full((1,), -1, dtype=torch.int32) if varlen is None else None
        ds = plan_backward.bwd_preprocess(out, dout, lse, delta, lse2, acc, 64, varlen, sink, order=counter)
        results.append((delta, lse2, acc, ds, counter))
    torch.save(results, sys.argv[3])
""")


def _in_child(code, cases, tmp_path):
    """Run ``code`` (a child script) on ``cases`` in a fresh interpreter; its results."""
    torch.save(cases, tmp_path / "in.pt")
    subprocess.run([sys.executable, "-c", code, ROOT, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                   check=True, env={**os.environ, "TRITON_INTERPRET": "1"})
    return torch.load(tmp_path / "out.pt")


def _sink_grad64(out, dout, lse, sink, heads_axis):
    """float64 ds from rows laid out ``[..., H, rows]`` (``lse``) and ``[rows..., H, D]``."""
    delta = (out.double() * dout.double()).sum(-1)
    delta = delta.transpose(1, 2) if heads_axis == 1 else delta.t()  # as lse: [B, H, S] or [H, T]
    s = sink.double().view(1, -1, 1) if heads_axis == 1 else sink.double().view(-1, 1)
    live = lse.double() > s
    terms = torch.where(live, torch.exp(s - lse.double()) * torch.where(live, delta, 0.0), 0.0)
    return -(terms.sum(dim=(0, 2)) if heads_axis == 1 else terms.sum(dim=1))


def _fixed_case(gen, sink_dtype):
    b, s, h, d = 2, 129, 3, 64
    out = torch.randn(b, s, h, d, generator=gen).to(torch.bfloat16)
    dout = torch.randn(b, s, h, d, generator=gen).to(torch.bfloat16)
    sink = torch.randn(h, generator=gen).to(sink_dtype)
    lse = sink.float().view(1, h, 1) + torch.rand(b, h, s, generator=gen) * 3 + 1e-3
    lse[0, 1, 5:9] = sink.float()[1]  # rows that saw no key: LSE' = s, out 0, dO anything
    out[0, 5:9, 1] = 0
    dout[0, 5:9, 1] = float("nan")
    return out, dout, lse, sink, (b, h, 192), None


def _varlen_case(gen, sink_dtype, seqused):
    lens, h, d = [70, 0, 1, 130], 2, 128
    total = sum(lens)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    used = torch.tensor([50, 0, 1, 129], dtype=torch.int32) if seqused else None
    out = torch.randn(total, h, d, generator=gen).to(torch.bfloat16)
    dout = torch.randn(total, h, d, generator=gen).to(torch.bfloat16)
    sink = torch.randn(h, generator=gen).to(sink_dtype)
    lse = sink.float().view(h, 1) + torch.rand(h, total, generator=gen) * 3 + 1e-3
    if used is not None:  # the gaps past seqused: garbage the kernel must not read
        for b, (start, n) in enumerate(zip(cu[:-1].tolist(), used.tolist())):
            end = cu[b + 1].item()
            out[start + n:end], dout[start + n:end] = float("nan"), float("nan")
            lse[:, start + n:end] = float("nan")
    from hopper_flash.plan_backward import varlen_padded_rows
    rows = (h, varlen_padded_rows(total, len(lens), 64))
    return out, dout, lse, sink, rows, (cu, used, len(lens), max(lens))


def _expected_ds(case):
    """The float64 ds over the case's live rows (varlen: each sequence's
    first ``seqused`` rows, or all of its rows)."""
    out, dout, lse, sink, rows, varlen = case
    if varlen is None:
        return _sink_grad64(out, dout, lse, sink, 1)
    cu, used, batch, _ = varlen
    keep = torch.zeros(out.shape[0], dtype=torch.bool)
    for b in range(batch):
        n = (used[b] if used is not None else cu[b + 1] - cu[b]).item()
        keep[cu[b]:cu[b] + n] = True
    idx = keep.nonzero().squeeze(1)
    return _sink_grad64(out[idx], dout[idx], lse[:, idx], sink, 0)


@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_preprocess_statistics_and_sink_gradient(tmp_path, sink_dtype):
    gen = torch.Generator().manual_seed(7)
    cases = [_fixed_case(gen, sink_dtype), _varlen_case(gen, sink_dtype, False), _varlen_case(gen, sink_dtype, True)]
    # Each case again without sinks: the same statistics, no gradient.
    cases += [(o, do, lse, None, rows, vl) for o, do, lse, _, rows, vl in cases]
    results = _in_child(CHILD, cases, tmp_path)
    for case, (delta, lse2, acc, ds, counter) in zip(cases, results):
        out, dout, lse, sink, rows, varlen = case
        if sink is None:
            assert ds is None
        else:
            expected = _expected_ds(case)
            assert ds.dtype == sink.dtype and ds.shape == sink.shape
            assert torch.isfinite(ds.float()).all(), ds
            tol = 1e-5 if sink.dtype == torch.float32 else 1e-2
            torch.testing.assert_close(ds.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())
        if varlen is None:
            s = out.shape[1]
            ref_delta = (out.double() * dout.double()).sum(-1).transpose(1, 2)
            live = ref_delta.isfinite()
            got = delta[..., :s].double()
            assert torch.allclose(got[live], ref_delta[live], rtol=1e-5, atol=1e-5)
            assert torch.allclose(lse2[..., :s].double(), lse.double() * math.log2(math.e), rtol=1e-6)
            assert (lse2[..., s:] == float("inf")).all() and (delta[..., s:] == 0).all()
            assert (acc == 0).all()
            assert counter.tolist() == [0]  # zeroed for the persistent grid


ORDER_CHILD = PROLOGUE + textwrap.dedent("""
    orders = []
    for lens, used in torch.load(sys.argv[2]):
        h, d, total = 1, 64, sum(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
        out = torch.randn(total, h, d).to(torch.bfloat16)
        lse = torch.randn(h, total)
        rows = (h, plan_backward.varlen_padded_rows(total, len(lens), 64))
        stats = [torch.empty(rows), torch.empty(rows), torch.empty(rows + (d,))]
        order = torch.full((len(lens) + 1,), -1, dtype=torch.int32)  # the order, then the item counter
        plan_backward.bwd_preprocess(out, out, lse, *stats, 64, (cu, used, len(lens), max(max(lens), 1)),
                                     order=order)
        orders.append(order)
    torch.save(orders, sys.argv[3])
""")


def test_varlen_order_ranks_sequences_by_query_rows(tmp_path):
    """The preprocess's varlen ``order`` (the main kernel's grid takes the
    sequences in it): every sequence once, from the most live query rows to
    the fewest, ties in the caller's order; ``seqused_q`` gives the live
    rows where it is passed. Against a sort done here. After it, the main
    kernel's persistent-grid item counter, zeroed."""
    gen = torch.Generator().manual_seed(3)
    cases = [([70, 0, 1, 130], None),
             ([5, 9, 5, 9, 9, 0, 0, 1], None),  # ties
             ([64, 64, 64], torch.tensor([10, 60, 10], dtype=torch.int32)),  # seqused decides
             ([int(x) for x in torch.randint(0, 300, (300,), generator=gen)], None)]  # more than one rank block
    for (lens, used), order in zip(cases, _in_child(ORDER_CHILD, cases, tmp_path)):
        live = lens if used is None else used.tolist()
        expected = sorted(range(len(lens)), key=lambda b: (-live[b], b))
        assert order[:-1].tolist() == expected, (lens, order.tolist())
        assert order[-1].item() == 0
