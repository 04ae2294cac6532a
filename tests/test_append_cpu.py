"""The KV cache's append and rotary embedding (``kernels/append.py``, launched
by ``kvcache._append``) on the CPU, through Triton's interpreter
(``TRITON_INTERPRET=1``, in a child process: the variable must be set before
the kernel's module is imported).

Every case fills the caches with random values first, appends random new
keys and values at random per-row lengths, and checks against an append by
indexed writes and a float64 rotation as complex products (``rotary_ref``):
the new tokens land at
``cache_seqlens[b] + j`` (through ``cache_batch_idx`` or a shuffled page
table), every other cache entry is unchanged, values and unrotated features
are copied bit for bit, rotated features are within one bf16 rounding of the
float64 rotation, and q is rotated into a new tensor at flash-attn's
positions (``cache_seqlens + i`` under a causal or local mask, else
``cache_seqlens``) while q itself is untouched; the kernel writes the
lengths after the append, ``cache_seqlens + S_new``, into a vector of its
own."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hopper_flash import _triton_support
from rotary_ref import rotate64

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(
    _triton_support.parse_minor(_triton_support.installed_version()) < (3, 7),
    reason="triton 3.6's interpreter cannot use a scalar kernel argument under numpy 2")

# (name, batch, s_new, seqlen_q, heads, kv heads, head dim, cache rows or pages, capacity or page size, layout,
#  rotary: None or (rotary_dim, interleaved, q_pos_step, cos dtype))
CASES = [
    ("plain", 3, 2, 1, 3, 3, 64, 3, 40, "rows", None),
    ("batch-idx", 3, 1, 1, 4, 2, 128, 5, 33, "batch_idx", None),
    ("paged16", 2, 5, 5, 4, 4, 64, 9, 16, "paged", None),
    ("rotary-gptj-causal", 2, 3, 3, 6, 2, 128, 2, 50, "rows", (128, True, True, torch.bfloat16)),
    ("rotary-neox-noncausal", 2, 2, 4, 6, 2, 128, 2, 50, "rows", (128, False, False, torch.bfloat16)),
    ("rotary-partial-neox", 3, 1, 1, 8, 1, 64, 3, 21, "rows", (48, False, True, torch.float32)),
    ("rotary-partial-gptj-paged", 2, 3, 2, 2, 2, 256, 8, 16, "paged", (32, True, False, torch.float32)),
    ("rotary-batch-idx-mqa", 2, 1, 1, 16, 1, 64, 4, 30, "batch_idx", (64, True, True, torch.bfloat16)),
    # Head dims the kernels do not have (rows of a power of two, masked at the head dim).
    ("plain-d96", 2, 2, 1, 3, 3, 96, 3, 40, "rows", None),
    ("rotary-d80-paged", 2, 3, 3, 4, 2, 80, 8, 16, "paged", (64, False, True, torch.bfloat16)),
    ("rotary-d40-full", 2, 1, 2, 4, 4, 40, 2, 20, "rows", (40, True, False, torch.float32)),
    # v's head dim other than k's (FA3's hdim_v): (head dim, v's head dim).
    ("dv-192-128-rotary", 2, 2, 2, 4, 2, (192, 128), 2, 30, "rows", (64, False, True, torch.bfloat16)),
    ("dv-64-128-paged", 2, 3, 1, 2, 2, (64, 128), 8, 16, "paged", None),
]

CHILD = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, sys.argv[1])
    import torch
    from hopper_flash import kvcache, plan
    # The interpreter launches through the JIT: the cached fast launch needs a GPU.
    plan.launch_triton = lambda kernel, grid, args, constexprs, num_warps, launch_pdl=False: \\
        kernel[grid](*args, **constexprs, num_warps=num_warps)
    results = []
    for q, kc, vc, k, v, seqlens, bidx, pt, rotary in torch.load(sys.argv[2]):
        q_used, seqused = kvcache._append(q, kc, vc, k, v, seqlens, bidx, pt, rotary)
        results.append((kc, vc, q_used, q, seqused, seqlens))
    torch.save(results, sys.argv[3])
""")


