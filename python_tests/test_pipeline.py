"""End to end with a micro config: Stage 0 -> 1 -> 2 (k=2) -> 2 (k=4), evaluation, tables, plot."""

import json
from pathlib import Path

import pytest
import torch

from kforcing_kernels.evaluate import evaluate_pipeline, format_nll_table, format_table1, plot_summary, teacher_score
from kforcing_kernels.inference import generate_kforcing
from kforcing_kernels.pipeline import PipelineConfig, run_pipeline
from kforcing_kernels.checkpoint import load_model, read_metrics
from kforcing_kernels.train import TrainConfig


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    corpus = root / "corpus"
    corpus.mkdir()
    for path in sorted(Path(json.__file__).parent.glob("*.py")):
        (corpus / path.name).write_text(path.read_text())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KFORCING_CACHE", str(root / "cache"))
        base = TrainConfig(data=str(corpus), vocab_size=300, preset="micro", seq_len=16, batch_size=4, warmup_steps=2,
                           log_every=1, eval_batches=1, progress=False)
        pipe = PipelineConfig(out=str(root / "run"), k_final=4, steps_stage0=8, steps_stage1=4, steps_stage2=4)
        summaries = run_pipeline(pipe, base)
        summary = evaluate_pipeline(root / "run", batch_sizes=(2, 3), prompt_len=4, new_tokens=6, reps=1,
                                    nll_batches=1, nll_batch_size=2, log=lambda s: None)
        yield root / "run", summaries, summary


def test_every_stage_is_trained_and_chained(run):
    folder, summaries, _ = run
    assert list(summaries) == ["stage0", "stage1", "stage2_k2", "stage2_k4"]
    ks = []
    for name in summaries:
        model, info, _ = load_model(str(folder / name))
        ks.append(info["k"])
        losses = [m["loss"] for m in read_metrics(folder / name / "metrics.jsonl") if "loss" in m]
        assert all(torch.isfinite(torch.tensor(losses)))
        if name != "stage0":
            assert Path(info["teacher"]).name == {"stage1": "stage0", "stage2_k2": "stage1", "stage2_k4": "stage2_k2"}[name]
    assert ks == [0, 1, 2, 4]
    # The final PFLM decodes any k <= k_train.
    model, _, _ = load_model(str(folder / "stage2_k4"))
    for k in (1, 2, 3, 4):
        assert generate_kforcing(model, [[1, 2, 3]], k, 5).shape == (1, 5)


def test_rerunning_the_pipeline_skips_finished_stages(run, capsys):
    folder, summaries, _ = run
    again = run_pipeline(PipelineConfig(out=str(folder), k_final=4), TrainConfig())
    assert again == summaries
    assert capsys.readouterr().err.count("skipping") == 4


def test_evaluation_tables_and_plot(run, tmp_path):
    _, _, summary = run
    assert set(summary["throughput"]) == {"AR", "K-Forcing k=1", "K-Forcing k=2", "K-Forcing k=4"}
    assert all(v > 0 for row in summary["throughput"].values() for v in row.values())
    assert all(summary["speedup"]["AR"][b] == 1.0 for b in ("2", "3"))
    rows = summary["per_position_nll"]
    assert [r["k"] for r in rows] == [0, 1, 2, 4] and len(rows[-1]["nll"]) == 4
    table1, table2 = format_table1(summary), format_nll_table(summary)
    assert "K-Forcing k=4" in table1 and "teacher PPL" in table1 and "data (held-out text)" in table1
    assert "NLL j=4" in table2 and "PFLM(k=4)" in table2
    assert plot_summary(summary, tmp_path / "plot.png") is None
    assert (tmp_path / "plot.png").stat().st_size > 1000


def test_teacher_score_cuts_at_the_first_eos(run):
    folder, _, _ = run
    teacher, _, _ = load_model(str(folder / "stage0"))
    prompts = torch.tensor([[5, 6, 7]])
    full = teacher_score(teacher, prompts, torch.tensor([[8, 9, 0, 10, 11]]))
    cut = teacher_score(teacher, prompts, torch.tensor([[8, 9, 0, 10, 11]]), eos_id=0)
    assert full["tokens"] == 5 and cut["tokens"] == 3
    with torch.no_grad():
        logp = torch.log_softmax(teacher(torch.tensor([[5, 6, 7, 8, 9]])), -1)[0]
    expected = -(logp[2, 8] + logp[3, 9] + logp[4, 0]) / 3
    assert cut["nll"] == pytest.approx(float(expected), rel=1e-5)


def test_inference_cli(run, capsys):
    from kforcing_kernels.inference import main

    folder, _, _ = run
    main([str(folder / "stage2_k4"), "--prompt", "def f(x):", "--prompt", "import", "--k", "2", "--new-tokens", "5"])
    out = capsys.readouterr().out
    assert out.count("-" * 40) == 2 and out.startswith("def f(x):")
    with pytest.raises(SystemExit):
        main([str(folder / "stage2_k4"), "--prompt", "x", "--k", "8"])
    assert "--k: expected 1 <= k <= k_train=4" in capsys.readouterr().err
