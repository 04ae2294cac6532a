"""Prepared calls launched from C (``hopper_flash/c_launch.py``) on the GPU:
the same bits as the Python launch path on the same inputs, judged against
float64 too, in eager calls and in a replayed CUDA graph with a changing key
length. The CPU half (every kernel parameter and TMA map against the Python
path's, against a stand-in libcuda) is tests/test_c_launch_cpu.py."""
import pytest
import torch

import hopper_flash
from hopper_flash import c_launch, plan
from hopper_flash.reference import check_kvcache
from gpu_inputs import capture, nan_tailed_cache, paged_copy, rnd

pytestmark = pytest.mark.gpu


def _cache_views(batch, nheads_kv, capacity, length, gen):
    """K/V as transformers' caches hold them, [B, Hkv, L, D] seen as BSHD, in
    a longer buffer whose tail is NaN (no key past the length may count)."""
    kv = []
    for _ in range(2):
        buf = torch.randn(batch, nheads_kv, capacity, 128, device="cuda", generator=gen).to(torch.bfloat16)
        buf[:, :, length:] = float("nan")
        kv.append(buf[:, :, :length].transpose(1, 2))
    return kv


def _prepared_launches():
    return [launch for call in plan._PREPARED.values() for launch in call.launches.values()]


@pytest.mark.parametrize("batch,nheads,nheads_kv,length,lse", [
    (1, 32, 8, 32768, False),   # the Llama decode row: split-KV, PackGQA, an extent-1 batch axis
    (2, 8, 2, 8190, True),      # split with the LSE
    (4, 16, 16, 1000, False),   # MHA
    (1, 32, 8, 300, False),     # few keys
    (3, 8, 1, 4097, True),      # MQA, odd batch
])
def test_c_launch_gives_the_python_launch_bits_gpu(monkeypatch, batch, nheads, nheads_kv, length, lse):
    assert c_launch.module() is not None, "the C launch module did not build, or libcuda did not open"
    gen = torch.Generator(device="cuda").manual_seed(length)
    q = torch.randn(batch, 1, nheads, 128, device="cuda", generator=gen).to(torch.bfloat16)
    k, v = _cache_views(batch, nheads_kv, length + 37, length, gen)
    results = {}
    for c_on in ("0", "1"):
        monkeypatch.setenv("HOPPER_FLASH_C_LAUNCH", c_on)
        monkeypatch.setattr(plan, "_PREPARED", {})
        runs = [hopper_flash.flash_attn_func(q, k, v, causal=True, return_lse=lse) for _ in range(3)]
        launches = _prepared_launches()
        assert launches and all((launch.c_state is not None) == (c_on == "1") for launch in launches)
        results[c_on] = runs[-1]  # the third: the prepared call
    (out_py, lse_py), (out_c, lse_c) = [(r if lse else (r, None)) for r in (results["0"], results["1"])]
    assert torch.equal(out_c, out_py)
    if lse:
        assert torch.equal(lse_c, lse_py)
    bad = [r.message for r in check_kvcache(out_c, q, k.contiguous(), v.contiguous(), [length] * batch,
                                            causal=True, lse=lse_c) if not r]
    assert not bad, bad


