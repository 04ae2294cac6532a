"""Host time of one decode step's attention at a long context (issue 10's
generation criterion): transformers' hopper_flash backend against its warm
``sdpa`` backend, and the layers under ours (``flash_attn_func``,
``plan.launch_forward``, the compiled kernel's launcher, one TMA descriptor
fill), with FA3's ``flash_attn_func`` beside them when it is importable.

B1, 32 query heads on 8 KV heads, D128, one query row against ``--context``
keys, the BHSD views transformers passes. Wall time of back-to-back calls
(the host's time wherever it exceeds the GPU's) and the CPU time to enqueue a
burst, then cProfiles of the backend call.

    PYTHONPATH=. python -P scripts/backend_host.py [--context 32768]   (GPU machine)"""
import argparse
import os
import sys
import time

import torch

import hopper_flash
from hopper_flash import launcher, plan
from hopper_flash.integrations import transformers as hf_backend
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # host_timing, also under python -P
from host_timing import enqueue_us, host_us, profile_calls  # noqa: E402


class Module(torch.nn.Module):
    """What the attention functions read from a transformers attention layer."""
    is_causal = True
    num_key_value_groups = 4


def per_call(fn, n=2000):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=32768)
    args = p.parse_args()
    s = args.context
    torch.manual_seed(0)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, s, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    module = Module()
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    qb, kb, vb = (x.transpose(1, 2) for x in (q, k, v))
    calls = {
        "backend hopper_flash": lambda: hf_backend.hopper_flash_attention_forward(module, q, k, v, None,
                                                                                   scaling=128 ** -0.5),
        "backend sdpa (warm)": lambda: sdpa_attention_forward(module, q, k, v, None, scaling=128 ** -0.5),
        "flash_attn_func": lambda: hopper_flash.flash_attn_func(qb, kb, vb, causal=False),
    }
    out = torch.empty_like(qb)
    calls["plan.launch_forward"] = lambda: plan.launch_forward(qb, kb, vb, out, None, 128 ** -0.5, False,
                                                               num_splits=0, pack_gqa=None)
    try:
        import flash_attn_interface as fa3
        calls["fa3 flash_attn_func"] = lambda: fa3.flash_attn_func(qb, kb, vb, causal=False)
    except ImportError:
        pass
    # As in a model: a DynamicCache's K/V move every step (torch.cat) and grow
    # by one key, so layer 1 of a step meets a new argument signature and
    # every layer new K/V addresses (TMA descriptors to encode). Views of one
    # buffer stand in for them: keys [:, :, :s + i] (a new signature per call)
    # and [:, :, i:i + s] (the signature of the last layer, new addresses).
    big_k = torch.randn(1, 8, s + 1200, 128, device="cuda", dtype=torch.bfloat16)
    big_v = torch.randn_like(big_k)
    grow = [(big_k[:, :, :s + i], big_v[:, :, :s + i]) for i in range(1200)]
    moved = [(big_k[:, :, i:i + s], big_v[:, :, i:i + s]) for i in range(1200)]

    def cycling(views, backend):
        state = {"i": 0}

        def call():
            kk, vv = views[state["i"] % len(views)]
            state["i"] += 1
            return backend(module, q, kk, vv, None, scaling=128 ** -0.5)
        return call
    pattern_calls = {
        "hopper_flash, new length": cycling(grow, hf_backend.hopper_flash_attention_forward),
        "hopper_flash, moved K/V": cycling(moved, hf_backend.hopper_flash_attention_forward),
        "sdpa (warm), moved K/V": cycling(moved, sdpa_attention_forward),
    }
    with torch.inference_mode():
        for name, fn in pattern_calls.items():
            fn()
            # enqueue_us makes 1000 calls: each "new length" call is a signature not seen before
            print(f"{name:32s} enqueue {enqueue_us(fn):7.1f} us/call")
        ref = calls["backend sdpa (warm)"]()[0].float()
        got = calls["backend hopper_flash"]()[0].float()
        print(f"context {s}: max |ours - sdpa| = {(got - ref).abs().max().item():.3e}")
        for name, fn in calls.items():
            print(f"{name:24s} wall {host_us(fn):7.1f} us/call   enqueue {enqueue_us(fn):7.1f} us/call")
        launches = [*plan._COMPILED.values(), *plan._TRITON_COMPILED.values()]
        print("direct launches:", sum(kl.direct is not None for kl in launches), "of", len(launches))
        direct = [kl.direct for kl in launches]
        for kl in launches:
            kl.direct = None  # CompiledKernel.run, as before launcher.py
        for name in ("backend hopper_flash", "flash_attn_func", "plan.launch_forward"):
            fn = calls[name]
            print(f"{name + ' (run)':24s} wall {host_us(fn):7.1f} us/call   enqueue {enqueue_us(fn):7.1f} us/call")
        for kl, d in zip(launches, direct):
            kl.direct = d
        lp = plan._plan_launch.cache_info()
        print("plan cache:", lp)
        key = next(k for k in plan._COMPILED if k[4] == plan.CONFIGS[128])
        kernel = plan._COMPILED[key].compiled
        print("kernels compiled:", len(plan._COMPILED), "mode of the decode launch:", key[5])
        # The compiled kernel's launcher alone, on the last plan's arguments.
        lpl = plan._plan_launch(0, q.dtype, 1, 1, 32, 8, plan.triton_cdiv(s, 128), plan.CONFIGS[128], 0, False,
                                False, 0, None, False, False)
        print("plan:", lpl.mode, "splits", lpl.num_splits, "ctas", lpl.n_ctas)
        from triton.runtime.driver import driver
        utils = driver.active.utils
        meta = kernel.metadata.tensordesc_meta
        print("tensordesc_meta[1]:", meta[1] if meta else None)
        m = meta[1]
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
        host_type = TMA_DTYPE_DEVICE_TO_HOST[m["elem_type"]]
        if hasattr(utils, "fill_tma_descriptor"):  # triton 3.6; 3.7+ encode inside their generic launcher
            fill = lambda: utils.fill_tma_descriptor(kb.data_ptr(), m["swizzle"], m["elem_size"], host_type,
                                                     m["block_size"], list(kb.shape), list(plan.tma_strides(kb)),
                                                     0)
            print(f"fill_tma_descriptor alone: {per_call(fill, 20000):.2f} us")
        print(f"TmaArg(k): {per_call(lambda: launcher.TmaArg(kb), 20000):.2f} us")
        print(f"torch.empty(part): {per_call(lambda: torch.empty(1 << 20, device='cuda'), 20000):.2f} us")
        print(f"current stream: {per_call(lambda: driver.active.get_current_stream(0), 20000):.2f} us")
        launch = kernel.run.launch
        names = launch.__code__.co_freevars if hasattr(launch, "__code__") else ()
        print("launcher wrapper free variables:", names)
        for title in ("backend hopper_flash", "flash_attn_func"):
            print(f"==== cProfile {title}, 1000 calls, by own time\n" + profile_calls(calls[title])[:6000])


if __name__ == "__main__":
    main()