def _case(spec, gen):
    name, B, s_new, sq, H, Hkv, D, n_rows, size, layout, rotary = spec
    D, Dv = (D, D) if isinstance(D, int) else D
    bf16 = torch.bfloat16
    paged = layout == "paged"
    pages_per_row = 4 if paged else None
    capacity = pages_per_row * size if paged else size
    kc = torch.randn(n_rows, size, Hkv, D, generator=gen).to(bf16)
    vc = torch.randn(n_rows, size, Hkv, Dv, generator=gen).to(bf16)
    # New tokens as strided views (the head dim contiguous), as a fused QKV projection gives them.
    k = torch.randn(B, s_new, Hkv, 2 * D, generator=gen).to(bf16)[..., :D]
    v = torch.randn(B, s_new, Hkv, Dv, generator=gen).to(bf16)
    q = torch.randn(B, sq, H, D, generator=gen).to(bf16)
    seqlens = torch.randint(0, capacity - s_new + 1, (B,), generator=gen, dtype=torch.int32)
    seqlens[0] = capacity - s_new  # one row filled to the brim
    bidx = torch.randperm(n_rows, generator=gen)[:B].to(torch.int32) if layout == "batch_idx" else None
    pt = torch.randperm(n_rows, generator=gen)[:B * pages_per_row].view(B, pages_per_row).to(torch.int32) \
        if paged else None
    rot = None
    if rotary is not None:
        rotary_dim, interleaved, q_step, cos_dtype = rotary
        angle = torch.rand(capacity + 3, rotary_dim // 2, generator=gen, dtype=torch.float64) * 6.3
        cos, sin = torch.cos(angle).to(cos_dtype), torch.sin(angle).to(cos_dtype)
        if name == "rotary-partial-neox":  # cos a column slice of a wider table: sin's row stride differs
            cos = torch.cat((cos, torch.full_like(cos, float("nan"))), dim=1)[:, :rotary_dim // 2]
        rot = (cos, sin, interleaved, q_step)
    return q, kc, vc, k, v, seqlens, bidx, pt, rot


def _expected(q, kc, vc, k, v, seqlens, bidx, pt, rot):
    """The caches after the append and the queries the attention should
    read, by indexed writes here (float64 where rotated)."""
    kc, vc = kc.double().clone(), vc.double().clone()
    B, s_new = k.shape[:2]
    pos = seqlens.long()[:, None] + torch.arange(s_new)[None, :]
    k_new = k.double()
    q_used = q.double()
    if rot is not None:
        cos, sin, interleaved, q_step = rot
        k_new = rotate64(k, cos, sin, pos[:, :, None], interleaved)
        rows_q = torch.arange(q.shape[1])[None, :]
        q_pos = seqlens.long()[:, None] + (rows_q if q_step else torch.zeros_like(rows_q))
        q_used = rotate64(q, cos, sin, q_pos[:, :, None], interleaved)
    if pt is not None:
        page_size = kc.shape[1]
        rows, at = torch.gather(pt.long(), 1, pos // page_size), pos % page_size
    else:
        rows = (bidx.long() if bidx is not None else torch.arange(B))[:, None].expand(B, s_new)
        at = pos
    kc[rows, at] = k_new
    vc[rows, at] = v.double()
    written = torch.zeros(kc.shape[:2], dtype=torch.bool)
    written[rows, at] = True
    return kc, vc, q_used, written


def test_append_and_rotary_match_indexed_writes(tmp_path):
    gen = torch.Generator().manual_seed(0)
    cases = [_case(spec, gen) for spec in CASES]
    torch.save(cases, tmp_path / "cases.pt")
    subprocess.run([sys.executable, "-c", CHILD, ROOT, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")],
                   check=True, capture_output=True, text=True, timeout=900)
    results = torch.load(tmp_path / "out.pt")
    for spec, case, (kc, vc, q_used, q_after, seqused, seqlens_after) in zip(CASES, cases, results):
        name, rotary = spec[0], spec[-1]
        q, kc0, vc0, k, v, seqlens = case[:6]
        assert torch.equal(q_after, q), name  # the caller's q is never written
        # The lengths the attention reads: the kernel's own vector, each row's length plus the new tokens.
        assert torch.equal(seqlens_after, seqlens), name  # the caller's lengths are never written
        assert seqused.dtype == torch.int32 and torch.equal(seqused.long(), seqlens.long() + k.shape[1]), name
        ref_k, ref_v, ref_q, written = _expected(*case)
        # Untouched entries and the values: bit for bit.
        assert torch.equal(kc[~written], kc0[~written]), name
        assert torch.equal(vc.double(), ref_v), name
        if rotary is None:
            assert torch.equal(kc.double(), ref_k), name
            assert torch.equal(q_used, q), name
            continue
        rotary_dim = rotary[0]
        # Unrotated features copied; rotated ones in fp32 and rounded once
        # (the interpreter truncates where the GPU rounds): within one bf16
        # step of the float64 rotation.
        got, want = kc[written].double(), ref_k[written]
        assert torch.equal(got[..., rotary_dim:], want[..., rotary_dim:]), name
        assert ((got - want).abs() <= want.abs() * 2.0 ** -7 + 1e-5).all(), name
        assert q_used.shape == q.shape and q_used.dtype == q.dtype, name
        assert torch.equal(q_used[..., rotary_dim:], q[..., rotary_dim:]), name
        assert ((q_used.double() - ref_q).abs() <= ref_q.abs() * 2.0 ** -7 + 1e-5).all(), name
        # The rotation moved something (a kernel that only copied would fail above, but say so plainly).
        assert not torch.equal(q_used, q), name
