"""The judge line of the evaluation report names the judge and how it was trained, never "None steps"."""

from kforcing_kernels.app.evaluation.report import judge_description


def test_a_pretrained_teacher_is_called_pretrained(tmp_path):
    folder = tmp_path / "qwen"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen2"}')  # a plain Hugging Face folder: no model.json
    for given in (False, True):
        text = judge_description(folder, {"k": 0, "tensors": {}}, given=given)
        assert "pretrained" in text and str(folder) in text
        assert "None" not in text and "steps" not in text
    assert judge_description(folder, {}, given=False).startswith("the run's AR teacher, the pretrained --model model")


def test_a_trained_teacher_says_its_steps(tmp_path):
    info = {"k": 0, "train_config": {"steps": 600}}
    assert judge_description(tmp_path, info, given=False) == f"the run's Stage-0 AR teacher ({tmp_path}, 600 steps)"
    assert judge_description(tmp_path, info, given=True) == f"a separately trained AR model ({tmp_path}, 600 steps)"
    unrecorded = judge_description(tmp_path, {"k": 0}, given=False)  # no train_config: the steps are not known
    assert unrecorded == f"the run's Stage-0 AR teacher ({tmp_path})"
