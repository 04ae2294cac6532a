"""The attention implementations being compared.

A Backend has a name, an availability check (``None`` when usable, else the
reason) and ``build(cfg, q, k, v, scale)``, which returns a zero-argument
callable computing the attention output in BSHD layout. The callable is what
gets timed, so per-config set-up (transposed views, block masks, compilation
handles) happens in ``build``. A backend that cannot run a config raises
``Unsupported``, from ``build`` or from the first call; the runner reports
that cell as unsupported instead of failing the run.

Everything here imports torch/hopper_flash/flash_attn lazily: availability is
decided on the GPU machine, not at import time.
"""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from typing import Callable

from .configs import Config

AttnFn = Callable[[], object]


class Unsupported(Exception):
    """This backend does not implement the requested configuration."""


@dataclass(frozen=True)
class Backend:
    name: str
    check: Callable[[], str | None]
    build: Callable[..., AttnFn]  # (cfg, q, k, v, scale) -> fn returning BSHD output
    # In the default run; the decode (KV-cache) APIs run on request (--backends).
    default: bool = True
    # Timed in the "bwd"/"fwd+bwd" passes: build gets requires_grad leaves and
    # the output is differentiated by autograd.
    grad: bool = True

    def unavailable_reason(self) -> str | None:
        try:
            return self.check()
        except Exception as e:  # a broken install should be reported, not crash the run
            return f"{type(e).__name__}: {e}"


def _import_check(module: str, attr: str) -> Callable[[], str | None]:
    def check() -> str | None:
        try:
            mod = importlib.import_module(module)
        except Exception as e:
            return f"cannot import {module}: {type(e).__name__}: {e}"
        if not hasattr(mod, attr):
            return f"{module} has no {attr}"
        return None

    return check


# --- hopper_flash -----------------------------------------------------------


def _window_kwargs(cfg: Config) -> dict:
    """``window_size`` for the flash-attn style calls, only when the config has a window."""
    return {} if cfg.window is None else {"window_size": tuple(cfg.window)}


def _no_window(cfg: Config, what: str) -> None:
    if cfg.window_bounds is not None:
        raise Unsupported(f"{what} has no sliding window")


def _build_hopper_flash(cfg: Config, q, k, v, scale: float) -> AttnFn:
    from hopper_flash import flash_attn_func

    window = _window_kwargs(cfg)

    def fn():
        try:
            return flash_attn_func(q, k, v, softmax_scale=scale, causal=cfg.causal, **window)
        except (ValueError, NotImplementedError) as e:
            # The interface's documented way of declining a configuration.
            raise Unsupported(str(e)) from e

    return fn


def _build_hopper_flash_kvcache(cfg: Config, q, k, v, scale: float) -> AttnFn:
    """The decode API: k and v as a KV cache whose every row is live
    (``cache_seqlens`` as a device tensor, as a serving loop passes it)."""
    import torch

    from hopper_flash import flash_attn_with_kvcache

    seqlens = torch.full((cfg.batch,), cfg.seqlen_kv, dtype=torch.int32, device=q.device)
    window = _window_kwargs(cfg)

    def fn():
        try:
            return flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, softmax_scale=scale, causal=cfg.causal,
                                           **window)
        except (ValueError, NotImplementedError) as e:
            raise Unsupported(str(e)) from e

    return fn


# FA3 builds often leave fp16 and sliding windows out (shared/tools/fa3's
# does: it halves the build), and such a build does not raise on those
# inputs: it crashes the process (a segmentation fault, seventeenth and
# eighteenth sessions), which would end the whole benchmark with no report.
# So before FA3 first runs a dtype other than bf16, or a window, a child
# process tries it on a tiny input.
_PROBE_CODE = """
import sys, torch, flash_attn_interface as fa3
dtype, d = getattr(torch, sys.argv[1]), int(sys.argv[2])
window = {{}} if sys.argv[3] == "none" else {{"window_size": tuple(int(x) for x in sys.argv[3].split(","))}}
q = torch.randn(1, 128, 1, d, device="cuda", dtype=dtype)
out = fa3.{func}(q, q, q, causal=True, **window)
torch.cuda.synchronize()
"""


