"""The install routes, run as a user would run them (pip, python -m build) in scratch venvs.

* The sdist (``python -m build --sdist``) holds what a build needs: csrc/ sources and
  headers, third_party/, LICENSE, README, CHANGELOG, pyproject.toml; no binaries.
* sdist -> ``pip wheel --no-build-isolation`` (compiles the extension against this torch)
  -> ``pip install`` the wheel into a fresh venv -> ``backends_available()["cpp"] is None``;
  the wheel carries a stripped ``.so``, ``py.typed`` and the LICENSE.
* A plain, isolated ``pip install`` (pip's default, torch not importable in the build)
  fails, printing why and both ways out; it never installs silently without the extension.
* ``KFORCING_BUILD_EXT=0`` with the isolated install installs the pure-Python package on
  purpose; ``backends_available()["cpp"]`` then says the extension is missing.
* Importing the package and its ops needs torch only (the extras stay optional).

The venvs reuse this interpreter's packages (torch included) through a ``.pth`` file,
so nothing large is downloaded; an isolated build fetches setuptools/wheel from the
configured package index. Marked slow (the wheel route compiles the extension, about
2-3 minutes on 2 quiet cores); ``make test`` and CI run them.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import tarfile
import textwrap
import zipfile

import pytest

from helpers import REPO

ROOT = str(REPO)
VERSION = re.search(r'__version__ = "([^"]+)"', open(os.path.join(ROOT, "kforcing_kernels", "__init__.py")).read())[1]

CHECK_INSTALLED = textwrap.dedent(
    """
    import json, os, warnings
    warnings.simplefilter("ignore")
    import kforcing_kernels, torch
    from kforcing_kernels import WindowLayout, backends_available, window_attention
    layout = WindowLayout.kforcing_single(6, 2)
    q = torch.randn(1, 2, layout.n_queries, 8, dtype=torch.float64)
    out = window_attention(q, q, q, layout, backend="composite")
    ref = window_attention(q, q, q, layout, backend="reference")
    assert torch.allclose(out, ref), "composite != reference"
    cpp = backends_available()["cpp"]
    if cpp is None:
        assert torch.allclose(window_attention(q, q, q, layout, backend="cpp"), ref), "cpp != reference"
    print(json.dumps({"file": kforcing_kernels.__file__, "version": kforcing_kernels.__version__, "cpp": cpp}))
    """
)


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KFORCING_BUILD_EXT", "KFORCING_DISABLE_EXT")}
    env.update(PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


def _run(cmd, cwd, timeout=300, **env):
    return subprocess.run(cmd, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=timeout)


def _ok(proc):
    assert proc.returncode == 0, f"{proc.args}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    return proc


def _site_dirs():
    return [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)]


def make_venv(path):
    """A venv whose own site-packages comes first, then this interpreter's (torch, pip, setuptools).

    ``--without-pip``: pip comes from this interpreter's packages too, and the venv's
    bundled (old) setuptools does not shadow the one the build needs.
    """
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", path], cwd=os.path.dirname(path), timeout=120))
    python = os.path.join(path, "bin", "python")
    site = _ok(
        _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=path)
    ).stdout.strip()
    with open(os.path.join(site, "_parent_site.pth"), "w") as f:
        f.write("\n".join(_site_dirs()) + "\n")
    return python


def installed_state(python, cwd):
    """(module file, version, cpp reason) of the kforcing_kernels that ``python`` imports from ``cwd``."""
    proc = _ok(_run([python, "-c", CHECK_INSTALLED], cwd=cwd))
    state = json.loads(proc.stdout.strip().splitlines()[-1])
    return state["file"], state["version"], state["cpp"]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    try:
        import build  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("the `build` package is not installed (it is in the test extra: pip install .[test])")
    out = tmp_path_factory.mktemp("sdist")
    proc = _run([sys.executable, "-m", "build", "--sdist", "--outdir", str(out), ROOT], cwd=str(out), timeout=600)
    if proc.returncode != 0 and "No matching distribution found" in proc.stdout + proc.stderr:
        pytest.skip("no package index reachable for the isolated sdist build")
    _ok(proc)
    (path,) = glob.glob(str(out / "*.tar.gz"))
    return path


@pytest.mark.slow
def test_sdist_holds_everything_the_build_needs(sdist):
    assert os.path.basename(sdist) == f"kforcing_kernels-{VERSION}.tar.gz"
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    csrc = {
        os.path.basename(p)
        for p in glob.glob(os.path.join(ROOT, "csrc", "*.cpp")) + glob.glob(os.path.join(ROOT, "csrc", "*.h"))
    }
    assert any(n.endswith(".h") for n in csrc) and any(n.endswith(".cpp") for n in csrc)
    missing = sorted(f"csrc/{n}" for n in csrc if f"csrc/{n}" not in names)
    assert not missing, f"sdist lacks {missing}"
    for required in (
        "LICENSE",
        "README.md",
        "CHANGELOG.md",
        "BENCHMARKS.md",
        "pyproject.toml",
        "setup.py",
        "third_party/README.md",
        "kforcing_kernels/__init__.py",
        "kforcing_kernels/py.typed",
        "kforcing_kernels/ops/window_attention/op.py",
        "kforcing_kernels/ops/sampling/op.py",
        "kforcing_kernels/ops/window_attention/dispatch_table.json",
    ):
        assert required in names, f"sdist lacks {required}"
    binaries = [n for n in names if n.endswith((".so", ".o", ".pyc"))]
    assert not binaries, f"sdist carries build outputs: {binaries}"


@pytest.mark.slow
def test_sdist_to_wheel_with_extension_installs_and_runs_cpp(sdist, tmp_path):
    python = make_venv(str(tmp_path / "venv"))
    wheels = tmp_path / "wheels"
    _ok(
        _run(
            [
                python,
                "-m",
                "pip",
                "wheel",
                "--no-cache-dir",
                "--no-build-isolation",
                "--no-deps",
                "-w",
                str(wheels),
                sdist,
            ],
            cwd=str(tmp_path),
            timeout=1500,
        )
    )
    (wheel,) = glob.glob(str(wheels / "*.whl"))
    assert re.search(rf"kforcing_kernels-{re.escape(VERSION)}-cp\d+-cp\d+-linux_\w+\.whl$", wheel), wheel
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        (so_name,) = [n for n in names if re.fullmatch(r"kforcing_kernels/_C\..*\.so", n)]
        so_bytes = whl.read(so_name)
    assert "kforcing_kernels/py.typed" in names
    assert "kforcing_kernels/ops/window_attention/dispatch_table.json" in names  # backend=None on CUDA reads it
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert not any(n.startswith("csrc/") for n in names)
    # The release build carries no debug info and no symbol table (15.6 MB -> 0.53 MB).
    assert b".debug_info" not in so_bytes and b".symtab" not in so_bytes
    assert len(so_bytes) < 4 * 2**20, f"{len(so_bytes) / 2**20:.1f} MB: not a stripped release build"

    _ok(
        _run(
            [python, "-m", "pip", "install", "--no-cache-dir", "--no-deps", "--ignore-installed", wheel],
            cwd=str(tmp_path),
            timeout=300,
        )
    )
    where, version, cpp = installed_state(python, str(tmp_path))
    assert where.startswith(str(tmp_path / "venv")), where
    assert version == VERSION
    assert cpp is None, f"the wheel's extension does not load: {cpp}"


@pytest.mark.slow
def test_isolated_install_fails_loudly_without_torch(sdist, tmp_path):
    python = make_venv(str(tmp_path / "venv"))
    proc = _run(
        [python, "-m", "pip", "install", "--no-cache-dir", "--no-deps", "--ignore-installed", sdist],
        cwd=str(tmp_path),
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    if "No matching distribution found for setuptools" in output:
        pytest.skip("no package index reachable for pip's isolated build environment")
    assert proc.returncode != 0, "an isolated install without torch must not succeed:\n" + output[-3000:]
    assert "cannot build the C++ extension kforcing_kernels._C" in output, output[-3000:]
    assert "torch is not importable" in output
    assert "pip install --no-build-isolation" in output and "KFORCING_BUILD_EXT=0" in output
    assert not glob.glob(str(tmp_path / "venv" / "lib" / "python*" / "site-packages" / "kforcing_kernels*"))


@pytest.mark.slow
def test_isolated_install_without_extension_on_request(sdist, tmp_path):
    python = make_venv(str(tmp_path / "venv"))
    proc = _run(
        [python, "-m", "pip", "install", "--no-cache-dir", "--no-deps", "--ignore-installed", sdist],
        cwd=str(tmp_path),
        timeout=600,
        KFORCING_BUILD_EXT="0",
    )
    if "No matching distribution found for setuptools" in proc.stdout + proc.stderr:
        pytest.skip("no package index reachable for pip's isolated build environment")
    _ok(proc)
    where, version, cpp = installed_state(python, str(tmp_path))
    assert where.startswith(str(tmp_path / "venv")), where
    assert version == VERSION
    assert cpp is not None and "kforcing_kernels._C is not available" in cpp
    pkg = os.path.dirname(where)
    assert os.path.exists(os.path.join(pkg, "py.typed"))
    assert not glob.glob(os.path.join(pkg, "_C*.so"))


def test_core_import_needs_only_torch(tmp_path):
    """The ops, model, SDPA entry point and extension loader import and run with every extra absent
    (numpy is a core dependency: the op keys its layout cache on ``Tensor.numpy()`` bytes)."""
    code = textwrap.dedent(
        """
        import sys
        for name in ("triton", "tokenizers", "safetensors", "tqdm", "transformers", "matplotlib"):
            sys.modules[name] = None  # makes `import name` raise ImportError
        import torch
        import kforcing_kernels, kforcing_kernels.sdpa, kforcing_kernels.model
        from kforcing_kernels import WindowLayout, backends_available, window_attention, inverse_cdf_sample
        reasons = backends_available()
        assert reasons["triton"] and "triton" in reasons["triton"], reasons
        layout = WindowLayout.sbd(8, 4)
        q = torch.randn(1, 2, layout.n_queries, 8)
        out = window_attention(q, q, q, layout)
        assert out.shape == q.shape
        print("ok", kforcing_kernels.__version__)
        """
    )
    proc = _ok(_run([sys.executable, "-c", code], cwd=str(tmp_path), PYTHONPATH=ROOT))
    assert proc.stdout.strip() == f"ok {VERSION}"


def test_one_version_source():
    """pyproject.toml takes the version from kforcing_kernels.__version__; no other file states one."""
    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
    assert 'dynamic = ["version"]' in pyproject
    assert 'version = { attr = "kforcing_kernels.__version__" }' in pyproject
    assert not re.search(r"^version\s*=\s*['\"]", pyproject, re.M)
    assert "version=" not in open(os.path.join(ROOT, "setup.py")).read()
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION)
    assert f"## [{VERSION}]" in open(os.path.join(ROOT, "CHANGELOG.md")).read()
