"""A Hugging Face transformers attention backend: ``attn_implementation="hopper_flash"``.

Usage::

    import hopper_flash.integrations.transformers as hf_hopper
    hf_hopper.register()      # idempotent; returns "hopper_flash"
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16,
                                                 attn_implementation="hopper_flash").cuda()
    # or, on a model that already exists: model.set_attn_implementation("hopper_flash")

What ``register()`` does, for the installed transformers:

* registers :func:`hopper_flash_attention_forward` in transformers'
  ``AttentionInterface`` under ``"hopper_flash"``;
* registers transformers' own SDPA mask function under the same name in
  ``AttentionMaskInterface`` (transformers >= 4.53). Without a mask function a
  backend gets ``attention_mask=None`` always, padding or not, which would
  silently drop padding. With SDPA's, the backend gets ``None`` exactly where
  SDPA would rely on ``is_causal`` (plain causal or full attention, no
  padding), and otherwise a materialised 4-D boolean mask, which the backend
  checks (see below);
* transformers 5.x treats every implementation name containing ``"flash"`` as
  a FlashAttention variant and tries to import a FlashAttention kernel for it
  while checking the name (``set_attn_implementation``, ``from_pretrained``),
  which fails for ``"hopper_flash"``. ``register()`` wraps that pre-import
  (``transformers.modeling_utils.lazy_import_flash_attention``) so that it
  skips ``"hopper_flash"`` only; every other name goes through unchanged.

The backend computes exactly what SDPA computes, or raises:

* no mask (``None``): causal (bottom-right aligned, as ``is_causal`` says,
  from the call or ``module.is_causal``) or full attention. As SDPA does, a
  causal prefill whose keys outnumber the queries with no mask (a static
  cache's first fill: the extra keys are empty slots) reads only the first
  ``seqlen_q`` keys;
* a 4-D mask (boolean, or additive float holding only 0 and "-inf"): used
  only when it is the bottom-right causal pattern or all-visible, possibly
  followed by key columns that no query sees (the unused tail of a static
  cache), which are dropped. Any other mask (padding, packed sequences, an
  active sliding window, chunked or custom patterns) raises
  ``NotImplementedError``: hopper_flash has no varlen or masked kernel yet;
* dropout > 0, logit soft-capping, attention sinks, position biases and
  varlen arguments (``cu_seq_lens_q``/``cu_seqlens``) raise
  ``NotImplementedError``;
* ``query``/``key``/``value`` arrive as ``[batch, heads, seq, head_dim]`` and
  are handed to :func:`hopper_flash.flash_attn_func` as BSHD views
  (``.transpose(1, 2)``, no copy); k/v keep their own number of heads (GQA is
  read natively). The output is returned as ``[batch, seq, heads, head_dim]``
  with ``None`` attention weights, as transformers expects.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["NAME", "register", "is_registered", "hopper_flash_attention_forward"]

NAME = "hopper_flash"

_INSTALL_HINT = "pip install 'transformers>=4.48'"

_PADDING_MESSAGE = (
    "hopper_flash does not support padding or other non-causal attention masks yet (no varlen / masked "
    "kernel): the attention mask passed to the 'hopper_flash' attention implementation masks positions "
    "beyond the causal pattern. Pass batches of equal-length sequences without padding (attention_mask "
    "None or all ones), or use attn_implementation='sdpa' for padded or packed batches."
)

# Keyword arguments of transformers' attention calls that change the result and
# that the hopper_flash kernel cannot honour: present and not None -> raise.
_UNSUPPORTED_KWARGS = {
    "softcap": "logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias",
    "head_mask": "a head mask",
    "cu_seq_lens_q": "packed variable-length sequences (varlen, cu_seq_lens_q)",
    "cu_seq_lens_k": "packed variable-length sequences (varlen, cu_seq_lens_k)",
    "cu_seqlens": "packed variable-length sequences (varlen, cu_seqlens)",
}


def _import_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "hopper_flash.integrations.transformers needs the Hugging Face `transformers` package, which is "
            f"not installed: {_INSTALL_HINT}"
        ) from e
    return transformers


# --------------------------------------------------------------------------
# Mask analysis
# --------------------------------------------------------------------------
def _visible(mask: torch.Tensor) -> torch.Tensor:
    """Boolean "query may see key" of a 4-D boolean or additive float mask."""
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        visible = mask == 0
        # Masked entries of transformers' float masks are finfo.min or -inf;
        # anything else is a bias that changes the softmax.
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool((visible | blocked).all()):
            raise NotImplementedError(
                "hopper_flash does not support additive attention biases: the float attention mask passed to "
                "the 'hopper_flash' attention implementation holds values other than 0 and -inf"
            )
        return visible
    raise TypeError(f"attention_mask must be a boolean or floating-point tensor, got dtype {mask.dtype}")


def _analyse_mask(mask, seqlen_q: int, seqlen_k: int) -> tuple[bool | None, int]:
    """Decide how to run a masked call exactly.

    Returns ``(causal, seqlen_k_used)``: ``causal`` is None when the mask masks
    nothing (the caller then falls back to its ``is_causal`` flag), else True
    (bottom-right causal) or False (all visible); only the first
    ``seqlen_k_used`` keys take part. Raises NotImplementedError for every
    other pattern.
    """
    if not isinstance(mask, torch.Tensor):
        raise NotImplementedError(
            f"hopper_flash does not support attention masks of type {type(mask).__name__} (e.g. flex "
            "attention block masks); " + _PADDING_MESSAGE
        )
    if mask.dim() == 2:
        # A [batch, seqlen_k] padding mask (1/True: keep), as flash-attention's mask function passes it.
        if mask.is_floating_point():
            raise TypeError("a 2-D attention_mask must be boolean or integer (1 = keep), got "
                            f"dtype {mask.dtype}")
        if mask.shape[-1] != seqlen_k:
            raise ValueError(f"2-D attention_mask has {mask.shape[-1]} key positions, the keys have {seqlen_k}")
        if bool(mask.bool().all()):
            return None, seqlen_k
        raise NotImplementedError(_PADDING_MESSAGE)
    if mask.dim() != 4:
        raise ValueError("attention_mask must be None, 2-D [batch, seqlen_k] or 4-D "
                         f"[batch, heads, seqlen_q, seqlen_k], got shape {tuple(mask.shape)}")
    if mask.shape[-1] != seqlen_k or mask.shape[-2] not in (1, seqlen_q):
        raise ValueError(f"4-D attention_mask of shape {tuple(mask.shape)} does not fit seqlen_q={seqlen_q}, "
                         f"seqlen_k={seqlen_k}")
    visible = _visible(mask)
    seen_keys = visible.any(dim=-2).flatten(0, -2).any(dim=0)  # [seqlen_k]: some query sees the key
    seen_index = seen_keys.nonzero()
    if seen_index.numel() == 0:
        raise NotImplementedError("the attention mask hides every key from every query; " + _PADDING_MESSAGE)
    used = int(seen_index[-1]) + 1  # keys past this one are seen by no query (static-cache tail)
    visible = visible[..., :used]
    if bool(visible.all()):
        return False, used
    if used >= seqlen_q and visible.shape[-2] == seqlen_q:
        rows = torch.arange(seqlen_q, device=mask.device)[:, None]
        cols = torch.arange(used, device=mask.device)[None, :]
        if bool((visible == (cols <= rows + (used - seqlen_q))).all()):
            return True, used
    raise NotImplementedError(_PADDING_MESSAGE)


# --------------------------------------------------------------------------
# The attention function
# --------------------------------------------------------------------------
def hopper_flash_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers ``AttentionInterface`` function backed by :func:`hopper_flash.flash_attn_func`.

    ``query`` is ``[batch, heads, seqlen_q, head_dim]``, ``key``/``value``
    ``[batch, heads_kv, seqlen_k, head_dim]``. Returns ``(out, None)`` with
    ``out`` ``[batch, seqlen_q, heads, head_dim]``. Every input the kernel
    cannot compute exactly raises before the GPU is touched.
    """
    if dropout:
        raise NotImplementedError(
            f"hopper_flash has no attention dropout (got dropout={dropout}): set the config's "
            "attention_dropout to 0 to train with it, or call model.eval()"
        )
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"hopper_flash does not support {what} (got `{name}`); use another "
                                      "attn_implementation for this model")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("query, key and value must be 4-D [batch, heads, seq, head_dim], got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")

    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    # As transformers' sdpa/flash backends: the call's is_causal wins over the module's.
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    mask_causal = None
    if attention_mask is not None:
        mask_causal, used = _analyse_mask(attention_mask, seqlen_q, seqlen_k)
        if used < seqlen_k:
            key, value = key[:, :, :used], value[:, :, :used]
            seqlen_k = used
    if mask_causal is not None:
        # The mask says it all (sliding windows, if any, are part of it).
        causal = mask_causal and seqlen_q > 1
    else:
        causal = bool(is_causal) and seqlen_q > 1
        if causal and seqlen_k > seqlen_q:
            # No mask with more keys than queries: transformers' sdpa mask function returns None here only
            # for a first fill of a static cache (the extra keys are empty slots), which SDPA computes
            # with its top-left causal mask over the first seqlen_q keys. Do the same.
            key, value = key[:, :, :seqlen_q], value[:, :, :seqlen_q]
            seqlen_k = seqlen_q
        if sliding_window is not None and seqlen_k > sliding_window:
            raise NotImplementedError(
                f"hopper_flash does not support sliding-window attention yet (window {sliding_window} < "
                f"{seqlen_k} keys)"
            )

    import hopper_flash  # attribute looked up per call: the public entry point

    out = hopper_flash.flash_attn_func(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        softmax_scale=scaling, causal=causal,
    )
    return out, None


