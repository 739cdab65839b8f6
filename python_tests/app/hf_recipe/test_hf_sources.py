"""Issue 38 section 3, "the files": what a run takes from a ``--model`` folder and what it does with bad model sources.

* A finished stage is reused only while the ``--model`` folder is the teacher it was trained on: its weights, and also
  its ``config.json`` (``rope_theta`` changes the model) and tokenizer files (other merges, same size and eos, change
  the token ids); the rerun is refused naming ``model`` instead of skipping the stages.
* Bad model sources (a ``--model-config`` JSON without ``model_type``, not an object, sizes transformers rejects; a
  ``--model`` folder with a corrupt ``config.json`` or no tokenizer) are usage errors naming the option, before any
  stage folder is made.
* A run records its teacher as a resolved path: ``evaluate`` finds it from any directory, and a teacher that moved is
  named in an HF folder's terms (no ``model.json``).

Tiny random Qwen2 folders built in the test (no hub), the json package's source as text.
"""

import json
import os
import shutil

import pytest
import torch

from helpers import REPO

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from helpers.train_helpers import write_json_package  # noqa: E402
from kforcing_kernels.app import train as train_cli  # noqa: E402
from kforcing_kernels.app.data import EOS, load_corpus  # noqa: E402
from kforcing_kernels.app.evaluation.evaluate import evaluate_pipeline  # noqa: E402
from kforcing_kernels.app.evaluation.run_folders import ar_teacher_folder  # noqa: E402

VOCAB = 300
SMALL = [
    "--seq-len",
    "16",
    "--batch-size",
    "4",
    "--steps-stage1",
    "1",
    "--steps-stage2",
    "1",
    "--warmup-steps",
    "1",
    "--eval-batches",
    "1",
    "--k-final",
    "2",
    "--threads",
    "1",
    "--no-progress",
    "--device",
    "cpu",
]


def tiny_qwen2(vocab: int = VOCAB, **overrides):
    sizes = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return transformers.Qwen2Config(vocab_size=vocab, **{**sizes, **overrides})


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_sources")
    write_json_package(root / "corpus")
    (root / "other").mkdir()
    for path in sorted((root / "corpus").glob("*.py"))[:3]:  # another text: another BPE of the same size
        (root / "other" / path.name).write_text(path.read_text()[::-1])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KFORCING_CACHE", str(root / "cache"))
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=load_corpus(str(root / "corpus"), vocab_size=VOCAB).tokenizer, eos_token=EOS
        )
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(tiny_qwen2()).save_pretrained(root / "qwen2")
        tokenizer.save_pretrained(root / "qwen2")
        yield root


def pipeline(root, out, model, *extra):
    train_cli.main(
        ["pipeline", "--out", str(out), "--data", str(root / "corpus"), "--model", str(model), *SMALL, *extra]
    )


@pytest.fixture(scope="module")
def trained(root):
    """A finished two-stage run (stage1, stage2_k2) on a copy of the Qwen2 folder, which the tests then change."""
    teacher = root / "teacher"
    shutil.copytree(root / "qwen2", teacher)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KFORCING_CACHE", str(root / "cache"))
        pipeline(root, root / "run", teacher)
    return teacher


def usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit):
        train_cli.main(argv)
    return capsys.readouterr().err


@pytest.fixture
def fresh_run(root, trained, tmp_path, monkeypatch):
    """The finished run and its teacher folder, which the test may change: restored afterwards."""
    monkeypatch.setenv("KFORCING_CACHE", str(root / "cache"))
    info = json.loads((root / "run" / "stage1" / "model.json").read_text())
    assert info["teacher"] == str(trained.resolve())  # recorded resolved
    shutil.copytree(trained, tmp_path / "backup")
    yield trained, root / "run"
    shutil.rmtree(trained, ignore_errors=True)
    shutil.copytree(tmp_path / "backup", trained)


def test_an_unchanged_model_folder_reuses_the_finished_stages(root, fresh_run, capsys):
    teacher, out = fresh_run
    pipeline(root, out, teacher)
    err = capsys.readouterr().err
    assert f"{out / 'stage1'} is done; skipping" in err and f"{out / 'stage2_k2'} is done; skipping" in err


