"""The GPU check's own steps (bench/gpu/check.py): versions, the smoke test, int64 offsets, the sampler, the vLLM slot.

    python -m bench gpu-script versions|smoke|int64|sampler|vllm [--dry-run] [--dims D ...]

Each exits 0 when its check passes. ``--dry-run`` runs the same code on CPU (tiny shapes, fp32; the triton
backend in Triton's interpreter when TRITON_INTERPRET=1 was set before the first import of triton, as the
check's dry run does).
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
import time


def versions(dry: bool) -> int:
    """Packages, the GPU, the triton tile sets and autotune switch, composite_cuda's kernels, the dispatch table."""
    print("python", sys.version.split()[0], "on", platform.platform())
    required = {
        "torch": "everything",
        "triton": "the triton backend",
        "numpy": "torch and Triton",
        "pytest": "the pytest step (python_tests/.../test_triton_gpu.py)",
    }
    optional = {
        "flash_attn": "the bench's fa2_causal column (empty without it; sdpa_causal is always measured)",
        "flash_attn.cute": "FlexAttention's FLASH route (KFORCING_FLEX_BACKEND=FLASH, the flash-attn-4 package)",
        "safetensors": "kforcing_kernels.app.train / inference checkpoints; not used by this script",
        "tokenizers": "kforcing_kernels.app.data; not used by this script",
        "transformers": "the HF integration tests; not run here",
    }
    missing = []
    for name, why in {**required, **optional}.items():
        try:
            module = importlib.import_module(name)
            print(f"  {name:17s} {getattr(module, '__version__', '(no __version__)')}")
        except Exception as exc:  # noqa: BLE001 - report, never fail here
            kind = "MISSING, REQUIRED for" if name in required else "missing (optional):"
            print(f"  {name:17s} {kind} {why} [{type(exc).__name__}: {exc}]")
            if name in required:
                missing.append(name)
    if missing:
        print(
            f"REQUIRED PACKAGES MISSING: {', '.join(missing)}. The check installs nothing (no network); "
            "the steps that need them fail."
        )
    import torch

    print(
        "torch",
        torch.__version__,
        "cuda",
        torch.version.cuda,
        "cudnn",
        torch.backends.cudnn.version(),
        "cuda available:",
        torch.cuda.is_available(),
    )
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        print(
            f"device 0: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
            f"{total / 2**30:.1f} GiB ({free / 2**30:.1f} free), {torch.cuda.device_count()} device(s)"
        )
    try:
        import triton

        print("triton", triton.__version__, "ptxas", getattr(triton.knobs.nvidia.ptxas, "path", "?"))
    except Exception as exc:  # noqa: BLE001
        print("triton check failed:", type(exc).__name__, exc)
    import kforcing_kernels
    from kforcing_kernels.ops.window_attention import dispatch
    from kforcing_kernels.ops.window_attention.composite import cuda as composite_cuda
    from kforcing_kernels.ops.window_attention.triton import configs

    print("kforcing_kernels imported from", kforcing_kernels.__file__)
    print("backends:", kforcing_kernels.backends_available())
    print("backend limits:", kforcing_kernels.ops.window_attention.backend_limits())
    print("composite_cuda kernels:", composite_cuda.status())
    sets = {n: {d: tuple(t.__dict__.values()) for d, t in s.items()} for n, s in configs.TILE_SETS.items()}
    print("triton autotune:", "on" if configs.autotune_enabled() else "off (first config)", "| tile sets:", sets)
    print("dispatch table:", dispatch.TABLE_PATH, f"{len(dispatch.load()['rows'])} measured row(s)")
    return 1 if missing else 0


