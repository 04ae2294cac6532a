"""Usage: PYTHONPATH=PKG python -P scripts/bwd_pre_post.py

Backward pre/postprocess and the dq_accum fill, timed alone (do_bench
medians), with the preprocess (which also zeroes dq_accum's rows) launched at
several (BLOCK, num_warps)."""
import torch
from triton.testing import do_bench
from hopper_flash.kernels.backward_pre import _bwd_preprocess_kernel
from hopper_flash import plan_backward
for (B, S, H) in ((16, 1024, 16), (4, 8192, 32)):
    D = 128
    o, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lse = torch.randn(B, H, S, device="cuda")
    delta = torch.empty(B, H, S, device="cuda"); lse2 = torch.empty_like(delta)
    acc = torch.randn(B, H, S, D, device="cuda"); dq = torch.empty_like(o)
    gb = 2 * o.numel() * 2 / 1e9
    st = plan_backward._strides8(o.stride(0), o.stride(1), o.stride(2))
    ref = (o.float() * do.float()).sum(-1).transpose(1, 2)
    for blk, w in ((64, 4), (64, 8), (128, 4), (128, 8), (32, 4), (256, 8)):
        args = (o, do, lse, delta, lse2, acc, lse, lse, lse, lse, lse, *st, *st, lse.stride(0), lse.stride(1), S, S, H)
        f = lambda: _bwd_preprocess_kernel[(S // blk, H, B)](*args, BLOCK=blk, HEAD_DIM=D, BLOCK_M=64, VARLEN=False, SEQUSED=False, SINK=False, num_warps=w)
        delta.fill_(float("nan")); f(); ok = torch.allclose(delta, ref, rtol=1e-3, atol=1e-2)
        ms = do_bench(f, warmup=20, rep=100, return_mode="median")
        print(f"B{B} S{S} H{H} pre BLOCK={blk} warps={w}: {ms*1e3:.1f} us {gb/ms:.2f} TB/s ok={ok}", flush=True)
    ms = do_bench(lambda: acc.zero_(), warmup=20, rep=100, return_mode="median")
    print(f"  fill dq_accum {acc.numel()*4/1e6:.0f} MB: {ms*1e3:.1f} us {acc.numel()*4/1e9/ms:.2f} TB/s")
    ms = do_bench(lambda: plan_backward.bwd_postprocess(acc.view(-1, D), dq, 0.1, 64), warmup=20, rep=100, return_mode="median")
    print(f"  post: {ms*1e3:.1f} us {(acc.numel()*4 + dq.numel()*2)/1e9/ms:.2f} TB/s")
    ms = do_bench(lambda: plan_backward.bwd_preprocess(o, do, lse, delta, lse2, acc, 64), warmup=20, rep=100, return_mode="median")
    print(f"  shipped pre: {ms*1e3:.1f} us {gb/ms:.2f} TB/s")

import triton, triton.language as tl
@triton.jit
def _pre_zero(o_ptr, do_ptr, delta_ptr, acc_ptr, so_b, so_s, so_h, S, H, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    pid_m = tl.program_id(0); h = tl.program_id(1).to(tl.int64); b = tl.program_id(2).to(tl.int64)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK); cols = tl.arange(0, HEAD_DIM)
    off = b * so_b + h * so_h + rows.to(tl.int64)[:, None] * so_s + cols[None, :]
    o = tl.load(o_ptr + off); do = tl.load(do_ptr + off)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    r = (b * H + h) * S + rows
    tl.store(delta_ptr + r, delta)
    tl.store(acc_ptr + r[:, None] * HEAD_DIM + cols[None, :], tl.zeros([BLOCK, HEAD_DIM], tl.float32))
for (B, S, H) in ((16, 1024, 16), (4, 8192, 32)):
    D = 128
    o, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    delta = torch.empty(B, H, S, device="cuda"); acc = torch.randn(B, H, S, D, device="cuda")
    for blk, w in ((64, 4), (64, 8), (128, 8)):
        f = lambda: _pre_zero[(S // blk, H, B)](o, do, delta, acc, o.stride(0), o.stride(1), o.stride(2), S, H, BLOCK=blk, HEAD_DIM=D, num_warps=w)
        ms = do_bench(f, warmup=20, rep=100, return_mode="median")
        print(f"B{B} S{S} fused pre+zero BLOCK={blk} warps={w}: {ms*1e3:.1f} us ({(2*o.numel()*2 + acc.numel()*4)/1e9/ms:.2f} TB/s)", flush=True)
