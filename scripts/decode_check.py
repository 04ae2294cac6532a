"""Decode / KV-cache check on one GPU call: a correctness matrix (run in
parallel worker processes so the kernel compiles overlap), then timings
against SDPA, a short table last.

    python scripts/decode_check.py            # everything
    python scripts/decode_check.py --part 0 --of 6   # one worker's share
"""
import argparse
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hopper_flash  # noqa: E402
from hopper_flash.reference import check_kvcache  # noqa: E402

DEV = "cuda"


def rnd(*shape, dtype=torch.bfloat16, gen=None):
    return torch.randn(*shape, device=DEV, generator=gen).to(dtype)


RESULTS = []


def report(name, ok, detail):
    RESULTS.append((name, ok))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def check_close(name, out, q, kc, vc, lens, causal, scale, rows=None, lse=None):
    """Each batch row against the float64 reference over its live keys
    (hopper_flash.reference.check_kvcache, the tests' judge)."""
    verdicts = check_kvcache(out, q, kc, vc, lens, causal=causal, rows=rows, softmax_scale=scale, lse=lse)
    bad = [v.message for v in verdicts if not v]
    report(name, not bad, "; ".join(bad) or f"{len(verdicts)} verdicts ok")


def make_cache(B, cap, Hkv, D, lens, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    kc = rnd(B, cap, Hkv, D, dtype=dtype, gen=gen)
    vc = rnd(B, cap, Hkv, D, dtype=dtype, gen=gen)
    for b, L in enumerate(lens):  # the tail past the live length is NaN
        kc[b, L:] = float("nan")
        vc[b, L:] = float("nan")
    return kc, vc


def case_kvcache(Sq, lens, H=32, Hkv=8, D=128, causal=True, cap=None, num_splits=0, pack_gqa=None,
                 dtype=torch.bfloat16, seed=1):
    B = len(lens)
    cap = cap or max(lens) + 77
    kc, vc = make_cache(B, cap, Hkv, D, lens, dtype, seed)
    q = rnd(B, Sq, H, D, dtype=dtype, gen=torch.Generator(device=DEV).manual_seed(seed + 1))
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out, lse = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=causal,
                                                    num_splits=num_splits, pack_gqa=pack_gqa,
                                                    return_softmax_lse=True)
    check_close(f"kvcache Sq={Sq} lens={lens} H={H}/{Hkv} D={D} causal={causal} splits={num_splits} "
                f"pack={pack_gqa} {str(dtype)[6:]}", out, q, kc, vc, lens, causal, D ** -0.5, lse=lse)


def case_func(B, Sq, Sk, H, Hkv, D, causal):
    gen = torch.Generator(device=DEV).manual_seed(Sq * 7 + Sk)
    q, k, v = rnd(B, Sq, H, D, gen=gen), rnd(B, Sk, Hkv, D, gen=gen), rnd(B, Sk, Hkv, D, gen=gen)
    out, lse = hopper_flash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    check_close(f"func B={B} Sq={Sq} Sk={Sk} H={H}/{Hkv} D={D} causal={causal}", out, q, k, v, [Sk] * B,
                causal, D ** -0.5, lse=lse)


