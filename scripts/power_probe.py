"""SM clock and board power while a kernel runs back to back: is the H200
power-limited under attention, and at what clock does each kernel run?

Each case runs for ``--seconds`` in a loop (no L2 flush, no sync inside)
while ``nvidia-smi`` samples the SM clock, the power draw and the active
clock event (throttle) reasons every 50 ms, after half a second of warm-up. It
prints the achieved TFLOP/s, the median clock and power, and the tensor
cores' busy share implied by them: TFLOP/s over the dense bf16 rate at that
clock (4096 FLOP per cycle per SM, 132 SMs). Cases: hopper_flash and SDPA
cuDNN on D=128 B4 H32 S8192 (causal and not), a bf16 8192^3 matmul, and
FA3 where it is importable (``PYTHONPATH=/tmp/fa3pkg``).

    PYTHONPATH=. python -P scripts/power_probe.py [--seconds 3]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

from hopper_flash import flash_attn_func

SMS, FLOP_PER_CYCLE = 132, 4096


def run_case(name, fn, flops, seconds):
    """Half a second of warm-up, then ``seconds`` of calls enqueued back to
    back between two CUDA events (the rate is the events' GPU time), with
    nvidia-smi sampling over the same window."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        fn()
        torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    e1.record()
    torch.cuda.synchronize()
    smi.terminate()
    out, _ = smi.communicate()
    rows = [r for r in (line.split(", ") for line in out.strip().splitlines()) if len(r) == 3]
    clocks = [float(r[0]) for r in rows]
    power = [float(r[1]) for r in rows]
    reasons = sorted({r[2] for r in rows})
    tflops = flops * calls / (e0.elapsed_time(e1) * 1e-3) / 1e12
    clock = statistics.median(clocks) if clocks else float("nan")
    busy = tflops * 1e12 / (clock * 1e6 * FLOP_PER_CYCLE * SMS)
    print(f"{name:>38} {tflops:8.0f} {clock:8.0f} {statistics.median(power) if power else float('nan'):8.0f} "
          f"{busy:7.0%}  {' '.join(reasons)}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args()
    try:
        from flash_attn_interface import flash_attn_func as fa3
    except ImportError:
        fa3 = None
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'case':>38} {'TFLOP/s':>8} {'SM MHz':>8} {'W':>8} {'tensor':>7}  clock event reasons (bitmask)")
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    run_case("matmul 8192^3 bf16", lambda: torch.matmul(a, b), 2 * n ** 3, args.seconds)
    B, H, S, D = 4, 32, 8192, 128
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    for causal in (True, False):
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        tag = f"D128 B4 H32 S8192 {'causal' if causal else 'full'}"
        run_case(f"hopper_flash {tag}", lambda: flash_attn_func(q, k, v, causal=causal), flops, args.seconds)
        if fa3 is not None:
            run_case(f"fa3 {tag}", lambda: fa3(q, k, v, causal=causal), flops, args.seconds)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            run_case(f"cudnn {tag}", lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), flops,
                     args.seconds)


if __name__ == "__main__":
    main()