def smoke(dry: bool, dims: tuple[int, ...] | None = None) -> int:
    """window_attention(backend="triton") fwd+bwd in bf16 vs the float64 reference (ours <= 2x torch's own bf16
    error + 8e-3), at ``dims`` (None: 128 and 64; the dry run 64), slot and tile modes, every tile set that has the
    head dim forced in turn (the A/B times each of them: bench/gpu/gpu_variants.txt), 3 more runs that must match
    bit for bit; backend="flex" on one case; the composite CUDA path."""
    import torch

    from kforcing_kernels import WindowLayout, window_attention
    from kforcing_kernels.ops.window_attention.composite import cuda as composite_cuda
    from kforcing_kernels.ops.window_attention.triton.configs import TILE_SETS

    dev = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16  # the interpreter's bf16 dot is wrong
    failures = 0

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def run(q, k, v, layout, dout, backend, grads=True):
        out, lse = window_attention(q, k, v, layout, backend=backend, return_lse=True)
        if not grads:
            return out, lse
        return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))

    def case(name, layout, d, batch=2, heads=4, kv_heads=2, backend="triton"):
        nonlocal failures
        g = torch.Generator(device=dev).manual_seed(0)
        grads = not (backend == "flex" and dev.type == "cpu")  # FlexAttention has no CPU backward

        def rand(h, length):
            return torch.randn(batch, h, length, d, device=dev, dtype=dtype, generator=g)

        q, k, v = rand(heads, layout.n_queries), rand(kv_heads, layout.n_keys), rand(kv_heads, layout.n_keys)
        dout = rand(heads, layout.n_queries)
        q, k, v = (t.requires_grad_(grads) for t in (q, k, v))
        tiles = os.environ.get("KFORCING_TRITON_TILES", "auto")
        label = f"{backend:9s} {name:26s} {str(dtype)[6:]:8s} D={d:3d} tiles={tiles}"
        try:
            t0 = time.perf_counter()
            ours = run(q, k, v, layout, dout, backend, grads)
            sync()
            first_s = time.perf_counter() - t0
            ref64 = run(
                *(t.detach().double().requires_grad_(grads) for t in (q, k, v)),
                layout,
                dout.double(),
                "reference",
                grads,
            )
            ref_lp = run(
                *(t.detach().clone().requires_grad_(grads) for t in (q, k, v)), layout, dout, "reference", grads
            )
            repeat_ok = True
            for _ in range(1 if dry else 3):
                again = run(q, k, v, layout, dout, backend, grads)
                repeat_ok &= all(torch.equal(a, b) for a, b in zip(again, ours))
        except Exception as exc:  # noqa: BLE001 - report and go on
            failures += 1
            print(f"{label}: EXCEPTION {type(exc).__name__}: {exc}", flush=True)
            return
        floor = 8e-3 if dtype == torch.bfloat16 else 1e-3
        # composite: each piece run by a fused CUDA kernel returns its dK/dV in the input dtype, so a key's
        # gradient is rounded once per fused piece that sees it and again after the fp32 sum (<= 2 + 1 roundings
        # here) where torch's dense reference rounds once: 3x (test_composite_cuda.py, the rounding test).
        factor = 3 if backend == "composite" else 2
        parts, ok = [], repeat_ok
        for what, a, b, c in zip(("out", "lse", "dq", "dk", "dv"), ours, ref64, ref_lp):
            finite = bool(torch.isfinite(a).all())
            err = (a.double() - b).abs().max().item()
            torch_err = (c.double() - b).abs().max().item()
            good = finite and err <= factor * torch_err + floor
            ok &= good
            parts.append(f"{what} {err:.1e}/{torch_err:.1e}{'' if finite else ' NONFINITE'}{'' if good else ' BAD'}")
        failures += not ok
        print(
            f"{label}: first call {first_s:5.1f}s | max err ours/torch-same-dtype vs fp64: {', '.join(parts)} | "
            f"bitwise repeatable: {repeat_ok} | {'OK' if ok else 'FAIL'}",
            flush=True,
        )

    if dry:  # the same calls on fewer, smaller cases: each interpreted fwd + bwd takes seconds
        cases = [
            ("single N=4 k=4", WindowLayout.kforcing_single(4, 4)),
            ("double N=2 k=12 (tiles)", WindowLayout.kforcing_double(2, 12)),
        ]
        big, big_name, tile_cases = WindowLayout.kforcing_single(8, 4), "single N=8 k=4 H=2", cases[:1]
        dims = dims or (64,)
    else:
        cases = [
            ("single N=256 k=4", WindowLayout.kforcing_single(256, 4)),  # slot mode (w <= 16)
            ("double N=128 k=4", WindowLayout.kforcing_double(128, 4)),  # slot mode, two streams
            ("double N=64 k=12 (tiles)", WindowLayout.kforcing_double(64, 12)),  # w = 24: tile mode with streams
            ("sbd N=300 b=7", WindowLayout.sbd(300, 7)),  # full intra, short last window
        ]
        big, big_name = WindowLayout.kforcing_single(1024, 4), "single N=1024 k=4 H=16"
        dims, tile_cases = dims or (128, 64), cases[:3]
    big_heads = 2 if dry else 16
    for d in dims:
        for name, layout in cases:
            case(name, layout, d)
    previous = os.environ.get("KFORCING_TRITON_TILES")
    try:
        for d in dims:  # every tile set with this head dim, whatever this GPU would pick
            for tiles in [name for name, tile_set in TILE_SETS.items() if d in tile_set]:
                os.environ["KFORCING_TRITON_TILES"] = tiles
                for name, layout in tile_cases:
                    case(name, layout, d)
                if not dry:
                    case(big_name, big, d, batch=1, heads=big_heads, kv_heads=big_heads)
    finally:
        if previous is None:
            os.environ.pop("KFORCING_TRITON_TILES", None)
        else:
            os.environ["KFORCING_TRITON_TILES"] = previous
    case(big_name, big, dims[0], batch=1, heads=big_heads, kv_heads=big_heads, backend="flex")
    for name, layout in cases:
        case(name, layout, dims[0], backend="composite")
    print("composite_cuda kernels:", composite_cuda.status())
    failures += bool(composite_cuda.status()["disabled"])
    print(f"smoke: {failures} failing case(s)")
    return 1 if failures else 0