def test_a_stage_saved_before_config_and_tokenizer_were_recorded_is_reused_with_a_warning(root, fresh_run, capsys):
    from kforcing_kernels.app.hf_recipe.files import hf_weights_sha256

    teacher, out = fresh_run
    path = out / "stage1" / "model.json"
    saved = path.read_text()
    try:
        # the old record
        path.write_text(json.dumps({**json.loads(saved), "teacher_sha256": hf_weights_sha256(teacher)}))
        pipeline(root, out, teacher)
        err = capsys.readouterr().err
        assert "saved before the --model folder's config.json and tokenizer files were recorded" in err
        assert f"{out / 'stage1'} is done; skipping" in err
        config = json.loads((teacher / "config.json").read_text())
        (teacher / "config.json").write_text(json.dumps({**config, "rope_theta": 500.0}))
        pipeline(root, out, teacher)  # not checkable for such a stage: the warning says so
        assert "did not change" in capsys.readouterr().err
        (teacher / "model.safetensors").write_bytes((teacher / "model.safetensors").read_bytes()[:-4] + b"\0\0\0\1")
        err = usage_error(
            capsys, ["pipeline", "--out", str(out), "--data", str(root / "corpus"), "--model", str(teacher), *SMALL]
        )
        assert "stage1, but the --model folder" in err  # other weights are refused as before
    finally:
        path.write_text(saved)


def test_a_changed_config_json_is_another_teacher(root, fresh_run, capsys):
    teacher, out = fresh_run
    config = json.loads((teacher / "config.json").read_text())
    config["rope_theta"] = 500.0  # the same weights, another model
    (teacher / "config.json").write_text(json.dumps(config))
    err = usage_error(
        capsys, ["pipeline", "--out", str(out), "--data", str(root / "corpus"), "--model", str(teacher), *SMALL]
    )
    assert "model: " in err and "stage1, but the --model folder" in err and "config.json or tokenizer files" in err
    assert "is done; skipping" not in err


def test_a_replaced_tokenizer_is_another_teacher(root, fresh_run, capsys):
    teacher, out = fresh_run
    other = load_corpus(str(root / "other"), vocab_size=VOCAB).tokenizer
    assert other.get_vocab_size() == VOCAB and other.to_str() != (teacher / "tokenizer.json").read_text()
    # same size and eos
    transformers.PreTrainedTokenizerFast(tokenizer_object=other, eos_token=EOS).save_pretrained(teacher)
    err = usage_error(
        capsys, ["pipeline", "--out", str(out), "--data", str(root / "corpus"), "--model", str(teacher), *SMALL]
    )
    assert "model: " in err and "stage1, but the --model folder" in err
    assert "is done; skipping" not in err


def test_the_run_finds_its_teacher_from_any_directory(root, trained, tmp_path, monkeypatch):
    monkeypatch.setenv("KFORCING_CACHE", str(root / "cache"))
    # Trained with a relative --model, evaluated from another directory.
    monkeypatch.chdir(root)
    pipeline(root, tmp_path / "run", "qwen2")
    monkeypatch.chdir(tmp_path)
    assert ar_teacher_folder(tmp_path / "run") == (root / "qwen2").resolve()
    summary = evaluate_pipeline(
        tmp_path / "run",
        batch_sizes=[1],
        ks=[1, 2],
        new_tokens=2,
        taus=[],
        reps=3,
        nll_batches=1,
        nll_batch_size=2,
        prompt_len=4,
        log=lambda line: None,
    )
    assert [row["k"] for row in summary["per_position_nll"]] == [0, 1, 2]
    # Timings (section 2): every method's runs and their spread, and transformers' generate beside the package's AR.
    assert set(summary["timing"]) == {"AR", "K-Forcing k=1", "K-Forcing k=2", "HF generate (sdpa)"}
    for per_batch in summary["timing"].values():
        t = per_batch["1"]
        assert t["runs"] == 3 and 0 < t["min_s"] <= t["median_s"] <= t["max_s"]
        assert t["spread"] == pytest.approx((t["max_s"] - t["min_s"]) / t["median_s"])
    assert summary["hf_generate"]["1"] > 0 and "HF generate (sdpa)" not in summary["throughput"]
    for name, row in summary["speedup_vs_hf_generate"].items():
        assert row["1"] == pytest.approx(summary["throughput"][name]["1"] / summary["hf_generate"]["1"])


