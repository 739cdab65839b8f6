"""Steady-state launches without the autotuner and the JIT's argument binding.

The first launch of a kernel for a (tune key, autotune on/off, constexprs, argument specialisation,
device) goes through ``triton.autotune`` and ``JITFunction.run``, which pick the config, bind and
specialise the arguments, compile if needed and return the ``CompiledKernel`` they launched. Later
launches with the same key call that kernel's launcher directly with the same arguments (in the
kernel's parameter order), the same grid and the current stream (host time per launch:
bench/gpu/triton_host_cost.py, BENCHMARKS.md "Triton host cost").

The key holds everything Triton's choice depends on: the autotuner keys on ``HEAD_DIM`` (in the
constexprs) and every tensor's dtype; the JIT's cache on each argument's specialisation, which
``ArgSignature`` reproduces conservatively (tensors: dtype and 16-byte alignment; ints: 32/64-bit
or unsigned 64-bit range, divisible by 16, equal to 1; floats and bools: their type). Any other
argument type, a JIT pre-run hook, or a result that is not a ``CompiledKernel`` keeps the call on
the autotuner path. Triton's debug and instrumentation knobs are read when a key is first seen
(flipping them later in the process does not recompile on this path), and the JIT's check that the
kernel's global constants did not change since it compiled runs on the first launch only.
KFORCING_TRITON_DIRECT_LAUNCH=0 keeps every launch on the autotuner path (to compare, or to rule
this path out).

Building the key is most of a direct launch's host time, so it is a handful of C-level passes over
the arguments: their types (which pick a cached plan of positions; the previous call's plan is
reused while the types are equal), the tensors' dtypes, one ``math.gcd`` of their pointers for the
alignment, one ``array('i')`` for the int32 range, one ``gcd`` of the specialised ints; the
switches come from ``env.py``'s cheap reads of ``os.environ`` (still read on every launch).
"""

from __future__ import annotations

import array
import operator
import threading
from math import gcd
from typing import Any, Optional, Union

import torch

from .... import env

_I32 = (-(2**31), 2**31)
_I64 = (-(2**63), 2**63)


def direct_launch_enabled() -> bool:
    """KFORCING_TRITON_DIRECT_LAUNCH: unset or ``1``: on; ``0``: every launch goes through the autotuner."""
    value = env.triton_direct_launch()
    if value is None or value == "1":
        return True
    if value == "0":
        return False
    raise ValueError(f"KFORCING_TRITON_DIRECT_LAUNCH: expected '0' or '1', got {value!r}")


