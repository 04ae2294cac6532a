"""The backward's deterministic mode against its default, timed in one
process (D=128 causal bf16, B=4 H=32), with each mode's gradients checked:
the deterministic ones bitwise equal over two runs, both within the tests'
judge of the float64 reference (sampled rows) at S=2048.

    PYTHONPATH=. python -P scripts/bwd_deterministic_timing.py [--rep-ms 100]
"""
from __future__ import annotations

import argparse

import torch
import triton

from hopper_flash import flash_attn_func
from hopper_flash.reference import check_attention_grads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rep-ms", type=float, default=100)
    args = p.parse_args()
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'row':>18} {'mode':>14} {'ms':>8} {'TFLOP/s':>8}  checks")
    for S in (2048, 8192):
        gen = torch.Generator(device="cuda").manual_seed(S)
        q, k, v = (torch.randn(4, S, 32, 128, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
                   for _ in range(3))
        dout = torch.randn(4, S, 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
        flops = 2.5 * 4 * 4 * 32 * S * S * 128 / 2
        for det in (False, True):
            out = flash_attn_func(q, k, v, causal=True, deterministic=det)

            def grads():
                return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

            g1, g2 = grads(), grads()
            # The float64 reference of S=8192's gradients does not fit beside them: judged at 2048 only.
            notes = [] if S > 2048 else [
                x.message for x in check_attention_grads(g1, q, k, v, dout, causal=True,
                                                         rows=torch.arange(0, S, 97, device="cuda"),
                                                         key_rows=torch.arange(0, S, 89, device="cuda")) if not x]
            if det and not all(torch.equal(a, b) for a, b in zip(g1, g2)):
                notes.append("deterministic gradients differ between two runs")
            ms = triton.testing.do_bench(grads, warmup=30, rep=args.rep_ms)
            mode = "deterministic" if det else "default"
            print(f"{f'B4 H32 S{S}':>18} {mode:>14} {ms:8.3f} {flops / ms / 1e9:8.0f}  "
                  f"{'; '.join(notes) if notes else 'ok'}", flush=True)


if __name__ == "__main__":
    main()
