"""A pipeline run's folders as the evaluation reads them: its AR teacher, the text it was trained on, the judge.

:func:`~kforcing_kernels.app.evaluation.evaluate.evaluate_pipeline` resolves a run with these: which folder holds
the AR teacher (``stage0``, or stage1's recorded teacher for a run that K-Forces a pretrained Hugging Face model),
where the recorded ``--data`` is from here, and which AR model scores the generated text.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from ..data import DEFAULT_SOURCE
from ..files import tokenizer_sha256
from ..records import read_model_json
from ..student import Student, find_kind, load_student
from .report import judge_description


def same_tokenizer(a, b) -> Optional[bool]:
    """Whether two tokenizers map text to the same ids; None when either is missing (a model saved without one)."""
    if a is None or b is None:
        return None
    return tokenizer_sha256(a) == tokenizer_sha256(b)


def recorded_data(folder: Path, info: dict) -> Optional[str]:
    """The --data a stage in ``folder`` was trained on (``info``: its model.json), as a path that works from here.

    Runs record it resolved; a run saved before that recorded it as typed, relative to the directory it was started
    in. That directory is the stage folder less its recorded ``out`` (typed relative the same way), tried first;
    then this working directory. When neither holds it, a ValueError says where it was looked for and what to do.
    """
    data = info.get("data")
    if data in (None, DEFAULT_SOURCE) or Path(data).is_absolute():
        return data
    tried = []
    out = info.get("train_config", {}).get("out")
    if out and not Path(out).is_absolute():
        here, parts = folder.resolve().parts, Path(os.path.normpath(out)).parts
        if ".." not in parts and here[-len(parts) :] == parts:
            tried.append(Path(*here[: -len(parts)]) / data)  # the directory the stage was trained in
    tried.append(Path.cwd() / data)
    for path in tried:
        if path.exists():
            return str(path)
    where = " nor at ".join(repr(str(p)) for p in tried)
    raise ValueError(
        f"run: {folder} was trained on the text at {data!r} (a path its model.json records relative to "
        f"the directory the run was started in), which is not at {where}; run kforcing-evaluate from the "
        "directory the run was trained in, or put the text back there"
    )


def ar_teacher_folder(run: Path) -> Path:
    """The run's AR teacher: its stage0, or (a pipeline K-Forcing a pretrained Hugging Face model) stage1's teacher."""
    if (run / "stage0" / "model.json").exists() or not (run / "stage1" / "model.json").exists():
        return run / "stage0"
    teacher = read_model_json(run / "stage1").get("teacher")
    if teacher is None:
        return run / "stage0"
    if find_kind(teacher) is None:  # say what is missing in an HF folder's terms too
        raise ValueError(
            f"run: its AR teacher {teacher!r} (stage1's teacher, recorded in "
            f"{run / 'stage1' / 'model.json'}) is not here (no Hugging Face config.json, no stage model): "
            "it was moved or deleted, or the run was trained before teachers were recorded as absolute "
            "paths (then evaluate it from the directory it was trained in)"
        )
    return Path(teacher)


def load_judge(run: Path, judge: Union[str, Path, Student, None], device: str, tokenizer=None) -> tuple[Student, str]:
    """(the judge model in eval mode, its description): ``judge`` None -> the run's Stage-0 teacher.

    ``tokenizer``: the run's; a judge folder whose tokenizer differs is refused (it would score other text).
    """
    if judge is not None and not isinstance(judge, (str, Path)):  # a model
        return judge.eval(), "a model given by the caller"
    folder = Path(judge) if judge is not None else ar_teacher_folder(run)
    if find_kind(folder) is None:
        raise ValueError(
            "judge: expected an AR stage folder holding model.json (or a Hugging Face model folder), got "
            f"{str(folder)!r}"
        )
    model, info, judge_tokenizer = load_student(folder, device)
    if same_tokenizer(judge_tokenizer, tokenizer) is False:
        raise ValueError(
            f"judge: the tokenizer of {str(folder)!r} is not the run's: the same ids mean other text to "
            "it; "
            "pass a judge trained on the run's --data and --vocab-size"
        )
    if info.get("k", 0) != 0:
        raise ValueError(
            f"judge: expected an AR model (a stage0 folder), got a PFLM with k={info['k']} in {str(folder)!r}"
        )
    return model, judge_description(folder, info, given=judge is not None)
