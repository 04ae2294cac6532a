"""The host path of one decode step's attention on the CPU machine: the real
Python from the transformers backend down to the C launch call, with the
CUDA-only pieces patched out (device checks, the stream, the SM count, the C
launch function and the TMA encoder are stand-ins; tensors live on the CPU,
so allocations cost less than on the GPU machine). For cutting Python
overhead without device time; the GPU machine's figures come from
``scripts/backend_host.py`` (the backward's from ``scripts/bwd_host.py``).

    python scripts/host_standin.py [SEQLEN_K] [-p]      (-p: a cProfile too)
    python scripts/host_standin.py --varlen [-p]        one continuous-batching step's flash_attn_varlen_func
                                                        call (64 decodes + a 512-query chunk), split heuristic
                                                        on and off
    python scripts/host_standin.py --chunk [-p]         a chunked decode step's flash_attn_with_kvcache call
                                                        (attention_chunk): prepared, and the full path
    python scripts/host_standin.py --skew [-p]          a skewed packed decode (64 over 1024 keys, 1 over
                                                        65536): unsplit, uniform 8 splits, split table
    python scripts/host_standin.py --backward [-p]      a B1 H1 S128 D128 causal backward through
                                                        autograd (torch.autograd.grad; on the CPU the
                                                        engine runs on the calling thread, on the GPU
                                                        machine on its device thread)"""
import contextlib
import cProfile
import os
import pstats
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hopper_flash import checks, launcher, plan, plan_backward  # noqa: E402
from hopper_flash.integrations import transformers as hft  # noqa: E402

torch.cuda.current_device = lambda: None
checks.check_device = lambda t, name="q": None
checks._PASSED_DEVICE_TYPE = "cpu"  # as CUDA tensors are on the GPU machine: a passed signature is remembered
plan._sm_count = lambda device: 132
plan.FAST_LAUNCH = True
plan._launch_hooked = lambda: False
class Drv:
    class active:
        @staticmethod
        def get_current_stream(d): return 7
plan.driver = Drv
def c_launch(*a): pass
def fill(*a): return object()
class Run:
    launch = c_launch; global_scratch_size = 0; profile_scratch_size = 0
    launch_cooperative_grid = False; launch_pdl = False
meta = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [1, 64, 1, 128], "fp4_padded": False}
def make_kl():
    # Nine descriptor slots: the backward's kernel has nine, the forward's four.
    comp = types.SimpleNamespace(run=Run(), function=1, packed_metadata=(4, 1, 1),
                                 metadata=types.SimpleNamespace(tensordesc_meta=[meta] * 9))
    d = launcher._Direct(c_launch, fill, {10: 9}, [meta] * 9, False, Run())
    return launcher.KernelLaunch(comp, direct=d)
class AutoDict(dict):
    def get(self, k, default=None):
        if k not in self: self[k] = make_kl()
        return dict.get(self, k)
plan._COMPILED = AutoDict(); plan._TRITON_COMPILED = AutoDict(); plan_backward._COMPILED = AutoDict()
plan_backward.FAST_LAUNCH = True
torch.cuda.device = lambda device: contextlib.nullcontext()


def timed(f, calls):
    for _ in range(200): f()
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls): f()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def profile_if_asked(f, calls):
    """With -p: cProfile's 30 most expensive functions over ``calls`` calls of ``f``."""
    if "-p" in sys.argv:
        pr = cProfile.Profile(); pr.enable()
        for _ in range(calls): f()
        pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(30)


if "--backward" in sys.argv:
    from hopper_flash import ops
    qb, kb, vb = (torch.randn(1, 128, 1, 128).to(torch.bfloat16).requires_grad_() for _ in range(3))
    # flash_attn_func's eager autograd path (it takes the custom op for CPU tensors)
    out, _ = ops.EagerAttention.apply(qb, kb, vb, 128 ** -0.5, True, False, None)
    g = torch.randn_like(out)
    f = lambda: torch.autograd.grad(out, (qb, kb, vb), g, retain_graph=True)
    print(f"backward call through autograd, CPU stand-in: {timed(f, 2000):.1f} us")
    profile_if_asked(f, 2000)
    sys.exit(0)

