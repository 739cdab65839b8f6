"""Context parallelism in one process: the pair-balanced row split, and the one-rank path of the CP attention,
model and loss (the torchrun tests with 2 ranks are in test_context_parallel_torchrun.py).

Oracles: pairs counted from the layout's dense mask; single-process ``window_attention`` / model / ``compute_loss``.
"""

import json

import pytest
import torch

from kforcing_kernels.app.training.config import ConfigError, TrainConfig
from kforcing_kernels.app.training.context_parallel import context_parallel_loss
from kforcing_kernels.app.training.objectives import Objective, compute_loss, make_batch
from kforcing_kernels.app.training.parallel import ParallelDims, setup_parallel
from kforcing_kernels.app.training.validation import validate_config
from kforcing_kernels.layouts import WindowLayout
from kforcing_kernels.model import KForcingLM, ModelConfig
from kforcing_kernels.ops.window_attention import window_attention
from kforcing_kernels.parallel import ContextParallel, balanced_split, context_parallel_attention

BALANCE_CASES = {
    "causal": WindowLayout.causal(512),
    "single": WindowLayout.kforcing_single(128, 4),
    "double": WindowLayout.kforcing_double(128, 4),
    "single_packed": WindowLayout.kforcing_single(128, 4, cu_seqlens=[0, 17, 60, 61, 128]),
    "causal_packed_per_batch": WindowLayout.causal(256, cu_seqlens=[[0, 100, 256], [0, 256]]),
}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("name", sorted(BALANCE_CASES))
def test_split_balances_pairs_and_rows(name, world):
    layout = BALANCE_CASES[name]
    split = balanced_split(layout, world)
    mask = layout.dense_mask()
    mask = mask[None] if mask.dim() == 2 else mask
    seen = torch.cat(list(split.query_rows)).sort().values
    assert torch.equal(seen, torch.arange(layout.n_queries))  # a partition of the rows
    keys = torch.cat(list(split.key_rows)).sort().values
    assert torch.equal(keys, torch.arange(layout.n_keys))  # and of the keys
    pairs = [int(mask[:, rows].sum()) for rows in split.query_rows]  # counted from the dense mask
    assert pairs == list(split.pairs)
    assert max(pairs) <= 1.05 * sum(pairs) / world, pairs
    counts = [rows.numel() for rows in split.query_rows]
    assert max(counts) <= 1.25 * layout.n_queries / world, counts  # memory (rows) stays balanced too
    for rows in split.query_rows:
        assert bool((rows[1:] > rows[:-1]).all())


def test_equal_rows_would_not_balance_the_staircase():
    # Why pairs, not rows: the first and second half of a causal layout differ 3x in work.
    layout = WindowLayout.causal(512)
    half = layout.dense_mask()[:256].sum(), layout.dense_mask()[256:].sum()
    assert half[1] > 2.9 * half[0]
    split = balanced_split(layout, 2)
    assert split.imbalance() < 0.01  # the 2P-block deal is zig-zag: rank r holds blocks r and 2P-1-r
    assert split.query_rows[0].tolist() == list(range(128)) + list(range(384, 512))


def test_split_is_deterministic_and_checks_arguments():
    layout = WindowLayout.kforcing_single(40, 3)
    a, b = balanced_split(layout, 3), balanced_split(layout, 3)
    assert all(torch.equal(x, y) for x, y in zip(a.query_rows, b.query_rows))
    with pytest.raises(ValueError, match="^world: "):
        balanced_split(layout, 0)
    with pytest.raises(ValueError, match="^layout: "):
        balanced_split(layout.restrict_rows([0, 1]), 2)


