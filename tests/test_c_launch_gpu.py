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
