"""The transformers attention backend (hopper_flash.integrations.transformers).

CPU tests: registration (no GPU needed), the errors for what the kernel cannot
compute exactly (raised before the GPU is touched), the mask analysis, and the
call contract end to end: a small random Llama on CPU whose hopper_flash
backend calls a stand-in for ``flash_attn_func`` (the float64 reference) must
reproduce transformers' own "sdpa" logits, which checks layouts, GQA, scale,
causal alignment and the mask handling of cached calls.

GPU tests (``gpu`` marker): the same model in bf16 on a Hopper GPU with the
real kernel, against "sdpa".
"""
import functools
import math
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hopper_flash  # noqa: E402
from hopper_flash.integrations import transformers as hft  # noqa: E402
from hopper_flash.checks import window_bounds  # noqa: E402
from hopper_flash.reference import attention_reference, rel_fro_err  # noqa: E402

NAME = "hopper_flash"


def _llama_config(**overrides):
    kwargs = dict(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=1024)
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


def _llama(seed=0, **overrides):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_llama_config(**overrides)).eval()


@functools.lru_cache(maxsize=None)
def _cb_era() -> str:
    """How this transformers' continuous batching reaches the attention
    function (hopper_flash/integrations/transformers.py): "paged" up to 5.18
    (the "paged|" name), "cache" in 5.19-5.23 (the function gets the cache
    and writes the new keys), "layer" from 5.24 (the model's layer updates
    the cache before the call)."""
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.19.0.dev0"):
        return "paged"
    from transformers.models.llama import modeling_llama
    import inspect

    return "layer" if "cache" in inspect.signature(modeling_llama.LlamaAttention.forward).parameters else "cache"


def _impl_name(impl: str) -> str:
    """``impl`` as the model's config names it once set: transformers 5.19 on
    drops the ``paged|`` of every name but ``paged|eager``."""
    if impl.startswith("paged|") and impl != "paged|eager" and _cb_era() != "paged":
        return impl.removeprefix("paged|")
    return impl


def _set_attn(model, impl):
    """Switch the attention implementation; returns the model to run."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
        assert model.config._attn_implementation == _impl_name(impl)
        return model
    # Older transformers: a second model with the same weights.
    other = type(model)._from_config(model.config, attn_implementation=impl)
    other.load_state_dict(model.state_dict())
    return other.to(device=next(model.parameters()).device, dtype=next(model.parameters()).dtype).eval()


@pytest.fixture
def registered():
    return hft.register()


@pytest.fixture
def fake_kernel(monkeypatch):
    """Replace hopper_flash.flash_attn_func by the float64 reference; record the calls."""
    calls = []

    def fake(q, k, v, *, softmax_scale=None, causal=False, return_lse=False, window_size=(-1, -1), softcap=0.0,
             learnable_sink=None):
        calls.append(dict(q=q, k=k, v=v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                          softcap=softcap, learnable_sink=learnable_sink))
        window = window_bounds(window_size, causal)
        out, _ = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                     softcap=softcap, sink=learnable_sink)
        return out.to(q.dtype)

    monkeypatch.setattr(hopper_flash, "flash_attn_func", fake)
    return calls


def _varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, seqused_q=None, seqused_k=None, softmax_scale=None,
                     causal=False, block_table=None, window_size=(-1, -1), **unused):
    """A differentiable float32 flash_attn_varlen_func (per-sequence softmax attention) that also checks
    the host bounds and the slot contract the kernel relies on; rows outside every sequence are 0.
    With ``block_table`` k and v are page pools, sequence b's keys the first ones of its pages;
    ``window_size`` flash-attn's, per sequence."""
    window = window_bounds(window_size, causal)
    if block_table is not None:
        lens = (cu_k[1:] - cu_k[:-1]).tolist()
        page = k.shape[1]
        k, v = (torch.cat([pool[block_table[b, :-(-n // page)].long()].flatten(0, 1)[:n] for b, n in
                           enumerate(lens)]) for pool in (k, v))
        cu_k = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_q_l, cu_k_l = cu_q.tolist(), cu_k.tolist()
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q_l[0] >= 0 and cu_k_l[0] >= 0
    assert cu_q_l == sorted(cu_q_l) and cu_k_l == sorted(cu_k_l), "cu_seqlens not monotonic"
    assert cu_q_l[-1] <= q.shape[0] and cu_k_l[-1] <= k.shape[0], "cu_seqlens past the tensors' rows"
    rows, pos = [], 0
    for b in range(len(cu_q_l) - 1):
        qs, ks = cu_q_l[b], cu_k_l[b]
        lq = int(seqused_q[b]) if seqused_q is not None else cu_q_l[b + 1] - qs
        lk = int(seqused_k[b]) if seqused_k is not None else cu_k_l[b + 1] - ks
        assert 0 <= lq <= cu_q_l[b + 1] - qs and 0 <= lk <= cu_k_l[b + 1] - ks, "seqused past its slot"
        assert lq <= max_q and lk <= max_k, "max_seqlen below a length"
        if lq == 0:
            continue
        qb, kb, vb = (x.float().transpose(0, 1) for x in (q[qs:qs + lq], k[ks:ks + lk], v[ks:ks + lk]))
        group = qb.shape[0] // kb.shape[0]
        kb, vb = kb.repeat_interleave(group, 0), vb.repeat_interleave(group, 0)
        scale = softmax_scale if softmax_scale is not None else qb.shape[-1] ** -0.5
        s = qb @ kb.transpose(1, 2) * scale
        if causal:
            s = s.masked_fill(torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + lk - lq, -math.inf)
        if window is not None:
            left, right = window
            rel = torch.arange(lk)[None, :] - (torch.arange(lq)[:, None] + lk - lq)  # key minus query position
            if left >= 0:
                s = s.masked_fill(rel < -left, -math.inf)
            if right >= 0:
                s = s.masked_fill(rel > right, -math.inf)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        rows += [torch.zeros(qs - pos, *q.shape[1:], dtype=q.dtype), (p @ vb).transpose(0, 1).to(q.dtype)]
        pos = qs + lq
    rows.append(torch.zeros(q.shape[0] - pos, *q.shape[1:], dtype=q.dtype))
    return torch.cat(rows)


@pytest.fixture
def fake_varlen(monkeypatch):
    """Replace hopper_flash.flash_attn_varlen_func by a float32 stand-in; record the calls."""
    calls = []

    def fake(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        calls.append(dict(q=q, k=k, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, **kwargs))
        return _varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)

    monkeypatch.setattr(hopper_flash, "flash_attn_varlen_func", fake)
    return calls


@pytest.fixture
def fake_kvcache(monkeypatch):
    """Replace hopper_flash.flash_attn_with_kvcache by the float64 reference over each row's live keys
    (``cache_leftpad[b] .. cache_seqlens[b] - 1``, bottom-right causal against them); record the calls."""
    calls = []

    def fake(q, k_cache, v_cache, *, cache_seqlens=None, cache_leftpad=None, softmax_scale=None, causal=False,
             window_size=(-1, -1), softcap=0.0, learnable_sink=None, **unused):
        assert not unused, unused
        calls.append(dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                          cache_leftpad=cache_leftpad, softmax_scale=softmax_scale, causal=causal,
                          window_size=window_size, softcap=softcap, learnable_sink=learnable_sink))
        assert cache_seqlens.dtype == cache_leftpad.dtype == torch.int32
        out = torch.empty(*q.shape[:3], v_cache.shape[3], dtype=q.dtype)
        for b in range(q.shape[0]):
            lo, hi = int(cache_leftpad[b]), int(cache_seqlens[b])
            assert 0 <= lo <= hi <= k_cache.shape[1], "the KV cache contract"
            if hi == lo:
                out[b] = 0
                continue
            ref, _ = attention_reference(q[b:b + 1], k_cache[b:b + 1, lo:hi], v_cache[b:b + 1, lo:hi],
                                         causal=causal, softmax_scale=softmax_scale,
                                         window=window_bounds(window_size, causal), softcap=softcap,
                                         sink=learnable_sink)
            out[b] = ref[0].nan_to_num(0.0).to(q.dtype)
        return out

    monkeypatch.setattr(hopper_flash, "flash_attn_with_kvcache", fake)
    return calls


class _Module(torch.nn.Module):
    def __init__(self, is_causal=True):
        super().__init__()
        self.is_causal = is_causal


def _qkv(batch=2, heads=4, heads_kv=2, seqlen_q=16, seqlen_k=16, dim=128, dtype=torch.bfloat16):
    q = torch.randn(batch, heads, seqlen_q, dim).to(dtype)
    k = torch.randn(batch, heads_kv, seqlen_k, dim).to(dtype)
    v = torch.randn(batch, heads_kv, seqlen_k, dim).to(dtype)
    return q, k, v


def _bool_mask(batch, seqlen_q, seqlen_k, pad_left=0):
    """Bottom-right causal 4-D boolean mask, with `pad_left` padded keys in batch row 0."""
    rows = torch.arange(seqlen_q)[:, None]
    cols = torch.arange(seqlen_k)[None, :]
    mask = (cols <= rows + (seqlen_k - seqlen_q)).expand(batch, 1, seqlen_q, seqlen_k).clone()
    mask[0, :, :, :pad_left] = False
    return mask


# --------------------------------------------------------------------------
# Registration (CPU)
# --------------------------------------------------------------------------
def test_register_returns_name_and_registers():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert hft.register() == NAME
    assert NAME in transformers.AttentionInterface()
    assert NAME in ALL_ATTENTION_FUNCTIONS
    assert ALL_ATTENTION_FUNCTIONS[NAME] is hft.hopper_flash_attention_forward
    assert NAME in ALL_ATTENTION_FUNCTIONS.valid_keys()
    assert hft.is_registered()


def test_register_registers_a_mask_function():
    masking_utils = pytest.importorskip("transformers.masking_utils")
    hft.register()
    masks = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS
    assert NAME in masks._global_mapping
    # FlashAttention's rule: None or the 2-D padding mask, which the backend turns into a varlen call.
    assert masks[NAME] is hft.padding_mask
    ones = torch.ones(2, 8, dtype=torch.bool)
    assert hft.padding_mask(2, 8, 8, attention_mask=ones) is None
    padded = ones.clone()
    padded[0, :3] = False
    assert torch.equal(hft.padding_mask(2, 8, 8, attention_mask=padded), padded)
    assert torch.equal(hft.padding_mask(2, 1, 6, attention_mask=padded), padded[:, -6:])


def test_register_is_idempotent():
    from transformers import modeling_utils

    assert hft.register() == NAME
    preload = getattr(modeling_utils, "lazy_import_flash_attention", None)
    assert hft.register() == NAME
    assert hft.register() == NAME
    assert getattr(modeling_utils, "lazy_import_flash_attention", None) is preload  # wrapped once at most
    assert transformers.AttentionInterface()[NAME] is hft.hopper_flash_attention_forward


def test_flash_preload_wrapper_skips_only_our_name(registered):
    """transformers 5.x pre-imports a FlashAttention kernel for every name containing "flash"."""
    from transformers import modeling_utils

    preload = getattr(modeling_utils, "lazy_import_flash_attention", None)
    if getattr(preload, "_hopper_flash_skips", None) != NAME:
        pytest.skip("this transformers does not pre-import FlashAttention for 'hopper_flash'")
    from transformers import modeling_flash_attention_utils

    assert preload(NAME) is None
    # every other name goes to transformers' own function
    assert preload.__wrapped__ is modeling_flash_attention_utils.lazy_import_flash_attention


def test_modeling_utils_does_not_take_our_name_for_flash_attention(registered):
    """Else models listing compatible FlashAttention builds (gpt-oss) swap
    hopper_flash for one of them; every other name is answered as before."""
    from transformers import modeling_utils
    from transformers.utils.generic import is_flash_attention_requested

    check = modeling_utils.is_flash_attention_requested
    if getattr(check, "_hopper_flash_skips", None) != NAME:
        pytest.skip("this transformers asks no such question in modeling_utils")
    assert check(requested_attention_implementation=NAME) is False
    assert check(requested_attention_implementation=f"paged|{NAME}") is False
    assert check(config=_llama_config(attn_implementation=NAME)) is False
    for other in ("flash_attention_2", "kernels-community/vllm-flash-attn3", "sdpa", "eager"):
        assert check(requested_attention_implementation=other) == is_flash_attention_requested(
            requested_attention_implementation=other)


def test_set_attn_implementation_on_cpu_without_gpu(registered):
    model = _llama(num_hidden_layers=1)
    model = _set_attn(model, NAME)
    assert model.config._attn_implementation == NAME
    # and back
    model = _set_attn(model, "sdpa")
    assert model.config._attn_implementation == "sdpa"


def test_model_built_with_hopper_flash_config(registered):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(_llama_config(num_hidden_layers=1),
                                                       attn_implementation=NAME)
    assert model.config._attn_implementation == NAME


def test_missing_transformers_gives_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    with pytest.raises(ImportError, match=r"needs the Hugging Face `transformers` package.*pip install"):
        hft.register()


# --------------------------------------------------------------------------
# Errors, raised before the GPU is touched (CPU tensors)
# --------------------------------------------------------------------------
PADDING = r"but not this 4-D attention mask"


def test_padding_mask_4d_bool_raises(fake_kernel):
    q, k, v = _qkv()
    mask = _bool_mask(2, 16, 16, pad_left=3)
    with pytest.raises(NotImplementedError, match=PADDING):
        hft.hopper_flash_attention_forward(_Module(), q, k, v, mask, scaling=0.1)
    assert fake_kernel == []


def test_padding_mask_4d_float_raises(fake_kernel):
    q, k, v = _qkv()
    bool_mask = _bool_mask(2, 16, 16, pad_left=3)
    mask = torch.zeros(bool_mask.shape).masked_fill(~bool_mask, torch.finfo(torch.float32).min)
    with pytest.raises(NotImplementedError, match=PADDING):
        hft.hopper_flash_attention_forward(_Module(), q, k, v, mask)
    mask = torch.zeros(bool_mask.shape).masked_fill(~bool_mask, -math.inf)
    with pytest.raises(NotImplementedError, match=PADDING):
        hft.hopper_flash_attention_forward(_Module(), q, k, v, mask)
    assert fake_kernel == []


def test_padding_mask_2d_takes_the_varlen_path(fake_kernel, fake_varlen):
    q, k, v = _qkv(batch=3)
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, 11:] = 0  # right padding
    out, _ = hft.hopper_flash_attention_forward(_Module(), q, k, v, mask, scaling=0.1)
    assert fake_kernel == [] and len(fake_varlen) == 1
    call = fake_varlen[0]
    # q's rows are compact (copied from the BHSD layout _qkv makes); k and v are read where they are: row b's
    # keys from row b·(2 heads·16) of a view whose rows step by one token (_thd_rows)
    assert call["cu_q"].tolist() == [0, 16 + 4, 32, 48] and call["cu_k"].tolist() == [0, 32 + 4, 64, 80]
    assert call["k"].data_ptr() == k.data_ptr() and call["k"].stride() == (128, 16 * 128, 1)
    assert call["seqused_k"].tolist() == [16, 12, 11] and call["seqused_q"].tolist() == [16, 12, 11]
    assert call["max_q"] == 16 and call["max_k"] == 16 and call["causal"] is True
    assert out.shape == (3, 16, 4, 128)
    # Each row equals its tokens run alone; padded query rows are zero.
    for b, (lo, hi) in enumerate([(0, 16), (4, 16), (0, 11)]):
        ref, _ = attention_reference(q[b:b + 1, :, lo:hi].transpose(1, 2), k[b:b + 1, :, lo:hi].transpose(1, 2),
                                     v[b:b + 1, :, lo:hi].transpose(1, 2), causal=True, softmax_scale=0.1)
        torch.testing.assert_close(out[b, lo:hi].double(), ref[0], atol=2e-2, rtol=2e-2)
        assert out[b, :lo].abs().sum() == 0 and out[b, hi:].abs().sum() == 0


@pytest.mark.parametrize("layout", ["bhsd", "bshd", "wider buffer", "v apart", "gradient"])
def test_padded_prefill_reads_keys_in_place(fake_varlen, layout):
    """A padded batch with as many queries as keys: k and v are read where they lie, with no copy, when
    their layout allows (BSHD as projected, BHSD as a KV cache holds them, a view of a wider
    buffer), q's rows stay compact (the output's); with gradients, or k and v laid out differently, the
    keys come as compact copies. NaN in the padding and past the mask; each row judged against the
    attention over its run alone."""
    batch, heads, heads_kv, seqlen, dim = 3, 4, 2, 16, 64
    width = 24 if layout == "wider buffer" else seqlen  # (the buffer's keys; the mask covers seqlen)
    q = torch.randn(batch, seqlen, heads, dim).to(torch.bfloat16).transpose(1, 2)  # BSHD, as projected

    def keys():
        if layout == "bshd":
            return torch.randn(batch, seqlen, heads_kv, dim).to(torch.bfloat16).transpose(1, 2)
        return torch.randn(batch, heads_kv, width, dim).to(torch.bfloat16)[:, :, :seqlen]

    k, v = keys(), keys()
    if layout == "v apart":
        v = torch.randn(batch, seqlen, heads_kv, dim).to(torch.bfloat16).transpose(1, 2)
    if layout == "gradient":
        q.requires_grad_()
    runs = [(0, 16), (5, 16), (0, 9)]
    mask = torch.zeros(batch, seqlen, dtype=torch.long)
    with torch.no_grad():
        for b, (lo, hi) in enumerate(runs):
            mask[b, lo:hi] = 1
            for t in (k, v):
                t[b, :, :lo] = t[b, :, hi:] = math.nan
        if layout == "wider buffer":
            for t in (k, v):
                t.as_strided((batch, heads_kv, width - seqlen, dim), t.stride(), seqlen * dim).fill_(math.nan)
    out, _ = hft.hopper_flash_attention_forward(_Module(), q, k, v, mask, scaling=0.1)
    (call,) = fake_varlen
    in_place = layout in ("bhsd", "bshd", "wider buffer")
    rows = {"bhsd": heads_kv * seqlen, "wider buffer": heads_kv * width}.get(layout, seqlen)
    assert (call["k"].data_ptr() == k.data_ptr()) is in_place
    assert call["cu_k"].tolist() == [b * rows + lo for b, (lo, _) in enumerate(runs)] + [call["k"].shape[0]]
    assert call["cu_q"].tolist() == [b * seqlen + lo for b, (lo, _) in enumerate(runs)] + [batch * seqlen]
    assert call["q"].data_ptr() == q.data_ptr()  # (BSHD: a view)
    for b, (lo, hi) in enumerate(runs):
        ref, _ = attention_reference(*(t[b:b + 1, :, lo:hi].transpose(1, 2).detach() for t in (q, k, v)),
                                     causal=True, softmax_scale=0.1)
        torch.testing.assert_close(out[b, lo:hi].double(), ref[0], atol=2e-2, rtol=2e-2)
        assert out[b, :lo].abs().sum() == 0 and out[b, hi:].abs().sum() == 0


@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_padding_mask_2d_decode_step_reads_the_cache_in_place(fake_varlen, fake_kvcache, seqlen_q):
    """Fewer queries than keys over left-padded keys, no gradient: one KV cache call on views of the
    batch (no copy), each row's run from its first token (cache_leftpad) to its end (cache_seqlens); a
    static cache's columns past the mask are never live."""
    q, k, v = _qkv(batch=3, seqlen_q=seqlen_q, seqlen_k=12)
    mask = torch.ones(3, 10, dtype=torch.bool)  # two empty static-cache slots past the mask
    mask[0, :6] = False
    mask[2, :] = False  # a row with no token: zero output
    k[0, :, :6] = v[0, :, :6] = math.nan  # padding and empty slots hold anything
    k[:, :, 10:] = v[:, :, 10:] = math.nan
    out, _ = hft.hopper_flash_attention_forward(_Module(), q, k, v, mask, scaling=0.1)
    assert fake_varlen == [] and len(fake_kvcache) == 1
    call = fake_kvcache[0]
    for name, t in (("q", q), ("k_cache", k), ("v_cache", v)):
        assert call[name].data_ptr() == t.data_ptr() and call[name].shape == t.transpose(1, 2).shape, name
    assert call["cache_leftpad"].tolist() == [6, 0, 0] and call["cache_seqlens"].tolist() == [10, 10, 0]
    assert call["causal"] is (seqlen_q > 1) and call["softmax_scale"] == 0.1
    assert out.shape == (3, seqlen_q, 4, 128) and torch.isfinite(out).all()
    for b, (lo, hi) in enumerate([(6, 10), (0, 10)]):
        ref, _ = attention_reference(q[b:b + 1].transpose(1, 2), k[b:b + 1, :, lo:hi].transpose(1, 2),
                                     v[b:b + 1, :, lo:hi].transpose(1, 2), causal=seqlen_q > 1,
                                     softmax_scale=0.1)
        torch.testing.assert_close(out[b].double(), ref[0], atol=2e-2, rtol=2e-2)
    assert out[2].abs().sum() == 0


def test_padding_mask_2d_decode_step_with_gradients_takes_the_varlen_path(fake_varlen, fake_kvcache):
    """The KV cache call has no backward: with gradients a decode-shaped call stays on the varlen path,
    every query row a token and the keys the mask's run."""
    q, k, v = _qkv(batch=2, seqlen_q=1, seqlen_k=10)
    q.requires_grad_()
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, :6] = False
    hft.hopper_flash_attention_forward(_Module(), q, k, v, mask)
    assert fake_kvcache == [] and len(fake_varlen) == 1
    call = fake_varlen[0]
    assert call["cu_q"].tolist() == [0, 1, 2] and call["seqused_q"] is None
    assert call["cu_k"].tolist() == [6, 10, 20] and call["seqused_k"].tolist() == [4, 10]
    assert call["causal"] is False  # one query sees every key either way


