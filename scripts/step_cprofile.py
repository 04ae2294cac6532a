"""Where a decode step's host time differs between two transformers
attention backends: cProfile of the same steps of the Llama-shaped model of
``generate_bench.py``, per backend, and the functions whose own time per
step differs most.

    PYTHONPATH=. python -P scripts/step_cprofile.py [--context 8192] [--steps 20]   (GPU machine)"""
import argparse
import copy
import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate_bench import build_model  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--backends", nargs=2, default=["sdpa", "hopper_flash"])
    args = p.parse_args()
    import transformers
    from hopper_flash.integrations import transformers as hft

    hft.register()
    model = build_model(4, "cuda", torch.bfloat16)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.context), device="cuda")
    tok = prompt[:, -1:]
    stats = {}
    with torch.inference_mode():
        model.set_attn_implementation("sdpa")
        cache = transformers.DynamicCache(config=model.config)
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        for impl in args.backends:
            model.set_attn_implementation(impl)
            # The same key lengths once unprofiled first: SDPA's cuDNN builds
            # a plan per new key length (~45 ms), which a replay finds cached.
            c = copy.deepcopy(cache)
            for _ in range(args.steps):
                model(input_ids=tok, past_key_values=c, use_cache=True)
            c = copy.deepcopy(cache)
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                model(input_ids=tok, past_key_values=c, use_cache=True)
            torch.cuda.synchronize()
            prof.disable()
            st = pstats.Stats(prof)
            stats[impl] = {f"{k[0].split('site-packages/')[-1]}:{k[1]}({k[2]})": (v[1], v[2], v[3])
                           for k, v in st.stats.items()}
            total = sum(v[1] for v in stats[impl].values())
            print(f"==== {impl}: {total / args.steps * 1e6:.0f} us own time per step (cProfile)")
            st.sort_stats("cumulative").print_stats(25)
    a, b = (stats[i] for i in args.backends)
    diff = {k: (b.get(k, (0, 0, 0))[1] - a.get(k, (0, 0, 0))[1]) / args.steps * 1e6 for k in set(a) | set(b)}
    print(f"==== own time per step, {args.backends[1]} minus {args.backends[0]} (us), largest first")
    for k, d in sorted(diff.items(), key=lambda x: -abs(x[1]))[:30]:
        calls_b, calls_a = b.get(k, (0,))[0] / args.steps, a.get(k, (0,))[0] / args.steps
        print(f"{d:+9.1f}  calls/step {calls_b:6.1f} vs {calls_a:6.1f}  {k}")


if __name__ == "__main__":
    main()
