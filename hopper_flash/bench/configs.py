"""Benchmark configurations: the Config record, the default set, JSON config
files and FLOP counting.

A Config uses the same field names as the CLI options (``--kv-heads`` is
``kv_heads``) and as the JSON config files, so a row of the results can be
pasted back into a config file.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

DTYPES = ("bf16", "fp16")


class ConfigError(ValueError):
    """A config that cannot be benchmarked as written (bad field, bad value)."""


@dataclass(frozen=True)
class Config:
    """One attention forward shape, BSHD layout as in flash-attn.

    ``seqlen_k`` and ``kv_heads`` default to ``None`` meaning "same as the
    query side"; they stay ``None`` so that overriding ``seqlen``/``heads``
    later (CLI options applied to the default set) keeps them equal.
    ``window``: flash-attn's ``window_size`` ``(left, right)`` (-1: no bound
    on that side; ``causal`` makes ``right`` 0), or None. ``headdim_v``: v's
    head dim where it differs from q's and k's (FA3's ``hdim_v``, e.g.
    DeepSeek's 192/128); None: ``headdim``.
    """

    seqlen: int
    batch: int = 4
    heads: int = 32
    kv_heads: int | None = None
    seqlen_k: int | None = None
    headdim: int = 128
    causal: bool = True
    dtype: str = "bf16"
    window: tuple[int, int] | None = None
    headdim_v: int | None = None

    def __post_init__(self) -> None:
        for name in ("seqlen", "batch", "heads", "kv_heads", "seqlen_k", "headdim", "headdim_v"):
            value = getattr(self, name)
            if value is None and name in ("kv_heads", "seqlen_k", "headdim_v"):
                continue
            # bool is an int subclass; "causal": 1 in a JSON file is a typo worth catching.
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.causal, bool):
            raise ConfigError(f"causal must be true or false, got {self.causal!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.heads % self.nheads_kv:
            raise ConfigError(
                f"heads ({self.heads}) must be a multiple of kv_heads ({self.nheads_kv})"
            )
        if self.window is not None:
            w = self.window
            if (not isinstance(w, (list, tuple)) or len(w) != 2
                    or any(not isinstance(x, int) or isinstance(x, bool) or x < -1 for x in w)):
                raise ConfigError(f"window must be a pair [left, right] of ints >= -1 (-1: no bound), got {w!r}")
            object.__setattr__(self, "window", (int(w[0]), int(w[1])))

    @property
    def window_bounds(self) -> tuple[int, int] | None:
        """The window as the kernels and the reference take it
        (``hopper_flash.checks.window_bounds``), or None for none."""
        if self.window is None:
            return None
        from hopper_flash.checks import window_bounds

        return window_bounds(self.window, self.causal)

    @property
    def seqlen_q(self) -> int:
        return self.seqlen

    @property
    def seqlen_kv(self) -> int:
        return self.seqlen if self.seqlen_k is None else self.seqlen_k

    @property
    def nheads_kv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def head_dim_v(self) -> int:
        return self.headdim if self.headdim_v is None else self.headdim_v

    @property
    def label(self) -> str:
        """Short human label, e.g. ``B4 H32 S4096 D128 causal bf16``."""
        heads = f"H{self.heads}" if self.nheads_kv == self.heads else f"H{self.heads}/{self.nheads_kv}"
        seq = f"S{self.seqlen}" if self.seqlen_kv == self.seqlen else f"S{self.seqlen}x{self.seqlen_kv}"
        mode = "causal" if self.causal else "full"
        if self.window_bounds is not None:
            mode += " win{},{}".format(*self.window_bounds)
        dims = f"D{self.headdim}" if self.head_dim_v == self.headdim else f"D{self.headdim}x{self.head_dim_v}"
        return f"B{self.batch} {heads} {seq} {dims} {mode} {self.dtype}"

    def to_record(self) -> dict:
        """Flat dict with the defaults resolved (used in JSON/CSV results)."""
        return {
            "batch": self.batch,
            "heads": self.heads,
            "kv_heads": self.nheads_kv,
            "seqlen": self.seqlen,
            "seqlen_k": self.seqlen_kv,
            "headdim": self.headdim,
            "causal": self.causal,
            "dtype": self.dtype,
            "window": list(self.window) if self.window is not None else None,
            "headdim_v": self.head_dim_v,
        }


FIELDS = tuple(f.name for f in dataclasses.fields(Config))

DEFAULT_SEQLENS = (1024, 2048, 4096, 8192, 16384)


def default_configs() -> list[Config]:
    """The set run with no arguments: a seqlen sweep at B=4 H=32, plus a
    short-sequence large-batch case and a single 32k sequence."""
    sweep = [Config(seqlen=s, batch=4, heads=32) for s in DEFAULT_SEQLENS]
    return sweep + [Config(seqlen=512, batch=16, heads=16), Config(seqlen=32768, batch=1, heads=32)]


def config_from_dict(obj: object, where: str = "config") -> Config:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected an object with fields {', '.join(FIELDS)}, got {obj!r}")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; valid fields: {', '.join(FIELDS)}"
        )
    if "seqlen" not in obj:
        raise ConfigError(f"{where}: missing required field 'seqlen'")
    try:
        return Config(**obj)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def load_config_file(path: str | Path) -> list[Config]:
    """Read a JSON file holding a list of config objects (or a single object)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON: {e}") from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not data:
        raise ConfigError(f"{path}: expected a non-empty JSON list of config objects")
    return [config_from_dict(item, f"{path}[{i}]") for i, item in enumerate(data)]


def causal_pairs(seqlen_q: int, seqlen_k: int) -> int:
    """Number of visible (query, key) pairs under a bottom-right aligned causal
    mask (flash-attn's convention): query row i sees keys j <= i + seqlen_k - seqlen_q,
    so row i contributes clamp(i + seqlen_k - seqlen_q + 1, 0, seqlen_k) keys.

    Closed form of that sum: the per-row counts run over v = a..b with
    a = seqlen_k - seqlen_q + 1 and b = seqlen_k, each clamped to [0, seqlen_k].
    """

    def prefix(n: int) -> int:  # sum_{v=1..n} clamp(v, 0, seqlen_k); 0 for n <= 0
        if n <= 0:
            return 0
        if n <= seqlen_k:
            return n * (n + 1) // 2
        return seqlen_k * (seqlen_k + 1) // 2 + (n - seqlen_k) * seqlen_k

    a = seqlen_k - seqlen_q + 1
    b = seqlen_k
    return prefix(b) - prefix(a - 1)


def _window_spans(seqlen_q: int, seqlen_k: int, left: int, right: int):
    """``(lo, hi)`` per query row under a sliding window (bottom-right
    aligned, -1 = no bound on that side): row ``i`` sees keys
    ``max(0, i + off - left) .. min(seqlen_k - 1, i + off + right)`` (none
    when ``hi < lo``)."""
    off = seqlen_k - seqlen_q
    for i in range(seqlen_q):
        yield (0 if left < 0 else max(0, i + off - left),
               seqlen_k - 1 if right < 0 else min(seqlen_k - 1, i + off + right))


def window_pairs(seqlen_q: int, seqlen_k: int, left: int, right: int) -> int:
    """Visible (query, key) pairs under a sliding window (``_window_spans``)."""
    return sum(max(0, hi - lo + 1) for lo, hi in _window_spans(seqlen_q, seqlen_k, left, right))


def window_keys(seqlen_q: int, seqlen_k: int, left: int, right: int) -> int:
    """Keys that some row sees under a sliding window (``_window_spans``).
    Consecutive rows' windows are one key apart, so the seen keys are one
    run: from the first seeing row's leftmost key to the last row's
    rightmost."""
    spans = [(lo, hi) for lo, hi in _window_spans(seqlen_q, seqlen_k, left, right) if hi >= lo]
    return spans[-1][1] - spans[0][0] + 1 if spans else 0


def kv_bytes(cfg: Config) -> int:
    """Bytes of K and V one call must read at least once: 2 * B * Hkv * S_k * D
    * element size, S_k counting only the keys a window shows (``window_keys``).
    Decode (small S_q) is bound by reading them, so its speed is this over the
    time, next to the HBM copy rate (``timing.hbm_copy_tbs``, in the report's
    header; ~4.3 TB/s on the H200)."""
    keys = cfg.seqlen_kv
    window = cfg.window_bounds
    if window is not None:
        keys = window_keys(cfg.seqlen_q, cfg.seqlen_kv, *window)
    return cfg.batch * cfg.nheads_kv * keys * (cfg.headdim + cfg.head_dim_v) * 2


def attention_flops(cfg: Config) -> int:
    """Forward FLOPs: two matmuls (QK^T and PV), 2 FLOPs per multiply-add, so
    4 * B * H * S_q * S_k * D without a mask (with v's own head dim Dv:
    2 * B * H * S_q * S_k * (D + Dv)). H is the number of query heads (GQA
    shares K/V but does not reduce the work).

    A sliding window counts its visible pairs exactly (``window_pairs``).

    Causal, following the project's convention (and flash-attn's benchmarks):
      * S_q == S_k: exactly half of the dense count, 2 * B * H * S^2 * D. The
        exact number of visible pairs is S(S+1)/2, i.e. 1/S more; the
        convention ignores that so numbers compare with published ones.
      * S_q != S_k: 4 * B * H * D * causal_pairs(S_q, S_k), the visible pairs
        under bottom-right alignment (there is no established "half").
    """
    b, h, sq, sk = cfg.batch, cfg.heads, cfg.seqlen_q, cfg.seqlen_kv
    dd = cfg.headdim + cfg.head_dim_v  # QK's and PV's depths: 2 * D with one head dim
    if cfg.window_bounds is not None:
        return 2 * b * h * dd * window_pairs(sq, sk, *cfg.window_bounds)
    if not cfg.causal:
        return 2 * b * h * sq * sk * dd
    if sq == sk:
        return b * h * sq * sk * dd
    return 2 * b * h * dd * causal_pairs(sq, sk)
