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
import math
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hopper_flash  # noqa: E402
from hopper_flash.integrations import transformers as hft  # noqa: E402
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


def _set_attn(model, impl):
    """Switch the attention implementation; returns the model to run."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
        assert model.config._attn_implementation == impl
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

    def fake(q, k, v, *, softmax_scale=None, causal=False, return_lse=False):
        calls.append(dict(q=q, k=k, v=v, softmax_scale=softmax_scale, causal=causal))
        out, _ = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale)
        return out.to(q.dtype)

    monkeypatch.setattr(hopper_flash, "flash_attn_func", fake)
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
    assert masks[NAME] is masks["sdpa"]


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
PADDING = r"does not support padding or other non-causal attention masks yet"


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


def test_padding_mask_2d_raises(fake_kernel):
    q, k, v = _qkv()
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :4] = 0
    with pytest.raises(NotImplementedError, match=PADDING):
        hft.hopper_flash_attention_forward(_Module(), q, k, v, mask)
    assert fake_kernel == []


def test_padding_mask_through_the_model_raises(registered, fake_kernel):
    model = _set_attn(_llama(num_hidden_layers=1), NAME)
    ids = torch.randint(0, 1000, (2, 12))
    attention_mask = torch.ones_like(ids)
    attention_mask[0, :3] = 0  # left padding in row 0
    with torch.no_grad(), pytest.raises(NotImplementedError, match=PADDING):
        model(ids, attention_mask=attention_mask)
    assert fake_kernel == []


def test_additive_bias_raises():
    q, k, v = _qkv()
    mask = torch.randn(2, 1, 16, 16)
    with pytest.raises(NotImplementedError, match="additive attention biases"):
        hft.hopper_flash_attention_forward(_Module(), q, k, v, mask)


def test_active_sliding_window_mask_raises():
    q, k, v = _qkv()
    rows, cols = torch.arange(16)[:, None], torch.arange(16)[None, :]
    mask = ((cols <= rows) & (cols > rows - 4)).expand(2, 1, 16, 16)
    with pytest.raises(NotImplementedError, match=PADDING):
        hft.hopper_flash_attention_forward(_Module(), q, k, v, mask, sliding_window=4)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        hft.hopper_flash_attention_forward(_Module(), q, k, v, None, sliding_window=4)


@pytest.mark.parametrize("kwarg,value", [("softcap", 30.0), ("s_aux", torch.zeros(4)),
                                         ("cu_seq_lens_q", torch.tensor([0, 8, 16]))])
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


def test_no_mask_with_more_keys_than_queries_reads_first_keys_like_sdpa(fake_kernel):
    """Static-cache first fill: transformers' sdpa path crops k/v to seqlen_q; so do we."""
    q, k, v = _qkv(seqlen_q=8, seqlen_k=32)
    out, _ = hft.hopper_flash_attention_forward(_Module(), q, k, v, None)
    assert fake_kernel[-1]["k"].shape[1] == 8 and fake_kernel[-1]["causal"] is True
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k[:, :, :8].float(), v[:, :, :8].float(), is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


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
def test_llama_greedy_generate_matches_sdpa_cpu(registered, fake_kernel, cache_implementation):
    model = _llama()
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(3))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                  pad_token_id=0, cache_implementation=cache_implementation)
    with torch.no_grad():
        ref = _set_attn(model, "sdpa").generate(ids, **kwargs)
        out = _set_attn(model, NAME).generate(ids, **kwargs)
    assert torch.equal(out, ref)
    assert fake_kernel[-1]["q"].shape[1] == 1  # decode steps went through the backend


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
