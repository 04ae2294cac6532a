"""``hopper-flash bench``: compare attention kernels (forward, backward,
forward+backward) on a Hopper GPU.

Exit status: 0 when every timed result matches the float64 reference (judged against SDPA's error),
1 when any result FAILs the check or errors, 2 for usage errors or when no
Hopper GPU is present.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Sequence

from .backends import BACKEND_NAMES, Backend, all_backends
from .configs import DTYPES, Config, ConfigError, default_configs, load_config_file
from .results import Result
from .runner import PASSES
from .timing import Timer

# Options that override fields of every config in the set.
OVERRIDES = ("batch", "heads", "kv_heads", "headdim", "headdim_v", "causal", "dtype", "window")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hopper-flash", description="hopper_flash tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "bench",
        help="benchmark attention (forward, backward) against other implementations",
        description=(
            "Time hopper_flash.flash_attn_func next to PyTorch SDPA (cuDNN, flash, efficient), "
            "compiled FlexAttention and FlashAttention-2/3 when installed, on the same inputs; "
            "check every output (and with --pass bwd / fwd+bwd every gradient dq, dk, dv) against a "
            "float64 reference. Without --seqlen or --config it runs "
            "the default set (causal bf16 D128: B4 H32 S1024..16384, B16 H16 S512, B1 H32 S32768); "
            "--batch/--heads/--kv-heads/--headdim/--causal/--dtype override those fields in every config."
        ),
    )
    p.set_defaults(command_parser=p)
    shape = p.add_argument_group("configurations")
    shape.add_argument("--seqlen", type=int, nargs="+", metavar="S", help="query sequence lengths, one config each")
    shape.add_argument("--seqlen-k", type=int, nargs="+", metavar="S",
                       help="key/value lengths: one, or one per --seqlen (default: equal to seqlen)")
    shape.add_argument("--batch", type=int, metavar="N", help="batch size (default 4 with --seqlen)")
    shape.add_argument("--heads", type=int, metavar="N", help="query heads (default 32 with --seqlen)")
    shape.add_argument("--kv-heads", type=int, metavar="N", help="key/value heads for GQA (default: = heads)")
    shape.add_argument("--headdim", type=int, metavar="N", help="head dimension (default 128)")
    shape.add_argument("--headdim-v", type=int, metavar="N",
                       help="v's head dimension where it differs from q's and k's (FA3's hdim_v; default: "
                            "--headdim); TFLOP/s count QK at the one and PV at the other")
    shape.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                       help="causal mask, bottom-right aligned (default: causal)")
    shape.add_argument("--dtype", choices=DTYPES, help="input dtype (default bf16)")
    shape.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"),
                       help="sliding window, flash-attn's window_size (-1: no bound on that side; causal makes "
                            "RIGHT 0); TFLOP/s count the visible pairs. SDPA and FlexAttention rows are "
                            "unsupported")
    shape.add_argument("--varlen", metavar="LO:HI",
                       help="instead of the configs: one mixed-length batch through flash_attn_varlen_func "
                            "(--batch sequences, default 16, lengths uniform in LO..HI; --heads/--kv-heads default "
                            "32/8), next to FA3's varlen call and the fixed-length kernel at equal total tokens; "
                            "forward, backward and both")
    shape.add_argument("--config", metavar="FILE.json",
                       help="JSON list of config objects with fields: " + ", ".join(
                           ("seqlen", "seqlen_k", "batch", "heads", "kv_heads", "headdim", "headdim_v", "causal",
                            "dtype", "window")))
    run = p.add_argument_group("running")
    run.add_argument("--pass", dest="passes", nargs="+", choices=PASSES, default=["fwd"], metavar="PASS",
                     help="what to time, one table block each: fwd (the output), bwd (dq, dk, dv of a fixed "
                          "grad_out through autograd; the forward runs once, untimed), fwd+bwd (both); "
                          "TFLOP/s count the backward as 2.5x the forward's FLOPs (default: fwd)")
    run.add_argument("--memory", action="store_true",
                     help="also report the peak GPU memory PyTorch allocates during one call of each cell "
                          "beyond what was allocated before it (torch.cuda.max_memory_allocated)")
    run.add_argument("--backends", nargs="+", choices=BACKEND_NAMES, metavar="NAME",
                     help=f"subset to run, from: {', '.join(BACKEND_NAMES)} (default: all but the KV-cache APIs, "
                          "hopper_flash-kvcache and fa3-kvcache)")
    # do_bench takes time budgets, not counts; the number of timed calls made
    # is recorded in each result ("reps").
    run.add_argument("--variant", action="append", default=[], metavar="FIELD=VALUE[,FIELD=VALUE]",
                     help="also time hopper_flash with these plan.ForwardConfig fields replaced in every head "
                          "dim's config (e.g. k_stages=3,v_stages=3 or persistent=False), as backend "
                          "'hopper_flash[FIELD=VALUE]'; repeatable")
    run.add_argument("--warmup-ms", "--warmup", type=float, default=100, metavar="MS",
                     help="untimed warm-up time per cell, in ms (default %(default)g)")
    run.add_argument("--rep-ms", "--reps", type=float, default=500, metavar="MS",
                     help="timed repetition time per cell, in ms, each rep after an L2 flush (default %(default)g)")
    run.add_argument("--rounds", type=int, default=1, metavar="N",
                     help="time each cell's backends in N interleaved rounds, the warm-up and rep budgets split "
                          "over them, each backend's median over all its calls: a power-capped GPU's clock "
                          "drift then falls on every backend alike (default %(default)s: one backend after "
                          "the other)")
    run.add_argument("--cuda-graph", action="store_true",
                     help="time replays of a CUDA graph holding back-to-back calls (no host or launch overhead, "
                          "no L2 flush between calls), as serving loops run decode steps")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write all results and the header facts as JSON")
    out.add_argument("--csv", metavar="FILE", help="write all results as CSV, one row per (config, backend)")
    out.add_argument("--plot", metavar="FILE.png", help="plot TFLOP/s vs sequence length per backend")
    out.add_argument("--quiet", action="store_true", help="no progress bar (the report is still printed)")
    return parser


def resolve_configs(args: argparse.Namespace) -> list[Config]:
    """The config set the options describe; ConfigError when inconsistent."""
    if args.seqlen_k and not args.seqlen:
        raise ConfigError("--seqlen-k needs --seqlen")
    if args.config and args.seqlen:
        raise ConfigError("use either --config or --seqlen, not both")
    if args.seqlen:
        seqlens_k = args.seqlen_k or [None]
        if len(seqlens_k) == 1:
            seqlens_k = seqlens_k * len(args.seqlen)
        elif len(seqlens_k) != len(args.seqlen):
            raise ConfigError(
                f"--seqlen-k takes one value or one per --seqlen ({len(args.seqlen)}), got {len(seqlens_k)}"
            )
        base = [Config(seqlen=s, seqlen_k=sk) for s, sk in zip(args.seqlen, seqlens_k)]
    elif args.config:
        base = load_config_file(args.config)
    else:
        base = default_configs()
    overrides = {name: getattr(args, name) for name in OVERRIDES if getattr(args, name) is not None}
    try:
        return [Config(**{**_fields(c), **overrides}) for c in base]
    except ConfigError as e:
        raise ConfigError(f"options: {e}") from None


def _fields(cfg: Config) -> dict:
    return {name: getattr(cfg, name) for name in Config.__dataclass_fields__}


def select_backends(backends: Sequence[Backend], names: Sequence[str] | None) -> list[Backend]:
    if not names:
        return [b for b in backends if b.default]
    return [b for b in backends if b.name in names]


def execute(
    configs: Sequence[Config],
    backends: Sequence[Backend],
    timer: Timer,
    args: argparse.Namespace,
    command: str,
    *,
    device: str = "cuda",
    matmul_tflops: float | None = None,
    memory=None,
    hbm_copy_tbs: float | None = None,
) -> int:
    """Run, report and write files; the exit status. Separate from the GPU
    set-up so tests can call it with fake backends and timer on the CPU."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from . import report, results as results_io, runner
    from .environment import collect_meta

    passes = list(dict.fromkeys(getattr(args, "passes", None) or ["fwd"]))  # in order, once each
    memory = memory if getattr(args, "memory", False) else None
    total = len(configs) * len(passes) * len(backends)
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True), transient=True, disable=args.quiet,
    )
    with progress:
        task = progress.add_task("starting", total=total)
        done = iter(range(total))

        def on_step(cfg: Config, backend: str) -> None:
            progress.update(task, completed=next(done), description=f"{cfg.label} · {backend}")

        meta = collect_meta(command, matmul_tflops, hbm_copy_tbs)  # once: the run's header, dated at its start
        on_config = None
        if args.json:
            # The rows finished so far, marked partial, after each config: a
            # process that dies later (FA3 has segfaulted mid-block on the
            # H200) still leaves them. The last write below replaces them.
            partial_meta = {**meta, "partial": True}

            def on_config(done_results: list[Result]) -> None:
                results_io.write_json(args.json, done_results, partial_meta)

        results: list[Result] = runner.run(
            configs, backends, timer, device=device, matmul_tflops=matmul_tflops, on_step=on_step,
            passes=passes, memory=memory, on_config=on_config, rounds=getattr(args, "rounds", 1),
        )
        progress.update(task, completed=total)

    report.print_report(results, meta)
    if args.json:
        results_io.write_json(args.json, results, meta)
    if args.csv:
        results_io.write_csv(args.csv, results)
    if args.plot:
        from .plot import write_plot

        write_plot(args.plot, results, meta)
    return 1 if any(r.failed for r in results) else 0


