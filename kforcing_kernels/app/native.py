"""The package's own model (``KForcingLM``) as a kind of :mod:`kforcing_kernels.app.student`'s registry.

Its stage folder is ``model.safetensors`` + ``model.json`` (+ the run's ``tokenizer.json``), written and read by
:mod:`kforcing_kernels.app.training.checkpoint`; its text is the package's own BPE of ``--data``; it generates over
the package's KV caches (paged or contiguous, :mod:`kforcing_kernels.app.generation.inference`). The modules it
delegates to are imported when used, so that registering the kind costs nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import torch

from ..model.decoding import DECODE_RULES
from .student import ModelKind


class NativeKind(ModelKind):
    name = "native"
    summary = "the package's own model (KForcingLM)"
    decode_rules = DECODE_RULES
    source_files = "its model file"
    caches = ("paged", "contiguous")  # the first is the default (app/generation/inference.py)
    default_page_size = 16
    compiled_step = True  # generation takes compile_step (app/generation/static_step.py)
    serves_paged = True  # PagedGenerator's cache holds its layers (app/generation/paged_cache.py)

    def holds(self, folder) -> bool:
        return (Path(folder) / "model.json").is_file()

    def load(self, folder, device="cpu"):
        from .training.checkpoint import load_model

        return load_model(folder, device)

    def identity(self, folder) -> str:
        from .training.checkpoint import read_model_info

        return read_model_info(folder)["tensors"]["sha256"]

    def build(self, cfg, generator: torch.Generator):
        from ..model import PRESETS, KForcingLM

        model_cfg = PRESETS[cfg.preset](**{"seq_len": cfg.seq_len, "vocab_size": cfg.vocab_size, **cfg.model_overrides})
        model = KForcingLM(model_cfg)
        model.reset_parameters(generator)
        return model

    def build_like(self, model):
        from ..model import KForcingLM

        return KForcingLM(model.config)

    def save(self, folder, model, info: dict, corpus=None) -> None:
        from .training.checkpoint import save_model

        # The run's tokenizer.json is in the folder already (written when the stage started).
        save_model(folder, model, {**info, "model_kind": self.name})

    def config_dict(self, model) -> dict:
        return model.config.to_dict()

    def decode_rule(self, model) -> str:
        return model.config.decode

    def eos_id(self, model, tokenizer) -> int:
        from .data import EOS

        return tokenizer.token_to_id(EOS)

    def export_sharded(self, checkpoint, out, manifest: dict, record: dict, tokenizer=None) -> None:
        """``model.safetensors`` + ``model.json``; ``tokenizer``: the run's tokenizer.json (default: the one in the
        run folder above ``checkpoints/``), copied beside the model so ``load_model`` checks and returns it."""
        import torch.distributed.checkpoint as dcp

        from ..model import KForcingLM, ModelConfig
        from .files import write_bytes
        from .training.checkpoint import save_model

        checkpoint = Path(checkpoint)
        model = KForcingLM(ModelConfig.from_dict(manifest["model_config"]))
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
        model.load_state_dict(state["model"])
        save_model(out, model, record)
        tokenizer = Path(tokenizer) if tokenizer else checkpoint.parent.parent / "tokenizer.json"
        if tokenizer.is_file():
            write_bytes(Path(out) / "tokenizer.json", tokenizer.read_bytes())

    def with_decode(self, model, rule: str) -> None:
        super().with_decode(model, rule)
        model.config = dataclasses.replace(model.config, decode=rule)

    def corpus(self, teacher, data: Optional[str], vocab_size: int, verbose: bool = False):
        from .data import load_corpus

        return load_corpus(data, vocab_size=vocab_size, verbose=verbose)

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
        compile_step=False,
    ):
        from .generation.inference import cached_kforcing

        return cached_kforcing(
            model,
            tokens,
            lengths,
            noise,
            temperature,
            k=k,
            max_new_tokens=max_new_tokens,
            cache=cache,
            page_size=page_size,
            k_train=k_train,
            return_logits=return_logits,
            compile_step=compile_step,
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
        compile_step=False,
    ):
        from .generation.inference import cached_ar

        return cached_ar(
            model,
            tokens,
            lengths,
            noise,
            temperature,
            max_new_tokens=max_new_tokens,
            cache=cache,
            page_size=page_size,
            return_logits=return_logits,
            compile_step=compile_step,
        )


KIND = NativeKind()