def int64_offsets(dry: bool) -> int:
    """B*H*L*D > 2^31 elements per tensor: the first and last batch element vs the reference (dry: the code path
    on 3 small batch elements)."""
    import torch

    from kforcing_kernels import WindowLayout, window_attention

    layout = WindowLayout.kforcing_single(8 if dry else 64, 4)  # Lq = Lk = 320, 256 window rows
    heads, d, dtype = (2, 32, torch.float32) if dry else (16, 128, torch.bfloat16)
    per_batch = heads * layout.n_queries * d
    batch = 3 if dry else 2**31 // per_batch + 2
    elems = batch * per_batch
    window_rows = layout.n_queries - layout.n_ctx
    # Peak: q, k, v, out, dout, dq, dk, dv (bf16), the fp32 slot partial, lse/delta.
    need = 8 * elems * 2 + batch * heads * window_rows * d * 4 + 2 * batch * heads * layout.n_queries * 4
    free = need * 2 + 2**32 if dry else torch.cuda.mem_get_info()[0]
    print(
        f"B={batch} H={heads} L={layout.n_queries} D={d}: {elems} elements per tensor (2^31 = {2**31}); "
        f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    )
    if free < need * 1.1 + 2 * 2**30:
        print("int64 offsets: SKIPPED (not enough free GPU memory)")
        return 0
    dev = torch.device("cpu" if dry else "cuda")
    g = torch.Generator(device=dev).manual_seed(0)

    def rand():
        return torch.randn(batch, heads, layout.n_queries, d, device=dev, dtype=dtype, generator=g)

    q, k, v = (rand().requires_grad_(True) for _ in range(3))
    dout = rand()
    out, lse = window_attention(q, k, v, layout, backend="triton", return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    if not dry:
        torch.cuda.synchronize()

    def reference(b, precision):
        qr, kr, vr = (t[b : b + 1].detach().to(precision).requires_grad_(True) for t in (q, k, v))
        ro, rl = window_attention(qr, kr, vr, layout, backend="reference", return_lse=True)
        return (ro, rl, *torch.autograd.grad(ro, (qr, kr, vr), dout[b : b + 1].to(precision)))

    bad = 0
    for b in (0, batch - 1):
        ref64, ref_lp = reference(b, torch.float64), reference(b, dtype)
        parts = []
        for what, a, r, c in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref64, ref_lp):
            a = a[b : b + 1]
            err = (a.double() - r).abs().max().item()
            torch_err = (c.double() - r).abs().max().item()
            good = bool(torch.isfinite(a).all()) and err <= 2 * torch_err + (1e-3 if dry else 8e-3)
            bad += not good
            parts.append(f"{what} {err:.1e}/{torch_err:.1e}{'' if good else ' BAD'}")
        print(f"batch element {b}: max err ours/torch-bf16 vs fp64: {', '.join(parts)}")
    print("int64 offsets:", "FAIL" if bad else "OK")
    return 1 if bad else 0


