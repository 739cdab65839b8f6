"""The benchmarks, run from a checkout: ``python -m bench <command> [options]``.

Run ``python -m bench <command> --help`` for a command's options; with no command, ``attention`` runs.
The folders group them by subject: ``attention/`` (CPU attention and layouts), ``training/``,
``inference/``, ``gpu/`` (Triton on CUDA, its profiles, checks and host cost).
"""

from __future__ import annotations

import importlib
import sys

# command -> (module under bench/, one-line help). Every command module has one shape: ``add_arguments(p)`` adds
# its options to the subcommand's parser, an optional ``finish_args(p, args, argv, prog)`` checks and completes
# them (``p.error`` for a usage error), ``execute(args)`` runs (an exit code, or a report for callers in-process:
# ``run_command``). The one exception, OWN_PARSER, is handed the rest of the command line (``main(argv)``).
COMMANDS = {
    "attention": ("attention.sweep", "the attention microbenchmark sweep (--quick for a short one)"),
    "peers": ("attention.peers", "one shape against its peers: dense SDPA, FlexAttention, our backends, the ideal"),
    "cpu-kernels": (
        "attention.cpu_kernels",
        "the C++ extension's CPU kernels (attention, sampler) against their baselines",
    ),
    "cpp-ab": ("attention.cpp_ab", "the cpp backend A/B between git commits, at the headline shape"),
    "layout-build": ("attention.layout_build", "mask construction per training step for block-drafter layouts"),
    "sliding-window": (
        "attention.sliding_window",
        "SingleForward under a sliding window: attended pairs and window_attention time",
    ),
    "decode-copy": ("attention.decode_copy", "a decode call on K/V views of a stacked cache: bytes copied and ms"),
    "eagle3": ("attention.eagle3", "EAGLE-3 training-time test: attention vs causal over L, and mask construction"),
    "context-parallel": (
        "attention.context_parallel",
        "context parallelism by accounting: per-rank memory, longest sequence, bytes communicated",
    ),
    "cp-throughput": (
        "attention.cp_throughput",
        "the trainer's --context-parallel end to end: tokens/s with W ranks vs one process",
    ),
    "validate": ("attention.schema", "check attention JSON reports against their schema"),
    "report": ("attention.report", "reprint an attention JSON report and redraw its plots"),
    "train": ("training.train_step", "one self-forcing training step, dense-mask attention vs ours"),
    "train-gpu": (
        "training.train_gpu",
        "the training step on a GPU as the trainer runs it (bf16 autocast): dense-mask SDPA, ours, no attention",
    ),
    "eval-loss": (
        "training.eval_loss",
        "the chunked loss under no_grad (evaluate_loss): head requiring grad vs detached",
    ),
    "memory": (
        "training.train_memory",
        "per-rank memory and communication of an FSDP2 training step, with and without activation checkpointing",
    ),
    "memory-model": (
        "training.memory_model",
        "a memory model of one Stage-2 step per part (paper backbone), calibrated on CPU",
    ),
    "teacher": (
        "training.teacher_parallel",
        "the frozen teacher replicated or FSDP2-sharded: ms per Stage-2 step and its all-gathers",
    ),
    "stage1": (
        "training.stage1_curve",
        "the Stage-1 student over steps and model width: noise use and its samples against the teacher's",
    ),
    "allocation": (
        "training.demo_allocation",
        "the demo's training budget split between stages, variants trained side by side",
    ),
    "vllm": ("inference.vllm_serving", "Table 1 through vLLM: vLLM AR vs K-Forcing k = 2, 4 (tokens/s, steps/token)"),
    "infer": ("inference.serving", "inference throughput, AR vs K-Forcing, contiguous vs paged cache"),
    "gpu": (
        "gpu.triton_gpu",
        "Triton vs FlexAttention and SDPA on CUDA (TFLOP/s per useful FLOP), the README's GPU table",
    ),
    "profile": ("gpu.triton_profile", "per-kernel GPU time vs host enqueue time of the Triton path"),
    "dispatch-table": ("gpu.dispatch_table", "write the CUDA dispatch table from an A/B report of `gpu`"),
    "bwd-registers": ("gpu.bwd_registers", "which program kind sets the fused backward's register count (AOT, no GPU)"),
    "host-cost": ("gpu.triton_host_cost", "host time per Triton fwd+bwd and per launch, GPU launches stubbed (CPU)"),
    "batch-invariance": (
        "gpu.batch_invariance",
        "the same bits for a sequence alone and inside a batch: attention, configs, teacher",
    ),
    "gpu-script": ("gpu.check_scripts", "one script of the GPU check: versions, smoke, int64, sampler"),
    "gpu-check": ("gpu.check", "the GPU check, planned as two calls (<= 380 s + 280 s of step caps); --dry-run on CPU"),
}
PROG = "python -m bench"
# Commands whose module still owns its parser (``main(argv)``): bench/inference/vllm_serving.py, kept by the vLLM
# integration's owner this round (python_tests/bench/test_bench_cli.py holds the same exception).
OWN_PARSER = frozenset({"vllm"})


