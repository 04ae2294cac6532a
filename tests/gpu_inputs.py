"""Inputs and checks the GPU test files share: seeded random tensors on
the GPU, NaN-tailed and paged KV caches, varlen prefix sums, and the
backward kernel's check on its own forward (imported as ``from gpu_inputs import ...``, as ``launch_fakes``
is)."""
import math

import torch

DEV = "cuda"


def rnd(*shape, dtype=torch.bfloat16, seed=0, magnitude=1.0):
    """A standard normal tensor of ``shape`` times ``magnitude`` in ``dtype``,
    drawn on the GPU from its own generator seeded with ``seed``."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=gen) * magnitude).to(dtype)


def capture(fn, warmup=2):
    """``(graph, result)``: ``fn`` run ``warmup`` times on a side stream (so
    allocations and compiles happen outside the capture), then captured
    into a CUDA graph; ``result`` is what the captured call returned, whose
    buffers each ``graph.replay()`` rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def cu(lengths):
    """int32 prefix sums ``[0, l0, l0 + l1, ...]`` on the GPU (``cu_seqlens``)."""
    return torch.tensor([0] + list(lengths), device=DEV).cumsum(0).to(torch.int32)


def check_kernel_backward(batch, seqlen_q, seqlen_k, h, hkv, d, causal, *, window_size=(-1, -1), softcap=0.0,
                          magnitude=1.0, deterministic=False, dtype=torch.bfloat16, seed=0):
    """dq, dk, dv from ``plan_backward.launch_backward`` (buffers poisoned
    with NaN) on the forward's own O and LSE, under flash-attn's
    ``window_size`` and ``softcap``, against the float64 textbook backward
    with the same mask and cap, within 2x SDPA's error on the same problem
    (``reference.check_attention_grads``). Q and K are drawn at
    ``magnitude`` (large logits make a cap bite). Returns ``(q, k, v, do,
    dq, dk, dv)``."""
    import hopper_flash
    from hopper_flash import checks, plan_backward
    from hopper_flash.reference import check_attention_grads

    q = rnd(batch, seqlen_q, h, d, dtype=dtype, seed=seed, magnitude=magnitude)
    k = rnd(batch, seqlen_k, hkv, d, dtype=dtype, seed=seed + 1, magnitude=magnitude)
    v = rnd(batch, seqlen_k, hkv, d, dtype=dtype, seed=seed + 2)
    do = rnd(batch, seqlen_q, h, d, dtype=dtype, seed=seed + 3)
    window = checks.window_bounds(window_size, causal)
    scale = d ** -0.5
    with torch.no_grad():
        out, lse = hopper_flash.flash_attn_func(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                                                return_lse=True)
    dq, dk, dv = (torch.full_like(t, math.nan) for t in (q, k, v))
    plan_backward.launch_backward(do, q, k, v, out, lse, dq, dk, dv, scale, causal, deterministic, window=window,
                                  softcap=softcap)
    verdicts = check_attention_grads((dq, dk, dv), q, k, v, do, causal=causal, softmax_scale=scale, window=window,
                                     softcap=softcap)
    assert all(verdicts), "; ".join(x.message for x in verdicts if not x)
    return q, k, v, do, dq, dk, dv


def nan_tailed_cache(B, cap, Hkv, D, lens, dtype=torch.bfloat16, seed=0, k_magnitude=1.0):
    """Random K and V caches ``[B, cap, Hkv, D]`` (K times ``k_magnitude``)
    with NaN past each row's live length ``lens[b]``: uninitialised cache
    memory may hold anything, and 0 * NaN = NaN in PV."""
    kc = rnd(B, cap, Hkv, D, dtype=dtype, seed=seed, magnitude=k_magnitude)
    vc = rnd(B, cap, Hkv, D, dtype=dtype, seed=seed + 1)
    for b, L in enumerate(lens):
        kc[b, L:] = math.nan
        vc[b, L:] = math.nan
    return kc, vc


def paged_copy(kc, vc, page_size, lens, seed=0):
    """The same caches as pages in random order; page-table entries past each
    row's live pages are garbage."""
    B, cap, Hkv, D = kc.shape
    max_pages = -(-cap // page_size)
    n_pages = B * max_pages + 3
    gen = torch.Generator(device=DEV).manual_seed(seed)
    perm = torch.randperm(n_pages, device=DEV, generator=gen)[: B * max_pages].view(B, max_pages).to(torch.int32)
    kp = torch.full((n_pages, page_size, Hkv, D), float("nan"), device=DEV, dtype=kc.dtype)
    vp = torch.full((n_pages, page_size, Hkv, vc.shape[3]), float("nan"), device=DEV, dtype=vc.dtype)
    for b in range(B):
        for p in range(max_pages):
            lo, hi = p * page_size, min((p + 1) * page_size, cap)
            kp[perm[b, p], : hi - lo] = kc[b, lo:hi]
            vp[perm[b, p], : hi - lo] = vc[b, lo:hi]
    pt = perm.clone()
    for b, L in enumerate(lens):
        pt[b, -(-L // page_size) + 1:] = 10 ** 6
    return kp, vp, pt
