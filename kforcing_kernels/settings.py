"""The one check for real-valued settings: a finite number in the setting's range, refused by name otherwise.

Every config with float fields (``ModelConfig``, ``TrainConfig``, ``PipelineConfig``, ``EvalSettings``, the serving
``Request``) lists them in a ``REAL_SETTINGS`` table ``{field: Real(...)}`` and checks itself with
:func:`check_reals`; the CLIs build their argparse types from the same table (:func:`argparse_type`), so an
option and the Python field it sets accept and refuse the same values with the same words. A NaN or an infinity
is never accepted: a NaN ``rope_base`` or ``norm_eps`` builds a model whose logits are all NaN, which a run would
otherwise only report steps later as a "non-finite loss" naming no setting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real as _RealNumber
from typing import Iterable, Mapping, Optional


@dataclass(frozen=True)
class Real:
    """The range a real-valued setting accepts, besides being a finite real number (bool refused).

    ``low`` / ``high``: bounds (None: unbounded); ``low_open`` / ``high_open``: the bound itself is excluded.
    """

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False

    def accepts(self, value) -> bool:
        if not isinstance(value, _RealNumber) or isinstance(value, bool):
            return False
        try:
            value = float(value)
        except (TypeError, ValueError, OverflowError):
            return False
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))

    @property
    def expected(self) -> str:
        """The words of a refusal: ``a positive number``, ``a number in [0, 1)``, ..."""
        if self.low == 0 and self.high is None:
            return "a positive number" if self.low_open else "a finite number >= 0"
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"a number in {left}{_num(self.low)}, {_num(self.high)}{right}"
        if self.low is not None:
            return f"a finite number {'>' if self.low_open else '>='} {_num(self.low)}"
        if self.high is not None:
            return f"a finite number {'<' if self.high_open else '<='} {_num(self.high)}"
        return "a finite number"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


POSITIVE = Real(0, low_open=True)
NON_NEGATIVE = Real(0)
UNIT = Real(0, 1)  # [0, 1]
UNIT_OPEN_HIGH = Real(0, 1, high_open=True)  # [0, 1)


def real_error(value, spec: Real) -> Optional[str]:
    """``"expected <range>, got <value>"`` when ``value`` is not a finite real number in ``spec``'s range, else None."""
    return None if spec.accepts(value) else f"expected {spec.expected}, got {value!r}"


def check_real(name: str, value, spec: Real, error: type = ValueError) -> None:
    """Raise ``error("<name>: expected ..., got ...")`` unless ``value`` is a finite number in ``spec``'s range."""
    message = real_error(value, spec)
    if message:
        raise error(f"{name}: {message}")


def check_reals(
    obj, specs: Mapping[str, Real], error: type = ValueError, names: Optional[Iterable[str]] = None
) -> None:
    """:func:`check_real` for every setting of ``specs`` (or only ``names``) on ``obj``; a sequence value (a
    per-round or per-temperature list) has each of its items checked. None is accepted only for the fields listed in
    ``obj.OPTIONAL_REALS`` (an unset optional setting)."""
    optional = getattr(obj, "OPTIONAL_REALS", ())
    for name in specs if names is None else names:
        value = getattr(obj, name)
        if value is None and name in optional:
            continue
        if isinstance(value, (list, tuple)):  # each item (an empty list has none to refuse)
            for item in value:
                message = real_error(item, specs[name])
                if message:
                    raise error(f"{name}: {message} (in {value!r})")
        else:
            check_real(name, value, specs[name], error)


def argparse_type(spec: Real):
    """An argparse ``type`` for a setting of range ``spec``: parses a float and refuses it in ``spec``'s words."""
    import argparse

    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {spec.expected}, got {text!r}") from None
        if not spec.accepts(value):
            raise argparse.ArgumentTypeError(f"expected {spec.expected}, got {value}")
        return value

    parse.__name__ = spec.expected
    return parse
