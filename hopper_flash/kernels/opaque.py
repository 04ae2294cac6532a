"""Values the compiler cannot see through.

Triton's passes and ptxas hoist, fold and keep live whatever they can prove
about a value. In a few places the kernels need the opposite: a value
computed where it is used, not at the kernel's entry or before a loop,
because keeping it live costs registers that a warp does not have. Each
helper here is one inline-asm move that is not pure, so the compiler keeps
it in program order among the side effects around it and cannot know its
result:

* ``opaque(x)``: ``x`` (an int32 scalar). The forward's Q_ROWS copy
  (``forward._copy_q_rows``) takes each step's first row through it, so a
  one-warp producer computes one step's addresses at a time (all eight
  steps' at once spilled its 24 registers), and reads q's token stride in
  heads (``q_heads``) through it where the copy uses it (kept live from the
  entry, it spilled a consumer 32 bytes at head dim 128, non-causal, pages
  of 16).
* ``opaque_zero()``: 0. The backward's step loop at head dim 256 indexes K
  and V with it, so their wgmma descriptors are built inside the loop
  instead of hoisted out of it and kept live across it (ptxas spills
  them).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def opaque(x):
    """``x``, produced by a move the compiler keeps in program order among
    the side effects around it (a scalar int32)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def opaque_zero():
    """0, as a value the compiler cannot see through."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
