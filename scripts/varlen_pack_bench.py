"""PackGQA in the varlen forward, timed: the same packed (THD) batch through
``dispatch.forward_varlen`` packed and unpacked, next to FA3's
``flash_attn_varlen_func`` (which packs every varlen batch with GQA) when
``flash_attn_interface`` imports. Every timed output is judged against the
float64 reference per sequence first (``reference.judge``).

``packed+split`` is the packed call with split-KV's heuristic
(``num_splits=0``, what ``flash_attn_with_kvcache``'s mixed packed route
and ``flash_attn_varlen_func``'s default; it splits only where host
values show an idle GPU or skewed keys); ``fa3 split0`` is FA3 asked for its own split
heuristic (its ``flash_attn_varlen_func`` defaults to ``num_splits=1``).

Batches: issue 12's (16 sequences, lengths uniform in 512..8192, causal,
GQA 32/8) at head dims 64, 128 and 256, and serving mixes: many one-query
sequences (decodes) over caches of 1000..8000 keys beside one or two
prefill chunks, causal, D=128, GQA 32/8; speculative drafts, a few long
decodes beside a chunk, and skewed keys (64 short decodes beside one
long). For the mixes and drafts the K/V read rate
(every live key's K and V once per KV head) is printed too.

``--groups``: groups that are not powers of two (Llama 4's 40/8,
Qwen2.5-7B's 28/4) instead: decode batches, drafts and a decode mix with a
prefill chunk, where ``packed`` packs from a packed copy of q
(``plan.pack_layout``, ``plan.packed_q``) and ``default`` is the call's
default (``pack_gqa=None, num_splits=0``: packed where the decodes' K/V
reads outweigh the copy, ``plan.choose_varlen_view``). Running them on
another tree (``PYTHONPATH=.wt/main``) times that tree's packing.

``--prefill-groups``: prefill batches alone (16 sequences of 512..8192
tokens) at groups of 5 and 7, head dims 64 and 128, causal and not: whether
packing them pays without any decode beside them.

``--skew``: skewed keys only (the long sequence last and first, random
short lengths, drafts beside a long decode).

    PYTHONPATH=.:/tmp/fa3pkg python scripts/varlen_pack_bench.py [--quick | --groups | --prefill-groups | --skew]
"""
import argparse
import importlib

import torch
import triton

from hopper_flash import dispatch
from hopper_flash.reference import judge, varlen_baseline, varlen_reference


def cu(lengths):
    return torch.tensor([0] + list(lengths), device="cuda").cumsum(0).to(torch.int32)


def batches(quick):
    gen = torch.Generator().manual_seed(0)
    prefill = torch.randint(512, 8193, (16,), generator=gen).tolist()
    out = []
    for d, h, hkv in ([(128, 32, 8)] if quick else [(64, 32, 8), (128, 32, 8), (256, 16, 4)]):
        out.append((f"issue12 B16 512..8192 H{h}/{hkv} D{d}", prefill, prefill, h, hkv, d))
    for n_dec, chunks in ((64, [512]), (128, [256, 1024]), (32, [2048])):
        dec_k = torch.randint(1000, 8001, (n_dec,), generator=gen).tolist()
        lq = [1] * n_dec + chunks
        lk = dec_k + [c + 1024 for c in chunks]
        out.append((f"mix {n_dec} decodes + chunks {chunks} H32/8 D128", lq, lk, 32, 8, 128))
    # Split-KV's cases, where the heuristic (host values only) sees an idle
    # GPU: speculative decoding's ragged drafts (1..4 queries each,
    # max_seqlen_q 4) over long caches, and a few long decodes beside a
    # 256-query chunk, which max_seqlen_q alone (FA3's rule) takes for four
    # chunks but q's 259 rows bound at 96 live items.
    drafts = torch.randint(1, 5, (8,), generator=gen).tolist()
    out.append(("drafts 8 x 1..4 queries over 16k..64k H32/8 D128", drafts,
                torch.randint(16384, 65537, (8,), generator=gen).tolist(), 32, 8, 128))
    out.append(("mix 3 long decodes + chunk [256] H32/8 D128", [1, 1, 1, 256], [60000, 45000, 30000, 1280], 32, 8,
                128))
    # Skewed keys (plan.varlen_skew_splits): 64 short decodes beside one
    # long one fill the SMs with items, so no rule on max_seqlen_q and the
    # item count splits, while the long decode's items read its keys alone.
    out.append(("skewed 64 decodes over 1024 keys + 1 over 65536 H32/8 D128", [1] * 65, [1024] * 64 + [65536], 32,
                8, 128))
    return out


def skew_batches():
    """Skewed keys (``--skew``): short decodes beside one long one, the
    long one last or first (plan.varlen_skew_splits; kernels/split_table.py)."""
    gen = torch.Generator().manual_seed(4)
    out = []
    for n, short, long in ((64, 1024, 65536), (32, 2048, 32768), (128, 512, 131072), (512, 512, 131072),
                           (1024, 256, 65536)):
        out.append((f"skewed {n} decodes over {short} keys + 1 over {long} H32/8 D128", [1] * (n + 1),
                    [short] * n + [long], 32, 8, 128))
    out.append(("skewed, the long one first: 1 over 65536 + 64 over 1024 H32/8 D128", [1] * 65, [65536] + [1024] * 64,
                32, 8, 128))
    lk = torch.randint(500, 4000, (96,), generator=gen).tolist() + [100000]
    out.append(("skewed 96 decodes over 500..4000 keys + 1 over 100000 H32/8 D128", [1] * 97, lk, 32, 8, 128))
    drafts = torch.randint(1, 5, (48,), generator=gen).tolist() + [1]
    out.append(("skewed 48 drafts of 1..4 over 1000..3000 + 1 over 60000 H32/8 D128", drafts,
                torch.randint(1000, 3000, (48,), generator=gen).tolist() + [60000], 32, 8, 128))
    return out