class ArgSignature:
    """Per kernel: what Triton's specialisation of the positional arguments depends on, as a hashable
    key at least as fine as ``native_specialize_impl``'s result, or None when an argument's type is not
    handled here. Tensors: dtype and 16-byte alignment; ints: 32/64-bit or unsigned 64-bit range, and
    for specialised parameters divisibility by 16 and equality to 1; floats, bools, None: their type;
    constexprs passed positionally: their value. Tensors passed for a ``trusted`` parameter name add
    nothing: the caller guarantees their dtype and 16-byte alignment (the launchers' int32 plan tables,
    ``jit_common.PLAN_POINTERS``, made by ``plan_device.device_int32``). The tuple of argument types picks a plan (which
    positions hold what); bulk checks keep the common case (every pointer aligned, every int in int32,
    every specialised int a multiple of 16) at a few C-level passes: ``math.gcd`` of all the pointers
    (or specialised ints) is a multiple of 16 exactly when each of them is."""

    def __init__(self, fn, trusted: tuple = ()):
        self.params = getattr(fn, "params", None)  # None: not a plain JITFunction, never launched directly
        self.trusted = frozenset(trusted)
        self._plans: dict[tuple, Optional[_Plan]] = {}
        self._last: tuple = ((), None)  # (argument types, plan) of the previous call: a launcher's types rarely change

    def __call__(self, args: tuple) -> Optional[tuple]:
        types = tuple(map(type, args))
        last = self._last
        if types == last[0]:
            plan = last[1]
        else:
            plan = self._plans.get(types, False)
            if plan is False:
                plan = self._plans[types] = self._plan(types)
            self._last = (types, plan)
        if plan is None:
            return None
        # The plan stands for the argument types in the key (one per tuple of types; hashed by identity).
        # Each part of the key: () when the plan has none, True for the common case, else a tuple per argument.
        dtypes: tuple = ()
        aligned: Union[bool, tuple] = ()
        widths: Union[bool, tuple] = ()
        divisible: Union[bool, tuple] = ()
        constants: tuple = ()
        if plan.tensors is not None:
            tensors = plan.tensors(args)
            dtypes = tuple(map(_dtype, tensors))
            aligned = (
                True if gcd(*map(_data_ptr, tensors)) & 15 == 0 else tuple(p & 15 == 0 for p in map(_data_ptr, tensors))
            )
        if plan.ints is not None:
            ints = plan.ints(args)
            try:  # one C-level pass: array('i') takes only ints that fit in int32 (Triton's "i32")
                array.array("i", ints)
                widths = True
            except OverflowError:
                widths = tuple(map(_int_width, ints))
        if plan.specialised is not None:
            specialised = plan.specialised(args)
            divisible = True if gcd(*specialised) & 15 == 0 else tuple((a % 16 == 0, a == 1) for a in specialised)
        if plan.constants is not None:
            constants = plan.constants(args)
        return plan, dtypes, aligned, widths, divisible, constants

    def _plan(self, types: tuple) -> Optional["_Plan"]:
        if self.params is None or len(types) > len(self.params):
            return None
        tensors, ints, specialised, constants = [], [], [], []
        for i, (t, param) in enumerate(zip(types, self.params)):
            if param.is_constexpr:
                constants.append(i)
            elif issubclass(t, torch.Tensor):
                if param.name not in self.trusted:
                    tensors.append(i)
            elif t is int:
                ints.append(i)
                if not param.do_not_specialize:
                    specialised.append(i)
            elif t not in (float, bool, type(None)):
                return None
        return _Plan(*map(_getter, (tensors, ints, specialised, constants)))


class _Plan:
    """Where one tuple of argument types puts the tensors, the ints, the specialised ints and the
    positional constexprs: C-level getters returning a tuple, None where there are none."""

    __slots__ = ("tensors", "ints", "specialised", "constants")

    def __init__(self, tensors, ints, specialised, constants):
        self.tensors, self.ints, self.specialised, self.constants = tensors, ints, specialised, constants


def _getter(positions: list):
    """``args -> tuple(args[i] for i in positions)`` without a Python frame (None for no positions):
    a slice where the positions are consecutive (the launchers pass tensors first), else an itemgetter."""
    if not positions:
        return None
    if positions == list(range(positions[0], positions[-1] + 1)):
        return operator.itemgetter(slice(positions[0], positions[-1] + 1))
    return operator.itemgetter(*positions)


_dtype = operator.attrgetter("dtype")
_data_ptr = torch.Tensor.data_ptr


def _int_width(a: int) -> int:
    return 0 if _I32[0] <= a < _I32[1] else (1 if _I64[0] <= a < _I64[1] else 2)