def case_paged(page_size, lens=(1, 700, 3001), H=32, Hkv=8, D=128, Sq=1):
    B = len(lens)
    cap = max(lens) + 300
    kc, vc = make_cache(B, cap, Hkv, D, lens, seed=page_size)
    q = rnd(B, Sq, H, D, gen=torch.Generator(device=DEV).manual_seed(3))
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    max_pages = -(-cap // page_size)
    n_pages = B * max_pages + 5
    perm = torch.randperm(n_pages, device=DEV)[: B * max_pages].view(B, max_pages).to(torch.int32)
    kp = torch.full((n_pages, page_size, Hkv, D), float("nan"), device=DEV, dtype=kc.dtype)
    vp = kp.clone()
    for b in range(B):
        for p in range(max_pages):
            lo, hi = p * page_size, min((p + 1) * page_size, cap)
            if lo < cap:
                kp[perm[b, p], : hi - lo] = kc[b, lo:hi]
                vp[perm[b, p], : hi - lo] = vc[b, lo:hi]
    # Page-table entries past a row's live pages are garbage.
    pt = perm.clone()
    for b, L in enumerate(lens):
        pt[b, -(-L // page_size) + 1:] = 10 ** 6
    out = hopper_flash.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=cs, page_table=pt, causal=True)
    contig = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True)
    check_close(f"paged P={page_size}", out, q, kc, vc, lens, True, D ** -0.5)
    if page_size >= 128:
        report(f"paged P={page_size} == contiguous bitwise", torch.equal(out, contig), "")


def case_append(paged=False, Snew=3, lens=(0, 500, 1300), H=32, Hkv=8, D=128):
    B = len(lens)
    cap = 2048
    kc, vc = make_cache(B, cap, Hkv, D, lens, seed=11)
    gen = torch.Generator(device=DEV).manual_seed(12)
    q = rnd(B, Snew, H, D, gen=gen)
    kn, vn = rnd(B, Snew, Hkv, D, gen=gen), rnd(B, Snew, Hkv, D, gen=gen)
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    kh, vh = kc.clone(), vc.clone()
    for b, L in enumerate(lens):
        kh[b, L:L + Snew] = kn[b]
        vh[b, L:L + Snew] = vn[b]
    if paged:
        P = 128
        mp = cap // P
        perm = torch.randperm(B * mp, device=DEV).view(B, mp).to(torch.int32)
        kp = torch.empty(B * mp, P, Hkv, D, device=DEV, dtype=kc.dtype)
        vp = torch.empty_like(kp)
        for b in range(B):
            for p in range(mp):
                kp[perm[b, p]] = kc[b, p * P:(p + 1) * P]
                vp[perm[b, p]] = vc[b, p * P:(p + 1) * P]
        out = hopper_flash.flash_attn_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=cs, block_table=perm,
                                                   causal=True)
        back = torch.stack([kp[perm[b].long()].reshape(cap, Hkv, D) for b in range(B)])
        same_cache = all(torch.equal(back[b, :L + Snew], kh[b, :L + Snew]) for b, L in enumerate(lens))
    else:
        out = hopper_flash.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=cs, causal=True)
        same_cache = all(torch.equal(kc[b, :L + Snew], kh[b, :L + Snew]) and
                         torch.equal(vc[b, :L + Snew], vh[b, :L + Snew]) for b, L in enumerate(lens))
    byhand = hopper_flash.flash_attn_with_kvcache(q, kh, vh, cache_seqlens=cs + Snew, causal=True)
    report(f"append paged={paged}: cache written", same_cache, "")
    report(f"append paged={paged}: out == by-hand append", torch.equal(out, byhand),
           f"max diff {(out.float() - byhand.float()).abs().max().item():.2e}")
    check_close(f"append paged={paged} vs ref", out, q, kh, vh, [L + Snew for L in lens], True, D ** -0.5)


def case_batch_idx():
    lens = [900, 5, 2000]
    rows = [4, 0, 2]
    kc, vc = make_cache(5, 2100, 8, 128, [2000] * 5, seed=21)
    for r, L in zip(rows, lens):
        kc[r, L:] = float("nan")
        vc[r, L:] = float("nan")
    q = rnd(3, 2, 32, 128, gen=torch.Generator(device=DEV).manual_seed(22))
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    bi = torch.tensor(rows, dtype=torch.int32, device=DEV)
    out = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, cache_batch_idx=bi, causal=True)
    check_close("cache_batch_idx", out, q, kc, vc, lens, True, 128 ** -0.5, rows=rows)


def case_graph():
    B, cap = 4, 8192
    kc, vc = make_cache(B, cap, 8, 128, [cap] * B, seed=31)
    q = rnd(B, 1, 32, 128, gen=torch.Generator(device=DEV).manual_seed(32))
    cs = torch.tensor([100, 200, 300, 400], dtype=torch.int32, device=DEV)
    fn = lambda: hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    ok = True
    for lens in ([1, 8191, 4096, 77], [5000, 3, 129, 8192], [0, 1, 2, 3]):
        cs.copy_(torch.tensor(lens, dtype=torch.int32))
        g.replay()
        eager = fn()
        torch.cuda.synchronize()
        ok = ok and torch.equal(out, eager)
        ok = ok and all(check_kvcache(out, q, kc, vc, lens, causal=True))
    report("CUDA graph replay, changing cache_seqlens", ok, "")


def case_compile():
    B, cap = 2, 1024
    kc, vc = make_cache(B, cap, 8, 128, [cap] * B, seed=41)
    q = rnd(B, 1, 32, 128, gen=torch.Generator(device=DEV).manual_seed(42))
    kn, vn = rnd(B, 1, 8, 128), rnd(B, 1, 8, 128)
    cs = torch.tensor([10, 600], dtype=torch.int32, device=DEV)
    k1, v1 = kc.clone(), vc.clone()

    def step(q, kc, vc, kn, vn, cs):
        return hopper_flash.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=cs, causal=True)

    eager = step(q, k1, v1, kn, vn, cs)
    comp = torch.compile(step, fullgraph=True)(q, kc, vc, kn, vn, cs)
    report("torch.compile (append mutates the cache)", torch.equal(eager, comp) and torch.equal(k1, kc), "")


