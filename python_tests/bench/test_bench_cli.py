"""``python -m bench`` command line: every command answers --help, validate reports bad paths clearly."""

import os
import subprocess
import sys

import pytest

from helpers import REPO

ROOT = str(REPO)


def _bench(*args, entry=("-m", "bench")):
    return subprocess.run([sys.executable, *entry, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_validate_help():
    proc = _bench("validate", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout and "REPORT.json" in proc.stdout


def test_validate_missing_and_broken_files_are_clear_errors(tmp_path):
    proc = _bench("validate", str(tmp_path / "missing.json"))
    assert proc.returncode == 2 and "REPORT.json: no such file" in proc.stderr and "Traceback" not in proc.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    proc = _bench("validate", str(bad))
    assert proc.returncode == 2 and "cannot read" in proc.stderr and "Traceback" not in proc.stderr
    proc = _bench("validate")
    assert proc.returncode == 2 and "usage:" in proc.stderr


def test_validate_a_real_report():
    report = os.path.join(ROOT, "bench", "results", "cpu-n1024-quiet", "attention.json")
    if not os.path.exists(report):
        pytest.skip("no stored report")
    proc = _bench("validate", report)
    assert proc.returncode == 0 and "valid" in proc.stdout, proc.stdout + proc.stderr


# ---------------------------------------------------------------------- one command style

# A command whose module may still own its parser (``main(argv)``), with the reason; bench/__main__.py's OWN_PARSER.
OWN_PARSER_ALLOWED = {
    "vllm": "bench/inference/vllm_serving.py belongs to the vLLM integration's owner this round (issue 55)",
}


def _module_functions(module: str) -> dict[str, object]:
    import ast

    path = os.path.join(ROOT, "bench", *module.split(".")) + ".py"
    tree = ast.parse(open(path).read(), path)
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_every_bench_command_has_the_one_style():
    """Every command module gives ``add_arguments(p)`` and ``execute(args)`` (optionally ``finish_args(p, args,
    argv, prog)``) to the dispatcher, and builds no parser or entry of its own (no ``main`` / ``parse_args`` /
    ``build_parser`` / ``make_parser`` function): one way to add a command, one parser per command."""
    from bench.__main__ import COMMANDS, OWN_PARSER

    assert set(OWN_PARSER) == set(OWN_PARSER_ALLOWED)
    for name, (module, _) in COMMANDS.items():
        functions = _module_functions(module)
        if name in OWN_PARSER:
            assert "main" in functions and "add_arguments" not in functions, name
            continue
        own = sorted(set(functions) & {"main", "parse_args", "build_parser", "make_parser"})
        assert own == [], f"{name} (bench/{module}): {own}"
        assert {"add_arguments", "execute"} <= set(functions), f"{name} (bench/{module})"
        assert [len(functions[f].args.args) for f in ("add_arguments", "execute")] == [1, 1], name
        if "finish_args" in functions:
            assert len(functions["finish_args"].args.args) == 4, name
        text = open(os.path.join(ROOT, "bench", *module.split(".")) + ".py").read()
        assert "ArgumentParser(" not in text, f"{name} (bench/{module}) builds a parser of its own"


def test_a_command_parses_alike_alone_and_under_the_dispatcher():
    """command_parser / parse_command (what tests and the GPU check use in-process) give the options of the
    dispatcher's subcommand, finish_args included, and a usage error exits 2 as on the command line."""
    from bench.__main__ import COMMANDS, OWN_PARSER, build_parser, command_parser, parse_command

    top = build_parser()
    (sub,) = [a for a in top._actions if a.dest == "bench_command"]  # argparse keeps subparsers only there
    for name in COMMANDS:
        if name in OWN_PARSER:
            with pytest.raises(ValueError, match="^name: "):
                command_parser(name)
            continue
        alone, under = command_parser(name), sub.choices[name]
        assert alone.prog == under.prog == f"python -m bench {name}"
        assert alone.format_help() == under.format_help(), name
    argv = ["--layouts", "single", "--n", "16", "--k", "2", "--device", "cpu", "--out", "x"]
    args = parse_command("attention", argv)
    assert args.layouts == ["single"] and args.n == [16]  # finish_args ran: the lists are parsed
    assert args.command == "python -m bench attention " + " ".join(argv)
    with pytest.raises(SystemExit) as exit_info:
        parse_command("attention", ["--layouts", "nosuch", "--device", "cpu"])
    assert exit_info.value.code == 2


def test_a_cpu_benchmarks_own_thread_count_stands_when_threads_is_not_given():
    """--threads defaults to None everywhere (the shared option); cpu-kernels, cpp-ab and sliding-window still run
    with 2 threads when it is not given (their BENCHMARKS.md / README numbers), cp-throughput with all cores, and
    a given count wins."""
    from bench.__main__ import parse_command

    for name in ("cpu-kernels", "cpp-ab", "sliding-window"):
        assert parse_command(name, []).threads == 2, name
        assert parse_command(name, ["--threads", "1"]).threads == 1, name
    cores = os.cpu_count()
    if cores % 2 == 0:  # the default --worlds 2 must divide the cores
        assert parse_command("cp-throughput", []).threads == cores
    assert parse_command("cp-throughput", ["--threads", "4", "--worlds", "2", "4"]).threads == 4
    for name, argv in (
        ("cpu-kernels", ["--threads", "0"]),
        ("cpp-ab", ["--layouts", "single,triple"]),
        ("cp-throughput", ["--threads", "4", "--steps", "1"]),
        ("gpu", ["--n", "0"]),
        ("profile", ["--batch-size", "0"]),
    ):
        with pytest.raises(SystemExit) as exit_info:
            parse_command(name, argv)
        assert exit_info.value.code == 2, (name, argv)
    assert parse_command("cpp-ab", ["--layouts", "double"]).layouts == ["double"]


def test_bench_gpu_refuses_to_time_on_a_cpu_device_when_cuda_is_there(monkeypatch, capsys):
    """bench gpu's --device is the shared one (auto), but its timing is CUDA only: --device cpu on a machine with
    CUDA is a named error before anything runs; without CUDA the sweep says so and measures nothing."""
    import torch

    from bench.__main__ import parse_command
    from bench.gpu import triton_gpu

    args = parse_command("gpu", ["--device", "cpu", "--n", "64", "--k", "2", "--dim", "32"])
    assert (args.device, args.batch_size) == ("cpu", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert triton_gpu.execute(args) == 0
    assert "no CUDA device here; nothing was measured" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit, match="^--device cpu: bench gpu times on CUDA only"):
        triton_gpu.execute(args)
