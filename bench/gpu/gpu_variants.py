"""The variants bench/gpu/gpu_check.sh measures against the defaults: the variant file (``gpu_variants.txt``), what
each variant runs, whether this checkout can run it, and the KFORCING_* switches set for the duration of one."""

from __future__ import annotations

import contextlib
import os

import torch


@contextlib.contextmanager
def triton_switches(tiles: str = "auto", extra: dict | None = None):
    """KFORCING_TRITON_TILES (and ``extra`` variables) for the duration ("auto": the dispatcher's own)."""
    want = {"KFORCING_TRITON_TILES": None if tiles == "auto" else tiles, **(extra or {})}
    old = {name: os.environ.pop(name, None) for name in want}
    os.environ.update({name: value for name, value in want.items() if value})
    try:
        yield
    finally:
        os.environ.update({name: value for name, value in old.items() if value is not None})
        for name in [n for n, value in old.items() if value is None]:
            os.environ.pop(name, None)


def read_variants(path: str) -> list[tuple[str, dict]]:
    """``[(name, {VAR: value})]`` from a variants file: one ``NAME VAR=VALUE ...`` per line, ``#`` comments."""
    variants = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            name, assignments = words[0], words[1:]
            bad = [a for a in assignments if "=" not in a or not a.startswith("KFORCING_")]
            if bad or not assignments:  # no setting: the default's run again
                raise ValueError(f"{path}:{number}: expected NAME KFORCING_VAR=VALUE ..., got {bad}")
            variants.append((name, dict(a.split("=", 1) for a in assignments)))
    names = [name for name, _ in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: a variant name appears twice: {names}")
    return variants


def repeats_the_default(assignments: dict, head_dim: int, rows: int, device) -> bool:
    """Whether a variant that only forces a tile set would time nothing new at this shape: the set is the default
    here, or it has no tiles for this head dim or GPU and falls back to ``base`` (which the default or the
    ``tiles_base`` variant times; the H200 run timed ``hopper128`` at D=128 as a second copy of ``base``)."""
    from kforcing_kernels.ops.window_attention.triton.configs import tile_set_for

    if set(assignments) != {"KFORCING_TRITON_TILES"}:
        return False
    with triton_switches():
        default = tile_set_for(head_dim, rows, device)
    with triton_switches(extra=assignments):
        forced = tile_set_for(head_dim, rows, device)
    return forced == default or forced != assignments["KFORCING_TRITON_TILES"]


def variant_backend(assignments: dict) -> str:
    """The backend a variant runs: ``flex`` when it sets a KFORCING_FLEX_* switch, else ``triton``."""
    return "flex" if any(var.startswith("KFORCING_FLEX_") for var in assignments) else "triton"


def variant_problem(assignments: dict) -> str | None:
    """Why this checkout cannot run a variant (a variable its env.py does not read, a tile set configs.py lacks,
    a FlexAttention kernel this torch or machine lacks), else None: the variant list may name switches another
    branch adds, and FlexAttention's FLASH route needs the flash-attn-4 package."""
    import importlib.util

    from kforcing_kernels import env
    from kforcing_kernels.ops.window_attention.triton.configs import TILE_SETS

    for var, value in assignments.items():
        if var not in (env.__doc__ or ""):
            return f"{var} is not read by this checkout (not in kforcing_kernels/env.py)"
        if var == "KFORCING_TRITON_TILES" and value not in TILE_SETS:
            return f"KFORCING_TRITON_TILES={value}: no such tile set in configs.TILE_SETS ({sorted(TILE_SETS)})"
        if var == "KFORCING_FLEX_BACKEND":
            from kforcing_kernels.ops.window_attention import flex

            with triton_switches(extra={var: value}):
                try:
                    flex.kernel_options()
                except ValueError as exc:
                    return str(exc)
            if value == "FLASH" and (
                importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None
            ):
                return (
                    "KFORCING_FLEX_BACKEND=FLASH needs the flash-attn-4 package (flash_attn.cute), not installed here"
                )
            if not torch.cuda.is_available():
                return (
                    f"KFORCING_FLEX_BACKEND={value}: FlexAttention's kernel choice applies to compiled CUDA runs only"
                )
    return None
