"""The transformers backend's decode call inside a model step, on the CPU
machine: a small Llama (head dim 128, GQA 4/1) decoding from a DynamicCache
on the CPU, with ``host_standin.py``'s stubs for the CUDA pieces (device
checks, stream, SM count, the C launch function, the TMA encoder), each
attention call's host time taken inside the step.

Inside a model step the call runs cold (the layer's other code between two
calls evicts its code and objects from the CPU caches) and meets new K/V
every step (a growing cache is a new tensor): on the H200's host the
twenty-third session measured it at about 3x its time in a tight loop
(``scripts/generate_bench.py --time-calls``). This reproduces that on the
CPU, so host-path changes can be judged where it matters without device
time. Beside ``hopper_flash``:

* ``floor``: what any such call must do (three transposes, the output and
  partials allocated, two launches of the stub, their addresses): the cost
  a Python launch path cannot go under;
* ``launch_only``: the floor plus ``plan._launch_forward_direct`` on the
  prepared plan (descriptors, arguments, the combine), the full path's
  launch: what the prepared call's templates save is this minus
  ``hopper_flash``'s launch.

    python scripts/standin_model.py [LAYERS] [--steps N]

Prints, per backend and round, the step time and the median call time
(after five warm-up steps). Backends take turns, two rounds. On the
two-core CPU machine the call's median moved between 70 and 91 us across
runs of the same code: it resolves changes of 10 us or more (the launch
path against the floor, a whole layer skipped), not single micro-cuts.
"""
import argparse
import copy
import os
import runpy
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("layers", type=int, nargs="?", default=8)
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    # host_standin's stubs (it also times one call in a loop, printed first: the tight-loop figure).
    argv, sys.argv = sys.argv, [os.path.join(HERE, "host_standin.py"), "32768"]
    stand_in = runpy.run_path(os.path.join(HERE, "host_standin.py"))
    sys.argv = argv
    hft, c_launch = stand_in["hft"], stand_in["c_launch"]

    import transformers
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hopper_flash import plan

    hft.register()

    def transposed(query, key, value):
        return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)

    def floor(module, query, key, value, attention_mask, **kwargs):
        q, k, v = transposed(query, key, value)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        part = q.new_empty(1 << 16, dtype=torch.float32)
        ptrs = [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), part.data_ptr()]
        c_launch(*ptrs, *range(40))
        c_launch(*ptrs, *range(10))
        return out, None

    def launch_only(module, query, key, value, attention_mask, scaling=None, **kwargs):
        q, k, v = transposed(query, key, value)
        prepared = list(plan._PREPARED.values())[-1]  # hopper_flash's, from its round before
        launch = prepared.launches[-(-k.shape[1] // prepared.block_n)]
        lp, kernel = launch.lp, launch.kernel
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        plan._launch_forward_direct(kernel, lp, q, k, v, out, None, scaling, None, None, None, k.shape[1], 0)
        return out, None

    for name, fn in (("floor", floor), ("launch_only", launch_only)):
        transformers.AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, hft.padding_mask)
    impls = ("hopper_flash", "floor", "launch_only")
    times = {impl: [] for impl in impls}

    def timing(impl, fn):
        def call(*a, **kw):
            t0 = time.perf_counter()
            result = fn(*a, **kw)
            times[impl].append(time.perf_counter() - t0)
            return result
        return call

    for impl in impls:
        ALL_ATTENTION_FUNCTIONS._global_mapping[impl] = timing(impl, ALL_ATTENTION_FUNCTIONS[impl])

    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_attention_heads=4,
                                   num_key_value_heads=1, num_hidden_layers=args.layers, vocab_size=1000,
                                   max_position_embeddings=1 << 16)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.inference_mode():
        model.set_attn_implementation("sdpa")
        cache = transformers.DynamicCache(config=model.config)
        model(input_ids=torch.randint(0, 1000, (1, 2048)), past_key_values=cache, use_cache=True)
        print(f"{args.layers} layers, {args.steps} steps from 2048 keys; call = median host time of one "
              "attention call inside the step")
        for _ in range(2):
            for impl in impls:
                steps_cache = copy.deepcopy(cache)
                model.set_attn_implementation(impl)
                times[impl].clear()
                t0 = time.perf_counter()
                for i in range(args.steps):
                    model(input_ids=torch.tensor([[i + 1]]), past_key_values=steps_cache, use_cache=True)
                step_ms = (time.perf_counter() - t0) / args.steps * 1e3
                calls = sorted(times[impl][5 * args.layers:])
                print(f"{impl:14s} step {step_ms:7.3f} ms   call {calls[len(calls) // 2] * 1e6:6.1f} us")


if __name__ == "__main__":
    main()
