"""Does the persistent grid's item order matter for long-key causal items?
Times ``flash_attn_func`` with ``plan`` monkeypatched three ways: the
shipped static deal (items in zig-zag pairs), single items round-robin, and
the dynamic order (sections of heads, every query tile of a head together),
on shapes whose items read many KV tiles (Sq512 Sk32768 and others); each
output is compared with the shipped one.

    PYTHONPATH=. python -P scripts/order_probe.py      (on the GPU machine)"""
import torch, triton
import hopper_flash, hopper_flash.plan as P

def run(shape, causal=True):
    B, Sq, Sk, H, Hk, D = shape
    torch.manual_seed(0)
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Sk, Hk, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Sk, Hk, D, device="cuda", dtype=torch.bfloat16)
    f = lambda: hopper_flash.flash_attn_func(q, k, v, causal=causal)
    ref = REF.setdefault(shape, f().float())
    ms = triton.testing.do_bench(f, warmup=30, rep=200)
    out = f().float()
    flops = 4 * B * H * Sq * Sk * D / 1e12
    return ms, flops / (ms * 1e-3), (out - ref).abs().max().item()

REF = {}
orig_deal, orig_dyn = P.deal, P.choose_dynamic
modes = {
    "shipped": (orig_deal, orig_dyn),
    "single": (lambda items, cfg, device=None: (min(P.sm_count(device), items), 1) if cfg.persistent else orig_deal(items, cfg, device), orig_dyn),
    "dynamic": (orig_deal, lambda items, n_tiles, causal, varlen, sms: items > sms),
}
shapes = [(2, 512, 32768, 32, 8, 128), (2, 512, 32768, 32, 32, 128), (4, 1024, 16384, 32, 8, 128), (4, 8192, 8192, 32, 32, 128)]
for rnd in range(2):
    for name, (d, c) in modes.items():
        P.deal, P.choose_dynamic = d, c
        P._plan_launch.cache_clear(); P._COMPILED.clear()
        for s in shapes:
            ms, tf, err = run(s, causal=True)
            print(f"{rnd} {name:8s} B{s[0]} Sq{s[1]} Sk{s[2]} H{s[3]}/{s[4]}: {ms*1000:8.1f} us {tf:6.1f} TFLOP/s(full count) diff {err:.1e}", flush=True)