@functools.lru_cache(maxsize=None)
def fa3_probe(func: str, dtype_name: str, head_dim: int, window: tuple[int, int] | None = None,
              run=subprocess.run) -> str | None:
    """None when ``flash_attn_interface.<func>`` ran a ``dtype_name`` input of
    head dim ``head_dim`` (with ``window_size=window`` if given) in a child
    process, else why not (a crash or an exception there)."""
    what = f"{dtype_name} head-dim-{head_dim}" + ("" if window is None else f" window {window}")
    arg = "none" if window is None else f"{window[0]},{window[1]}"
    try:
        r = run([sys.executable, "-c", _PROBE_CODE.format(func=func), dtype_name, str(head_dim), arg],
                capture_output=True, text=True, timeout=300, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return f"FA3's {func} did not finish a {what} probe in 300 s"
    if r.returncode == 0:
        return None
    last = (r.stderr or "").strip().splitlines()[-1:] or [""]
    how = f"crashed (signal {-r.returncode})" if r.returncode < 0 else f"failed ({last[0][:200]})"
    return f"this FA3 build {how} on a {what} probe: built without those kernels?"


def _check_fa3(func: str, cfg: Config, q) -> None:
    """Unsupported where this FA3 build may lack the kernels (a non-bf16
    dtype, a window) and its probe fails; bf16 without a window is never
    probed."""
    import torch

    window = None if cfg.window is None else tuple(cfg.window)
    if q.dtype != torch.bfloat16 or window is not None:
        why = fa3_probe(func, str(q.dtype).removeprefix("torch."), q.shape[-1], window)
        if why is not None:
            raise Unsupported(why)


def _build_fa3_kvcache(cfg: Config, q, k, v, scale: float) -> AttnFn:
    import torch

    _check_fa3("flash_attn_with_kvcache", cfg, q)
    func = importlib.import_module("flash_attn_interface").flash_attn_with_kvcache
    seqlens = torch.full((cfg.batch,), cfg.seqlen_kv, dtype=torch.int32, device=q.device)
    window = _window_kwargs(cfg)

    def fn():
        out = func(q, k, v, cache_seqlens=seqlens, softmax_scale=scale, causal=cfg.causal, **window)
        return out[0] if isinstance(out, tuple) else out

    return fn


# --- flash-attn 2 / 3 (BSHD, bottom-right causal, native GQA) ----------------


def _build_flash_attn(module: str) -> Callable[..., AttnFn]:
    def build(cfg: Config, q, k, v, scale: float) -> AttnFn:
        if module == "flash_attn_interface":
            _check_fa3("flash_attn_func", cfg, q)
        func = importlib.import_module(module).flash_attn_func
        window = _window_kwargs(cfg)

        def fn():
            out = func(q, k, v, softmax_scale=scale, causal=cfg.causal, **window)
            # Some FA3 releases return (out, lse).
            return out[0] if isinstance(out, tuple) else out

        return fn

    return build


# --- PyTorch SDPA with one forced kernel --------------------------------------


def _build_sdpa(backend_name: str) -> Callable[..., AttnFn]:
    def build(cfg: Config, q, k, v, scale: float) -> AttnFn:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        _no_window(cfg, "SDPA's is_causal")
        # One query row sees every key under the bottom-right mask: not causal.
        causal = cfg.causal and cfg.seqlen_q > 1
        if causal and cfg.seqlen_q != cfg.seqlen_kv:
            raise Unsupported(
                "SDPA is_causal is top-left aligned; the bench uses bottom-right "
                "(flash-attn) causal, which only agrees for equal q/kv lengths"
            )
        backend = getattr(SDPBackend, backend_name)
        gqa = cfg.nheads_kv != cfg.heads
        # SDPA wants BHSD; these are views of the BSHD inputs, no copy.
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        kwargs = {"enable_gqa": True} if gqa else {}

        def call():
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale, **kwargs)
            return out.transpose(1, 2)

        # Probe once: a forced kernel that cannot take these inputs raises
        # "No available kernel" and explains why only in warnings.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                call()
            except RuntimeError as e:
                if "No available kernel" not in str(e):
                    raise
                why = "; ".join(str(w.message).strip() for w in caught) or str(e)
                raise Unsupported(why) from e
        return call

    return build


# --- FlexAttention, compiled -------------------------------------------------


def _flex_check() -> str | None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except Exception as e:
        return f"cannot import torch.nn.attention.flex_attention: {e}"
    return None


