"""The one seam between model kinds: what the trainer, generation and evaluation may ask of a model, and the registry
of kinds (torchtitan's ``TrainSpec`` shape).

Two things, both declared here and implemented once per kind:

* :class:`Student`, the model itself: the forwards of K-Forcing (AR, SingleForward, DoubleForward and a rank's
  share under context parallelism), its decoder layers (the unit of activation checkpointing, compile and FSDP2),
  its noise encoder, ``k_train`` and ``kind``, the registry name of its kind. ``KForcingLM`` (``model/gpt.py``) and
  ``HFStudent`` (``app/hf_recipe/student.py``) implement it.
* :class:`ModelKind`, what differs per kind outside the model's forward: recognising, loading, building and saving
  its folders, the identity of a teacher folder, its text, generation over its cache, and the few capabilities a
  stage checks. ``app/native.py`` (the package's own model) and ``app/hf_recipe/kind.py`` (Hugging Face models)
  implement it.

The registry maps a kind's name to the module that implements it, loaded on first use (as ``ops/common/registry.py``
does for backends): this module imports no kind, and no caller asks which kind it holds; it asks the registry for the
model's (:func:`kind_of`) or the folder's (:func:`kind_of_folder`) and calls the kind.
"""

from __future__ import annotations

import importlib
import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Protocol, Union, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from ..parallel import ContextParallel
    from .data import Corpus

# The kind of a folder no kind recognises (its loader then names what is missing) and of a fresh stage0.
DEFAULT_KIND = "native"


@runtime_checkable
class Student(Protocol):
    """A model the trainer, generation and evaluation drive (shapes as ``KForcingLM``'s; B batch, N context tokens, k
    window slots, V vocabulary, R a rank's rows)."""

    kind: str  # the registry name of its ModelKind
    config: Any  # vocab_size at least; the kind's own config object
    k_train: Optional[int]  # the window it was trained with (0: AR), None when unknown

    @property
    def noise_encoder(self) -> nn.Module:
        """The noise encoder (its own parameters; Stage 1 starts it fresh)."""

    def forward(
        self,
        tokens: torch.Tensor,
        noise: Optional[torch.Tensor] = None,
        tau=1.0,
        cu_seqlens=None,
        context_parallel: Optional["ContextParallel"] = None,
    ) -> Any:
        """AR logits ``[B, N, V]`` (noise None), SingleForward logits ``[B, N, k, V]``, or with ``context_parallel``
        this rank's share ``(logits [B, R, V], rows [R])``."""

    def single_forward(
        self, tokens: torch.Tensor, noise: torch.Tensor, tau=1.0, cu_seqlens=None
    ) -> tuple[torch.Tensor, Any]:
        """SingleForward (eq. 18): ``(logits [B, N, k, V], the context's cache that double_forward reuses)``."""

    def double_forward(
        self, context_kv, first: torch.Tensor, noise: torch.Tensor, tau=1.0, cu_seqlens=None
    ) -> torch.Tensor:
        """DoubleForward (eq. 19) on the cache of :meth:`single_forward`: logits ``[B, N, k, V]``."""

    def context_parallel_forward(
        self,
        cp: "ContextParallel",
        tokens: torch.Tensor,
        noise: Optional[torch.Tensor] = None,
        tau=1.0,
        cu_seqlens=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the AR forward or the SingleForward: ``(logits [B, R, V], rows int64 [R])``."""

    def embed_noise(self, noise: torch.Tensor, tau) -> torch.Tensor:
        """noise ``[B, *S]`` in [0, 1), tau scalar or ``[B]`` -> embeddings ``[B, *S, C]``."""

    def reset_noise_encoder(self, generator: Optional[torch.Generator] = None) -> None:
        """A fresh noise encoder (Stage 1 starts from the AR teacher with one)."""

    def decoder_layers(self) -> list[nn.Module]:
        """The repeated layers, in order: what activation checkpointing, compile and FSDP2 wrap one by one."""

    def tied_keys(self) -> list[str]:
        """state_dict keys whose tensor is an earlier key's (tied embeddings): saved once, restored by the tie."""

    def output_head(self) -> Optional[nn.Linear]:
        """The linear layer that maps ``forward(..., return_hidden=True)``'s hidden states to the logits, or None when
        the logits are not exactly that (the loss then takes the logits)."""

    # The nn.Module members the generic code uses (every Student is an nn.Module).
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...
    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]: ...
    def eval(self) -> Any: ...
    def train(self, mode: bool = True) -> Any: ...
    def cpu(self) -> Any: ...
    def to(self, *args: Any, **kwargs: Any) -> Any: ...
    def requires_grad_(self, requires_grad: bool = True) -> Any: ...
    def state_dict(self, *args: Any, **kwargs: Any) -> Any: ...
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any: ...


