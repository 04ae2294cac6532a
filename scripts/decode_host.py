"""Where the host time of one ``flash_attn_with_kvcache`` call goes (B8 H32/8
Sq1 Sk4096 D128 causal, no grad): wall time of back-to-back calls, without
and with a one-token append (and rotary embedding), the CPU time to enqueue a burst, the parts
(validation, ``plan.launch_forward``, one allocation) and a cProfile.

    PYTHONPATH=. python -P scripts/decode_host.py      (on the GPU machine)
    PYTHONPATH=. python -P scripts/decode_host.py --shape B,H,HK,SQ,SK [...]
        per shape (contiguous cache, causal, D128): host wall time and CPU
        enqueue time per call, ``do_bench`` of plain calls and of graph
        replay, and the kernels one call launches (torch.profiler): where a
        plain call's time above the replay's goes (the sixty-fourth
        session's 48-query blocks at H40/8: 124.9 us plain, 77.0 replayed)."""
import os
import sys
import time

import torch
import hopper_flash
from hopper_flash import kvcache, plan
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # host_timing, also under python -P
from host_timing import enqueue_us, host_us, profile_calls  # noqa: E402



def shape_report(b, h, hk, sq, sk, d=128):
    import triton
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    f = lambda: hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)  # noqa: E731
    with torch.no_grad():
        plain = triton.testing.do_bench(f, warmup=30, rep=150) * 1e3
        graph = triton.testing.do_bench_cudagraph(f, rep=150) * 1e3
        wall, enq = host_us(f, 500), enqueue_us(f)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            f()
            torch.cuda.synchronize()
    kernels = [(e.name[:60], e.device_time) for e in prof.events() if e.device_time > 0]
    print(f"B{b} H{h}/{hk} Sq{sq} Sk{sk}: do_bench plain {plain:.1f} us, graph {graph:.1f} us; "
          f"host wall {wall:.1f} us/call, enqueue {enq:.1f} us/call; kernels: "
          + ", ".join(f"{n} {t:.1f} us" for n, t in kernels), flush=True)


if "--shape" in sys.argv:
    for arg in sys.argv[sys.argv.index("--shape") + 1:]:
        shape_report(*(int(x) for x in arg.split(",")))
    sys.exit(0)

B, H, HK, D, SK = 8, 32, 8, 128, 4096
q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
kc = torch.randn(B, SK, HK, D, device="cuda", dtype=torch.bfloat16)
vc = torch.randn_like(kc)
lens = torch.full((B,), SK, dtype=torch.int32, device="cuda")
knew = torch.randn(B, 1, HK, D, device="cuda", dtype=torch.bfloat16)
lens_app = torch.full((B,), SK - 1, dtype=torch.int32, device="cuda")

def call():
    return hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)

def call_append():
    return hopper_flash.flash_attn_with_kvcache(q, kc, vc, knew, knew, cache_seqlens=lens_app, causal=True)

cos, sin = (torch.randn(SK, D // 2, device="cuda", dtype=torch.bfloat16) for _ in range(2))

def call_rotary():
    return hopper_flash.flash_attn_with_kvcache(q, kc, vc, knew, knew, rotary_cos=cos, rotary_sin=sin,
                                                cache_seqlens=lens_app, causal=True)

with torch.no_grad():
    print("lp:", plan._plan_launch.cache_info())
    for name, f in (("no append", call), ("append 1", call_append), ("append 1 + rotary", call_rotary)):
        print(f"{name}: wall {host_us(f):.1f} us/call, CPU to enqueue {enqueue_us(f):.1f} us/call")
    # components
    sc = kvcache.validate_kvcache
    t = time.perf_counter()
    for _ in range(2000): sc(q, kc, vc, None, None, lens, None, None, None, True, 0, None)
    print(f"validate_kvcache: {(time.perf_counter()-t)/2000*1e6:.1f} us")
    out = torch.empty_like(q)
    t = time.perf_counter()
    for _ in range(2000): plan.launch_forward(q, kc, vc, out, None, D ** -0.5, True, None, seqused_k=lens, num_splits=0, pack_gqa=None)
    torch.cuda.synchronize()
    print(f"launch_forward alone: {(time.perf_counter()-t)/2000*1e6:.1f} us")
    lp = plan._plan_launch(0, q.dtype, B, 1, H, HK, SK // 128, plan.CONFIGS[D], 0, True, False, 0, None, True, False)
    print("plan:", lp.mode, lp.num_splits, lp.n_ctas)
    t = time.perf_counter()
    for _ in range(20000): torch.empty(q.shape, dtype=q.dtype, device=q.device)
    print(f"torch.empty: {(time.perf_counter()-t)/20000*1e6:.2f} us")
    t = time.perf_counter()
    for _ in range(20000): torch.cuda.current_device()
    print(f"current_device: {(time.perf_counter()-t)/20000*1e6:.2f} us")
    print(profile_calls(call, 1000, limit=22)[:5000])
    print(profile_calls(call, 1000, sort="cumulative", limit=18)[:4000])
