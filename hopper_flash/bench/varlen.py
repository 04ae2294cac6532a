"""``hopper-flash bench --varlen LO:HI``: a mixed-length (THD) batch through
``flash_attn_varlen_func``, next to FlashAttention-3's varlen call (when
``flash_attn_interface`` imports) and to the fixed-length kernel at the same
total number of tokens.

One config: ``--batch`` sequences (default 16) with lengths drawn uniformly
from ``LO..HI`` (seeded), ``--heads``/``--kv-heads`` (default 32/8),
``--headdim`` (128), causal unless ``--no-causal``, bf16 unless ``--dtype``.
Every backend is timed for the forward, the backward alone (gradients of a
recorded forward) and both (``--pass bwd`` or ``--pass fwd+bwd`` select;
the default runs all three); the forward output is checked against the float64
reference per sequence, judged against PyTorch's error
(``hopper_flash.reference.judge``). FLOPs follow flash-attn's convention
(causal: half the pairs; backward 2.5x the forward), summed over sequences.
The same keys as a paged cache (``PAGE_SIZE`` keys a page, the pages in a
shuffled pool, ``block_table``; vLLM's layout) are timed for the forward
alone (``hopper_flash-varlen-paged16``: the varlen kernel reading the pages).
"""
from __future__ import annotations

import json

from dataclasses import asdict, dataclass, field

PASSES = ("fwd", "bwd", "fwd+bwd")
# The paged backend's page size (vLLM's default block size).
PAGE_SIZE = 16
# Backends without a backward.
FORWARD_ONLY = ("hopper_flash-varlen-paged16",)


@dataclass(frozen=True)
class VarlenConfig:
    lo: int
    hi: int
    batch: int = 16
    heads: int = 32
    kv_heads: int = 8
    headdim: int = 128
    causal: bool = True
    dtype: str = "bf16"
    seed: int = 0

    def __post_init__(self):
        if not 0 < self.lo <= self.hi:
            raise ValueError(f"--varlen LO:HI needs 0 < LO <= HI, got {self.lo}:{self.hi}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")

    def lengths(self) -> list[int]:
        import torch

        gen = torch.Generator().manual_seed(self.seed)
        return torch.randint(self.lo, self.hi + 1, (self.batch,), generator=gen).tolist()

    def inputs(self, device: str = "cuda"):
        """``(q, k, v, cu_seqlens)`` for ``lengths()``: THD tensors of
        ``dtype`` drawn from the config's seed (the bench's inputs, and
        ``scripts/ncu_forward.sh``'s with ``VARLEN=1``)."""
        import torch

        lengths = self.lengths()
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]
        gen = torch.Generator(device=device).manual_seed(self.seed)
        total = sum(lengths)
        q = torch.randn(total, self.heads, self.headdim, generator=gen, device=device).to(dtype)
        k = torch.randn(total, self.kv_heads, self.headdim, generator=gen, device=device).to(dtype)
        v = torch.randn(total, self.kv_heads, self.headdim, generator=gen, device=device).to(dtype)
        cu = torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)
        return q, k, v, cu

    @property
    def label(self) -> str:
        mode = "causal" if self.causal else "full"
        return (f"varlen B{self.batch} L{self.lo}..{self.hi} H{self.heads}/{self.kv_heads} D{self.headdim} "
                f"{mode} {self.dtype}")