def test_quick_evaluation_times_enough_tokens_and_runs():
    from kforcing_kernels.app.evaluation.evaluate import QUICK_EVAL

    assert QUICK_EVAL.new_tokens >= 32 and QUICK_EVAL.reps >= 5


def test_hf_generate_of_the_timing_samples_every_token(root):
    from kforcing_kernels.app.evaluation.evaluate import _hf_generate

    model = transformers.AutoModelForCausalLM.from_pretrained(root / "qwen2", attn_implementation="sdpa").eval()
    prompts = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(0))
    out = _hf_generate(model, prompts, 12, 1.0, eos_id=0)
    assert out.shape == (2, 16) and torch.equal(out[:, :4], prompts)  # no early stop at eos: the timed work is fixed


def test_a_moved_teacher_is_named_without_model_json(fresh_run):
    teacher, out = fresh_run
    shutil.rmtree(teacher)
    with pytest.raises(ValueError, match="AR teacher .* not here") as caught:
        ar_teacher_folder(out)
    assert str(teacher) in str(caught.value) and "holding model.json" not in str(caught.value)


def _qwen2_json(**changes):
    """tiny_qwen2's config as JSON with ``changes`` written over it (sizes transformers' own constructor may refuse)."""
    return json.dumps({**tiny_qwen2().to_dict(), **changes})


def _write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda d: _write(
                d / "c.json", json.dumps({k: v for k, v in tiny_qwen2().to_dict().items() if k != "model_type"})
            ),
            'model_config: .* has no "model_type"',
        ),
        (lambda d: _write(d / "c.json", "[1, 2]"), "model_config: .* holds a JSON list, expected an object"),
        (
            lambda d: _write(d / "c.json", tiny_qwen2(hidden_size=-8).to_json_string()),
            "model_config: transformers rejects",
        ),
        (
            lambda d: _write(d / "c.json", tiny_qwen2(num_attention_heads=0).to_json_string()),
            "model_config: transformers rejects",
        ),
        # The class of issue 46: whatever transformers raises (its strict-dataclass validators, a model that builds but
        # cannot
        # run its first forward: an odd head dim RoPE cannot rotate, kv heads that do not divide the heads) is a usage
        # error.
        (lambda d: _write(d / "c.json", _qwen2_json(hidden_size=30)), "model_config: transformers rejects"),
        (lambda d: _write(d / "c.json", _qwen2_json(hidden_size=32.5)), "model_config: transformers rejects"),
        (
            lambda d: _write(d / "c.json", _qwen2_json(hidden_size=12, num_attention_heads=4, num_key_value_heads=4)),
            "model_config: transformers rejects",
        ),
        (lambda d: _write(d / "c.json", _qwen2_json(num_key_value_heads=3)), "model_config: transformers rejects"),
        # Reals that make every logit NaN: refused by name before any step, not a "non-finite loss" at step 1.
        (
            lambda d: _write(d / "c.json", _qwen2_json(rms_norm_eps=float("nan"))),
            "model_config: .*rms_norm_eps: expected a finite",
        ),
        (
            lambda d: _write(d / "c.json", _qwen2_json(rms_norm_eps=0.0)),
            "model_config: .*rms_norm_eps: expected a positive",
        ),
        (
            lambda d: _write(d / "c.json", _qwen2_json(rope_theta=-10.0)),
            "model_config: .*rope_theta: expected a positive",
        ),
    ],
)
def test_bad_model_configs_are_usage_errors(root, tmp_path, capsys, monkeypatch, make, message):
    import re

    monkeypatch.setenv("KFORCING_CACHE", str(root / "cache"))
    path = make(tmp_path)
    for command in ("pipeline", "stage0"):
        err = usage_error(
            capsys,
            [
                command,
                "--out",
                str(tmp_path / "out"),
                "--data",
                str(root / "corpus"),
                "--model-config",
                str(path),
                "--vocab-size",
                str(VOCAB),
                "--steps",
                "1",
                "--threads",
                "1",
                "--no-progress",
                "--device",
                "cpu",
            ]
            if command == "stage0"
            else [
                "pipeline",
                "--out",
                str(tmp_path / "out"),
                "--data",
                str(root / "corpus"),
                "--model-config",
                str(path),
                "--vocab-size",
                str(VOCAB),
                "--steps-stage0",
                "1",
                *SMALL,
            ],
        )
        assert "Traceback" not in err and re.search(message, err) and "(--model-config)" in err, err
        assert not (tmp_path / "out" / "stage0").exists() and not (tmp_path / "out" / "model.json").exists()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: _write(d / "config.json", '{"model_type": "qwen2", '), "config.json is not valid JSON"),
        (lambda d: _write(d / "config.json", "[1]"), "config.json is not a transformers config"),
        (lambda d: [p.unlink() for p in d.glob("tokenizer*")], "has no tokenizer files"),
    ],
)
def test_bad_model_folders_are_usage_errors(root, tmp_path, capsys, monkeypatch, damage, message):
    monkeypatch.setenv("KFORCING_CACHE", str(root / "cache"))
    folder = tmp_path / "model"
    shutil.copytree(root / "qwen2", folder)
    damage(folder)
    for command in ("pipeline", "stage1"):
        argv = [command, "--out", str(tmp_path / "out"), "--data", str(root / "corpus"), "--model", str(folder)]
        argv += (
            SMALL if command == "pipeline" else ["--steps", "1", "--threads", "1", "--no-progress", "--device", "cpu"]
        )
        err = usage_error(capsys, argv)
        assert "Traceback" not in err and "error: model: " in err and message in err and "(--model)" in err, err
        assert not (tmp_path / "out" / "stage1").exists() and not (tmp_path / "out" / "model.json").exists()


