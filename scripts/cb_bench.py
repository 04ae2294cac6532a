"""transformers continuous batching (``generate_batch``) end to end with
"hopper_flash" against "paged|sdpa" ("sdpa" from transformers 5.19, which
dropped the "paged|" names) on the same random Llama-shaped
model (bf16, GQA 32/8, D=128): wall time per batch and tokens per second,
after one warm-up batch each. Random weights leave the logits nearly tied, so
greedy tokens differ between backends (and bf16 runs); each backend's last
batch is checked teacher-forced instead, as the GPU test does: on four
requests, every generated token's float32 logit is within twice the bf16
noise floor of the float32 maximum.

    PYTHONPATH=. python scripts/cb_bench.py [--layers 8] [--requests 64] [--prompt 1024] [--new 64]
"""
import argparse
import time

import torch
import transformers
from packaging.version import Version
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from hopper_flash.integrations import transformers as hft


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    hft.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8,
                                      head_dim=128, max_position_embeddings=32768)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.prompt // 2, args.prompt * 3 // 2, (args.requests,), generator=gen).tolist()
    prompts = [torch.randint(1, 32000, (n,), generator=gen).tolist() for n in lengths]
    gconf = transformers.GenerationConfig(max_new_tokens=args.new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    results = {}
    runs = {}
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}; "
          f"{args.layers} layers, {args.requests} requests of {min(lengths)}..{max(lengths)} prompt tokens, "
          f"{args.new} new")
    sdpa = "paged|sdpa" if Version(transformers.__version__) < Version("5.19.0.dev0") else "sdpa"
    for impl in (sdpa, hft.NAME, sdpa, hft.NAME):
        model.set_attn_implementation(impl)
        cb = ContinuousBatchingConfig(block_size=256, num_blocks=2048, max_batch_tokens=4096)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=gconf, continuous_batching_config=cb)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        tokens = {k: list(r.generated_tokens) for k, r in out.items()}
        print(f"{impl:14s} {dt:7.2f} s, {args.requests * args.new / dt:8.1f} new tokens/s", flush=True)
        runs.setdefault(impl, []).append(tokens)
        results[impl] = tokens
    for impl, (a, b) in runs.items():
        print(f"{impl}: requests with the same tokens in both runs {sum(a[k] == b[k] for k in a)}/{len(a)}")
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        for impl, tokens in results.items():
            worst = 0.0
            for i in range(4):
                prompt, toks = prompts[i], tokens[f"req_{i}"]
                ids = torch.tensor([prompt + toks[:-1]], device="cuda")
                b16 = model(ids).logits.float()[0, len(prompt) - 1:]
                f32 = model.float()(ids).logits[0, len(prompt) - 1:]  # the same weights in float32 (exact round trip)
                model.to(torch.bfloat16)
                noise = (b16 - f32).abs().max().item()
                chosen = f32.gather(1, torch.tensor(toks, device="cuda")[:, None])[:, 0]
                gap = (f32.max(dim=1).values - chosen).max().item()
                worst = max(worst, gap / (2 * noise + 1e-3))
            print(f"{impl}: teacher-forced gap over 2x bf16 noise, worst of 4 requests: {worst:.3f} "
                  f"({'ok' if worst <= 1 else 'FAIL'})")


if __name__ == "__main__":
    main()
