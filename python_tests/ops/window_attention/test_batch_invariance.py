"""bench/gpu/batch_invariance.py: a sequence alone (batch 1, the oracle for the bits) vs the same sequence inside
batches of other sequences, for window_attention (forward and backward) and a teacher's targets. CPU parts
here at small sizes; the triton backend and its configs on CUDA only (issue #24, step 3)."""

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

from bench.gpu import batch_invariance as bi
from bench.gpu import batch_invariance_teacher as bt
from helpers import REPO
from kforcing_kernels import backends_available

ROOT = str(REPO)
CPU_BACKENDS = [name for name in ("cpp", "composite", "reference") if backends_available()[name] is None]
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA device (and compiled, not interpreted, Triton)",
)


def _attention(report, backend, *, n=12, k=3, dims=(16,), batch_sizes=(2, 5), device="cpu", dtype=torch.float32):
    for dim in dims:
        for name, layout in bi.layouts(n, k).items():
            bi.attention_case(
                report,
                backend,
                name,
                layout,
                dim=dim,
                heads=2,
                dtype=dtype,
                device=torch.device(device),
                batch_sizes=list(batch_sizes),
                seed=0,
                config="test",
            )
    return report.data["checks"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_attention_bitwise_alone_vs_inside_batches(backend):
    checks = _attention(bi.Report(None, {}, quiet=True), backend)
    oracle = [c for c in checks if c["check"] == "attention_vs_reference"]
    batched = [c for c in checks if c["check"] == "attention"]
    assert len(oracle) == 2 and len(batched) == 2 * (2 + 3)  # 2 layouts; positions {0, 1} and {0, 2, 4}
    assert all(c["pass"] for c in oracle), [c["err"] for c in oracle if not c["pass"]]
    for c in batched:
        assert c["pass"] and not c["unequal"], c
        assert set(c["max_abs_diff"]) == set(bi.OUTPUTS) and max(c["max_abs_diff"].values()) == 0.0


def test_attention_check_fails_a_batch_variant_kernel_and_a_wrong_invariant_one(monkeypatch):
    real = bi.window_attention

    def batch_variant(q, k, v, layout, **kw):
        out, lse = real(q, k, v, layout, **kw)
        return out + (q.shape[0] > 1) * 1e-6, lse  # a last-bit change that depends on the batch size

    monkeypatch.setattr(bi, "window_attention", batch_variant)
    checks = _attention(bi.Report(None, {}, quiet=True), "composite", batch_sizes=(3,))
    assert all(c["pass"] for c in checks if c["check"] == "attention_vs_reference")  # within tolerance...
    batched = [c for c in checks if c["check"] == "attention"]
    assert batched and all(not c["pass"] and "out" in c["unequal"] for c in batched)  # ...but not invariant

    def wrong(q, k, v, layout, **kw):
        out, lse = real(q, k, v, layout, **kw)
        return out * 1.01, lse  # invariant, but wrong

    monkeypatch.setattr(bi, "window_attention", wrong)
    report = bi.Report(None, {}, quiet=True)
    checks = _attention(report, "composite", batch_sizes=(3,))
    assert all(c["pass"] for c in checks if c["check"] == "attention")
    assert not any(c["pass"] for c in checks if c["check"] == "attention_vs_reference")
    assert report.failures()


def test_teacher_per_sample_mode_is_invariant_and_the_default_mode_repeatable():
    report = bi.Report(None, {}, quiet=True)
    bt.teacher_checks(report, device=torch.device("cpu"), dtype=torch.float32, n=8, k=2, batch_sizes=[3], seed=0)
    checks = report.data["checks"]
    oracle = [c for c in checks if c["check"] == "teacher_vs_reference"]
    assert len(oracle) == 1 and oracle[0]["pass"], oracle  # the batch-1 logits vs a float64 model
    per_sample = [c for c in checks if c.get("mode") == "per_sample"]
    batched = [c for c in checks if c.get("mode") == "batched"]
    assert len(per_sample) == len(batched) == 3  # positions 0, 1, 2
    for c in per_sample:
        assert c["pass"], c
        assert all(t["equal"] for t in c["targets"].values())
    tau_per_row = [c for c in checks if c.get("mode") == "batched_tau_per_row"]
    for c in batched + tau_per_row:  # observations: on CPU the BLAS may pick another kernel for B rows than for one
        assert c["observation"] and c["max_abs_diff"]["single_logits"] < 1e-4, c
        assert c["pass"] or c["first_divergent_module"] is not None
    assert not report.failures()
    summary = report.data["meta"]["teacher_summary"]
    assert summary["per_sample"] == {
        "invariant": True,
        "records": 3,
        "max_logit_diff": 0.0,
        "tokens_differing": 0,
        "first_divergent_modules": {},
    }
    assert summary["batched"]["invariant"] == all(c["pass"] for c in batched)
    assert report.data["meta"]["teacher_throughput"]["per_sample_s"] > 0
    # The default mode is deterministic on CPU: the same batch twice gives the same bits.
    model = bt.teacher_model(torch.device("cpu"), 8, 0)
    inputs = bt.random_inputs(model.config, 3, 8, 2, torch.Generator().manual_seed(3), torch.device("cpu"))
    first, again = (bt.targets(model, *inputs, contextlib.nullcontext) for _ in range(2))
    assert all(torch.equal(first[name], again[name]) for name in first)


def test_first_divergent_module_finds_a_planted_batch_variant_layer():
    model = bt.teacher_model(torch.device("cpu"), 6, 0)
    layer = model.noise_encoder.z_in  # runs before every other matmul of SingleForward
    layer.register_forward_hook(lambda m, i, out: out + 1e-3 * (out.shape[0] > 1))
    gen = torch.Generator().manual_seed(1)
    one = bt.random_inputs(model.config, 1, 6, 2, gen, torch.device("cpu"))
    others = bt.random_inputs(model.config, 2, 6, 2, gen, torch.device("cpu"))
    batched = [torch.cat([o[:1], t, o[1:]]) for o, t in zip(others, one)]
    found = bt.first_divergent_module(model, one, batched, 1, contextlib.nullcontext)
    assert found["module"] == "noise_encoder.z_in" and found["input_equal"], found
    assert found["rows_alone"] == 6 * 2 and found["rows_batched"] == 3 * 6 * 2
    assert abs(found["max_abs_diff"] - 1e-3) < 1e-5


def test_tau_mlp_per_row_computes_the_same_function_and_restores_the_module():
    model = bt.teacher_model(torch.device("cpu"), 6, 0)
    mlp = model.noise_encoder.tau_mlp
    x = torch.randn(5, 1, 1, mlp[0].in_features)
    whole = mlp(x)
    with bt.tau_mlp_per_row(model):
        rows = mlp(x)
        assert torch.equal(rows[2:3], mlp[2](mlp[1](mlp[0](x[2:3]))))  # row 2 computed alone
    assert rows.shape == whole.shape and torch.allclose(rows, whole, atol=1e-6)
    assert "forward" not in vars(mlp) and torch.equal(mlp(x), whole)


def test_forced_config_runs_the_chosen_entry_and_restores_everything(monkeypatch):
    pytest.importorskip("triton")
    launch = bi.triton_launch()
    monkeypatch.setenv(bi.AUTOTUNE_ENV, "1")
    table = launch.KERNEL_CONFIGS["fwd"]
    before = {key: list(value) for key, value in table.items()}
    launch._tuned[("sentinel",)] = object()
    wanted = before[("base", 64)][2]
    with bi.forced_config("fwd", "base", 64, 2) as chosen:
        assert chosen == wanted and os.environ[bi.AUTOTUNE_ENV] == "0" and not launch._tuned
        tuner = launch._tuned_kernel("fwd", ("base", 64, 1024, "slot-causal"))  # what a launch would build now
        assert [(c.num_warps, c.num_stages) for c in tuner.configs] == [wanted]
    assert {key: list(value) for key, value in table.items()} == before
    assert os.environ[bi.AUTOTUNE_ENV] == "1" and not launch._tuned
    with pytest.raises(ValueError, match="index"):
        with bi.forced_config("fwd", "base", 64, len(before[("base", 64)])):
            pass


def test_command_line_writes_the_json_and_is_a_bench_command(tmp_path, capsys):
    from bench.__main__ import main as bench_main

    out = tmp_path / "inv.json"
    argv = [
        "--device",
        "cpu",
        "--backend",
        "composite",
        "--checks",
        "attention",
        "configs",
        "--n",
        "6",
        "--k",
        "2",
        "--dims",
        "16",
        "--batch-sizes",
        "2",
        "--json",
        str(out),
        "--quiet",
    ]
    assert bench_main(["batch-invariance", *argv]) == 0
    report = json.loads(out.read_text())
    assert report["complete"] and report["meta"]["backend"] == "composite" and report["meta"]["device"] == "cpu"
    assert "torch" in report["meta"]["versions"] and "configs_skipped" in report["meta"]
    assert report["summary"] == {"attention_vs_reference": {"pass": 2, "fail": 0}, "attention": {"pass": 4, "fail": 0}}
    assert "0 failing" in capsys.readouterr().out


def test_gpu_check_runs_the_step_with_arguments_the_bench_accepts(tmp_path):
    from bench.__main__ import parse_command
    from bench.gpu import check

    (step,) = [s for s in check.STEPS if s.command == "batch-invariance"]
    assert step.call == 1
    args = parse_command("batch-invariance", check.expand(step.argv, str(tmp_path))[3:])
    assert args.json == str(tmp_path / "batch_invariance.json")
    # N=8192: where the dispatch table may pick flex at D=128 (issue 53), so its invariance is checked there.
    assert args.n == 8192 and sorted(args.dims) == [64, 128]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="starts its own interpreter process")
