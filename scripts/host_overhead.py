"""Host time per call at a tiny size (B=1, H=1, S=128), hopper_flash next to
SDPA's cuDNN backend: wall time of N back-to-back calls divided by N, with the
GPU work far shorter than the host work. Also a cProfile of hopper_flash's call,
and the CPU time of enqueueing calls at B=16 H=16 S=512 (the GPU is slower
there, so the time to issue a burst of calls, short of the launch queue's
depth, is the host's share).
Then the backward alone (``plan_backward.backward`` on the forward's out and
LSE, and SDPA cuDNN's autograd backward), with the backward's fast launch on
and off (``plan_backward.FAST_LAUNCH``).

    PYTHONPATH=. python scripts/host_overhead.py"""
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import hopper_flash
from hopper_flash import plan_backward
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # host_timing, also under python -P
from host_timing import enqueue_us, host_us, profile_calls  # noqa: E402

N = 2000


def calls(batch, seqlen, heads):
    """(hopper_flash call, SDPA cuDNN call, q, k, v) on one set of causal bf16 D=128 inputs."""
    q, k, v = (torch.randn(batch, seqlen, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def ours():
        return hopper_flash.flash_attn_func(q, k, v, causal=True)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    return ours, cudnn, q, k, v


ours, cudnn, q, k, v = calls(1, 128, 1)
qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))


do = torch.randn_like(q)
with torch.no_grad():
    out, lse = hopper_flash.flash_attn_func(q, k, v, causal=True, return_lse=True)


def ours_bwd():
    return plan_backward.backward(do, q, k, v, out, lse, 128 ** -0.5, True)


qg, kg, vg = (x.detach().requires_grad_() for x in (qt, kt, vt))
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    out_cudnn = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
do_t = do.transpose(1, 2)


def cudnn_bwd():
    return torch.autograd.grad(out_cudnn, (qg, kg, vg), do_t, retain_graph=True)


def at_b16_s512():
    ours5, cudnn5 = calls(16, 512, 16)[:2]
    for fn in (ours5, cudnn5):
        for _ in range(20):
            fn()
    return enqueue_us(ours5), enqueue_us(cudnn5)


if __name__ == "__main__":
    print(profile_calls(ours, 500, limit=12))
    print(f"host time per call (B=1, H=1, S=128, causal): hopper_flash {host_us(ours, N):.1f} us, "
          f"SDPA cuDNN {host_us(cudnn, N):.1f} us")
    print(f"enqueue time per call (B=1, H=1, S=128, causal): hopper_flash {enqueue_us(ours):.1f} us, "
          f"SDPA cuDNN {enqueue_us(cudnn):.1f} us")
    ours16, cudnn16 = at_b16_s512()
    print(f"enqueue time per call (B=16, H=16, S=512, causal): hopper_flash {ours16:.1f} us, SDPA cuDNN {cudnn16:.1f} us")
    fast = host_us(ours_bwd, N)
    plan_backward.FAST_LAUNCH = False
    jit = host_us(ours_bwd, N)
    plan_backward.FAST_LAUNCH = fast_default = hopper_flash.plan.FAST_LAUNCH
    print(f"backward host time per call: hopper_flash {fast:.1f} us (fast launch {'on' if fast_default else 'off'}), "
          f"{jit:.1f} us through the JIT; SDPA cuDNN autograd backward {host_us(cudnn_bwd, N):.1f} us")
