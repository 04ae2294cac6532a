"""Does racecheck report hazards on a warp-specialized Gluon kernel that shares nothing?

The forward kernel's racecheck hazards all sit in the shared-memory slots that
Triton's lowering of ``gl.warp_specialize`` uses to start its worker warps
(docs/sanitizer.md). To tell the tool's view of that start-up apart from the
kernel's own data path, this script launches tiny kernels whose partitions
touch no shared memory of their own: each partition writes its own slice of a
global output, nothing else. Any hazard racecheck reports on them comes from
the start-up code Triton generates, not from attention.

Variants differ only in the worker partitions, since the hazards depend on
which warps run which start-up path:

  w1      default 4 warps + one 1-warp worker (3 padding warps sit idle)
  w4      default 4 warps + one 4-warp worker (no padding warps)
  w4_1    default 4 warps + workers of 4 and 1 warps (the forward kernel's shape)
  w4_4    default 4 warps + workers of 4 and 4 warps
  w4_none default 4 warps + one 4-warp worker that takes no arguments

Two hand-written PTX kernels (loaded through the driver, no Triton) then ask
the question underneath: thread 0 writes a shared word, all 128 threads meet
at ``bar.sync 1``, warps 1-3 read the word. The barrier orders the write
before the reads in both; they differ only in where the threads meet.

  ptx_same_pc   every thread reaches the same bar.sync instruction
  ptx_split_pc  warp 0 and warps 1-3 reach bar.sync 1 at different
                instructions, as Triton's start-up code does

    PYTHONPATH=. python scripts/racecheck_probe.py [PROBE ...] [--repeat N]
    compute-sanitizer --tool racecheck python scripts/racecheck_probe.py ws_w4_1
    OUT=out bash scripts/racecheck_probe.sh     # each probe under racecheck

Each variant checks its output and prints one line; exits 1 on a wrong output.
"""
from __future__ import annotations

import argparse
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

SLICE = gl.constexpr(128)  # elements each partition writes


