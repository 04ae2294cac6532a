"""``flash_attn_with_kvcache``'s prepared calls on the CPU (stand-in kernels,
``kvcache`` module docstring): a call whose signature launched directly
before skips the checks and the plan, and must hand the kernels exactly what
a direct launch of the same arguments hands them, its own lengths (after
its append, where it has new keys), cache rows, page table, q and caches
included (the prepared launch patches their
addresses into templates built from another call's). The C launch of the
same templates is checked against a stand-in libcuda in
tests/test_c_launch_cpu.py; outputs on the GPU in tests/test_c_launch_gpu.py."""
from types import SimpleNamespace

import pytest
import torch
from test_direct_launch_cpu import META, fakes, remembering  # noqa: F401  (fixtures)

from hopper_flash import chunked, kvcache, launcher, plan
from hopper_flash.kernels import forward

ROWS = 4  # cache rows where cache_batch_idx picks them


def _recording_launch(calls: list, descriptors: int) -> launcher.KernelLaunch:
    """A compiled kernel whose launcher records its flat arguments, each TMA
    map as ``("map", address)``."""
    run = SimpleNamespace(launch_cooperative_grid=False, launch_pdl=False)
    direct = launcher._Direct(lambda *a: calls.append(list(a[13:])), lambda address, *a: ("map", address), {10: 9},
                              [META] * descriptors, False, run)
    return launcher.KernelLaunch(SimpleNamespace(function=1, packed_metadata=(4, 1, 1)), direct=direct)


def _arguments(layout: str, seed: int, page_size: int = 64) -> dict:
    """Fresh tensors (new addresses, new lengths and tables) of one signature."""
    g = torch.Generator().manual_seed(seed)
    batch, nheads, nheads_kv, seqlen_q = 2, 8, 2, (48 if layout == "view-48" else 1)
    if layout.startswith("view"):
        nheads = 10  # a group of 5: PackGQA from a packed view of q (a copy past one query per row)
    q = torch.randn(batch, seqlen_q, nheads, 128, generator=g).to(torch.bfloat16)
    args = dict(q=q, cache_seqlens=torch.randint(1, 8000, (batch,), generator=g, dtype=torch.int32))
    if layout.startswith("pages"):
        pages = 8192 // page_size
        args["k_cache"], args["v_cache"] = (torch.randn(batch * pages + 3, page_size, nheads_kv, 128, generator=g)
                                            .to(torch.bfloat16) for _ in "kv")
        args["page_table"] = torch.randperm(batch * pages + 3, generator=g)[:batch * pages].view(batch, pages).to(
            torch.int32)
        if layout == "pages-rows":
            args["cache_batch_idx"] = torch.tensor([1, 0], dtype=torch.int32)
    else:
        rows = ROWS if layout == "rows" else batch
        args["k_cache"], args["v_cache"] = (torch.randn(rows, 8192, nheads_kv, 128, generator=g).to(torch.bfloat16)
                                            for _ in "kv")
        if layout == "rows":
            args["cache_batch_idx"] = torch.randperm(ROWS, generator=g)[:batch].to(torch.int32)
        if layout == "leftpad":  # flash-attn's cache_leftpad: each row's first live key
            args["cache_leftpad"] = (args["cache_seqlens"] * torch.rand(batch, generator=g)).to(torch.int32)
    return args


def _after(append_args):
    """The CPU stand-in for the append kernel's lengths (``kvcache._append``'s
    second result): ``cache_seqlens + S_new``, a fresh vector, from the
    stubbed ``_append``'s arguments after q (``k_cache, v_cache, k, v,
    seqlens, ...``)."""
    return append_args[4] + append_args[2].shape[1]


def _direct_from_now_on() -> tuple[list, list]:
    """After a first (JIT) call: every launch of its kernels is direct, its
    flat arguments recorded (the forward's, the combine's)."""
    [key] = plan._COMPILED
    calls, c_calls = [], []
    plan._COMPILED[key] = _recording_launch(calls, 4)
    for c_key in plan._COMBINE_OF:
        plan._COMBINE_OF[c_key] = _recording_launch(c_calls, 0)
    return calls, c_calls


