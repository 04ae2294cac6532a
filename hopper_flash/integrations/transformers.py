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
* registers :func:`padding_mask` (transformers' FlashAttention mask function,
  traceable) under the same name in ``AttentionMaskInterface`` (transformers
  >= 4.53), as a FlashAttention kernel is integrated: once per model forward
  it reduces the 2-D padding mask to ``None`` when nothing is padded and
  otherwise passes the 2-D ``[batch, seqlen_k]`` mask on, which the backend
  turns into a varlen call;
* transformers 5.x treats every implementation name containing ``"flash"`` as
  a FlashAttention variant and tries to import a FlashAttention kernel for it
  while checking the name (``set_attn_implementation``, ``from_pretrained``),
  which fails for ``"hopper_flash"``. ``register()`` wraps that pre-import
  (``transformers.modeling_utils.lazy_import_flash_attention``) so that it
  skips ``"hopper_flash"`` only; every other name goes through unchanged.
  Models that list the FlashAttention builds they work with (gpt-oss's
  ``_compatible_flash_implementations``) would also swap any "flash" name
  for the first of them: ``register()`` makes modeling_utils'
  ``is_flash_attention_requested`` answer no for ``"hopper_flash"`` (and
  only for it). There is no supported route to either: the name is the
  public one, and transformers reads "flash" in it.

The backend computes exactly what SDPA computes, or raises:

* no mask (``None``): causal (bottom-right aligned, as ``is_causal`` says,
  from the call or ``module.is_causal``) or full attention over every key,
  as with flash-attn (a static cache therefore needs its 2-D attention mask,
  which ``generate`` always passes);
* a 2-D ``[batch, seqlen_k]`` padding mask (1 = token): a varlen call
  (:func:`hopper_flash.flash_attn_varlen_func`) without any host
  synchronisation: each row's tokens must form one contiguous run (left or
  right padding, as tokenizers and ``generate`` produce; a row with holes is
  not supported). Sequence ``b``'s keys start at the run's first column
  (``cu_seqlens_k[b] = b·seqlen_k + start``) and ``seqused_k`` is its length;
  with as many queries as keys the queries are the same run, with fewer
  (decode, chunked prefill) every query row is a token and the queries are
  the sequence's last keys (bottom-right causal). Padded query rows get zero
  output, as with flash-attn. Decode steps (fewer queries than keys, no
  gradient) read the keys where the cache holds them, through
  :func:`hopper_flash.flash_attn_with_kvcache` with the run's start as
  ``cache_leftpad``; the other calls read the batch through THD views
  where its layout allows (q as projected; k and v also as a KV cache
  holds them, when no gradient is recorded), else copies;
* packed sequences (one row holding several documents): explicit
  ``cu_seq_lens_q``/``cu_seq_lens_k`` and ``max_length_q``/``max_length_k``
  keyword arguments (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``)
  go straight to the varlen call, with no sync (a ``max_length`` that is a
  tensor is replaced by the host-known total length). ``position_ids`` that
  restart at 0 (batch 1, no mask) are detected and turned into
  ``cu_seqlens`` with one host sync per model forward (cached across
  layers, eager only; under torch.compile pass the explicit kwargs);
* a 4-D mask (boolean, or additive float holding only 0 and "-inf"): used
  only when it is the bottom-right causal pattern or all-visible, possibly
  followed by key columns that no query sees (the unused tail of a static
  cache), which are dropped. Any other 4-D mask (an explicit padding or
  block pattern, a sliding window's pattern, chunked or custom patterns)
  raises ``NotImplementedError``;
* a layer's ``sliding_window`` (Mistral, Gemma, Qwen2 and others) becomes
  flash-attn's ``window_size=(w - 1, w - 1)`` whenever the keys outnumber
  the window, as transformers' own FlashAttention path sets it (with the
  causal mask: a query sees itself and the ``w - 1`` keys before it),
  forward and backward, eager or compiled;
* a layer's ``softcap`` (Gemma 2's ``attn_logit_softcapping``) becomes
  flash-attn's ``softcap``, forward and backward;
