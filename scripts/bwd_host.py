"""Usage: PYTHONPATH=PKG python -P scripts/bwd_host.py

Host time per backward call through autograd (torch.autograd.grad on a
fixed graph), tiny GPU work (B1 H1 S128 D128 causal), ours vs SDPA cuDNN;
then the B16 H16 S1024 call: CPU time to enqueue 30 calls against the wall
time to finish them (wall > host: GPU-bound); the host time of a whole
tiny training step (forward under autograd + backward); then a cProfile of
the backward."""
import time, torch, hopper_flash
from torch.nn.attention import SDPBackend, sdpa_kernel
F = torch.nn.functional
def mk(B, S, H):
    q, k, v = (torch.randn(B, S, H, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    o = hopper_flash.flash_attn_func(q, k, v, causal=True)
    g = torch.randn_like(o)
    ours = lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        oc = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    gc = g.transpose(1, 2)
    cud = lambda: torch.autograd.grad(oc, (qt, kt, vt), gc, retain_graph=True)
    return ours, cud
for name, (B, S, H) in (("tiny", (1, 128, 1)), ("B16 S1024", (16, 1024, 16))):
    ours, cud = mk(B, S, H)
    for label, f in (("hopper_flash", ours), ("cudnn", cud)):
        for _ in range(20): f()
        torch.cuda.synchronize()
        n = 200 if name == "tiny" else 30
        t0 = time.perf_counter()
        for _ in range(n): f()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"{name} {label}: host {1e6*(t1-t0)/n:.0f} us/call, wall {1e6*(t2-t0)/n:.0f} us/call", flush=True)
# Forward and backward of a training step (autograd records the forward).
q, k, v = (torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16)
qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))


def step_ours():
    o = hopper_flash.flash_attn_func(q, k, v, causal=True)
    return torch.autograd.grad(o, (q, k, v), g)


def step_cudnn():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    return torch.autograd.grad(o, (qt, kt, vt), g.transpose(1, 2))


for label, f in (("hopper_flash", step_ours), ("cudnn", step_cudnn)):
    for _ in range(20): f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200): f()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"tiny fwd+bwd {label}: host {1e6*(t1-t0)/200:.0f} us/step", flush=True)
import cProfile, pstats
ours, cud = mk(1, 128, 1)
for _ in range(20): ours()
pr = cProfile.Profile(); pr.enable()
for _ in range(200): ours()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(22)
