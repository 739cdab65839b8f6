"""The curated mutation list for tools/mutate.py (issue 17, item 5).

Each entry is one realistic semantic bug: ``old`` must occur exactly once in ``file``
and is replaced by ``new``; ``tests`` are the pytest arguments (files, ``-k``) that
must catch it; ``env`` extra environment; ``rebuild`` marks C++ sources (the scratch
copy rebuilds the extension). When a bug slips past the suite, add it here together
with the test that catches it.
"""

WA = "kforcing_kernels/ops/window_attention"
TRITON_ENV = {"TRITON_INTERPRET": "1"}
TRITON_CASES = ["python_tests/test_triton_interpreter_cases.py", "-k", "test_matches_reference and (ptp-batched or sbd-N17-b2 or double-N17-k2)"]

MUTATIONS = [
    # --- inference positions (survived the suite before issue 17)
    dict(id="prefill-noise-positions+1", file="kforcing_kernels/app/serving.py",
         old="lengths[:, None] + torch.arange(k)], 1)", new="lengths[:, None] + 1 + torch.arange(k)], 1)",
         tests=["python_tests/test_sharp_behaviour.py", "python_tests/test_paged_generation.py"]),
    dict(id="kforcing-decode-positions+1", file="kforcing_kernels/app/inference.py",
         old="positions = (kv.lengths[:, None] + torch.arange(2 * k))",
         new="positions = (kv.lengths[:, None] + 1 + torch.arange(2 * k))",
         tests=["python_tests/test_sharp_behaviour.py", "python_tests/test_paged_generation.py"]),
    dict(id="ar-decode-positions+1", file="kforcing_kernels/app/inference.py",
         old="positions = kv.lengths[:, None].to(device)", new="positions = (kv.lengths[:, None] + 1).to(device)",
         tests=["python_tests/test_sharp_behaviour.py", "python_tests/test_paged_generation.py"]),
    dict(id="model-noise-positions-without+1", file="kforcing_kernels/layouts/positions.py",
         old="noise = (t[..., None] + 1 + torch.arange(k, device=device))", new="noise = (t[..., None] + torch.arange(k, device=device))",
         tests=["python_tests/test_sharp_behaviour.py", "python_tests/test_model.py"]),
    dict(id="double-forward-future2-positions-1", file="kforcing_kernels/layouts/positions.py",
         old="(t + 1 + k + i).flatten(-2)", new="(t + k + i).flatten(-2)",
         tests=["python_tests/test_sharp_behaviour.py"]),
    # --- loss wiring
    dict(id="stage1-loss-tau=1", file="kforcing_kernels/app/objectives.py",
         old="forward_distillation_targets(teacher_logits, noise[..., 0], batch.tau)",
         new="forward_distillation_targets(teacher_logits, noise[..., 0], torch.ones_like(batch.tau))",
         tests=["python_tests/test_objectives.py"]),
    dict(id="stage2-second-round-reuses-first-noise", file="kforcing_kernels/app/objectives.py",
         old="teacher.double_forward(context_kv, first, z[..., k:], tau,", new="teacher.double_forward(context_kv, first, z[..., :k], tau,",
         tests=["python_tests/test_objectives.py"]),
    dict(id="noise-inversion-targets-unshifted", file="kforcing_kernels/app/objectives.py",
         old="targets = tokens[:, 1:][:, reads]", new="targets = tokens[:, :-1][:, reads]",
         tests=["python_tests/test_objectives.py"]),
    # --- evaluation order
    dict(id="per-position-nll-reversed", file="kforcing_kernels/app/evaluate.py",
         old='"nll": (nll / batches).tolist()', new='"nll": (nll / batches).flip(0).tolist()',
         tests=["python_tests/test_per_position_nll.py"]),
    # --- sampler convention
    dict(id="reference-sampler->=", file="kforcing_kernels/ops/sampling/reference.py",
         old="searchsorted(cdf, target.contiguous(), right=True)", new="searchsorted(cdf, target.contiguous(), right=False)",
         tests=["python_tests/test_sampler_oracle.py"]),
    dict(id="cpp-sampler->= (C++)", file="csrc/kf_isa_impl.h", rebuild=True,
         old="run * st.brel[b] > target) return", new="run * st.brel[b] >= target) return",
         tests=["python_tests/test_sampler_oracle.py"]),
    dict(id="cpp-gemm-ignores-accumulate (C++)", file="csrc/kf_isa_impl.h", rebuild=True,
         old="acc[i][j] = accumulate ? vload(C + i * ldc + j * L) : V{};", new="acc[i][j] = V{};",
         tests=["python_tests/test_cpp_attention.py"]),
    # --- masks: constructors and the row-interval rule
    dict(id="kforcing-staircase-sees-next-token", file="kforcing_kernels/layouts/constructors.py",
         old="hi = torch.arange(1, n_ctx + 1)\n    docs", new="hi = torch.arange(2, n_ctx + 2).clamp(max=n_ctx)\n    docs",
         tests=["python_tests/test_layouts.py", "python_tests/test_backends_vs_paper_masks.py"]),
    dict(id="sbd-block-sees-own-first-clean-token", file="kforcing_kernels/layouts/constructors.py",
         old="hi = torch.arange(m) * block\n", new="hi = (torch.arange(m) * block + 1).clamp(max=n_ctx)\n",
         tests=["python_tests/test_layouts.py", "python_tests/test_backends_vs_paper_masks.py"]),
    dict(id="interval-own-stream-excludes-self", file="kforcing_kernels/layouts/intervals.py",
         old="torch.where(stream == j, within + 1, 0)", new="torch.where(stream == j, within, 0)",
         tests=["python_tests/test_layouts.py", "python_tests/test_backends_vs_paper_masks.py"]),
    dict(id="interval-later-stream-rule->=", file="kforcing_kernels/layouts/intervals.py",
         old="torch.where(stream > j, n_j,", new="torch.where(stream >= j, n_j,",
         tests=["python_tests/test_layouts.py", "python_tests/test_backends_vs_paper_masks.py"]),
    # --- cpp backend (Python side: what is passed to the kernels)
    dict(id="cpp-backward-scale-1", file=f"{WA}/cpp.py",
         old="out, lse, *_layout_args(layout), float(scale))", new="out, lse, *_layout_args(layout), 1.0)",
         tests=["python_tests/test_cpp_attention.py"]),
    dict(id="cpp-row-intervals-shifted-one-row", file=f"{WA}/cpp.py",
         old="layout.row_intervals_int32, *layout.cpu_query_tiles,", new="layout.row_intervals_int32.roll(1, 1).contiguous(), *layout.cpu_query_tiles,",
         tests=["python_tests/test_cpp_attention.py"]),
    # --- composite backend: accumulation over chunks
    dict(id="composite-prefix-dk-=", file=f"{WA}/composite/pieces.py",
         old="dk[:, :, klo:khi] += dk_c", new="dk[:, :, klo:khi] = dk_c",
         tests=["python_tests/test_composite_chunks.py"]),
    dict(id="composite-context-dv-=", file=f"{WA}/composite/__init__.py",
         old="dv_ctx[:, :, klo:khi] += dv_c", new="dv_ctx[:, :, klo:khi] = dv_c",
         tests=["python_tests/test_composite_chunks.py"]),
    # --- the math path (reference backend under torch.compile; composite without CPU flash): scale in the
    # backward, accumulation over row chunks. Survived test_backends_vs_paper_masks (eager reference is SDPA).
    dict(id="math-path-backward-dk-unscaled", file=f"{WA}/lse_attention.py",
         old="dk += ((ds.transpose(-1, -2) @ qc) * scale).sum(2)", new="dk += (ds.transpose(-1, -2) @ qc).sum(2)",
         tests=["python_tests/test_math_path.py"]),
    dict(id="math-path-backward-dv-=", file=f"{WA}/lse_attention.py",
         old="dv += (p.transpose(-1, -2) @ doc).sum(2)", new="dv = (p.transpose(-1, -2) @ doc).sum(2)",
         tests=["python_tests/test_math_path.py"]),
    # --- triton kernels, in the interpreter
    dict(id="triton-dkdv-dk-unscaled", file=f"{WA}/triton/jit_backward.py",
         old="tl.store(DK + kv_off, (dk * sm_scale)", new="tl.store(DK + kv_off, (dk)",
         tests=TRITON_CASES, env=TRITON_ENV),
    dict(id="triton-dkdv-dv-=", file=f"{WA}/triton/jit_backward.py",
         old="dv += tl.dot(p.to(do.dtype), do)", new="dv = tl.dot(p.to(do.dtype), do)",
         tests=TRITON_CASES, env=TRITON_ENV),
    # --- checkpoint resume
    dict(id="resume-drops-optimizer-state", file="kforcing_kernels/app/checkpoint.py",
         old='optimizer.load_state_dict({"state": state,', new='optimizer.load_state_dict({"state": {},',
         tests=["python_tests/test_train.py", "-k", "resume"]),
    dict(id="resume-skips-a-step", file="kforcing_kernels/app/trainer.py",
         old='start = (load_sharded_checkpoint if fsdp else load_checkpoint)(ckpt, student, optimizer, scaler)["step"]',
         new='start = (load_sharded_checkpoint if fsdp else load_checkpoint)(ckpt, student, optimizer, scaler)["step"] + 1',
         tests=["python_tests/test_train.py", "-k", "resume"]),
    # --- issue #29 item 15: planted bugs the suite did not catch
    dict(id="composite-staircase-with-blank-slots", file=f"{WA}/composite/pieces.py",
         old="        and not layout.has_blank_slots and not layout.has_sliding_context\n",
         new="        and not layout.has_sliding_context\n",
         tests=["python_tests/test_fuzz.py", "-k", "test_fuzz_quick and not triton"]),
    dict(id="grad-accum-sums", file="kforcing_kernels/app/trainer.py",
         old="scaler.scale(loss / cfg.grad_accum).backward()", new="scaler.scale(loss).backward()",
         tests=["python_tests/test_train_runs.py", "-k", "gradient_accumulation"]),
    dict(id="resume-from-oldest-checkpoint", file="kforcing_kernels/app/checkpoint.py",
         old="return max(found, key=lambda p: (p.stem, p.suffix)) if found else None",
         new="return min(found, key=lambda p: (p.stem, p.suffix)) if found else None",
         tests=["python_tests/test_train_runs.py", "-k", "newest_checkpoint"]),
    # --- issue #29 items 10-14
    dict(id="cpp-backward-tiles-of-batch-0 (C++)", file="csrc/attention.cpp", rebuild=True,
         old="tiles[p.Bp > 1 ? bh / a.H : 0];", new="tiles[0];",
         tests=["python_tests/test_determinism.py", "-k", "per_batch_documents"]),
    dict(id="noise-inversion-may-return-one", file="kforcing_kernels/ops/sampling/reference.py",
         old="    return torch.minimum(z, below_one)", new="    return z",
         tests=["python_tests/test_sampling_contract.py", "-k", "never_returns_one and reference"]),
    dict(id="tokenizer-parses-eos-in-text", file="kforcing_kernels/app/checkpoint.py",
         old="    tok.encode_special_tokens = True", new="    tok.encode_special_tokens = False",
         tests=["python_tests/test_train_packed.py", "-k", "literal_eos"]),
    dict(id="one-row-cu-seqlens-broadcasts", file="kforcing_kernels/layouts/documents.py",
         old="    if per_batch:\n        return torch.stack(rows)", new="    if per_batch and len(rows) > 1:\n        return torch.stack(rows)",
         tests=["python_tests/test_layouts_packed.py", "-k", "one_row"]),
    dict(id="check-scale-math-isfinite", file="kforcing_kernels/ops/validation.py",
         old="    if not (value > 0 and value < math.inf):", new="    if not (math.isfinite(value) and value > 0):",
         tests=["python_tests/test_compile.py", "-k", "default_backend_fullgraph_dynamic"]),
    # --- issue #28: context parallelism
    dict(id="cp-split-balances-rows-not-pairs", file="kforcing_kernels/parallel/balance.py",
         old="        owner = _deal(cost, size, world)", new="        owner = _deal(torch.ones_like(cost), size, world)",
         tests=["python_tests/test_context_parallel.py", "-k", "balances or staircase"]),
    dict(id="cp-dk-not-reduced-over-ranks", file="kforcing_kernels/parallel/context_parallel.py",
         old="        dist.reduce_scatter_tensor(mine, per_rank.view(-1, *per_rank.shape[2:]), op=dist.ReduceOp.SUM, group=group)",
         new="        mine = per_rank[rank]",
         tests=["python_tests/test_context_parallel_torchrun.py", "-k", "gloo"]),
    dict(id="cp-loss-share-not-scaled-for-ddp", file="kforcing_kernels/app/context_parallel.py",
         old="    return share * cp.world, ", new="    return share, ",
         tests=["python_tests/test_context_parallel_torchrun.py", "-k", "trainer_step"]),
]
