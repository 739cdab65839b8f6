"""The GPU check's steps as data (``STEPS``): each step's module and arguments on the GPU and in the CPU dry run,
its call and budget (bench/gpu/check.py, ``python -m bench gpu-check``, runs them; its docstring gives the plan)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Step:
    """One step: a Python module run as ``python <argv>`` (``{work}``: the work folder; ``{test:NAME}``: the path of
    test file NAME under python_tests/, wherever the tests' regroup put it).

    call: 1 or 2 (the planned calls) or 0 (an extra: runs only when named by ``--only`` or in the dry run).
    budget_s: the planned seconds (its cap on the GPU). dry_argv: the CPU command of the dry run. pending: arguments
    another branch adds to the module; appended only where the module's parser accepts them (so the plan runs on
    either side of that merge), and reported when it does not. placeholder: the command is a stand-in another branch
    replaces (named in ``note``)."""

    name: str
    call: int
    budget_s: int
    argv: tuple[str, ...]
    dry_argv: tuple[str, ...]
    note: str = ""
    pending: tuple[str, ...] = ()
    placeholder: bool = False

    @property
    def module(self) -> str:
        """The module ``python -m`` runs (``bench``: the command line of ``python -m bench <command>``)."""
        return self.argv[1]

    @property
    def command(self) -> str:
        """The ``python -m bench`` command (``gpu``, ``train``, ...), else the module."""
        return self.argv[2] if self.module == "bench" else self.module


def _m(module: str, *args: str) -> tuple[str, ...]:
    return ("-m", module, *args)


_SHAPES = ("--layout", "single", "--n", "1024", "8192", "--k", "4", "--dim", "64", "128", "--batch-size", "1",
           "--heads", "16")
_DRY_SHAPES = ("--layout", "single", "--n", "1024", "--k", "4", "--dim", "64", "--batch-size", "1", "--heads", "2")
_AB_METHODS = ("--methods", "triton", "flex", "flex_backend", "--variants", "bench/gpu/gpu_variants.txt")
_TRAIN = ("--device", "cuda", "--preset", "paper", "--batch-size", "4", "--ours", "triton", "--warmup", "1",
          "--reps", "3", "--max-seconds", "15", "--no-progress")
_DRY_TRAIN = ("--device", "cpu", "--preset", "micro", "--seq-len", "16", "--batch-size", "1", "--warmup", "0",
              "--reps", "1", "--max-seconds", "1", "--no-progress")
_TABLE = ("--layout", "single", "--n", "1024", "4096", "8192", "--k", "2", "4", "8", "--batch-size", "1", "--heads",
          "16", "--methods", "triton", "flex", "sdpa_flash_causal", "dense_sdpa")
_DRY_TABLE = ("--layout", "single", "--n", "1024", "--k", "2", "--batch-size", "1", "--heads", "2", "--methods",
              "triton", "flex", "sdpa_flash_causal", "dense_sdpa", "--dry-run")

STEPS: tuple[Step, ...] = (
    # ---------------------------------------------------------------- call 1 (<= 480 s), by value
    Step("versions", 1, 15, _m("bench", "gpu-script", "versions"), _m("bench", "gpu-script", "versions"),
         "packages, the GPU, tile sets, composite_cuda's kernels, the dispatch table in use (measured: 12 s)"),
    Step("warm", 1, 90, _m("bench", "gpu", "--warm", *_SHAPES, *_AB_METHODS, "--json", "{work}/warm.json"),
         _m("bench", "gpu", "--warm", *_DRY_SHAPES, *_AB_METHODS, "--json", "{work}/warm.json", "--dry-run"),
         "compiles and autotunes every kernel the A/B times, so later caps do not pay for it (measured: 84 s)"),
    Step("smoke", 1, 50, _m("bench", "gpu-script", "smoke"), _m("bench", "gpu-script", "smoke", "--dry-run"),
         "bf16 vs float64 within 2x torch's error (composite 3x), bitwise repeatable, both D=128 tile sets, flex, "
         "composite (45 s)"),
    Step("pytest_gpu", 1, 90,
         _m("pytest", "{test:test_triton_gpu.py}", "-q", "-p", "no:cacheprovider", "-rfEs", "--durations=10",
            "--maxfail=4", "--junitxml={work}/pytest_gpu.xml"),
         _m("pytest", "{test:test_triton_gpu.py}", "-q", "-p", "no:cacheprovider", "--collect-only"),
         "the CUDA tests; cold it compiles its own shapes (timed out at 80 s; 35 s warm)"),
    Step("int64_offsets", 1, 15, _m("bench", "gpu-script", "int64"),
         _m("bench", "gpu-script", "int64", "--dry-run"), "> 2^31 elements per tensor (measured: 12 s)"),
    Step("batch_invariance", 1, 35,
         _m("bench", "batch-invariance", "--n", "1024", "--k", "4", "--dims", "64", "128", "--batch-sizes", "2,4,8,16",
            "--json", "{work}/batch_invariance.json"),
         _m("bench", "batch-invariance", "--n", "4", "--k", "2", "--dims", "32", "--batch-sizes", "2", "--json",
            "{work}/batch_invariance.json", "--device", "cpu", "--backend", "triton", "--layouts", "single",
            "--heads", "1", "--teacher-n", "8"),
         "bitwise batch invariance, forward and backward, every config forced; teacher targets (measured: 28 s)"),
    Step("ab", 1, 45, _m("bench", "gpu", *_SHAPES, *_AB_METHODS, "--json", "{work}/bench_ab.json"),
         _m("bench", "gpu", *_DRY_SHAPES, *_AB_METHODS, "--json", "{work}/bench_ab.json", "--dry-run"),
         "the default vs compiled FlexAttention (direct and backend='flex') and gpu_variants.txt (42 s)"),
    Step("profile", 1, 50,
         _m("bench", "profile", "--layout", "single", "--n", "1024", "8192", "--k", "4", "--dim", "64", "128",
            "--methods", "triton", "flex_backend", "--reps", "5", "--json", "{work}/profile.json"),
         _m("bench", "profile", "--layout", "single", "--n", "1024", "--k", "4", "--dim", "64", "--methods",
            "triton", "flex_backend", "--reps", "5", "--json", "{work}/profile.json", "--dry-run"),
         "per-kernel GPU time vs host enqueue, all four shapes, the default and backend='flex' (with every variant "
         "it reached one shape in 45 s: the variants' profile is the extra step profile_variants)"),
    Step("dispatch_table", 1, 10,
         _m("bench", "dispatch-table", "{work}/bench_ab.json", "--out", "{work}/dispatch_table.json", "--command",
            "python -m bench gpu-check"),
         _m("bench", "dispatch-table", "{work}/bench_ab.json", "--out", "{work}/dispatch_table.json", "--command",
            "python -m bench gpu-check"),
         "the A/B's winners with their provenance (measured: 9 s)"),
    Step("train_n1024", 1, 40,
         _m("bench", "train", *_TRAIN, "--seq-len", "1024", "--k", "2", "--out", "{work}/train_n1024"),
         _m("bench", "train", *_DRY_TRAIN, "--k", "1", "--out", "{work}/train_n1024"),
         "paper backbone (12 x 768), N=1024, B=4, teacher k 2 -> student 4, activation checkpointing (34 s measured "
         "without it)", pending=("--ac",)),
    Step("train_n4096", 1, 40,
         _m("bench", "train", *_TRAIN, "--seq-len", "4096", "--k", "4", "--out", "{work}/train_n4096"),
         _m("bench", "train", *_DRY_TRAIN, "--k", "2", "--out", "{work}/train_n4096"),
         "N=4096, B=4, k 4 -> 8 with activation checkpointing (without it: out of memory, 38 s)", pending=("--ac",)),
    # ---------------------------------------------------------------- call 2 (<= 240 s)
    Step("serving", 2, 150,
         _m("bench", "infer", "--paper", "--device", "cuda", "--compile", "cudagraph", "--hf", "eager", "--hf-reps",
            "1", "--no-progress", "--out", "{work}/serving"),
         _m("bench", "infer", "--quick", "--device", "cpu", "--batch-sizes", "2", "--new-tokens", "4", "--warmup",
            "0", "--reps", "1", "--hf", "eager", "--no-progress", "--out", "{work}/serving"),
         "K-Forcing's Table 1 protocol (issue 50): paper backbone, bf16, 64-token prompts to 1,024 tokens, AR and "
         "k = 2 / 4 on both caches at batch 4 / 16 / 128, the decode step captured in a CUDA graph, 1 warm-up + 3 "
         "timed runs, each row written as it finishes; + HF generate (static cache, eager) timed once; estimated "
         "~2 min (the eager step took > 170 s for batch 4 alone)"),
    Step("table_d64", 2, 45, _m("bench", "gpu", *_TABLE, "--dim", "64", "--json", "{work}/table_d64.json"),
         _m("bench", "gpu", *_DRY_TABLE, "--dim", "64", "--json", "{work}/table_d64.json"),
         "the README table (render: python -m bench gpu --render table_d*.json)"),
    Step("table_d128", 2, 45, _m("bench", "gpu", *_TABLE, "--dim", "128", "--json", "{work}/table_d128.json"),
         _m("bench", "gpu", *_DRY_TABLE, "--dim", "64", "--json", "{work}/table_d128.json"),
         "the README table at D=128"),
    # ---------------------------------------------------------------- extras (--only NAME), not in either call
    Step("serving_capture", 0, 150,
         _m("pytest", "{test:test_static_step_cuda.py}", "-q", "-p", "no:cacheprovider", "-rfEs",
            "--junitxml={work}/serving_capture.xml"),
         _m("pytest", "{test:test_static_step_cuda.py}", "-q", "-p", "no:cacheprovider", "--collect-only"),
         "issue 50: a CUDA-graph replay gives the eager step's bits, the compiled step (reduce-overhead) the eager "
         "tokens, AR and k = 4, both caches (inductor compiles: minutes)"),
    Step("sampler", 0, 20, _m("bench", "gpu-script", "sampler"),
         _m("bench", "gpu-script", "sampler", "--dry-run"),
         "the Triton sampler vs float64 (equal on the H200, 13 s)"),
    Step("profile_variants", 0, 120,
         _m("bench", "profile", "--layout", "single", "--n", "1024", "8192", "--k", "4", "--dim", "64", "128",
            "--methods", "triton", "flex_backend", "--variants", "bench/gpu/gpu_variants.txt", "--reps", "5", "--json",
            "{work}/profile_variants.json"),
         _m("bench", "profile", "--layout", "single", "--n", "1024", "--k", "4", "--dim", "64", "--methods",
            "triton", "flex_backend", "--variants", "bench/gpu/gpu_variants.txt", "--reps", "5", "--json",
            "{work}/profile_variants.json", "--dry-run"),
         "the profile of every variant too (one shape took 45 s)"),
    Step("grid_d128", 0, 30,
         _m("bench", "gpu", "--layout", "single", "--n", "1024", "4096", "8192", "--k", "2", "4", "8", "--dim",
            "128", "--batch-size", "1", "--heads", "16", "--methods", "triton", "sdpa_flash_causal", "fa2_causal",
            "--triton-tiles", "auto", "base", "--json", "{work}/bench_single_d128.json"),
         _m("bench", "gpu", "--layout", "single", "--n", "1024", "--k", "2", "--dim", "64", "--batch-size", "1",
            "--heads", "2", "--methods", "triton", "sdpa_flash_causal", "fa2_causal", "--triton-tiles", "auto",
            "base", "--json", "{work}/bench_single_d128.json", "--dry-run"),
         "triton (auto and base tiles) vs SDPA flash causal and flash-attn (21 s)"),
    Step("in_tile", 0, 25,
         _m("bench", "gpu", "--layout", "single", "double", "--n", "1024", "8192", "--k", "2", "4", "--dim", "128",
            "--batch-size", "1", "--heads", "16", "--methods", "triton", "--slot-window-max", "0", "--json",
            "{work}/bench_in_tile_d128.json"),
         _m("bench", "gpu", "--layout", "single", "double", "--n", "1024", "--k", "2", "--dim", "64",
            "--batch-size", "1", "--heads", "2", "--methods", "triton", "--slot-window-max", "0", "--json",
            "{work}/bench_in_tile_d128.json", "--dry-run"),
         "every window's intra part in-tile: the slot-step threshold (16 s)"),
    Step("composite_dense", 0, 25,
         _m("bench", "gpu", "--layout", "single", "--n", "1024", "2048", "--k", "4", "--dim", "64", "128",
            "--batch-size", "1", "--heads", "16", "--methods", "triton", "sdpa_flash_causal", "composite",
            "dense_sdpa", "--json", "{work}/bench_composite_dense.json"),
         _m("bench", "gpu", "--layout", "single", "--n", "1024", "--k", "4", "--dim", "64", "--batch-size", "1",
            "--heads", "2", "--methods", "triton", "sdpa_flash_causal", "composite", "dense_sdpa", "--json",
            "{work}/bench_composite_dense.json", "--dry-run"),
         "the composite CUDA path and dense-mask SDPA (18 s)"),
)


def steps_of(call: int) -> list[Step]:
    return [s for s in STEPS if s.call == call]


def planned_seconds(call: int) -> int:
    """The sum of a call's step budgets (what its deadline is)."""
    return sum(s.budget_s for s in steps_of(call))
