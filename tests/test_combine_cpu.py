"""The split-KV combine (``kernels/combine.py``) on the CPU, through Triton's
interpreter (``TRITON_INTERPRET=1``, in a child process: the variable must
be set before the kernel's module is imported), against a float64 merge of
the same partials computed here.

The partials are random, with an empty split inside a row (``lse = -inf``,
``O = 0``, as the split kernel writes it), a split slot no item wrote
(``lse = -inf`` from the split table's fill, ``O`` NaN: never read), and a
row whose every split is empty (the result is 0 and its LSE -inf); the outputs are poisoned with NaN
first. Split counts cover one chunk and several, split counts that are not a
multiple of the chunk, and up to 128 (B=1 decode with one KV head). Every
case runs again with attention sinks (fp32 or bf16, read in their dtype):
the merge then counts the sink as one more split with no output, and the
all-empty row gives 0 with the sink as its LSE."""
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
    reason="triton 3.6's interpreter cannot use a scalar kernel argument as a loop bound under numpy 2")

CASES = [  # (splits, batch, seqlen_q, heads, head dim, write_lse)
    (1, 2, 1, 3, 128, True), (2, 2, 1, 3, 128, True), (15, 2, 1, 3, 128, True), (16, 2, 1, 3, 128, False),
    (17, 2, 1, 3, 128, True), (70, 1, 2, 2, 128, True), (109, 1, 1, 8, 128, True), (128, 1, 1, 2, 128, False),
    (33, 1, 3, 2, 256, True), (5, 1, 1, 4, 64, True),
]

CHILD = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, sys.argv[1])
    import torch
    from hopper_flash.kernels.combine import combine_kernel
    from hopper_flash.plan import _combine_constexprs
    cases = torch.load(sys.argv[2])
    results = []
    for o, lse, write_lse, sink in cases:
        n_splits, batch, seqlen_q, heads, head_dim = o.shape
        out = torch.full((batch, seqlen_q, heads, head_dim), float("nan"), dtype=torch.bfloat16)
        lse_out = torch.full((batch, heads, seqlen_q), float("nan")) if write_lse else lse  # as plan.launch_combine
        combine_kernel[(batch * seqlen_q * heads,)](
            o, lse, out, lse_out, lse if sink is None else sink, n_splits, batch, seqlen_q, heads, out.stride(0),
            out.stride(1), out.stride(2),
            **{**_combine_constexprs(head_dim, n_splits, write_lse, sink is not None), "DEPENDENT": False})
        results.append((out, lse_out if write_lse else None))
    torch.save(results, sys.argv[3])
""")


def _partials(n_splits, batch, seqlen_q, heads, head_dim, gen):
    o = torch.randn(n_splits, batch, seqlen_q, heads, head_dim, generator=gen)
    lse = torch.randn(n_splits, batch, heads, seqlen_q, generator=gen) * 3
    # An empty split inside row (0, 0, 0) and, with more than one row, every split of the last row empty.
    lse[0, 0, 0, 0], o[0, 0, 0, 0] = -math.inf, 0.0
    if batch * seqlen_q * heads > 1:
        lse[:, -1, -1, -1], o[:, -1, -1, -1] = -math.inf, 0.0
    if n_splits > 2:
        # A split slot no item wrote (a sequence with fewer splits than the
        # launch, kernels/split_table.py): LSE -inf from the fill, O whatever
        # the buffer held; it must not be read.
        lse[-1, 0, 0, 0], o[-1, 0, 0, 0] = -math.inf, math.nan
    return o, lse


@pytest.mark.parametrize("sink_dtype", [None, torch.float32, torch.bfloat16], ids=["no-sink", "sink-fp32", "sink-bf16"])
def test_combine_merges_the_splits_by_lse(tmp_path, sink_dtype):
    gen = torch.Generator().manual_seed(0)
    cases = [(*_partials(*shape[:5], gen), shape[5],
              None if sink_dtype is None else (torch.randn(shape[3], generator=gen) * 3).to(sink_dtype))
             for shape in CASES]
    torch.save(cases, tmp_path / "cases.pt")
    subprocess.run([sys.executable, "-c", CHILD, ROOT, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
                   check=True, capture_output=True, text=True, timeout=600)
    results = torch.load(tmp_path / "out.pt")
    for (o, lse, write_lse, sink), (out, lse_out), shape in zip(cases, results, CASES):
        l64 = lse.double()
        if sink is not None:  # the sink: one more split, with no output
            l64 = torch.cat([l64, sink.double().view(1, 1, -1, 1).expand(1, *l64.shape[1:])])
            o = torch.cat([o, torch.zeros_like(o[:1])])
        ref_lse = torch.logsumexp(l64, dim=0)  # [B, H, Sq]
        weights = torch.exp(l64 - ref_lse).nan_to_num(0.0)  # an all-empty row: 0, not NaN
        # (The unwritten slot's NaN has weight 0: its contribution is 0.)
        ref = (weights.permute(0, 1, 3, 2)[..., None] * o.double().nan_to_num(0.0)).sum(0)  # [B, Sq, H, D]
        assert not out.isnan().any(), shape
        # The merge in fp32, then one conversion to bf16 (the interpreter's
        # truncates where the GPU's rounds): within one bf16 ulp of the float64 merge.
        assert ((out.double() - ref).abs() <= ref.abs() * 2.0 ** -7 + 1e-6).all(), shape
        several_rows = shape[1] * shape[2] * shape[3] > 1  # then the last row is all-empty (_partials)
        if several_rows:
            assert (out[-1, -1, -1] == 0).all(), shape
        if write_lse:
            live = torch.isfinite(ref_lse)
            assert torch.allclose(lse_out.double()[live], ref_lse[live], rtol=0, atol=1e-5), shape
            assert (lse_out[~live] == -math.inf).all() and (several_rows or live.all()), shape
            assert sink is None or live.all(), "with sinks every row has an LSE (the all-empty row's: the sink)"
        else:
            assert lse_out is None
