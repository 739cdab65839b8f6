"""A Triton driver for CPU-only machines whose kernel launches do nothing: host-cost measurement.

``StubDriver`` replaces ``triton.runtime.driver.active``. Everything on the host runs as on a GPU:
the autotuner, ``JITFunction.run``'s argument binding and specialisation, the compile (real
``triton.compile`` for ``GPUTarget("cuda", capability, 32)``, real ptxas, cached on disk as
usual), ``CompiledKernel`` and our launchers. What is stubbed, and so NOT measured:

* ``CompiledKernel`` loading (``utils.load_binary`` returns dummy handles: no module is loaded);
* the launcher (``launcher_cls``): Triton's C launcher that unpacks the arguments and calls
  ``cuLaunchKernel`` (a few microseconds per launch on a GPU) is replaced by a call that only
  counts (and, when asked, records) the launch;
* the device and stream queries (constants instead of ``torch.cuda.current_device`` and
  ``_cuda_getCurrentRawStream``), and the autotuner's timing (``get_benchmarker``: every config
  runs once through the launcher and gets the same time, so the first config wins).

Tensors are CPU tensors: Triton's binder only reads their ``dtype`` and ``data_ptr()``. Works
with the driver interface of Triton 3.6 .. 3.9 (``CompiledKernel.run(gridX, gridY, gridZ,
stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

STREAM = 0x5EED  # the stream handle every launch reports (no CUDA stream exists)
DEVICE = 0


class StubLauncher:
    """What ``CompiledKernel.run`` calls; counts launches, hands them to ``StubDriver.on_launch``."""

    def __init__(self, src, metadata):
        self.name = getattr(metadata, "name", "?")

    def __call__(self, grid_x, grid_y, grid_z, stream, function, *rest):
        # 3.6 and 3.9 both pass (packed_metadata, launch_metadata, enter_hook, exit_hook, *kernel args).
        driver = _active
        driver.launches += 1
        if driver.on_launch is not None:
            driver.on_launch(self.name, (grid_x, grid_y, grid_z), stream, function, rest[4:])


class _StubUtils:
    def __init__(self, max_shared: int):
        self.max_shared = max_shared

    def load_binary(self, name, kernel, shared, device):
        # (module, function, n_regs, n_spills, n_max_threads)
        return (1, 1, 0, 0, 1024)

    def unload_module(self, module):
        pass

    def get_device_properties(self, device):
        return {
            "max_shared_mem": self.max_shared,
            "multiprocessor_count": 132,
            "max_num_regs": 65536,
            "warpSize": 32,
            "sm_clock_rate": 1980000,
            "mem_clock_rate": 2619000,
            "mem_bus_width": 5120,
        }


class _StubBenchmarker:
    def __call__(self, kernel_call, quantiles=None, **kwargs):
        kernel_call()  # compiles the config as the real autotuner would
        return [1.0, 1.0, 1.0] if quantiles else 1.0


_active: Optional["StubDriver"] = None


class StubDriver:
    """Duck-typed ``triton.runtime.driver`` backend: a CUDA target whose launches are no-ops."""

    def __init__(self, capability: int = 90, max_shared: int = 232448):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", capability, 32)
        self.utils = _StubUtils(max_shared)
        self.launcher_cls = StubLauncher
        self.launches = 0
        self.on_launch: Optional[Callable] = None  # (name, grid, stream, function, args) per launch

    @classmethod
    def is_active(cls):
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return DEVICE

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return STREAM

    def get_device_capability(self, device=None):
        return divmod(self.target.arch, 10)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("the stub driver generates no launcher source")

    def get_benchmarker(self):
        return _StubBenchmarker()

    def get_empty_cache_for_benchmark(self):
        import torch

        return torch.empty(1)

    def clear_cache(self, cache):
        pass


@contextlib.contextmanager
def stub_driver(capability: int = 90):
    """Install a ``StubDriver`` as Triton's active driver for the block (restores the previous one)."""
    global _active
    from triton.runtime import driver as config

    previous = config._active
    _active = StubDriver(capability)
    config.set_active(_active)
    try:
        yield _active
    finally:
        config._active = previous
        _active = None
