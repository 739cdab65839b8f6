"""The drafts that make vLLM schedule Algorithm 1's windows: ``[rest of the last window | k noise placeholders]``.

vLLM's ``custom_class`` speculative method (``speculative_config={"method": "custom_class", "model": this class's
path}``) builds one instance per worker with the ``VllmConfig`` and calls ``load_model(model)`` then, after each
step, ``propose(sampled_token_ids, ...)`` with the tokens each batch row committed. The window the model decoded
this step (``model.kf_last``) gives the drafts; the next window's noise (the request's seeded uniforms) is carried
by the model itself, from the request's seed (:mod:`.model`).

The per-request state (sampling parameters, batch order) is the model runner's: vLLM's proposer interface gives
neither request ids nor parameters, so the instance finds the runner that constructs it on its call stack (the
runner builds the drafter in its ``__init__``) and hands it to the model in ``load_model``. Nothing of vLLM is
patched.
"""

from __future__ import annotations

import inspect
from typing import Any

from .model import NOISE_DRAFT


def _constructing_runner() -> Any:
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and type(owner).__name__.endswith("ModelRunner") and frame.f_code.co_name == "__init__":
            return owner
        frame = frame.f_back
    raise RuntimeError(
        "KForcingProposer: expected to be built by a vLLM V1 model runner (speculative_config method custom_class)"
    )


class KForcingProposer:
    """vLLM ``custom_class`` proposer for K-Forced models (:mod:`kforcing_kernels.integrations.vllm.model`)."""

    def __init__(self, vllm_config):
        self.runner = _constructing_runner()
        self.model: Any = None

    def load_model(self, model) -> None:
        if not hasattr(model, "kf_k"):
            raise ValueError(
                f"KForcingProposer: the model is {type(model).__name__}, not a K-Forced architecture; select one with "
                'hf_overrides={"architectures": ["KForcing<Base>ForCausalLM"]} (engine_kwargs does)'
            )
        model.kf_runner = self.runner
        self.model = model

    def propose(self, sampled_token_ids, *args, **kwargs) -> list[list[int]]:
        model, last = self.model, self.model.kf_last
        if last is None:
            return [[] for _ in sampled_token_ids]
        windows = last["windows"].tolist()  # the one read of this step's windows
        drafts: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                drafts.append([])
                continue
            drafts.append(windows[i][int(last["emit"][i]) + 1 :] + [NOISE_DRAFT] * model.kf_k)
        model.kf_prune()
        return drafts
