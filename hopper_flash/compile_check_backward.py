"""Compile the backward's main kernel for sm_90a without a GPU and take its
census (registers, spills, shared memory, SASS opcodes), as
``compile_check`` does for the forward.

``python -m hopper_flash.compile_check_backward`` prints a table of every
shipped backward specialisation.

Comparing two trees' kernels: the head-dim-64 and 128 backward kernels
compile to the same SASS on every run, but ptxas (12.8, triton 3.6's) does
not at head dim 256: one PTX gives different cubins from run to run (same
opcodes, other registers or order; BENCHMARKS.md, forty-first session).
Compare D = 256 by PTX (less its line info), and recompile with
``TRITON_ALWAYS_COMPILE=1``: Triton's cache otherwise hands back the last
build.
"""
from __future__ import annotations

from .compile_check import SASS_OPS, CompileReport, _TORCH_TO_SIG, read_census
from .plan import compile_options, smem_layout
from .plan_backward import (BACKWARD_CONFIGS, BackwardConfig, block_shapes, fp32_smem_layout, kernel_constexprs,
                            persistent_grid)

BWD_SASS_OPS = SASS_OPS + ("RED", "ATOM", "BAR")


def compile_backward(cfg: BackwardConfig, dtype: str = "bfloat16", causal: bool = True,
                     deterministic: bool = False, varlen: bool = False, seqused: bool = False, window=None,
                     softcap: bool = False, short_rows: bool = False, o_dim: int = 0):
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from .kernels.backward import attention_backward_kernel

    tdtype = getattr(torch, dtype)
    sig_dtype = _TORCH_TO_SIG[dtype]

    def desc_sig(block):
        return f"tensordesc<{sig_dtype}[{', '.join(map(str, block))}],{smem_layout(block, tdtype)!r}>"

    blocks = block_shapes(cfg)
    constexprs = kernel_constexprs(cfg, causal, deterministic, varlen, seqused, seqused, window, softcap, short_rows,
                                   o_dim)
    signature = {f"{name}_desc": desc_sig(blocks[name]) for name in ("q", "k", "v", "do", "dk", "dv")}
    dq_block = blocks["dq_accum"]
    signature["dq_desc"] = (f"tensordesc<fp32[{', '.join(map(str, dq_block))}],"
                            f"{fp32_smem_layout(tuple(dq_block))!r}>")
    for name in ("lse2", "delta"):
        signature[f"{name}_desc"] = (f"tensordesc<fp32[{blocks[name][0]}],"
                                     f"{fp32_smem_layout(tuple(blocks[name]))!r}>")
    signature.update({"sem_ptr": "*i32", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32", "used_q_ptr": "*i32",
                      "used_k_ptr": "*i32", "order_ptr": "*i32", "dk_ptr": f"*{sig_dtype}", "dv_ptr": f"*{sig_dtype}",
                      "stride_kv_row": "i32", "stride_kv_head": "i32",
                      "seqlen_q": "i32", "seqlen_k": "i32", "seqlen_q_rounded": "i32", "num_heads": "i32",
                      "kv_group": "i32", "kv_tiles": "i32", "batch": "i32", "section": "i32",
                      "qk_scale": "fp32", "softmax_scale": "fp32"})
    signature.update({name: "constexpr" for name in constexprs})
    src = GluonASTSource(attention_backward_kernel, signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=compile_options(cfg))


def census(cfg: BackwardConfig, dtype: str = "bfloat16", causal: bool = True,
           deterministic: bool = False, varlen: bool = False, seqused: bool = False, window=None,
           softcap: bool = False, short_rows: bool = False, o_dim: int = 0) -> CompileReport:
    """``softcap``: the soft-capped specialisation (run with
    ``plan_backward.softcap_config(cfg)``, as the plan does); ``short_rows``:
    fixed lengths short enough for the persistent grid (D = 128 causal fast
    mode, ``plan_backward.persistent_grid``); ``o_dim``: varlen's narrower
    dK/dV (``kernel_constexprs``)."""
    compiled = compile_backward(cfg, dtype, causal, deterministic, varlen, seqused, window, softcap, short_rows,
                                o_dim)
    return read_census(compiled, BWD_SASS_OPS, head_dim=cfg.head_dim, dtype=dtype, causal=causal,
                       write_lse=deterministic)


def shipped_specialisations():
    """Every (config, dtype, causal, deterministic, short_rows) the backward
    can launch on fixed lengths; ``short_rows`` where that gives another
    kernel (the persistent grid, ``plan_backward.persistent_grid``)."""
    for cfg in BACKWARD_CONFIGS.values():
        for dtype in ("bfloat16", "float16"):
            for causal in (False, True):
                for deterministic in (False, True):
                    yield cfg, dtype, causal, deterministic, False
                    if persistent_grid(cfg, causal, deterministic, False, True):
                        yield cfg, dtype, causal, deterministic, True


def main() -> None:
    rows = []
    for cfg, dtype, causal, det, short_rows in shipped_specialisations():
        r = census(cfg, dtype, causal, det, short_rows=short_rows)
        rows.append((r.head_dim, r.dtype, r.causal, det, short_rows, r.registers, r.stack_bytes, r.shared_bytes,
                     *(r.sass_counts[op] for op in BWD_SASS_OPS)))
    header = ("D", "dtype", "causal", "det", "short", "regs", "stack", "smem") + BWD_SASS_OPS
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in (header, *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)), flush=True)


if __name__ == "__main__":
    main()