@gluon.jit
def _fill(out, part: gl.constexpr, NW: gl.constexpr):
    # Partition `part` writes `part + 1` into out[part * SLICE : (part + 1) * SLICE].
    layout: gl.constexpr = gl.BlockedLayout([SLICE // (32 * NW)], [32], [NW], [0])
    offs = part * SLICE + gl.arange(0, SLICE, layout=layout)
    gl.store(out + offs, gl.full([SLICE], part + 1, gl.float32, layout))


@gluon.jit
def _idle():
    pass


@gluon.jit
def probe_w1(out):
    gl.warp_specialize([(_fill, (out, 0, 4)), (_fill, (out, 1, 1))], [1], [24])


@gluon.jit
def probe_w4(out):
    gl.warp_specialize([(_fill, (out, 0, 4)), (_fill, (out, 1, 4))], [4], [240])


@gluon.jit
def probe_w4_1(out):
    gl.warp_specialize([(_fill, (out, 0, 4)), (_fill, (out, 1, 4)), (_fill, (out, 2, 1))], [4, 1], [240, 24])


@gluon.jit
def probe_w4_4(out):
    gl.warp_specialize([(_fill, (out, 0, 4)), (_fill, (out, 1, 4)), (_fill, (out, 2, 4))], [4, 4], [200, 24])


@gluon.jit
def probe_w4_none(out):
    gl.warp_specialize([(_fill, (out, 0, 4)), (_idle, ())], [4], [240])


PTX_HEAD = """
.version 8.0
.target sm_90a
.address_size 64

.shared .align 4 .b32 slot;
"""

def _entry(name: str, body: str) -> str:
    """A kernel over one int32 output per thread. Around ``body``: %r1 is the
    thread id, %r2 its warp; the body leaves the thread's result in %r3."""
    return f"""
.visible .entry {name}(.param .u64 out_ptr)
{{
  .reg .pred %p<3>;
  .reg .b32 %r<6>;
  .reg .b64 %rd<4>;
  ld.param.u64 %rd1, [out_ptr];
  cvta.to.global.u64 %rd1, %rd1;
  mov.u32 %r1, %tid.x;
  shr.u32 %r2, %r1, 5;
{body}
DONE:
  mul.wide.u32 %rd2, %r1, 4;
  add.s64 %rd3, %rd1, %rd2;
  st.global.u32 [%rd3], %r3;
  ret;
}}
"""


# Thread 0 writes `slot`; every thread meets at one bar.sync; warps 1-3 read.
PTX_SAME_PC = _entry("same_pc", """
  setp.eq.u32 %p1, %r1, 0;
  setp.ne.u32 %p2, %r2, 0;
  mov.u32 %r3, 42;
  @%p1 st.shared.u32 [slot], %r3;
  bar.sync 1;
  @%p2 ld.shared.u32 %r3, [slot];""")

# The same, but warp 0 and warps 1-3 reach bar.sync 1 at different
# instructions.
PTX_SPLIT_PC = _entry("split_pc", """
  mov.u32 %r3, 42;
  setp.eq.u32 %p2, %r2, 0;
  @%p2 bra WRITER;
  bar.sync 1;
  ld.shared.u32 %r3, [slot];
  bra.uni DONE;
WRITER:
  setp.eq.u32 %p1, %r1, 0;
  @%p1 st.shared.u32 [slot], %r3;
  bar.sync 1;""")

# Triton's start-up and shut-down in miniature, 256 threads: warps 0-3 (the
# "default partition") write the slot, four CTA-wide bar.sync 1 (A, B, C, D)
# separate the phases, warps 4-7 (the "worker") read it after A and after D.
# Between B and C each group may sync among itself on a 128-thread named
# barrier, as the real partitions do ({DEFAULT_BODY}, {WORKER_BODY}). Every
# thread ends with 42 + 43.
PTX_HANDSHAKE = """
  setp.eq.u32 %p2, %r1, 0;
  setp.lt.u32 %p1, %r2, 4;
  @%p1 bra DEFAULT;
  bar.sync 1;
  ld.shared.u32 %r3, [slot];
  bar.sync 1;
  {WORKER_BODY}
  bar.sync 1;
  bar.sync 1;
  ld.shared.u32 %r4, [slot];
  add.u32 %r3, %r3, %r4;
  bra.uni DONE;
DEFAULT:
  mov.u32 %r5, 42;
  @%p2 st.shared.u32 [slot], %r5;
  bar.sync 1;
  bar.sync 1;
  {DEFAULT_BODY}
  bar.sync 1;
  mov.u32 %r5, 43;
  @%p2 st.shared.u32 [slot], %r5;
  bar.sync 1;
  mov.u32 %r3, 85;"""


def _group_sync(bar_id, times):
    return f"bar.sync {bar_id}, 128;\n  " * times


# handshake variant -> (default group's barrier id, how many times; the
# worker group's barrier id, how many times)
HANDSHAKES = {
    "plain": (0, 0, 2, 0),
    "d0x3_w2x3": (0, 3, 2, 3),
    "d3x3_w2x3": (3, 3, 2, 3),
    "d0x3": (0, 3, 2, 0),
    "d3x3": (3, 3, 2, 0),
    "w2x3": (0, 0, 2, 3),
    "d0x3_w2x1": (0, 3, 2, 1),
    "d0x1_w2x3": (0, 1, 2, 3),
}
PTX = PTX_HEAD + PTX_SAME_PC + PTX_SPLIT_PC + "".join(
    _entry(f"handshake_{name}", PTX_HANDSHAKE.replace("{DEFAULT_BODY}", _group_sync(d, dn))
           .replace("{WORKER_BODY}", _group_sync(w, wn))) for name, (d, dn, w, wn) in HANDSHAKES.items())
EXPECTED = {"same_pc": 42, "split_pc": 42, **{f"handshake_{n}": 85 for n in HANDSHAKES}}


def run_ptx(entry: str) -> bool:
    import ctypes

    libcuda = ctypes.CDLL("libcuda.so.1")
    threads = 256 if entry.startswith("handshake") else 128
    out = torch.full((threads,), -1, dtype=torch.int32, device="cuda")  # makes torch's context current
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    for rc in (libcuda.cuModuleLoadData(ctypes.byref(module), PTX.encode() + b"\0"),
               libcuda.cuModuleGetFunction(ctypes.byref(function), module, entry.encode())):
        if rc:
            raise RuntimeError(f"CUDA driver error {rc} loading {entry}")
    arg = ctypes.c_uint64(out.data_ptr())
    params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(arg), ctypes.c_void_p))
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    if libcuda.cuLaunchKernel(function, 1, 1, 1, threads, 1, 1, 0, stream, params, None):
        raise RuntimeError(f"launch of {entry} failed")
    torch.cuda.synchronize()
    return bool((out == EXPECTED[entry]).all())


