"""Triton sampler (ops/sampling/triton_kernels.py) without a GPU.

1. Correctness in Triton's interpreter (TRITON_INTERPRET=1, in a subprocess so the
   variable is set before any kernel is decorated): exact agreement with the float64
   reference and with the C++ sampler, and noise-inversion round trips.
2. Compilation for sm_80 / sm_90 with Triton's ptxas: the kernels build for real
   GPUs (float64 exp included) and do not spill.
"""

import os
import re
import subprocess
import sys
import tempfile
import textwrap
import warnings

import pytest

from helpers import REPO

pytest.importorskip("triton")

ROOT = str(REPO)

INTERPRETER_CHECK = textwrap.dedent(
    """
    import torch
    from kforcing_kernels import _extension
    from kforcing_kernels.ops.sampling import triton_kernels as st

    def reference64(logits, z, tau):
        cdf = torch.softmax(logits.double() / tau, -1).cumsum(-1)
        return torch.searchsorted(cdf, z.double()[:, None].contiguous(),
                                  right=True)[:, 0].clamp(max=logits.shape[-1] - 1)

    assert st.interpreting() and st.available() is None
    ext = _extension.load()
    g = torch.Generator().manual_seed(0)
    checked = 0
    for V in (1, 7, 2500):
        for tau in (0.01, 1.0, 5.0):
            for dtype in (torch.float32, torch.float64):
                logits = torch.randn(8, V, generator=g, dtype=torch.float64) * 3
                if V > 1:
                    logits[:, 1] = logits[:, 0]                      # a tie
                if V > 3:
                    logits[:, 2::5] = float("-inf")
                    logits[::2, -1] = float("-inf")
                logits = logits.to(dtype)
                z = torch.rand(8, generator=g)
                z[0], z[1] = 0.0, torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
                t = torch.tensor(tau, dtype=torch.float64)
                got = st.inverse_cdf_sample(logits, z, t)
                want = reference64(logits, z, tau)
                assert torch.equal(got, want), (V, tau, dtype, got, want)
                if ext is not None:
                    assert torch.equal(got, ext.inverse_cdf_sample(logits, z, t)), (V, tau, dtype)
                back = st.noise_inversion(logits, got, t, torch.rand(8, generator=g))
                assert back.dtype == torch.float32
                assert torch.equal(st.inverse_cdf_sample(logits, back, t), got), (V, tau, dtype)
                checked += 1
    # Per-row temperatures and a batch shape.
    logits = torch.randn(2, 3, 1500, generator=g)
    z = torch.rand(2, 3, generator=g)
    tau = torch.rand(2, 3, generator=g, dtype=torch.float64) + 0.1
    got = st.inverse_cdf_sample(logits, z, tau)
    assert got.shape == (2, 3)
    assert torch.equal(got.flatten(), torch.stack([reference64(logits.view(6, -1)[i:i + 1], z.view(6)[i:i + 1],
                                                               tau.view(6)[i].item())[0] for i in range(6)]))
    print("checked", checked)
    """
)


def test_triton_sampler_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("KFORCING_DISABLE_EXT", None)
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRETER_CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "checked 18" in proc.stdout


_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def _tools_missing():
    import triton

    for tool in ("ptxas", "cuobjdump"):
        path = getattr(triton.knobs.nvidia, tool).path
        if not path or not os.access(path, os.X_OK):
            return f"Triton's {tool} is missing ({path!r})"
    return None


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels; the interpreter is on")
@pytest.mark.parametrize("arch", [80, 90])
def test_triton_sampler_compiles_for_gpus_without_spills(arch):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kforcing_kernels.ops.sampling import triton_kernels as st

    if _tools_missing():
        pytest.skip(_tools_missing())
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    consts = {"BLOCK": st.BLOCK, "NB_P2": 64}
    ints = {"V": "i32", "NB": "i32"}
    jobs = {
        "block_stats_bf16": (st._block_stats, {"x_ptr": "*bf16", "tau_ptr": "*fp64", "stats_ptr": "*fp64"}),
        "block_stats_fp32": (st._block_stats, {"x_ptr": "*fp32", "tau_ptr": "*fp64", "stats_ptr": "*fp64"}),
        "sample_fp32": (
            st._sample,
            {"x_ptr": "*fp32", "z_ptr": "*fp64", "tau_ptr": "*fp64", "stats_ptr": "*fp64", "out_ptr": "*i64"},
        ),
        "invert_bf16": (
            st._invert,
            {
                "x_ptr": "*bf16",
                "tok_ptr": "*i64",
                "u_ptr": "*fp64",
                "tau_ptr": "*fp64",
                "stats_ptr": "*fp64",
                "out_ptr": "*fp32",
            },
        ),
    }
    for name, (fn, pointers) in jobs.items():
        signature = {p.name: pointers.get(p.name) or ints.get(p.name) or "constexpr" for p in fn.params}
        constexprs = {key: val for key, val in consts.items() if key in signature}
        compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32))
        assert "__nv_exp" in compiled.asm["ptx"], f"{name}: float64 exp should lower to libdevice"
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kernel.cubin")
            with open(path, "wb") as f:
                f.write(compiled.asm["cubin"])
            dump = subprocess.run(
                [triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", path],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        reg, stack, _, local = (int(x) for x in _RESOURCES.search(dump).groups())
        assert stack == 0 and local == 0, f"sm_{arch} {name}: spills (REG {reg} STACK {stack} LOCAL {local})"