@pytest.fixture
def counted(fakes, remembering, monkeypatch):  # noqa: F811
    """The checks pass for CPU tensors (counted); plan.launch_forward counted."""
    log = []
    monkeypatch.setattr(kvcache, "validate_kvcache",
                        lambda q, *a, **kw: log.append("validate") or q.shape[-1] ** -0.5)
    real = plan.launch_forward
    monkeypatch.setattr(plan, "launch_forward", lambda *a, **kw: log.append("plan") or real(*a, **kw))
    return log


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "rows", "pages", "view-1", "view-48", "leftpad"])
def test_a_prepared_kvcache_call_launches_what_a_direct_launch_would(counted, layout, return_lse):
    def call(args):
        return kvcache.flash_attn_with_kvcache(**args, causal=True, return_softmax_lse=return_lse)

    call(_arguments(layout, 0))  # compiles (JIT stand-ins)
    [key] = plan._COMPILED
    assert key[5].seqused and key[5].kv_batch == (layout == "rows") and key[5].page_size == (64 * (layout == "pages"))
    assert key[5].pack_view == layout.startswith("view") and key[5].leftpad == (layout == "leftpad")
    split = key[5].split
    calls, c_calls = _direct_from_now_on()
    call(_arguments(layout, 1))  # direct, and prepared after it
    assert len(plan._PREPARED) == 1 and len(calls) == 1
    counted.clear()

    args = _arguments(layout, 2)
    prepared = call(args)  # the prepared call: no checks, no plan
    assert counted == [] and len(calls) == 2 and len(c_calls) == 2 * split
    plan._PREPARED.clear()
    direct = call(args)  # the same arguments, launched directly
    assert counted == ["validate", "plan"] and len(calls) == 3

    # The direct launch's arguments with its own buffers (out, LSE, partials)
    # renamed to the prepared call's: every other argument must be the same,
    # the maps' addresses (q or its packed copy, the caches) included.
    (out_p, lse_p), (out_d, lse_d) = [r if return_lse else (r, None) for r in (prepared, direct)]
    rename = {out_d.data_ptr(): out_p.data_ptr()}
    if lse_d is not None:
        rename[lse_d.data_ptr()] = lse_p.data_ptr()
    names = forward.attention_forward_kernel.real.arg_names
    n_desc = 4 * 9
    got, want = calls[1], calls[2]
    assert len(got) == len(want)
    p_args = dict(zip(names[4:], got[n_desc:]))
    d_args = dict(zip(names[4:], want[n_desc:]))
    if split:
        for name in ("o_part_ptr", "lse_part_ptr"):
            rename[d_args[name]] = p_args[name]
    q_map = want[0]
    if layout == "view-48":  # q's packed copy, a fresh tensor per call
        rename[q_map[1]] = got[0][1]
    else:
        assert q_map == ("map", args["q"].data_ptr())
    assert want[9] == ("map", args["k_cache"].data_ptr()) and want[18] == ("map", args["v_cache"].data_ptr())

    def renamed(x):
        return ("map", rename.get(x[1], x[1])) if isinstance(x, tuple) else rename.get(x, x)
    assert got == [renamed(x) for x in want]
    assert p_args["seqused_ptr"] == args["cache_seqlens"].data_ptr()
    if layout == "rows":
        assert p_args["kv_batch_ptr"] == args["cache_batch_idx"].data_ptr()
    if layout == "pages":
        assert p_args["page_table_ptr"] == args["page_table"].data_ptr()
    if layout == "leftpad":  # the kernel reads the left pads through cu_k_ptr
        assert p_args["cu_k_ptr"] == args["cache_leftpad"].data_ptr()
    if split:
        c_got, c_want = c_calls[-2], c_calls[-1]
        assert c_got == [renamed(x) for x in c_want]
    assert out_p.shape == out_d.shape and out_p.is_contiguous()


@pytest.mark.parametrize("layout", ["contiguous", "pages"])
def test_a_prepared_call_with_an_append_appends_then_attends_over_the_new_lengths(counted, layout, monkeypatch):
    """With new keys the prepared call launches the append as the full path
    does (the same arguments), then the attention over the lengths after it:
    a fresh vector, whose address the prepared launch passes."""
    appends, lengths = [], []  # (the CPU stand-in returns the lengths the append kernel writes)
    monkeypatch.setattr(kvcache, "_append", lambda q, *a: appends.append(a) or lengths.append(_after(a)) or
                        (q, lengths[-1]))

    def call(args):
        return kvcache.flash_attn_with_kvcache(**args, causal=True)

    def with_new_keys(seed):
        args = _arguments(layout, seed)
        g = torch.Generator().manual_seed(100 + seed)
        args["k"], args["v"] = (torch.randn(2, 3, 2, 128, generator=g).to(torch.bfloat16) for _ in "kv")
        return args

    call(with_new_keys(0))
    calls, _ = _direct_from_now_on()
    call(with_new_keys(1))
    assert len(plan._PREPARED) == 1
    counted.clear()
    args = with_new_keys(2)
    call(args)  # prepared
    assert counted == [] and len(appends) == 3 and len(calls) == 2
    seqused = lengths[-1]
    assert torch.equal(seqused, args["cache_seqlens"] + 3)
    names = forward.attention_forward_kernel.real.arg_names
    p_args = dict(zip(names[4:], calls[-1][4 * 9:]))
    assert p_args["seqused_ptr"] == seqused.data_ptr()
    plan._PREPARED.clear()
    call(args)  # the full path on the same arguments: the same append
    assert counted == ["validate", "plan"] and len(appends) == 4

    def same(a, b):
        return all(torch.equal(x, y) and x.data_ptr() == y.data_ptr() if isinstance(x, torch.Tensor) else x == y
                   for x, y in zip(a, b))
    assert same(appends[2], appends[3])