def _build_flex(cfg: Config, q, k, v, scale: float) -> AttnFn:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    _no_window(cfg, "the bench's FlexAttention mask")
    sq, sk = cfg.seqlen_q, cfg.seqlen_kv
    block_mask = None
    if cfg.causal:
        offset = sk - sq  # bottom-right alignment, as hopper_flash and flash-attn

        def causal(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx

        block_mask = create_block_mask(causal, B=None, H=None, Q_LEN=sq, KV_LEN=sk, device=q.device)
    # A fresh compile per config: dynamo's recompile limit (8 by default)
    # would otherwise silently fall back to eager flex after a few shapes.
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    gqa = cfg.nheads_kv != cfg.heads

    def fn():
        return compiled(qt, kt, vt, block_mask=block_mask, scale=scale, enable_gqa=gqa).transpose(1, 2)

    return fn


# --- hopper_flash kernel variants (--variant) ---------------------------------


def parse_variant(spec: str) -> dict:
    """``"k_stages=3,v_stages=3"`` -> ForwardConfig fields, or a ValueError
    naming what is wrong (the CLI reports it as a usage error)."""
    import dataclasses

    from hopper_flash import plan

    try:
        fields = plan.config_variant(spec)
    except ValueError as e:
        raise ValueError(f"--variant {spec!r}: expected FIELD=VALUE[,FIELD=VALUE] with int or True/False "
                         f"values ({e})") from None
    known = {f.name for f in dataclasses.fields(plan.ForwardConfig)} - {"head_dim"}
    unknown = sorted(set(fields) - known)
    if not fields or unknown:
        raise ValueError(f"--variant {spec!r}: unknown ForwardConfig field(s) {unknown or '(none given)'}; "
                         f"known: {', '.join(sorted(known))}")
    return fields


def variant_backend(spec: str) -> Backend:
    """hopper_flash with every head dim's ``plan.ForwardConfig`` fields replaced
    by ``spec`` (e.g. ``persistent=False`` or ``k_stages=3,v_stages=3``), named
    ``hopper_flash[spec]``: a kernel experiment timed next to the shipped
    configs, on the same inputs, in one process. The shipped config is put back
    after every call."""
    fields = parse_variant(spec)

    def build(cfg: Config, q, k, v, scale: float) -> AttnFn:
        import dataclasses

        from hopper_flash import flash_attn_func, plan

        shipped = plan.CONFIGS.get(cfg.headdim)
        if shipped is None:
            raise Unsupported(f"no kernel config for head dim {cfg.headdim}")
        variant = dataclasses.replace(shipped, **fields)
        window = _window_kwargs(cfg)

        def fn():
            plan.CONFIGS[cfg.headdim] = variant
            try:
                return flash_attn_func(q, k, v, softmax_scale=scale, causal=cfg.causal, **window)
            except (ValueError, NotImplementedError) as e:
                raise Unsupported(str(e)) from e
            finally:
                plan.CONFIGS[cfg.headdim] = shipped

        return fn

    return Backend(f"hopper_flash[{spec}]", _import_check("hopper_flash", "flash_attn_func"), build)


def all_backends() -> list[Backend]:
    """Every backend the bench knows, in table order. cuDNN SDPA is the
    reference point for the speed ratio column."""
    torch_check = _import_check("torch.nn.attention", "sdpa_kernel")
    return [
        Backend("hopper_flash", _import_check("hopper_flash", "flash_attn_func"), _build_hopper_flash),
        Backend("hopper_flash-kvcache", _import_check("hopper_flash", "flash_attn_with_kvcache"),
                _build_hopper_flash_kvcache, default=False, grad=False),
        Backend("sdpa-cudnn", torch_check, _build_sdpa("CUDNN_ATTENTION")),
        Backend("sdpa-flash", torch_check, _build_sdpa("FLASH_ATTENTION")),
        Backend("sdpa-efficient", torch_check, _build_sdpa("EFFICIENT_ATTENTION")),
        # A compiled flex backward per config is a compile-time benchmark more than a kernel one.
        Backend("flex-compiled", _flex_check, _build_flex, grad=False),
        Backend("fa3", _import_check("flash_attn_interface", "flash_attn_func"), _build_flash_attn("flash_attn_interface")),
        Backend("fa3-kvcache", _import_check("flash_attn_interface", "flash_attn_with_kvcache"), _build_fa3_kvcache,
                default=False, grad=False),  # the KV-cache APIs have no backward
        Backend("fa2", _import_check("flash_attn", "flash_attn_func"), _build_flash_attn("flash_attn")),
    ]


BACKEND_NAMES = tuple(b.name for b in all_backends())
CUDNN = "sdpa-cudnn"
