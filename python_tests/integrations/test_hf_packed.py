"""Packed batches under attn_implementation="kforcing": documents never see each other.

HF users pack with ``DataCollatorWithFlattening``: one row, ``position_ids`` restarting at 0
per document, optionally the flash kwargs ``cu_seq_lens_q/k`` (+ ``max_length_q/k``). The
oracle is the same model and weights under ``sdpa`` (which finds the documents from the
restarting positions) or ``eager`` with the block-diagonal additive mask. "kforcing" used to
attend across documents and ignore the flash kwargs.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kforcing_kernels.integrations.hf as kf_hf  # noqa: E402
from helpers import hf_helpers as H  # noqa: E402
from kforcing_kernels import WindowLayout  # noqa: E402
from kforcing_kernels.layouts.positions import single_positions  # noqa: E402

FAMILIES = {"llama": H.llama, "qwen2": H.qwen2, "mistral": H.mistral, "phi3": H.phi3, "gpt2": H.gpt2}
DOCS = [5, 4, 3]  # three documents in one row of 12 tokens


def packed_batch(flash: bool):
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash)
    gen = torch.Generator().manual_seed(7)
    features = [{"input_ids": torch.randint(1, H.VOCAB, (n,), generator=gen).tolist()} for n in DOCS]
    batch = collator(features)
    batch.pop("labels")
    return batch


@pytest.mark.parametrize("family", FAMILIES)
def test_restarting_position_ids_keep_documents_apart_like_sdpa(family):
    ours, sdpa = H.twin_models(FAMILIES[family](), "kforcing", "sdpa")
    batch = packed_batch(flash=False)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]]
    got = H.logits_and_grads(ours, use_cache=False, **batch)
    want = H.logits_and_grads(sdpa, use_cache=False, **batch)
    H.assert_same_logits_and_grads(got, want)
    # Each document alone gives the same logits: nothing leaked across.
    with torch.no_grad():
        alone = ours(input_ids=batch["input_ids"][:, 5:9], use_cache=False).logits
    torch.testing.assert_close(got[0][:, 5:9], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_flash_kwargs_become_documents(family):
    ours, sdpa, eager = H.twin_models(FAMILIES[family](), "kforcing", "sdpa", "eager")
    batch = packed_batch(flash=True)
    assert batch["cu_seq_lens_q"].tolist() == [0, 5, 9, 12]
    got = H.logits_and_grads(ours, use_cache=False, **batch)
    plain = {k: v for k, v in batch.items() if not k.startswith(("cu_seq", "max_length"))}
    H.assert_same_logits_and_grads(got, H.logits_and_grads(sdpa, use_cache=False, **plain))
    # The flash kwargs alone (positions not restarting) still separate the documents, as flash attention would.
    del batch["position_ids"]
    got = H.logits_and_grads(ours, use_cache=False, **batch)
    mask = kf_hf.additive_mask(WindowLayout.causal(12, cu_seqlens=[0, 5, 9, 12]), batch=1)
    H.assert_same_logits_and_grads(
        got, H.logits_and_grads(eager, input_ids=batch["input_ids"], attention_mask=mask, use_cache=False)
    )


def test_flash_kwargs_that_cannot_be_honoured_are_refused():
    (model,) = H.twin_models(H.llama(), "kforcing")
    batch = packed_batch(flash=True)
    ids = batch["input_ids"]
    with torch.no_grad():
        with pytest.raises(ValueError, match="max_length_q: expected at least the longest document"):
            model(**{**batch, "max_length_q": 3}, use_cache=False)
        with pytest.raises(ValueError, match="cu_seq_lens_k: expected equal to cu_seq_lens_q"):
            model(**{**batch, "cu_seq_lens_k": torch.tensor([0, 6, 9, 12], dtype=torch.int32)}, use_cache=False)
        with pytest.raises(ValueError, match="cu_seq_lens_q: expected non-decreasing offsets from 0 to 12"):
            model(
                **{
                    **batch,
                    "cu_seq_lens_q": torch.tensor([0, 5, 13], dtype=torch.int32),
                    "cu_seq_lens_k": torch.tensor([0, 5, 13], dtype=torch.int32),
                },
                use_cache=False,
            )
        with pytest.raises(ValueError, match="cu_seq_lens_q: packed documents come as one row"):
            model(
                input_ids=ids.expand(2, -1),
                cu_seq_lens_q=batch["cu_seq_lens_q"],
                cu_seq_lens_k=batch["cu_seq_lens_k"],
                use_cache=False,
            )
        cache = model(input_ids=ids[:, :4], use_cache=True).past_key_values
        with pytest.raises(ValueError, match="cu_seq_lens_q: packed flash kwargs need the keys to be exactly"):
            model(
                input_ids=ids[:, 4:],
                past_key_values=cache,
                use_cache=True,
                cu_seq_lens_q=torch.tensor([0, 8], dtype=torch.int32),
                cu_seq_lens_k=torch.tensor([0, 8], dtype=torch.int32),
            )


def test_layout_with_packed_positions_composes_or_is_refused():
    """A K-Forcing layout with restarting context positions: fine if the layout is per document, refused otherwise."""
    ours, eager = H.twin_models(H.llama(), "kforcing", "eager")
    cu, n, k = [0, 4, 7], 7, 2
    emb = kf_hf.NoiseEmbedding(H.HIDDEN)
    ids, noise, tau = torch.randint(0, H.VOCAB, (1, n)), torch.rand(1, n, k), torch.ones(1)
    batch = kf_hf.single_forward_inputs(ours, ids, noise, emb, tau)
    batch["position_ids"] = single_positions(n, k, cu_seqlens=torch.tensor(cu))[None]
    per_document = WindowLayout.kforcing_single(n, k, cu_seqlens=cu)
    got = H.logits_and_grads(ours, **{**batch, "kforcing_layout": per_document})
    plain = {key: v for key, v in batch.items() if key != "kforcing_layout"}
    plain["inputs_embeds"] = kf_hf.single_forward_inputs(eager, ids, noise, emb, tau)["inputs_embeds"]
    want = H.logits_and_grads(eager, attention_mask=kf_hf.additive_mask(per_document, batch=1), **plain)
    H.assert_same_logits_and_grads(got, want)
    with (
        torch.no_grad(),
        pytest.raises(ValueError, match="position_ids pack several documents.*cu_seqlens=\\[0, 4, 7\\]"),
    ):
        ours(**batch)  # the layout of single_forward_inputs spans the whole row


def test_layout_with_flash_kwargs_composes_or_is_refused():
    ours, sdpa = H.twin_models(H.llama(), "kforcing", "sdpa")
    batch = packed_batch(flash=True)
    cu = batch["cu_seq_lens_q"].tolist()
    with torch.no_grad():
        # A per-document causal layout is what the flash kwargs say already: it runs, and equals sdpa's packing.
        got = ours(**batch, kforcing_layout=WindowLayout.causal(12, cu_seqlens=cu), use_cache=False).logits
        plain = {k: v for k, v in batch.items() if not k.startswith(("cu_seq", "max_length"))}
        torch.testing.assert_close(got, sdpa(**plain, use_cache=False).logits, atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="cu_seq_lens_q pack several documents"):
            ours(**batch, kforcing_layout=WindowLayout.causal(12), use_cache=False)
        with pytest.raises(ValueError, match="cu_seq_lens_q: flash kwargs describe rows of plain tokens"):
            layout = WindowLayout.kforcing_single(4, 2)
            ours(
                input_ids=batch["input_ids"],
                cu_seq_lens_q=batch["cu_seq_lens_q"],
                cu_seq_lens_k=batch["cu_seq_lens_k"],
                kforcing_layout=layout,
                use_cache=False,
            )


def test_position_ids_edited_in_place_are_checked_again():
    """Issue 46 (a planted bug the suite let through): the position-id check must read the ids of each call. Ids edited
    in place after an accepted call (the same tensor object, storage and layout) describe other documents: refused."""
    ours = H.twin_models(H.llama(), "kforcing", "eager")[0]
    n, k = 7, 2
    emb = kf_hf.NoiseEmbedding(H.HIDDEN)
    ids, noise, tau = torch.randint(0, H.VOCAB, (1, n)), torch.rand(1, n, k), torch.ones(1)
    batch = kf_hf.single_forward_inputs(ours, ids, noise, emb, tau)
    batch["position_ids"] = single_positions(n, k, cu_seqlens=torch.tensor([0, 4, 7]))[None].clone()
    batch["kforcing_layout"] = WindowLayout.kforcing_single(n, k, cu_seqlens=[0, 4, 7])
    with torch.no_grad():
        ours(**batch)  # the ids match the layout's documents: accepted
        ours(**batch)  # and again
        batch["position_ids"].copy_(single_positions(n, k, cu_seqlens=torch.tensor([0, 3, 7]))[None])
        with pytest.raises(ValueError, match="position_ids pack several documents"):
            ours(**batch)