def test_a_prepared_call_that_cannot_serve_does_not_append(counted, monkeypatch):
    """A prepared call whose launch is gone (the compiled-kernel table
    replaced) returns before the append: the full path appends, once."""
    appends = []
    monkeypatch.setattr(kvcache, "_append", lambda q, *a: appends.append(a) or (q, _after(a)))
    args = _arguments("contiguous", 0)
    args["k"] = args["v"] = torch.randn(2, 1, 2, 128).to(torch.bfloat16)
    kvcache.flash_attn_with_kvcache(**args, causal=True)
    _direct_from_now_on()
    kvcache.flash_attn_with_kvcache(**args, causal=True)
    assert len(plan._PREPARED) == 1 and len(appends) == 2
    monkeypatch.setattr(plan, "_COMPILED", dict(plan._COMPILED))  # another table: the prepared call stands down
    counted.clear()
    kvcache.flash_attn_with_kvcache(**args, causal=True)
    assert counted == ["validate", "plan"] and len(appends) == 3


@pytest.mark.parametrize("change", ["lengths-misaligned", "table-width", "scale", "window", "contract", "append",
                                    "leftpad", "leftpad-misaligned", "chunk"])
def test_a_call_unlike_the_prepared_one_takes_the_full_path(counted, change, monkeypatch):
    """A call that differs from the prepared one in what the checks or the
    plan read, or that the prepared launch cannot replay, takes the full path."""
    layout = {"table-width": "pages", "leftpad-misaligned": "leftpad"}.get(change, "contiguous")

    def call(args, **kw):
        return kvcache.flash_attn_with_kvcache(**args, causal=True, **kw)

    call(_arguments(layout, 0))
    _direct_from_now_on()
    call(_arguments(layout, 1))
    assert len(plan._PREPARED) == 1
    args, kw = _arguments(layout, 2), {}
    if change == "lengths-misaligned":  # the kernels specialise on 16-byte pointers
        args["cache_seqlens"] = torch.zeros(5, dtype=torch.int32)[1:3].copy_(args["cache_seqlens"])
    elif change == "table-width":
        args["page_table"] = torch.cat([args["page_table"], args["page_table"][:, :1]], 1)
    elif change == "scale":
        kw["softmax_scale"] = 0.5
    elif change == "window":
        kw["window_size"] = (100, 0)
    elif change == "contract":
        monkeypatch.setattr(kvcache, "check_contract", lambda *a: counted.append("contract"))
        kw["check_contract"] = True
    elif change == "leftpad":  # left pads where the prepared call had none: another signature
        args["cache_leftpad"] = torch.zeros(2, dtype=torch.int32)
    elif change == "leftpad-misaligned":  # copied per call to align them: never the caller's
        args["cache_leftpad"] = torch.zeros(5, dtype=torch.int32)[1:3].copy_(args["cache_leftpad"])
    elif change == "chunk":  # chunked attention: another signature (its own prepared call, derived per call)
        kw["attention_chunk"] = 1024
    elif change == "append":  # new keys: another signature
        kw["k"] = kw["v"] = torch.randn(2, 1, 2, 128).to(torch.bfloat16)
        monkeypatch.setattr(kvcache, "_append", lambda q, *a: (q, _after(a)))
    counted.clear()
    call(args, **kw)
    assert "plan" in counted, "a call the prepared launch cannot serve took it"
    assert ("contract" in counted) == (change == "contract")


@pytest.mark.parametrize("layout", ["lengths-strided", "pages-copied", "pages-gathered", "pages-rows",
                                    "leftpad-strided", "leftpad-misaligned"])