def device_of(model: Student) -> torch.device:
    """The device of ``model``'s weights (where generation puts its prompts and noise)."""
    return next(model.parameters()).device


def dtype_of(model: Student) -> torch.dtype:
    """The dtype of ``model``'s weights."""
    return next(model.parameters()).dtype


def unwrap(model: Union[Student, nn.Module]) -> Union[Student, nn.Module]:
    """The model inside DDP and ``torch.compile`` wrappers (the module whose kind and head the generic code asks)."""
    from torch._dynamo.eval_frame import OptimizedModule  # torch.compile's wrapper (public since 2.0)

    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(model, OptimizedModule):
            model = model._orig_mod  # noqa: SLF001 - the compiled module's original, torch's documented attribute
        else:
            return model


class CapabilityError(ValueError):
    """An option or call that a model kind cannot honour; the message names the option and the kind."""


class ModelKind(ABC):
    """What differs per kind of model outside its forward. One instance per kind, registered by name."""

    name: str = ""
    summary: str = ""
    sized_by_preset: bool = True  # --preset / --n-layer size its models (False: the model's own config does)
    reads_config_files: bool = False  # stage0 builds it from a config file (--model-config)
    tokenizer_from_model: bool = False  # a stage distilled from it encodes --data with the teacher's own tokenizer
    decode_rules: tuple[str, ...] = ("argmax",)  # the PFLM decoding rules it can be trained with (model/decoding.py)
    source_files: str = "its model file"  # what its identity (:meth:`identity`) covers, in an error's words
    # Generation capabilities (app/generation/inference.py asks them through :meth:`generation_options`):
    caches: tuple[str, ...] = ()  # the ``cache=`` values it honours (empty: it decodes over its own cache only)
    default_page_size: Optional[int] = None  # ``page_size=`` when the paged cache is asked without one
    compiled_step: bool = False  # it honours ``compile_step`` (a static, compilable decode step)
    serves_paged: bool = False  # PagedGenerator (app/generation/serving.py) can serve its models

    def refuse(self, option: str, what: str, got: Any) -> CapabilityError:
        """The error for an option this kind cannot honour: names the option, the kind and the value given."""
        return CapabilityError(f"{option}: {self.summary} {what}, got {got!r}")

    # -------------------------------------------------------------- folders

    @abstractmethod
    def holds(self, folder) -> bool:
        """Whether ``folder`` is a model of this kind (a stage folder it wrote, or a source folder it reads)."""

    @abstractmethod
    def load(self, folder, device="cpu") -> tuple[Student, dict, Any]:
        """``(model in eval mode, its model.json info, its tokenizer or None)``, every file checked first."""

    @abstractmethod
    def identity(self, folder) -> str:
        """The SHA-256 a stage distilled from ``folder`` records as ``teacher_sha256``."""

    def earlier_identity_note(self, folder, recorded: str) -> Optional[str]:
        """When ``recorded`` is the identity an earlier version recorded for ``folder`` (which covered less), the
        warning that accepts it; else None."""
        return None

    def source_option(self, folder) -> Optional[str]:
        """The command-line option ``folder`` came in by when it is a source, not a stage (``--model``), else None."""
        return None

    def check_options(self, model: Optional[str], model_config: Optional[str]) -> None:  # noqa: B027 - a no-op default
        """Refuse, naming the option, a bad ``--model`` / ``--model-config`` this kind reads (before a stage starts)."""

    def check_stage_options(self, cfg) -> None:  # noqa: B027 - a no-op default: a kind that reads neither option
        """Refuse, naming the option, what the options this kind reads cannot take in a stage (``cfg``, a
        ``TrainConfig`` with ``--model`` or ``--model-config``): which stages take them and what they exclude (a
        :class:`CapabilityError`), then a bad option itself (as :meth:`check_options`). ``validate_config`` asks every
        kind."""

    # -------------------------------------------------------------- building and saving

    @abstractmethod
    def build(self, cfg, generator: torch.Generator) -> Student:
        """A fresh Stage-0 model for the ``TrainConfig`` ``cfg``, initialised from ``generator`` / ``cfg.seed``."""

    @abstractmethod
    def build_like(self, model: Student) -> Student:
        """A fresh fp32 CPU model of ``model``'s config: the frame a full state dict is loaded into."""

    @abstractmethod
    def save(self, folder, model: Student, info: dict, corpus: Optional["Corpus"]) -> None:
        """A finished stage as a model folder :meth:`load` reads back (``corpus``: the text it was trained on); its
        ``model.json`` records ``model_kind`` (this kind's name), so the registry finds the kind without asking."""

    def holds_config(self, model_config: dict) -> bool:
        """Whether ``model_config`` (a checkpoint's saved model config) configures a model of this kind; the default
        kind's is the fallback (:func:`kind_of_config`), so it need not claim its own."""
        return False

    def export_sharded(self, checkpoint, out, manifest: dict, record: dict, tokenizer=None) -> None:
        """Write the model of a sharded (DCP) checkpoint, whole, as this kind's stage folder ``out`` (one process, no
        process group); ``manifest`` is the checkpoint's, ``record`` the ``model.json`` info to save, ``tokenizer``
        the user's ``--tokenizer`` or None."""
        raise self.refuse("checkpoint", "has no export of sharded checkpoints", str(checkpoint))

    def config_dict(self, model: Student) -> dict:
        """``model``'s config as JSON gives it back (what a checkpoint records as ``model_config``)."""
        raise self.refuse("model", "has no config a checkpoint can record", type(model).__name__)

    def decode_rule(self, model: Student) -> str:
        """The PFLM decoding rule ``model`` decodes by (one of :attr:`decode_rules`)."""
        return self.decode_rules[0]

    def with_decode(self, model: Student, rule: str) -> None:
        """Record the PFLM decoding rule ``rule`` (one of :attr:`decode_rules`) in ``model``'s config."""
        if rule not in self.decode_rules:
            raise ValueError(
                f"decode: {rule} decoding is not available for {self.summary}; use one of {self.decode_rules}"
            )

    # -------------------------------------------------------------- text and generation

    def is_source(self, folder) -> bool:
        """Whether ``folder`` is a source (a pretrained model that no stage of a run wrote): its ``model.json``, if
        any, records no run text, which a run's first stage (``stage1``) then holds."""
        return self.source_option(folder) is not None

    def eos_id(self, model: Student, tokenizer) -> int:
        """The end-of-text id of ``model`` with ``tokenizer`` (the one :meth:`load` returned): an empty prompt starts
        a document with it."""
        raise self.refuse("model", "names no end-of-text token", type(model).__name__)

    def generation_options(
        self, cache: Optional[str], page_size: Optional[int], compile_step: Union[bool, str]
    ) -> dict[str, Any]:
        """``cache`` / ``page_size`` / ``compile_step`` of ``generate_kforcing`` / ``generate_ar`` as this kind's
        :meth:`generate_kforcing` takes them: None means the kind's default; an option it cannot honour is refused
        naming the option and the kind (never silently ignored)."""
        if cache is not None and cache not in self.caches:
            what = (
                f"decodes over its own cache (cache= one of {self.caches})"
                if self.caches
                else "decodes over its own KV cache only (no cache= option)"
            )
            raise self.refuse("cache", what, cache)
        cache = cache if cache is not None else (self.caches[0] if self.caches else None)
        if page_size is not None and "paged" not in self.caches:
            raise self.refuse("page_size", "has no paged cache (it decodes over its own KV cache)", page_size)
        if page_size is None and "paged" in self.caches:
            page_size = self.default_page_size  # read by the paged cache only (cache="contiguous" has no pages)
        if compile_step is not False and not self.compiled_step:
            raise self.refuse(
                "compile_step",
                "decodes with its own KV cache; compile_step applies to the package's caches",
                compile_step,
            )
        return {"cache": cache, "page_size": page_size, "compile_step": compile_step}

    def check_serving(self, model: Student) -> None:
        """Refuse (naming the kind) a model that :class:`~kforcing_kernels.app.generation.serving.PagedGenerator`
        cannot serve."""
        if not self.serves_paged:
            raise self.refuse(
                "model",
                "is not served by PagedGenerator (the package's paged KV cache holds its own model's layers); "
                "use generate_kforcing / generate_ar",
                type(model).__name__,
            )

    @abstractmethod
    def corpus(self, teacher, data: Optional[str], vocab_size: int, verbose: bool = False) -> "Corpus":
        """The text of a stage whose teacher is the folder ``teacher`` of this kind (None: a stage0 without one)."""

    @abstractmethod
    def generate_kforcing(
        self,
        model: Student,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        noise: torch.Tensor,
        temperature,
        *,
        k: int,
        max_new_tokens: int,
        cache: Optional[str],
        page_size: Optional[int],
        k_train: Optional[int],
        return_logits: bool,
        compile_step: Union[bool, str] = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Algorithm 1 over the kind's KV cache, arguments checked by ``generation/inference.py`` (``cache``,
        ``page_size`` and ``compile_step`` by :meth:`generation_options`): right-padded ``tokens [B, P]``,
        ``lengths [B]``, ``noise [B, ceil(T / k), k]`` -> ``(tokens [B, T], logits [B, T, V])`` (logits may be None
        without ``return_logits``)."""

    @abstractmethod
    def generate_ar(
        self,
        model: Student,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        noise: torch.Tensor,
        temperature,
        *,
        max_new_tokens: int,
        cache: Optional[str],
        page_size: Optional[int],
        return_logits: bool,
        compile_step: Union[bool, str] = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """AR decoding over the kind's KV cache: ``noise [B, T]`` -> ``(tokens [B, T], logits [B, T, V])``."""

    def reference_generator(self, folder, device) -> Optional[nn.Module]:
        """The model of ``folder`` as its own library generates with it (timed beside the package), or None."""
        return None

    def sliding_window(self, cfg) -> Optional[int]:
        """The sliding window (positions) of the model that ``cfg`` (a ``TrainConfig``) trains, None when no layer
        slides; read before any stage trains, after ``check_model_options``."""
        return None


