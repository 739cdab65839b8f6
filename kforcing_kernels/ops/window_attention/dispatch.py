"""The measured CUDA dispatch table: which backend ``backend=None`` runs, by GPU measurement.

``dispatch_table.json`` (next to this file; ``KFORCING_DISPATCH_TABLE`` names another) holds rows
written by the GPU check (``bench/gpu/dispatch_table.py`` from ``bench/gpu/triton_gpu.py``'s JSON), each::

    {"capability": "9.0", "dtype": "bfloat16", "head_dim": 128, "length_bucket": 1024, "family": "single",
     "backend": "flex", "fwd_bwd_ms": {"triton": 1.31, "flex_backend": 1.12},
     "provenance": {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0",
                    "date": "2026-11-27T10:00:00Z", "command": "bash bench/gpu/gpu_check.sh"}}

A row applies to CUDA inputs on a GPU of that compute capability, of that dtype and head dim,
whose layout is of that family (:func:`layout_family`) with a context length in that bucket
(:func:`length_bucket`). For such inputs ``backend=None`` runs the row's backend (when it is
available); without a row it runs the registry's default (``triton``). ``KFORCING_BACKEND`` still
overrides both. The provenance may add ``commit`` (the measured checkout) and a ``note``; rows may add
``measured`` (every timing behind the choice). A top-level ``pending`` list names keys
(capability, dtype, head_dim, length_bucket, family, and ``why``) whose measurement went stale and
that have no row until the GPU check measures them again (:func:`merge` settles them).

The shipped rows are the H200's (issue 47; ``bench/results/gpu-h200/``): triton at D = 64 (N <= 1024,
N <= 8192) and D = 128 (N <= 1024); D = 128, N <= 8192 is pending (FlexAttention's own backward, issue 47
item 2, changed what ``backend="flex"`` costs there).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Optional

import torch

from ... import env

FORMAT = 1
TABLE_PATH = Path(__file__).with_name("dispatch_table.json")
FAMILIES = ("single", "streams", "full")
PROVENANCE_KEYS = ("gpu", "torch", "triton", "date", "command")
ROW_KEYS = ("capability", "dtype", "head_dim", "length_bucket", "family", "backend", "fwd_bwd_ms", "provenance")
SMALLEST_BUCKET = 1024  # every context length up to 1024 shares one bucket: the benches measure N >= 1024


def layout_family(layout) -> str:
    """``single``: causal windows, one stream (K-Forcing single, PTP, packed documents); ``streams``: causal windows
    stored stream-major (K-Forcing double, ``n_streams > 1``); ``full``: windows that see each other fully
    (SBD, BD3-LM, Jacobi, blank slots)."""
    if layout.intra == "full":
        return "full"
    return "streams" if layout.n_streams > 1 else "single"


def length_bucket(n_ctx) -> int:
    """The bucket of context length ``n_ctx``: the smallest power of two >= it, at least ``SMALLEST_BUCKET``."""
    bucket = SMALLEST_BUCKET
    while bucket < n_ctx:
        bucket *= 2
    return bucket


def in_bucket(n_ctx, bucket: int) -> bool:
    """Whether ``length_bucket(n_ctx) == bucket`` (comparisons only: ``n_ctx`` may be a SymInt under compile)."""
    low = 0 if bucket <= SMALLEST_BUCKET else bucket // 2
    return low < n_ctx <= bucket


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def capability_name(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


DTYPES = ("float16", "bfloat16", "float32")  # dtype_name of the dtypes the CUDA backends take
_CAPABILITY = re.compile(r"[0-9]+\.[0-9]+")


def validate(table: dict, where: str = "dispatch table") -> dict:
    """``table`` if it is a well-formed dispatch table, else ValueError naming ``where`` (the file), the row and the
    field. A row that could never match an input (a capability or dtype spelt otherwise than the op looks them up)
    is refused here: ignored, it would drop the measured choice without a word."""
    if not isinstance(table, dict) or table.get("format") != FORMAT:
        raise ValueError(f'{where}: expected a JSON object with "format": {FORMAT}')
    rows = table.get("rows")
    if not isinstance(rows, list):
        raise ValueError(f"{where}: rows: expected a list")
    seen = set()
    for i, row in enumerate(rows):
        _validate_row(row, f"{where}: rows[{i}]")
        key = row_key(row)
        if key in seen:
            raise ValueError(f"{where}: rows[{i}]: a second row for {key}")
        seen.add(key)
    return table


def _validate_row(row, where: str) -> None:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object with {list(ROW_KEYS)}, got a JSON {_json_type(row)}")
    missing = [key for key in ROW_KEYS if key not in row]
    if missing:
        raise ValueError(f"{where}: missing {missing}")
    capability = row["capability"]
    if not isinstance(capability, str) or not _CAPABILITY.fullmatch(capability):
        raise ValueError(
            f'{where}.capability: expected "major.minor" as a string (e.g. "9.0", as '
            f"torch.cuda.get_device_capability gives it, joined by a dot), got {capability!r}"
        )
    if row["dtype"] not in DTYPES:
        raise ValueError(f"{where}.dtype: expected one of {DTYPES} (torch's dtype names), got {row['dtype']!r}")
    if row["family"] not in FAMILIES:
        raise ValueError(f"{where}.family: expected one of {FAMILIES}, got {row['family']!r}")
    bucket = row["length_bucket"]
    if not _is_int(bucket) or bucket != length_bucket(bucket):
        raise ValueError(f"{where}.length_bucket: expected a power of two >= {SMALLEST_BUCKET}, got {bucket!r}")
    if not _is_int(row["head_dim"]) or row["head_dim"] < 1:
        raise ValueError(f"{where}.head_dim: expected a positive int, got {row['head_dim']!r}")
    times = row["fwd_bwd_ms"]
    if not isinstance(times, dict) or not all(
        isinstance(ms, (int, float)) and not isinstance(ms, bool) and math.isfinite(ms) and ms > 0
        for ms in times.values()
    ):
        raise ValueError(f"{where}.fwd_bwd_ms: expected an object of positive milliseconds by method, got {times!r}")
    if row["backend"] not in _measured_backends(row):
        raise ValueError(
            f"{where}.backend: {row['backend']!r} is not among its measurements {sorted(times)} "
            f"(a backend of {sorted(BENCH_METHOD)} measured as {BENCH_METHOD})"
        )
    provenance = row["provenance"]
    absent = [key for key in PROVENANCE_KEYS if not isinstance(provenance, dict) or not provenance.get(key)]
    if absent:
        raise ValueError(f"{where}.provenance: missing {absent}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


# The bench names the flex backend's measurement "flex_backend" ("flex" is FlexAttention called directly).
BENCH_METHOD = {"triton": "triton", "flex": "flex_backend"}


def _measured_backends(row: dict) -> set:
    return {name for name, method in BENCH_METHOD.items() if method in row["fwd_bwd_ms"]}


def row_key(row: dict) -> tuple:
    return (row["capability"], row["dtype"], row["head_dim"], row["length_bucket"], row["family"])


def empty_table() -> dict:
    return {"format": FORMAT, "rows": []}


def load(path=None) -> dict:
    """The table at ``path`` (default: ``KFORCING_DISPATCH_TABLE`` or the package's), validated."""
    path = Path(path or env.dispatch_table_path() or TABLE_PATH)
    where = f"{path} (KFORCING_DISPATCH_TABLE)" if str(path) == env.dispatch_table_path() else str(path)
    try:
        text = path.read_text()
    except FileNotFoundError:  # a FileNotFoundError still (bench/gpu/dispatch_table.py starts a new table on it)
        raise FileNotFoundError(f"dispatch table {where}: no such file") from None
    except OSError as exc:
        raise ValueError(f"dispatch table {where}: cannot read it ({exc.strerror or exc})") from None
    try:
        table = json.loads(text)
    except ValueError as exc:
        raise ValueError(
            f"dispatch table {where}: not valid JSON ({exc}); write it again from the GPU check's "
            "measurements (bench/gpu/dispatch_table.py), or name another table"
        ) from None
    return validate(table, f"dispatch table {where}")


def write(table: dict, path=None) -> Path:
    """Write ``table`` (validated) to ``path`` (default: the package's), rows sorted, atomically."""
    path = Path(path or TABLE_PATH)
    validate(table, str(path))
    table = dict(table, rows=sorted(table["rows"], key=row_key))
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path


def merge(table: dict, rows: list[dict]) -> dict:
    """``table`` with ``rows`` added; a new row replaces the old one with the same key, and settles a ``pending``
    entry of that key (a key whose measurement is known to be stale, kept out of the rows until re-measured)."""
    by_key = {row_key(row): row for row in table["rows"]}
    by_key.update({row_key(row): row for row in rows})
    merged = dict(table, rows=list(by_key.values()))
    if "pending" in table:
        merged["pending"] = [p for p in table["pending"] if row_key(p) not in by_key]
    return merged


def choose(rows, capability: str, dtype: str, head_dim, n_ctx, family: str) -> Optional[str]:
    """The backend of the row matching the inputs, or None. ``rows``: dicts or ``(capability, dtype, head_dim,
    length_bucket, family, backend)`` tuples; ``head_dim`` / ``n_ctx`` may be SymInts (compared only)."""
    for row in rows:
        cap, dt, dim, bucket, fam, backend = row if isinstance(row, tuple) else (*row_key(row), row["backend"])
        if cap == capability and dt == dtype and fam == family and head_dim == dim and in_bucket(n_ctx, bucket):
            return backend
    return None


def device_capability(device_index: int) -> tuple[int, int]:
    """The compute capability of CUDA device ``device_index`` (tests replace it to select rows on CPU)."""
    return torch.cuda.get_device_capability(device_index)


_cache: dict = {}


def measured_rows(device_index: int, dtype: torch.dtype, usable) -> tuple:
    """The table rows for this GPU and dtype whose backend is usable (``usable()``: the set of usable backend names),
    as ``choose`` tuples. Cached per table path, device and dtype: the op asks on every call."""
    path = env.dispatch_table_path() or str(TABLE_PATH)
    key = ("rows", path, device_index, dtype)
    rows = _cache.get(key)
    if rows is None:
        capability, names = capability_of(device_index), usable()
        rows = tuple(
            (*row_key(row), row["backend"])
            for row in load(path)["rows"]
            if row["capability"] == capability and row["dtype"] == dtype_name(dtype) and row["backend"] in names
        )
        _cache[key] = rows
    return rows


def capability_of(device_index: int) -> str:
    """``capability_name(device_capability(device_index))``, cached."""
    key = ("capability", device_index)
    name = _cache.get(key)
    if name is None:
        name = _cache[key] = capability_name(device_capability(device_index))
    return name


def clear_cache() -> None:
    """Forget the rows and capabilities read so far (after writing a table, or when a test swaps either)."""
    _cache.clear()
