"""GPU sampler rows of bench/gpu/triton_gpu.py (``--sampler``): the Triton inverse-CDF sampler against the plain torch
way."""

from __future__ import annotations

import torch


def rows(args, time_ms) -> list[dict]:
    """The Triton inverse-CDF sampler vs softmax + cumsum + searchsorted (fp32, fp64) on bf16 logits, timed by
    ``time_ms`` (bench/gpu/triton_gpu.py's); one row per (``args.sampler_vocab``, ``args.sampler_rows``)."""
    from kforcing_kernels.ops import sampling

    from ..attention.cpu_kernels import softmax_cumsum_searchsorted

    rows = []
    for vocab in args.sampler_vocab:
        for n_rows in args.sampler_rows:
            gen = torch.Generator(device=args.device).manual_seed(0)
            logits = (torch.randn(n_rows, vocab, device=args.device, generator=gen) * 2).to(torch.bfloat16)
            z = torch.rand(n_rows, device=args.device, generator=gen)
            tau = 0.8
            methods = {
                "triton": lambda logits=logits, z=z, tau=tau: sampling.inverse_cdf_sample(logits, z, tau),
                "softmax+cumsum+searchsorted fp32": lambda logits=logits, z=z, tau=tau: softmax_cumsum_searchsorted(
                    logits, z, tau, torch.float32
                ),
                "softmax+cumsum+searchsorted fp64": lambda logits=logits, z=z, tau=tau: softmax_cumsum_searchsorted(
                    logits, z, tau, torch.float64
                ),
            }
            times = {name: time_ms(fn) for name, fn in methods.items()}
            agree = float(
                (methods["triton"]() == sampling.inverse_cdf_sample_reference(logits, z, tau)).double().mean()
            )
            read_gb = logits.numel() * logits.element_size() / 1e9
            row = {
                "vocab": vocab,
                "rows": n_rows,
                "backend": sampling.sampler_backend("cuda"),
                "ms": times,
                "logits_read_gb_per_s": {name: read_gb / (ms / 1e3) for name, ms in times.items()},
                "agreement_with_fp64_reference": agree,
            }
            rows.append(row)
            print(
                f"sampler V={vocab} rows={n_rows}: "
                + ", ".join(f"{n} {ms:.3f} ms" for n, ms in times.items())
                + f" | triton x{times['softmax+cumsum+searchsorted fp32'] / times['triton']:.1f} vs fp32; "
                f"agrees with fp64 on {agree:.4f}",
                flush=True,
            )
    return rows