def sampler(dry: bool) -> int:
    """The Triton inverse-CDF sampler vs torch float64, and the noise-inversion round trip."""
    import torch

    from kforcing_kernels.ops import sampling

    dev = torch.device("cpu" if dry else "cuda")
    rows = 16 if dry else 256
    print(f"sampler backend on {dev.type}:", sampling.sampler_backend(dev))
    g = torch.Generator(device=dev).manual_seed(0)
    fails = 0
    for vocab in (7, 300) if dry else (7, 2500, 152064):
        for dtype in (torch.float32, torch.bfloat16):
            for tau in (0.3, 1.0):
                logits = (torch.randn(rows, vocab, device=dev, generator=g) * 3).to(dtype)
                if vocab > 3:
                    logits[:, 2::5] = float("-inf")
                z = torch.rand(rows, device=dev, generator=g)
                got = sampling.inverse_cdf_sample(logits, z, tau)
                want = sampling.inverse_cdf_sample_reference(logits, z, tau)
                mismatch = int((got != want).sum())
                z_back = sampling.noise_inversion(logits, got, tau, generator=g)
                round_trip = int((sampling.inverse_cdf_sample(logits, z_back, tau) != got).sum())
                # A lone mismatch can be a 1-ulp float64 difference at a bin edge; more than 2 of 256 is a bug.
                fails += mismatch > 2 or round_trip > 2
                print(
                    f"V={vocab:6d} {str(dtype)[6:]:8s} tau={tau}: {mismatch}/{rows} differ from the torch float64 "
                    f"reference, {round_trip}/{rows} noise-inversion round trips fail"
                )
    if not dry:
        torch.cuda.synchronize()
    print("sampler:", "FAIL" if fails else "OK")
    return 1 if fails else 0


def vllm_slot(dry: bool) -> int:
    """The GPU check's slot for the vLLM serving step (issue 57: K-Forcing k = 4 vs vLLM AR on the same backbone at
    batch 4 / 16 / 128, CUDA graphs on), which the vLLM integration's branch fills in: here it only says whether
    that step could run (``kforcing_kernels.integrations.vllm`` imports and vllm is installed) and exits 0; the
    runner gives its unused seconds to the steps after it."""
    import importlib

    missing = []
    for name in ("vllm", "kforcing_kernels.integrations.vllm"):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - absent is an answer, not a failure
            missing.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    if missing:
        print("vllm serving step: absent (" + "; ".join(missing) + ")")
    else:
        print("vllm serving step: present, but this checkout's plan has no command for it (the slot is a placeholder)")
    return 0


SCRIPTS = {"versions": versions, "smoke": smoke, "int64": int64_offsets, "sampler": sampler, "vllm": vllm_slot}


def add_arguments(p) -> None:
    p.add_argument("script", choices=sorted(SCRIPTS), help="which check")
    p.add_argument("--dry-run", action="store_true", help="CPU, fp32, tiny shapes (the Triton interpreter)")
    p.add_argument("--dims", type=int, nargs="+", default=None, help="smoke: head dims (None: 128 64; dry: 64)")


def execute(args) -> int:
    if args.dims is not None and args.script != "smoke":
        raise SystemExit(f"--dims: only the smoke script takes head dims, not {args.script!r}")
    if args.script == "smoke":
        return smoke(args.dry_run, tuple(args.dims) if args.dims else None)
    return SCRIPTS[args.script](args.dry_run)
