"""The attention sweep's JSON report: its schema and a validator.

    python -m bench validate runs/bench-.../attention.json

``SCHEMA`` is plain JSON Schema (draft-07 keywords: type, required, properties,
additionalProperties, items, enum, minimum, minLength). ``validate_schema``
implements exactly that subset so the check needs no extra package;
``check_report`` adds what a schema cannot say: every expected method is either
measured in every configuration or listed as unavailable with a reason, and
every row that carries no timing says why.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

from .sweep import METHODS, PHASES, SCHEMA_ID

_NUM = {"type": "number"}
_OPT_NUM = {"type": ["number", "null"]}
_STR = {"type": "string"}

ROW = {
    "type": "object",
    "required": [
        "machine",
        "torch",
        "triton",
        "git_commit",
        "timestamp",
        "layout",
        "n",
        "k",
        "d",
        "lq",
        "lk",
        "num_pairs",
        "ideal_multiplier",
        "method",
        "kind",
        "phase",
        "status",
        "reason",
        "median_ms",
        "min_ms",
        "first_ms",
        "reps",
        "ratio_to_ideal",
        "ratio_to_ideal_min",
        "causal_units",
        "tflops",
    ],
    "properties": {
        "machine": _STR,
        "torch": _STR,
        "triton": {"type": ["string", "null"]},
        "git_commit": _STR,
        "timestamp": _STR,
        "layout": _STR,
        "n": {"type": "integer", "minimum": 1},
        "k": {"type": ["integer", "null"], "minimum": 1},
        "d": {"type": "integer", "minimum": 1},
        "lq": {"type": "integer", "minimum": 1},
        "lk": {"type": "integer", "minimum": 1},
        "num_pairs": {"type": "number", "minimum": 1},
        "ideal_multiplier": {"type": "number", "minimum": 0},
        "method": {"type": "string", "enum": list(METHODS)},
        "kind": {"type": "string", "enum": ["ideal", "peer", "ours"]},
        "phase": {"type": "string", "enum": ["build", *PHASES]},
        "status": {"type": "string", "enum": ["ok", "unsupported", "skipped", "error"]},
        "reason": {"type": ["string", "null"]},
        "median_ms": _OPT_NUM,
        "min_ms": _OPT_NUM,
        "first_ms": _OPT_NUM,
        "reps": {"type": "integer", "minimum": 0},
        "ratio_to_ideal": _OPT_NUM,
        "ratio_to_ideal_min": _OPT_NUM,
        "causal_units": _OPT_NUM,
        "tflops": _OPT_NUM,
    },
}

SCHEMA = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": SCHEMA_ID,
    "type": "object",
    "required": ["schema", "meta", "methods", "rows", "fits"],
    "properties": {
        "schema": {"type": "string", "enum": [SCHEMA_ID]},
        "meta": {
            "type": "object",
            "required": [
                "machine",
                "processor",
                "cpus",
                "threads",
                "torch",
                "triton",
                "git_commit",
                "timestamp",
                "command",
                "quick",
                "device",
                "dtype",
                "batch",
                "heads",
                "warmup",
                "reps",
                "layouts",
                "n",
                "k",
                "dims",
                "fit_n",
                "wall_s",
            ],
            "properties": {
                "threads": {"type": "integer", "minimum": 1},
                "command": {"type": "string", "minLength": 1},
                "timestamp": {"type": "string", "minLength": 1},
                "quick": {"type": "boolean"},
                "wall_s": _NUM,
                "layouts": {"type": "array", "items": _STR},
                "n": {"type": "array", "items": {"type": "integer"}},
                "k": {"type": "array", "items": {"type": "integer"}},
                "dims": {"type": "array", "items": {"type": "integer"}},
            },
        },
        "methods": {
            "type": "object",
            "required": list(METHODS),
            "additionalProperties": False,
            "properties": {
                m: {
                    "type": "object",
                    "required": ["kind", "status", "reason", "description"],
                    "properties": {
                        "status": {"type": "string", "enum": ["measured", "unavailable"]},
                        "reason": {"type": ["string", "null"]},
                    },
                }
                for m in METHODS
            },
        },
        "rows": {"type": "array", "items": ROW},
        "fits": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "layout",
                    "n",
                    "d",
                    "method",
                    "phase",
                    "k",
                    "median_ms",
                    "min_ms",
                    "causal_units",
                    "slope_k",
                    "slope_k_min",
                    "slope_k_norm",
                    "slope_work",
                    "slope_work_min",
                    "slope_work_norm",
                ],
                "properties": {
                    "slope_k": _NUM,
                    "slope_k_min": _NUM,
                    "slope_k_norm": _NUM,
                    "slope_work": _OPT_NUM,
                    "slope_work_min": _OPT_NUM,
                    "slope_work_norm": _OPT_NUM,
                },
            },
        },
    },
}

_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
    "integer": int,
    "number": (int, float),
}


def _is(value, name: str) -> bool:
    if name in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _TYPES[name])


def validate_schema(instance, schema: dict, path: str = "$") -> list[str]:
    """Errors of ``instance`` against the JSON Schema subset ``schema`` uses (empty: valid)."""
    errors = []
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else types
        if not any(_is(instance, t) for t in names):
            return [f"{path}: expected {' or '.join(names)}, got {type(instance).__name__}"]
    if "enum" in schema and instance not in schema["enum"]:
        errors.append(f"{path}: expected one of {schema['enum']}, got {instance!r}")
    if "minimum" in schema and _is(instance, "number") and instance < schema["minimum"]:
        errors.append(f"{path}: expected >= {schema['minimum']}, got {instance}")
    if "minLength" in schema and isinstance(instance, str) and len(instance) < schema["minLength"]:
        errors.append(f"{path}: expected at least {schema['minLength']} characters")
    if isinstance(instance, dict):
        for key in schema.get("required", []):
            if key not in instance:
                errors.append(f"{path}: missing required key {key!r}")
        props = schema.get("properties", {})
        for key, value in instance.items():
            if key in props:
                errors += validate_schema(value, props[key], f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}: unexpected key {key!r}")
    if isinstance(instance, list) and "items" in schema:
        for i, item in enumerate(instance):
            errors += validate_schema(item, schema["items"], f"{path}[{i}]")
    return errors


def check_report(report: dict) -> list[str]:
    """Schema errors plus completeness: each expected method measured everywhere or absent with a reason."""
    errors = validate_schema(report, SCHEMA)
    if errors:
        return errors
    methods = report["methods"]
    for m, info in methods.items():
        if info["status"] == "unavailable" and not info["reason"]:
            errors.append(f"methods.{m}: unavailable without a reason")
        if info["status"] == "measured" and info["reason"]:
            errors.append(f"methods.{m}: measured but carries a reason {info['reason']!r}")
    measured = [m for m, info in methods.items() if info["status"] == "measured"]
    if "ideal" not in measured:
        errors.append("methods.ideal: the ideal line must be measured")
    rows = report["rows"]
    if not rows:
        errors.append("rows: empty")
    by_config = defaultdict(dict)
    for i, row in enumerate(rows):
        where = f"rows[{i}] ({row['layout']} N={row['n']} k={row['k']} D={row['d']} {row['method']} {row['phase']})"
        if row["method"] not in measured:
            errors.append(f"{where}: method is listed unavailable but has rows")
        if row["status"] == "ok":
            if not (row["median_ms"] and row["min_ms"] and row["reps"] >= 1 and row["min_ms"] <= row["median_ms"]):
                errors.append(f"{where}: ok without positive timings (min <= median, reps >= 1)")
            if row["phase"] in PHASES and row["ratio_to_ideal"] is None:
                errors.append(f"{where}: ok without ratio_to_ideal")
        elif not row["reason"]:
            errors.append(f"{where}: status {row['status']} without a reason")
        by_config[(row["layout"], row["n"], row["k"], row["d"])][(row["method"], row["phase"])] = row
    for config, cells in by_config.items():
        for m in measured:
            for phase in PHASES:
                if (m, phase) not in cells:
                    errors.append(f"config {config}: no {phase} row for measured method {m}")
        for phase in PHASES:
            ideal = cells.get(("ideal", phase))
            if ideal is not None and ideal["status"] != "ok":
                errors.append(f"config {config}: ideal {phase} not timed: {ideal['reason']}")
    return errors


def add_arguments(p) -> None:
    p.add_argument("reports", nargs="+", metavar="REPORT.json", help="attention reports written by the sweep")


def finish_args(p, args, argv=None, prog=None):
    """A clear usage error for a missing or unreadable report (before any checking)."""
    for path in args.reports:
        if not os.path.isfile(path):
            p.error(f"REPORT.json: no such file: {path}")
        try:
            with open(path) as f:
                json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            p.error(f"REPORT.json: cannot read {path} as JSON: {exc}")
    return args


def execute(args) -> int:
    """Exit status 0 when every report is valid, 1 otherwise."""
    status = 0
    for path in args.reports:
        with open(path) as f:
            errors = check_report(json.load(f))
        print(f"{path}: " + ("valid" if not errors else f"{len(errors)} problem(s)"))
        for err in errors[:50]:
            print("  " + err)
        status |= bool(errors)
    return status