def _module(name: str):
    return importlib.import_module(f".{COMMANDS[name][0]}", __package__)


def _add(sub, name: str):
    """``name``'s subcommand parser in ``sub``, its options added (OWN_PARSER's: a name and help only)."""
    from kforcing_kernels.app.cli import add_command

    module = _module(name)
    p = add_command(sub, name, help=COMMANDS[name][1], description=module.__doc__)
    if name not in OWN_PARSER:  # OWN_PARSER's: main() hands it the command line before this parser is built
        module.add_arguments(p)
        p.set_defaults(bench_module=module, bench_parser=p)
    return p


def build_parser(prog: str = PROG):
    """The top-level parser: one argparse subcommand per command."""
    from kforcing_kernels.app.cli import make_parser

    parser = make_parser(prog, __doc__)
    sub = parser.add_subparsers(
        dest="bench_command",
        metavar="{" + ",".join(COMMANDS) + "}",
        help="the benchmark to run (`<command> --help` for its options)",
    )
    for name in COMMANDS:
        _add(sub, name)
    return parser


def command_parser(name: str, prog: str = PROG):
    """The parser of ``python -m bench <name>`` alone: the same options and ``--help`` as under
    :func:`build_parser`, without importing the other commands' modules."""
    from kforcing_kernels.app.cli import make_parser

    if name not in COMMANDS or name in OWN_PARSER:
        raise ValueError(f"name: expected one of {sorted(set(COMMANDS) - OWN_PARSER)}, got {name!r}")
    return _add(make_parser(prog).add_subparsers(), name)


def _finished(args, argv: list[str]):
    """``(module, args)``: the command's module, and ``args`` through its ``finish_args`` where it has one
    (``argv``: the command's own arguments). The dispatcher's bookkeeping is taken out of ``args``, which
    commands record in their reports (``vars(args)``)."""
    module, p = vars(args).pop("bench_module"), vars(args).pop("bench_parser")
    if hasattr(module, "finish_args"):
        args = module.finish_args(p, args, argv, p.prog)
    return module, args


def parse_command(name: str, argv: list[str], prog: str = PROG):
    """The options of ``python -m bench <name> <argv...>``, as ``execute`` gets them (``finish_args`` applied).
    A usage error exits as on the command line (SystemExit 2)."""
    return _finished(command_parser(name, prog).parse_args(argv), list(argv))[1]


def run_command(name: str, argv: list[str], prog: str = PROG):
    """Run ``python -m bench <name> <argv...>`` in this process; returns what the command's ``execute`` returns
    (its report where it makes one, else its exit code)."""
    return _module(name).execute(parse_command(name, argv, prog))


def main(argv=None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv.insert(0, "attention")  # the default command, as before subcommands
    if argv[0] in OWN_PARSER:
        sys.argv[0] = f"{prog} {argv[0]}"  # argparse's default prog in the command's own parser
        result = _module(argv[0]).main(argv[1:])
        return result if isinstance(result, int) else 0
    module, args = _finished(build_parser(prog).parse_args(argv), argv[1:])
    result = module.execute(args)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
