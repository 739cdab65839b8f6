"""Builds the C++ extension ``kforcing_kernels._C``; the metadata is in pyproject.toml.

The extension (csrc/*.cpp: pybind11 + ninja, OpenMP) is compiled with torch's
cpp_extension against the torch that is importable at build time, so install with

    pip install --no-build-isolation .        # torch already installed

A build that cannot produce the extension fails with a message saying why and what
to do (torch not importable, as in pip's default isolated build; no compiler; a
compile error). It never installs silently without it. ``KFORCING_BUILD_EXT=0``
skips the extension on purpose: the package then runs on its Python backends and
``kforcing_kernels.backends_available()["cpp"]`` says so.
"""

import glob
import os

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

BUILD_ENV = "KFORCING_BUILD_EXT"
NAME = "kforcing_kernels._C"

HOW_TO = f"""
  * with the extension (the fast CPU backend and sampler): install torch first, then
        pip install --no-build-isolation <this package>
    so that the build sees your torch (pip's default build isolation hides it);
  * without it (pure Python; every op still works on the composite/reference backends):
        {BUILD_ENV}=0 pip install <this package>"""


def _fail(why: str):
    bar = "=" * 78
    raise SystemExit(f"\n{bar}\nkforcing_kernels: cannot build the C++ extension {NAME}: {why}\n{HOW_TO}\n{bar}\n")


def extensions():
    if os.environ.get(BUILD_ENV, "1") == "0":
        return [], {}
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    if not sources:
        _fail("no csrc/*.cpp next to setup.py (an incomplete source tree or sdist)")
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as exc:
        # Metadata and sdist builds need no torch; only building the extension does.
        # Declare it with a build_ext that stops the build with the reason.
        why = f"torch is not importable in this build environment ({exc})"

        class NoTorchBuildExt(build_ext):
            def run(self):
                _fail(why)

        return [Extension(NAME, sources)], {"build_ext": NoTorchBuildExt}

    # Release build: -O3, no debug info (-g0 overrides the -g in Python's CFLAGS) and a
    # stripped link (-s): 15.6 MB -> 0.53 MB. FMA contraction is off under -std=c++17 by
    # default; the kernels rely on it. Wider ISAs (AVX2, AVX-512) are enabled per file
    # (csrc/isa_*.cpp) and picked at run time.
    flags = ["-O3", "-g0", "-std=c++17", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno", "-Wno-psabi"]
    if os.uname().machine == "x86_64":
        flags.append("-march=x86-64-v2")
    ext = CppExtension(NAME, sources, extra_compile_args={"cxx": flags}, extra_link_args=["-fopenmp", "-s"])

    class LoudBuildExtension(BuildExtension.with_options(use_ninja=True)):
        """A failed compile (no compiler, no OpenMP, ...) fails the install with the reason."""

        def run(self):
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - report any build failure the same way
                _fail(f"{type(exc).__name__}: {exc}")

    return [ext], {"build_ext": LoudBuildExtension}


# The library and its app. The benchmarks (bench/) are a tool of the checkout, run as `python -m bench`,
# and are not installed.
PACKAGES = find_packages(include=["kforcing_kernels", "kforcing_kernels.*"])

ext_modules, cmdclass = extensions()
setup(packages=PACKAGES, ext_modules=ext_modules, cmdclass=cmdclass)
