"""The benchmarks: ``python -m bench <command> [options]`` from the checkout, or ``kforcing-bench`` once installed.

Run ``<command> --help`` for a command's options; with no command, ``attention`` runs.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module in bench/, one-line help)
COMMANDS = {
    "attention": ("sweep", "the attention microbenchmark sweep (--quick for a short one)"),
    "train": ("train_step", "one self-forcing training step, dense-mask attention vs ours"),
    "infer": ("inference", "inference throughput, AR vs K-Forcing, contiguous vs paged cache"),
    "memory": ("train_memory", "per-rank memory and communication of an FSDP2 training step, with and without activation checkpointing"),
    "teacher": ("teacher_parallel", "the frozen teacher replicated or FSDP2-sharded: ms per Stage-2 step and its all-gathers"),
    "stage1": ("stage1_curve", "the Stage-1 student over steps and model width: noise use and its samples against the teacher's"),
    "allocation": ("demo_allocation", "the demo's training budget split between stages, variants trained side by side"),
    "validate": ("schema", "check attention JSON reports against their schema"),
    "report": ("report", "reprint an attention JSON report and redraw its plots"),
    "host-cost": ("triton_host_cost", "host time per Triton fwd+bwd and per launch, GPU launches stubbed (CPU)"),
    "batch-invariance": ("batch_invariance", "the same bits for a sequence alone and inside a batch: attention, configs, teacher"),
}


def build_parser(prog: str = "kforcing-bench"):
    """The top-level parser with one argparse subcommand per entry of :data:`COMMANDS`."""
    from kforcing_kernels.app.cli import add_command, make_parser

    parser = make_parser(prog, __doc__)
    sub = parser.add_subparsers(dest="bench_command", metavar="{" + ",".join(COMMANDS) + "}",
                                help="the benchmark to run (`<command> --help` for its options)")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(f".{module_name}", __package__)
        p = add_command(sub, name, help=help_text, description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(bench_module=module, bench_parser=p)
    return parser


def main(argv=None, prog: str = "kforcing-bench") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv.insert(0, "attention")  # the default command, as before subcommands
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    module, p = args.bench_module, args.bench_parser
    if hasattr(module, "finish_args"):
        args = module.finish_args(p, args, argv[1:], p.prog)
    result = module.execute(args)
    return result if isinstance(result, int) else 0


def console_main() -> None:
    """The ``kforcing-bench`` console script (the package installs this folder as ``kforcing_bench``)."""
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main(prog="python -m bench"))
