"""A Hugging Face student's sharded (FSDP2) checkpoint exported whole, as the stage folder a finished stage is.

``python -m kforcing_kernels.app.training.sharded_checkpoint CHECKPOINT --out FOLDER`` reaches
:func:`export_sharded` through the registry (``ModelKind.export_sharded``): DCP reads every rank's shards into one
full state dict in this process (no process group), the model is rebuilt from the checkpoint's saved transformers
config and noise embedding shapes, and :func:`~.files.save_hf_stage` writes ``save_pretrained`` of the backbone and of
the run's tokenizer, ``noise_embedding.safetensors`` and ``model.json``: ``from_pretrained``, ``load_pflm`` and
``load_hf_stage`` load it. The tokenizer is the one the finished stage would have saved: the run's teacher folder (a
distilled stage), the run folder itself (a finished Stage 0), else the run's ``tokenizer.json`` (the package's BPE,
wrapped with its EOS), or ``--tokenizer``; it is refused unless it is the tokenizer the run recorded.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import torch

from ..data import EOS
from ..files import CheckpointError, literal_specials, tokenizer_sha256
from .files import import_transformers, is_hf_source, is_hf_stage, save_hf_stage


def _saved_tensor_shapes(checkpoint: Path) -> dict[str, tuple]:
    """name -> full shape of every tensor DCP saved under ``model.`` (from its metadata; no tensor is read)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {
        name.removeprefix("model."): tuple(meta.size)
        for name, meta in metadata.items()
        if name.startswith("model.") and hasattr(meta, "size")
    }


def export_sharded(checkpoint: Path, out: Path, manifest: dict, record: dict, tokenizer: Optional[Path]) -> None:
    """A Hugging Face student's sharded checkpoint as its stage folder (``save_hf_stage``), from the full state dict."""
    import torch.distributed.checkpoint as dcp

    from ...integrations.hf_noise import NoiseEmbedding
    from .student import HFStudent

    tf = import_transformers()
    values = manifest["model_config"]
    try:
        config = tf.AutoConfig.for_model(**values)
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(
            f"{checkpoint / 'manifest.json'}: its model_config is not a config this transformers "
            f"builds ({type(exc).__name__}: {exc})"
        ) from None
    # The noise embedding's feature counts are read off its saved layers (DCP metadata): z_in takes
    # 2 * (noise_features // 2) features, tau_mlp.0 2 + 2 * (tau_features // 2).
    shapes = _saved_tensor_shapes(checkpoint)
    try:
        noise = NoiseEmbedding(
            config.hidden_size,
            noise_features=shapes["noise_encoder.z_in.weight"][1],
            tau_features=shapes["noise_encoder.tau_mlp.0.weight"][1] - 2,
        )
    except KeyError as exc:
        raise CheckpointError(
            f"{checkpoint}: no noise embedding tensor {exc} in this Hugging Face student's checkpoint"
        ) from None
    hf_tokenizer = _hf_tokenizer(checkpoint, manifest, tokenizer)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="kforcing", dtype=torch.float32)
    student = HFStudent(model.float(), noise, k_train=manifest["info"].get("k"))
    # A tied head is saved once, under its embedding's name.
    state = {"model": {name: t for name, t in student.state_dict().items() if name in shapes}}
    missing = sorted(set(student.state_dict()) - set(shapes) - set(student.tied_keys()))
    if missing:
        raise CheckpointError(f"{checkpoint}: the saved model does not match its model_config (no {missing[0]!r})")
    dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    student.load_state_dict(state["model"], strict=False)  # loaded in place; a tied head follows its embedding
    save_hf_stage(out, student.eval(), {**record, "model_kind": "hf"}, hf_tokenizer)


def _hf_tokenizer(checkpoint: Path, manifest: dict, given: Optional[Path]):
    """The tokenizer the finished stage would have saved (see :func:`export_sharded`), checked against the run's."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    info, run = manifest["info"], checkpoint.parent.parent
    teacher = info.get("teacher") or manifest["train_config"].get("teacher")
    if given:
        source, what = Path(given), "--tokenizer"
    elif teacher:  # a distilled stage: the teacher's tokenizer, as the trainer used (eos token and all)
        if not (is_hf_source(teacher) or is_hf_stage(teacher)):
            raise CheckpointError(
                f"tokenizer: the run's teacher {teacher}, whose tokenizer the stage saves, is not "
                "here (moved or deleted); pass --tokenizer, a folder holding that tokenizer"
            )
        source, what = Path(teacher), f"the run's teacher {teacher}"
    elif is_hf_stage(run):  # a finished Stage 0: the stage folder holds its tokenizer already
        source, what = run, f"the run folder {run}"
    else:  # an unfinished Stage 0 of a --model-config run: the package's BPE
        source, what = run / "tokenizer.json", "the run's tokenizer.json"
    try:
        if source.is_dir():
            tok = AutoTokenizer.from_pretrained(str(source))
            backend = literal_specials(tok.backend_tokenizer)
        elif source.is_file():
            backend = literal_specials(Tokenizer.from_file(str(source)))
            tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(source)), eos_token=EOS)
        else:
            raise OSError("not found")
    except Exception as exc:  # OSError, ValueError, and the plain Exception tokenizers raises for a malformed file
        raise CheckpointError(
            f"tokenizer: cannot load a tokenizer from {what} ({source}: {exc}); pass --tokenizer, "
            "the run's Hugging Face tokenizer folder (its teacher's) or tokenizer.json"
        ) from None
    want = info.get("tokenizer_sha256")
    if want is not None and not _same_tokenizer(backend, want):
        raise CheckpointError(
            f"tokenizer: {what} ({source}) is not the tokenizer this run was trained with; pass "
            "--tokenizer, the run's Hugging Face tokenizer folder (its teacher's) or tokenizer.json"
        )
    return tok


def _same_tokenizer(backend, want: str) -> bool:
    """``backend`` is the tokenizer of SHA-256 ``want``
    (:func:`~kforcing_kernels.app.files.tokenizer_sha256`), also once wrapped by
    ``PreTrainedTokenizerFast``: the wrapper adds a post-processor that adds no token."""
    if tokenizer_sha256(backend) == want:
        return True
    data = json.loads(backend.to_str())
    post = data.get("post_processor")
    if not (isinstance(post, dict) and post.get("type") == "TemplateProcessing" and not post.get("special_tokens")):
        return False
    data["post_processor"] = None  # as the package's BPE was before the wrapper
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest() == want