def test_one_rank_cp_attention_is_window_attention():
    layout = WindowLayout.kforcing_double(9, 3)
    torch.manual_seed(0)
    q = torch.randn(2, 4, layout.n_queries, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, layout.n_keys, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, layout.n_keys, 8, dtype=torch.float64, requires_grad=True)
    out = context_parallel_attention(q, k, v, balanced_split(layout, 1), 0)
    want = window_attention(q, k, v, layout, backend="reference")
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    g = torch.autograd.grad(out.sum(), (q, k, v))
    w = torch.autograd.grad(want.sum(), (q, k, v))
    for a, b in zip(g, w):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_cp_attention_refuses_wrong_shards():
    split = balanced_split(WindowLayout.causal(10), 2)
    q = torch.randn(1, 2, split.query_rows[0].numel(), 4)
    with pytest.raises(ValueError, match="^group: "):  # two ranks, no process group
        context_parallel_attention(q, q, q, split, 0)
    split1 = balanced_split(WindowLayout.causal(10), 1)
    with pytest.raises(ValueError, match=r"^q: expected 10 rows"):
        context_parallel_attention(q, torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4), split1, 0)
    with pytest.raises(ValueError, match="^rank: "):
        ContextParallel(2, 2)


def test_one_rank_model_and_loss_match_the_plain_ones():
    torch.manual_seed(0)
    model = KForcingLM(ModelConfig.micro())
    cp = ContextParallel(0, 1)
    batch = make_batch(
        Objective.AR, torch.randint(0, 64, (400,)), 4, 12, 1, (0.5, 1.0), torch.Generator().manual_seed(1), separator=3
    )
    share, loss, per_pos = context_parallel_loss(Objective.AR, model, batch, None, cp)
    want, want_pos = compute_loss(Objective.AR, model, batch)
    torch.testing.assert_close(loss, want.detach())
    torch.testing.assert_close(share, want)
    torch.testing.assert_close(per_pos, want_pos)
    tokens, noise = batch.tokens[:, :12], torch.rand(4, 12, 3)
    logits, rows = model(tokens, noise, 1.0, context_parallel=cp)
    assert torch.equal(rows, torch.arange(36))
    torch.testing.assert_close(logits, model(tokens, noise, 1.0).flatten(1, 2))


def test_mesh_coordinates_and_a_size_that_does_not_divide_the_world(monkeypatch):
    """Rank r of a dp x cp world is (r // cp, r % cp): CP groups are consecutive ranks, the batch goes by rows."""
    cpu = torch.device("cpu")
    assert [ParallelDims(2, 2, False, r, cpu).dp_rank for r in range(4)] == [0, 0, 1, 1]
    assert [ParallelDims(4, 1, False, r, cpu).dp_rank for r in range(4)] == [0, 1, 2, 3]
    assert ParallelDims(4, 1, False, 3, cpu).context_parallel is None
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="^context_parallel: expected a divisor of the world size 4, got 3"):
        setup_parallel("cpu", 3)
    with pytest.raises(ConfigError, match="^context_parallel: expected a divisor"):
        validate_config(TrainConfig(context_parallel=3), 4)


def test_traffic_accounting_matches_the_dense_mask():
    from kforcing_kernels.parallel.cost import layer_traffic, needed_keys

    layout = WindowLayout.kforcing_single(40, 4, cu_seqlens=[0, 15, 40])
    split = balanced_split(layout, 2)
    mask = layout.dense_mask()
    for rank in range(2):
        want = mask[split.query_rows[rank]].any(0)  # keys some row of the rank sees
        assert torch.equal(needed_keys(split, rank), want)
        owned = torch.zeros(layout.n_keys, dtype=torch.bool)
        owned[split.key_rows[rank]] = True
        per_key = 2 * 1 * 3 * 8 * 4
        t = layer_traffic(split, rank, batch=1, kv_heads=3, head_dim=8, elem_bytes=4)
        assert t.ideal == 2 * int((want & ~owned).sum()) * per_key
        assert t.actual == 3 * split.max_keys * per_key and t.all_gather_once == 2 * split.max_keys * per_key


def test_validate_config_refuses_a_cp_size_that_does_not_divide_the_world():
    with pytest.raises(ConfigError, match="^context_parallel: "):
        validate_config(TrainConfig(context_parallel=2), world=1)
    with pytest.raises(ConfigError, match="^batch_size: "):
        validate_config(TrainConfig(context_parallel=2, batch_size=3), world=4)  # 2 data-parallel groups


def test_bench_measures_the_same_saved_activations_on_both_paths():
    from bench.attention.context_parallel import saved_bytes

    model = KForcingLM(ModelConfig.micro())
    plain, cp = saved_bytes(model, 6, 3, False), saved_bytes(model, 6, 3, True)
    assert plain > 0 and cp == plain
    assert saved_bytes(model, 12, 3, False) > plain  # grows with the rows


