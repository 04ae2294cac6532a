"""Compile the forward kernel for sm_90a without a GPU and take its census.

Triton compiles Gluon for Hopper on any machine; the result carries PTX, the
cubin and metadata, and triton's wheel ships ``cuobjdump`` to read the SASS.
This catches spills, missing instructions (HGMMA, UTMALDG/UTMASTG,
USETMAXREG) and shared-memory overruns before any device time is spent.

Run ``python -m hopper_flash.compile_check`` for a table of every shipped
specialisation.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

from . import ptx_rings
from .plan import (CONFIGS, PREFILL, WIDE_CONFIGS, ForwardConfig, Mode, block_shapes, forward_compile_options,
                   kernel_constexprs, smem_layout, takes_one_item)

# Hopper's per-block shared-memory limit with the opt-in carve-out.
SMEM_LIMIT_BYTES = 227 * 1024
SASS_OPS = ("HGMMA", "UTMALDG", "UTMASTG", "USETMAXREG", "LDL", "STL", "MUFU.EX2")

_TORCH_TO_SIG = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass
class CompileReport:
    head_dim: int
    dtype: str
    causal: bool
    write_lse: bool
    registers: int
    stack_bytes: int
    local_bytes: int
    shared_bytes: int
    block_m: int = 0  # query rows per tile (forward)
    sass_counts: dict = field(default_factory=dict)
    ptx: str = ""
    sass: str = ""
    ptxas_log: str = ""

    @property
    def spills(self) -> bool:
        return self.stack_bytes > 0 or self.local_bytes > 0 or self.sass_counts.get("LDL", 0) > 0 \
            or self.sass_counts.get("STL", 0) > 0


def _bindir() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_triton(kernel, signature: dict, constexprs: dict, num_warps: int, attrs=None, **options):
    """A plain Triton kernel (the combine, the append, the split table, the
    sinks' gradient) compiled for sm_90a on any machine, no GPU needed:
    ``signature`` names every argument's type ("constexpr" for those in
    ``constexprs``); ``options`` go to the compiler beside ``num_warps``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **options})


def compile_combine(constexprs: dict, out_dtype: str = "bfloat16", num_warps: int = 1):
    """The split-KV combine kernel compiled for sm_90a (no GPU needed);
    ``constexprs`` as ``plan._combine_constexprs`` gives them."""
    from .kernels.combine import combine_kernel

    real = getattr(combine_kernel, "real", combine_kernel)  # a test may have patched the launch out
    out = "*bf16" if out_dtype == "bfloat16" else "*fp16"
    sig = {"o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "out_ptr": out, "lse_ptr": "*fp32", "sink_ptr": "*fp32",
           "n_splits": "i32", "batch": "i32", "seqlen_q": "i32", "num_heads": "i32",
           "stride_ob": "i32", "stride_oq": "i32", "stride_oh": "i32",
           **{name: "constexpr" for name in ("HEAD_DIM", "S_MAX", "WRITE_LSE", "DEPENDENT", "SINK", "OUT_DIM")}}
    return compile_triton(real, sig, constexprs, num_warps=num_warps)


