"""Host time per call at a tiny size (B=1, H=1, S=128), hopper_flash next to
SDPA's cuDNN backend: wall time of N back-to-back calls divided by N, with the
GPU work far shorter than the host work. Also a cProfile of hopper_flash's call."""
import cProfile
import pstats
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import hopper_flash

N = 2000
q, k, v = (torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))


def ours():
    return hopper_flash.flash_attn_func(q, k, v, causal=True)


def cudnn():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)


def host_us(fn):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(N):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / N * 1e6)
    return best


if __name__ == "__main__":
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        ours()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    print(f"host time per call (B=1, H=1, S=128, causal): hopper_flash {host_us(ours):.1f} us, "
          f"SDPA cuDNN {host_us(cudnn):.1f} us")