def test_padding_runs_found_once_per_mask(fake_kvcache, monkeypatch):
    """Every layer of a forward gets the same mask object: its runs are found by the first layer only,
    and again once the mask changes in place (its version) or a new mask comes."""
    found = []
    real = torch.Tensor.argmax
    monkeypatch.setattr(torch.Tensor, "argmax", lambda self, *a, **kw: found.append(1) or real(self, *a, **kw))
    q, k, v = _qkv(batch=2, seqlen_q=1, seqlen_k=10)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, :3] = False
    for _ in range(3):
        hft.hopper_flash_attention_forward(_Module(), q, k, v, mask)
    assert len(found) == 1 and [c["cache_leftpad"].tolist() for c in fake_kvcache] == [[3, 0]] * 3
    mask[1, :2] = False  # in place: a new version
    hft.hopper_flash_attention_forward(_Module(), q, k, v, mask)
    assert len(found) == 2 and fake_kvcache[-1]["cache_leftpad"].tolist() == [3, 2]
    hft.hopper_flash_attention_forward(_Module(), q, k, v, mask.clone())
    assert len(found) == 3


def _layer(idx):
    module = _Module()
    module.layer_idx = idx
    return module


def test_padding_runs_kept_within_one_cuda_graph_capture(fake_kvcache, monkeypatch):
    """While a CUDA graph is captured, the layers after the first reuse the runs the capture found (they
    replay together, after the capture's own kernels that find them); never runs found outside the capture
    (they would not follow in-place changes of the mask on replay), nor a capture's runs outside it or in
    another capture (they exist only in its graph); a capture the driver cannot name finds them every call."""
    found = []
    real = torch.Tensor.argmax
    monkeypatch.setattr(torch.Tensor, "argmax", lambda self, *a, **kw: found.append(1) or real(self, *a, **kw))
    capture = [0]
    monkeypatch.setattr(hft.checks, "capture_id", lambda: capture[0])
    q, k, v = _qkv(batch=2, seqlen_q=1, seqlen_k=10)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, :3] = False

    def forward():
        for layer in range(4):
            hft.hopper_flash_attention_forward(_layer(layer), q, k, v, mask)

    forward()
    assert len(found) == 1
    for ident, finds in ((11, 2), (11, 2), (12, 3), (0, 4), (0, 4), (None, 8)):
        capture[0] = ident
        forward()
        assert len(found) == finds, (ident, found)
    runs = [c["cache_leftpad"] for c in fake_kvcache]
    assert all(r.tolist() == [3, 0] for r in runs)
    assert runs[4] is not runs[0] and all(r is runs[4] for r in runs[4:12])  # capture 11 (twice): its own
    assert runs[12] is not runs[4] and runs[16] is not runs[12]  # capture 12, then eager again


