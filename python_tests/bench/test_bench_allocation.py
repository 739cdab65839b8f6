"""``python -m bench allocation``: its variant syntax and report (the runs themselves are the demo pipeline's, tested in
test_pipeline)."""

import argparse

import pytest

from bench.training.demo_allocation import format_report, parse_variant


def test_parse_variant():
    from kforcing_kernels.app.demo import DEMO

    assert parse_variant("a=600,200,150,240,distill_batch=16,seed=1") == (
        "a",
        dict(steps_stage0=600, steps_stage1=200, steps_stage2=(150, 240), batch_size_distill=16, seed=1),
    )
    # Without distill_batch a variant distils at the demo's batch, so the demo's steps reproduce the demo.
    demo = DEMO["pipeline"]
    steps = f"{demo.steps_stage0},{demo.steps_stage1},{demo.round_steps()[0]},{demo.round_steps()[1]}"
    assert parse_variant("d=" + steps)[1]["batch_size_distill"] == demo.batch_size_distill
    assert parse_variant("s=0,2,3,4")[1]["steps_stage0"] == 0  # with --shared-stage0


@pytest.mark.parametrize(
    "text",
    [
        "a=1,2,3",
        "=1,2,3,4",
        "a=1,2,3,0",
        "a=1,0,3,4",
        "a=1,2,3,4,lr=2",
        "a=1,2,3,4,seed=x",
        "a=1,2,3,4,distill_batch=0",
        "a",
    ],
)
def test_parse_variant_refuses_what_it_cannot_run(text):
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=S0,S1,K2,K4"):
        parse_variant(text)


def test_duplicate_names_are_refused(capsys):
    from bench.__main__ import parse_command

    with pytest.raises(SystemExit):
        parse_command("allocation", ["--variant", "a=1,2,3,4", "--variant", "a=1,2,3,5"])
    assert "expected distinct names" in capsys.readouterr().err


def test_stage0_steps_zero_needs_a_shared_teacher(tmp_path):
    from bench.training.demo_allocation import run

    args = argparse.Namespace(
        out=str(tmp_path), variant=[parse_variant("a=0,2,3,4")], shared_stage0=None, device="cpu", command=""
    )
    with pytest.raises(SystemExit, match="S0 = 0 only with --shared-stage0"):
        run(args)


def test_report_lists_every_variant_with_its_k4_ratios():
    spec = dict(steps_stage0=600, steps_stage1=200, steps_stage2=(150, 240), batch_size_distill=8, seed=0)
    ok = {
        "spec": spec,
        "train_seconds": 61.0,
        "ppl_over_ar": {"0.5": {"AR": 1.0, "K-Forcing k=4": 3.23}, "0.8": {"AR": 1.0, "K-Forcing k=4": 1.55}},
        "distinct4": {"0.8": {"K-Forcing k=4": 0.792}},
        "judge_ppl": {"0.8": {"AR": 27.76}},
    }
    failed = {"spec": dict(spec, batch_size_distill=None), "status": "failed (exit 1): see x.log"}
    text = format_report({"variants": {"r2": ok, "r9": failed}})
    rows = text.splitlines()[2:]
    assert rows[0] == "| r2 | 600, 200, 150, 240 | 8 | 0 | 61 | 3.23x, 1.55x | 0.792 | 27.76 |"
    assert rows[1].startswith("| r9 | 600, 200, 150, 240 | - | 0 | failed (exit 1)")
