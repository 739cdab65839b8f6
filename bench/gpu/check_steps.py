"""The GPU check's steps as data (``STEPS``): each step's module and arguments on the GPU and in the CPU dry run,
its call and budget (bench/gpu/check.py, ``python -m bench gpu-check``, runs them; its docstring gives the plan)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Step:
    """One step: a Python module run as ``python <argv>`` (``{work}``: the work folder; ``{test:NAME}``: the path of
    test file NAME under python_tests/, wherever the tests' regroup put it).

    call: 1 or 2 (the planned calls) or 0 (an extra: runs only when named by ``--only`` or in a dry run without
    ``--call``). budget_s: the planned seconds (its cap on the GPU). dry_extra: what the CPU dry run appends to
    ``argv`` (``--dry-run`` where the module shrinks its sizes itself, else size and device arguments: argparse takes
    the last of a repeated option); any other difference between the two as the module parses them is named in
    ``dry_differs`` ({argument: why}; test_gpu_check.py fails on an undeclared one). dry_triton: how the dry run runs
    Triton: ``interpret`` (TRITON_INTERPRET=1: real numbers, fp32 / fp16) or ``stub`` (the module installs
    bench/gpu/triton_stub_driver.py: kernels compiled for sm_90a, launches no-ops, CUDA's dtype rules). env: variables
    set for the step (``{work}`` filled in). pending: arguments another branch adds to the module; appended only where
    the module's parser accepts them, reported when it does not. placeholder: the command is a stand-in another
    branch replaces (named in ``note``)."""

    name: str
    call: int
    budget_s: int
    argv: tuple[str, ...]
    dry_extra: tuple[str, ...]
    note: str = ""
    pending: tuple[str, ...] = ()
    placeholder: bool = False
    dry_triton: str = "interpret"
    dry_differs: dict = dataclasses.field(default_factory=dict)
    env: tuple[tuple[str, str], ...] = ()

    @property
    def dry_argv(self) -> tuple[str, ...]:
        """The dry run's command: ``argv`` + ``dry_extra``."""
        return (*self.argv, *self.dry_extra)

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


# The dry run's sizes: what a step's dry_extra may change, with the device (test_gpu_check.py compares each step's
# GPU and dry-run arguments as its module parses them: any other difference must be declared in dry_differs).
SIZE_KEYS = frozenset(
    {
        "device",
        "dry_run",
        "n",
        "k",
        "dim",
        "dims",
        "batch_size",
        "batch_sizes",
        "heads",
        "seq_len",
        "shapes",
        "teacher_n",
        "new_tokens",
        "prompt_len",
        "reps",
        "warmup",
        "max_seconds",
        "hf_reps",
        "override",
    }
)
_DRY = ("--dry-run",)  # modules whose --dry-run shrinks the sizes and moves to CPU, and changes nothing else
_AB_METHODS = (
    "--methods",
    "triton",
    "flex",
    "flex_backend",
    "sdpa_flash_causal",
    "dense_sdpa",
    "--variants",
    "bench/gpu/gpu_variants.txt",
)
# The A/B's shapes by value: N=8192 first (the 1.1x target), k = 4 before 2 and 8; rows are written as they finish.
_AB_SHAPES = ("--layout", "single", "--n", "8192", "1024", "4096", "--k", "4", "2", "8", "--batch-size", "1")
_AB_SHAPES += ("--heads", "16")
_DRY_PAPER = ("--override", "n_layer=1", "--override", "n_embd=128", "--override", "n_head=2")
_DRY_PAPER += ("--override", "vocab_size=512")
_DRY_SERVING = ("--device", "cpu", "--batch-sizes", "2", "--new-tokens", "4", "--warmup", "0", "--reps", "1")
_DRY_SERVING += (*_DRY_PAPER, "--compile", "eager")
# infer's --device is checked when parsed (no "cuda" on a CPU machine): its GPU argv takes the default, auto = cuda.
_NO_CUDA_GRAPH = {"compile": "a CUDA graph needs CUDA: eager on CPU (serving_capture checks the replay on the GPU)"}
_PYTEST = ("-q", "-p", "no:cacheprovider", "-rfEs", "-p", "bench.gpu.pytest_rows")
_COLLECT = ("--collect-only",)  # the CUDA tests skip on CPU: the dry run collects them (imports, parametrization)

STEPS: tuple[Step, ...] = (
    # ---------------------------------------------------------------- call 1: the D=128 A/B, the training step
    Step(
        "versions",
        1,
        10,
        _m("bench", "gpu-script", "versions"),
        (),
        "packages, the GPU, tile sets, composite_cuda's kernels, the dispatch table in use (measured: 12 s)",
    ),
    Step(
        "smoke_d128",
        1,
        45,
        _m("bench", "gpu-script", "smoke", "--dims", "128"),
        _DRY,
        "bf16 vs float64 (<= 2x torch's error), bitwise repeatable, at D=128 with every D=128 tile set forced (base, "
        "wide, wide_n64: each one the A/B times), flex, composite (all of smoke, D 64 + 128: 45 s)",
        dry_triton="interpret",
    ),
    Step(
        "ab_d128",
        1,
        100,
        _m("bench", "gpu", *_AB_SHAPES, "--dim", "128", *_AB_METHODS, "--json", "{work}/ab_d128.json"),
        _DRY,
        "fwd and fwd+bwd TFLOP/s at D=128, N 8192/1024/4096 x k 4/2/8: the default vs compiled FlexAttention "
        "(direct, backend='flex'), SDPA flash causal, dense SDPA, every variant; each method's first call (compile, "
        "autotune) untimed; 9 shapes (4 shapes x 8 methods took 84 s cold + 42 s on the H200: the cap may cut the "
        "last shapes)",
        dry_triton="interpret",
    ),
    Step(
        "train",
        1,
        140,
        _m(
            "bench",
            "train-gpu",  # --device: the default, auto = cuda there (checked when parsed, like infer's)
            "--preset",
            "paper",
            "--batch-size",
            "4",
            "--dtype",
            "bfloat16",
            "--ac",
            "--out",
            "{work}/train",
        ),
        _DRY,
        "paper backbone (12 x 768), B=4, bf16 autocast, AC, chunked loss: N=4096 k 4->8 first, then 1024 k 2->4, "
        "8192 k 4->8, ...; variants ours (dispatch), zero, dense-mask SDPA (N <= 4096), ours[triton], ours[flex]; "
        "peak memory per variant; rows in train/train_gpu.jsonl as they finish (H200: zero 666 ms at N=4096 k 4)",
        dry_triton="stub",
    ),
    Step(
        "dispatch_table",
        1,
        10,
        _m(
            "bench",
            "dispatch-table",
            "{work}/ab_d128.json",
            "--out",
            "{work}/dispatch_table.json",
            "--command",
            "python -m bench gpu-check",
        ),
        (),
        "the A/B's winners with their provenance (measured: 9 s)",
    ),
    Step(
        "batch_invariance",
        1,
        35,
        _m(
            "bench",
            "batch-invariance",
            "--n",
            "8192",
            "--k",
            "4",
            "--dims",
            "128",
            "64",
            "--batch-sizes",
            "2,4,8",
            "--json",
            "{work}/batch_invariance.json",
        ),
        ("--device", "cpu", "--n", "8", "--dims", "32", "--batch-sizes", "2", "--heads", "1", "--teacher-n", "8"),
        "bitwise batch invariance, forward and backward, of the backend the just-written dispatch table picks "
        "(KFORCING_DISPATCH_TABLE; flex included) at N=8192, D 128/64; forced triton configs; teacher targets "
        "(N=1024: 28 s)",
        env=(("KFORCING_DISPATCH_TABLE", "{work}/dispatch_table.json"),),
    ),
    Step(
        "pytest_gpu",
        1,
        40,
        _m(
            "pytest",
            "{test:test_triton_gpu.py}",
            *_PYTEST,
            "--rows-jsonl={work}/pytest_gpu.jsonl",
            "--durations=10",
            "--maxfail=4",
            "--junitxml={work}/pytest_gpu.xml",
        ),
        _COLLECT,
        "the CUDA tests, last: each outcome is a line of pytest_gpu.jsonl as it happens, so a cap that cuts the "
        "cold compile (> 80 s cold, 35 s warm) keeps the tests that ran",
    ),
    # ---------------------------------------------------------------- call 2: serving, then the D=64 A/B
    Step(
        "serving_capture",
        2,
        30,
        _m(
            "pytest",
            "{test:test_static_step_cuda.py}",
            *_PYTEST,
            "--rows-jsonl={work}/serving_capture.jsonl",
            "-k",
            "cuda_graph_replay",
            "--junitxml={work}/serving_capture.xml",
        ),
        _COLLECT,
        "issue 50, before any timing: a CUDA-graph replay gives the eager step's bits, AR and k = 4, both caches",
    ),
    Step(
        "serving",
        2,
        100,
        _m(
            "bench",
            "infer",
            "--paper",
            "--compile",
            "cudagraph",
            "--k",
            "4",
            "--cache",
            "paged",
            "--no-progress",
            "--out",
            "{work}/serving",
        ),
        _DRY_SERVING,
        "Table 1 (issue 50): paper backbone, bf16, 64-token prompts to 1,024 tokens, AR and k = 4 on the paged "
        "cache at batch 4 / 16 / 128, both captured, 1 warm-up + 3 timed runs, rows written as they finish",
        dry_differs=_NO_CUDA_GRAPH,
    ),
    Step(
        "vllm",
        2,
        60,
        _m("bench", "gpu-script", "vllm"),
        (),
        "the vLLM serving step's slot (K-Forcing k = 4 vs vLLM AR, batch 4 / 16 / 128, CUDA graphs): runs only where "
        "kforcing_kernels.integrations.vllm imports and vllm is installed, else logs 'absent' (its 60 s go on to "
        "the next steps)",
        placeholder=True,
    ),
    Step(
        "serving_more",
        2,
        25,
        _m(
            "bench",
            "infer",
            "--paper",
            "--compile",
            "cudagraph",
            "--k",
            "2",
            "--cache",
            "paged",
            "--hf",
            "eager",
            "--hf-reps",
            "1",
            "--no-progress",
            "--out",
            "{work}/serving_more",
        ),
        _DRY_SERVING,
        "k = 2 (with AR again, same run) and the HF generate baseline (static cache, eager, timed once)",
        dry_differs=_NO_CUDA_GRAPH,
    ),
    Step(
        "smoke_d64",
        2,
        20,
        _m("bench", "gpu-script", "smoke", "--dims", "64"),
        _DRY,
        "call 2's own correctness check: every D=64 tile set (base, hopper, hopper128) vs float64, before its A/B",
        dry_triton="interpret",
    ),
    Step(
        "ab_d64",
        2,
        45,
        _m("bench", "gpu", *_AB_SHAPES, "--dim", "64", *_AB_METHODS, "--json", "{work}/ab_d64.json"),
        _DRY,
        "the A/B at D=64 (as ab_d128; the README table renders from both: python -m bench gpu --render ab_d*.json)",
        dry_triton="interpret",
    ),
    # ---------------------------------------------------------------- extras (--only NAME), not in either call
    Step(
        "profile",
        0,
        50,
        _m(
            "bench",
            "profile",
            *_AB_SHAPES[:4],
            "1024",
            "--k",
            "4",
            "--dim",
            "64",
            "128",
            "--methods",
            "triton",
            "flex_backend",
            "--reps",
            "5",
            "--json",
            "{work}/profile.json",
        ),
        _DRY,
        "per-kernel GPU time vs host enqueue, N 8192/1024, the default and backend='flex' (where the time goes)",
        dry_triton="interpret",
    ),
    Step(
        "int64_offsets",
        0,
        15,
        _m("bench", "gpu-script", "int64"),
        _DRY,
        "> 2^31 elements per tensor (OK on the H200, 12 s)",
        dry_triton="interpret",
    ),
    Step(
        "serving_compiled",
        0,
        150,
        _m("pytest", "{test:test_static_step_cuda.py}", *_PYTEST, "--rows-jsonl={work}/serving_compiled.jsonl"),
        _COLLECT,
        "the whole file: the compiled step (reduce-overhead) gives the eager tokens too (inductor compiles: minutes)",
    ),
    Step(
        "sampler",
        0,
        20,
        _m("bench", "gpu-script", "sampler"),
        _DRY,
        "the Triton sampler vs float64 (equal on the H200, 13 s)",
        dry_triton="interpret",
    ),
    Step(
        "profile_variants",
        0,
        120,
        _m(
            "bench",
            "profile",
            *_AB_SHAPES[:4],
            "1024",
            "--k",
            "4",
            "--dim",
            "64",
            "128",
            "--methods",
            "triton",
            "flex_backend",
            "--variants",
            "bench/gpu/gpu_variants.txt",
            "--reps",
            "5",
            "--json",
            "{work}/profile_variants.json",
        ),
        _DRY,
        "the profile of every variant too (one shape took 45 s)",
        dry_triton="interpret",
    ),
    Step(
        "grid_d128",
        0,
        30,
        _m(
            "bench",
            "gpu",
            *_AB_SHAPES,
            "--dim",
            "128",
            "--methods",
            "triton",
            "sdpa_flash_causal",
            "fa2_causal",
            "--triton-tiles",
            "auto",
            "base",
            "--json",
            "{work}/bench_single_d128.json",
        ),
        _DRY,
        "triton (auto and base tiles) vs SDPA flash causal and flash-attn (21 s)",
        dry_triton="interpret",
    ),
    Step(
        "in_tile",
        0,
        25,
        _m(
            "bench",
            "gpu",
            "--layout",
            "single",
            "double",
            "--n",
            "1024",
            "8192",
            "--k",
            "2",
            "4",
            "--dim",
            "128",
            "--batch-size",
            "1",
            "--heads",
            "16",
            "--methods",
            "triton",
            "--slot-window-max",
            "0",
            "--json",
            "{work}/bench_in_tile_d128.json",
        ),
        _DRY,
        "every window's intra part in-tile: the slot-step threshold (16 s)",
        dry_triton="interpret",
    ),
    Step(
        "composite_dense",
        0,
        25,
        _m(
            "bench",
            "gpu",
            "--layout",
            "single",
            "--n",
            "1024",
            "2048",
            "--k",
            "4",
            "--dim",
            "64",
            "128",
            "--batch-size",
            "1",
            "--heads",
            "16",
            "--methods",
            "triton",
            "sdpa_flash_causal",
            "composite",
            "dense_sdpa",
            "--json",
            "{work}/bench_composite_dense.json",
        ),
        _DRY,
        "the composite CUDA path and dense-mask SDPA (18 s)",
        dry_triton="interpret",
    ),
)


def steps_of(call: int) -> list[Step]:
    return [s for s in STEPS if s.call == call]


def dry_order() -> list[Step]:
    """A dry run without ``--call``: call 1, call 2, then the extras."""
    return steps_of(1) + steps_of(2) + steps_of(0)


def planned_seconds(call: int) -> int:
    """The sum of a call's step budgets (what its deadline is)."""
    return sum(s.budget_s for s in steps_of(call))
