"""A native stage folder (K-Forced, or AR) exported as the folder vLLM serves (``kforcing_kernels.integrations.vllm``).

``python -m kforcing_kernels.app.vllm_export runs/native/stage2_k4 --out runs/native/stage2_k4_vllm`` (or
:func:`export_for_vllm`): the stage is loaded with every check ``load_model`` makes (its files' sizes and SHA-256, its
config, its tokenizer against the recorded SHA-256), then written through the mapping of
:mod:`kforcing_kernels.integrations.vllm.export`:

* ``config.json`` (vLLM's ``ModelConfig``: architecture ``KForcingNativeForCausalLM``), ``model.safetensors`` (the
  backbone under vLLM's names), ``noise_embedding.safetensors`` (the native noise encoder, a format-2 noise embedding);
* the tokenizer: the run's ``tokenizer.json`` (the package's BPE) wrapped with its EOS as ``PreTrainedTokenizerFast``
  saves it, which vLLM loads (needs transformers), with ``split_special_tokens`` (text holding ``<|eos|>`` is
  ordinary tokens, as the package encodes it);
* ``model.json`` last: ``native_export`` (the format), ``k``, ``decode``, the native ``model_config``, the noise
  embedding's format, settings and file record, every file's size and SHA-256, and the source's identity
  (``source_sha256``: its tensors' SHA-256), which ``read_stage`` checks before vLLM loads anything.

An AR stage (k = 0, the teacher) is exported without the noise encoder, as ``KForcingNativeARForCausalLM`` (served by
stock vLLM decoding: the AR baseline on the native backbone).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Optional

from ..integrations.vllm.export import (
    NATIVE_EXPORT_FORMAT,
    noise_settings,
    noise_tensors,
    vllm_config,
    vllm_tensors,
)
from ..integrations.vllm.stage import NOISE_FILE, is_native_export
from .files import CheckpointError, atomic_write_file, hf_literal_specials, save_tensors, sha256_file, write_json


class ExportError(ValueError):
    """A folder the vLLM export cannot write from; the message names the folder and what is wrong."""


def export_for_vllm(folder, out, *, max_positions: Optional[int] = None) -> Path:
    """Write the vLLM export of the native stage ``folder`` into ``out`` (new, empty, or an earlier export, whose
    files are replaced); returns ``out/model.json``. ``max_positions``: the longest sequence vLLM may serve (default
    the trained ``seq_len``)."""
    from .native import KIND
    from .student import find_kind

    folder, out = Path(folder), Path(out)
    kind = find_kind(folder)
    if kind is None:
        raise ExportError(f"{folder}: no model folder here (no model.json)")
    if kind is not KIND:
        raise ExportError(
            f"{folder}: {kind.summary}, not the package's own model: vLLM serves a K-Forced Hugging Face stage "
            "folder as it is (kforcing_kernels.integrations.vllm.engine_kwargs)"
        )
    if out.resolve() == folder.resolve():
        raise ExportError(f"out: {str(out)!r} is the stage folder itself; choose another folder")
    if out.exists() and not out.is_dir():
        raise ExportError(f"out: {str(out)!r} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not _is_export(out):
        # vLLM loads every *.safetensors of the folder: a stranger's files there would be loaded as the model's.
        raise ExportError(f"out: {str(out)!r} is not empty and holds no earlier vLLM export; choose an empty folder")
    model, info, tokenizer = KIND.load(folder)
    k = info["k"]  # 0: an AR stage (the teacher), exported as a plain autoregressive model (no noise encoder)
    if tokenizer is None:
        raise ExportError(f"{folder}/tokenizer.json: missing; vLLM loads the model's tokenizer from its folder")
    from .data import EOS

    eos = tokenizer.token_to_id(EOS)
    if eos is None:
        raise ExportError(f"{folder}/tokenizer.json: no end-of-text token {EOS!r} (not the package's tokenizer)")
    state = model.state_dict()
    config = vllm_config(model.config, max_positions=max_positions, eos_token_id=eos, autoregressive=k == 0)
    try:
        backbone = vllm_tensors(state, model.config.tie_embeddings)
    except ValueError as exc:
        raise ExportError(f"{folder}: {exc}") from None
    out.mkdir(parents=True, exist_ok=True)
    if k == 0:  # an earlier export's noise file: vLLM loads every *.safetensors of the folder
        (out / NOISE_FILE).unlink(missing_ok=True)
    files = {}
    write_json(out / "config.json", config)
    save_tensors(out / "model.safetensors", backbone)
    for name, record in _save_tokenizer(folder / "tokenizer.json", out, EOS).items():
        files[name] = record
    for name in ("config.json", "model.safetensors"):
        files[name] = {"bytes": (out / name).stat().st_size, "sha256": sha256_file(out / name)}
    record = {
        "native_export": NATIVE_EXPORT_FORMAT,
        "k": k,
        "decode": model.config.decode,
        "model_config": model.config.to_dict(),
        "source": str(folder),
        "source_sha256": info["tensors"]["sha256"],
        "tokenizer_sha256": info.get("tokenizer_sha256"),
    }
    if k:
        from ..integrations.hf_noise import NOISE_EMBEDDING_FORMAT

        record["noise_embedding"] = {
            "format": NOISE_EMBEDDING_FORMAT,
            "settings": noise_settings(model.config),
            "tensors": save_tensors(out / NOISE_FILE, noise_tensors(state)),
        }
    write_json(out / "model.json", {**record, "files": dict(sorted(files.items()))})
    return out / "model.json"


def _is_export(folder: Path) -> bool:
    """Whether ``folder`` holds an earlier export (its ``model.json`` records ``native_export``)."""
    import json

    try:
        record = json.loads((folder / "model.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and is_native_export(record)


def _save_tokenizer(path: Path, out: Path, eos: str) -> dict:
    """The package's ``tokenizer.json`` as ``PreTrainedTokenizerFast(eos_token=eos).save_pretrained`` writes it into
    ``out``; returns ``{file name: {bytes, sha256}}`` of what it wrote."""
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast
    except ImportError as exc:
        raise ExportError(
            f"the vLLM export needs transformers for the tokenizer vLLM loads ({exc}): pip install '.[hf]'"
        ) from None
    # With the package's rule for special-token text (``<|eos|>`` in a prompt is ordinary tokens, as load_tokenizer
    # encodes it), written as tokenizer_config.json's split_special_tokens, which vLLM's tokenizer honours.
    backend = Tokenizer.from_file(str(path))
    wrapped = hf_literal_specials(PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos))
    files = {}
    with tempfile.TemporaryDirectory(dir=out, prefix=".tokenizer.") as staging:
        wrapped.save_pretrained(staging)
        for written in sorted(p for p in Path(staging).iterdir() if p.is_file()):
            with open(written, "rb") as src:
                atomic_write_file(out / written.name, lambda f: shutil.copyfileobj(src, f, 1 << 22))
            files[written.name] = {"bytes": written.stat().st_size, "sha256": sha256_file(out / written.name)}
    return files


def main(argv=None) -> None:
    from .cli import make_parser

    # No console script is installed for it (pyproject.toml): the usage line names the command that runs it.
    parser = make_parser(
        "python -m kforcing_kernels.app.vllm_export",
        "Export a native stage folder (the package's own model: a K-Forced stage, or an AR stage served as plain AR) "
        "as the folder vLLM serves (kforcing_kernels.integrations.vllm: vllm.LLM(**engine_kwargs(OUT, k))).",
    )
    parser.add_argument("folder", help="the native stage folder (model.safetensors, model.json, tokenizer.json)")
    parser.add_argument(
        "--out", required=True, help="folder for the export: new, empty, or an earlier export (its files replaced)"
    )
    parser.add_argument(
        "--max-positions",
        type=int,
        default=None,
        help="the longest sequence (prompt + generated + 2k) vLLM may serve (default: the trained seq_len)",
    )
    args = parser.parse_args(argv)
    try:
        print(export_for_vllm(args.folder, args.out, max_positions=args.max_positions))
    except (CheckpointError, ExportError, ValueError) as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    main()