# ---------------------------------------------------------------------- issue 40: planted bugs that survived


@pytest.mark.parametrize("world", [1, 2])
def test_the_split_cache_tells_two_packed_batches_of_one_length_apart(world):
    """The second packed batch of the same length gets its own split and mask, not the first batch's (the cache
    is keyed by the layout's content). Oracle: a fresh balanced_split of each layout."""
    first = WindowLayout.causal(64, cu_seqlens=[0, 10, 64])
    second = WindowLayout.causal(64, cu_seqlens=[0, 40, 50, 64])
    cp = ContextParallel(rank=0, world=world)
    for layout in (first, second, first):
        split, fresh = cp.split(layout), balanced_split(layout, world)
        assert torch.equal(split.layout.dense_mask(), layout.dense_mask())
        assert all(torch.equal(a, b) for a, b in zip(split.query_rows, fresh.query_rows))
        assert cp.shard(layout).split is split


def test_the_memory_estimate_counts_every_buffer_of_the_backward():
    """attention_transient_bytes by hand on a small split: gathered K/V, their padded gather buffers, fp32 dK/dV and
    their scatter buffers, dq, one chunk's score-sized tensors. Each part is written out here from what the CP
    backward allocates (gather_keys, scatter_key_grads in parallel/context_parallel.py), so leaving one out fails."""
    from kforcing_kernels.parallel.cost import attention_transient_bytes

    layout = WindowLayout.causal(24, cu_seqlens=[0, 7, 24])
    b, h, hkv, d, elem, chunk_rows = 2, 4, 2, 8, 2, 5
    for world in (2, 3):
        split = balanced_split(layout, world)
        rows = max(int(r.numel()) for r in split.query_rows)
        n = layout.n_keys
        gathered_kv = 2 * b * hkv * n * d * elem  # the whole sequence's K and V after the gather
        gather_buffers = 2 * b * hkv * world * split.max_keys * d * elem  # padded shards received
        dkdv = 2 * (2 * b * hkv * n * d * 4)  # full-length fp32 dK, dV, and their torch.stack copy
        # the padded buffer and its per-rank contiguous copy
        scatter = 2 * (2 * b * hkv * world * split.max_keys * d * 4)
        dq = b * h * rows * d * 4
        scores = 3 * b * h * min(chunk_rows, rows) * n * 4
        expected = gathered_kv + gather_buffers + dkdv + scatter + dq + scores
        got = attention_transient_bytes(
            split, batch=b, heads=h, kv_heads=hkv, head_dim=d, elem_bytes=elem, chunk_rows=chunk_rows
        )
        assert got == expected, (world, got, expected)


def test_cp_throughput_bench_reads_the_steady_rate_and_checks_its_worlds(tmp_path):
    """bench.attention.cp_throughput: the median tokens/s after the first logged step (its compiles), from
    metrics.jsonl; a world size that does not divide the cores is refused by name."""
    from bench.__main__ import run_command
    from bench.attention import cp_throughput

    lines = [
        {"step": 1, "loss": 3.0, "tokens_per_s": 10.0},
        {"step": 2, "val_loss": 2.9},
        *({"step": s, "loss": 2.0, "tokens_per_s": r} for s, r in ((2, 300.0), (3, 100.0), (4, 200.0))),
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in lines) + "\n")
    assert cp_throughput.steady_tokens_per_s(tmp_path) == (200.0, [10.0, 300.0, 100.0, 200.0])
    (tmp_path / "metrics.jsonl").write_text(json.dumps(lines[0]) + "\n")
    with pytest.raises(RuntimeError, match="expected >= 2 logged steps"):
        cp_throughput.steady_tokens_per_s(tmp_path)
    with pytest.raises(SystemExit):
        run_command("cp-throughput", ["--threads", "2", "--worlds", "4"])


