"""The backward preprocess's SASS on the CPU, to compare two packages: every
(head dim, varlen, seqused) specialisation without sinks, constant-bank
offsets (parameter positions) masked. Writes a pickle; ``--compare A B``
prints which specialisations are identical.

    PYTHONPATH=OLD python -P scripts/preprocess_sass.py /tmp/old.pkl
    PYTHONPATH=.   python -P scripts/preprocess_sass.py /tmp/new.pkl
    python scripts/preprocess_sass.py --compare /tmp/old.pkl /tmp/new.pkl
"""
from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import tempfile


def sass_of(flags: dict, kernel) -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {}
    for p in kernel.params:
        n = p.name
        sig[n] = ("constexpr" if n in flags else "*bf16" if n in ("o_ptr", "do_ptr") else
                  "*i32" if n in ("cu_ptr", "used_ptr") else "*fp32" if n.endswith("_ptr") else "i32")
    compiled = triton.compile(ASTSource(kernel, sig, constexprs=flags), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    sass = subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    return [re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[P]", m.group(1))
            for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(.*?)\s*;", sass)]


def main() -> None:
    if sys.argv[1] == "--compare":
        old, new = (pickle.load(open(p, "rb")) for p in sys.argv[2:4])
        for key in old:
            print(*key, len(old[key]), len(new.get(key, [])), "identical" if old[key] == new.get(key) else "DIFFERENT")
        return
    import hopper_flash
    from hopper_flash.kernels.backward_pre import _bwd_preprocess_kernel as kernel

    print("hopper_flash from", hopper_flash.__file__)
    has_sink = any(p.name == "SINK" for p in kernel.params)
    out = {}
    for head_dim in (64, 128, 256):
        for varlen, seqused in ((False, False), (True, False), (True, True)):
            flags = {"BLOCK": 64, "HEAD_DIM": head_dim, "BLOCK_M": 64, "VARLEN": varlen, "SEQUSED": seqused}
            if has_sink:
                flags["SINK"] = False
            out[(head_dim, varlen, seqused)] = sass_of(flags, kernel)
    with open(sys.argv[1], "wb") as f:
        pickle.dump(out, f)


if __name__ == "__main__":
    main()