def compile_forward(cfg: ForwardConfig, dtype: str = "bfloat16", causal: bool = True, write_lse: bool = False,
                    mode: Mode = PREFILL):
    """Return the compiled kernel object for sm_90a (no GPU needed)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from .kernels.forward import attention_forward_kernel

    tdtype = getattr(torch, dtype)
    sig_dtype = _TORCH_TO_SIG[dtype]

    def desc_sig(block):
        return f"tensordesc<{sig_dtype}[{', '.join(map(str, block))}],{smem_layout(block, tdtype)!r}>"

    blocks = block_shapes(cfg, mode.box_g, mode.page_size)
    constexprs = kernel_constexprs(cfg, causal, write_lse, mode)
    signature = {
        "q_desc": desc_sig(blocks["q"]),
        "k_desc": desc_sig(blocks["k"]),
        "v_desc": desc_sig(blocks["v"]),
        "o_desc": desc_sig(blocks["o"]),
        "lse_ptr": "*fp32",
        "seqused_ptr": "*i32",
        "kv_batch_ptr": "*i32",
        "page_table_ptr": "*i32",
        # varlen and a packed view: O itself (stored by address), unless split
        "o_part_ptr": f"*{sig_dtype}" if (mode.varlen or mode.pack_view) and not mode.split else "*fp32",
        "lse_part_ptr": "*fp32",
        "cu_q_ptr": "*i32",
        "cu_k_ptr": "*i32",
        "used_q_ptr": "*i32",
        "sched_ptr": "*i32",
        "q_ptr": f"*{sig_dtype}",
        "k_ptr": f"*{sig_dtype}",
        "v_ptr": f"*{sig_dtype}",
        "sink_ptr": f"*{_TORCH_TO_SIG[mode.sink]}" if mode.sink else "*fp32",
        "seqlen_q": "i32",
        "seqlen_k": "i32",
        "num_heads": "i32",
        "kv_group": "i32",
        "batch": "i32",
        "qk_scale": "fp32",
        "softmax_scale": "fp32",
        "num_splits": "i32",
        "pair": "i32",
        "page_stride": "i32",
        "total_q": "i32",
        "section": "i32",
        "q_heads": "i32",
    }
    signature.update({name: "constexpr" for name in constexprs})
    # The JIT specialises pointers on 16-byte alignment; the page pools'
    # (k_ptr, v_ptr: a gathered tile's cp.async width) and q's (q_ptr: Q_ROWS's)
    # are always aligned, as TMA requires of them too.
    names = attention_forward_kernel.arg_names
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in ("q_ptr", "k_ptr", "v_ptr")}
    src = GluonASTSource(attention_forward_kernel, signature, constexprs=constexprs, attrs=attrs)
    with ptx_rings.compiling(constexprs["RING_PTX"]):  # as the launches compile it (plan._jit_launch)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=forward_compile_options(cfg, mode))


# --------------------------------------------------------------------------
# Reading a kernel's steady-state loop from its SASS (scripts/sass_flow.py,
# tests/test_compile_sm90.py)
# --------------------------------------------------------------------------
def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text without the trailing ';') of every SASS line."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,6})\*/\s+(.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def steady_loops(ins: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """Loop bodies (back-edge target .. branch) holding HGMMA and MUFU.EX2."""
    loops = []
    for addr, text in ins:
        m = re.search(r"\bBRA\s+(?:\S+,\s*)?(0x[0-9a-f]+)", text)
        if not m or not text.startswith("@"):
            continue
        target = int(m.group(1), 16)
        if target >= addr:
            continue
        body = [(a, t) for a, t in ins if target <= a <= addr]
        if any("HGMMA" in t for _, t in body) and any("MUFU.EX2" in t for _, t in body):
            loops.append(body)
    return loops


def issued_in_flight(body: list[tuple[int, str]], opcode: str) -> int:
    """Instructions ``opcode`` issued between a ``DEPBAR.LE gsb0, 0x1`` and the
    next ``0x0``: in the forward's step, after QK's wait and before PV's."""
    count, open_ = 0, False
    for _, text in body:
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in text:
            open_ = True
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in text:
            open_ = False
        elif open_ and opcode in text:
            count += 1
    return count


def dependent_chain(body: list[tuple[int, str]], opcode: str) -> int:
    """The longest run of ``opcode`` instructions in ``body`` each reading the
    register the one before it wrote (a dependency chain, in SASS order; a
    register written by any other instruction starts over). The forward's
    row maximum at head dim 128: 34 as triton 3.6 and 3.7 compile ``gl.max`` (a thread's 32
    columns of a row one after the other, then the quad's two shuffle rounds
    and the running maximum), 9 with ``softmax._row_max``'s tree."""
    depth: dict[str, int] = {}
    longest = 0
    for _, text in body:
        words = text.split()
        if words and words[0].startswith("@"):
            words = words[1:]
        if len(words) < 2:
            continue
        regs = re.findall(r"\bR\d+\b", " ".join(words[1:]))
        if not regs:
            continue
        if words[0].split(".")[0] == opcode:
            d = 1 + max((depth.get(r, 0) for r in regs[1:]), default=0)
            longest = max(longest, d)
            depth[regs[0]] = d
        else:
            depth[regs[0]] = 0
    return longest


def exps_in_flight(body: list[tuple[int, str]]) -> int:
    """MUFU.EX2 issued while PV is in flight (``issued_in_flight``)."""
    return issued_in_flight(body, "MUFU.EX2")