# ---------------------------------------------------------------------- the smaller items of section 3


def test_vocab_size_with_model_is_refused_not_ignored(root, tmp_path, capsys):
    err = usage_error(
        capsys,
        [
            "pipeline",
            "--out",
            str(tmp_path / "out"),
            "--data",
            str(root / "corpus"),
            "--model",
            str(root / "qwen2"),
            "--vocab-size",
            "512",
            *SMALL,
        ],
    )
    assert "argument --vocab-size: --model brings its own tokenizer" in err and not (tmp_path / "out").exists()


def test_ctrl_c_ends_in_one_line_not_a_traceback(root, tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_cli, "run_pipeline", interrupted)
    with pytest.raises(SystemExit) as exit_:
        pipeline(root, tmp_path / "out", root / "qwen2")
    err = capsys.readouterr().err
    assert exit_.value.code == 130 and "interrupted" in err and "--resume" in err and "Traceback" not in err


def test_the_pipeline_prints_where_the_evaluation_is_not_all_of_it(root, trained, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KFORCING_CACHE", str(root / "cache"))
    out = tmp_path / "run"
    shutil.copytree(root / "run", out)
    monkeypatch.setattr(train_cli, "_evaluate", lambda out, which, device: {"per_position_nll": [{"k": 0}] * 200})
    pipeline(root, out, trained, "--evaluate", "quick")
    printed = json.loads(capsys.readouterr().out)
    assert set(printed) == {"training", "evaluation"} and "summary.json" in printed["evaluation"]


def test_the_exporters_usage_names_a_command_that_exists(capsys):

    import tomllib

    from kforcing_kernels.app.training import sharded_checkpoint

    with pytest.raises(SystemExit):
        sharded_checkpoint.main(["--help"])
    usage = capsys.readouterr().out.splitlines()[0]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    command = usage.split("usage: ", 1)[1].split(" [")[0]
    assert command in scripts or command == "python -m kforcing_kernels.app.training.sharded_checkpoint", usage