def bench(args: argparse.Namespace, configs: list[Config], command: str) -> int:
    from .environment import hopper_problem

    problem = hopper_problem()
    if problem:
        print(f"hopper-flash bench: {problem}", file=sys.stderr)
        return 2
    from . import runner
    from .backends import variant_backend
    from .timing import cuda_graph_timer, do_bench_timer, hbm_copy_tbs, matmul_tflops, round_timer

    def make_timer(share: int):
        if args.cuda_graph:
            return cuda_graph_timer(args.rep_ms / share)
        return round_timer(args.warmup_ms, args.rep_ms, share)

    backends = select_backends(all_backends(), args.backends) + [variant_backend(v) for v in args.variant]
    # The copy rate is the GPU's, whatever the run's timer: replayed from a
    # CUDA graph the 1 GiB copy measured 2.45 TB/s against 3.02 plain on one
    # H100 (sixty-fifth session), which would misstate the ceiling.
    return execute(configs, backends, make_timer(args.rounds), args, command, device="cuda",
                   matmul_tflops=matmul_tflops(make_timer(1)), memory=runner.cuda_peak_memory,
                   hbm_copy_tbs=hbm_copy_tbs(do_bench_timer(args.warmup_ms, args.rep_ms)))


def missing_extras(args: argparse.Namespace) -> list[str]:
    """Packages of the ``bench`` extra this run needs but cannot import:
    rich for the report, matplotlib for ``--plot``."""
    import importlib.util

    needed = ["rich"] + (["matplotlib"] if args.plot else [])
    return [name for name in needed if importlib.util.find_spec(name) is None]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    # The command line that reproduces this run, whichever way it was started.
    command = shlex.join(["hopper-flash", *argv])
    if args.command == "bench":
        missing = missing_extras(args)
        if missing:
            print(f"hopper-flash bench needs {' and '.join(missing)}, which the base install does not include: "
                  f"pip install 'hopper_flash[bench]' (from a checkout: pip install -e '.[bench]')", file=sys.stderr)
            return 2
        if args.rounds < 1:
            args.command_parser.error(f"--rounds must be at least 1, got {args.rounds}")
        if args.varlen:
            from . import varlen

            try:
                varlen.parse_range(args.varlen)
                if args.seqlen or args.config:
                    raise ValueError("--varlen replaces --seqlen/--config")
            except ValueError as e:
                args.command_parser.error(str(e))
            return varlen.main(args, command)
        try:
            configs = resolve_configs(args)
            for spec in args.variant:
                from .backends import parse_variant

                parse_variant(spec)
        except (ConfigError, ValueError) as e:
            args.command_parser.error(str(e))  # usage line of `bench`, exit status 2
        return bench(args, configs, command)
    parser.error(f"unknown command {args.command}")
    return 2