# ---------------------------------------------------------------------- the registry

# name -> "module:attribute" of its ModelKind, loaded on first use; asked in this order which kind holds a folder.
_SPECS: dict[str, str] = {
    "hf": "kforcing_kernels.app.hf_recipe.kind:KIND",
    "native": "kforcing_kernels.app.native:KIND",
}
_LOADED: dict[str, ModelKind] = {}


def register_kind(name: str, where: str | ModelKind) -> None:
    """Add (or replace) a kind: ``where`` is a :class:`ModelKind` or ``"module:attribute"`` naming one."""
    if not isinstance(where, (str, ModelKind)):
        raise ValueError(f"where: expected a ModelKind or 'module:attribute', got {type(where).__name__}")
    _SPECS[name] = where if isinstance(where, str) else f"<registered {type(where).__name__}>"
    _LOADED.pop(name, None)
    if isinstance(where, ModelKind):
        _LOADED[name] = where


def unregister_kind(name: str) -> None:
    """Remove the kind called ``name`` (one :func:`register_kind` added: tests, a plugin unloaded; removing a
    built-in kind removes it for the process). An unknown name: ValueError naming the known ones."""
    if name not in _SPECS:
        raise ValueError(f"kind: expected one of {kind_names()}, got {name!r}")
    del _SPECS[name]
    _LOADED.pop(name, None)