def test_padding_runs_of_an_inference_tensor_found_once_per_forward(fake_kvcache, monkeypatch):
    """A mask made under torch.inference_mode has no version counter: its runs are kept only while the
    layers run in order (layer_idx rising), found again at the next forward's first layer, where an
    in-place change of the same mask object shows; a module without layer_idx finds them every call."""
    found = []
    real = torch.Tensor.argmax
    monkeypatch.setattr(torch.Tensor, "argmax", lambda self, *a, **kw: found.append(1) or real(self, *a, **kw))
    q, k, v = _qkv(batch=2, seqlen_q=1, seqlen_k=10)
    with torch.inference_mode():
        mask = torch.ones(2, 10, dtype=torch.bool)
        mask[0, :3] = False
        for layer in range(4):
            hft.hopper_flash_attention_forward(_layer(layer), q, k, v, mask)
        assert len(found) == 1
        mask[1, :2] = False  # in place, between two forwards: no version counter tells it
        for layer in range(4):
            hft.hopper_flash_attention_forward(_layer(layer), q, k, v, mask)
        assert len(found) == 2
        assert [c["cache_leftpad"].tolist() for c in fake_kvcache] == [[3, 0]] * 4 + [[3, 2]] * 4
        for _ in range(2):
            hft.hopper_flash_attention_forward(_Module(), q, k, v, mask)  # no layer_idx
        assert len(found) == 4


def test_position_ids_of_an_inference_tensor_read_once_per_forward(fake_kernel, fake_varlen, monkeypatch):
    """Packed documents found from position_ids (one host sync) once per forward under inference_mode
    too: the layers after the first reuse the first's answer; the next forward reads them again."""
    synced = []
    real = torch.Tensor.nonzero
    monkeypatch.setattr(torch.Tensor, "nonzero", lambda self, *a, **kw: synced.append(1) or real(self, *a, **kw))
    q, k, v = _qkv(batch=1, seqlen_q=12, seqlen_k=12)
    with torch.inference_mode():
        position_ids = torch.cat([torch.arange(5), torch.arange(7)])[None]
        for forward in range(2):
            for layer in range(3):
                hft.hopper_flash_attention_forward(_layer(layer), q, k, v, None, position_ids=position_ids)
            assert len(synced) == forward + 1
    assert len(fake_varlen) == 6 and all(c["cu_q"].tolist() == [0, 5, 12] for c in fake_varlen)


def test_padding_mask_on_another_device_is_named(fake_varlen, fake_kvcache):
    """A 2-D mask away from the queries' device: an error naming the mask, not the lengths built from it."""
    q, k, v = _qkv(batch=2, seqlen_q=1, seqlen_k=10)
    mask = torch.ones(2, 10, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match="attention_mask must be on the queries' device"):
        hft.hopper_flash_attention_forward(_Module(), q, k, v, mask)
    assert fake_varlen == [] and fake_kvcache == []


def _runs_masked_reference(q, k, v, runs, window, scale, dtype=torch.float64):
    """What a padded batch's attention is, from the mask's definition alone: row ``b``'s keys are its
    run ``[lo, hi)``; with as many queries as keys its queries are the run's tokens (other rows 0), with
    fewer they sit at the run's last positions (bottom-right); causal; ``window``: transformers'
    sliding window (``|p - j| < w``). ``out`` ``[B, Sq, H, Dv]`` in ``dtype`` (float64: the reference;
    the inputs' dtype with a float32 softmax: the math path's rounding, the judge's baseline)."""
    batch, heads, seqlen_q, _ = q.shape
    seqlen_k, group = k.shape[2], heads // k.shape[1]
    out = torch.zeros(batch, seqlen_q, heads, v.shape[3], dtype=dtype, device=q.device)
    cols = torch.arange(seqlen_k, device=q.device)
    for b, (lo, hi) in enumerate(runs):
        for i in range(seqlen_q):
            p = i if seqlen_q == seqlen_k else hi - seqlen_q + i  # the query's column
            if seqlen_q == seqlen_k and not lo <= p < hi:
                continue
            seen = (cols >= lo) & (cols < hi) & (cols <= p)
            if window is not None:
                seen &= (p - cols < window) & (cols - p < window)
            if not seen.any():
                continue
            kb, vb = (x[b][:, seen].to(dtype).repeat_interleave(group, 0) for x in (k, v))
            s = torch.einsum("hd,hnd->hn", q[b, :, i].to(dtype), kb).float() * scale
            out[b, i] = torch.einsum("hn,hnd->hd", s.softmax(-1).to(dtype), vb)
    return out


def _random_runs(gen, batch, seqlen_q, seqlen_k, side):
    """Each row's run of tokens ``(lo, hi)``: left padding ends at the last column, right padding starts
    at 0, "mixed" is either or a run inside (a static cache's empty slots past it); one empty row. A
    decode-shaped call's runs hold its queries (they are the run's newest tokens)."""
    least = 1 if seqlen_q == seqlen_k else seqlen_q
    runs = []
    for b in range(batch):
        n = int(torch.randint(least, seqlen_k + 1, (1,), generator=gen))
        lo = {"left": seqlen_k - n, "right": 0}.get(side, int(torch.randint(0, seqlen_k - n + 1, (1,), generator=gen)))
        runs.append((lo, lo + n))
    runs[1] = (runs[1][0], runs[1][0])  # a row with no token
    return runs


def _padded_sweep_case(seqlen_q, side, window, seed, device):
    gen = torch.Generator().manual_seed(seed)
    batch, heads, heads_kv, seqlen_k, dim = 5, 8, 2, 40, 64
    q = torch.randn(batch, heads, seqlen_q, dim, generator=gen).to(torch.bfloat16).to(device)
    k, v = (torch.randn(batch, heads_kv, seqlen_k, dim, generator=gen).to(torch.bfloat16).to(device) for _ in "kv")
    runs = _random_runs(gen, batch, seqlen_q, seqlen_k, side)
    mask = torch.zeros(batch, seqlen_k, dtype=torch.long, device=device)
    for b, (lo, hi) in enumerate(runs):
        mask[b, lo:hi] = 1
        for t in (k, v):  # what lies outside a row's run never counts
            t[b, :, :lo] = math.nan
            t[b, :, hi:] = math.nan
    module = _Module()
    module.sliding_window = window
    return q, k, v, mask, runs, module


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("side", ["left", "right", "mixed"])
@pytest.mark.parametrize("seqlen_q", [1, 3, 40])
def test_padded_batches_match_the_masks_definition_cpu(fake_varlen, fake_kvcache, seqlen_q, side, window, seed):
    """A sweep of padded batches through the backend (the stand-in kernels: this checks the lengths,
    pads, alignment and windows handed to them) against the attention the 2-D mask defines, computed
    without the backend: decode-shaped calls through the KV cache route, others through varlen."""
    if seqlen_q < 40 and side == "right":
        pytest.skip("a decode step's run ends at its newest key: right padding leaves holes")
    q, k, v, mask, runs, module = _padded_sweep_case(seqlen_q, side, window, seed, "cpu")
    with torch.no_grad():
        out, _ = hft.hopper_flash_attention_forward(module, q, k, v, mask, scaling=0.125,
                                                    sliding_window=window)
    assert len(fake_kvcache if seqlen_q < 40 else fake_varlen) == 1
    want = _runs_masked_reference(q, k, v, runs, window, 0.125)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("side", ["left", "right", "mixed"])
@pytest.mark.parametrize("seqlen_q", [1, 3, 40])
def test_padded_batches_match_the_masks_definition_gpu(seqlen_q, side, window):
    """The same sweep on the kernels (NaN outside every run), judged against the float64 definition
    relative to the bf16 math path's error on the same inputs."""
    from hopper_flash.reference import judge

    if seqlen_q < 40 and side == "right":
        pytest.skip("a decode step's run ends at its newest key: right padding leaves holes")
    hft.register()
    for seed in range(3):
        q, k, v, mask, runs, module = _padded_sweep_case(seqlen_q, side, window, seed, "cuda")
        with torch.no_grad():
            out, _ = hft.hopper_flash_attention_forward(module, q, k, v, mask, scaling=0.125,
                                                        sliding_window=window)
        want = _runs_masked_reference(q, k, v, runs, window, 0.125)
        base = _runs_masked_reference(q, k, v, runs, window, 0.125, dtype=torch.bfloat16)
        verdict = judge(f"seed {seed}", out.reshape(want.shape), want, base)
        assert verdict, verdict.message


@pytest.mark.gpu
@pytest.mark.parametrize("width", [1000, 1129])
def test_padded_prefill_reads_keys_in_place_gpu(width):
    """A padded prefill whose keys a KV cache holds (BHSD; width > 1000: a view of a wider buffer)
    on the kernels: read in place (no copy), judged against the float64 definition of the mask relative
    to the bf16 math path's error, NaN outside the runs, and bitwise equal to the same varlen call on
    compact copies of the keys (the route before the views)."""
    from hopper_flash.reference import judge

    hft.register()
    torch.manual_seed(0)
    batch, heads, heads_kv, seqlen, dim = 4, 16, 4, 1000, 128
    q = torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(batch, heads_kv, width, dim, device="cuda", dtype=torch.bfloat16)[:, :, :seqlen]
            for _ in "kv")
    runs = [(0, 1000), (129, 1000), (0, 127), (999, 1000)]
    mask = torch.zeros(batch, seqlen, dtype=torch.long, device="cuda")
    for b, (lo, hi) in enumerate(runs):
        mask[b, lo:hi] = 1
        for t in (k, v):
            t[b, :, :lo] = t[b, :, hi:] = math.nan
    with torch.no_grad():
        out, _ = hft.hopper_flash_attention_forward(_Module(), q, k, v, mask, scaling=dim ** -0.5)
        want = _runs_masked_reference(q, k, v, runs, None, dim ** -0.5)
        base = _runs_masked_reference(q, k, v, runs, None, dim ** -0.5, dtype=torch.bfloat16)
        verdict = judge(f"width {width}", out.reshape(want.shape), want, base)
        assert verdict, verdict.message
        starts = torch.tensor([lo for lo, _ in runs], dtype=torch.int32, device="cuda")
        lens = torch.tensor([hi - lo for lo, hi in runs], dtype=torch.int32, device="cuda")
        rows = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * seqlen
        cu = torch.cat([rows[:-1] + starts, rows[-1:]])
        compact = hopper_flash.flash_attn_varlen_func(
            *(hft._thd(t) for t in (q, k, v)), cu, cu,  # (_thd: compact copies of k and v)
            seqlen, seqlen, seqused_q=lens, seqused_k=lens, softmax_scale=dim ** -0.5, causal=True)
    assert torch.equal(out.reshape(compact.shape), compact)


def test_padding_mask_with_holes_is_the_callers_contract(fake_varlen):
    """A 2-D mask row must be one run of tokens; the run's first token and its count are what is used."""
    q, k, v = _qkv(batch=1)
    mask = torch.zeros(1, 16, dtype=torch.bool)
    mask[0, 3:9] = True
    hft.hopper_flash_attention_forward(_Module(), q, k, v, mask)
    assert fake_varlen[0]["cu_k"].tolist() == [3, 16] and fake_varlen[0]["seqused_k"].tolist() == [6]


def _pad_batch(seqs, side):
    width = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, x in enumerate(seqs):
        sl = slice(width - len(x), width) if side == "left" else slice(0, len(x))
        ids[b, sl] = x
        mask[b, sl] = 1
    return ids, mask


@pytest.mark.parametrize("side", ["left", "right"])
def test_llama_padded_batch_rows_equal_running_alone_cpu(registered, fake_kernel, fake_varlen, side):
    model = _set_attn(_llama(), NAME)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(1, 1000, (n,), generator=gen) for n in (23, 7, 16, 1)]
    ids, mask = _pad_batch(seqs, side)
    batched = _logits(model, ids, attention_mask=mask)
    assert len(fake_varlen) == 2 and fake_kernel == []  # one varlen call per layer, no padded call
    for b, x in enumerate(seqs):
        alone = _logits(model, x[None])
        row = batched[b, -len(x):] if side == "left" else batched[b, :len(x)]
        torch.testing.assert_close(row, alone[0], atol=1e-4, rtol=1e-4)


def test_llama_left_padded_greedy_generate_equals_alone_cpu(registered, fake_kernel, fake_varlen, fake_kvcache):
    model = _set_attn(_llama(), NAME)
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(1, 1000, (n,), generator=gen) for n in (9, 4, 13)]
    ids, mask = _pad_batch(seqs, "left")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        for b, x in enumerate(seqs):
            alone = model.generate(x[None], attention_mask=torch.ones(1, len(x), dtype=torch.long),
                                   max_new_tokens=6, do_sample=False, pad_token_id=0)
            assert torch.equal(out[b, ids.shape[1]:], alone[0, len(x):]), b
    # The padded prefill went varlen, the decode steps (one query per row) read the cache in place.
    assert any(c["q"].shape[0] == 3 * ids.shape[1] for c in fake_varlen)
    assert any(c["q"].shape[:2] == (3, 1) for c in fake_kvcache)