def cases():
    yield case_func, (2, 1000, 1000, 4, 4, 128, True)
    yield case_func, (2, 513, 513, 32, 8, 128, True)
    yield case_func, (1, 300, 300, 4, 4, 64, False)
    yield case_func, (2, 257, 257, 4, 4, 256, True)
    yield case_func, (1, 1, 4099, 32, 8, 128, True)
    yield case_func, (2, 3, 1000, 8, 8, 128, False)
    yield case_func, (3, 128, 8192, 32, 8, 128, True)
    for Sq in (1, 2, 4, 16, 128):
        yield case_kvcache, (Sq, [1, 777, 4099])
    yield case_kvcache, (1, [0, 5, 129, 65536])
    yield case_kvcache, (1, [3000, 17], 8, 8)
    yield case_kvcache, (1, [3000, 17], 16, 2)
    yield case_kvcache, (4, [3000, 1000], 32, 8, 128, True, None, 3, False)
    yield case_kvcache, (4, [3000, 1000], 32, 8, 128, False, None, 1, True)
    yield case_kvcache, (1, [2000, 9], 32, 8, 64)
    yield case_kvcache, (2, [2000, 9], 32, 8, 256)
    yield case_kvcache, (1, [2000, 9], 32, 8, 128, True, None, 0, None, torch.float16)
    for P in (1, 16, 64, 128, 256):
        yield case_paged, (P,)
    yield case_append, (False,)
    yield case_append, (True,)
    yield case_batch_idx, ()
    yield case_graph, ()
    yield case_compile, ()


def run_part(part, of):
    for n, (fn, args) in enumerate(cases()):
        if n % of != part:
            continue
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            report(f"{fn.__name__}{args}", False, f"{type(e).__name__}: {str(e)[:300]}")
        torch.cuda.synchronize()


def bench():
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for B, Sq, Sk in [(8, 1, 4096), (8, 1, 16384), (1, 1, 65536), (64, 1, 2048), (8, 4, 8192), (4, 128, 8192),
                      (2, 512, 32768)]:
        H, Hkv, D = 32, 8, 128
        q = torch.randn(B, Sq, H, D, device=DEV, dtype=torch.bfloat16)
        kc = torch.randn(B, Sk, Hkv, D, device=DEV, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        cs = torch.full((B,), Sk, dtype=torch.int32, device=DEV)
        f_cache = lambda: hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True)  # noqa
        f_func = lambda: hopper_flash.flash_attn_func(q, kc, vc, causal=True)  # noqa: E731
        t_cache = triton.testing.do_bench(f_cache, warmup=50, rep=200)
        t_graph = triton.testing.do_bench_cudagraph(f_cache, rep=200)
        t_func = triton.testing.do_bench(f_func, warmup=50, rep=200)
        t_sdpa, which = float("nan"), "-"
        if Sq == 1:
            qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
            for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                             ("eff", SDPBackend.EFFICIENT_ATTENTION)):
                try:
                    with sdpa_kernel(be):
                        fs = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)  # noqa
                        fs()
                        t_sdpa, which = triton.testing.do_bench(fs, warmup=50, rep=200), name
                    break
                except Exception:  # noqa: BLE001
                    continue
        tb = 2 * B * Hkv * Sk * D * 2 / 1e12
        rows.append((B, Sq, Sk, t_cache * 1e3, t_graph * 1e3, t_func * 1e3, t_sdpa * 1e3, which,
                     tb / (t_cache * 1e-3), tb / (t_graph * 1e-3)))
    # Prefill regression: B4 H32 S8192 causal D128 against cuDNN.
    q, k, v = (torch.randn(4, 8192, 32, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    t_pf = triton.testing.do_bench(lambda: hopper_flash.flash_attn_func(q, k, v, causal=True), warmup=25, rep=200)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        t_cd = triton.testing.do_bench(
            lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True), warmup=25, rep=200)
    fl = 2 * 4 * 32 * 8192 ** 2 * 128 / 1e12
    print("\n| B | Sq | Sk | kvcache us | kvcache graph us | func us | SDPA us | K/V TB/s (plain / graph) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.0f} | {r[4]:.0f} | {r[5]:.0f} | {r[6]:.0f} ({r[7]}) | "
              f"{r[8]:.2f} / {r[9]:.2f} |")
    print(f"prefill B4 H32 S8192 causal D128: ours {fl / (t_pf * 1e-3):.0f} TFLOP/s, cuDNN {fl / (t_cd * 1e-3):.0f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", type=int)
    ap.add_argument("--of", type=int, default=6)
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--bench-only", action="store_true")
    ap.add_argument("--bench-timeout", type=float, default=150)
    args = ap.parse_args()
    if args.bench_only:
        bench()
        return
    if args.part is not None:
        run_part(args.part, args.of)
        return
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--part", str(i), "--of", str(args.of)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(args.of)]
    for i, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(1, args.timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += f"\nFAIL part {i}: TIMEOUT (hang?)\n"
        print(f"--- part {i} (rc {p.returncode})\n" + "\n".join(
            l for l in out.splitlines() if l.startswith(("PASS", "FAIL", "Traceback", "  File", "Error")) or
            "Error" in l)[-4000:], flush=True)
    print(f"correctness matrix: {time.time() - t0:.0f}s", flush=True)
    if not args.no_bench:
        try:
            subprocess.run([sys.executable, __file__, "--bench-only"], timeout=args.bench_timeout)
        except subprocess.TimeoutExpired:
            print("FAIL bench: TIMEOUT")


if __name__ == "__main__":
    main()
