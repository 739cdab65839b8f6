"""Hugging Face causal LMs (``HFStudent``) as a kind of :mod:`kforcing_kernels.app.student`'s registry.

Its folders are a plain HF model folder (``--model``, a pretrained AR teacher) and the stage folders of
:mod:`.files` (``save_pretrained`` + the noise embedding); ``--model-config`` builds one at stage0; a stage distilled
from one encodes ``--data`` with the teacher's own tokenizer; it generates over the HF model's own KV cache.
transformers is imported only when a model is built, loaded or run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import torch

from ..files import CheckpointError
from ..student import CapabilityError, ModelKind
from . import files


class HFKind(ModelKind):
    name = "hf"
    summary = "a Hugging Face student (HFStudent), which decodes by argmax"
    sized_by_preset = False
    reads_config_files = True
    tokenizer_from_model = True
    decode_rules = ("argmax",)
    source_files = "its weights, config.json or tokenizer files"

    # Generation runs over the HF model's own DynamicCache: no cache= / page_size= / compile_step option, and
    # PagedGenerator (whose pages hold the native model's layers) refuses it (ModelKind's defaults say so by name).

    def holds(self, folder) -> bool:
        return files.is_hf_source(folder) or files.is_hf_stage(folder)

    def load(self, folder, device="cpu"):
        if files.is_hf_stage(folder):
            return files.load_hf_stage(folder, device)
        return files.load_hf_source(folder, device)

    def identity(self, folder) -> str:
        if files.is_hf_source(folder):
            return files.hf_source_sha256(folder)
        return files.read_hf_stage_info(folder)["tensors"]["sha256"]

    def earlier_identity_note(self, folder, recorded: str) -> Optional[str]:
        if files.is_hf_source(folder) and recorded == files.hf_weights_sha256(folder):
            # Saved before a --model folder's identity covered its config.json and tokenizer files.
            return (
                "the --model folder's config.json and tokenizer files were recorded; its weights are the same, "
                "reusing it without checking that config.json and the tokenizer did not change"
            )
        return None

    def source_option(self, folder) -> Optional[str]:
        return "--model" if files.is_hf_source(folder) else None

    def check_options(self, model: Optional[str], model_config: Optional[str]) -> None:
        if model:
            files.check_hf_source(model)
        if model_config:
            files.read_model_config(model_config)

    def check_stage_options(self, cfg) -> None:
        """--model (stage1's pretrained AR teacher) and --model-config (stage0's random initialisation): one of them,
        at its stage, and neither with the native model's sizes; --model is the teacher, so --teacher is not another
        folder; then the folder or file itself (:meth:`check_options`)."""
        if cfg.model and cfg.model_config:
            raise CapabilityError(
                "model_config: --model (a pretrained folder) and --model-config (a random initialisation) are two "
                "sources of the model; pass one"
            )
        if cfg.model_config and cfg.stage != "stage0":
            raise CapabilityError(
                "model_config: only stage0 builds a model from --model-config (later stages inherit their "
                f"teacher's), got stage {cfg.stage!r}"
            )
        if cfg.model and cfg.stage != "stage1":
            raise CapabilityError(
                "model: --model is a pretrained AR teacher, distilled from stage1 on (`stage1 --model PATH` or "
                f"`pipeline --model PATH`), got stage {cfg.stage!r}"
            )
        if cfg.model and cfg.teacher and Path(cfg.teacher).resolve() != Path(cfg.model).resolve():
            raise CapabilityError("teacher: --model is stage1's teacher; pass --model or --teacher, not both")
        if (cfg.model or cfg.model_config) and cfg.model_overrides:
            option = "--model" if cfg.model else "--model-config"
            raise CapabilityError(
                f"model_overrides: {option} gives the model; --"
                f"{'/--'.join(k.replace('_', '-') for k in cfg.model_overrides)} size the native model only"
            )
        self.check_options(cfg.model, cfg.model_config)

    def build(self, cfg, generator: torch.Generator):
        return files.build_from_config(cfg.model_config, cfg.seed)

    def build_like(self, model):
        return files.build_like(model)

    def save(self, folder, model, info: dict, corpus=None) -> None:
        if corpus is None:
            raise CheckpointError(f"{folder}: a Hugging Face stage is saved with its tokenizer (pass the corpus)")
        files.save_hf_stage(folder, model, {**info, "model_kind": self.name}, files.hf_tokenizer_of(corpus))

    def holds_config(self, model_config: dict) -> bool:
        return isinstance(model_config.get("model_type"), str)  # every transformers config names its model_type

    def export_sharded(self, checkpoint, out, manifest: dict, record: dict, tokenizer=None) -> None:
        from .export import export_sharded

        export_sharded(Path(checkpoint), Path(out), manifest, record, None if tokenizer is None else Path(tokenizer))

    def config_dict(self, model) -> dict:
        return json.loads(model.config.to_json_string())

    def eos_id(self, model, tokenizer) -> int:
        # Its own tokenizer's EOS (load() sets hf_tokenizer on the student).
        if model.hf_tokenizer is None or model.hf_tokenizer.eos_token_id is None:
            raise self.refuse("model", "was loaded without a tokenizer that names an EOS token", type(model).__name__)
        return model.hf_tokenizer.eos_token_id

    def corpus(self, teacher, data: Optional[str], vocab_size: int, verbose: bool = False):
        return files.hf_corpus(teacher, data, verbose=verbose)

    def generate_kforcing(
        self,
        model,
        tokens,
        lengths,
        noise,
        temperature,
        *,
        k,
        max_new_tokens,
        cache,
        page_size,
        k_train,
        return_logits,
        compile_step: Union[bool, str] = False,
    ):
        from .student import generate_grouped

        steps = noise.shape[1]
        taus = torch.as_tensor(temperature, dtype=torch.float32, device=tokens.device).expand(tokens.shape[0])
        return generate_grouped(
            lambda p, z, t: model.generate_kforcing(p, k, steps, t, z), tokens, lengths, max_new_tokens, noise, taus
        )

    def generate_ar(
        self,
        model,
        tokens,
        lengths,
        noise,
        temperature,
        *,
        max_new_tokens,
        cache,
        page_size,
        return_logits,
        compile_step: Union[bool, str] = False,
    ):
        from ..generation.checks import is_greedy
        from .student import generate_grouped

        greedy = is_greedy(temperature)
        taus = torch.as_tensor(temperature, dtype=torch.float32, device=tokens.device).expand(tokens.shape[0])
        return generate_grouped(
            lambda p, z, t: model.generate_ar(p, max_new_tokens, t, z, greedy),
            tokens,
            lengths,
            max_new_tokens,
            noise,
            taus,
        )

    def reference_generator(self, folder, device):
        """The AR teacher as an HF user runs it: ``from_pretrained(attn_implementation="sdpa")``."""
        with files.quiet_loading():
            model = files.import_transformers().AutoModelForCausalLM.from_pretrained(
                str(folder), attn_implementation="sdpa", dtype=torch.float32
            )
        return model.to(device).eval()

    def sliding_window(self, cfg) -> Optional[int]:
        """The window of ``--model-config`` or of the ``--model`` folder's config (None when transformers cannot read
        the folder: loading the model says why, naming --model, when its stage starts)."""
        if cfg.model_config:
            config = files.read_model_config(cfg.model_config)
        elif cfg.model:
            try:
                config = files.import_transformers().AutoConfig.from_pretrained(str(cfg.model))
            except Exception:  # noqa: BLE001 (any failure is reported by the stage that loads the model)
                return None
        else:
            return None
        return config_sliding_window(config)


def config_sliding_window(config) -> Optional[int]:
    """The sliding window of a transformers config's attention, or None when no layer slides (Qwen2 keeps a
    ``sliding_window`` value with ``use_sliding_window=False``; Gemma-style ``layer_types`` list the sliding layers)."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


KIND = HFKind()
