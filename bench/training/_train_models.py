"""The teacher/student pair of a Stage-2 step for the training benches (``memory``, ``teacher``), built as the
trainer builds it, and the counters they share (collective buffers, the teacher's passes, resident memory).

A pair is the native model (``--preset``) or a Hugging Face causal LM: ``--hf-llama NAME`` (a built-in Llama config of
:data:`HF_LLAMA`) or ``--model-config FILE`` (a transformers config JSON, as ``kforcing-train --model-config``). Both
go through ``kforcing_kernels.app.hf_recipe.files.build_from_config``: the teacher is a PFLM(k/2) (frozen), the student
a copy of it trained at window k (Stage 2 starts the student from its teacher).
"""

from __future__ import annotations

import copy
import json
import resource
import tempfile
from pathlib import Path

import torch

# Llama configs (tied embeddings, no dropout). Parameters of the HF model, noise embedding not included:
#   100m: 32000 x 768 embedding (24,576,000, tied head) + 12 x 7,079,424 per layer + 768 final norm = 109,529,856
#    25m: 16000 x 512 embedding (8,192,000, tied head) + 6 x 3,212,288 per layer + 512 final norm = 27,466,240
_LLAMA = dict(
    model_type="llama",
    hidden_act="silu",
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    attention_dropout=0.0,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
)
HF_LLAMA = {
    "tiny": dict(
        _LLAMA,
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    ),
    "25m": dict(
        _LLAMA,
        vocab_size=16000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
    ),
    "100m": dict(
        _LLAMA,
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
    ),
}


def add_model_arguments(p, preset: str, hf_llama: str | None = None) -> None:
    from kforcing_kernels.app.cli import add_preset

    add_preset(p, preset, help="native model size of teacher and student (unless --hf-llama or --model-config)")
    p.add_argument(
        "--hf-llama",
        choices=sorted(HF_LLAMA),
        default=hf_llama,
        help="a Hugging Face Llama of this built-in config instead of the native model (see "
        "bench/training/_train_models.py)",
    )
    p.add_argument(
        "--model-config", default=None, help="a Hugging Face model from this transformers config JSON instead"
    )


def model_name(args) -> str:
    if args.model_config:
        return f"HF {Path(args.model_config).name}"
    return f"HF Llama {args.hf_llama}" if args.hf_llama else args.preset


def model_argv(args) -> list[str]:
    """The model options again, for a torchrun worker's command line."""
    if args.model_config:
        return ["--model-config", str(Path(args.model_config).resolve())]
    return ["--hf-llama", args.hf_llama] if args.hf_llama else ["--preset", args.preset]


def build_pair(args, seq_len: int, k: int, device: torch.device, seed: int = 0):
    """(teacher PFLM(k/2), frozen, eval; student PFLM(k), a copy of it, train) on ``device``, unsharded."""
    if args.hf_llama or args.model_config:
        from kforcing_kernels.app.hf_recipe.files import build_from_config

        if args.model_config:
            teacher = build_from_config(args.model_config, seed)
        else:
            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder, "config.json")
                path.write_text(json.dumps(HF_LLAMA[args.hf_llama]))
                teacher = build_from_config(path, seed)
        # build_from_config seeds the HF weights only; Stage 1 gives the noise embedding its seeded start (as the
        # trainer)
        teacher.reset_noise_encoder(torch.Generator().manual_seed(seed))
        teacher.k_train = k // 2
    else:
        from kforcing_kernels.model import PRESETS, KForcingLM

        torch.manual_seed(seed)
        teacher = KForcingLM(PRESETS[args.preset](seq_len=seq_len))
    student = copy.deepcopy(teacher).to(device).train().requires_grad_(True)
    student.k_train = k
    return teacher.to(device).eval().requires_grad_(False), student


def vocab_size(model) -> int:
    return model.config.vocab_size


class Collectives:
    """Counts the bytes of the buffers FSDP2 passes to torch.distributed's all-gather and reduce-scatter; the
    all-gathers made inside a teacher pass (:meth:`watch_teacher`) separately, in ``teacher_gathered``."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.gathered, self.scattered, self.teacher_gathered, self.in_teacher = dist, 0, 0, 0, False
        self.original = dist.all_gather_single, dist.reduce_scatter_single

    def reset(self) -> None:
        self.gathered = self.scattered = self.teacher_gathered = 0

    def watch_teacher(self, teacher) -> None:
        """Route the all-gathers of ``teacher``'s passes (forward, single_forward, double_forward) to
        ``teacher_gathered``."""
        for name in ("forward", "single_forward", "double_forward"):
            method = getattr(teacher, name)

            def wrapped(*args, _method=method, **kwargs):
                self.in_teacher = True
                try:
                    return _method(*args, **kwargs)
                finally:
                    self.in_teacher = False

            setattr(teacher, name, wrapped)

    def __enter__(self):
        def all_gather(output_tensor, input_tensor, *args, **kwargs):
            if self.in_teacher:
                self.teacher_gathered += output_tensor.nbytes
            else:
                self.gathered += output_tensor.nbytes
            return self.original[0](output_tensor, input_tensor, *args, **kwargs)

        def reduce_scatter(output, input, *args, **kwargs):
            self.scattered += input.nbytes
            return self.original[1](output, input, *args, **kwargs)

        self.dist.all_gather_single, self.dist.reduce_scatter_single = all_gather, reduce_scatter
        return self

    def __exit__(self, *exc):
        self.dist.all_gather_single, self.dist.reduce_scatter_single = self.original


def tensor_bytes(tensors) -> int:
    """Bytes of the tensors as this rank holds them (a DTensor: its local shard)."""
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors if torch.is_tensor(t))


def rss_bytes() -> tuple[int, int]:
    """(resident bytes now, peak resident bytes of this process so far) on Linux; (0, peak) elsewhere."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        import os

        rss = pages * os.sysconf("SC_PAGE_SIZE")
        return rss, max(peak, rss)  # the kernel updates ru_maxrss in steps: it can trail the current size a little
    except (OSError, ValueError, IndexError):
        return 0, peak


def execute_launcher(args, worker, run, report, payload) -> int:
    """The command of a torchrun bench: as a worker (``--worker-out``) run ``worker(args)``; else check ``--k``, launch
    ``run(args)``, print ``report(result)`` and write ``payload(result)`` as JSON to ``--out``."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker_out:
        worker(args)
        return 0
    if args.k % 2:
        raise SystemExit(f"--k: expected an even student window (twice the teacher's), got {args.k}")
    result = run(args)
    print(report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(payload(result), indent=1))
    return 0