if "--skew" in sys.argv:
    # The skewed packed decode (varlen_pack_bench's row): 64 decodes over
    # 1024 keys beside one over 65536, GQA 32/8; the default call splits
    # each sequence by its own count (a split table, one launch more).
    lq, lk = [1] * 65, [1024] * 64 + [65536]
    cq = torch.tensor([0] + lq).cumsum(0).to(torch.int32)
    ck = torch.tensor([0] + lk).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lq), 32, 128).to(torch.bfloat16)
    k = torch.randn(sum(lk), 8, 128).to(torch.bfloat16); v = torch.randn_like(k)
    import hopper_flash
    for splits in (1, 8, 0):
        f = lambda: hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, 1, 65536, causal=True, num_splits=splits)
        print(f"skewed varlen call (num_splits={splits}), CPU stand-in: {timed(f, 2000):.1f} us")
    profile_if_asked(f, 2000)
    sys.exit(0)

if "--chunk" in sys.argv:
    # A chunked decode step (flash_attn_with_kvcache(attention_chunk=8192),
    # chunk_decode_probe's row): B8 H40/8 D128 over 32768 keys, contiguous
    # and in pages of 64 and 256; prepared (this tree) and the full path
    # every call (what a tree without prepared chunked calls runs). On the
    # CPU each row's last chunk is a few torch ops, on the GPU one launch;
    # the argument checks are stubbed (they refuse CPU tensors), so the full
    # path's figure lacks their cost.
    import hopper_flash
    from hopper_flash import kvcache
    kvcache.validate_kvcache = lambda q, *a, **kw: q.shape[-1] ** -0.5
    from hopper_flash.reference import paged_cache
    b, cap, chunk = 8, 32768, 8192
    q = torch.randn(b, 1, 40, 128).to(torch.bfloat16)
    kc = torch.randn(b, cap, 8, 128).to(torch.bfloat16); vc = torch.randn_like(kc)
    lens = torch.full((b,), cap, dtype=torch.int32)
    layouts = {"contiguous": dict(k_cache=kc, v_cache=vc)}
    for page in (64, 256):
        kp, vp, pt = paged_cache(kc, vc, page)
        layouts[f"pages of {page}"] = dict(k_cache=kp, v_cache=vp, page_table=pt)
    real = kvcache.prepared_call
    for name, kw in layouts.items():
        f = lambda: hopper_flash.flash_attn_with_kvcache(q, **kw, cache_seqlens=lens, causal=True,
                                                         attention_chunk=chunk)
        kvcache.prepared_call = real
        prepared = timed(f, 2000)
        kvcache.prepared_call = lambda *a, **k: None
        full = timed(f, 2000)
        print(f"chunked decode step, {name}, CPU stand-in: prepared {prepared:.1f} us, full path {full:.1f} us")
    kvcache.prepared_call = real
    profile_if_asked(f, 2000)
    sys.exit(0)

if "--varlen" in sys.argv:
    # One continuous-batching step's call (flash_attn_varlen_func, as
    # paged|hopper_flash makes it per layer): 64 decodes over 4096 keys and a
    # 512-query chunk, GQA 32/8, with the default split heuristic and without.
    lq, lk = [1] * 64 + [512], [4096] * 64 + [1536]
    cq = torch.tensor([0] + lq).cumsum(0).to(torch.int32)
    ck = torch.tensor([0] + lk).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lq), 32, 128).to(torch.bfloat16)
    k = torch.randn(sum(lk), 8, 128).to(torch.bfloat16); v = torch.randn_like(k)
    import hopper_flash
    for splits in (0, 1):
        f = lambda: hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, 512, 4096, causal=True, num_splits=splits)
        print(f"varlen call (num_splits={splits}), CPU stand-in: {timed(f, 2000):.1f} us")
    profile_if_asked(f, 2000)
    sys.exit(0)

class Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 4
m = Module()
S = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
q = torch.randn(1, 32, 1, 128).to(torch.bfloat16)
k = torch.randn(1, 8, S, 128).to(torch.bfloat16); v = torch.randn_like(k)
f = lambda: hft.hopper_flash_attention_forward(m, q, k, v, None, scaling=128 ** -0.5)
print(f"backend decode call, CPU stand-in: {timed(f, 5000):.1f} us")
profile_if_asked(f, 5000)