class DirectLaunch:
    """One cached ``CompiledKernel`` and the constexpr values that follow the positional arguments.
    Its launcher, function handle and packed metadata are read once: Triton sets them when the kernel
    is first launched (the autotuner path did that) and never resets them while the kernel lives."""

    __slots__ = ("kernel", "tail", "_run", "_function", "_packed")

    def __init__(self, kernel, tail: tuple):
        global _runtime_knobs
        if _runtime_knobs is None:
            from triton import knobs

            _runtime_knobs = knobs.runtime
        self.kernel = kernel
        self.tail = tail
        self._run, self._function, self._packed = kernel.run, kernel.function, kernel.packed_metadata

    def __call__(self, grid: tuple, args: tuple, stream) -> None:
        enter, leave = _runtime_knobs.launch_enter_hook, _runtime_knobs.launch_exit_hook
        # The metadata only feeds the enter hook: skipped while that is an empty HookChain.
        metadata = (
            self.kernel.launch_metadata(grid, stream, *args, *self.tail) if getattr(enter, "calls", enter) else None
        )
        size = len(grid)
        # JITFunction.run's launch (Triton 3.6 .. 3.9 share this CompiledKernel.run signature).
        self._run(
            grid[0],
            grid[1] if size > 1 else 1,
            grid[2] if size > 2 else 1,
            stream,
            self._function,
            self._packed,
            metadata,
            enter,
            leave,
            *args,
            *self.tail,
        )


_runtime_knobs: Any = None  # triton.knobs.runtime (the launch hooks), imported with the first DirectLaunch


def pack_tail(fn, n_positional: int, kwargs: dict) -> Optional[tuple]:
    """The keyword arguments' values in ``fn``'s parameter order after the positional ones (what
    ``JITFunction.run`` passes as ``bound_args.values()``), or None when they do not match the
    remaining parameters exactly (then the call stays on the autotuner path)."""
    names = getattr(fn, "arg_names", [])[n_positional:]
    if len(names) != len(kwargs) or any(name not in kwargs for name in names):
        return None
    return tuple(kwargs[name] for name in names)


class _KernelSite:
    """Per kernel name: its ``ArgSignature`` and the last (key, launch) found for it. Most launches
    repeat their kernel's previous key, and comparing with it is cheaper than hashing the key."""

    __slots__ = ("signer", "last")

    def __init__(self, fn, trusted: tuple):
        self.signer = ArgSignature(fn, trusted)
        self.last: tuple = (None, None)


class DirectCache:
    """Direct launches by key; filled from the autotuner path's results."""

    def __init__(self, trusted: tuple = ()):
        """``trusted``: parameter names whose tensors ``ArgSignature`` need not inspect (see there)."""
        self.trusted = tuple(trusted)
        self._entries: dict[tuple, DirectLaunch] = {}
        self._sites: dict[str, _KernelSite] = {}
        self._lock = threading.Lock()

    def lookup(
        self, kernel_name: str, fn, tune_key: tuple, autotune: bool, device, args: tuple, kwargs: dict
    ) -> tuple[Optional[tuple], Optional[DirectLaunch]]:
        """(key, cached launch or None) of a launch of ``fn`` (called ``kernel_name``) for ``tune_key``
        with autotuning on/off on ``device``: the key holds these, the keyword constexprs and the
        arguments' ``ArgSignature``; (None, None) when the arguments cannot be launched directly."""
        site = self._sites.get(kernel_name)
        if site is None:
            site = self._sites.setdefault(kernel_name, _KernelSite(fn, self.trusted))
        signature = site.signer(args)
        if signature is None:
            return None, None
        # The keyword names then their values, flat (unambiguous: as many names as values).
        key = (kernel_name, tune_key, autotune, device, (*kwargs, *kwargs.values()), signature)
        last = site.last
        if key == last[0]:
            return key, last[1]
        entry = self._entries.get(key)
        if entry is not None:
            site.last = (key, entry)
        return key, entry

    def remember(self, key: tuple, fn, kernel, n_positional: int, kwargs: dict) -> Optional[DirectLaunch]:
        """Cache ``kernel`` (what the autotuner path launched for ``key``) if it can be launched directly."""
        from triton.compiler import CompiledKernel

        if not isinstance(kernel, CompiledKernel) or getattr(fn, "pre_run_hooks", None):
            return None
        tail = pack_tail(fn, n_positional, kwargs)
        if tail is None:
            return None
        entry = DirectLaunch(kernel, tail)
        with self._lock:
            self._entries[key] = entry
        return entry

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._sites.clear()

    def __len__(self) -> int:
        return len(self._entries)
