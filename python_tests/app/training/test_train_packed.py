"""Training on packed documents (--packed-docs): every objective's loss equals the documents computed
one at a time, runs resume bit for bit, and a window holding one document is the unpacked path."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kforcing_kernels.app.data import load_corpus
from kforcing_kernels.app.files import write_json
from kforcing_kernels.app.train import main
from kforcing_kernels.app.training.checkpoint import latest_checkpoint, read_json, read_metrics
from kforcing_kernels.app.training.loop import train
from kforcing_kernels.app.training.objectives import (
    Batch,
    Objective,
    compute_loss,
    forward_distillation_targets,
    make_batch,
    self_forcing_targets,
    step_generator,
)
from kforcing_kernels.layouts.positions import document_offsets
from kforcing_kernels.model import KForcingLM, ModelConfig
from kforcing_kernels.ops.sampling import noise_inversion

EOS, V = 0, 40


def _model(seed: int) -> KForcingLM:
    model = KForcingLM(ModelConfig.micro(vocab_size=V, seq_len=64))
    model.reset_parameters(torch.Generator().manual_seed(seed))
    return model.eval()


def _stream(lengths, seed: int = 0) -> torch.Tensor:
    """Documents of the given lengths (text tokens 1..V-1), each followed by EOS, as the corpus joins them."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for n in lengths:
        parts += [torch.randint(1, V, (n,), generator=g), torch.tensor([EOS])]
    return torch.cat(parts)


def _pieces(row: torch.Tensor):
    """The oracle's documents of one window, by a plain scan: [(start, end, closed)], closed when it ends with EOS."""
    out, start = [], 0
    for i, tok in enumerate(row.tolist()):
        if tok == EOS:
            out.append((start, i + 1, True))
            start = i + 1
    if start < len(row):
        out.append((start, len(row), False))
    return out


def _kept(a: int, b: int, closed: bool, t: int, j: int) -> bool:
    """Slot j of window t (document [a, b)) targets position t + 1 + j: past a closed document's end it leaves the
    loss."""
    return not closed or t + 1 + j < b


def _oracle(objective, student, teacher, batch: Batch, k: int) -> torch.Tensor:
    """Mean cross-entropy with every document run through the models alone (no cu_seqlens anywhere)."""
    losses = []
    for r in range(batch.tokens.shape[0]):
        tokens = batch.tokens[r : r + 1]
        tau = None if batch.tau is None else batch.tau[r : r + 1]
        if objective is Objective.AR:
            x, y = tokens[:, :-1], tokens[:, 1:]
            for a, b, closed in _pieces(x[0]):
                ce = F.cross_entropy(student(x[:, a:b])[0], y[0, a:b], reduction="none")
                losses += [ce[t - a] for t in range(a, b) if _kept(a, b, closed, t, 0)]
            continue
        if objective is Objective.NOISE_INVERSION:
            raise AssertionError("noise inversion: use _oracle_ni_row (its uniforms come from the batch seed)")
        noise = batch.noise[r : r + 1]
        for a, b, closed in _pieces(tokens[0]):
            if objective is Objective.FORWARD:
                tgt = forward_distillation_targets(teacher(tokens[:, a:b]), noise[:, a:b, 0], tau)[..., None]
            else:
                tgt = self_forcing_targets(teacher, tokens[:, a:b], noise[:, a:b], tau)
            logits = student(tokens[:, a:b], noise[:, a:b], tau)
            ce = F.cross_entropy(logits.flatten(0, 2), tgt.flatten(), reduction="none").view(tgt.shape)[0]
            losses += [ce[t - a, j] for t in range(a, b) for j in range(k) if _kept(a, b, closed, t, j)]
    return torch.stack(losses).mean()


CASES = [(Objective.AR, 1), (Objective.FORWARD, 1), (Objective.NOISE_INVERSION, 3), (Objective.SELF_FORCING, 4)]


def _batch(objective, k, stream, separator, seed=3, size=3, seq_len=20):
    batch = make_batch(objective, stream, size, seq_len, k, (0.6, 1.0), torch.Generator().manual_seed(seed), separator)
    if objective is Objective.NOISE_INVERSION:
        # One row per batch (its seed as Batch.shard derives it), so the oracle can redraw its uniforms.
        return [batch.shard(r, size) for r in range(size)]
    return [batch]


