"""integrations/hf_masks.py under a sliding window (issue 56 item 6a): the position check lives on this path.

A model with a sliding window reads a kforcing_layout in position space, so hf_masks checks ``position_ids``
against the layout, once per forward (a memo keyed by the layout, the tensor and its version). Ids edited in
place after an accepted call must be checked again: the test added for issue 46 used a model without a sliding
window, so it exercised the documents check of hf.py, never this memo.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kforcing_kernels.integrations.hf as kf_hf  # noqa: E402
from helpers import hf_helpers as H  # noqa: E402
from kforcing_kernels import WindowLayout  # noqa: E402
from kforcing_kernels.layouts.positions import single_positions  # noqa: E402


def test_sliding_window_position_ids_edited_in_place_are_checked_again():
    ours = H.twin_models(H.mistral(sliding_window=3), "kforcing", "sdpa")[0]
    n, k = 7, 2
    emb = kf_hf.NoiseEmbedding(H.HIDDEN)
    ids, noise, tau = torch.randint(0, H.VOCAB, (1, n)), torch.rand(1, n, k), torch.ones(1)
    batch = kf_hf.single_forward_inputs(ours, ids, noise, emb, tau)
    batch["position_ids"] = single_positions(n, k)[None].clone()
    batch["kforcing_layout"] = WindowLayout.kforcing_single(n, k)
    with torch.no_grad():
        first = ours(**batch, use_cache=False).logits  # positions as the recipe gives them: accepted
        torch.testing.assert_close(ours(**batch, use_cache=False).logits, first, atol=0, rtol=0)  # the memo's hit
        # The windows' positions one further on: the context (the documents check of hf.py) is unchanged, so only
        # the sliding window's position check can refuse them, and it must see the edit.
        batch["position_ids"][:, n:] += 1
        with pytest.raises(ValueError, match="position_ids: with the model's sliding window"):
            ours(**batch, use_cache=False)
        # The same tensor set back: accepted again, the same logits.
        batch["position_ids"][:, n:] -= 1
        torch.testing.assert_close(ours(**batch, use_cache=False).logits, first, atol=0, rtol=0)
