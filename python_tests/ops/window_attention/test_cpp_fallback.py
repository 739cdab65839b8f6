"""Without the C++ extension (disabled, or failing to import) everything falls back to Python.

Each case runs in a subprocess: the extension is loaded once per process.
"""

import os
import subprocess
import sys
import textwrap

from helpers import REPO

ROOT = str(REPO)

USE_PACKAGE = textwrap.dedent(
    """
    import warnings
    warnings.simplefilter("always")
    import torch
    from kforcing_kernels import WindowLayout, backends_available, default_backend, window_attention
    from kforcing_kernels.ops.sampling import inverse_cdf_sample, noise_inversion, sampler_backend

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reason = backends_available()["cpp"]
        layout = WindowLayout.kforcing_single(6, 2)
        q = torch.randn(1, 2, layout.n_queries, 8, requires_grad=True)
        out = window_attention(q, q.detach(), q.detach(), layout)
        out.sum().backward()
        ref = window_attention(q, q.detach(), q.detach(), layout, backend="reference")
        logits = torch.randn(4, 50)
        tokens = inverse_cdf_sample(logits, torch.rand(4))
        assert torch.equal(inverse_cdf_sample(logits, noise_inversion(logits, tokens)), tokens)
    ext_warnings = [str(w.message) for w in caught if "kforcing_kernels._C" in str(w.message)]
    assert reason is not None
    assert default_backend(torch.device("cpu")) == "composite"
    assert sampler_backend("cpu") == "reference"
    assert torch.allclose(out, ref, atol=1e-5)
    print("REASON:", reason)
    print("WARNINGS:", len(ext_warnings), ext_warnings)
    """
)


def _run(code, **env):
    full_env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=300)


def test_disabled_extension_falls_back_silently():
    proc = _run(USE_PACKAGE, KFORCING_DISABLE_EXT="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REASON: disabled by KFORCING_DISABLE_EXT=1" in proc.stdout
    assert "WARNINGS: 0" in proc.stdout


def test_broken_extension_warns_once_and_falls_back():
    # A None entry in sys.modules makes `import kforcing_kernels._C` raise ImportError,
    # as a missing or unloadable shared object would.
    proc = _run("import sys; sys.modules['kforcing_kernels._C'] = None\n" + USE_PACKAGE, KFORCING_DISABLE_EXT="0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REASON: kforcing_kernels._C is not available" in proc.stdout
    assert "WARNINGS: 1" in proc.stdout, proc.stdout


def test_my_suites_pass_with_the_extension_disabled():
    """The sampler suite exercises the torch fallback; the cpp suite reports itself skipped."""
    suites = [
        os.path.join(ROOT, "python_tests", "ops", "sampling", "test_sampling.py"),
        os.path.join(ROOT, "python_tests", "ops", "window_attention", "test_cpp_attention.py"),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *suites],
        env=dict(os.environ, KFORCING_DISABLE_EXT="1"),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
