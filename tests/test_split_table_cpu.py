"""The split table (``kernels/split_table.py``) on the CPU, through Triton's
interpreter in a child process (as ``test_combine_cpu.py``), and the host's
bound on its entries (``plan.varlen_split_table``).

Each sequence ``b`` of a skewed packed batch must get exactly ``clamp(
ceil(ceil(len_b / block_n) / blocks), 1, max_splits)`` entries, its splits
0 .. count - 1, each entry naming the count; the split sequences' entries
come before the others; the entries past the last are -1; and the
partial LSEs are all -inf. Lengths come from ``cu_seqlens_k`` or from
``seqused_k`` (which may be shorter than the slots, or 0), and the table
buffer starts poisoned."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hopper_flash import _triton_support, plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK_N = plan.CONFIGS[128].block_n

CHILD = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, sys.argv[1])
    import torch
    from hopper_flash.kernels.split_table import FILL_BLOCK, split_table_kernel
    cases = torch.load(sys.argv[2])
    results = []
    for cu_k, used_k, n_items, blocks, max_splits, n_lse in cases:
        table = torch.full((n_items,), -7, dtype=torch.int32)
        lse = torch.full((n_lse,), float("nan"))
        grid = (1 + (n_lse + FILL_BLOCK - 1) // FILL_BLOCK,)
        split_table_kernel[grid](cu_k, used_k if used_k is not None else cu_k, table, lse, cu_k.numel() - 1,
                                 n_items, blocks, max_splits, n_lse, BLOCK_N=%d, SEQUSED=used_k is not None,
                                 BLOCK_B=4, S_MAX=1 << max(1, (max_splits - 1).bit_length()), FILL=FILL_BLOCK)
        results.append((table, lse))
    torch.save(results, sys.argv[3])
""" % BLOCK_N)


def _lengths(cu_k, used_k):
    return (used_k if used_k is not None else cu_k[1:] - cu_k[:-1]).tolist()


def _cases():
    gen = torch.Generator().manual_seed(3)
    out = []
    # (key lengths, seqused_k or None, max splits): a long sequence among short ones at either end, empty
    # sequences, seqused shorter than its slot or 0, more sequences than a block of the kernel (4), and a
    # launch whose count no sequence reaches.
    specs = [
        ([1024] * 9 + [65536], None, 8),
        ([65536] + [1024] * 9, None, 8),
        ([0, 129, 40001, 0, 300, 12000, 1], None, 11),
        ([5000, 3000, 70000, 100], [4999, 0, 69999, 100], 32),
        (torch.randint(0, 3000, (23,), generator=gen).tolist() + [50000], None, 16),
        ([100, 200], None, 3),
    ]
    for lens, used, max_splits in specs:
        cu_k = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        used_k = None if used is None else torch.tensor(used, dtype=torch.int32)
        longest = max(_lengths(cu_k, used_k))
        blocks = plan.split_table_blocks(longest, max_splits, plan.CONFIGS[128])
        n_items = plan.varlen_split_table(int(cu_k[-1]), len(lens), longest, max_splits, plan.CONFIGS[128])
        out.append((cu_k, used_k, n_items, blocks, max_splits, 3 * FILL + 5))
    return out


FILL = 4096


@pytest.mark.skipif(_triton_support.parse_minor(_triton_support.installed_version()) < (3, 7),
                    reason="triton 3.6's interpreter cannot use a scalar kernel argument as a loop bound under numpy 2")
def test_split_table_gives_each_sequence_its_count_longest_first(tmp_path):
    cases = _cases()
    torch.save(cases, tmp_path / "cases.pt")
    subprocess.run([sys.executable, "-c", CHILD, ROOT, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
                   check=True, capture_output=True, text=True, timeout=600)
    for (cu_k, used_k, n_items, blocks, max_splits, _), (table, lse) in zip(cases, torch.load(tmp_path / "out.pt")):
        lengths = _lengths(cu_k, used_k)
        want = [min(max(-(-(-(-n // BLOCK_N)) // blocks), 1), max_splits) for n in lengths]
        assert (lse == float("-inf")).all()
        entries = table.tolist()
        live = [e for e in entries if e != -1]
        assert len(live) == sum(want) <= n_items, (len(live), sum(want), n_items)
        assert entries[len(live):] == [-1] * (n_items - len(live)), "the entries past the last are -1"
        decoded = [(e >> 14, (e >> 7) & 127, e & 127) for e in live]
        for b, count in enumerate(want):
            mine = [(c, s) for bb, c, s in decoded if bb == b]
            assert sorted(mine) == [(count, s) for s in range(count)], (b, mine, count)
        counts = [c for _, c, _ in decoded]
        n_split = sum(c > 1 for c in counts)
        assert all(c > 1 for c in counts[:n_split]) and all(c == 1 for c in counts[n_split:]), \
            "the split sequences' entries come first"


def test_split_table_bound_covers_every_length_mix():
    """``varlen_split_table``'s entry count is never below what any lengths
    summing to at most ``total_k`` give (random mixes, each with its longest
    at ``max_seqlen_k``), and it refuses what the encoding cannot hold."""
    cfg = plan.CONFIGS[128]
    gen = torch.Generator().manual_seed(5)
    for _ in range(300):
        batch = int(torch.randint(1, 200, (1,), generator=gen))
        lens = torch.randint(0, int(torch.randint(2, 20000, (1,), generator=gen)), (batch,), generator=gen)
        lens[int(torch.randint(0, batch, (1,), generator=gen))] = int(torch.randint(1, 200000, (1,), generator=gen))
        total_k = int(lens.sum()) + int(torch.randint(0, 1000, (1,), generator=gen))
        splits = int(torch.randint(2, 33, (1,), generator=gen))
        longest = int(lens.max())
        blocks = plan.split_table_blocks(longest, splits, cfg)
        need = sum(min(max(-(-(-(-int(n) // cfg.block_n)) // blocks), 1), splits) for n in lens)
        assert need <= plan.varlen_split_table(total_k, batch, longest, splits, cfg)
    assert plan.varlen_split_table(100000, 10, 65536, 1, cfg) == 0  # unsplit
    assert plan.varlen_split_table(100000, 10, 65536, 128, cfg) == 0  # a count past 7 bits
    assert plan.varlen_split_table(10 ** 9, 1 << 17, 65536, 8, cfg) == 0  # a batch past 17 bits


@pytest.mark.parametrize("seqused", [False, True])
def test_split_table_kernel_compiles(seqused):
    """The table kernel for sm_90a, as the forward's varlen launch runs it
    (plan._split_table: 128 sequences a block, up to 32 splits): no local
    memory."""
    from hopper_flash.compile_check import compile_triton
    from hopper_flash.kernels.split_table import FILL_BLOCK, split_table_kernel

    sig = {"cu_k_ptr": "*i32", "used_k_ptr": "*i32", "table_ptr": "*i32", "lse_part_ptr": "*fp32", "batch": "i32",
           "n_items": "i32", "blocks_per_split": "i32", "max_splits": "i32", "n_lse": "i32",
           "BLOCK_N": "constexpr", "SEQUSED": "constexpr", "BLOCK_B": "constexpr", "S_MAX": "constexpr",
           "FILL": "constexpr"}
    k = compile_triton(split_table_kernel, sig, {"BLOCK_N": 128, "SEQUSED": seqused, "BLOCK_B": 128, "S_MAX": 32,
                                                 "FILL": FILL_BLOCK}, num_warps=4)
    assert ".local" not in k.asm["ptx"]
