"""Build for kforcing_kernels, with the optional C++ extension ``kforcing_kernels._C``.

The extension is built from csrc/*.cpp with torch's cpp_extension (pybind11 + ninja,
OpenMP on) when torch is importable at build time. Set ``KFORCING_BUILD_EXT=0`` to
skip it; if it is absent at run time the package falls back to the Python backends.
Install with ``pip install --no-build-isolation -e .`` so the build sees your torch.
"""

import glob
import os
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def extensions():
    if os.environ.get("KFORCING_BUILD_EXT", "1") == "0":
        return [], {}
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    if not sources:
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("kforcing_kernels: torch not importable at build time; skipping the C++ extension", file=sys.stderr)
        return [], {}
    # FMA contraction is off under -std=c++17 by default; the kernels rely on it.
    # Wider ISAs (AVX2, AVX-512) are enabled per file (csrc/isa_*.cpp) and picked at run time.
    flags = ["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=fast", "-fno-math-errno", "-Wno-psabi"]
    if os.uname().machine == "x86_64":
        flags.append("-march=x86-64-v2")
    ext = CppExtension(
        "kforcing_kernels._C", sources, extra_compile_args={"cxx": flags}, extra_link_args=["-fopenmp"],
    )

    class OptionalBuildExtension(BuildExtension.with_options(use_ninja=True)):
        """A failed build (no compiler, no OpenMP, ...) warns instead of failing the install."""

        def run(self):
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - any build failure means "no extension"
                print(
                    f"kforcing_kernels: WARNING: building the C++ extension failed ({type(exc).__name__}: {exc}); "
                    "installing without it (the Python backends are used)",
                    file=sys.stderr,
                )

    return [ext], {"build_ext": OptionalBuildExtension}


ext_modules, cmdclass = extensions()

setup(
    name="kforcing_kernels",
    version="0.1.0",
    description="Prefix-window attention kernels for K-Forcing and related parallel-decoding training",
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["kforcing_kernels", "kforcing_kernels.*"]),
    python_requires=">=3.9",
    # torch is a floor, not a pin: an existing torch >= 2.5 is kept. The Makefile
    # installs the CPU wheel torch==2.13.0 first on a machine that has none.
    install_requires=[
        "torch>=2.5",
        "triton>=3.6; platform_system == 'Linux'",  # oldest/newest checked by `make aot-check`
        "numpy",
        "safetensors",
        "tokenizers",
    ],
    extras_require={
        "test": ["pytest", "pytest-benchmark", "hypothesis", "transformers"],
        "plots": ["matplotlib"],
        "hf": ["transformers"],
        "flash": ["flash-attn"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