def test_c_launch_in_a_replayed_graph_gpu(monkeypatch):
    # A serving loop's decode step captured once, replayed as the cache grows
    # (views of one buffer, one key longer per step: the same tensors' shapes
    # are captured, so the graph replays the captured length; a new capture
    # per length is what a server does). Here: capture at each length and
    # compare with the eager Python path.
    monkeypatch.setenv("HOPPER_FLASH_C_LAUNCH", "1")
    monkeypatch.setattr(plan, "_PREPARED", {})
    gen = torch.Generator(device="cuda").manual_seed(7)
    buf_k = torch.randn(1, 8, 5000, 128, device="cuda", generator=gen).to(torch.bfloat16)
    buf_v = torch.randn_like(buf_k)
    q = torch.randn(1, 1, 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
    for length in (4095, 4096, 4097):
        k, v = buf_k[:, :, :length].transpose(1, 2), buf_v[:, :, :length].transpose(1, 2)
        for _ in range(2):  # JIT or direct, then prepared (C)
            hopper_flash.flash_attn_func(q, k, v, causal=True)
        assert any(launch.c_state is not None for launch in _prepared_launches())
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            hopper_flash.flash_attn_func(q, k, v, causal=True)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = hopper_flash.flash_attn_func(q, k, v, causal=True)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setenv("HOPPER_FLASH_C_LAUNCH", "0")
        plan._PREPARED.clear()
        want = [hopper_flash.flash_attn_func(q, k, v, causal=True) for _ in range(3)][-1]
        monkeypatch.setenv("HOPPER_FLASH_C_LAUNCH", "1")
        plan._PREPARED.clear()
        assert torch.equal(out, want), length


def _kvcache_inputs(layout, lens, seed):
    """Fresh inputs of one signature (new addresses, the given lengths, a new
    page order), every cache NaN past each row's length: ``(kwargs for
    flash_attn_with_kvcache, (q, contiguous k, v, lens) for the judge)``."""
    view = layout.startswith("view")  # a group of 5: PackGQA from a packed view of q
    nheads, nheads_kv, seqlen_q = (40, 8, 48 if layout == "view5-48" else 1) if view else (32, 8, 1)
    batch = len(lens)
    q = rnd(batch, seqlen_q, nheads, 128, seed=seed)
    rows = batch + 2 if layout == "rows" else batch
    kc, vc = nan_tailed_cache(rows, 4200, nheads_kv, 128, lens + [0] * (rows - batch), seed=seed + 1)
    cs = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kw = dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=cs)
    if layout == "rows":
        idx = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))[:batch]
        kc2, vc2 = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
        kc2[idx], vc2[idx] = kc[:batch], vc[:batch]  # row b of the judge's cache is cache row idx[b]
        kw.update(k_cache=kc2, v_cache=vc2, cache_batch_idx=idx.to(torch.int32).cuda())
    elif layout.startswith("pages"):
        kp, vp, pt = paged_copy(kc, vc, int(layout[5:]), lens, seed=seed)
        kw.update(k_cache=kp, v_cache=vp, page_table=pt)
    elif layout == "leftpad":  # flash-attn's cache_leftpad: each row's keys from its pad on, NaN before it
        pads = [n // 3 for n in lens]
        for b, pad in enumerate(pads):
            kc[b, :pad] = vc[b, :pad] = float("nan")
        kw["cache_leftpad"] = torch.tensor(pads, dtype=torch.int32, device="cuda")
    return kw, (q, kc[:batch], vc[:batch])


def _starts(kw, lens=None, chunk: int = 0):
    """The judge's ``starts`` (``check_kvcache``): the left pads, or None;
    under chunked attention (``attention_chunk``, one query per row) each
    row's keys from its last chunk's start on, counted from its pad."""
    pads = kw["cache_leftpad"].tolist() if "cache_leftpad" in kw else None
    if not chunk:
        return pads
    return [p + max(n - p - 1, 0) // chunk * chunk for p, n in zip(pads or [0] * len(lens), lens)]


@pytest.mark.parametrize("chunk", [0, 1024], ids=["plain", "chunk1024"])
@pytest.mark.parametrize("layout", ["contiguous", "rows", "pages64", "pages256", "view5", "view5-48", "leftpad"])
@pytest.mark.parametrize("c_on", ["0", "1"], ids=["python", "c"])
def test_kvcache_prepared_calls_gpu(monkeypatch, layout, c_on, chunk):
    """flash_attn_with_kvcache's prepared calls (``kvcache`` docstring): from
    the third call of a signature on, no checks and no plan, the launch
    replayed with each call's own q, caches, lengths, rows, pages and left
    pads; every
    output judged against float64 and bit-equal to the full path's on the
    same inputs; a captured prepared call replays with new lengths. With
    ``chunk``, chunked decode steps (``attention_chunk``), whose prepared
    calls derive each row's last chunk per call: the lengths cross chunk
    boundaries, and the judge reads each row's keys from its last chunk's
    start (the keys before it are live, and must not be seen)."""
    if chunk and layout == "view5-48":
        pytest.skip("48 queries per row: chunked attention over the varlen mode, never prepared")
    monkeypatch.setenv("HOPPER_FLASH_C_LAUNCH", c_on)
    monkeypatch.setattr(plan, "_PREPARED", {})
    planned = []
    real = plan.launch_forward
    monkeypatch.setattr(plan, "launch_forward", lambda *a, **kw: planned.append(1) or real(*a, **kw))
    lse_on = layout in ("pages64", "view5-48")
    for call, lens in enumerate(([4100, 17, 1, 0], [1, 4096, 300, 2], [4097, 0, 129, 4200], [33, 3001, 4200, 7])):
        kw, judged = _kvcache_inputs(layout, lens, seed=10 * call)
        planned.clear()
        res = hopper_flash.flash_attn_with_kvcache(**kw, causal=True, return_softmax_lse=lse_on,
                                                   attention_chunk=chunk)
        out, lse = res if lse_on else (res, None)
        # The first call is planned (JIT or direct); the second at the latest prepares the signature.
        if call == 0:
            assert planned, "the first call of a signature was not planned"
        elif call >= 2:
            assert not planned, f"call {call} was not prepared"
        bad = [r.message for r in check_kvcache(out, *judged, lens, causal=True, lse=lse,
                                                starts=_starts(kw, lens, chunk)) if not r]
        assert not bad, (call, bad)
    launches = _prepared_launches()
    assert len(launches) == 1 and (launches[0].c_state is not None) == (c_on == "1")
    prepared = plan._PREPARED.copy()
    plan._PREPARED.clear()
    full = hopper_flash.flash_attn_with_kvcache(**kw, causal=True, return_softmax_lse=lse_on, attention_chunk=chunk)
    for a, b in zip(res if lse_on else (res,), full if lse_on else (full,)):
        assert torch.equal(a, b)
    plan._PREPARED.update(prepared)
    planned.clear()
    graph, g_res = capture(lambda: hopper_flash.flash_attn_with_kvcache(**kw, causal=True, return_softmax_lse=lse_on,
                                                                       attention_chunk=chunk))
    assert not planned  # captured through the prepared call
    new_lens = [30, 3000, 4000, 3]  # at most the captured call's, whose caches are NaN past those (and before
    kw["cache_seqlens"].copy_(torch.tensor(new_lens, dtype=torch.int32))  # its left pads, at most these)
    graph.replay()
    torch.cuda.synchronize()
    g_out, g_lse = g_res if lse_on else (g_res, None)
    bad = [r.message for r in check_kvcache(g_out, *judged, new_lens, causal=True, lse=g_lse,
                                            starts=_starts(kw, new_lens, chunk)) if not r]
    assert not bad, bad


@pytest.mark.parametrize("chunk", [0, 1024], ids=["plain", "chunk1024"])
@pytest.mark.parametrize("layout", ["contiguous", "pages64"])
@pytest.mark.parametrize("c_on", ["0", "1"], ids=["python", "c"])
def test_kvcache_prepared_calls_with_an_append_gpu(monkeypatch, layout, c_on, chunk):
    """Prepared calls with new keys (flash-attn's decode idiom): each call's
    two new keys land at its ``cache_seqlens`` (the positions were NaN
    before) and its attention reads the lengths after them; judged against
    float64 over the cache as it should be; the last call bit-equal to the
    full path's on the same inputs; a captured prepared call replayed with
    new lengths writes the keys there and attends over them. With
    ``chunk``, chunked decode steps (``attention_chunk``): each row's last
    chunk counted from the lengths after the append."""
    monkeypatch.setenv("HOPPER_FLASH_C_LAUNCH", c_on)
    monkeypatch.setattr(plan, "_PREPARED", {})
    planned = []
    real = plan.launch_forward
    monkeypatch.setattr(plan, "launch_forward", lambda *a, **kw: planned.append(1) or real(*a, **kw))
    s_new = 2

    def inputs(lens, seed):
        q = rnd(len(lens), 1, 32, 128, seed=seed)
        kc, vc = nan_tailed_cache(len(lens), 4200, 8, 128, lens, seed=seed + 1)
        k_new = torch.stack([kc[b, n - s_new:n] for b, n in enumerate(lens)])
        v_new = torch.stack([vc[b, n - s_new:n] for b, n in enumerate(lens)])
        kp, vp = kc.clone(), vc.clone()
        for b, n in enumerate(lens):
            kp[b, n - s_new:n] = float("nan")  # the append must write them
            vp[b, n - s_new:n] = float("nan")
        kw = dict(q=q, k=k_new, v=v_new, cache_seqlens=torch.tensor([n - s_new for n in lens], dtype=torch.int32,
                                                                    device="cuda"))
        if layout == "pages64":
            kp, vp, pt = paged_copy(kp, vp, 64, lens, seed=seed)
            kw["page_table"] = pt
        kw.update(k_cache=kp, v_cache=vp)
        return kw, (q, kc, vc)

    for call, lens in enumerate(([4100, 17, 2, 3], [2, 4096, 300, 5], [4097, 2, 129, 4200], [33, 3001, 4200, 7])):
        kw, judged = inputs(lens, seed=10 * call)
        planned.clear()
        out = hopper_flash.flash_attn_with_kvcache(**kw, causal=True, attention_chunk=chunk)
        if call == 0:
            assert planned, "the first call of a signature was not planned"
        elif call >= 2:
            assert not planned, f"call {call} was not prepared"
        bad = [r.message for r in check_kvcache(out, *judged, lens, causal=True, starts=_starts(kw, lens, chunk))
               if not r]
        assert not bad, (call, bad)
    assert (_prepared_launches()[0].c_state is not None) == (c_on == "1")
    prepared = plan._PREPARED.copy()
    plan._PREPARED.clear()
    full = hopper_flash.flash_attn_with_kvcache(**kw, causal=True, attention_chunk=chunk)  # the same keys, in place
    assert torch.equal(out, full)
    plan._PREPARED.update(prepared)
    planned.clear()
    graph, g_out = capture(lambda: hopper_flash.flash_attn_with_kvcache(**kw, causal=True, attention_chunk=chunk))
    assert not planned  # captured through the prepared call
    new_cs = [10, 2000, 3000, 0]
    kw["cache_seqlens"].copy_(torch.tensor(new_cs, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    q, kc, vc = judged
    kc, vc = kc.clone(), vc.clone()
    for b, n in enumerate(new_cs):  # the cache as the replay leaves it
        kc[b, n:n + s_new], vc[b, n:n + s_new] = kw["k"][b], kw["v"][b]
    new_lens = [n + s_new for n in new_cs]
    bad = [r.message for r in check_kvcache(g_out, q, kc, vc, new_lens, causal=True,
                                            starts=_starts(kw, new_lens, chunk)) if not r]
    assert not bad, bad


@pytest.mark.parametrize("growth", ["view", "new-tensor"])
@pytest.mark.parametrize("c_on", ["0", "1"], ids=["python", "c"])
def test_kvcache_prepared_calls_of_a_growing_cache_gpu(monkeypatch, growth, c_on):
    """A contiguous cache that grows by a key per call (a view ``k_cache[:, :L]``
    of a longer buffer, or a new [B, Hkv, L, D] tensor seen as BSHD, as
    transformers' caches are) keeps its prepared call: from the third call on
    no plan but at a new KV tile count, each call's own length and strides
    launched; every output judged against float64 (NaN outside every row's
    live keys: lengths per row inside the cache's, left pads too)."""
    monkeypatch.setenv("HOPPER_FLASH_C_LAUNCH", c_on)
    monkeypatch.setattr(plan, "_PREPARED", {})
    monkeypatch.setattr(plan, "_SIGHTED", {})
    planned = []
    real = plan.launch_forward
    monkeypatch.setattr(plan, "launch_forward", lambda *a, **kw: planned.append(1) or real(*a, **kw))
    gen = torch.Generator(device="cuda").manual_seed(4)
    batch, nheads, nheads_kv, capacity = 3, 32, 8, 4400
    q = rnd(batch, 1, nheads, 128, seed=5)
    for step, length in enumerate((4000, 4001, 4050, 4095, 4096, 4097, 4200)):
        # (fresh values each call: the NaN below may not leak into a later call's live keys)
        if growth == "view":  # [B, S, Hkv, D] buffers of one capacity, seen up to the length
            kc, vc = (torch.randn(batch, capacity, nheads_kv, 128, device="cuda", generator=gen)
                      .to(torch.bfloat16)[:, :length] for _ in "kv")
        else:  # [B, Hkv, L, D], a new tensor per length, seen as BSHD
            kc, vc = (torch.randn(batch, nheads_kv, length, 128, device="cuda", generator=gen)
                      .to(torch.bfloat16).transpose(1, 2) for _ in "kv")
        ends = torch.tensor([length, length - 7, length // 2], dtype=torch.int32, device="cuda")
        pads = torch.tensor([0, 3, 100], dtype=torch.int32, device="cuda")
        for t in (kc, vc):  # nothing outside each row's live keys may count
            t[1, length - 7:] = float("nan")
            t[2, length // 2:] = float("nan")
            t[2, :100] = float("nan")
        planned.clear()
        out = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=ends, cache_leftpad=pads, causal=True)
        if 2 <= step <= 4:  # 4000-4096 keys: 32 KV tiles of 128, prepared at the second call
            assert not planned, (step, length)
        if length == 4097:  # a 33rd tile: planned (and prepared, once its split's combine launches directly)
            assert planned
        bad = [r.message for r in check_kvcache(out, q, kc, vc, ends.tolist(), causal=True, starts=pads.tolist())
               if not r]
        assert not bad, (length, bad)
    assert len(plan._PREPARED) == 1