def group_batches():
    """Decode batches, drafts and a mix at groups of 5 and 7 (``--groups``)."""
    gen = torch.Generator().manual_seed(2)
    out = []
    for h, hkv in ((40, 8), (28, 4)):
        dec_k = torch.randint(1000, 8001, (64,), generator=gen).tolist()
        out.append((f"decodes 64 over 1000..8000 H{h}/{hkv} D128", [1] * 64, dec_k, h, hkv, 128))
        drafts = torch.randint(1, 5, (8,), generator=gen).tolist()
        out.append((f"drafts 8 x 1..4 queries over 16k..64k H{h}/{hkv} D128", drafts,
                    torch.randint(16384, 65537, (8,), generator=gen).tolist(), h, hkv, 128))
        out.append((f"mix 64 decodes + chunk [512] H{h}/{hkv} D128", [1] * 64 + [512], dec_k + [1536], h, hkv, 128))
        # Decodes beside a prefill chunk: the default rule weighs the decodes' K/V reads against the copy of q.
        for n_dec, chunk in ((64, 2048), (16, 4096), (64, 8192), (256, 8192)):
            lk = torch.randint(1000, 8001, (n_dec,), generator=gen).tolist() + [chunk + 1024]
            out.append((f"mix {n_dec} decodes + chunk [{chunk}] H{h}/{hkv} D128", [1] * n_dec + [chunk], lk, h, hkv,
                        128))
        prefill = torch.randint(512, 8193, (16,), generator=gen).tolist()
        out.append((f"prefill B16 512..8192 H{h}/{hkv} D128", prefill, prefill, h, hkv, 128))
    return out


def prefill_group_batches():
    """Prefill batches alone at groups of 5 and 7 (``--prefill-groups``), the
    last field whether causal."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for d in (128, 64):
        for h, hkv in ((40, 8), (28, 4)):
            lens = torch.randint(512, 8193, (16,), generator=gen).tolist()
            for causal in (True, False):
                out.append((f"prefill B16 512..8192 H{h}/{hkv} D{d} {'causal' if causal else 'full'}", lens, lens,
                            h, hkv, d, causal))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--groups", action="store_true")
    ap.add_argument("--skew", action="store_true")
    ap.add_argument("--prefill-groups", action="store_true")
    args = ap.parse_args()
    try:
        fa3 = importlib.import_module("flash_attn_interface").flash_attn_varlen_func
    except Exception:
        fa3 = None
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}; {dispatch.__file__}")
    rows = (group_batches() if args.groups else skew_batches() if args.skew
            else prefill_group_batches() if args.prefill_groups else batches(args.quick))
    for label, lq, lk, h, hkv, d, *flags in rows:
        causal = flags[0] if flags else True
        gen = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(sum(lq), h, d, generator=gen, device="cuda").to(torch.bfloat16)
        k = torch.randn(sum(lk), hkv, d, generator=gen, device="cuda").to(torch.bfloat16)
        v = torch.randn(sum(lk), hkv, d, generator=gen, device="cuda").to(torch.bfloat16)
        cq, ck = cu(lq), cu(lk)
        mq, mk = max(lq), max(lk)
        fns = {
            "packed": lambda: dispatch.forward_varlen(q, k, v, cq, ck, mq, mk, None, None, None, causal, False,
                                                      pack_gqa=True)[0],
            "unpacked": lambda: dispatch.forward_varlen(q, k, v, cq, ck, mq, mk, None, None, None, causal, False,
                                                        pack_gqa=False)[0],
            # PackGQA and split-KV as the KV cache's mixed route runs them (num_splits=0: the heuristic).
            "packed+split": lambda: dispatch.forward_varlen(q, k, v, cq, ck, mq, mk, None, None, None, causal, False,
                                                            pack_gqa=True, num_splits=0)[0],
        }
        if args.groups or args.prefill_groups:
            fns["default"] = lambda: dispatch.forward_varlen(q, k, v, cq, ck, mq, mk, None, None, None, causal, False,
                                                             pack_gqa=None, num_splits=0)[0]
        if fa3 is not None:
            def fa3_fn():
                o = fa3(q, k, v, cq, ck, mq, mk, causal=causal)
                return o[0] if isinstance(o, tuple) else o
            fns["fa3"] = fa3_fn
            if not label.startswith("issue12"):
                def fa3_split_fn():  # FA3's own split heuristic (its default for this call is num_splits=1)
                    o = fa3(q, k, v, cq, ck, mq, mk, causal=causal, num_splits=0)
                    return o[0] if isinstance(o, tuple) else o
                fns["fa3 split0"] = fa3_split_fn
        ref, _ = varlen_reference(q, k, v, cq, ck, causal=causal)
        base = varlen_baseline(q, k, v, cq, ck, causal=causal)
        kv_bytes = 2 * sum(lk) * hkv * d * 2
        times = {}
        for name, fn in fns.items():
            verdict = judge(name, fn(), ref, base)
            if not verdict:
                raise SystemExit(f"{label}: {verdict.message}")
            times[name] = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
        fa = times.get("fa3")
        parts = []
        for name, t in times.items():
            extra = f" {kv_bytes / (t * 1e-3) / 1e12:.2f} TB/s" if not label.startswith("issue12") else ""
            vs = f" {fa / t:.3f}x fa3" if fa else ""
            parts.append(f"{name} {t * 1e3:.1f} us{extra}{vs}")
        print(f"{label}: " + "; ".join(parts) + f"; packed/unpacked speed {times['unpacked'] / times['packed']:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
