"""Benchmark command for hopper_flash (``hopper-flash bench``).

Layout: configs (shapes, FLOPs), backends (implementations compared),
timing (do_bench, matmul rate), reference (float32 check), runner (the loop),
results (records, JSON/CSV), report (rich table), plot (matplotlib),
environment (Hopper check, header facts), cli (argparse).
"""
