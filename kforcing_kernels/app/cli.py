"""The command-line options that mean the same thing in every CLI (train, generate, evaluate, demo, bench).

One name, type, default and help text each, so a user who learnt one command can guess the others:

    --device       auto (CUDA when torch sees a GPU, else CPU), cpu, cuda, cuda:1, ...
    --temperature  sampling temperature tau; 0.8 everywhere something is sampled
    --seed         0
    --threads      torch CPU threads; default: torch's own choice
    --new-tokens   tokens generated per prompt
    --batch-size   one batch size (int); --batch-sizes 4,16 where a command takes several
    --preset       model size (micro, tiny, paper)

Every parser built with :func:`make_parser` shows each option's default in ``--help``
(``python_tests/app/test_cli_consistency.py`` checks all of the above across the CLIs).
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, Optional, Sequence

DEFAULT_DEVICE = "auto"
DEFAULT_TEMPERATURE = 0.8
DEFAULT_SEED = 0
DEFAULT_NEW_TOKENS = 64


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after every help text; the description's line breaks kept."""


def make_parser(prog: Optional[str] = None, description: Optional[str] = None, **kwargs) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter, **kwargs)


def add_command(sub, name: str, **kwargs) -> argparse.ArgumentParser:
    """``sub.add_parser(name)`` with the same formatter (argparse does not pass it down to subcommands)."""
    kwargs.setdefault("formatter_class", HelpFormatter)
    return sub.add_parser(name, **kwargs)


# ---------------------------------------------------------------------- checked types


def checked(cast: Callable, accept: Callable, expected: str):
    """An argparse ``type`` that casts and checks, naming what it expected."""

    def parse(text):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    parse.__name__ = expected  # argparse names the type in "invalid <name> value" messages
    return parse


positive_int = checked(int, lambda v: v >= 1, "a positive integer")
non_negative_int = checked(int, lambda v: v >= 0, "an integer >= 0")
positive_float = checked(float, lambda v: v > 0 and math.isfinite(v), "a positive number")
non_negative_float = checked(float, lambda v: v >= 0 and math.isfinite(v), "a finite number >= 0")
fraction = checked(float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")


def _int_list(text: str) -> list:
    items = [item.strip() for item in str(text).split(",")]
    if not items or any(not item for item in items):
        raise ValueError(text)
    return [int(item) for item in items]


int_list = checked(_int_list, lambda v: all(x >= 1 for x in v), "comma-separated positive integers, e.g. 4,16")


def _float_list(text: str) -> list:
    if str(text).strip().lower() in ("", "none"):
        return []
    items = [item.strip() for item in str(text).split(",")]
    if any(not item for item in items):
        raise ValueError(text)
    return [float(item) for item in items]


positive_float_list = checked(
    _float_list,
    lambda v: all(x > 0 and math.isfinite(x) for x in v),
    "comma-separated positive numbers, e.g. 0.5,0.8 (none: an empty list)",
)


def resolve_device(name: str) -> str:
    """``"auto"`` -> ``"cuda"`` when torch sees a GPU, else ``"cpu"``; anything else is checked by torch, and
    ``cuda``/``cuda:N``/``mps`` against what this torch and machine have (a usage error, not a traceback later)."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "this torch is built without CUDA"
                if torch.version.cuda is None and getattr(torch.version, "hip", None) is None
                else "torch sees no CUDA device"
            )
            raise argparse.ArgumentTypeError(f"{name!r} is not available: {why}; use cpu or auto")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(
                f"{name!r} is not available: torch sees {count} CUDA device(s) (cuda:0..cuda:{count - 1})"
            )
    elif device.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise argparse.ArgumentTypeError(f"{name!r} is not available on this machine; use cpu or auto")
    return name


resolve_device.__name__ = "device"


# ---------------------------------------------------------------------- the shared options


def add_device(p: argparse.ArgumentParser, *, help_extra: str = "") -> None:
    """``help_extra``: what this command does with the device, after the shared text (e.g. that it times on
    CUDA only); the name, type and default stay the shared ones."""
    # argparse runs string defaults through ``type``: args.device is always resolved ("cpu", "cuda", ...).
    p.add_argument(
        "--device",
        type=resolve_device,
        default=DEFAULT_DEVICE,
        help="auto (cuda when available, else cpu), cpu, cuda, cuda:1, ..." + help_extra,
    )


def add_temperature(p: argparse.ArgumentParser, *, help_extra: str = "") -> None:
    p.add_argument(
        "--temperature",
        type=non_negative_float,
        default=DEFAULT_TEMPERATURE,
        help="sampling temperature tau" + help_extra,
    )


def add_seed(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="random seed")


def add_threads(p: argparse.ArgumentParser, *, none: str = "torch's own choice") -> None:
    """``none``: what the command runs with when ``--threads`` is not given (the default stays None everywhere, so
    a command's own count, e.g. 2 for the README's CPU numbers, is set where it reads the option)."""
    p.add_argument("--threads", type=positive_int, default=None, help=f"torch CPU threads; None: {none}")


def add_new_tokens(
    p: argparse.ArgumentParser, default: Optional[int] = DEFAULT_NEW_TOKENS, help_extra: str = ""
) -> None:
    p.add_argument("--new-tokens", type=positive_int, default=default, help="tokens generated per prompt" + help_extra)


def add_batch_size(p: argparse.ArgumentParser, default: Optional[int], help: str = "sequences per batch") -> None:
    p.add_argument("--batch-size", type=positive_int, default=default, help=help)


def add_batch_sizes(p: argparse.ArgumentParser, default, help: str = "batch sizes to run") -> None:
    """``--batch-sizes 4,16``; ``default`` a list (or None for a profile's choice), shown comma-separated."""
    text = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
    p.add_argument("--batch-sizes", type=int_list, default=text, help=help + " (comma-separated)")


def add_preset(p: argparse.ArgumentParser, default: Optional[str] = "tiny", help: str = "model size") -> None:
    from ..model import PRESETS

    p.add_argument("--preset", choices=sorted(PRESETS), default=default, help=help)


def apply_threads(threads: Optional[int]) -> None:
    """``torch.set_num_threads`` when ``--threads`` was given."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


# The options above, by flag: (dest, type, default). test_cli_consistency.py checks every CLI against this.
SHARED_OPTIONS = {
    "--device": ("device", resolve_device, DEFAULT_DEVICE),
    "--temperature": ("temperature", non_negative_float, DEFAULT_TEMPERATURE),
    "--seed": ("seed", int, DEFAULT_SEED),
    "--threads": ("threads", positive_int, None),
    "--new-tokens": ("new_tokens", positive_int, None),  # default: per command (checked for its type only)
    "--batch-size": ("batch_size", positive_int, None),
    "--batch-sizes": ("batch_sizes", int_list, None),
}
# Spellings that must not come back: the same things under other names.
RETIRED_FLAGS = ("--max-new-tokens", "--batch", "--tau", "--num-threads", "--bs")


def all_parsers(parser: argparse.ArgumentParser, name: str = "") -> Sequence:
    """``[(command name, parser)]`` for ``parser`` and every subcommand below it."""
    found = [(name or parser.prog, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                found.extend(all_parsers(sub, f"{name or parser.prog} {sub_name}"))
    return found