def test_inference_mode_calls_match_no_grad_cpu(registered, fake_kernel, fake_varlen, fake_kvcache):
    """Tensors made under torch.inference_mode carry no version counter (reading it raises), so nothing
    derived from them is kept by identity: a batch-1 prefill (whose position_ids the backend reads for
    packed documents), documents packed by restarting position_ids, and a left-padded batch's greedy
    generation give under inference_mode what they give under no_grad."""
    model = _set_attn(_llama(), NAME)
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(1, 1000, (1, 12), generator=gen)
    seqs = [torch.randint(1, 1000, (n,), generator=gen) for n in (7, 3, 5)]
    packed_ids, position_ids, _ = _packed(seqs)
    padded_ids, mask = _pad_batch(seqs, "left")

    def run():
        return (model(ids).logits, model(packed_ids, position_ids=position_ids).logits,
                model.generate(padded_ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0))
    with torch.no_grad():
        want = run()
    with torch.inference_mode():
        got = run()
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def _packed(seqs):
    ids = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(len(x)) for x in seqs])[None]
    cu = torch.tensor([0] + [len(x) for x in seqs]).cumsum(0).to(torch.int32)
    return ids, position_ids, cu


@pytest.mark.parametrize("how", ["cu_seq_lens", "position_ids"])
def test_llama_packed_sequences_equal_running_alone_cpu(registered, fake_kernel, fake_varlen, how):
    model = _set_attn(_llama(), NAME)
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(1, 1000, (n,), generator=gen) for n in (11, 1, 30, 5)]
    ids, position_ids, cu = _packed(seqs)
    kwargs = dict(position_ids=position_ids)
    if how == "cu_seq_lens":
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=30, max_length_k=30)
    packed = _logits(model, ids, **kwargs)
    assert len(fake_varlen) == 2 and fake_kernel == []
    assert fake_varlen[0]["cu_q"].tolist() == cu.tolist()
    pos = 0
    for x in seqs:
        torch.testing.assert_close(packed[0, pos:pos + len(x)], _logits(model, x[None])[0], atol=1e-4, rtol=1e-4)
        pos += len(x)


def test_llama_packed_training_step_gradients_match_padded_cpu(registered, fake_kernel, fake_varlen):
    """The same documents as one packed row (DataCollatorWithFlattening's kwargs) and as a right-padded
    batch with labels -100 on the padding give the same loss and parameter gradients."""
    gen = torch.Generator().manual_seed(8)
    seqs = [torch.randint(1, 1000, (n,), generator=gen) for n in (12, 5, 20)]

    def step(**batch):
        model = _set_attn(_llama(seed=1).train(), NAME)
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ids, position_ids, cu = _packed(seqs)
    labels = ids.clone()
    labels[0, cu[:-1].long()] = -100  # a document's first token is not predicted from the previous one
    packed_loss, packed_grads = step(input_ids=ids, labels=labels, position_ids=position_ids, cu_seq_lens_q=cu,
                                     cu_seq_lens_k=cu, max_length_q=20, max_length_k=20)
    pids, mask = _pad_batch(seqs, "right")
    plabels = pids.masked_fill(mask == 0, -100)
    plabels[:, 0] = -100
    padded_loss, padded_grads = step(input_ids=pids, attention_mask=mask, labels=plabels)
    torch.testing.assert_close(packed_loss, padded_loss, atol=1e-5, rtol=1e-5)
    assert packed_grads.keys() == padded_grads.keys()
    for name in packed_grads:
        torch.testing.assert_close(packed_grads[name], padded_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_additive_bias_raises():
    q, k, v = _qkv()
    mask = torch.randn(2, 1, 16, 16)
    with pytest.raises(NotImplementedError, match="additive attention biases"):
        hft.hopper_flash_attention_forward(_Module(), q, k, v, mask)


def test_a_sliding_window_pattern_in_a_4d_mask_raises():
    q, k, v = _qkv()
    rows, cols = torch.arange(16)[:, None], torch.arange(16)[None, :]
    mask = ((cols <= rows) & (cols > rows - 4)).expand(2, 1, 16, 16)
    with pytest.raises(NotImplementedError, match=PADDING):
        hft.hopper_flash_attention_forward(_Module(), q, k, v, mask, sliding_window=4)


@pytest.mark.parametrize("sliding_window, seqlen_k, expected", [
    (None, 16, (-1, -1)), (16, 16, (-1, -1)), (20, 16, (-1, -1)), (4, 16, (3, 3)), (1, 16, (0, 0))])
def test_sliding_window_becomes_flash_attn_window_size(sliding_window, seqlen_k, expected):
    # transformers' FlashAttention path: (w - 1, w - 1) once the keys outnumber the window.
    assert hft._window_size(sliding_window, seqlen_k) == expected


def test_sliding_window_reaches_flash_attn_func(monkeypatch):
    import hopper_flash

    calls = []
    monkeypatch.setattr(hopper_flash, "flash_attn_func",
                        lambda q, k, v, **kw: calls.append(kw) or torch.zeros_like(q))
    q, k, v = _qkv()
    hft.hopper_flash_attention_forward(_Module(), q, k, v, None, sliding_window=4)
    hft.hopper_flash_attention_forward(_Module(), q, k, v, None, sliding_window=64)
    assert [c["window_size"] for c in calls] == [(3, 3), (-1, -1)]
    assert all(c["causal"] for c in calls)
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        hft.hopper_flash_attention_forward(_Module(), q, k, v, None, sliding_window=0)


def test_half_of_the_packed_kwargs_raises():
    q, k, v = _qkv(batch=1)
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k must be given together"):
        hft.hopper_flash_attention_forward(_Module(), q, k, v, None, cu_seq_lens_q=torch.tensor([0, 8, 16]))


@pytest.mark.parametrize("kwarg,value", [("position_bias", torch.zeros(4)),
                                         ("cu_seqlens", torch.tensor([0, 8, 16]))])
def test_unsupported_features_raise(kwarg, value):
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="does not support"):
        hft.hopper_flash_attention_forward(_Module(), q, k, v, None, **{kwarg: value})


def test_dropout_raises():
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="dropout"):
        hft.hopper_flash_attention_forward(_Module(), q, k, v, None, dropout=0.1)


def test_valid_call_reaches_the_kernel_device_check():
    """Without a stand-in the real kernel entry point refuses CPU tensors, after our checks pass."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="must be a CUDA tensor on a Hopper GPU"):
        hft.hopper_flash_attention_forward(_Module(), q, k, v, _bool_mask(2, 16, 16))


# --------------------------------------------------------------------------
# Mask analysis and the call handed to flash_attn_func (CPU stand-in)
# --------------------------------------------------------------------------
def test_call_contract_views_gqa_scale(fake_kernel):
    q, k, v = _qkv(seqlen_q=16, seqlen_k=16)
    out, weights = hft.hopper_flash_attention_forward(_Module(), q, k, v, None, scaling=0.125)
    assert weights is None
    (call,) = fake_kernel
    assert call["causal"] is True and call["softmax_scale"] == 0.125
    # BSHD views of the BHSD inputs, no copies; k/v keep their 2 heads (GQA read natively)
    assert call["q"].shape == (2, 16, 4, 128) and call["k"].shape == (2, 16, 2, 128)
    assert call["q"].data_ptr() == q.data_ptr() and call["k"].data_ptr() == k.data_ptr()
    assert call["q"].stride() == q.transpose(1, 2).stride()
    assert out.shape == (2, 16, 4, 128)  # [batch, seq, heads, head_dim]


def test_softcap_reaches_the_call(fake_kernel):
    """Gemma 2's layers pass softcap=attn_logit_softcapping: it becomes flash-attn's softcap (None: 0.0)."""
    q, k, v = _qkv(seqlen_q=16, seqlen_k=16)
    out, _ = hft.hopper_flash_attention_forward(_Module(), q, k, v, None, scaling=0.125, softcap=50.0)
    hft.hopper_flash_attention_forward(_Module(), q, k, v, None, scaling=0.125, softcap=None)
    assert [c["softcap"] for c in fake_kernel] == [50.0, 0.0]
    s = (q.double() @ k.double().repeat_interleave(2, dim=1).transpose(-1, -2)) * 0.125
    s = 50.0 * torch.tanh(s / 50.0)
    s = s.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    expected = (s.softmax(-1) @ v.double().repeat_interleave(2, dim=1)).transpose(1, 2)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=0)
    with pytest.raises(ValueError, match="softcap must be finite and >= 0"):
        hft.hopper_flash_attention_forward(_Module(), q, k, v, None, softcap=-1.0)


def test_attention_sinks_reach_the_call(fake_kernel):
    """gpt-oss's layers pass s_aux=self.sinks: it becomes flash-attn's
    learnable_sink, and the result is gpt-oss's eager attention with sinks."""
    q, k, v = _qkv(seqlen_q=16, seqlen_k=16)
    sink = torch.randn(4)
    out, _ = hft.hopper_flash_attention_forward(_Module(), q, k, v, None, scaling=0.125, s_aux=sink)
    assert fake_kernel[-1]["learnable_sink"] is sink
    hft.hopper_flash_attention_forward(_Module(), q, k, v, None, scaling=0.125)
    assert fake_kernel[-1]["learnable_sink"] is None
    s = (q.double() @ k.double().repeat_interleave(2, dim=1).transpose(-1, -2)) * 0.125
    s = s.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    logits = torch.cat([s, sink.double().view(1, -1, 1, 1).expand(2, -1, 16, 1)], dim=-1)
    expected = (logits.softmax(-1)[..., :-1] @ v.double().repeat_interleave(2, dim=1)).transpose(1, 2)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=0)


def _gpt_oss(window=64, heads=8):
    """A tiny gpt-oss: a sliding-window layer and a full one, each with sinks."""
    import logging

    config = transformers.GptOssConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=2, head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=window,
        max_position_embeddings=1024, layer_types=["sliding_attention", "full_attention"])
    logging.getLogger("transformers").setLevel(logging.ERROR)  # the tiny config's RoPE-scaling note
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)  # sinks that take a real share (init: std 0.02)
    return model


@pytest.mark.skipif(not hasattr(transformers, "GptOssForCausalLM"), reason="transformers without gpt-oss")
def test_gpt_oss_logits_equal_eager_cpu(registered, fake_kernel):
    """A tiny gpt-oss (a sliding-window layer and a full one, each with
    sinks) gives eager's logits with hopper_flash (the float64 stand-in
    kernel): the sinks and the window reach every layer's call."""
    model = _gpt_oss(window=8, heads=4)
    ids = torch.randint(1, 1000, (2, 24), generator=torch.Generator().manual_seed(7))
    eager = _logits(_set_attn(model, "eager"), ids)
    ours = _logits(_set_attn(model, NAME), ids)
    assert len(fake_kernel) == 2
    assert [c["window_size"] for c in fake_kernel] == [(7, 7), (-1, -1)]
    assert all(c["learnable_sink"] is layer.self_attn.sinks for c, layer in zip(fake_kernel, model.model.layers))
    torch.testing.assert_close(ours, eager, atol=1e-4, rtol=1e-4)


def test_attention_sinks_reach_the_varlen_call(monkeypatch):
    """A padded batch with sinks: the varlen call gets them."""
    calls = []
    monkeypatch.setattr(hopper_flash, "flash_attn_varlen_func",
                        lambda q, *a, **kw: calls.append(kw) or torch.zeros_like(q))
    q, k, v = _qkv()
    sink = torch.randn(4)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    hft.hopper_flash_attention_forward(_Module(), q, k, v, mask, s_aux=sink)
    assert calls[-1]["learnable_sink"] is sink


@pytest.mark.parametrize("module_causal,kwarg_causal,expected", [
    (True, None, True), (False, None, False), (True, False, False), (False, True, True)])
def test_is_causal_from_module_or_kwarg(fake_kernel, module_causal, kwarg_causal, expected):
    q, k, v = _qkv()
    hft.hopper_flash_attention_forward(_Module(module_causal), q, k, v, None, is_causal=kwarg_causal)
    assert fake_kernel[-1]["causal"] is expected