def census(cfg: ForwardConfig, dtype: str = "bfloat16", causal: bool = True, write_lse: bool = False,
           mode: Mode = PREFILL) -> CompileReport:
    """Compile and read registers, stack, shared memory and SASS opcode counts."""
    compiled = compile_forward(cfg, dtype, causal, write_lse, mode)
    return read_census(compiled, SASS_OPS, head_dim=cfg.head_dim, block_m=cfg.block_m, dtype=dtype, causal=causal,
                       write_lse=write_lse)


def read_census(compiled, sass_ops, **fields) -> CompileReport:
    """Registers, stack, local memory and shared memory of a compiled kernel,
    and how often each opcode in ``sass_ops`` occurs in its SASS (read with
    the ``cuobjdump`` that triton's wheel ships). ``fields`` name the
    specialisation in the report."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
        cubin = f.name
    try:
        usage = subprocess.run([os.path.join(_bindir(), "cuobjdump"), "--dump-resource-usage", cubin],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(_bindir(), "cuobjdump"), "--dump-sass", cubin],
                              capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(cubin)

    def field_of(name):
        m = re.search(rf"\b{name}:(\d+)", usage)
        return int(m.group(1)) if m else 0

    counts = {op: len(re.findall(rf"\b{re.escape(op)}\b", sass)) for op in sass_ops}
    return CompileReport(
        registers=field_of("REG"), stack_bytes=field_of("STACK"), local_bytes=field_of("LOCAL"),
        shared_bytes=int(compiled.metadata.shared), sass_counts=counts,
        ptx=compiled.asm["ptx"], sass=sass, **fields,
    )


# Causal prefill long enough for the dynamic order (plan.choose_dynamic):
# more items than SMs, so a grid on every SM, launched dependent.
DYNAMIC_PREFILL = Mode(dynamic=True, dependent=True)
# At most one work item per SM, dealt statically (plan.Mode.one_item), for the
# configs whose kernel reads it (plan.takes_one_item); launched dependent
# where the items are exactly the SMs.
ONE_ITEM_PREFILL = Mode(one_item=True)
ONE_ITEM_DEPENDENT = Mode(one_item=True, dependent=True)
# Plain prefill launched dependent (its grid on every SM).
PREFILL_DEPENDENT = Mode(dependent=True)


def shipped_specialisations():
    """Every (config, dtype, causal, write_lse, mode) of fixed-length prefill
    the public API can launch: causal ones with the static deal and the
    dynamic order (plan.choose_dynamic picks by shape), on the shipped
    configs and their wide forms (plan.choose_wide), and head dim 128's
    one-item launches (plan.Mode.one_item); each launched plainly and by
    programmatic dependent launch (plan.launched_dependent: a grid on every
    SM), but the dynamic order, whose fixed-length grid always is."""
    from .plan import SUPPORTED_DTYPES

    for cfg in (*CONFIGS.values(), *WIDE_CONFIGS.values()):
        one_item = (ONE_ITEM_PREFILL, ONE_ITEM_DEPENDENT) if takes_one_item(cfg) else ()
        for tdtype in SUPPORTED_DTYPES:
            for causal in SUPPORTED_CAUSAL:
                for write_lse in (False, True):
                    for mode in ((PREFILL, PREFILL_DEPENDENT) + (DYNAMIC_PREFILL,) * causal + one_item):
                        yield cfg, str(tdtype).removeprefix("torch."), causal, write_lse, mode



# Causal modes the public API accepts today (see interface.py).
SUPPORTED_CAUSAL = (False, True)


def main() -> None:
    rows = []
    for cfg, dtype, causal, write_lse, mode in shipped_specialisations():
        r = census(cfg, dtype, causal, write_lse, mode)
        order = "dynamic" if mode.dynamic else "one item" if mode.one_item else "static"
        rows.append((r.head_dim, r.block_m, r.dtype, r.causal, r.write_lse, order,
                     r.registers, r.stack_bytes, r.shared_bytes, *(r.sass_counts[op] for op in SASS_OPS)))
    header = ("D", "rows", "dtype", "causal", "lse", "order", "regs", "stack", "smem") + SASS_OPS
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in (header, *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))


if __name__ == "__main__":
    main()
