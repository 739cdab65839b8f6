"""Random-weight K-Forced stage folders for the vLLM bench and tests (no downloads): a Llama / Qwen2 / Mistral
backbone, a random noise embedding, a word-level tokenizer of the model's vocabulary, written by the package's
own ``save_pflm`` (so the folder is exactly what kforcing-train writes); and the native model's stage
(:func:`build_native_stage`, written by the package's ``save_model``)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

VOCAB = 96


def tokenizer(vocab: int = VOCAB, eos: str = "<eos>"):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab - 1)}
    words[eos] = vocab - 1
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, unk_token="w0")


def config(family: str, vocab: int = VOCAB, hidden: int = 64, layers: int = 2, heads: int = 2, **extra):
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=512,
        eos_token_id=vocab - 1,
        bos_token_id=0,
        tie_word_embeddings=False,
        **extra,
    )
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "mistral": transformers.MistralConfig}
    if family == "mistral":
        common.setdefault("sliding_window", None)
    return cls[family](**common)


def build_stage(folder, family: str = "llama", k: int = 4, seed: int = 0, **config_extra) -> Path:
    """A K-Forced stage folder (k_train = ``k``) with random weights, written by ``save_pflm``."""
    import transformers

    from kforcing_kernels.app.hf_recipe.student import HFStudent
    from kforcing_kernels.app.hf_recipe.trainer import save_pflm

    folder = Path(folder)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(
        config(family, **config_extra), attn_implementation="kforcing", dtype=torch.float32
    )
    # Larger weights than the init's 0.02: random logits with clear margins, so fp32 reorderings between
    # vLLM's kernels and transformers' do not flip an argmax.
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    student = HFStudent(hf.float(), k_train=k)
    with torch.no_grad():
        for p in student.noise_encoder.parameters():
            p.normal_(0.0, 0.3)
    save_pflm(student, folder, tokenizer=tokenizer(config_extra.get("vocab", VOCAB)), k=k)
    return folder


def prompts(count: int = 32, seed: int = 0, low: int = 3, high: int = 40, vocab: int = VOCAB) -> list[list[int]]:
    """``count`` prompts of mixed lengths in [low, high), ids avoiding the EOS (the last id)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g).tolist()
    return [torch.randint(0, vocab - 1, (n,), generator=g).tolist() for n in lengths]


def reference(folder, prompt: list[int], k: int, max_tokens: int, tau: float, seed: int) -> list[int]:
    """The package's own decoding of one prompt: ``generate_kforcing`` (fp32, CPU), noise from ``seed``."""
    from kforcing_kernels.app.generation.inference import generate_kforcing

    model = _loaded(str(folder))
    gen = torch.Generator().manual_seed(seed)
    out = generate_kforcing(model, [prompt], k, max_tokens, temperature=tau, generator=gen)
    return out[0].tolist()


_MODELS: dict = {}


def _loaded(folder: str):
    """The stage of ``folder`` as the package loads it (either kind: ``load_student``), once per folder."""
    from kforcing_kernels.app.student import load_student

    if folder not in _MODELS:
        _MODELS[folder] = load_student(folder)[0]
    return _MODELS[folder]


def build_native_stage(
    folder,
    k: int = 4,
    seed: int = 0,
    vocab: int = VOCAB,
    decode: str = "argmax",
    tie: bool = False,
    backend=None,
    **overrides,
) -> Path:
    """A native K-Forced stage folder (``KForcingLM``, k_train = ``k``) with random weights, written by the package's
    own ``save_model`` with the word-level tokenizer of :func:`tokenizer` as its ``tokenizer.json`` (the run's), or
    ``backend`` (a ``tokenizers.Tokenizer`` of ``vocab`` ids, e.g. a corpus's BPE) in its place. ``k = 0``: an AR
    stage (the teacher, Stage 0)."""
    from kforcing_kernels.app.data import EOS
    from kforcing_kernels.app.files import tokenizer_sha256
    from kforcing_kernels.app.training.checkpoint import save_model
    from kforcing_kernels.model import KForcingLM, ModelConfig

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if backend is None:
        backend = tokenizer(vocab, eos=EOS).backend_tokenizer
    backend.save(str(folder / "tokenizer.json"))
    cfg = dict(vocab_size=vocab, n_layer=2, n_head=2, n_embd=64, seq_len=256, noise_features=16, tau_features=8)
    model = KForcingLM(ModelConfig.micro(**{**cfg, "decode": decode, "tie_embeddings": tie, **overrides}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # wide random weights (see build_stage): clear argmax margins
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if name.startswith("noise_encoder.") else 0.15))
    info = {"kind": "pflm" if k else "ar", "k": k, "tokenizer_sha256": tokenizer_sha256(backend)}
    save_model(folder, model, {**info, "model_kind": "native"})
    return folder