@pytest.mark.parametrize("seqlen_q,seqlen_k,used", [(16, 16, 16), (5, 21, 21), (5, 40, 21), (1, 40, 9)])
def test_causal_mask_pattern_runs_causal(fake_kernel, seqlen_q, seqlen_k, used):
    """Bottom-right causal over the first `used` keys, the rest unseen (a static cache's tail)."""
    q, k, v = _qkv(seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    mask = torch.zeros(2, 1, seqlen_q, seqlen_k, dtype=torch.bool)
    mask[..., :used] = _bool_mask(2, seqlen_q, used)
    hft.hopper_flash_attention_forward(_Module(), q, k, v, mask)
    call = fake_kernel[-1]
    assert call["k"].shape[1] == used and call["v"].shape[1] == used
    assert call["causal"] is (seqlen_q > 1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True).transpose(1, 2)
    out, _ = hft.hopper_flash_attention_forward(_Module(), q, k, v, mask)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_all_visible_mask_runs_non_causal(fake_kernel):
    q, k, v = _qkv(seqlen_q=8, seqlen_k=20)
    hft.hopper_flash_attention_forward(_Module(), q, k, v, torch.ones(2, 1, 8, 20, dtype=torch.bool))
    assert fake_kernel[-1]["causal"] is False and fake_kernel[-1]["k"].shape[1] == 20


def test_no_mask_with_more_keys_than_queries_is_bottom_right_causal(fake_kernel):
    """The FlashAttention mask function gives None for a chunk on a dynamic cache (no padding): the
    queries are the last keys, as in flash-attn (bottom-right causal over every key)."""
    q, k, v = _qkv(seqlen_q=8, seqlen_k=32)
    hft.hopper_flash_attention_forward(_Module(), q, k, v, None)
    assert fake_kernel[-1]["k"].shape[1] == 32 and fake_kernel[-1]["causal"] is True


# --------------------------------------------------------------------------
# A whole model on CPU with the stand-in kernel: logits equal sdpa's
# --------------------------------------------------------------------------
def _logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


def test_llama_logits_match_sdpa_cpu(registered, fake_kernel):
    model = _llama()
    ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(1))
    ref = _logits(_set_attn(model, "sdpa"), ids)
    model = _set_attn(model, NAME)
    out = _logits(model, ids)
    assert len(fake_kernel) == 2  # one call per layer
    assert all(c["causal"] for c in fake_kernel)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # an all-ones attention_mask is no padding
    torch.testing.assert_close(_logits(model, ids, attention_mask=torch.ones_like(ids)), ref,
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunks", [(40,), (24, 16)])
def test_mistral_sliding_window_matches_sdpa_cpu(registered, fake_kernel, chunks):
    """A Mistral layer with a sliding window shorter than the sequence: the
    backend's window_size (w - 1, w - 1) under the causal mask gives sdpa's
    logits, in one prefill and in a second chunk on a dynamic cache."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=128, max_position_embeddings=1024, sliding_window=8)
    model = transformers.MistralForCausalLM(config).eval()
    ids = torch.randint(0, 1000, (2, sum(chunks)), generator=torch.Generator().manual_seed(3))

    def run(impl):
        m = _set_attn(model, impl)
        cache = transformers.DynamicCache(config=m.config)
        outs, start = [], 0
        for n in chunks:
            outs.append(_logits(m, ids[:, start:start + n], past_key_values=cache, use_cache=True))
            start += n
        return torch.cat(outs, dim=1)

    ref = run("sdpa")
    out = run(NAME)
    assert {c["window_size"] for c in fake_kernel} == {(7, 7)}
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_llama_chunked_prefill_matches_sdpa_cpu(registered, fake_kernel):
    """A second chunk on a dynamic cache gets a materialised causal mask (kv longer than q)."""
    model = _llama()
    ids = torch.randint(0, 1000, (2, 48), generator=torch.Generator().manual_seed(2))

    def run(impl):
        m = _set_attn(model, impl)
        cache = transformers.DynamicCache(config=m.config)
        first = _logits(m, ids[:, :20], past_key_values=cache, use_cache=True)
        second = _logits(m, ids[:, 20:], past_key_values=cache, use_cache=True)
        return torch.cat([first, second], dim=1)

    ref = run("sdpa")
    out = run(NAME)
    assert fake_kernel[-1]["q"].shape[1] == 28 and fake_kernel[-1]["k"].shape[1] == 48
    assert fake_kernel[-1]["causal"] is True
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_llama_greedy_generate_matches_sdpa_cpu(registered, fake_kernel, fake_varlen, fake_kvcache,
                                               cache_implementation):
    model = _llama()
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(3))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                  pad_token_id=0, cache_implementation=cache_implementation)
    with torch.no_grad():
        ref = _set_attn(model, "sdpa").generate(ids, **kwargs)
        out = _set_attn(model, NAME).generate(ids, **kwargs)
    assert torch.equal(out, ref)
    calls = fake_kernel + fake_varlen + fake_kvcache
    assert any(c["q"].shape[1] == 1 or c["q"].shape[0] == 2 for c in calls)  # decode steps went through the backend


def test_mistral_sliding_window_greedy_generate_matches_sdpa_cpu(registered, fake_kernel, fake_varlen):
    """Greedy generation past the window (16-token prompt, window 6, 8 new
    tokens) gives sdpa's tokens with the backend's window_size."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=128, max_position_embeddings=1024, sliding_window=6)
    model = transformers.MistralForCausalLM(config).eval()
    ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = _set_attn(model, "sdpa").generate(ids, **kwargs)
        out = _set_attn(model, NAME).generate(ids, **kwargs)
    assert torch.equal(out, ref)
    assert any(c["window_size"] == (5, 5) for c in fake_kernel)  # the prompt's prefill saw the window


# --------------------------------------------------------------------------
# Continuous batching: "paged|hopper_flash"
# --------------------------------------------------------------------------
def _continuous_batching():
    """transformers' continuous batching module, or skip (it came with 4.56)."""
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching import cache as cb_cache
    except ImportError:
        pytest.skip("transformers without continuous batching")
    return ContinuousBatchingConfig, cb_cache


def _generate_batch(model, prompts, new_tokens=6, **cb):
    """``model.generate_batch`` greedy, a small cache: ``{request index: generated tokens}``."""
    ContinuousBatchingConfig, _ = _continuous_batching()
    config = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                                           pad_token_id=0)
    cb = dict(dict(block_size=16, num_blocks=128, max_batch_tokens=64), **cb)
    out = model.generate_batch(inputs=prompts, generation_config=config,
                               continuous_batching_config=ContinuousBatchingConfig(**cb))
    return {int(k.removeprefix("req_")): list(r.generated_tokens) for k, r in out.items()}


def test_register_registers_the_paged_name(registered):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert ALL_ATTENTION_FUNCTIONS.get(hft.PAGED_NAME) is hft.hopper_flash_paged_attention_forward
    model = _set_attn(_llama(), hft.PAGED_NAME)  # no FlashAttention kernel looked up for the name
    # (transformers 5.19 on runs continuous batching under the plain name: it drops "paged|")
    assert model.config._attn_implementation == (hft.PAGED_NAME if _cb_era() == "paged" else NAME)


def test_paged_call_without_a_cache_or_with_a_block_table_raises():
    q, k, v = _qkv(batch=1)
    module = _Module()
    module.layer_idx = 0
    with pytest.raises(ValueError, match="without a paged attention cache"):
        hft.hopper_flash_paged_attention_forward(module, q, k, v, None)
    with pytest.raises(NotImplementedError, match="block table"):
        hft.hopper_flash_paged_attention_forward(module, q, k, v, None, cache=object(),
                                                 block_table=torch.zeros(1, 1, 1, dtype=torch.int32))