def parse_range(spec: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--varlen takes LO:HI (two ints), got {spec!r}") from None
    return lo, hi


def forward_flops(lengths: list[int], heads: int, headdim: int, causal: bool) -> int:
    per = sum(n * n for n in lengths) * heads * headdim
    return 2 * per if causal else 4 * per


def pass_flops(fwd: int, which: str) -> float:
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd+bwd": 3.5 * fwd}[which]


@dataclass
class VarlenResult:
    backend: str
    which: str
    median_ms: float | None = None
    tflops: float | None = None
    status: str = "ok"
    message: str = ""
    checked: str = ""


@dataclass
class VarlenReport:
    config: dict
    lengths: list[int]
    results: list[VarlenResult] = field(default_factory=list)


def _backends(cfg: VarlenConfig, lengths):
    """name -> (fwd(q, k, v) callable factory, THD inputs?)."""
    import importlib

    import hopper_flash

    total = sum(lengths)
    mx = max(lengths)

    def hf_varlen(q, k, v, cu):
        return lambda: hopper_flash.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=cfg.causal)

    def fa3_varlen(q, k, v, cu):
        func = importlib.import_module("flash_attn_interface").flash_attn_varlen_func

        def fn():
            out = func(q, k, v, cu, cu, mx, mx, causal=cfg.causal)
            return out[0] if isinstance(out, tuple) else out

        return fn

    def hf_fixed(q, k, v, cu):
        # The same number of tokens as equal-length sequences: B x (total / B).
        s = total // cfg.batch
        qf, kf, vf = (x[:cfg.batch * s].view(cfg.batch, s, *x.shape[1:]) for x in (q, k, v))
        return lambda: hopper_flash.flash_attn_func(qf, kf, vf, causal=cfg.causal)

    def hf_paged(q, k, v, cu):
        kp, vp, table = paged_copy(k, v, cu, PAGE_SIZE, seed=cfg.seed)
        return lambda: hopper_flash.flash_attn_varlen_func(q, kp, vp, cu, cu, mx, mx, block_table=table,
                                                           causal=cfg.causal)

    out = {"hopper_flash-varlen": hf_varlen, "hopper_flash-varlen-paged16": hf_paged}
    try:
        importlib.import_module("flash_attn_interface").flash_attn_varlen_func  # noqa: B018
        out["fa3-varlen"] = fa3_varlen
    except Exception:
        pass
    out["hopper_flash (fixed, equal tokens)"] = hf_fixed
    return out