* attention sinks (gpt-oss's ``s_aux``) become flash-attn's
  ``learnable_sink``, forward and backward (the sink's gradient included);
* dropout > 0 and position biases raise ``NotImplementedError``;
* continuous batching (``generate_batch``): one varlen call per layer runs
  prefill chunks and decodes together. transformers up to 5.18 runs the
  model under ``"paged|hopper_flash"`` (registered too,
  :func:`hopper_flash_paged_attention_forward`), 5.19-5.23 under
  ``"hopper_flash"`` with the paged cache in the call: the cache's
  ``update`` writes the new keys and a full attention layer's keys are read
  in place through a block table (sliding-window layers: read back packed
  by ``update`` first). From 5.24 the model's layer updates the cache
  before the call, which then gets every cached key read back packed (the
  section "Continuous batching" below);
* ``query``/``key``/``value`` arrive as ``[batch, heads, seq, head_dim]`` and
  are handed to :func:`hopper_flash.flash_attn_func` as BSHD views
  (``.transpose(1, 2)``, no copy); k/v keep their own number of heads (GQA is
  read natively). The output is returned as ``[batch, seq, heads, head_dim]``
  with ``None`` attention weights, as transformers expects.
"""
from __future__ import annotations

import functools

import torch

from .. import checks, dispatch, interface, ops, plan

__all__ = ["NAME", "PAGED_NAME", "register", "is_registered", "hopper_flash_attention_forward",
           "hopper_flash_paged_attention_forward", "padding_mask"]

NAME = "hopper_flash"
# transformers' continuous batching (``generate_batch``, ``init_continuous_batching``)
# runs a model under the ``paged|`` form of its attention implementation's name.
PAGED_NAME = f"paged|{NAME}"

_INSTALL_HINT = "pip install 'transformers>=4.48'"

_PADDING_MESSAGE = (
    "hopper_flash supports padding as a 2-D [batch, seqlen_k] mask (what its registered mask function "
    "gives) and packed sequences through cu_seq_lens_q/k or restarting position_ids, but not this 4-D "
    "attention mask: it masks positions beyond the causal pattern. Pass the 2-D padding mask instead of a "
    "4-D one, or use attn_implementation='sdpa' for arbitrary masks."
)

# Keyword arguments of transformers' attention calls that change the result and
# that the hopper_flash kernel cannot honour: present and not None -> raise.
_UNSUPPORTED_KWARGS = {
    "position_bias": "an additive position bias",
    "head_mask": "a head mask",
    "cu_seqlens": "packed sequences given as `cu_seqlens` (pass cu_seq_lens_q/cu_seq_lens_k)",
}
# Their names, and the packed-sequence kwargs': one set test per call finds
# none of them (a decode step passes position_ids and use_cache).
_UNSUPPORTED_NAMES = frozenset(_UNSUPPORTED_KWARGS)
# Attention sinks (gpt-oss passes ``s_aux``): flash-attn's ``learnable_sink``.
_SINK_NAMES = frozenset(("s_aux", "sinks"))
_PACKED_NAMES = frozenset(("cu_seq_lens_q", "cu_seq_lens_k"))


def _sink(kwargs) -> torch.Tensor | None:
    """The attention sinks of a call (gpt-oss's ``s_aux``, or ``sinks``), or None."""
    if _SINK_NAMES.isdisjoint(kwargs):
        return None
    return kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")


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
        raise AssertionError("2-D masks take the varlen path (_run_padded)")
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
    softcap: float | None = None,
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
    if not _UNSUPPORTED_NAMES.isdisjoint(kwargs):
        for name, what in _UNSUPPORTED_KWARGS.items():
            if kwargs.get(name) is not None:
                raise NotImplementedError(f"hopper_flash does not support {what} (got `{name}`); use another "
                                          "attn_implementation for this model")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("query, key and value must be 4-D [batch, heads, seq, head_dim], got shapes "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")

    cache = kwargs.get("cache")
    if cache is not None and hasattr(cache, "layer_to_allocator"):
        # transformers 5.19-5.23's continuous batching: the keys are ours to write (_paged_step).
        return _paged_step(module, query, key, value, cache, scaling, sliding_window, softcap, kwargs), None

    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    # As transformers' sdpa/flash backends: the call's is_causal wins over the module's.
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)

    # (Each helper only where it can find something: this runs per layer of every decode step.)
    packed = None if _PACKED_NAMES.isdisjoint(kwargs) else _packed_from_kwargs(kwargs, query, key)
    if packed is None and attention_mask is None and seqlen_q == seqlen_k:
        packed = _packed_from_position_ids(kwargs.get("position_ids"), query, key, getattr(module, "layer_idx", None))
    window_size = (-1, -1) if sliding_window is None else _window_size(sliding_window, seqlen_k)
    softcap = 0.0 if softcap is None else checks.check_softcap(softcap)
    sink = _sink(kwargs)
    if packed is not None or (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2):
        if packed is not None:
            return _run_packed(query, key, value, packed, bool(is_causal), scaling, window_size, softcap,
                               sink), None
        return _run_padded(query, key, value, attention_mask, bool(is_causal), scaling, window_size,
                           softcap, sink, getattr(module, "layer_idx", None)), None

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
        # No mask with more keys than queries (a chunk on a dynamic cache): the
        # FlashAttention mask function's None means bottom-right causal over
        # every key, as in flash-attn.
        causal = bool(is_causal) and seqlen_q > 1

    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if not interface._needs_op(q, k, v, sink):
        # Inference (every decode step): the call prepared for these
        # arguments' signature, if flash_attn_func has made one, which it
        # does for CUDA tensors on their first direct launch; its option
        # checks are for values this call never passes. Host time per layer.
        window = None if window_size == (-1, -1) else checks.window_bounds(window_size, causal)
        out, _ = dispatch.prepared_forward(q, k, v, scaling, causal, False, window, softcap, sink)
        if out is not None:
            return out, None

    import hopper_flash  # attribute looked up per call: the public entry point

    return hopper_flash.flash_attn_func(q, k, v, softmax_scale=scaling, causal=causal, window_size=window_size,
                                        softcap=softcap, learnable_sink=sink), None


def _window_size(sliding_window, seqlen_k: int) -> tuple[int, int]:
    """flash-attn's ``window_size`` for a layer's ``sliding_window``, as
    transformers' own FlashAttention path sets it: ``(w - 1, w - 1)`` when the
    keys outnumber the window (a query sees itself and the ``w - 1`` keys
    before it; causal makes the right side 0), none otherwise."""
    if sliding_window is None or seqlen_k <= sliding_window:
        return (-1, -1)
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    return (sliding_window - 1, sliding_window - 1)


# --------------------------------------------------------------------------
# Variable-length batches: padded (2-D mask) and packed (cu_seq_lens / position_ids)
# --------------------------------------------------------------------------
def _thd(x: torch.Tensor) -> torch.Tensor:
    """``[batch, heads, seq, head_dim]`` as THD ``[batch·seq, heads, head_dim]``:
    a view for batch 1 (the varlen kernels take any 16-byte strides), a copy
    otherwise (batch and sequence axes do not merge in the BHSD layout)."""
    if x.shape[0] == 1:
        return x[0].transpose(0, 1)
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _thd_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``[batch, heads, seq, head_dim]`` as a THD view ``[rows', heads,
    head_dim]`` and ``rows``, the view's rows per batch row: token ``t`` of
    batch row ``b`` is the view's row ``b * rows + t``, so a varlen call
    takes ``cu_seqlens[b] = b * rows + start`` and the run's length as
    ``seqused``. Any layout whose batch stride is a multiple of its token
    stride has one: BSHD as projected (``rows = seq``, compact) and BHSD as
    a KV cache holds it (the view's rows step by one token of every head at
    once; ``rows`` is the batch stride in tokens, so a slot spans the row's
    other heads too, which never count: what the kernels read past a
    sequence's used rows they mask, keys to -inf and V's rows to 0). Else a copy
    (``_thd``, compact). A BHSD view has more rows than tokens: not for q,
    nor with gradients (the output, dq, dk and dv are allocated by rows).
    Under torch.compile always ``_thd``: an as_strided view past an
    intermediate's own elements is not a layout inductor keeps (it gave
    wrong logits), and the graph fuses the copy into its kernels."""
    batch, heads, seq, dim = x.shape
    sb, sh, st, sd = x.stride()
    if batch == 1 or torch.compiler.is_compiling():
        return _thd(x), seq  # (at batch 1 a view)
    if sd == 1 and sh > 0 and st > 0 and sb % st == 0 and sb // st >= seq:
        rows = sb // st
        return x.as_strided(((batch - 1) * rows + seq, heads, dim), (st, sh, 1)), rows
    return _thd(x), seq


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter, which in-place writes bump, or None for an
    inference tensor (made under ``torch.inference_mode``), which has none:
    reading it raises, and nothing tells an in-place change."""
    return None if t.is_inference() else t._version


class _ForwardMemo:
    """One value derived from tensors that every layer of a model forward
    (or of a continuous-batching step) is handed (the 2-D padding mask,
    ``position_ids``, the paged read index), kept so that the layers after
    the first skip deriving it again: while the tensors are the same
    objects with the same version counters (in-place writes bump them),
    under the same ``extra`` (host values the value depends on).

    An inference tensor (made under ``torch.inference_mode``) has no
    version counter, so nothing tells an in-place change between two
    forwards; a value derived from one is kept only within one forward,
    recognised by the layers' order: each call must come from a later
    layer (``module.layer_idx``) than the call before, as a model's layers
    run. A first layer again, or no layer (None), derives it anew."""

    __slots__ = ("entry",)

    def __init__(self):
        self.entry = None  # (weakrefs to the tensors, their versions, extra, the last layer, value)

    def get(self, tensors: tuple, extra, layer):
        """The value kept for ``tensors``, or None."""
        entry = self.entry
        if entry is None or entry[2] != extra or len(entry[0]) != len(tensors):
            return None
        inference = False
        for ref, kept, t in zip(entry[0], entry[1], tensors):  # (per layer call: no generator)
            if ref() is not t:
                return None
            if t.is_inference():
                inference = True
            elif t._version != kept:
                return None
        if inference:
            if layer is None or entry[3] is None or layer <= entry[3]:
                return None
            self.entry = (*entry[:3], layer, entry[4])
        return entry[4]

    def put(self, tensors: tuple, extra, layer, value) -> None:
        import weakref

        versions = tuple(map(_version, tensors))
        if layer is None and None in versions:
            return  # (get could never return it)
        self.entry = (tuple(weakref.ref(t) for t in tensors), versions, extra, layer, value)


def _memo_scope() -> int | None:
    """Where a value kept by a ``_ForwardMemo`` may be reused, as part of its
    ``extra``: 0 for eager calls, a capture's id among the calls of that
    CUDA graph capture (what it derived exists only in its graph, and a
    value kept from before it would not follow in-place updates on replay;
    ``checks.capture_id``); None, keep nothing, while tracing
    (torch.compile fuses the launches) or where the driver cannot say."""
    return None if torch.compiler.is_compiling() else checks.capture_id()


_PADDING_RUNS = _ForwardMemo()


def _padding_runs(mask: torch.Tensor, seqlen_k: int, layer=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's run of tokens in a 2-D padding mask: ``(start, length,
    end)``, int32 ``[batch]`` device tensors (no host sync; an empty row
    gives ``(0, 0, 0)``). Keys past the mask's columns (empty static-cache
    slots) are never live. Eager calls keep the last mask's runs
    (``_ForwardMemo``; ``layer``: the calling module's ``layer_idx``), and
    so do the calls of one CUDA graph capture, among themselves; not under
    torch.compile (``_memo_scope``)."""
    scope = _memo_scope()
    keep = scope is not None
    runs = _PADDING_RUNS.get((mask,), (seqlen_k, scope), layer) if keep else None
    if runs is not None:
        return runs
    live = mask.bool()
    if live.shape[1] > seqlen_k:
        live = live[:, -seqlen_k:]
    start = live.to(torch.int32).argmax(dim=1).to(torch.int32)  # first token (0 for an empty row)
    length = live.sum(dim=1, dtype=torch.int32)
    runs = (start, length, start + length)
    if keep:
        _PADDING_RUNS.put((mask,), (seqlen_k, scope), layer, runs)
    return runs


def _run_padded(query, key, value, mask, is_causal, scaling, window_size=(-1, -1), softcap=0.0, sink=None,
                layer=None):
    """A padded batch with no host sync (see the module docstring).

    Fewer queries than keys (a decode step, chunked prefill over a cache)
    without gradients: the queries are each row's last tokens, and the
    keys are read where the cache holds them, as
    :func:`hopper_flash.flash_attn_with_kvcache` reads a left-padded cache
    (``cache_leftpad`` the run's start, ``cache_seqlens`` its end): no copy
    of the keys. Otherwise one varlen call over THD views of the batch
    where the layouts allow (``_thd_rows``; without gradients k and v also
    in the BHSD layout a KV cache holds them in), copies where not.
    ``layer``: the module's ``layer_idx`` (``_padding_runs``)."""
    import hopper_flash

    batch, nheads, seqlen_q, _ = query.shape
    seqlen_k = key.shape[2]
    if mask.is_floating_point():
        raise TypeError(f"a 2-D attention_mask must be boolean or integer (1 = keep), got dtype {mask.dtype}")
    if mask.shape[0] != batch:
        raise ValueError(f"2-D attention_mask has batch {mask.shape[0]}, the queries have {batch}")
    if mask.device != query.device:
        raise ValueError(f"2-D attention_mask must be on the queries' device {query.device}, got {mask.device}")
    start_k, lens_k, end_k = _padding_runs(mask, seqlen_k, layer)
    causal = is_causal and seqlen_q > 1
    if seqlen_q < seqlen_k and not ops.records_grad(query, key, value, sink):
        return hopper_flash.flash_attn_with_kvcache(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), cache_seqlens=end_k,
            cache_leftpad=start_k, softmax_scale=scaling, causal=causal, window_size=window_size,
            softcap=softcap, learnable_sink=sink)
    q_thd = _thd(query)  # (compact: the output's rows are q's)
    if ops.records_grad(query, key, value, sink):
        # (The backward allocates dk and dv by k's and v's rows: compact.)
        k_thd, v_thd, k_rows = _thd(key), _thd(value), seqlen_k
    else:
        (k_thd, k_rows), (v_thd, v_rows) = _thd_rows(key), _thd_rows(value)
        if v_rows != k_rows:  # one cu_seqlens_k for both: the compact layout
            k_thd, v_thd, k_rows = (k_thd if k_rows == seqlen_k else _thd(key),
                                    v_thd if v_rows == seqlen_k else _thd(value), seqlen_k)
    rows = torch.arange(batch, dtype=torch.int32, device=query.device)

    def cu_seqlens(step, total):  # sequence b from row b·step + its run's start; the view's rows in all
        return torch.cat([rows * step + start_k, torch.full((1,), total, dtype=torch.int32, device=query.device)])

    cu_k = cu_seqlens(k_rows, k_thd.shape[0])
    if seqlen_q == seqlen_k:
        cu_q = cu_k if k_rows == seqlen_q else cu_seqlens(seqlen_q, q_thd.shape[0])
        used_q = lens_k
    else:
        # Fewer queries than keys: every query row is a token, the queries are
        # each sequence's last keys (left padding, decode, chunked prefill).
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=query.device) * seqlen_q
        used_q = None
    out = hopper_flash.flash_attn_varlen_func(
        q_thd, k_thd, v_thd, cu_q, cu_k, seqlen_q, seqlen_k, seqused_q=used_q, seqused_k=lens_k,
        softmax_scale=scaling, causal=causal, window_size=window_size, softcap=softcap,
        learnable_sink=sink)
    return out.view(batch, seqlen_q, nheads, value.shape[-1])


def _packed_from_kwargs(kwargs, query, key):
    """``(cu_q, cu_k, max_q, max_k)`` from DataCollatorWithFlattening's kwargs, or None."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None:
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k must be given together")
    total_q = query.shape[0] * query.shape[2]
    total_k = key.shape[0] * key.shape[2]
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    # A bound the host knows: the total (a tensor max would need a sync).
    max_q = int(max_q) if isinstance(max_q, int) and max_q > 0 else total_q
    max_k = int(max_k) if isinstance(max_k, int) and max_k > 0 else total_k
    return cu_q.to(torch.int32), cu_k.to(torch.int32), max(1, max_q), max(1, max_k)


# The position_ids of the current model forward (every layer gets the same
# object) and what they gave, so the sync happens once per forward.
_POSITION_IDS = _ForwardMemo()


def _packed_from_position_ids(position_ids, query, key, layer=None):
    """Packed documents in one row (batch 1, positions restarting at their
    minimum), as transformers' flash path detects them: ``(cu, cu, max, max)``
    or None. Needs the values on the host: one sync per forward (kept by
    ``_ForwardMemo``; ``layer``: the module's ``layer_idx``), eager only."""
    if (position_ids is None or query.shape[0] != 1 or query.shape[2] != key.shape[2] or query.shape[2] < 2
            or position_ids.dim() != 2 or position_ids.shape[-1] != query.shape[2]
            or torch.compiler.is_compiling()):
        return None
    kept = _POSITION_IDS.get((position_ids,), None, layer)
    if kept is not None:
        return kept[0]
    pos = position_ids.reshape(-1)
    starts = (pos == pos.min()).nonzero().flatten().to(torch.int32)  # the one sync
    if starts.numel() <= 1:
        result = None
    else:
        total = torch.full((1,), pos.numel(), dtype=torch.int32, device=pos.device)
        cu = torch.cat([starts, total])
        max_len = int((cu[1:] - cu[:-1]).max())
        result = (cu, cu, max_len, max_len)
    _POSITION_IDS.put((position_ids,), None, layer, (result,))  # (a tuple: None is a result too)
    return result


def _run_packed(query, key, value, packed, is_causal, scaling, window_size=(-1, -1), softcap=0.0, sink=None):
    import hopper_flash

    batch, nheads, seqlen_q, _ = query.shape
    cu_q, cu_k, max_q, max_k = packed
    out = hopper_flash.flash_attn_varlen_func(
        _thd(query), _thd(key), _thd(value), cu_q, cu_k, max_q, max_k, softmax_scale=scaling, causal=is_causal,
        window_size=window_size, softcap=softcap, learnable_sink=sink)
    return out.view(batch, seqlen_q, nheads, value.shape[-1])


# --------------------------------------------------------------------------
# Continuous batching (generate_batch)
# --------------------------------------------------------------------------
# transformers has handed a step's paged cache to the attention function in
# three ways. Every request's new tokens come packed in one row (query
# [1, heads, total_q, head_dim]) with cu_seq_lens_q / cu_seq_lens_k (per
# layer type where a model mixes sliding and full layers) and the cache's
# read_index / write_index, and each way ends in one varlen call per layer,
# bottom-right causal per request, prefill chunks and decodes together, no
# host sync:
# - up to 5.18 the model runs under "paged|hopper_flash"
#   (hopper_flash_paged_attention_forward), which gets ``cache`` and writes
#   the new keys itself (``cache.update(key_states, value_states, layer_idx,
#   read_index, write_index)``);
# - 5.19-5.23 drop "paged|" from the name: hopper_flash_attention_forward
#   gets ``cache`` and writes them (``cache.update(..., kwargs=kwargs)``,
#   which also picks the layer's cu_seq_lens_k and max_length_k):
#   _paged_step;
# - from 5.24 the model's layer calls ``cache.update`` before attention, so
#   hopper_flash_attention_forward gets every request's keys read back
#   packed and the layer's cu_seq_lens_k: the packed path
#   (_packed_from_kwargs).
# In the first two a full attention layer's keys are read where the cache
# keeps them, through a block table built on the device from the read index
# (the update only writes); in the third transformers has read them back (a
# copy of every cached key, per layer and step) before the call.
def _cb_varlen(query, key, value, cu_q, cu_k, max_q: int, max_k: int, scaling, sliding_window, softcap, kwargs,
               block_table=None, index=None) -> torch.Tensor:
    """A continuous-batching step's varlen call: ``query`` [1, heads,
    total_q, head_dim]; ``key``/``value`` THD [total_k, heads_kv, head_dim],
    or page pools [pages, page, heads_kv, head_dim] with ``block_table``,
    which was built from ``index`` (the read index: the table is checked
    against it under ``HOPPER_FLASH_CHECK_VARLEN=1``, and the split count
    read from it). A layer's ``sliding_window`` is flash-attn's ``(w - 1,
    0)``; sinks come from the call's ``kwargs``. Returns [total_q, heads,
    head_dim_v]."""
    window_size = (sliding_window - 1, 0) if sliding_window else (-1, -1)
    num_splits = 0
    if block_table is not None:
        if dispatch._check_contract_requested(None):
            check_paged_cache_view(index, cu_k, block_table, key.shape[1])
        num_splits = skew_splits(query, key, value, index, cu_k, max_q, max_k)
    import hopper_flash  # attribute looked up per call: the public entry point

    return hopper_flash.flash_attn_varlen_func(
        query[0].transpose(0, 1), key, value, cu_q, cu_k, max_q, max_k, softmax_scale=scaling, causal=True,
        window_size=window_size, softcap=0.0 if softcap is None else softcap, learnable_sink=_sink(kwargs),
        block_table=block_table, num_splits=num_splits)


def _paged_step(module, query, key, value, cache, scaling, sliding_window, softcap, kwargs) -> torch.Tensor:
    """A continuous-batching call under transformers 5.19-5.23 (above).
    ``cache`` is its ``PagedAttentionCache``, whose allocator for this layer
    (``cache.layer_to_allocator``) keeps a full attention group's keys in
    pages and a sliding group's in a ring. A full attention layer with keys
    cached has the update write the new keys only (its read index emptied,
    in a copy of the kwargs) and reads every key in place
    (:func:`allocator_pages`); any other layer has the update read each
    request's keys back packed, as transformers' own paths do. Returns
    [1, total_q, heads, head_dim_v]."""
    if query.shape[0] != 1:  # (4-D: checked by the caller)
        raise ValueError("continuous batching passes its packed batch as query [1, heads, total_q, head_dim], "
                         f"got shape {tuple(query.shape)}")
    if kwargs.get("block_table") is not None:
        # transformers builds block tables only for FlashAttention 2/3 names
        # (its flash_attn_with_kvcache decode path), never for this one.
        raise NotImplementedError(f"`{NAME}` reads the paged cache through its own block table, built from the "
                                  "step's read index; transformers' decode fast path (a block table for "
                                  "FlashAttention's flash_attn_with_kvcache) is not its route: set the continuous "
                                  "batching config's max_blocks_per_request to 0")
    layer = module.layer_idx
    allocator = cache.layer_to_allocator[layer]
    kw = dict(kwargs)  # cache.update picks this layer's entries in place
    read_index = kw["read_index"]
    index = read_index[allocator.index]
    pages = allocator_pages(allocator, layer, index)
    if pages is not None:
        kw["read_index"] = _write_only(read_index, allocator.index)
    key, value = cache.update(key_states=key, value_states=value, layer_idx=layer, kwargs=kw)
    cu_k, max_k = kw["cu_seq_lens_k"].to(torch.int32), int(kw["max_length_k"])
    cu_q, max_q = kw["cu_seq_lens_q"].to(torch.int32), int(kw["max_length_q"])
    if sliding_window is None:
        sliding_window = getattr(module, "sliding_window", None)
    if pages is None:
        out = _cb_varlen(query, key[0].transpose(0, 1), value[0].transpose(0, 1), cu_q, cu_k, max_q, max_k,
                         scaling, sliding_window, softcap, kwargs)
    else:
        k_pages, v_pages, page = pages
        out = _cb_varlen(query, k_pages, v_pages, cu_q, cu_k, max_q, max_k, scaling, sliding_window, softcap,
                         kwargs, block_table=_block_table(index, cu_k, max_k, page), index=index)
    return out.unsqueeze(0)


def _write_only(read_index: list, group: int) -> list:
    """The step's read indices with ``group``'s emptied: ``cache.update``
    then only writes that group's new keys (its no-read case) and returns
    them, which the in-place routes do not use."""
    return [r[:0] if i == group else r for i, r in enumerate(read_index)]


def allocator_pages(allocator, layer_idx: int, index: torch.Tensor):
    """A full attention layer's page pools in the paged cache of
    transformers 5.19 and later: ``(k_pages, v_pages, page)``, pools
    ``[pages, page, heads_kv, head_dim]`` for
    ``flash_attn_varlen_func(block_table=...)``, or None where the layer is
    not read in place (a sliding group's ring, nothing cached yet, another
    layout).

    The allocator's ``get_cache_for_block_table`` views the layer's keys as
    pages of ``tokens_per_page`` tokens (the cache interleaves a group's
    layers page by page), and the read index holds each key's row in that
    view; a request's keys fill whole pages in order, so key ``j``'s row is
    its page's first row plus ``j % tokens_per_page``. Viewed as pages of
    ``page`` keys (the largest power of two dividing ``tokens_per_page``,
    at most ``MAX_PAGE``), request ``b``'s page ``p`` is ``index[cu_k[b] + p
    * page] // page`` (:func:`_block_table`)."""
    if not getattr(allocator, "supports_block_table", False) or index.numel() == 0:
        return None
    get_pages = getattr(allocator, "get_cache_for_block_table", None)
    tokens = getattr(allocator, "tokens_per_page", None)
    if get_pages is None or not isinstance(tokens, int) or tokens <= 0:
        return None
    k_pages, v_pages = get_pages(layer_idx)
    if (k_pages.dim() != 4 or k_pages.shape != v_pages.shape or k_pages.shape[1] != tokens
            or not k_pages.is_contiguous() or not v_pages.is_contiguous()):
        return None
    page = min(tokens & -tokens, MAX_PAGE)
    if page != tokens:
        k_pages, v_pages = (x.view(-1, page, *x.shape[2:]) for x in (k_pages, v_pages))
    return k_pages, v_pages, page


def hopper_flash_paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers ``AttentionInterface`` function for continuous batching
    (``attn_implementation="paged|hopper_flash"``; ``generate_batch`` switches
    a model loaded with ``"hopper_flash"`` to it).

    Continuous batching packs every scheduled request's new tokens into one
    row: ``query`` ``[1, heads, total_q, head_dim]``, ``key``/``value`` the
    new tokens ``[1, heads_kv, total_q, head_dim]``, and ``cache`` (its
    ``PagedAttentionCache``) with ``read_index``/``write_index``,
    ``cu_seq_lens_q``/``cu_seq_lens_k`` and ``max_seqlen_q``/``max_seqlen_k``
    (per layer type where the model mixes sliding and full layers). The
    new keys are written into the cache by ``cache.update``; then one
    :func:`hopper_flash.flash_attn_varlen_func` call, bottom-right causal per
    request (PackGQA: a decode's queries of a group share a tile), runs the
    batch: prefill chunks and decodes together, no host sync. On a full
    attention layer it reads the keys where the cache keeps them, through a
    block table built on the device from the step's ``read_index``
    (:func:`paged_cache_view`); a sliding-window layer, or a cache of
    another layout, has each request's keys read back packed first
    (``cache.update``'s read, as transformers' own ``paged|flash_attention_*``
    path does without its decode fast path). A layer's ``sliding_window`` is
    flash-attn's ``(w - 1, 0)``, soft-capping and sinks (``s_aux``) are
    passed on. Returns ``(out [total_q, heads, head_dim_v], None)``.
    """
    cache = kwargs.get("cache")
    if cache is None:
        raise ValueError(f"`{PAGED_NAME}` was called without a paged attention cache: it runs transformers' "
                         f"continuous batching (generate_batch); use attn_implementation='{NAME}' for a plain "
                         "forward")
    if dropout:
        raise NotImplementedError(f"hopper_flash has no attention dropout (got dropout={dropout})")
    if kwargs.get("block_table") is not None:
        # transformers builds a block table only for FlashAttention 2/3 names
        # (its flash_attn_with_kvcache decode fast path), never for this one.
        raise NotImplementedError(f"`{PAGED_NAME}` builds its own block table from the step's read index, and "
                                  "transformers' decode fast path (a block table for FlashAttention's "
                                  "flash_attn_with_kvcache) is not its route: set the continuous batching config's "
                                  "max_blocks_per_request to 0")
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(f"`{PAGED_NAME}` takes the packed batch as query [1, heads, total_q, head_dim], got "
                         f"shape {tuple(query.shape)}")
    sliding = getattr(module, "sliding_window", None)
    cu_k, max_k = kwargs["cu_seq_lens_k"], kwargs["max_seqlen_k"]
    if isinstance(cu_k, dict):  # per layer type, for models mixing sliding and full layers
        layer_type = "sliding_attention" if sliding else "full_attention"
        cu_k, max_k = cu_k[layer_type], max_k[layer_type]
    cu_k, max_k = cu_k.to(torch.int32), int(max_k)
    read_index, write_index = kwargs["read_index"], kwargs["write_index"]
    view = None if sliding else paged_cache_view(cache, module.layer_idx, read_index, cu_k, max_k)
    cu_q, max_q = kwargs["cu_seq_lens_q"].to(torch.int32), int(kwargs["max_seqlen_q"])
    if view is None:
        # The new keys into the cache, and each request's keys back, packed [total_k, heads_kv, head_dim].
        key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                                  read_index=read_index, write_index=write_index)
        return _cb_varlen(query, key, value, cu_q, cu_k, max_q, max_k, scaling, sliding, softcap, kwargs), None
    # The new keys into the cache only (update's write-only case: an empty read index), then
    # the requests' keys read in place from the page pools.
    group = cache.layer_index_to_group_indices[module.layer_idx][0]
    cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                 read_index=_write_only(read_index, group), write_index=write_index)
    k_pages, v_pages, block_table = view
    return _cb_varlen(query, k_pages, v_pages, cu_q, cu_k, max_q, max_k, scaling, sliding, softcap, kwargs,
                      block_table=block_table, index=read_index[group]), None


def skew_splits(query, k_pages, v_pages, index, cu_k, max_q: int, max_k: int) -> int:
    """The split count for a step whose keys are read in place: 0 (the
    kernels' heuristic) unless ``plan.varlen_skew_splits`` sees a skewed
    batch (a long request beside many short ones) in host values: the read
    index's length bounds the step's keys, as k's rows do for a packed
    call."""
    cfg = plan.CONFIGS[plan.kernel_head_dim(query.shape[-1], v_pages.shape[-1])]
    splits = plan.varlen_skew_splits(index.numel(), cu_k.shape[0] - 1, max_q, max_k, query.shape[1],
                                     query.shape[1] // k_pages.shape[2], cfg, None, None, query.device.index)
    return splits if splits > 1 else 0


# The largest page the paged kernels take (hopper_flash.paged).
MAX_PAGE = 1024


def paged_cache_view(cache, layer_idx: int, read_index, cu_k: torch.Tensor, max_k: int):
    """A full attention layer's keys as they lie in transformers' paged
    cache (``PagedAttentionCache``): ``(k_pages, v_pages, block_table)`` for
    ``flash_attn_varlen_func(block_table=...)``, or None where the cache is
    not the layout read here (the caller then reads through ``cache.update``).

    The cache holds a layer group's keys as ``[pages, heads_kv, head_dim]``,
    ``block_size`` consecutive pages a block, and a request's keys fill whole
    blocks in order (``FullAttentionCacheAllocator.get_read_indices``: key
    ``j`` of a request lies at ``blocks[j // block_size] * block_size + j %
    block_size``). Viewed as pages of ``P`` keys (the largest power of two
    dividing ``block_size``, at most ``MAX_PAGE``), request ``b``'s page ``p``
    is then ``read_index[cu_k[b] + p * P] // P``: a ``[batch, ceil(max_k /
    P)]`` table computed on the device from the index transformers built for
    its own read, no host sync. Entries past a request's keys name valid
    pages that are never read. ``HOPPER_FLASH_CHECK_VARLEN=1`` checks every key's place against
    ``read_index`` (one sync, :func:`check_paged_cache_view`)."""
    groups = getattr(cache, "layer_index_to_group_indices", None)
    block_size = getattr(cache, "block_size", None)
    key_cache = getattr(cache, "key_cache", None)
    value_cache = getattr(cache, "value_cache", None)
    if not (isinstance(groups, dict) and isinstance(block_size, int) and block_size > 0
            and isinstance(key_cache, list) and isinstance(value_cache, list) and layer_idx in groups):
        return None
    group, in_group = groups[layer_idx]
    if getattr(cache, "sliding_windows", {}).get(layer_idx, 1) != 1:
        return None
    index = read_index[group]
    if index.numel() == 0:
        return None  # nothing cached to read: update returns the new keys themselves
    k_pool, v_pool = key_cache[in_group], value_cache[in_group]
    page = min(block_size & -block_size, MAX_PAGE)
    if (k_pool.dim() != 3 or v_pool.dim() != 3 or k_pool.shape[0] != v_pool.shape[0]
            or k_pool.shape[0] % page or not k_pool.is_contiguous() or not v_pool.is_contiguous()):
        return None
    table = _block_table(index, cu_k, max_k, page)
    return k_pool.view(-1, page, *k_pool.shape[1:]), v_pool.view(-1, page, *v_pool.shape[1:]), table


# The block table of the current continuous-batching step (_block_table).
_BLOCK_TABLE = _ForwardMemo()


def _block_table(index: torch.Tensor, cu_k: torch.Tensor, max_k: int, page: int) -> torch.Tensor:
    """The ``[batch, ceil(max_k / page)]`` block table of
    :func:`paged_cache_view`: each page's first key in the read index; past
    a request's keys the entries name some valid page (a later request's, or
    the index's last key's: clamped), which the kernels never read. Six
    small launches.

    Every full attention layer of a group gets the same ``read_index``
    tensor and ``cu_seq_lens_k`` within a step, so the table is built once
    per step and reused while both are the same objects with the same
    version counters (a new step hands a new index view, or rewrites the
    storage, which moves the counter), within one CUDA graph capture or
    outside any, not while tracing (``_memo_scope``), nor for inference
    tensors (``_version``; ``_ForwardMemo`` without a layer)."""
    scope = _memo_scope()
    keep = scope is not None
    table = _BLOCK_TABLE.get((index, cu_k), (max_k, page, scope), None) if keep else None
    if table is not None:
        return table
    offsets = torch.arange(0, -(-max_k // page) * page, page, device=cu_k.device)
    first_keys = (cu_k[:-1, None] + offsets).clamp_max_(index.numel() - 1)
    table = (index[first_keys] // page).to(torch.int32)
    if keep:
        _BLOCK_TABLE.put((index, cu_k), (max_k, page, scope), None, table)
    return table


def check_paged_cache_view(index: torch.Tensor, cu_k: torch.Tensor, block_table: torch.Tensor, page: int) -> None:
    """Every key the block table names is where ``read_index`` says it is
    (:func:`paged_cache_view`'s reading of the cache's layout). One host sync."""
    bounds = cu_k.tolist()
    for b in range(len(bounds) - 1):
        n = bounds[b + 1] - bounds[b]
        j = torch.arange(n, device=index.device)
        placed = block_table[b].long()[j // page] * page + j % page
        if not torch.equal(placed, index[bounds[b]:bounds[b + 1]]):
            raise ValueError(f"{NAME} (continuous batching): request {b}'s keys are not whole blocks of the paged "
                             "cache in order (read_index disagrees with the block table built from it): this "
                             "transformers' cache layout is not the one hopper_flash reads in place")


# --------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------
def _allow_flash_named_backend(transformers) -> None:
    """Let transformers 5.x accept a non-FlashAttention name containing "flash".

    ``PreTrainedModel._check_and_adjust_attn_implementation`` calls
    ``lazy_import_flash_attention(name)`` for every name with "flash" in it,
    which looks for a FlashAttention kernel of that name and raises. The
    wrapper skips that pre-import for NAME only. Models that list the
    FlashAttention builds they work with are redirected to one of them
    (below). Both wrappers act on NAME only and are installed once.
    """
    try:
        from transformers import modeling_utils
        from transformers.utils.generic import is_flash_attention_requested
    except ImportError:
        return  # transformers 4.x: only names starting with "flash_attention" are pre-imported
    if not is_flash_attention_requested(requested_attention_implementation=NAME):
        return
    original = getattr(modeling_utils, "lazy_import_flash_attention", None)
    if original is not None and getattr(original, "_hopper_flash_skips", None) != NAME:
        @functools.wraps(original)
        def lazy_import_flash_attention(implementation, *args, **kwargs):
            if implementation in (NAME, PAGED_NAME):
                return None  # hopper_flash is no FlashAttention kernel: nothing to pre-import
            return original(implementation, *args, **kwargs)

        lazy_import_flash_attention._hopper_flash_skips = NAME
        modeling_utils.lazy_import_flash_attention = lazy_import_flash_attention

    # Models that list FlashAttention builds they work with (gpt-oss's
    # ``_compatible_flash_implementations``) are redirected from any "flash"
    # name to the first of them when the model is set up
    # (``_check_and_adjust_attn_implementation``): hopper_flash would become
    # kernels-community/vllm-flash-attn3. modeling_utils asks
    # ``is_flash_attention_requested`` only about FlashAttention builds
    # (that redirect, the pre-import above, FA2/FA3 availability checks): in
    # its namespace the answer for NAME is no.
    check = getattr(modeling_utils, "is_flash_attention_requested", None)
    if check is None or getattr(check, "_hopper_flash_skips", None) == NAME:
        return

    @functools.wraps(check)
    def is_flash_attention_requested_unless_ours(*args, **kwargs):
        config = kwargs.get("config", args[0] if args else None)
        name = kwargs.get("requested_attention_implementation")
        if name is None and config is not None:
            name = getattr(config, "_attn_implementation", None)
        if isinstance(name, str) and name.split("|")[-1] == NAME:
            return False
        return check(*args, **kwargs)

    is_flash_attention_requested_unless_ours._hopper_flash_skips = NAME
    modeling_utils.is_flash_attention_requested = is_flash_attention_requested_unless_ours


def padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                 attention_mask=None, **kwargs):
    """The mask function registered for NAME: FlashAttention's (transformers'
    ``flash_attention_mask``), i.e. None when nothing is padded, else the 2-D
    ``[batch, kv_length]`` padding mask, which the backend turns into a varlen
    call. Built once per model forward, not per layer.

    Unlike transformers' own, it never asks the device whether the mask is
    all ones while torch.compile traces (a data-dependent branch would break
    ``fullgraph=True``): traced, a 2-D mask always takes the varlen path,
    which computes the same for an unpadded batch. Eager, that one check per
    forward keeps unpadded batches on the copy-free fixed-length path."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if torch.compiler.is_compiling():
        return attention_mask
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def register() -> str:
    """Register ``"hopper_flash"`` with transformers (and ``"paged|hopper_flash"``,
    its continuous-batching form); return ``"hopper_flash"``.

    Idempotent, and needs no GPU: the kernel is only reached when a model
    runs. Raises ImportError with an install hint when transformers is
    missing.
    """
    transformers = _import_transformers()
    transformers.AttentionInterface.register(NAME, hopper_flash_attention_forward)
    transformers.AttentionInterface.register(PAGED_NAME, hopper_flash_paged_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        pass  # transformers < 4.53: models build their own 4-D masks, which the backend checks
    else:
        AttentionMaskInterface.register(NAME, padding_mask)
    _allow_flash_named_backend(transformers)
    return NAME


def is_registered() -> bool:
    """Whether ``"hopper_flash"`` is in transformers' attention functions (False without transformers)."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return False
    return ALL_ATTENTION_FUNCTIONS.get(NAME) is hopper_flash_attention_forward