class _PagedCache:
    """The parts of transformers' PagedAttentionCache that paged_cache_view reads: one group of
    full attention layers, pools [pages, heads_kv, head_dim], blocks of block_size pages."""

    def __init__(self, block_size, num_blocks=12, heads_kv=2, dim=8, sliding=1):
        self.block_size = block_size
        self.layer_index_to_group_indices = {0: (0, 0)}
        self.sliding_windows = {0: sliding}
        self.key_cache = [torch.randn(num_blocks * block_size, heads_kv, dim)]
        self.value_cache = [torch.randn(num_blocks * block_size, heads_kv, dim)]

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        """transformers' update on a full attention layer: the new keys written, then every request's read back."""
        k, v = (x.transpose(1, 2).squeeze(0) for x in (key_states, value_states))
        self.key_cache[0].index_copy_(0, write_index[0], k)
        self.value_cache[0].index_copy_(0, write_index[0], v)
        if read_index[0].numel() == 0:
            return k, v
        return self.key_cache[0][read_index[0]], self.value_cache[0][read_index[0]]

    def read_index(self, lengths, blocks):
        """FullAttentionCacheAllocator's read indices: request b's key j at blocks[b][j // bs] * bs + j % bs."""
        bs = self.block_size
        return torch.tensor([blocks[b][j // bs] * bs + j % bs for b, n in enumerate(lengths) for j in range(n)])


def _requests(block_size):
    """Four requests for a cache of ``block_size``-key blocks: ``(num_blocks,
    key counts, each request's blocks in order)``, one request empty, one
    ending inside a block."""
    if block_size < 2048:
        per_block = min(block_size, 40)
        return 12, [3 * per_block - 1, 1, per_block, 0], [[7, 2, 9], [4], [0, 11], []]
    return 3, [2049, 1, 0, 5], [[2, 0], [1], [], [0]]


@pytest.mark.parametrize("block_size,page", [(16, 16), (12, 4), (6, 2), (2048, 1024)])
def test_paged_cache_view_reads_each_request_where_transformers_put_it(block_size, page):
    num_blocks, lengths, blocks = _requests(block_size)
    cache = _PagedCache(block_size, num_blocks=num_blocks)
    index = cache.read_index(lengths, blocks)
    cu_k = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    k, v, table = hft.paged_cache_view(cache, 0, [index], cu_k, max(lengths))
    assert k.shape == (cache.key_cache[0].shape[0] // page, page, 2, 8) and v.shape == k.shape
    assert k.data_ptr() == cache.key_cache[0].data_ptr() and table.dtype == torch.int32
    assert table.shape == (4, -(-max(lengths) // page))
    for b, n in enumerate(lengths):  # every live key is the cache row transformers' read names
        start = int(cu_k[b])
        rows = k[table[b, :-(-n // page)].long()].flatten(0, 1)[:n]
        torch.testing.assert_close(rows, cache.key_cache[0][index[start:start + n]], rtol=0, atol=0)
    hft.check_paged_cache_view(index, cu_k, table, page)


def test_paged_cache_view_falls_back_where_it_cannot_read_in_place():
    cache = _PagedCache(16)
    index = cache.read_index([20], [[3, 5]])
    cu_k = torch.tensor([0, 20], dtype=torch.int32)
    assert hft.paged_cache_view(_PagedCache(16, sliding=4096), 0, [index], cu_k, 20) is None
    assert hft.paged_cache_view(cache, 0, [index[:0]], cu_k, 20) is None  # nothing cached: update's write-only case
    assert hft.paged_cache_view(object(), 0, [index], cu_k, 20) is None
    assert hft.paged_cache_view(cache, 1, [index], cu_k, 20) is None  # a layer the cache does not know


def test_check_paged_cache_view_refuses_keys_that_are_not_whole_blocks():
    cache = _PagedCache(16)
    index = cache.read_index([20], [[3, 5]]) + 1  # shifted: the request no longer starts a block
    cu_k = torch.tensor([0, 20], dtype=torch.int32)
    _, _, table = hft.paged_cache_view(cache, 0, [index], cu_k, 20)
    with pytest.raises(ValueError, match="not whole blocks"):
        hft.check_paged_cache_view(index, cu_k, table, 16)


class _Allocator:
    """transformers 5.19+'s FullAttentionCacheAllocator as allocator_pages
    reads it: one tensor for a group of ``layers`` layers, each page of
    ``tokens`` rows holding [L0 keys | L0 values | L1 keys | ...] in turn,
    one page a block (a block's rows ``2 * layers * tokens`` apart)."""

    supports_block_table = True
    index = 0

    def __init__(self, tokens, num_blocks=12, layers=2, heads_kv=2, dim=8):
        self.tokens_per_page = tokens
        self.stride = 2 * layers * tokens
        self.rows = torch.randn(num_blocks * self.stride, heads_kv, dim)
        self.views = {i: (self.rows[2 * i * tokens:], self.rows[(2 * i + 1) * tokens:]) for i in range(layers)}

    def get_cache_for_block_table(self, layer):
        k, v = (x.view(-1, self.tokens_per_page, *x.shape[1:]) for x in self.views[layer])
        n = min(k.shape[0], v.shape[0])
        return k[:n], v[:n]

    def read_index(self, lengths, blocks):
        """get_read_indices: request b's key j at blocks[b][j // tokens] * stride + j % tokens."""
        t = self.tokens_per_page
        return torch.tensor([blocks[b][j // t] * self.stride + j % t for b, n in enumerate(lengths) for j in range(n)])


@pytest.mark.parametrize("tokens,page", [(16, 16), (12, 4), (6, 2), (2048, 1024)])
@pytest.mark.parametrize("layer", [0, 1])
def test_allocator_pages_read_each_request_where_transformers_put_it(tokens, page, layer):
    """transformers 5.19-5.23's cache (the continuous-batching route of
    _paged_step): the pools and the block table built from the read index
    name every key's row in the layer's own view, for either layer of an
    interleaved group; the opt-in check agrees."""
    num_blocks, lengths, blocks = _requests(tokens)
    alloc = _Allocator(tokens, num_blocks=num_blocks)
    index = alloc.read_index(lengths, blocks)
    cu_k = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    k, v, got_page = hft.allocator_pages(alloc, layer, index)
    assert got_page == page and k.shape[1:] == (page, 2, 8) and v.shape == k.shape
    table = hft._block_table(index, cu_k, max(lengths), page)
    assert table.dtype == torch.int32 and table.shape == (4, -(-max(lengths) // page))
    k_rows, v_rows = alloc.views[layer]
    for b, n in enumerate(lengths):  # every live key is the row transformers' read names
        start = int(cu_k[b])
        pages = table[b, :-(-n // page)].long()
        torch.testing.assert_close(k[pages].flatten(0, 1)[:n], k_rows[index[start:start + n]], rtol=0, atol=0)
        torch.testing.assert_close(v[pages].flatten(0, 1)[:n], v_rows[index[start:start + n]], rtol=0, atol=0)
    hft.check_paged_cache_view(index, cu_k, table, page)


def test_allocator_pages_fall_back_where_they_cannot_read_in_place():
    alloc = _Allocator(16)
    index = alloc.read_index([20], [[3, 5]])
    assert hft.allocator_pages(alloc, 0, index[:0]) is None  # nothing cached: the update's write-only case
    sliding = _Allocator(16)
    sliding.supports_block_table = False  # a sliding group's ring
    assert hft.allocator_pages(sliding, 0, index) is None
    assert hft.allocator_pages(object(), 0, index) is None


@pytest.fixture
def checked_cb(registered, fake_varlen, monkeypatch):
    """Continuous batching on the CPU with the float32 stand-in: each varlen
    call's arguments pass the kernel's own checks (in bf16, the kernel's
    dtypes), every block table is checked against transformers' own read
    index (``HOPPER_FLASH_CHECK_VARLEN=1``), and each call is recorded as
    ``(cu_q, cu_k, k.dim(), window_size)`` when it is made (transformers
    reuses the tensors)."""
    from hopper_flash import checks, paged

    _, cb_cache = _continuous_batching()
    # The cache sizes itself from the accelerator's free memory; on the CPU, 1 GiB.
    monkeypatch.setattr(cb_cache, "get_device_and_memory_breakdown",
                        lambda *a, **k: (torch.device("cpu"), 1 << 30, 0, 0))
    checked = []
    real_fake = hopper_flash.flash_attn_varlen_func

    def checked_fake(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        args = (q.bfloat16(), k.bfloat16(), v.bfloat16(), cu_q, cu_k, max_q, max_k, kwargs.get("seqused_q"),
                kwargs.get("seqused_k"))
        if kwargs.get("block_table") is not None:
            paged.check_paged_varlen_arguments(*args, kwargs["block_table"], kwargs.get("softmax_scale"),
                                               kwargs.get("causal"))
        else:
            checks.check_varlen_arguments(*args, kwargs.get("softmax_scale"), kwargs.get("causal"))
        checked.append((cu_q.tolist(), cu_k.tolist(), k.dim(), kwargs.get("window_size")))
        return real_fake(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)

    monkeypatch.setattr(hopper_flash, "flash_attn_varlen_func", checked_fake)
    monkeypatch.setenv("HOPPER_FLASH_CHECK_VARLEN", "1")
    return checked


@pytest.mark.parametrize("block_size,page", [(16, 16), (12, 4)])
def test_continuous_batching_matches_paged_sdpa_cpu(checked_cb, fake_varlen, block_size, page):
    """generate_batch on a model loaded with "hopper_flash" runs
    "paged|hopper_flash": each step one varlen call per layer over the
    requests' new tokens and their cached keys (prefill chunks beside
    decodes), read in place from the paged cache through a block table, whose
    arguments pass the real argument checks; the greedy tokens are
    paged|sdpa's (float32, the stand-in for the kernel). A block size of 12
    is read as pages of 4 keys."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in (5, 3, 30, 70)]
    model = _llama()
    ref = _generate_batch(_set_attn(model, "paged|sdpa"), prompts, block_size=block_size)
    out = _generate_batch(_set_attn(model, NAME), prompts, block_size=block_size)
    assert model.config._attn_implementation == NAME  # restored after the batch
    assert out == ref and all(len(t) == 6 for t in out.values())
    assert len(checked_cb) >= 2 * 6  # two layers, at least one call per step
    assert any(cu_q[-1] > len(cu_q) - 1 and cu_k[-1] > cu_q[-1] for cu_q, cu_k, _, _ in checked_cb), \
        "a prefill chunk beside cached keys"
    assert all(call["causal"] and call["window_size"] == (-1, -1) for call in fake_varlen)
    cached = [k_dim for cu_q, cu_k, k_dim, _ in checked_cb if cu_k[-1] > cu_q[-1]]
    if _cb_era() == "layer":
        # transformers 5.24 on reads every cached key back before the call: none is read in place.
        assert cached and all(k_dim == 3 for k_dim in cached)
        return
    in_place = [call for call in fake_varlen if call.get("block_table") is not None]
    assert in_place and all(call["k"].shape[1] == page for call in in_place)
    # Steps with cached keys read them in place; only prefills with nothing cached pass k itself.
    assert all(k_dim == 4 for k_dim in cached)


def test_continuous_batching_sliding_layers_and_shared_prefixes_cpu(checked_cb):
    """A model with a full attention layer and a sliding-window one (two
    cache groups, Qwen2's max_window_layers) and requests sharing a
    three-block prompt prefix (transformers shares those blocks): the full
    layer reads its keys in place (block tables checked against the read
    index), the sliding layer has them read back packed by cache.update,
    and the greedy tokens are paged|sdpa's. (The window, 4096 keys, covers
    every request: the stand-in need not apply it.)"""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=1000, hidden_size=512, intermediate_size=1024,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=8192, use_sliding_window=True, sliding_window=4096,
                                      max_window_layers=1)
    model = transformers.Qwen2ForCausalLM(config).eval()
    assert [getattr(layer.self_attn, "sliding_window", None) for layer in model.model.layers] == [None, 4096]
    gen = torch.Generator().manual_seed(8)
    prefix = torch.randint(1, 1000, (48,), generator=gen).tolist()
    prompts = [prefix + torch.randint(1, 1000, (n,), generator=gen).tolist() for n in (5, 20)]
    prompts += [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in (7, 33)]
    ref = _generate_batch(_set_attn(model, "paged|sdpa"), prompts)
    out = _generate_batch(_set_attn(model, NAME), prompts)
    assert out == ref and all(len(t) == 6 for t in out.values())
    cached = [(k_dim, window) for cu_q, cu_k, k_dim, window in checked_cb if cu_k[-1] > cu_q[-1]]
    if _cb_era() == "layer":
        # transformers 5.24 on reads every cached key back before the call (a window wider than
        # every request's keys is then no window: _window_size).
        assert cached and all(k_dim == 3 and window == (-1, -1) for k_dim, window in cached)
        return
    assert (4, (-1, -1)) in cached, "the full attention layer read in place"
    assert (3, (4095, 0)) in cached, "the sliding layer read back packed"
    assert all(window == (4095, 0) for k_dim, window in cached if k_dim == 3)


# --------------------------------------------------------------------------
# GPU: the real kernel in a bf16 model
# --------------------------------------------------------------------------
def _gpu_models():
    hft.register()
    model = _llama(seed=0).to(device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 1000, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()
    return model, ids


@pytest.mark.gpu
def test_llama_logits_match_sdpa_gpu():
    model, ids = _gpu_models()
    ref = _logits(_set_attn(model, "sdpa"), ids).float()
    out = _logits(_set_attn(model, NAME), ids).float()
    fp32 = _logits(_set_attn(model, "sdpa").float(), ids).float()  # same weights, float32
    assert torch.isfinite(out).all()
    rel = rel_fro_err(out, ref)
    rel_hf_fp32, rel_sdpa_fp32 = rel_fro_err(out, fp32), rel_fro_err(ref, fp32)
    max_abs = (out - ref).abs().max().item()
    print(f"\nhopper_flash vs sdpa (bf16): rel-Frobenius {rel:.3e}, max abs {max_abs:.3e}, "
          f"logit max abs {ref.abs().max().item():.3f}; vs float32 model: hopper_flash {rel_hf_fp32:.3e}, "
          f"sdpa {rel_sdpa_fp32:.3e}")
    assert rel < 2e-2
    assert rel_hf_fp32 < 2 * rel_sdpa_fp32 + 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not hasattr(transformers, "GptOssForCausalLM"), reason="transformers without gpt-oss")
def test_gpt_oss_prefill_and_decode_logits_match_eager_gpu():
    """gpt-oss (sinks in every layer; a sliding-window layer and a full one)
    in bf16 with the real kernels: a 300-token prefill and four decode steps
    on a cache. Each step's logits are as close to the float32 eager
    model's (same weights) as bf16 eager's are (the bf16 noise floor)."""
    hft.register()
    model = _gpt_oss().cuda()
    ids = torch.randint(1, 1000, (2, 304), generator=torch.Generator().manual_seed(3)).cuda()

    def run(impl, dtype):
        m = _set_attn(model.to(dtype), impl)
        cache = transformers.DynamicCache(config=m.config)
        steps = [_logits(m, ids[:, :300], past_key_values=cache, use_cache=True)]
        for t in range(300, 304):
            steps.append(_logits(m, ids[:, t:t + 1], past_key_values=cache, use_cache=True))
        return [x.float() for x in steps]

    fp32 = run("eager", torch.float32)
    eager = run("eager", torch.bfloat16)
    ours = run(NAME, torch.bfloat16)
    for i, (o, e, f) in enumerate(zip(ours, eager, fp32)):
        assert torch.isfinite(o).all()
        rel_ours, rel_eager = rel_fro_err(o, f), rel_fro_err(e, f)
        print(f"\nstep {i}: vs the float32 model, hopper_flash {rel_ours:.3e}, bf16 eager {rel_eager:.3e}")
        assert rel_ours < 2 * rel_eager + 1e-3, f"step {i}"


@pytest.mark.gpu
def test_llama_chunked_prefill_matches_sdpa_gpu():
    model, ids = _gpu_models()

    def run(impl):
        m = _set_attn(model, impl)
        cache = transformers.DynamicCache(config=m.config)
        first = _logits(m, ids[:, :100], past_key_values=cache, use_cache=True)
        second = _logits(m, ids[:, 100:], past_key_values=cache, use_cache=True)
        return torch.cat([first, second], dim=1).float()

    ref, out = run("sdpa"), run(NAME)
    rel = rel_fro_err(out, ref)
    print(f"\nchunked prefill, hopper_flash vs sdpa (bf16): rel-Frobenius {rel:.3e}")
    assert rel < 2e-2


@pytest.mark.gpu
def test_backend_decode_steps_take_the_prepared_call_gpu(monkeypatch):
    # A decode loop as a DynamicCache runs it (K/V a new tensor each step,
    # one key longer, across a KV tile boundary): after the first call per
    # tile count the backend takes the prepared call, without the checks,
    # and gives flash_attn_func's bits; one step judged against float64.
    from hopper_flash import checks, plan
    from hopper_flash.reference import check_kvcache

    class Module(torch.nn.Module):
        is_causal = True

    monkeypatch.setattr(plan, "_PREPARED", {})  # nothing prepared by earlier tests
    validated = []
    real_validate = checks.validate
    monkeypatch.setattr(checks, "validate", lambda *a: validated.append(1) or real_validate(*a))
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(1, 8, 4090, 128, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn_like(k)
    scale = 128 ** -0.5
    with torch.inference_mode():
        for step in range(12):  # 4091 .. 4102 keys: 32, then 33 tiles of 128
            q = torch.randn(1, 32, 1, 128, device="cuda", generator=gen).to(torch.bfloat16)
            k = torch.cat([k, torch.randn(1, 8, 1, 128, device="cuda", generator=gen).to(torch.bfloat16)], dim=2)
            v = torch.cat([v, torch.randn(1, 8, 1, 128, device="cuda", generator=gen).to(torch.bfloat16)], dim=2)
            before = len(validated)
            out = hft.hopper_flash_attention_forward(Module(), q, k, v, None, scaling=scale)[0]
            took_prepared = len(validated) == before
            ref = hopper_flash.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               softmax_scale=scale)
            assert torch.equal(out, ref), step
            # The first call of a tile count takes the full path, and it (or
            # the flash_attn_func call after it) prepares; the rest are prepared.
            assert took_prepared == (k.shape[2] not in (4091, 4097)), (step, k.shape[2])
            if step == 11:
                bad = [r.message for r in check_kvcache(out, q.transpose(1, 2), k.transpose(1, 2),
                                                        v.transpose(1, 2), [k.shape[2]], causal=False,
                                                        softmax_scale=scale) if not r]
                assert not bad, bad


# --------------------------------------------------------------------------
# GPU: padded and packed batches through the varlen kernel
# --------------------------------------------------------------------------
def _gpu_seqs(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 1000, (n,), generator=gen).cuda() for n in lengths]


@pytest.mark.gpu
@pytest.mark.parametrize("side", ["left", "right"])
def test_llama_padded_batch_rows_equal_running_alone_gpu(side):
    hft.register()
    model = _set_attn(_llama(seed=0).to(device="cuda", dtype=torch.bfloat16), NAME)
    seqs = _gpu_seqs((300, 7, 129, 1, 64), seed=11)
    ids, mask = _pad_batch([x.cpu() for x in seqs], side)
    batched = _logits(model, ids.cuda(), attention_mask=mask.cuda()).float()
    assert torch.isfinite(batched).all()
    for b, x in enumerate(seqs):
        alone = _logits(model, x[None]).float()[0]
        row = batched[b, -len(x):] if side == "left" else batched[b, :len(x)]
        rel = rel_fro_err(row, alone)
        print(f"\n{side} padding, prompt {b} ({len(x)} tokens): batched vs alone rel-Frobenius {rel:.3e}")
        assert rel < 2e-2


@pytest.mark.gpu
def test_llama_left_padded_greedy_generate_gpu():
    """Batched greedy generation with left padding (its decode steps read the cache in place, through
    flash_attn_with_kvcache): each prompt's logits at every step equal its logits generated alone, up to
    bf16 noise, for as long as the two greedy token streams agree (random weights make near-ties)."""
    hft.register()
    model = _set_attn(_llama(seed=0).to(device="cuda", dtype=torch.bfloat16), NAME)
    seqs = _gpu_seqs((40, 5, 77), seed=12)
    ids, mask = _pad_batch([x.cpu() for x in seqs], "left")
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(ids.cuda(), attention_mask=mask.cuda(), **kwargs)
        assert out.sequences.shape == (3, ids.shape[1] + 8)
        for b, x in enumerate(seqs):
            alone = model.generate(x[None], attention_mask=torch.ones(1, len(x), dtype=torch.long, device="cuda"),
                                   **kwargs)
            # The first new token comes from the prefill logits (bf16 noise apart, the same computation).
            assert out.sequences[b, ids.shape[1]] == alone.sequences[0, len(x)], b
            steps = 0
            for step, (batched, single) in enumerate(zip(out.logits, alone.logits)):
                rel = rel_fro_err(batched[b].float(), single[0].float())
                assert torch.isfinite(batched[b]).all() and rel < 2e-2, (b, step, rel)
                steps += 1
                if out.sequences[b, ids.shape[1] + step] != alone.sequences[0, len(x) + step]:
                    break
            print(f"\nprompt {b}: logits of {steps} steps within bf16 noise of generating alone")


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_padded_decode_step_reads_the_cache_in_place_gpu(seqlen_q):
    """A padded batch's decode step through the backend (no gradient; GQA 32/8, 3001 keys of which a
    static cache's last columns lie past the mask): each row judged against the float64 reference over
    its own run of keys, NaN everywhere else in k and v; then three layers of the step captured in a CUDA
    graph, twice (two graphs), and each graph replayed alone after the mask changed in place (the runs are
    found inside each graph and shared by its layers, never kept from an eager call or the other graph)."""
    from hopper_flash.reference import check_kvcache

    torch.manual_seed(0)
    batch, heads, heads_kv, dim, seqlen_k, width = 5, 32, 8, 128, 3001, 2900
    scale = dim ** -0.5
    q = torch.randn(batch, heads, seqlen_q, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, heads_kv, seqlen_k, dim, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    runs = [(0, width), (17, width), (1000, width), (width - seqlen_q, width), (0, 1234)]
    mask = torch.zeros(batch, width, dtype=torch.long, device="cuda")
    for b, (lo, hi) in enumerate(runs):
        mask[b, lo:hi] = 1
        for t in (k, v):
            t[b, :, :lo] = math.nan
            t[b, :, hi:] = math.nan

    def judged(out, runs):
        assert out.shape == (batch, seqlen_q, heads, dim)
        verdicts = check_kvcache(out, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                 [hi for _, hi in runs], starts=[lo for lo, _ in runs], causal=seqlen_q > 1,
                                 softmax_scale=scale)
        assert all(verdicts), "\n".join(x.message for x in verdicts if not x)

    def step(m, layer=0):
        return hft.hopper_flash_attention_forward(_layer(layer), q, k, v, m, scaling=scale)[0]

    def masked(runs):
        new_mask = torch.zeros_like(mask)
        for b, (lo, hi) in enumerate(runs):
            new_mask[b, lo:hi] = 1
        return new_mask

    with torch.no_grad():
        judged(step(mask), runs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(mask)  # warm-up: an eager call keeps the runs of this mask
        torch.cuda.current_stream().wait_stream(stream)
        graphs, outs = [], []
        for _ in range(2):
            graphs.append(torch.cuda.CUDAGraph())
            with torch.cuda.graph(graphs[-1]):
                outs.append([step(mask, layer) for layer in range(3)])
        inner = [(100, width), (17, 2500), (2000, width), (width - seqlen_q, width), (3, 1000)]
        other = [(5, 2000), (17, 2899), (1500, 2600), (width - seqlen_q, width), (7, 1234)]  # (inside the runs)
        for graph, out, new_runs in ((graphs[1], outs[1], inner), (graphs[0], outs[0], other)):
            mask.copy_(masked(new_runs))
            for o in out:
                o.fill_(math.nan)
            graph.replay()
            torch.cuda.synchronize()
            for o in out:
                judged(o, new_runs)


@pytest.mark.gpu
def test_padded_decode_step_compiles_fullgraph_gpu():
    """torch.compile(fullgraph=True) of a padded decode step through the backend: the KV cache call is
    traced (its custom op), each row judged against the float64 reference over its run."""
    from hopper_flash.reference import check_kvcache

    torch.manual_seed(1)
    scale = 128 ** -0.5
    q = torch.randn(3, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(3, 8, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    runs = [(0, 1000), (999, 1000), (130, 1000)]
    mask = torch.zeros(3, 1000, dtype=torch.long, device="cuda")
    for b, (lo, hi) in enumerate(runs):
        mask[b, lo:hi] = 1
        k[b, :, :lo] = v[b, :, :lo] = math.nan
    step = torch.compile(lambda q, k, v, m: hft.hopper_flash_attention_forward(_Module(), q, k, v, m,
                                                                               scaling=scale)[0], fullgraph=True)
    with torch.no_grad():
        out = step(q, k, v, mask)
    verdicts = check_kvcache(out, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), [hi for _, hi in runs],
                             starts=[lo for lo, _ in runs], causal=False, softmax_scale=scale)
    assert all(verdicts), "\n".join(x.message for x in verdicts if not x)


@pytest.mark.gpu
def test_llama_packed_training_step_gradients_match_padded_gpu():
    hft.register()
    seqs = [x.cpu() for x in _gpu_seqs((120, 5, 300, 64), seed=13)]

    def step(**batch):
        model = _set_attn(_llama(seed=1).to(device="cuda", dtype=torch.bfloat16).train(), NAME)
        loss = model(**{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}).loss
        loss.backward()
        return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}

    ids, position_ids, cu = _packed(seqs)
    labels = ids.clone()
    labels[0, cu[:-1].long()] = -100
    packed_loss, packed_grads = step(input_ids=ids, labels=labels, position_ids=position_ids, cu_seq_lens_q=cu,
                                     cu_seq_lens_k=cu, max_length_q=300, max_length_k=300)
    pids, mask = _pad_batch(seqs, "right")
    plabels = pids.masked_fill(mask == 0, -100)
    plabels[:, 0] = -100
    padded_loss, padded_grads = step(input_ids=pids, attention_mask=mask, labels=plabels)
    assert abs(packed_loss.item() - padded_loss.item()) < 1e-2 * abs(padded_loss.item())
    worst = max(rel_fro_err(packed_grads[n], padded_grads[n]) for n in packed_grads)
    print(f"\npacked vs padded training step: loss {packed_loss.item():.5f} vs {padded_loss.item():.5f}, "
          f"worst parameter-gradient rel-Frobenius {worst:.3e}")
    assert worst < 5e-2


@pytest.mark.gpu
def test_llama_compiled_forward_with_padding_gpu():
    hft.register()
    model = _set_attn(_llama(seed=0).to(device="cuda", dtype=torch.bfloat16), NAME)
    seqs = _gpu_seqs((50, 9, 33), seed=14)
    ids, mask = _pad_batch([x.cpu() for x in seqs], "left")
    ids, mask = ids.cuda(), mask.cuda()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        out = compiled(ids, attention_mask=mask).logits.float()
        ref = model(ids, attention_mask=mask).logits.float()
    live = mask.bool()
    assert rel_fro_err(out[live], ref[live]) < 1e-2


@pytest.fixture
def varlen_op_on_cpu(monkeypatch):
    """A CPU kernel for hopper_flash::varlen_fwd (the float32 stand-in), scoped to the test, and the
    device checks relaxed: lets torch.compile trace and run the whole varlen path on this machine.
    Yields the rows of k of each call."""
    from hopper_flash import checks

    k_rows = []

    def cpu_impl(q, k, v, cq, ck, uq, uk, mq, mk, scale, causal, deterministic=False):
        k_rows.append(k.shape[0])
        out = _varlen_stand_in(q, k, v, cq, ck, mq, mk, seqused_q=uq, seqused_k=uk, softmax_scale=scale,
                               causal=causal)
        return out, torch.zeros(q.shape[1], q.shape[0])

    monkeypatch.setattr(checks, "check_cuda", lambda t, name="q": None)
    monkeypatch.setattr(checks, "check_device", lambda t, name="q": None)
    with torch.library._scoped_library("hopper_flash", "IMPL") as lib:
        lib.impl("varlen_fwd", cpu_impl, "CPU")
        yield k_rows


@pytest.mark.parametrize("how", ["padded", "packed"])
def test_llama_compiled_fullgraph_varlen_cpu(registered, varlen_op_on_cpu, how):
    """torch.compile(fullgraph=True) of a model forward traces the padded and the packed varlen paths
    (no graph break: no host sync, no data-dependent branch) and computes what eager does."""
    model = _set_attn(_llama(num_hidden_layers=1).to(torch.bfloat16), NAME)
    gen = torch.Generator().manual_seed(15)
    seqs = [torch.randint(1, 1000, (n,), generator=gen) for n in (9, 4, 13)]
    if how == "padded":
        ids, mask = _pad_batch(seqs, "left")
        kwargs = dict(attention_mask=mask)
        live = mask.bool()
    else:
        ids, position_ids, cu = _packed(seqs)
        kwargs = dict(position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=13,
                      max_length_k=13)
        live = torch.ones_like(ids, dtype=torch.bool)
    ref = model(ids, **kwargs).logits.detach()  # parameters require grad: the custom-op path, as compiled
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, fullgraph=True, backend="eager")(ids, **kwargs).logits
        torch._dynamo.reset()  # (torch 2.13's fullgraph=True lets a tolist through on the CPU: explain counts it)
        explained = torch._dynamo.explain(model)(ids, **kwargs)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch.testing.assert_close(out[live], ref[live])
    # Compiled, the keys go compact (one row per token): inductor does not
    # keep the layout an as_strided view of an intermediate past its own
    # elements assumes (on the GPU such views gave wrong logits).
    assert varlen_op_on_cpu and set(varlen_op_on_cpu) == {ids.numel()}, varlen_op_on_cpu


@pytest.mark.gpu
def test_continuous_batching_greedy_tokens_gpu():
    """generate_batch in bf16 with the real kernels (paged|hopper_flash; the
    scheduler mixes prefill chunks and decodes): every generated token is the
    float32 model's greedy choice up to the bf16 noise floor, teacher-forced
    on the prompt and the tokens generated before it."""
    _continuous_batching()
    hft.register()
    model = _set_attn(_llama(seed=0).to(device="cuda", dtype=torch.bfloat16), NAME)
    calls = []
    real = hopper_flash.flash_attn_varlen_func

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in (300, 7, 129, 1, 64, 700)]
    try:
        hopper_flash.flash_attn_varlen_func = counted
        out = _generate_batch(model, prompts, new_tokens=8, block_size=256, num_blocks=16, max_batch_tokens=256)
    finally:
        hopper_flash.flash_attn_varlen_func = real
    assert calls, "continuous batching did not reach the varlen call"
    ref32 = _set_attn(_llama(seed=0).to(device="cuda"), "sdpa")
    ref16 = _set_attn(model, "sdpa")
    for i, prompt in enumerate(prompts):
        tokens = out[i]
        assert len(tokens) == 8, (i, tokens)
        ids = torch.tensor([prompt + tokens[:-1]], device="cuda")
        f32 = _logits(ref32, ids).float()[0, len(prompt) - 1:]
        b16 = _logits(ref16, ids).float()[0, len(prompt) - 1:]
        noise = (b16 - f32).abs().max().item()
        chosen = f32.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
        gap = (f32.max(dim=1).values - chosen).max().item()
        print(f"\nrequest {i} ({len(prompt)} tokens): chosen logit below the float32 maximum by {gap:.3e}, "
              f"bf16 noise {noise:.3e}")
        assert gap <= 2 * noise + 1e-3, (i, gap, noise)


def _cache_step(past, new, block_size, heads=8, heads_kv=2, dim=128, seed=0, device="cuda"):
    """A continuous-batching step on the GPU over a _PagedCache whose pools
    hold NaN everywhere but the requests' cached keys: request b has past[b]
    cached keys and new[b] new tokens, in blocks dealt at random. Returns
    the attention function's arguments and the keys it should see, packed."""
    gen = torch.Generator().manual_seed(seed)
    blocks_each = [-(-(p + n) // block_size) for p, n in zip(past, new)]
    cache = _PagedCache(block_size, num_blocks=sum(blocks_each) + 3, heads_kv=heads_kv, dim=dim)
    order = torch.randperm(sum(blocks_each) + 3, generator=gen).tolist()
    dealt, at = [], 0
    for nb in blocks_each:
        dealt.append(order[at:at + nb])
        at += nb
    read = cache.read_index([p + n for p, n in zip(past, new)], dealt)
    starts = [0] + torch.tensor([p + n for p, n in zip(past, new)]).cumsum(0).tolist()
    write = torch.cat([read[s + p:s + p + n] for s, p, n in zip(starts, past, new)])
    cached = torch.cat([read[s:s + p] for s, p in zip(starts, past)])
    for pools in (cache.key_cache, cache.value_cache):
        pool = torch.full(pools[0].shape, math.nan, dtype=torch.bfloat16)
        pool[cached] = torch.randn(len(cached), heads_kv, dim, generator=gen).bfloat16()
        pools[0] = pool.to(device)
    total_q = sum(new)
    q = torch.randn(1, heads, total_q, dim, generator=gen).bfloat16().to(device)
    k = torch.randn(1, heads_kv, total_q, dim, generator=gen).bfloat16().to(device)
    v = torch.randn(1, heads_kv, total_q, dim, generator=gen).bfloat16().to(device)
    i32 = dict(dtype=torch.int32, device=device)
    kwargs = dict(cache=cache, read_index=[read.to(device)], write_index=[write.to(device)],
                  cu_seq_lens_q=torch.tensor([0] + new).cumsum(0).to(**i32),
                  cu_seq_lens_k=torch.tensor(starts).to(**i32), max_seqlen_q=max(new),
                  max_seqlen_k=max(p + n for p, n in zip(past, new)))
    return q, k, v, kwargs, read.to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [256, 48, 16, 12])
@pytest.mark.parametrize("step", ["decodes", "mixed"])
def test_paged_attention_reads_transformers_cache_in_place_gpu(block_size, step):
    """hopper_flash_paged_attention_forward on the real kernels over a
    transformers-layout paged cache (pages of 256 read by TMA, 16 by TMA
    boxes, 4 gathered): the new keys are written, each request's keys read
    in place (NaN fills every cache row no request owns, and the tails of
    partly used blocks), and the output is judged against the float64
    reference over the keys transformers' own read would gather."""
    from hopper_flash.reference import assert_judged, varlen_baseline, varlen_reference

    past, new = (([300, 1, 2000, 77, 4097], [1] * 5) if step == "decodes"
                 else ([0, 100, 700, 5000], [50, 1, 64, 1]))
    q, k, v, kwargs, read = _cache_step(past, new, block_size, seed=block_size)
    module = _Module()
    module.layer_idx = 0
    calls = []
    view = hft.paged_cache_view
    hft.paged_cache_view = lambda *a: calls.append(1) or view(*a)
    try:
        out, _ = hft.hopper_flash_paged_attention_forward(module, q, k, v, None, **kwargs)
    finally:
        hft.paged_cache_view = view
    assert calls and view(kwargs["cache"], 0, kwargs["read_index"], kwargs["cu_seq_lens_k"],
                          kwargs["max_seqlen_k"]) is not None, "the in-place route"
    cache = kwargs["cache"]
    kp, vp = cache.key_cache[0][read], cache.value_cache[0][read]  # what cache.update's read gathers
    assert not kp.isnan().any(), "every key a request reads was written"
    qt = q[0].transpose(0, 1)
    cq, ck = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
    ref, _ = varlen_reference(qt, kp, vp, cq, ck, causal=True)
    base = varlen_baseline(qt, kp, vp, cq, ck, causal=True)
    assert_judged("out", out, ref, base)


def test_paged_attention_in_place_compiles_fullgraph_cpu(monkeypatch):
    """torch.compile(fullgraph=True) traces the continuous-batching attention
    function with its in-place read (the cache object's attributes, the
    write through cache.update, the block table built on the device, the
    paged varlen op) without a graph break, and computes what eager does
    (a CPU kernel for hopper_flash::varlen_fwd_paged: the float32 stand-in)."""
    from hopper_flash import checks

    def cpu_impl(q, k, v, cq, ck, uq, uk, table, mq, mk, scale, causal, wl=-1, wr=-1, softcap=0.0, sink=None,
                 num_splits=0):
        out = _varlen_stand_in(q, k, v, cq, ck, mq, mk, seqused_q=uq, seqused_k=uk, softmax_scale=scale,
                               causal=causal, block_table=table)
        return out, torch.zeros(q.shape[1], q.shape[0])

    monkeypatch.setattr(checks, "check_cuda", lambda t, name="q": None)
    monkeypatch.setattr(checks, "check_device", lambda t, name="q": None)
    monkeypatch.setattr(checks, "check_op_device", lambda t: None)
    past, new = [300, 1, 40], [1, 1, 9]
    q, k, v, kwargs, read = _cache_step(past, new, 16, seed=3, device="cpu")
    module = _Module()
    module.layer_idx = 0

    def layer(q, k, v):
        return hft.hopper_flash_paged_attention_forward(module, q, k, v, None, **kwargs)[0]

    with torch.library._scoped_library("hopper_flash", "IMPL") as lib:
        lib.impl("varlen_fwd_paged", cpu_impl, "CPU")
        torch._dynamo.reset()
        with torch.no_grad():
            out = torch.compile(layer, fullgraph=True, backend="eager")(q, k, v)
            # (torch 2.13's fullgraph=True lets a data-dependent read such as tolist through on the
            # CPU; explain counts it as the graph break it is.)
            torch._dynamo.reset()
            explained = torch._dynamo.explain(layer)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    cache = kwargs["cache"]
    kp, vp = cache.key_cache[0][read], cache.value_cache[0][read]  # what cache.update's read gathers
    expected = _varlen_stand_in(q[0].transpose(0, 1), kp, vp, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"],
                                max(new), max(p + n for p, n in zip(past, new)), causal=True)
    torch.testing.assert_close(out, expected)


def test_in_place_step_with_a_long_request_asks_for_splits(fake_varlen, monkeypatch):
    """A continuous-batching step whose keys are skewed (many short requests
    beside a long one: hopper_flash.plan.varlen_skew_splits on the read
    index's length) passes an explicit split count; an even step leaves the
    kernels' heuristic (num_splits=0)."""
    from hopper_flash import plan

    monkeypatch.setattr(plan, "sm_count", lambda device=None: 132)
    module = _Module()
    module.layer_idx = 0
    for past, skewed in (([1023] * 64 + [65535], True), ([4095] * 64, False)):
        new = [1] * len(past)
        q, k, v, kwargs, _ = _cache_step(past, new, 256, heads=32, heads_kv=8, dim=8, seed=4, device="cpu")
        fake_varlen.clear()
        hft.hopper_flash_paged_attention_forward(module, q, k, v, None, **kwargs)
        (call,) = fake_varlen
        assert call["block_table"] is not None
        assert (call["num_splits"] > 1) if skewed else call["num_splits"] == 0, (skewed, call["num_splits"])


def test_block_table_built_once_per_step_and_again_when_the_index_changes(monkeypatch):
    """Layers of one step (the same read index and cu_seq_lens_k tensors)
    share one block table; a rewritten index (its version moves) or a new
    step's index gets a new one, equal to a fresh build."""
    cache = _PagedCache(16)
    storage = torch.zeros(64, dtype=torch.int64)
    storage[:20] = cache.read_index([20], [[3, 5]])
    index, cu_k = storage[:20], torch.tensor([0, 20], dtype=torch.int32)
    first = hft.paged_cache_view(cache, 0, [index], cu_k, 20)[2]
    assert hft.paged_cache_view(cache, 0, [index], cu_k, 20)[2] is first  # the next layer of the step
    storage[:20] = cache.read_index([20], [[7, 1]])  # the next step writes the same storage
    rebuilt = hft.paged_cache_view(cache, 0, [index], cu_k, 20)[2]
    assert rebuilt is not first and rebuilt.tolist() == [[7, 1]]
    fresh = hft.paged_cache_view(cache, 0, [storage[:20].clone()], cu_k, 20)[2]  # a new index tensor
    assert fresh is not rebuilt and torch.equal(fresh, rebuilt)
    capture = [5]  # a CUDA graph capture's id (checks.capture_id): its own table, kept within it
    monkeypatch.setattr(hft.checks, "capture_id", lambda: capture[0])
    captured = hft.paged_cache_view(cache, 0, [index], cu_k, 20)[2]
    assert captured is not rebuilt and hft.paged_cache_view(cache, 0, [index], cu_k, 20)[2] is captured
    capture[0] = 6  # another capture
    assert hft.paged_cache_view(cache, 0, [index], cu_k, 20)[2] is not captured
    capture[0] = None  # capturing, the capture unknown: built every time
    assert hft.paged_cache_view(cache, 0, [index], cu_k, 20)[2] is not hft.paged_cache_view(cache, 0, [index], cu_k,
                                                                                            20)[2]
    capture[0] = 0  # eager again: not the capture's table
    eager = hft.paged_cache_view(cache, 0, [index], cu_k, 20)[2]
    assert eager is not captured and torch.equal(eager, rebuilt)


def test_block_table_of_inference_tensors_built_every_time():
    """Tensors made under torch.inference_mode have no version counter: a block table read from them is
    never reused (an in-place rewrite of the index could not be told), and it equals a fresh build."""
    cache = _PagedCache(16)
    with torch.inference_mode():
        index, cu_k = cache.read_index([20], [[3, 5]]), torch.tensor([0, 20], dtype=torch.int32)
        first = hft.paged_cache_view(cache, 0, [index], cu_k, 20)[2]
        again = hft.paged_cache_view(cache, 0, [index], cu_k, 20)[2]
    assert again is not first and first.tolist() == again.tolist() == [[3, 5]]