def kind_names() -> tuple[str, ...]:
    return tuple(_SPECS)


def kind_named(name: str) -> ModelKind:
    """The registered kind called ``name`` (ValueError naming the known ones otherwise)."""
    if name not in _SPECS:
        raise ValueError(f"kind: expected one of {kind_names()}, got {name!r}")
    if name not in _LOADED:
        module, _, attribute = _SPECS[name].partition(":")
        _LOADED[name] = getattr(importlib.import_module(module), attribute)
    return _LOADED[name]


def kind_of(model: Union[Student, nn.Module]) -> ModelKind:
    """The kind of a model (its ``kind`` attribute, a :class:`Student`'s; DDP and torch.compile wrappers are looked
    through; a module that declares none is the default kind's)."""
    return kind_named(getattr(unwrap(model), "kind", DEFAULT_KIND))


def kind_of_config(model_config: dict) -> ModelKind:
    """The registered kind that claims a checkpoint's saved model config (:meth:`ModelKind.holds_config`), else the
    default kind."""
    for name in _SPECS:
        if name != DEFAULT_KIND and kind_named(name).holds_config(model_config):
            return kind_named(name)
    return kind_named(DEFAULT_KIND)


def recorded_kind(folder) -> Optional[str]:
    """The registered kind a stage folder's ``model.json`` names (``model_kind``, written by every kind's
    :meth:`ModelKind.save`), or None (no such record: a source folder, or a stage saved before it was recorded; a
    ``model.json`` that is not a JSON object is left to the kind's loader, which names what is wrong with it).

    A ``model_kind`` that is not a string, or names no registered kind, raises ``ValueError`` naming the file, the
    entry and the known kinds (as ``files.check_fields`` words it; this module imports nothing of the app): the folder
    was written by a kind this process does not have (register it first, :func:`register_kind`), or edited; loading
    it as another kind would read its files wrongly."""
    path = Path(folder) / "model.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("model_kind") is None:
        return None
    name, known = record["model_kind"], ", ".join(kind_names())
    if not isinstance(name, str):
        raise ValueError(
            f"{path}: malformed: 'model_kind' has type {type(name).__name__}, expected str (one of the registered "
            f"kinds: {known})"
        )
    if name not in _SPECS:
        raise ValueError(
            f"{path}: malformed: 'model_kind' is {name!r}, expected one of the registered kinds ({known}); a folder "
            "of another kind loads once that kind is registered (student.register_kind)"
        )
    return name