def test_config_sweep_runs_end_to_end_through_the_triton_interpreter(tmp_path):
    """The configs check on CPU: the triton backend in Triton's interpreter, fp32. The interpreter runs one
    fixed config whatever is forced, so this holds the sweep's machinery (the launches it records, the config
    lists it walks, the forced runs) and the kernels' invariance there, not the configs themselves."""
    pytest.importorskip("triton")
    out = tmp_path / "interp.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("KFORCING_BACKEND", None)
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "batch-invariance",
        "--device",
        "cpu",
        "--backend",
        "triton",
        "--checks",
        "configs",
        "--layouts",
        "single",
        "--n",
        "4",
        "--k",
        "2",
        "--dims",
        "32",
        "--heads",
        "1",
        "--batch-sizes",
        "2",
        "--json",
        str(out),
        "--quiet",
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads(out.read_text())
    assert (
        report["complete"] and "configs_note" in report["meta"] and not [c for c in report["checks"] if not c["pass"]]
    )
    from kforcing_kernels.ops.window_attention.triton.configs import KERNEL_CONFIGS

    # fwd, delta and bwd launch (the fused kernels); one run with every first entry, one per other entry
    others = sum(len(KERNEL_CONFIGS[name][("base", 32)]) - 1 for name in ("fwd", "delta", "bwd"))
    runs = {c["config"] for c in report["checks"]}
    assert len(runs) == 1 + others, runs
    assert len(report["checks"]) == (1 + others) * (1 + 2)  # the oracle check and positions 0, 1 of batch 2


@needs_gpu
def test_triton_bitwise_alone_vs_batched_under_every_config():
    """(a) the dispatcher's default (autotuned) and (b) every config of every launched kernel, forced in turn.
    N=512, k=4: 2560 query rows, so D=128 takes the wide tile set on sm_90 and D=64 the hopper one."""
    import argparse

    report = bi.Report(None, {}, quiet=True)
    args = argparse.Namespace(
        n=512, k=4, dims=[64, 128], heads=2, batch_sizes=[2, 4], seed=0, device=torch.device("cuda")
    )
    bi.attention_checks(report, args, "triton", torch.bfloat16)
    bi.config_checks(report, args, torch.bfloat16)
    checks = report.data["checks"]
    assert not report.failures(), [bi.describe(c) for c in report.failures()][:5]
    forced = {(c["forced"]["kernel"], c["forced"]["index"]) for c in checks if "forced" in c}
    assert any(kernel == "fwd" for kernel, _ in forced), forced  # every fwd list has more than one entry
