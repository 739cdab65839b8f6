"""What the package reads back of the metadata it saved, entry by entry: a stage folder's ``model.json`` (every kind),
the ``info`` and ``train_config`` every checkpoint and model records, a run's ``train_config.json``. Each table maps
an entry to a :class:`~kforcing_kernels.app.files.Field` (its type and allowed values); every reader checks what it
reads against them (:func:`read_model_json`, :func:`~kforcing_kernels.app.files.read_json` with ``fields=``), so a
hand-edited or damaged file is refused with an error naming the file and the entry, never a ``TypeError`` later.

A kind's own entries are checked by its reader (``hf_format``, ``noise_embedding``, ``files``: ``hf_recipe/files.py``;
the checkpoint formats: ``training/checkpoint.py``, ``training/sharded_checkpoint.py``), ``model_kind``'s value
against the registry (:func:`kforcing_kernels.app.student.recorded_kind`). Entries a table does not name are kept
and not looked at; an entry an older version did not write may be absent (readers say what they assume then).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Optional

from ..integrations.vllm.stage import is_native_export
from ..model import PRESETS
from ..model.decoding import DECODE_RULES
from .files import NON_NEGATIVE_INT, POSITIVE_INT, SHA256, CheckpointError, Field, check_fields, read_json
from .training.targets import CDF_ORDERS

_PATH = Field((str, type(None)))  # a folder or file a run recorded (resolved), or None
_FINITE = Field(float, rule=math.isfinite, expected="a finite number")

# A run's settings as train() records them (TrainConfig.to_dict()), the entries the package reads back: the ones a
# --resume or a pipeline's reuse compares (TrainConfig.RESUME_KEYS), the ones evaluation uses (seq_len, steps, out).
# Their types are TrainConfig's (python_tests/app/test_records.py checks that they agree).
TRAIN_CONFIG_FIELDS: Mapping[str, Field] = {
    "stage": Field(str),
    "out": Field(str),
    "teacher": _PATH,
    "data": Field(str),
    "vocab_size": POSITIVE_INT,
    "preset": Field((str, type(None)), choices=(*PRESETS, None)),
    "model_overrides": Field(dict),
    "model": _PATH,
    "model_config": _PATH,
    "seq_len": POSITIVE_INT,
    "steps": POSITIVE_INT,
    "batch_size": POSITIVE_INT,
    "grad_accum": POSITIVE_INT,
    "lr": _FINITE,
    "min_lr_ratio": _FINITE,
    "warmup_steps": NON_NEGATIVE_INT,
    "weight_decay": _FINITE,
    "beta1": _FINITE,
    "beta2": _FINITE,
    "grad_clip": _FINITE,
    "tau_min": _FINITE,
    "tau_max": _FINITE,
    "supervision": Field(str),
    "decode": Field(str, choices=DECODE_RULES),
    "k": POSITIVE_INT,
    "packed_docs": Field(bool),
    "seed": Field(int),
    "precision": Field(str),
    "parallel": Field(str),
}

# What a stage records about itself (model.json and every checkpoint's "info"): app/training/stage.py writes it.
MODEL_INFO_FIELDS: Mapping[str, Field] = {
    "kind": Field(str, choices=("ar", "pflm")),
    "k": NON_NEGATIVE_INT,
    "teacher": _PATH,
    "teacher_k": NON_NEGATIVE_INT,
    "supervision": Field(str),
    "cdf_order": Field(str, choices=CDF_ORDERS),
    "data_sha256": Field((str, type(None)), rule=SHA256.rule, expected=SHA256.expected),
    "tokenizer_sha256": Field((str, type(None)), rule=SHA256.rule, expected=SHA256.expected),
    "teacher_sha256": Field((str, type(None)), rule=SHA256.rule, expected=SHA256.expected),
}

# model.json of a finished stage of any kind: the info above, what the trainer adds when the stage ends
# (training/loop.py's _finish) or an export (training/sharded_checkpoint.py), and the model's identity ("tensors":
# the SHA-256 a later stage records as teacher_sha256).
MODEL_JSON_FIELDS: Mapping[str, Field] = {
    **MODEL_INFO_FIELDS,
    "k": Field(int, required=True, rule=NON_NEGATIVE_INT.rule, expected=NON_NEGATIVE_INT.expected),
    "model_kind": Field(str),
    "stage": Field((str, type(None))),
    "data": Field((str, type(None))),
    "train_config": Field(dict, fields=TRAIN_CONFIG_FIELDS),
    "summary": Field(dict, fields={"final_loss": Field(float), "val_loss": Field(float), "steps": POSITIVE_INT}),
    "model_config": Field(dict, required=True),
    "tensors": Field(
        dict, required=True, fields={"sha256": Field(str, required=True, rule=SHA256.rule, expected=SHA256.expected)}
    ),
    "exported_from": Field(str),
    "step": NON_NEGATIVE_INT,
}


# What the evaluation reads of the model.json that records a run's text (its AR teacher's, or stage1's when the
# teacher is a pretrained model): where the text is and the crop length.
RUN_TEXT_FIELDS: Mapping[str, Field] = {
    "data": Field((str, type(None)), required=True),
    "train_config": Field(
        dict,
        required=True,
        fields={
            **TRAIN_CONFIG_FIELDS,
            "seq_len": Field(int, required=True, rule=POSITIVE_INT.rule, expected=POSITIVE_INT.expected),
        },
    ),
}
# What the evaluation reads of a distilled stage's model.json besides its model: the window of its teacher.
DISTILLED_FIELDS: Mapping[str, Field] = {
    "teacher_k": Field(int, required=True, rule=NON_NEGATIVE_INT.rule, expected=NON_NEGATIVE_INT.expected),
}


def read_model_json(folder, fields: Optional[Mapping[str, Field]] = None) -> dict:
    """``FOLDER/model.json``, checked against :data:`MODEL_JSON_FIELDS` (and a kind's own ``fields``): a
    :class:`~kforcing_kernels.app.files.CheckpointError` naming the file and the entry otherwise; and naming what
    the folder is when it is a native stage's vLLM export (``python -m kforcing_kernels.app.vllm_export``), whose
    ``model.json`` is vLLM's record, not a model the package loads."""
    path = Path(folder) / "model.json"
    record = read_json(path)
    if is_native_export(record):
        raise CheckpointError(
            f"{folder}: a vLLM export of {record.get('source')!r} (python -m kforcing_kernels.app.vllm_export), "
            "served by vLLM, not loaded by the package; load the source stage folder"
        )
    return check_fields(path, record, {**MODEL_JSON_FIELDS, **(fields or {})})