def test_layouts_a_prepared_launch_cannot_replay_are_never_prepared(counted, layout):
    """Lengths or left pads copied per call (not contiguous, or not 16-byte
    aligned), pages copied (a page size TMA cannot read in place) or
    gathered (the pools are per-call kernel arguments), and cache rows with
    pages: every call takes the full path."""
    page_size = {"pages-copied": 48, "pages-gathered": 8}.get(layout, 64)
    for seed in range(4):
        args = _arguments({"lengths-strided": "contiguous", "leftpad-strided": "leftpad",
                           "leftpad-misaligned": "leftpad"}.get(layout, layout), seed, page_size)
        if layout == "lengths-strided":
            args["cache_seqlens"] = torch.zeros(4, dtype=torch.int32)[::2].copy_(args["cache_seqlens"])
        if layout == "leftpad-strided":
            args["cache_leftpad"] = torch.zeros(4, dtype=torch.int32)[::2].copy_(args["cache_leftpad"])
        if layout == "leftpad-misaligned":
            args["cache_leftpad"] = torch.zeros(5, dtype=torch.int32)[1:3].copy_(args["cache_leftpad"])
        counted.clear()
        kvcache.flash_attn_with_kvcache(**args, causal=True)
        assert "plan" in counted, seed
        if seed == 0:
            _direct_from_now_on()
    assert not plan._PREPARED


def test_a_signature_is_prepared_at_its_second_launch(counted):
    """A signature met once is not prepared (a call made once would pay for
    a prepared launch nothing reuses); the second launch prepares it, even
    after a first through the JIT."""
    def call(seed):
        return kvcache.flash_attn_with_kvcache(**_arguments("contiguous", seed), causal=True)

    call(0)  # the JIT's launch: met once
    _direct_from_now_on()
    assert not plan._PREPARED
    call(1)  # met again: prepared now, for the next
    assert len(plan._PREPARED) == 1
    counted.clear()
    call(2)
    assert counted == []


@pytest.mark.parametrize("growth", ["view", "new-tensor"])
def test_a_growing_cache_keeps_its_prepared_call(counted, growth):
    """A contiguous cache's length is not part of the signature (nor the
    strides that follow it): a cache passed as a growing view
    (``k_cache[:, :L]``) or re-made one key longer each step (transformers'
    [B, Hkv, L, D] caches, seen as BSHD) keeps its prepared call, one launch
    per KV tile count, and each call hands the kernels its own length and
    strides: what a direct launch of the same arguments hands them."""
    big = _arguments("contiguous", 0)
    q, lens = big["q"], big["cache_seqlens"]
    kc, vc = (torch.randn(2, 8400, 2, 128).to(torch.bfloat16) for _ in "kv")
    heads_first = [x.transpose(1, 2).contiguous() for x in (kc, vc)]  # [B, Hkv, S, D]

    def caches(length):
        if growth == "view":
            return kc[:, :length], vc[:, :length]
        return tuple(x[:, :, :length].contiguous().transpose(1, 2) for x in heads_first)

    def call(k_cache, v_cache):
        return kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True)

    call(*caches(8100))  # the JIT's
    calls, _ = _direct_from_now_on()
    call(*caches(8101))  # direct, prepared after it
    assert len(plan._PREPARED) == 1
    names = forward.attention_forward_kernel.real.arg_names
    for length, planned in ((8150, False), (8192, False), (8193, True), (8300, False)):
        k_now, v_now = caches(length)
        counted.clear()
        prepared = call(k_now, v_now)
        assert ("plan" in counted) == planned, (length, counted)  # a new KV tile count at 8193: planned once
        assert len(plan._PREPARED) == 1
        kept = dict(plan._PREPARED)
        plan._PREPARED.clear()
        direct = call(k_now, v_now)
        plan._PREPARED.clear()
        plan._PREPARED.update(kept)
        got, want = dict(zip(names[4:], calls[-2][4 * 9:])), dict(zip(names[4:], calls[-1][4 * 9:]))
        want = {n: prepared.data_ptr() if x == direct.data_ptr() else x for n, x in want.items()}
        if want["o_part_ptr"] != prepared.data_ptr():  # split: each call's own partials
            want.update(o_part_ptr=got["o_part_ptr"], lse_part_ptr=got["lse_part_ptr"])
        assert got == want and got["seqlen_k"] == length, length
        assert calls[-2][:27] == calls[-1][:27], length  # q's, k's and v's maps: each call's length and strides


@pytest.mark.parametrize("layout,s_new", [("contiguous", 0), ("rows", 0), ("leftpad", 0), ("pages", 0),
                                          ("contiguous", 3), ("pages", 3)])
