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


def varlen_batch(lq, lk, h, hkv, d, *, used_q=None, used_k=None, dtype=torch.bfloat16, seed=0):
    """A packed (THD) batch: q ``[sum(lq), h, d]``, k and v ``[sum(lk), hkv,
    d]`` drawn from ``seed``, NaN in the gaps past ``used_q``/``used_k``
    (seqused, whose rows no kernel may read), and the int32 metadata on the
    GPU: ``(q, k, v, cu_q, cu_k, seqused_q, seqused_k)`` (None where not
    given)."""
    q = rnd(sum(lq), h, d, dtype=dtype, seed=seed)
    k = rnd(sum(lk), hkv, d, dtype=dtype, seed=seed + 1)
    v = rnd(sum(lk), hkv, d, dtype=dtype, seed=seed + 2)
    cq, ck = cu(lq), cu(lk)
    for t, c, u in ((q, cq, used_q), (k, ck, used_k), (v, ck, used_k)):
        if u is not None:
            starts = c.tolist()
            for b, n in enumerate(u):
                t[starts[b] + n:starts[b + 1]] = math.nan
    uq = torch.tensor(used_q, dtype=torch.int32, device=DEV) if used_q is not None else None
    uk = torch.tensor(used_k, dtype=torch.int32, device=DEV) if used_k is not None else None
    return q, k, v, cq, ck, uq, uk


def packed_queries_over_cache(lq, lens, h, hkv, d, cap, seed=0):
    """Packed queries (``lq[b]`` rows of sequence ``b``, THD, from ``seed``)
    over a :func:`nan_tailed_cache` of ``lens`` live keys (``seed + 1``),
    with the float64 reference and the baseline of causal attention over
    the same keys packed: ``(q, k_cache, v_cache, cu_q, ref, base)``."""
    from hopper_flash.reference import varlen_baseline, varlen_reference

    q = rnd(sum(lq), h, d, seed=seed)
    kc, vc = nan_tailed_cache(len(lens), cap, hkv, d, lens, seed=seed + 1)
    k, v = (torch.cat([c[b, :n] for b, n in enumerate(lens)]) for c in (kc, vc))
    cq, ck = cu(lq), cu(lens)
    return (q, kc, vc, cq, varlen_reference(q, k, v, cq, ck, causal=True)[0],
            varlen_baseline(q, k, v, cq, ck, causal=True))


def paged_pools(k, v, cu_k, page_size, seed=0, spare=5):
    """THD keys ``k``, ``v`` (sequence ``b`` at ``cu_k[b]``) as page pools
    ``[num_pages, page_size, Hkv, D]`` in shuffled order (vLLM's layout),
    NaN in every unused slot (``spare`` pages more than needed), and the
    int32 block table ``[batch, max_pages]``, garbage (10**6) past each
    row's live pages: ``(k_pool, v_pool, table)``."""
    starts, lengths = cu_k[:-1].tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
    batch, max_pages = len(lengths), max(1, -(-max(lengths, default=0) // page_size))
    n_pages = batch * max_pages + spare
    gen = torch.Generator(device=DEV).manual_seed(seed)
    perm = torch.randperm(n_pages, device=DEV, generator=gen)[:batch * max_pages].view(batch, max_pages)
    kp = torch.full((n_pages, page_size, *k.shape[1:]), math.nan, dtype=k.dtype, device=DEV)
    vp = torch.full((n_pages, page_size, *v.shape[1:]), math.nan, dtype=v.dtype, device=DEV)
    table = torch.full((batch, max_pages), 10 ** 6, dtype=torch.int32, device=DEV)
    for b, (start, n) in enumerate(zip(starts, lengths)):
        for p in range(-(-n // page_size)):
            lo, hi = p * page_size, min((p + 1) * page_size, n)
            kp[perm[b, p], :hi - lo] = k[start + lo:start + hi]
            vp[perm[b, p], :hi - lo] = v[start + lo:start + hi]
            table[b, p] = perm[b, p]
    return kp, vp, table


def live_rows(total, cu_seqlens, seqused=None):
    """Boolean ``[total]`` on the GPU: the rows inside some sequence's live
    part (``cu_seqlens``, ``seqused``), the rows a varlen kernel writes."""
    from hopper_flash.reference import varlen_spans

    m = torch.zeros(total, dtype=torch.bool, device=DEV)
    for start, n in varlen_spans(cu_seqlens, seqused):
        m[start:start + n] = True
    return m


def varlen_expected(q, k, v, cq, ck, uq, uk, causal, window=None, softcap=0.0, chunk=0):
    """What a varlen forward over this batch must give: ``(ref, ref_lse,
    base, live)``, the float64 reference's output and LSE, the baseline
    (PyTorch's attention on the same inputs) and :func:`live_rows`."""
    from hopper_flash.reference import varlen_baseline, varlen_reference

    ref, ref_lse = varlen_reference(q, k, v, cq, ck, seqused_q=uq, seqused_k=uk, causal=causal, window=window,
                                    softcap=softcap, chunk=chunk)
    base = varlen_baseline(q, k, v, cq, ck, seqused_q=uq, seqused_k=uk, causal=causal, window=window,
                           softcap=softcap, chunk=chunk)
    return ref, ref_lse, base, live_rows(q.shape[0], cq, uq)


def assert_varlen_forward(label, out, lse, expected):
    """``out`` and ``lse`` judged against :func:`varlen_expected`'s reference
    on the live rows, and zero output with an LSE of -inf on every other."""
    from hopper_flash.reference import assert_judged

    ref, ref_lse, base, live = expected
    assert_judged(f"out ({label})", out, ref, base)
    assert_judged(f"lse ({label})", lse[:, live], ref_lse[:, live].to(lse.device))
    assert (out[~live] == 0).all() and (lse[:, ~live] == -math.inf).all()


def varlen_sink_expected(q, k, v, cq, ck, sink):
    """``(ref, ref_lse, base)`` of causal varlen attention with sinks: the
    float64 reference and ``sink_eager``'s baseline, sequence by sequence."""
    from hopper_flash.reference import attention_reference, sink_eager, varlen_apply

    ref, ref_lse = varlen_apply(lambda a, b, c: attention_reference(a, b, c, causal=True, sink=sink), q, k, v, cq, ck,
                                out_dtype=torch.float64, with_lse=True)
    return ref, ref_lse, varlen_apply(lambda a, b, c: sink_eager(a, b, c, sink, causal=True), q, k, v, cq, ck)