# variant -> (kernel, partitions that write, maxnreg for the launch)
GLUON = {
    "w1": (probe_w1, 2, None),
    "w4": (probe_w4, 2, 168),
    "w4_1": (probe_w4_1, 3, 168),
    "w4_4": (probe_w4_4, 3, 168),
    "w4_none": (probe_w4_none, 1, 168),
}


def run_gluon(name: str, grid: int) -> bool:
    kernel, parts, maxnreg = GLUON[name]
    out = torch.full((parts * SLICE,), float("nan"), device="cuda")
    opts = {"num_warps": 4}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    kernel[(grid,)](out, **opts)  # every CTA writes the same values
    torch.cuda.synchronize()
    want = torch.arange(1, parts + 1, device="cuda", dtype=torch.float32).repeat_interleave(SLICE)
    return bool((out == want).all())


def run_forward(head_dim: int, batch: int, heads: int, seqlen_q: int, seqlen_k: int, causal: bool) -> bool:
    import hopper_flash
    from hopper_flash.reference import attention_reference

    q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen_k, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    out = hopper_flash.flash_attn_func(q, k, v, causal=causal)
    ref = attention_reference(q, k, v, causal=causal, dtype=torch.float32)[0]
    return bool((out.float() - ref.float()).abs().max() < 2e-2)


# name -> what it runs
PROBES = {
    **{f"ws_{name}": (lambda name=name: run_gluon(name, 1)) for name in GLUON},
    # The forward kernel's partition shape over a grid larger than the GPU:
    # CTAs reuse each SM's shared memory one after another.
    "ws_w4_1_grid": lambda: run_gluon("w4_1", 1024),
    **{f"ptx_{entry}": (lambda entry=entry: run_ptx(entry)) for entry in EXPECTED},
    # The forward kernel itself: one CTA (8 KV tiles) against a grid of many.
    "fwd_1cta": lambda: run_forward(128, 1, 1, 128, 1024, False),
    "fwd_1cta_d64": lambda: run_forward(64, 1, 1, 128, 1024, False),
    "fwd_grid": lambda: run_forward(128, 1, 16, 1024, 1024, True),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # No `choices=`: argparse checks an empty list against them and refuses it.
    ap.add_argument("probes", nargs="*", metavar="PROBE", help=f"default: all of {', '.join(PROBES)}")
    ap.add_argument("--repeat", type=int, default=1, help="launches per probe (the tool's reports vary run to run)")
    args = ap.parse_args()
    unknown = sorted(set(args.probes) - set(PROBES))
    if unknown:
        ap.error(f"unknown probe(s) {', '.join(unknown)}; choose from {', '.join(PROBES)}")
    failed = 0
    for name in args.probes or list(PROBES):
        ok = all([PROBES[name]() for _ in range(args.repeat)])
        failed += not ok
        print(f"probe {name:<22} {'ok' if ok else 'WRONG'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
