"""Every CLI speaks the same language: the shared options of kforcing_kernels/app/cli.py have one name,
type and default everywhere, every option has help text, every ``--help`` renders with its defaults, the
console entry points resolve, and the docs do not use retired spellings. All in-process (no subprocess)."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys

import pytest

from helpers import REPO

ROOT = str(REPO)

pytest.importorskip("tqdm")

# After the importorskip: the CLIs' modules import tqdm.
from kforcing_kernels.app import cli as cli_common  # noqa: E402
from kforcing_kernels.app.cli import RETIRED_FLAGS, SHARED_OPTIONS, all_parsers  # noqa: E402


def _bench_parser():
    from bench.__main__ import build_parser

    return build_parser()


def _bench_attention_parser():
    from bench.__main__ import command_parser

    return command_parser("peers")


BUILDERS = {
    "train": lambda: importlib.import_module("kforcing_kernels.app.train").build_parser(),
    "generate": lambda: importlib.import_module("kforcing_kernels.app.generation.inference").build_parser(),
    "evaluate": lambda: importlib.import_module("kforcing_kernels.app.evaluation.evaluate").build_parser(),
    "demo": lambda: importlib.import_module("kforcing_kernels.app.demo").build_parser(),
    "bench": _bench_parser,
    "bench/attention/peers.py": _bench_attention_parser,
}
# Where each shared option must be present (command path as all_parsers names it, after the builder's key).
REQUIRED = {
    "--device": [
        "train stage0",
        "train stage1",
        "train stage2",
        "train pipeline",
        "generate",
        "evaluate",
        "demo",
        "bench attention",
        "bench train",
        "bench infer",
        "bench gpu",
        "bench/attention/peers.py",
    ],
    "--temperature": ["generate", "evaluate", "demo"],
    "--seed": ["train stage0", "train stage1", "train stage2", "train pipeline", "generate", "evaluate"],
    "--threads": [
        "train stage0",
        "generate",
        "evaluate",
        "demo",
        "bench attention",
        "bench train",
        "bench infer",
        "bench cpu-kernels",
        "bench cpp-ab",
        "bench sliding-window",
        "bench cp-throughput",
    ],
    "--new-tokens": ["generate", "evaluate", "bench infer"],
    "--batch-size": [
        "train stage0",
        "train pipeline",
        "bench attention",
        "bench train",
        "bench cpp-ab",
        "bench sliding-window",
        "bench cp-throughput",
        "bench gpu",
        "bench profile",
    ],
    "--batch-sizes": ["evaluate", "bench infer"],
}


@pytest.fixture(scope="module")
def parsers():
    found = {}
    for key, build in BUILDERS.items():
        parser = build()
        for name, p in all_parsers(parser, key):
            found[name] = p
    return found


def _options(p):
    return [a for a in p._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_every_command_is_found(parsers):
    for names in REQUIRED.values():
        for name in names:
            assert name in parsers, f"{name}: not among {sorted(parsers)}"


@pytest.mark.parametrize("flag", sorted(SHARED_OPTIONS))
def test_shared_option_same_name_type_default(parsers, flag):
    dest, typ, default = SHARED_OPTIONS[flag]
    seen = []
    for name, p in parsers.items():
        for action in _options(p):
            if flag in action.option_strings:
                seen.append(name)
                assert action.dest == dest, f"{name} {flag}: dest {action.dest!r}, expected {dest!r}"
                assert action.type is typ, (
                    f"{name} {flag}: type {action.type!r}, expected cli_common's {typ.__name__!r}"
                )
                if default is not None or flag in ("--threads",):
                    assert action.default == default, f"{name} {flag}: default {action.default!r}, expected {default!r}"
            # The same dest under another flag would be the same thing with two names.
            elif action.dest == dest and not action.option_strings[0].startswith("--no-"):
                pytest.fail(f"{name}: {action.option_strings} sets {dest!r}, which is {flag} everywhere else")
    missing = [name for name in REQUIRED.get(flag, []) if name not in seen]
    assert not missing, f"{flag} missing from {missing}"


def test_no_retired_spellings(parsers):
    for name, p in parsers.items():
        for action in _options(p):
            bad = set(action.option_strings) & set(RETIRED_FLAGS)
            assert not bad, f"{name}: retired flag(s) {sorted(bad)}; use the cli_common names"


def test_every_option_has_help_and_shows_its_default(parsers):
    for name, p in parsers.items():
        assert issubclass(p.formatter_class, argparse.ArgumentDefaultsHelpFormatter), f"{name}: defaults not shown"
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and action.help.strip(), f"{name} {action.option_strings or action.dest}: no help text"
        text = p.format_help()
        assert "(default:" in text or not _options(p), f"{name}: --help shows no default"


def test_help_runs_for_every_command(parsers, capsys):
    for name, p in parsers.items():
        with pytest.raises(SystemExit) as exit_:
            p.parse_args(["--help"])
        assert exit_.value.code == 0, name
        out = capsys.readouterr().out
        assert out.startswith("usage:"), f"{name}: {out[:80]!r}"


def test_preset_help_names_the_stage_it_applies_to(parsers):
    """--preset only where the model size is chosen (stage0, pipeline), never "for stage0" on another stage."""
    for name, p in parsers.items():
        for action in _options(p):
            if "--preset" in action.option_strings:
                assert "stage0" not in action.help or name.endswith("stage0"), f"{name}: {action.help!r}"
    for stage in ("train stage1", "train stage2"):
        assert not any("--preset" in a.option_strings for a in _options(parsers[stage])), stage


def test_device_auto_resolves_and_bad_device_is_a_named_error(capsys):
    import torch

    from kforcing_kernels.app.train import build_parser

    args = build_parser().parse_args(["stage0", "--out", "x"])
    assert args.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert build_parser().parse_args(["stage0", "--out", "x", "--device", "cpu"]).device == "cpu"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["stage0", "--out", "x", "--device", "gpu0"])
    assert "--device" in capsys.readouterr().err


def test_batch_sizes_are_comma_separated_positive_ints(capsys):
    p = cli_common.make_parser("t")
    cli_common.add_batch_sizes(p, [4, 16])
    assert p.parse_args([]).batch_sizes == [4, 16]  # the default goes through the same type
    assert p.parse_args(["--batch-sizes", "2,3,128"]).batch_sizes == [2, 3, 128]
    for bad in ("4,,16", "0,4", "4 16", "a"):
        with pytest.raises(SystemExit):
            p.parse_args(["--batch-sizes", bad])
        assert "--batch-sizes" in capsys.readouterr().err


def test_console_entry_points_resolve():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert {"kforcing-train", "kforcing-generate", "kforcing-evaluate", "kforcing-demo"} <= set(scripts)
    assert "kforcing-bench" not in scripts  # the benchmarks run from a checkout: python -m bench
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name


def test_bench_is_one_cli_with_every_module_reachable():
    """Every bench module with a command line is a command of ``python -m bench`` (one entry style): no module
    of bench/ runs on its own (no ``__main__`` block), and each command's module imports and answers --help."""
    from bench.__main__ import COMMANDS

    bench = os.path.join(ROOT, "bench")
    for folder, _, files in os.walk(bench):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and path != os.path.join(bench, "__main__.py"):
                assert '__name__ == "__main__"' not in open(path).read(), path
    modules = {module for module, _ in COMMANDS.values()}
    for module in modules:
        importlib.import_module(f"bench.{module}")
    for name in ("peers", "gpu", "infer"):
        proc = subprocess.run(
            [sys.executable, "-m", "bench", name, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0 and proc.stdout.startswith(f"usage: python -m bench {name}"), (
            proc.stdout[:300] + proc.stderr[-2000:]
        )


def test_the_wheel_does_not_ship_the_benchmarks():
    text = open(os.path.join(ROOT, "setup.py")).read()
    assert "kforcing_bench" not in text and '"bench"' not in text


def test_bench_sweep_shows_progress_without_verbose(tmp_path, capsys):
    """The attention sweep draws a tqdm bar (count, rate) on stderr with no --verbose."""
    import torch

    from bench.__main__ import main

    threads = torch.get_num_threads()
    try:
        main(
            [
                "attention",
                "--layouts",
                "single",
                "--n",
                "16",
                "--k",
                "1,2",
                "--dims",
                "8",
                "--heads",
                "1",
                "--warmup",
                "0",
                "--reps",
                "1",
                "--max-seconds",
                "0.01",
                "--no-flex",
                "--backends",
                "composite",
                "--threads",
                "1",
                "--no-plots",
                "--device",
                "cpu",
                "--out",
                str(tmp_path),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert re.search(r"attention: 100%.*2/2", err), err[-500:]
    assert "config/s" in err or "s/config" in err


def test_docs_use_current_flag_names():
    for doc in ("README.md", "BENCHMARKS.md", "Makefile"):
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        for flag in RETIRED_FLAGS:
            assert not re.search(re.escape(flag) + r"(?![\w-])", text), f"{doc}: retired flag {flag}"