def test_a_prepared_chunked_decode_step_derives_its_own_last_chunks(counted, layout, s_new, monkeypatch):
    """A chunked decode step (``attention_chunk``, one query per row: the
    decode route over each row's last chunk) is prepared as a plain decode
    step is, and each call derives its rows' last chunks from its own
    lengths (after its append of ``s_new`` keys, if any; and its left pads,
    or page table): the kernels get what a direct launch of the same
    arguments hands them, the derived left pads, or lengths and shifted
    table, rebuilt for the call and equal to the torch reference's
    (``chunked.last_chunk_start``, ``shifted_pages``)."""
    chunk = 1024  # (16 pages of 64)
    derived = []
    for name in ("last_chunk_leftpad", "last_chunk_pages"):
        real = getattr(chunked, name)
        monkeypatch.setattr(chunked, name, lambda *a, _real=real: derived.append(_real(*a)) or derived[-1])
    after = []  # the lengths after each call's append (the CPU stand-in's: no append kernel)
    monkeypatch.setattr(kvcache, "_append", lambda q, *a: after.append(_after(a)) or (q, after[-1]))

    def call(args):
        return kvcache.flash_attn_with_kvcache(**args, causal=True, attention_chunk=chunk)

    def arguments(seed):
        args = _arguments(layout, seed)
        if s_new:
            args["k"], args["v"] = (torch.randn(2, s_new, 2, 128).to(torch.bfloat16) for _ in "kv")
        return args

    call(arguments(0))  # compiles (JIT stand-ins)
    [key] = plan._COMPILED
    assert key[5].leftpad == (layout != "pages") and key[5].page_size == 64 * (layout == "pages")
    calls, _ = _direct_from_now_on()
    call(arguments(1))  # direct, and prepared after it
    assert len(plan._PREPARED) == 1 and next(iter(plan._PREPARED.values())).cache.chunk == chunk
    counted.clear()
    args = arguments(2)
    prepared = call(args)  # the prepared call: no checks, no plan, its own last chunks
    assert counted == [] and len(calls) == 2
    mine = derived[-1]
    plan._PREPARED.clear()
    direct = call(args)
    assert counted == ["validate", "plan"] and len(calls) == 3
    theirs = derived[-1]

    lens = args["cache_seqlens"] + s_new
    if layout == "pages":
        start = chunked.last_chunk_start(lens, chunk)
        expected = (lens - start, chunked.shifted_pages(args["page_table"], start, 64, chunk // 64))
        mine_t, theirs_t = mine, theirs
    else:
        pad = args.get("cache_leftpad", 0)
        expected = ((pad + chunked.last_chunk_start(lens - pad, chunk)).to(torch.int32),)
        mine_t, theirs_t = (mine,), (theirs,)
    for m, t, e in zip(mine_t, theirs_t, expected):
        assert m.data_ptr() != t.data_ptr() and torch.equal(m, e) and torch.equal(t, e)

    names = forward.attention_forward_kernel.real.arg_names
    got, want = dict(zip(names[4:], calls[-2][4 * 9:])), dict(zip(names[4:], calls[-1][4 * 9:]))
    rename = {direct.data_ptr(): prepared.data_ptr(), **{t.data_ptr(): m.data_ptr() for m, t in zip(mine_t, theirs_t)}}
    if s_new:  # each call's lengths after its append: a fresh vector, the same values
        assert torch.equal(after[-2], lens) and torch.equal(after[-1], lens)
        rename[after[-1].data_ptr()] = after[-2].data_ptr()
    if got["o_part_ptr"] != prepared.data_ptr():  # split: each call's own partials
        rename.update({want["o_part_ptr"]: got["o_part_ptr"], want["lse_part_ptr"]: got["lse_part_ptr"]})
    assert got == {n: rename.get(x, x) for n, x in want.items()}
    # q's and the caches' maps the same; out's the same but for its address
    assert calls[-2][:27] == calls[-1][:27] and calls[-2][28:36] == calls[-1][28:36]
    assert calls[-2][27] == ("map", prepared.data_ptr()) and calls[-1][27] == ("map", direct.data_ptr())
    if layout == "pages":
        assert got["seqused_ptr"] == mine[0].data_ptr() and got["page_table_ptr"] == mine[1].data_ptr()
    else:  # the kernel reads the left pads through cu_k_ptr
        assert got["cu_k_ptr"] == mine.data_ptr()
        assert got["seqused_ptr"] == (after[-2] if s_new else args["cache_seqlens"]).data_ptr()
    if layout == "rows":
        assert got["kv_batch_ptr"] == args["cache_batch_idx"].data_ptr()