@pytest.mark.parametrize("backend", ["reference", "composite", "cpp"])
def test_cp_attention_refuses_what_window_attention_refuses_by_name(backend, monkeypatch):
    """Issue 46: the context-parallel entry points (RankRows.attend, context_parallel_attention) run the op's own
    validation, on every backend: a per-batch layout with another batch, mismatched dtypes, a bad scale, ... are the
    op's words, not a shape error inside a kernel."""
    from kforcing_kernels import backends_available

    if backends_available()[backend]:  # the reason it is unavailable here
        pytest.skip(backends_available()[backend])
    monkeypatch.setenv("KFORCING_BACKEND", backend)
    layout = WindowLayout.kforcing_single(12, 2, cu_seqlens=torch.tensor([[0, 5, 12], [0, 7, 12]]))  # batch 2
    assert layout.batch_size == 2
    rows = ContextParallel(0, 1).shard(layout)
    n_q, n_k = rows.query_rows.numel(), rows.key_rows.numel()

    def qkv(b=2, h=2, hkv=2, d=4, dtype=torch.float32, lk=n_k):
        return torch.randn(b, h, n_q, d, dtype=dtype), torch.randn(b, hkv, lk, d), torch.randn(b, hkv, lk, d)

    cases = [
        (qkv(b=3), r"^layout: expected per-batch ranges for batch 3, got 2"),
        (qkv(b=1), r"^layout: expected per-batch ranges for batch 1, got 2"),
        (qkv(dtype=torch.float64), r"^k, v: expected dtype torch.float64"),
        (qkv(h=3), r"^q: expected a head count that is a multiple of k's 2"),
        ((lambda q, k, v: (q, k, v[..., :3]))(*qkv()), r"^v: expected the shape of k"),
        ((lambda q, k, v: (q[0], k, v))(*qkv()), r"^q: expected rank 4"),
    ]
    for (q, k, v), message in cases:
        for attend in (rows.attend, lambda q, k, v: context_parallel_attention(q, k, v, rows.split, 0)):
            with pytest.raises(ValueError, match=message):
                attend(q, k, v)
            if message.startswith("^layout"):  # the same words as the op on the whole sequence
                with pytest.raises(ValueError, match=message):
                    window_attention(
                        torch.randn(q.shape[0], 2, layout.n_queries, 4),
                        *[torch.randn(q.shape[0], 2, layout.n_keys, 4)] * 2,
                        layout,
                    )
    with pytest.raises(ValueError, match="^scale: "):
        rows.attend(*qkv(), scale=float("nan"))
    out = rows.attend(*qkv())  # the right batch runs
    assert out.shape == (2, 2, n_q, 4)


def test_the_batch_size_check_counts_data_parallel_ranks_not_the_world():
    """Issue 46 (a planted bug the suite let through): the global batch must divide over data-parallel ranks x
    accumulation, dp = world / context_parallel (the ranks of a CP group share their sequences). Valid dp x cp runs
    are accepted and the others refused, against that rule computed here, degenerate meshes (1 x P, P x 1) included."""
    for world, cp in [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (6, 3)]:
        for accum in (1, 2, 3):
            for batch in range(1, 13):
                cfg = TrainConfig(context_parallel=cp, batch_size=batch, grad_accum=accum, device="cpu")
                if batch % ((world // cp) * accum) == 0:
                    validate_config(cfg, world=world)
                else:
                    with pytest.raises(ConfigError, match="^batch_size: expected a multiple of data-parallel ranks"):
                        validate_config(cfg, world=world)


def test_a_pipeline_refuses_a_distillation_batch_its_later_stages_would_refuse_before_stage0(tmp_path, monkeypatch):
    """Issue 46: every stage of a pipeline is checked before the first trains; the distillation batch used to be
    refused only when stage1 started, after stage0 trained."""
    from kforcing_kernels.app.training.config import TrainConfig
    from kforcing_kernels.app.training.pipeline import PipelineConfig, run_pipeline

    monkeypatch.setenv("WORLD_SIZE", "4")
    base = TrainConfig(device="cpu", batch_size=4, context_parallel=2)  # dp = 2
    with pytest.raises(
        ConfigError, match=r"^batch_size_distill: expected a multiple of data-parallel ranks x grad_accum = 2 x 1"
    ):
        run_pipeline(PipelineConfig(out=str(tmp_path / "run"), batch_size_distill=3), base)
    assert not (tmp_path / "run").exists()