@pytest.mark.parametrize("objective,k", CASES)
def test_packed_loss_equals_documents_computed_alone(objective, k):
    stream = _stream([3, 7, 1, 12, 2, 5, 9, 4, 15, 6, 2, 8, 3, 11] * 3)
    student, teacher = _model(1), (None if objective is Objective.AR else _model(2))
    for batch in _batch(objective, k, stream, EOS):
        assert (batch.tokens == EOS).any(), "the windows must cross documents for this test to mean anything"
        with torch.no_grad():
            loss, per_pos = compute_loss(objective, student, batch, teacher, k=k)
            unpacked, _ = compute_loss(objective, student, dataclasses.replace(batch, separator=None), teacher, k=k)
            if objective is Objective.NOISE_INVERSION:
                expected = _oracle_ni_row(student, teacher, batch, k)
            else:
                expected = _oracle(objective, student, teacher, batch, k)
        torch.testing.assert_close(loss, expected, atol=2e-5, rtol=2e-5)
        assert per_pos.shape == (k,)
        assert abs(float(loss) - float(unpacked)) > 1e-4  # documents change the result: the test can tell them apart


def _oracle_ni_row(student, teacher, batch: Batch, k: int) -> torch.Tensor:
    """Noise inversion on a one-row batch: its in-bin uniforms come from batch.seed (compute_loss's generator)."""
    tokens, tau = batch.tokens, batch.tau
    n = tokens.shape[1] - k
    teacher_logits = torch.cat([teacher(tokens[:, a:b]) for a, b, _ in _pieces(tokens[0, :-1])], 1)
    reads = torch.arange(n)[:, None] + torch.arange(k)
    targets = tokens[:, 1:][:, reads]
    noise = noise_inversion(
        teacher_logits[:, reads],
        targets,
        tau[:, None, None].expand(targets.shape),
        torch.Generator().manual_seed(batch.seed),
    )
    losses = []
    for a, b, _ in _pieces(tokens[0, :n]):
        ce = F.cross_entropy(
            student(tokens[:, a:b], noise[:, a:b], tau).flatten(0, 2), targets[:, a:b].flatten(), reduction="none"
        ).view(b - a, k)
        doc = next(p for p in _pieces(tokens[0]) if p[0] <= a < p[1])
        losses += [ce[t - a, j] for t in range(a, b) for j in range(k) if _kept(*doc, t, j)]
    return torch.stack(losses).mean()


@pytest.mark.parametrize("objective,k", CASES)
def test_one_document_per_window_is_the_unpacked_path(objective, k):
    stream = _stream([400])[:-1]  # one document, no separator inside any window
    student, teacher = _model(1), (None if objective is Objective.AR else _model(2))
    for batch in _batch(objective, k, stream, EOS):
        assert all(
            torch.equal(cu, torch.tensor([0, batch.tokens.shape[1]])) for cu in document_offsets(batch.tokens, EOS)
        )
        with torch.no_grad():
            packed, packed_pos = compute_loss(objective, student, batch, teacher, k=k)
            plain, plain_pos = compute_loss(
                objective, student, dataclasses.replace(batch, separator=None), teacher, k=k
            )
        torch.testing.assert_close(packed, plain, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(packed_pos, plain_pos, atol=1e-6, rtol=1e-6)


def test_document_offsets_and_batches():
    windows = torch.tensor([[5, EOS, 6, 7, EOS, 8], [EOS, 1, 2, 3, 4, EOS], [1, 2, 3, 4, 5, 6]])
    cus = document_offsets(windows, EOS)
    assert [cu.tolist() for cu in cus] == [[0, 2, 5, 6], [0, 1, 6], [0, 6]]
    with pytest.raises(ValueError, match="tokens: expected token ids"):
        document_offsets(windows[0], EOS)
    with pytest.raises(ValueError, match="separator: expected None or a token id"):
        make_batch(Objective.AR, _stream([50]), 2, 8, 1, (1.0, 1.0), torch.Generator(), separator=True)
    # The same draws with and without packing; shards and device moves keep the separator.
    a = make_batch(
        Objective.SELF_FORCING, _stream([50, 50]), 4, 8, 2, (0.5, 1.0), torch.Generator().manual_seed(0), EOS
    )
    b = make_batch(Objective.SELF_FORCING, _stream([50, 50]), 4, 8, 2, (0.5, 1.0), torch.Generator().manual_seed(0))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.noise, b.noise) and b.separator is None
    assert a.shard(1, 2).to("cpu").separator == EOS


# ---------------------------------------------------------------------- the trainer


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """Many short documents (a line of the json package each), so 16-token windows cross documents."""
    from helpers.train_helpers import write_json_package

    return write_json_package(tmp_path_factory.mktemp("docs"), one_document_per_line=True)


@pytest.fixture(scope="module", autouse=True)
def _cache(isolated_cache):
    yield


def micro(out, corpus_dir, **kw):
    from helpers.train_helpers import micro_config

    return micro_config(out, corpus_dir, **{"packed_docs": True, "seed": 1, **kw})


def _losses(folder):
    return [(m["step"], m["loss"]) for m in read_metrics(folder / "metrics.jsonl") if "loss" in m]


