"""What the Hugging Face kind (app/hf_recipe/kind.py) can and cannot do in generation, said by name: its students decode
over their own KV cache, so the package's paged server and the cache / page_size / compile_step options are refused
naming the option and the kind (before: PagedGenerator ended in ``AttributeError: 'LlamaConfig' object has no
attribute 'n_layer'``, and cache= / page_size= were silently ignored)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kforcing_kernels.integrations.hf  # noqa: E402,F401  (registers attn_implementation="kforcing")
from kforcing_kernels.app.generation.inference import generate_ar, generate_kforcing  # noqa: E402
from kforcing_kernels.app.generation.serving import PagedGenerator  # noqa: E402
from kforcing_kernels.app.hf_recipe.student import HFStudent  # noqa: E402
from kforcing_kernels.app.student import CapabilityError, kind_of  # noqa: E402

VOCAB = 48


@pytest.fixture(scope="module")
def student():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="kforcing", dtype=torch.float32)
    return HFStudent(model, k_train=2).eval()


def test_paged_generator_refuses_an_hf_student_by_name(student):
    with pytest.raises(CapabilityError, match="model: a Hugging Face student .* is not served by PagedGenerator"):
        PagedGenerator(student, 2, num_pages=16)


@pytest.mark.parametrize(
    "option, match",
    [
        ({"cache": "paged"}, "cache: a Hugging Face student .* decodes over its own KV cache only"),
        ({"cache": "contiguous"}, "cache: a Hugging Face student .* decodes over its own KV cache only"),
        ({"page_size": 4}, "page_size: a Hugging Face student .* has no paged cache"),
        ({"compile_step": True}, "compile_step: a Hugging Face student .* decodes with its own KV cache"),
    ],
)
def test_generation_options_it_cannot_honour_are_refused(student, option, match):
    prompts = [[1, 2, 3], [4, 5, 6]]
    with pytest.raises(ValueError, match=match):
        generate_kforcing(student, prompts, 2, 4, temperature=1.0, **option)
    student.k_train, k_train = 0, student.k_train
    try:
        with pytest.raises(ValueError, match=match):
            generate_ar(student, prompts, 4, temperature=0, **option)
    finally:
        student.k_train = k_train


def test_ragged_prompts_equal_each_prompt_alone(student):
    """Prompts of several lengths (run as groups of one length, documented in hf_recipe/student.py): each row equals
    that prompt decoded alone with its own noise (fp32)."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 5, 3, 7)]
    noise = torch.rand(len(prompts), 3, 2, generator=gen)
    together = generate_kforcing(student, prompts, 2, 6, temperature=0.8, noise=noise)
    for i, prompt in enumerate(prompts):
        alone = generate_kforcing(student, [prompt], 2, 6, temperature=0.8, noise=noise[i : i + 1])
        assert together[i].tolist() == alone[0].tolist()


def test_the_kind_answers_what_the_generic_code_asks(student):
    kind = kind_of(student)
    assert kind.generation_options(None, None, False) == {"cache": None, "page_size": None, "compile_step": False}
    config = kind.config_dict(student)
    assert config["vocab_size"] == VOCAB and config["model_type"] == "llama"
    assert kind.decode_rule(student) == "argmax"
    with pytest.raises(CapabilityError, match="model: a Hugging Face student .* without a tokenizer"):
        kind.eos_id(student, None)  # built here, not loaded from a folder: no tokenizer names its EOS