# --------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------
def _allow_flash_named_backend(transformers) -> None:
    """Let transformers 5.x accept a non-FlashAttention name containing "flash".

    ``PreTrainedModel._check_and_adjust_attn_implementation`` calls
    ``lazy_import_flash_attention(name)`` for every name with "flash" in it,
    which looks for a FlashAttention kernel of that name and raises. The
    wrapper skips that pre-import for NAME only.
    """
    try:
        from transformers import modeling_utils
        from transformers.utils.generic import is_flash_attention_requested
    except ImportError:
        return  # transformers 4.x: only names starting with "flash_attention" are pre-imported
    if not is_flash_attention_requested(requested_attention_implementation=NAME):
        return
    original = getattr(modeling_utils, "lazy_import_flash_attention", None)
    if original is None or getattr(original, "_hopper_flash_skips", None) == NAME:
        return

    @functools.wraps(original)
    def lazy_import_flash_attention(implementation, *args, **kwargs):
        if implementation == NAME:
            return None  # hopper_flash is no FlashAttention kernel: nothing to pre-import
        return original(implementation, *args, **kwargs)

    lazy_import_flash_attention._hopper_flash_skips = NAME
    modeling_utils.lazy_import_flash_attention = lazy_import_flash_attention


def register() -> str:
    """Register ``"hopper_flash"`` with transformers; return that name.

    Idempotent, and needs no GPU: the kernel is only reached when a model
    runs. Raises ImportError with an install hint when transformers is
    missing.
    """
    transformers = _import_transformers()
    transformers.AttentionInterface.register(NAME, hopper_flash_attention_forward)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:
        pass  # transformers < 4.53: models build their own 4-D masks, which the backend checks
    else:
        AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    _allow_flash_named_backend(transformers)
    return NAME


def is_registered() -> bool:
    """Whether ``"hopper_flash"`` is in transformers' attention functions (False without transformers)."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return False
    return ALL_ATTENTION_FUNCTIONS.get(NAME) is hopper_flash_attention_forward
