"""The curated mutation list for tools/mutate.py (issue 17, item 5).

Each entry is one realistic semantic bug: ``old`` must occur exactly once in ``file``
and is replaced by ``new``; ``tests`` are the pytest arguments (files, ``-k``) that
must catch it; ``env`` extra environment; ``rebuild`` marks C++ sources (the scratch
copy rebuilds the extension). When a bug slips past the suite, add it here together
with the test that catches it.
"""

WA = "kforcing_kernels/ops/window_attention"
TRITON_ENV = {"TRITON_INTERPRET": "1"}
TRITON_CASES = [
    "python_tests/ops/window_attention/triton/test_triton_interpreter_cases.py",
    "-k",
    "test_matches_reference and (ptp-batched or sbd-N17-b2 or double-N17-k2)",
]

MUTATIONS = [
    # --- inference positions (survived the suite before issue 17)
    dict(
        id="prefill-noise-positions+1",
        file="kforcing_kernels/app/generation/serving.py",
        old="lengths[:, None] + torch.arange(k)],",
        new="lengths[:, None] + 1 + torch.arange(k)],",
        tests=[
            "python_tests/app/generation/test_sharp_behaviour.py",
            "python_tests/app/generation/test_paged_generation.py",
        ],
    ),
    # AR and k-token decoding share the static step's positions (app/generation/static_step.py).
    dict(
        id="decode-positions+1",
        file="kforcing_kernels/app/generation/static_step.py",
        old="positions = lens[:, None] + offsets  # [B, W]",
        new="positions = lens[:, None] + 1 + offsets  # [B, W]",
        tests=[
            "python_tests/app/generation/test_sharp_behaviour.py",
            "python_tests/app/generation/test_paged_generation.py",
        ],
    ),
    dict(
        id="model-noise-positions-without+1",
        file="kforcing_kernels/layouts/positions.py",
        old="noise = (t[..., None] + 1 + torch.arange(k, device=device))",
        new="noise = (t[..., None] + torch.arange(k, device=device))",
        tests=["python_tests/app/generation/test_sharp_behaviour.py", "python_tests/model/test_model.py"],
    ),
    dict(
        id="double-forward-future2-positions-1",
        file="kforcing_kernels/layouts/positions.py",
        old="(t + 1 + k + i).flatten(-2)",
        new="(t + k + i).flatten(-2)",
        tests=["python_tests/app/generation/test_sharp_behaviour.py"],
    ),
    # --- loss wiring
    dict(
        id="stage1-loss-tau=1",
        file="kforcing_kernels/app/training/objectives.py",
        old="forward_distillation_targets(teacher_logits, noise[..., 0], tau)",
        new="forward_distillation_targets(teacher_logits, noise[..., 0], torch.ones_like(tau))",
        tests=["python_tests/app/training/test_objectives.py"],
    ),
    dict(
        id="stage2-second-round-reuses-first-noise",
        file="kforcing_kernels/app/training/targets.py",
        old="hidden2 = teacher.double_forward(context_kv, first, z[..., k:], tau,",
        new="hidden2 = teacher.double_forward(context_kv, first, z[..., :k], tau,",
        tests=["python_tests/app/training/test_objectives.py"],
    ),
    dict(
        id="noise-inversion-targets-unshifted",
        file="kforcing_kernels/app/training/targets.py",
        old="targets = tokens[:, 1:][:, reads]",
        new="targets = tokens[:, :-1][:, reads]",
        tests=["python_tests/app/training/test_objectives.py"],
    ),
    # --- evaluation order
    dict(
        id="per-position-nll-reversed",
        file="kforcing_kernels/app/evaluation/evaluate.py",
        old='"nll": (nll / batches).tolist()',
        new='"nll": (nll / batches).flip(0).tolist()',
        tests=["python_tests/app/evaluation/test_per_position_nll.py"],
    ),
    # --- sampler convention
    dict(
        id="reference-sampler->=",
        file="kforcing_kernels/ops/sampling/reference.py",
        old="searchsorted(cdf, target.contiguous(), right=True)",
        new="searchsorted(cdf, target.contiguous(), right=False)",
        tests=["python_tests/ops/sampling/test_sampler_oracle.py"],
    ),
    dict(
        id="cpp-sampler->= (C++)",
        file="csrc/kf_isa_impl.h",
        rebuild=True,
        old="run * st.brel[b] > target) return",
        new="run * st.brel[b] >= target) return",
        tests=["python_tests/ops/sampling/test_sampler_oracle.py"],
    ),
    dict(
        id="cpp-gemm-ignores-accumulate (C++)",
        file="csrc/kf_isa_impl.h",
        rebuild=True,
        old="acc[i][j] = accumulate ? vload(C + i * ldc + j * L) : V{};",
        new="acc[i][j] = V{};",
        tests=["python_tests/ops/window_attention/test_cpp_attention.py"],
    ),
    # --- masks: constructors and the row-interval rule
    dict(
        id="kforcing-staircase-sees-next-token",
        file="kforcing_kernels/layouts/constructors.py",
        old="hi = torch.arange(1, n_ctx + 1)\n    docs",
        new="hi = torch.arange(2, n_ctx + 2).clamp(max=n_ctx)\n    docs",
        tests=[
            "python_tests/layouts/test_layouts.py",
            "python_tests/ops/window_attention/test_backends_vs_paper_masks.py",
        ],
    ),
    dict(
        id="sbd-block-sees-own-first-clean-token",
        file="kforcing_kernels/layouts/constructors.py",
        old="hi = torch.arange(m) * block\n",
        new="hi = (torch.arange(m) * block + 1).clamp(max=n_ctx)\n",
        tests=[
            "python_tests/layouts/test_layouts.py",
            "python_tests/ops/window_attention/test_backends_vs_paper_masks.py",
        ],
    ),
    dict(
        id="interval-own-stream-excludes-self",
        file="kforcing_kernels/layouts/intervals.py",
        old="torch.where(stream == j, within + 1, 0)",
        new="torch.where(stream == j, within, 0)",
        tests=[
            "python_tests/layouts/test_layouts.py",
            "python_tests/ops/window_attention/test_backends_vs_paper_masks.py",
        ],
    ),
    dict(
        id="interval-later-stream-rule->=",
        file="kforcing_kernels/layouts/intervals.py",
        old="torch.where(stream > j, n_j,",
        new="torch.where(stream >= j, n_j,",
        tests=[
            "python_tests/layouts/test_layouts.py",
            "python_tests/ops/window_attention/test_backends_vs_paper_masks.py",
        ],
    ),
    # --- cpp backend (Python side: what is passed to the kernels)
    dict(
        id="cpp-backward-scale-1",
        file=f"{WA}/cpp.py",
        old="out, lse, *_layout_args(layout), float(scale),",
        new="out, lse, *_layout_args(layout), 1.0,",
        tests=["python_tests/ops/window_attention/test_cpp_attention.py"],
    ),
    dict(
        id="cpp-row-intervals-shifted-one-row",
        file=f"{WA}/cpp.py",
        old="        layout.row_intervals_int32,\n        *layout.cpu_query_tiles,",
        new="        layout.row_intervals_int32.roll(1, 1).contiguous(),\n        *layout.cpu_query_tiles,",
        tests=["python_tests/ops/window_attention/test_cpp_attention.py"],
    ),
    # --- composite backend: accumulation over chunks
    dict(
        id="composite-prefix-dk-=",
        file=f"{WA}/composite/pieces.py",
        old="dk[:, :, klo:khi] += dk_c",
        new="dk[:, :, klo:khi] = dk_c",
        tests=["python_tests/ops/window_attention/test_composite_chunks.py"],
    ),
    dict(
        id="composite-context-dv-=",
        file=f"{WA}/composite/__init__.py",
        old="dv_ctx[:, :, klo:khi] += dv_c",
        new="dv_ctx[:, :, klo:khi] = dv_c",
        tests=["python_tests/ops/window_attention/test_composite_chunks.py"],
    ),
    # --- the math path (reference backend under torch.compile; composite without CPU flash): scale in the
    # backward, accumulation over row chunks. Survived test_backends_vs_paper_masks (eager reference is SDPA).
    dict(
        id="math-path-backward-dk-unscaled",
        file=f"{WA}/lse_attention.py",
        old="dk += ((ds.transpose(-1, -2) @ qc) * scale).sum(2)",
        new="dk += (ds.transpose(-1, -2) @ qc).sum(2)",
        tests=["python_tests/ops/window_attention/test_math_path.py"],
    ),
    dict(
        id="math-path-backward-dv-=",
        file=f"{WA}/lse_attention.py",
        old="dv += (p.transpose(-1, -2) @ doc).sum(2)",
        new="dv = (p.transpose(-1, -2) @ doc).sum(2)",
        tests=["python_tests/ops/window_attention/test_math_path.py"],
    ),
    # --- issue 46: the tiled CPU backward (composite's pieces)
    dict(
        id="tiled-backward-causal-tile-drops-its-last-key",
        file=f"{WA}/lse_attention.py",
        old="klo, khi = 0, min(lk, r1) if causal else lk",
        new="klo, khi = 0, min(lk, r1 - 1) if causal else lk",
        tests=["python_tests/ops/window_attention/test_tiled_backward.py", "-k", "textbook"],
    ),
    dict(
        id="tiled-backward-dk-unscaled",
        file=f"{WA}/lse_attention.py",
        old="dk[:, klo:khi] += torch.bmm(ds.transpose(1, 2), qc).mul_(scale)",
        new="dk[:, klo:khi] += torch.bmm(ds.transpose(1, 2), qc)",
        tests=["python_tests/ops/window_attention/test_tiled_backward.py", "-k", "textbook"],
    ),
    # --- triton kernels, in the interpreter
    dict(
        id="triton-dkdv-dk-unscaled",
        file=f"{WA}/triton/jit_backward.py",
        old="tl.store(DK + kv_off, (dk * sm_scale)",
        new="tl.store(DK + kv_off, (dk)",
        tests=TRITON_CASES,
        env=TRITON_ENV,
    ),
    dict(
        id="triton-dkdv-dv-=",
        file=f"{WA}/triton/jit_backward.py",
        old="dv += tl.dot(p.to(do.dtype), do)",
        new="dv = tl.dot(p.to(do.dtype), do)",
        tests=TRITON_CASES,
        env=TRITON_ENV,
    ),
    # --- checkpoint resume
    dict(
        id="resume-drops-optimizer-state",
        file="kforcing_kernels/app/training/checkpoint.py",
        old='optimizer.load_state_dict({"state": state,',
        new='optimizer.load_state_dict({"state": {},',
        tests=["python_tests/app/training/test_train.py", "-k", "resume"],
    ),
    dict(
        id="resume-skips-a-step",
        file="kforcing_kernels/app/training/stage.py",
        old="start = checkpointer.load(ckpt, student, optimizer, scaler)",
        new="start = checkpointer.load(ckpt, student, optimizer, scaler) + 1",
        tests=["python_tests/app/training/test_train.py", "-k", "resume"],
    ),
    # --- issue #29 item 15: planted bugs the suite did not catch
    dict(
        id="composite-staircase-with-blank-slots",
        file=f"{WA}/composite/pieces.py",
        old="        and not layout.has_blank_slots\n        and not layout.has_sliding_context\n",
        new="        and not layout.has_sliding_context\n",
        tests=["python_tests/ops/window_attention/test_fuzz.py", "-k", "test_fuzz_quick and not triton"],
    ),
    dict(
        id="grad-accum-sums",
        file="kforcing_kernels/app/training/loop.py",
        old="scaler.scale(loss / cfg.grad_accum).backward()",
        new="scaler.scale(loss).backward()",
        tests=["python_tests/app/training/test_train_runs.py", "-k", "gradient_accumulation"],
    ),
    dict(
        id="resume-from-oldest-checkpoint",
        file="kforcing_kernels/app/training/checkpoint.py",
        old="return max(found, key=lambda p: (p.stem, p.suffix)) if found else None",
        new="return min(found, key=lambda p: (p.stem, p.suffix)) if found else None",
        tests=["python_tests/app/training/test_train_runs.py", "-k", "newest_checkpoint"],
    ),
    # --- issue #29 items 10-14
    dict(
        id="cpp-backward-tiles-of-batch-0 (C++)",
        file="csrc/attention.cpp",
        rebuild=True,
        old="tiles[p.Bp > 1 ? bh / a.H : 0];",
        new="tiles[0];",
        tests=["python_tests/ops/window_attention/test_determinism.py", "-k", "per_batch_documents"],
    ),
    dict(
        id="noise-inversion-may-return-one",
        file="kforcing_kernels/ops/sampling/reference.py",
        old="    return torch.minimum(z, below_one)",
        new="    return z",
        tests=["python_tests/ops/sampling/test_sampling_contract.py", "-k", "never_returns_one and reference"],
    ),
    dict(
        id="tokenizer-parses-eos-in-text",
        file="kforcing_kernels/app/files.py",
        old="    tok.encode_special_tokens = True",
        new="    tok.encode_special_tokens = False",
        tests=["python_tests/app/training/test_train_packed.py", "-k", "literal_eos"],
    ),
    dict(
        id="one-row-cu-seqlens-broadcasts",
        file="kforcing_kernels/layouts/documents.py",
        old="    if per_batch:\n        return torch.stack(rows)",
        new="    if per_batch and len(rows) > 1:\n        return torch.stack(rows)",
        tests=["python_tests/layouts/test_layouts_packed.py", "-k", "one_row"],
    ),
    dict(
        id="check-scale-math-isfinite",
        file="kforcing_kernels/ops/common/validation.py",
        old="    if not (value > 0 and value < math.inf):",
        new="    if not (math.isfinite(value) and value > 0):",
        tests=["python_tests/ops/window_attention/test_compile.py", "-k", "default_backend_fullgraph_dynamic"],
    ),
    # --- issue #28: context parallelism
    dict(
        id="cp-split-balances-rows-not-pairs",
        file="kforcing_kernels/parallel/balance.py",
        old="        owner = _deal(cost, size, world)",
        new="        owner = _deal(torch.ones_like(cost), size, world)",
        tests=["python_tests/parallel/test_context_parallel.py", "-k", "balances or staircase"],
    ),
    dict(
        id="cp-dk-not-reduced-over-ranks",
        file="kforcing_kernels/parallel/context_parallel.py",
        old="        _reduce_scatter_single(mine, per_rank.view(-1, *per_rank.shape[2:]), group=group)",
        new="        mine = per_rank[rank]",
        tests=["python_tests/app/training/test_context_parallel_torchrun.py", "-k", "gloo"],
    ),
    # --- issue #36: row subsets through the kernels, EAGLE-3 steps
    dict(
        id="subset-tiles-lose-a-row",
        file="kforcing_kernels/layouts/intervals.py",
        old="    keep = in_order >= 0\n",
        new="    keep = in_order > 0\n",
        tests=["python_tests/ops/window_attention/test_query_rows_backends.py", "-k", "area or fp64"],
    ),
    dict(
        id="cpp-chunks-start-at-the-tile-key (C++)",
        file="csrc/kf_isa_impl.h",
        rebuild=True,
        old="for (int64_t chunk = ka - (ka - origin) % step; chunk < kb; chunk += step) {",
        new="for (int64_t chunk = ka + 0 * origin; chunk < kb; chunk += step) {",
        tests=["python_tests/ops/window_attention/test_query_rows_backends.py", "-k", "bits"],
    ),
    dict(
        id="eagle3-drop-once-not-per-step",
        file="kforcing_kernels/layouts/constructors.py",
        old="live_rows = torch.clamp(valid - step * drop, min=0)",
        new="live_rows = torch.clamp(valid - drop, min=0)",
        tests=["python_tests/layouts/test_eagle3_ttt.py"],
    ),
    dict(
        id="cp-loss-share-not-scaled-for-ddp",
        file="kforcing_kernels/app/training/context_parallel.py",
        old="    return share * cp.world, ",
        new="    return share, ",
        tests=["python_tests/app/training/test_context_parallel_torchrun.py", "-k", "trainer_step"],
    ),
    # --- issue 40: planted bugs in what landed last that passed every test
    dict(
        id="triton-plan-first-full-tile-rounded-down",
        file=f"{WA}/triton/plan.py",
        old="    t0 = torch.where(has_full, -(-(flo - klo) // bn), 0)",
        new='    t0 = torch.where(has_full, torch.div(flo - klo, bn, rounding_mode="floor"), 0)',
        tests=["python_tests/ops/window_attention/triton/test_triton_plan.py", "-k", "full_tiles_are_full and sliding"],
    ),
    dict(
        id="triton-plan-first-full-tile-rounded-down (interpreter)",
        file=f"{WA}/triton/plan.py",
        old="    t0 = torch.where(has_full, -(-(flo - klo) // bn), 0)",
        new='    t0 = torch.where(has_full, torch.div(flo - klo, bn, rounding_mode="floor"), 0)',
        tests=[
            "python_tests/ops/window_attention/triton/test_triton_interpreter_cases.py",
            "-k",
            "test_matches_reference and sliding",
        ],
        env=TRITON_ENV,
    ),
    dict(
        id="cp-split-cached-by-layout-size",
        file="kforcing_kernels/parallel/context_parallel.py",
        old="        key = layout.cache_key\n        if key not in self._splits:",
        new="        key = (layout.n_queries, layout.n_keys)\n        if key not in self._splits:",
        tests=["python_tests/parallel/test_context_parallel.py", "-k", "split_cache"],
    ),
    dict(
        id="weight-decay-groups-swapped",
        file="kforcing_kernels/app/training/stage.py",
        old='groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]',
        new='groups = [{"params": no_decay, "weight_decay": cfg.weight_decay}, {"params": decay, "weight_decay": 0.0}]',
        tests=["python_tests/app/training/test_train_runs.py", "-k", "weight_decay_falls"],
    ),
    dict(
        id="hf-corpus-cache-without-tokenizer",
        file="kforcing_kernels/app/hf_recipe/files.py",
        old='json.dumps([FORMAT_VERSION, "hf", tokenizer_sha256(backend), eos, val_fraction])',
        new='json.dumps([FORMAT_VERSION, "hf", eos, val_fraction])',
        tests=["python_tests/app/hf_recipe/test_hf_recipe.py", "-k", "corpus_cache"],
    ),
    # The sliding window in position space (layouts/sliding.py): one key too many or too few at exactly W back.
    dict(
        id="sliding-window-context-off-by-one",
        file="kforcing_kernels/layouts/sliding.py",
        old="context_lo = torch.maximum(lo, rows - window + 1)",
        new="context_lo = torch.maximum(lo, rows - window)",
        tests=["python_tests/layouts/test_sliding_layouts.py", "-k", "boundary"],
    ),
    dict(
        id="sliding-window-slot-off-by-one",
        file="kforcing_kernels/layouts/sliding.py",
        old="prefix_hi - window + 1  # slot o",
        new="prefix_hi - window + 2  # slot o",
        tests=["python_tests/layouts/test_sliding_layouts.py", "-k", "boundary"],
    ),
    dict(
        id="atomic-write-renames-without-fsync",
        file="kforcing_kernels/app/files.py",
        old="            f.flush()\n            os.fsync(f.fileno())\n",
        new="            f.flush()\n",
        tests=["python_tests/app/training/test_train_runs.py", "-k", "fsync_the_temporary"],
    ),
    dict(
        id="cp-memory-estimate-without-scatter-buffers",
        file="kforcing_kernels/parallel/cost.py",
        old="grads = 2 * full_kv * 4 + 2 * padded * 4 + ",
        new="grads = 2 * full_kv * 4 + ",
        tests=["python_tests/parallel/test_context_parallel.py", "-k", "memory_estimate"],
    ),
    dict(
        id="restrict-rows-accepts-n_queries",
        file="kforcing_kernels/layouts/query_rows.py",
        old="int(r.max()) >= n):",
        new="int(r.max()) > n):",
        tests=["python_tests/layouts/test_layouts_query_rows.py", "-k", "n_queries_is_refused"],
    ),
    # --- issue 46: planted bugs that passed the whole suite
    dict(
        id="dispatch-bucket-boundary-one-step-off",
        file=f"{WA}/dispatch.py",
        old="    return low < n_ctx <= bucket",
        new="    return low <= n_ctx <= bucket",
        tests=["python_tests/ops/window_attention/test_flex_backend.py", "-k", "boundary"],
    ),
    dict(
        id="dispatch-row-cache-forgets-dtype",
        file=f"{WA}/dispatch.py",
        old='    key = ("rows", path, device_index, dtype)',
        new='    key = ("rows", path, device_index)',
        tests=["python_tests/ops/window_attention/test_flex_backend.py", "-k", "several_dtypes"],
    ),
    dict(
        id="bench-stage1-row-reused-across-taus",
        file="bench/training/stage1_curve.py",
        old='        "taus": [float(t) for t in args.taus],\n        "batches": args.batches,',
        new='        "batches": args.batches,',
        tests=["python_tests/bench/test_bench_stage1.py", "-k", "reused_row_matches"],
    ),
    dict(
        id="bench-stage1-checkpoint-only-stage-counts-as-finished",
        file="bench/training/stage1_curve.py",
        old="            if not _finished(\n                stage1,",
        new='            if not (stage1 / "checkpoints").is_dir() and not _finished(\n                stage1,',
        tests=["python_tests/bench/test_bench_stage1.py", "-k", "interrupted_or_outdated"],
    ),
    dict(
        id="cp-attention-skips-the-layout-batch-check",
        file="kforcing_kernels/parallel/context_parallel.py",
        old="    check_layout_batch(split.layout, q.shape[0])\n",
        new="",
        tests=["python_tests/parallel/test_context_parallel.py", "-k", "cp_attention_refuses_what"],
    ),
    dict(
        id="pipeline-evaluates-after-releasing-its-lock",
        file="kforcing_kernels/app/training/pipeline.py",
        old="            return then(summaries)",
        new="            lock.release()\n            return then(summaries)",
        tests=["python_tests/app/training/test_pipeline.py", "-k", "under_its_lock"],
    ),
    dict(
        id="hf-position-check-memoised-without-the-tensor-version",
        file="kforcing_kernels/integrations/hf.py",
        old=(
            '                docs = documents_from_positions(kwargs["position_ids"][:, :n_ctx], batch, n_ctx)\n'
            '                check_layout_documents(kforcing_layout, docs, "position_ids")\n'
        ),
        new=(
            '                memo = globals().setdefault("_CHECKED_POSITIONS", set())\n'
            '                key = (kwargs["position_ids"].data_ptr(), kforcing_layout.cache_key)\n'
            "                if key not in memo:\n"
            '                    docs = documents_from_positions(kwargs["position_ids"][:, :n_ctx], batch, n_ctx)\n'
            '                    check_layout_documents(kforcing_layout, docs, "position_ids")\n'
            "                    memo.add(key)\n"
        ),
        tests=["python_tests/integrations/test_hf_packed.py", "-k", "in_place"],
    ),
    dict(
        id="paged-cancel-marks-a-finished-request-cancelled",
        file="kforcing_kernels/app/generation/serving.py",
        old="        elif request.done:\n            return\n",
        new="",
        tests=["python_tests/app/generation/test_paged_generation.py", "-k", "cancel_after_the_end"],
    ),
    dict(
        id="fsdp-1x2-mesh-shards-over-dp",
        file="kforcing_kernels/app/training/parallel.py",
        old='        if self.dp == 1:\n            return self.mesh["cp"]',
        new='        if self.dp == 1:\n            return self.mesh["dp"]',
        tests=["python_tests/app/training/test_train_fsdp.py", "-k", "two_ranks_match and dp1xcp2"],
    ),
    dict(
        id="batch-size-checked-against-the-world",
        file="kforcing_kernels/app/training/validation.py",
        old="    if batch % (dp * grad_accum):",
        new="    if batch % (world * grad_accum):",
        tests=["python_tests/parallel/test_context_parallel.py", "-k", "counts_data_parallel"],
    ),
    # --- issue 56: gradient work and copies without a recorded backward; compact saved views
    dict(
        id="linear-ce-gradients-under-no-grad",
        file="kforcing_kernels/app/training/linear_ce.py",
        old="needs = [grad_mode and need for need in ctx.needs_input_grad[:3]]",
        new="needs = list(ctx.needs_input_grad[:3])",
        tests=["python_tests/app/training/test_chunked_loss.py", "-k", "no_gradient_work"],
    ),
    dict(
        id="own-storage-keeps-a-contiguous-view",
        file="kforcing_kernels/ops/common/saved.py",
        old="        return t.clone(memory_format=torch.contiguous_format)",
        new="        return t.contiguous()",
        tests=["python_tests/ops/common/test_saved.py"],
    ),
    dict(
        id="eager-op-copies-views-under-no-grad",
        file=f"{WA}/op.py",
        old="    if autograd_records(q, k, v):\n        return _EagerWindowAttention.apply",
        new="    if True:\n        return _EagerWindowAttention.apply",
        tests=["python_tests/ops/common/test_saved.py", "-k", "no_copy"],
    ),
    dict(
        id="sliding-position-memo-ignores-in-place-edits",
        file="kforcing_kernels/integrations/hf_masks.py",
        old="key = (layout, position_ids, None if position_ids is None else position_ids._version)",
        new="key = (layout, position_ids, None)",
        tests=["python_tests/integrations/test_hf_masks.py"],
    ),
    # The static step's per-row temperatures (issue 56 item 6c): every row given row 0's.
    dict(
        id="static-step-ar-row0-temperature",
        file="kforcing_kernels/app/generation/static_step.py",
        old="tau = torch.where(hot, taus, torch.ones_like(taus)).to(dev)",
        new="tau = torch.where(hot, taus[:1], torch.ones_like(taus)).to(dev)",
        tests=["python_tests/app/generation/test_static_step.py", "-k", "page_boundaries"],
    ),
    dict(
        id="static-step-kforcing-row0-tau",
        file="kforcing_kernels/app/generation/static_step.py",
        old="tau = taus.to(device=dev, dtype=torch.float32)",
        new="tau = taus.flatten()[0].expand(taus.shape).to(device=dev, dtype=torch.float32)",
        tests=["python_tests/app/generation/test_static_step.py", "-k", "run_alone"],
    ),
    # One autocast rule for every backend (issue 56 item 3): without the entry's cast, composite and cpp stay fp32.
    dict(
        id="window-attention-ignores-autocast",
        file=f"{WA}/op.py",
        old="    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)",
        new="    return False",
        tests=["python_tests/ops/window_attention/test_autocast.py"],
    ),
    # The private torch APIs behind ops/common/torch_compat.py (issue 55 item 2): the eager fast path blind to
    # functorch transforms, and a missing API read as "no mode" instead of the conservative "a mode may be active".
    dict(
        id="eager-path-ignores-functorch-transforms",
        file="kforcing_kernels/ops/common/torch_compat.py",
        old="    return torch_function_mode_active() or dispatch_mode_active() or functorch_transform_active()",
        new="    return torch_function_mode_active() or dispatch_mode_active()",
        tests=["python_tests/ops/common/test_torch_compat.py"],
    ),
    dict(
        id="missing-dispatch-api-means-no-mode",
        file="kforcing_kernels/ops/common/torch_compat.py",
        old="    if _dispatch_stack_len is None:\n        return True",
        new="    if _dispatch_stack_len is None:\n        return False",
        tests=["python_tests/ops/common/test_torch_compat.py"],
    ),
]