def find_kind(folder) -> Optional[ModelKind]:
    """The kind that recognises ``folder``, or None (no folder, or no model in it): the kind its ``model.json``
    names, else the first whose :meth:`ModelKind.holds` says so."""
    if folder is None or not Path(folder).is_dir():
        return None
    recorded = recorded_kind(folder)
    if recorded is not None:
        return kind_named(recorded)
    for name in _SPECS:
        kind = kind_named(name)
        if kind.holds(folder):
            return kind
    return None


def kind_of_folder(folder) -> ModelKind:
    """:func:`find_kind`, or the default kind (whose loader then says what the folder lacks)."""
    return find_kind(folder) or kind_named(DEFAULT_KIND)


def load_student(folder, device="cpu") -> tuple[Student, dict, Any]:
    """``(model in eval mode, info, tokenizer)`` of any kind's model folder."""
    return kind_of_folder(folder).load(folder, device)


def stage_kind(cfg) -> ModelKind:
    """The kind a stage of ``cfg`` (a ``TrainConfig``) trains: the kind of ``--model`` (the source every stage of its
    run descends from), the kind that reads ``--model-config``, the teacher's for a distilled stage, else the default. A
    teacher folder not trained yet (a later stage of a pipeline, asked early) counts as the default kind."""
    if cfg.model:
        return kind_of_folder(cfg.model)
    if cfg.model_config:
        return next(k for k in map(kind_named, _SPECS) if k.reads_config_files)
    if cfg.stage != "stage0" and cfg.teacher:
        return kind_of_folder(cfg.teacher)
    return kind_named(DEFAULT_KIND)


def corpus_for(teacher, data: Optional[str], vocab_size: int, verbose: bool = False) -> "Corpus":
    """The text of a stage whose teacher is ``teacher`` (None at stage0): as the teacher's kind encodes it."""
    return kind_of_folder(teacher).corpus(teacher, data, vocab_size, verbose=verbose)


def check_model_options(model: Optional[str], model_config: Optional[str]) -> None:
    """Every kind checks the ``--model`` / ``--model-config`` it reads: a usage error before a stage folder is made."""
    if model is None and model_config is None:  # nothing to check: no kind is loaded for it
        return
    for name in _SPECS:
        kind_named(name).check_options(model, model_config)