def test_packed_run_resumes_bit_for_bit_and_differs_from_unpacked(tmp_path, corpus_dir):
    corpus = load_corpus(str(corpus_dir), vocab_size=300)
    first = make_batch(Objective.AR, corpus.train, 4, 16, 0, (1.0, 1.0), step_generator(1, 0), corpus.eos_id)
    assert (first.tokens[:, :-1] == corpus.eos_id).any()  # the first step's windows cross documents
    main(
        [
            "stage0",
            "--out",
            str(tmp_path / "whole"),
            "--data",
            str(corpus_dir),
            "--vocab-size",
            "300",
            "--preset",
            "micro",
            "--seq-len",
            "16",
            "--steps",
            "6",
            "--batch-size",
            "4",
            "--warmup-steps",
            "2",
            "--log-every",
            "1",
            "--eval-batches",
            "1",
            "--lr",
            "3e-3",
            "--seed",
            "1",
            "--no-progress",
            "--packed-docs",
        ]
    )
    assert read_json(tmp_path / "whole" / "train_config.json")["packed_docs"] is True
    parts = micro(tmp_path / "parts", corpus_dir, stop_at=3)
    train(parts)
    train(dataclasses.replace(parts, stop_at=None, resume=True))
    assert _losses(tmp_path / "whole") == _losses(tmp_path / "parts") and len(_losses(tmp_path / "whole")) == 6
    a = load_file(str(tmp_path / "whole" / "model.safetensors"))
    b = load_file(str(tmp_path / "parts" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    train(micro(tmp_path / "plain", corpus_dir, packed_docs=False))
    assert _losses(tmp_path / "plain")[0] != _losses(tmp_path / "whole")[0]

    # The distillation stages run packed too (stage2's teacher forwards get the same documents).
    train(micro(tmp_path / "s1", corpus_dir, stage="stage1", teacher=str(tmp_path / "whole"), steps=2))
    summary = train(micro(tmp_path / "s2", corpus_dir, stage="stage2", teacher=str(tmp_path / "s1"), steps=2))
    assert torch.isfinite(torch.tensor(summary["val_loss"]))


def test_resume_refuses_a_different_packed_docs(tmp_path, corpus_dir):
    cfg = micro(tmp_path / "run", corpus_dir, steps=4, stop_at=2)
    train(cfg)
    with pytest.raises(ValueError, match=r"packed_docs: --resume needs.*used True, got False \(--packed-docs\)"):
        train(dataclasses.replace(cfg, stop_at=None, resume=True, packed_docs=False))
    # A run saved before the option existed trained unpacked: it resumes without the flag, and refuses it.
    old = micro(tmp_path / "old", corpus_dir, steps=4, stop_at=2, packed_docs=False)
    train(old)
    ckpt = latest_checkpoint(tmp_path / "old")
    meta = json.loads(ckpt.read_text())
    del meta["train_config"]["packed_docs"]
    write_json(ckpt, meta)
    with pytest.raises(ValueError, match=r"packed_docs:.*used False, got True \(--packed-docs\)"):
        train(dataclasses.replace(old, stop_at=None, resume=True, packed_docs=True))
    train(dataclasses.replace(old, stop_at=None, resume=True))
    assert [s for s, _ in _losses(tmp_path / "old")] == [1, 2, 3, 4]


def test_literal_eos_text_is_ordinary_tokens(tmp_path):
    """Issue #29 item 12: text holding the characters of the EOS marker encoded as the real EOS id (false
    document boundaries for --packed-docs, prompts cut short). Only the separator the corpus puts between
    documents is EOS; the marker's characters in text are ordinary tokens, in the streams, in
    Corpus.encode, and in the tokenizer a run folder or the cache gives back."""
    from helpers.train_helpers import write_json_package
    from kforcing_kernels.app import data
    from kforcing_kernels.app.files import load_tokenizer
    from kforcing_kernels.app.training.checkpoint import load_model, save_model

    folder = write_json_package(tmp_path / "docs")
    marker = data.EOS
    n_docs = len(list(folder.iterdir())) + 2
    (folder / "zz_a.txt").write_text(f"print('{marker}')\nx = 1 {marker} 2\n")
    (folder / "zz_b.txt").write_text(f"{marker}{marker} leading markers\n")
    for attempt in range(2):  # built, then read back from the cache
        corpus = load_corpus(str(folder), vocab_size=300)
        eos = corpus.eos_id
        assert int((corpus.train == eos).sum()) + int((corpus.val == eos).sum()) == n_docs, attempt
        ids = corpus.encode(f"a {marker} b")
        assert eos not in ids and corpus.decode(ids) == f"a {marker} b"
    save_model(tmp_path / "run", KForcingLM(ModelConfig(vocab_size=300, n_layer=1, n_head=2, n_embd=16)), {"k": 0})
    corpus.tokenizer.save(str(tmp_path / "run" / "tokenizer.json"))
    _, _, tok = load_model(tmp_path / "run")
    assert eos not in tok.encode(f"prompt {marker}").ids
    assert eos not in load_tokenizer(tmp_path / "run" / "tokenizer.json").encode(marker).ids
