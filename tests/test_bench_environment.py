"""Where the bench header's commit comes from, and what ``hopper-flash bench``
says when the ``bench`` extra is missing (no GPU needed)."""
import argparse
import shutil
import subprocess
from pathlib import Path

import pytest

from hopper_flash.bench import cli, environment

PACKAGE = Path(environment.__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(cwd, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main",
                           *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def make_repo(path: Path, project_name: str | None) -> str:
    path.mkdir(parents=True, exist_ok=True)
    if project_name:
        (path / "pyproject.toml").write_text(f'[project]\nname = "{project_name}"\n')
    (path / "README").write_text("x\n")
    git(path, "init", "-q")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "init")
    return git(path, "rev-parse", "HEAD")


def copy_package(dest: Path) -> Path:
    shutil.copytree(PACKAGE, dest / "hopper_flash", ignore=shutil.ignore_patterns("__pycache__"))
    return dest / "hopper_flash"


def test_copy_inside_another_repository_names_no_commit(tmp_path, monkeypatch):
    monkeypatch.delenv("HOPPER_FLASH_COMMIT", raising=False)
    make_repo(tmp_path / "outer", "someone_elses_project")
    copy_top = tmp_path / "outer" / "vendor" / "hf"
    copy_top.mkdir(parents=True)
    (copy_top / "pyproject.toml").write_text('[project]\nname = "hopper_flash"\n')
    pkg = copy_package(copy_top)
    assert environment._git_commit(pkg) is None


def test_package_at_the_top_of_another_projects_repository_names_no_commit(tmp_path, monkeypatch):
    monkeypatch.delenv("HOPPER_FLASH_COMMIT", raising=False)
    make_repo(tmp_path / "other", "other_project")
    pkg = copy_package(tmp_path / "other")
    assert environment._git_commit(pkg) is None


def test_hopper_flash_checkout_names_its_commit(tmp_path, monkeypatch):
    monkeypatch.delenv("HOPPER_FLASH_COMMIT", raising=False)
    top = tmp_path / "checkout"
    top.mkdir()
    copy_package(top)
    head = make_repo(top, "hopper_flash")
    commit = environment._git_commit(top / "hopper_flash")
    assert commit is not None and head.startswith(commit.removesuffix("-dirty"))


def test_environment_variable_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("HOPPER_FLASH_COMMIT", "abc1234")
    assert environment._git_commit(tmp_path) == "abc1234"


def test_missing_bench_extra_names_the_install_command(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "rich" else real(name, *a))
    assert cli.missing_extras(argparse.Namespace(plot=None)) == ["rich"]
    assert cli.main(["bench", "--seqlen", "128"]) == 2
    assert "pip install 'hopper_flash[bench]'" in capsys.readouterr().err


def test_plot_needs_matplotlib(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli.missing_extras(argparse.Namespace(plot="x.png")) == ["matplotlib"]
    assert cli.missing_extras(argparse.Namespace(plot=None)) == []


# --- --variant: kernel variants timed next to the shipped configs ------------


def test_parse_variant():
    from hopper_flash.bench.backends import parse_variant

    assert parse_variant("k_stages=3,v_stages=3") == {"k_stages": 3, "v_stages": 3}
    assert parse_variant("persistent=False") == {"persistent": False}
    for bad in ("bogus=1", "k_stages", "", "k_stages=three", "head_dim=64"):
        with pytest.raises(ValueError, match="--variant"):
            parse_variant(bad)


def test_variant_backend_runs_the_variant_and_restores_the_shipped_config(monkeypatch):
    import hopper_flash
    from hopper_flash import plan
    from hopper_flash.bench.backends import variant_backend
    from hopper_flash.bench.configs import Config

    shipped = plan.CONFIGS[128]
    seen = []

    def spy(q, k, v, softmax_scale=None, causal=False):
        seen.append(plan.CONFIGS[128])
        return q

    monkeypatch.setattr(hopper_flash, "flash_attn_func", spy)
    backend = variant_backend("k_stages=3,persistent=False")
    assert backend.name == "hopper_flash[k_stages=3,persistent=False]"
    fn = backend.build(Config(seqlen=64, headdim=128), "q", "k", "v", 0.1)
    assert fn() == "q"
    assert seen[0].k_stages == 3 and not seen[0].persistent and seen[0].v_stages == shipped.v_stages
    assert plan.CONFIGS[128] is shipped


def test_bad_variant_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--seqlen", "128", "--variant", "bogus=1"])
    assert e.value.code == 2
    assert "unknown ForwardConfig field" in capsys.readouterr().err


def test_header_names_the_imported_package():
    """A patched copy on PYTHONPATH can be shadowed by the checkout's own
    package (``python -m`` puts the working directory first): the header says
    which one ran."""
    import pathlib

    import hopper_flash
    from hopper_flash.bench.environment import collect_meta
    from hopper_flash.bench.report import header_lines

    meta = collect_meta("hopper-flash bench")
    where = str(pathlib.Path(hopper_flash.__file__).resolve().parent)
    assert meta["hopper_flash_path"] == where
    assert any(f"imported from {where}" in line for line in header_lines(meta))


def test_header_states_the_measured_hbm_copy_rate(monkeypatch):
    """Decode's K/V rate is read against this GPU's copy rate, measured with
    do_bench (an H100's is not the H200's 4.3 TB/s)."""
    from hopper_flash.bench import timing
    from hopper_flash.bench.environment import collect_meta
    from hopper_flash.bench.report import header_lines

    monkeypatch.setattr(timing, "COPY_BYTES", 1 << 20)
    copies = []

    def timer(fn):
        copies.append(fn())
        return timing.Timing(0.5, 0.5, 0.5, 1)  # 2 MiB moved in 0.5 ms

    rate = timing.hbm_copy_tbs(timer, device="cpu")
    assert len(copies) == 1 and copies[0].numel() == 1 << 20
    assert rate == 2 * (1 << 20) / 0.5e-3 / 1e12
    line = next(x for x in header_lines(collect_meta("c", 700.0, 2.91)) if x.startswith("- K/V TB/s"))
    assert "this GPU's HBM copy rate" in line and "2.91 TB/s" in line
    line = next(x for x in header_lines(collect_meta("c")) if x.startswith("- K/V TB/s"))
    assert "not measured" in line


@pytest.mark.parametrize("rounds", [1, 4])
@pytest.mark.parametrize("graph", [False, True], ids=["plain", "cuda-graph"])
def test_copy_rate_is_timed_with_do_bench_under_any_timer(monkeypatch, graph, rounds):
    """A ``--cuda-graph`` run times the attention calls by graph replay, but
    the header's copy rate is the GPU's: timed with ``do_bench`` (a graph's
    replay of the copy read 2.45 TB/s against 3.02 on one H100). With
    ``--rounds`` the calls' timer gets each round's share of the budgets and
    (do_bench) at least ``ROUND_MIN_CALLS`` calls a round."""
    from hopper_flash.bench import cli, environment, timing

    made = []

    def fake_timer(kind):
        def make(*budgets):
            timer = lambda fn: timing.Timing(1.0, 1.0, 1.0, 1)  # noqa: E731
            made.append((kind, budgets, timer))
            return timer
        return make

    monkeypatch.setattr(environment, "hopper_problem", lambda: None)
    monkeypatch.setattr(timing, "do_bench_timer", fake_timer("do_bench"))
    monkeypatch.setattr(timing, "cuda_graph_timer", fake_timer("graph"))
    monkeypatch.setattr(timing, "matmul_tflops", lambda timer: 700.0)
    copy_timers = []
    monkeypatch.setattr(timing, "hbm_copy_tbs", lambda timer: copy_timers.append(timer) or 3.0)
    seen = {}
    monkeypatch.setattr(cli, "execute", lambda configs, backends, timer, *a, **kw: seen.update(kw, timer=timer) or 0)
    argv = (["bench", "--backends", "hopper_flash", "--rep-ms", "40", "--warmup-ms", "8", "--rounds", str(rounds)]
            + (["--cuda-graph"] if graph else []))
    args = cli.build_parser().parse_args(argv)
    assert cli.bench(args, [], "cmd") == 0
    assert seen["hbm_copy_tbs"] == 3.0
    kind, budgets, timer = next(m for m in made if m[2] is copy_timers[0])
    assert kind == "do_bench" and budgets[:2] == (8, 40)
    kind, budgets, timer = next(m for m in made if m[2] is seen["timer"])
    if graph:
        assert kind == "graph" and budgets == (40 / rounds,)
    else:
        assert kind == "do_bench" and budgets == (8 / rounds, 40 / rounds, timing.ROUND_MIN_CALLS if rounds > 1 else 1)