def paged_copy(k, v, cu, page_size: int, seed: int = 0):
    """THD ``k``, ``v`` (sequences at ``cu``) as page pools ``[num_pages,
    page_size, Hkv, D]`` in a shuffled order, and the int32 block table
    ``[batch, max_pages]`` naming each sequence's pages in order."""
    import torch

    starts, ends = cu[:-1].tolist(), cu[1:].tolist()
    batch = len(starts)
    pages = [-(-(e - s) // page_size) for s, e in zip(starts, ends)]
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(sum(pages), generator=gen).tolist()
    kp = k.new_zeros((sum(pages), page_size, *k.shape[1:]))
    vp = v.new_zeros((sum(pages), page_size, *v.shape[1:]))
    table = torch.zeros((batch, max(1, max(pages))), dtype=torch.int32)
    n = 0
    for b, (s, e) in enumerate(zip(starts, ends)):
        for p in range(pages[b]):
            lo, hi = s + p * page_size, min(s + (p + 1) * page_size, e)
            kp[order[n], :hi - lo] = k[lo:hi]
            vp[order[n], :hi - lo] = v[lo:hi]
            table[b, p] = order[n]
            n += 1
    return kp, vp, table.to(k.device)


def run(cfg: VarlenConfig, timer, *, device: str = "cuda", passes=PASSES, rounds: int = 1) -> VarlenReport:
    """Each backend's output judged, then each (backend, pass) cell timed.
    ``rounds`` > 1: the cells that set up are timed in that many rounds,
    each once per round in a rotating order, each median over all its
    rounds' calls (as ``runner.run_config``; ``timer`` gets a round's share
    of the budget); every cell's callable is held until the last round."""
    from hopper_flash.reference import judge, varlen_baseline, varlen_reference

    from .timing import time_in_rounds

    lengths = cfg.lengths()
    report = VarlenReport(asdict(cfg), lengths)
    q, k, v, cu = cfg.inputs(device)
    total = sum(lengths)
    fwd_flops = forward_flops(lengths, cfg.heads, cfg.headdim, cfg.causal)
    fixed_s = total // cfg.batch
    fixed_flops = forward_flops([fixed_s] * cfg.batch, cfg.heads, cfg.headdim, cfg.causal)
    ref = base = None
    cells = []  # (result, FLOPs, timed callable) waiting for the rounds (rounds > 1)
    for name, factory in _backends(cfg, lengths).items():
        flops = fixed_flops if "fixed" in name else fwd_flops
        checked = ""
        try:
            fn = factory(q, k, v, cu)
            out = fn()
            if "fixed" not in name:
                if ref is None:
                    ref, _ = varlen_reference(q, k, v, cu, cu, causal=cfg.causal)
                    base = varlen_baseline(q, k, v, cu, cu, causal=cfg.causal)
                verdict = judge("out", out, ref, base)
                checked = verdict.message
                if not verdict:
                    report.results.append(VarlenResult(name, "fwd", status="FAIL", message=verdict.message))
                    continue
        except Exception as e:  # an unsupported option, out of memory: reported, not fatal
            report.results.append(VarlenResult(name, "fwd", status="error", message=f"{type(e).__name__}: {e}"))
            continue
        for which in passes:
            if which != "fwd" and name in FORWARD_ONLY:
                continue
            result = VarlenResult(name, which, checked=checked if which == "fwd" else "")
            report.results.append(result)
            try:
                timed = _pass_fn(which, factory, q, k, v, cu)
                if rounds > 1:
                    cells.append((result, pass_flops(flops, which), timed))
                    continue
                _record(result, pass_flops(flops, which), timer(timed))
            except Exception as e:
                result.status, result.message = "error", f"{type(e).__name__}: {e}"
    for (result, flops, _), t in zip(cells, time_in_rounds([fn for _, _, fn in cells], timer, rounds)):
        if isinstance(t, Exception):
            result.status, result.message = "error", f"{type(t).__name__}: {t}"
        else:
            _record(result, flops, t)
    return report


def _record(result: VarlenResult, flops: float, t) -> None:
    result.median_ms = t.median_ms
    result.tflops = flops / (t.median_ms * 1e-3) / 1e12


def _pass_fn(which, factory, q, k, v, cu):
    import torch

    if which == "fwd":
        return factory(q, k, v, cu)
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    fwd = factory(qg, kg, vg, cu)
    if which == "fwd+bwd":
        def step():
            out = fwd()
            return torch.autograd.grad(out, (qg, kg, vg), torch.ones_like(out))
        return step
    out = fwd()
    dout = torch.ones_like(out)
    return lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)


def format_report(report: VarlenReport) -> str:
    cfg = VarlenConfig(**report.config)
    lines = [cfg.label, f"lengths: {report.lengths} (total {sum(report.lengths)})"]
    ref = {r.which: r.median_ms for r in report.results if r.backend == "fa3-varlen" and r.median_ms}
    lines.append(f"{'backend':36s} {'pass':8s} {'ms':>9s} {'TFLOP/s':>8s} {'vs fa3':>7s}")
    for r in report.results:
        if r.median_ms is None:
            lines.append(f"{r.backend:36s} {r.which:8s} {r.status}: {r.message}")
            continue
        ratio = f"{ref[r.which] / r.median_ms:6.3f}x" if r.which in ref else "      -"
        lines.append(f"{r.backend:36s} {r.which:8s} {r.median_ms:9.3f} {r.tflops:8.1f} {ratio}")
    return "\n".join(lines)


def main(args, command: str) -> int:
    import sys

    from .environment import hopper_problem
    from .timing import round_timer

    problem = hopper_problem()
    if problem:
        print(f"hopper-flash bench: {problem}", file=sys.stderr)
        return 2
    lo, hi = parse_range(args.varlen)
    fields = dict(lo=lo, hi=hi)
    for name in ("batch", "heads", "kv_heads", "headdim", "causal", "dtype"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if args.heads is not None and args.kv_heads is None:
        fields["kv_heads"] = args.heads
    cfg = VarlenConfig(**fields)
    # --pass as for the fixed-length configs; its default (fwd alone) means all three here.
    passes = tuple(p for p in PASSES if p in (getattr(args, "passes", None) or ())) or PASSES
    if passes == ("fwd",):
        passes = PASSES
    rounds = getattr(args, "rounds", 1)
    report = run(cfg, round_timer(args.warmup_ms, args.rep_ms, rounds), passes=passes, rounds=rounds)
    print(command)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, **asdict(report)}, f, indent=1)
    return 1 if any(r.status != "ok" for r in report.results) else 0


__all__ = ["VarlenConfig", "parse_range", "forward_flops", "pass_flops", "run", "format_report", "main"]

