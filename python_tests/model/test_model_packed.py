"""Packed documents through the reference model: a packed row equals each document run alone."""

import torch

from kforcing_kernels.model import KForcingLM, ModelConfig


def _model():
    torch.manual_seed(0)
    return KForcingLM(ModelConfig(vocab_size=50, n_layer=2, n_head=2, n_embd=32, seq_len=64)).eval()


def test_ar_forward_packed_equals_documents_alone():
    model = _model()
    cu = [0, 5, 6, 14]
    tokens = torch.randint(0, 50, (2, 14))
    with torch.no_grad():
        packed = model.ar_forward(tokens, cu_seqlens=cu)
        for a, b in zip(cu[:-1], cu[1:]):
            alone = model.ar_forward(tokens[:, a:b])
            torch.testing.assert_close(packed[:, a:b], alone, atol=2e-5, rtol=2e-5)
        # Without documents the later ones see earlier text: the packed result must differ there.
        assert not torch.allclose(model.ar_forward(tokens)[:, 6:], packed[:, 6:], atol=1e-3)


def test_single_and_double_forward_packed_equal_documents_alone():
    model = _model()
    cu, k = [0, 7, 12], 2
    tokens = torch.randint(0, 50, (1, 12))
    noise = torch.rand(1, 12, k)
    first = torch.randint(0, 50, (1, 12, k))
    noise2 = torch.rand(1, 12, k)
    with torch.no_grad():
        logits, kv = model.single_forward(tokens, noise, 0.8, cu_seqlens=cu)
        second = model.double_forward(kv, first, noise2, 0.8, cu_seqlens=cu)
        for a, b in zip(cu[:-1], cu[1:]):
            alone, kv_alone = model.single_forward(tokens[:, a:b], noise[:, a:b], 0.8)
            torch.testing.assert_close(logits[:, a:b], alone, atol=2e-5, rtol=2e-5)
            second_alone = model.double_forward(kv_alone, first[:, a:b], noise2[:, a:b], 0.8)
            torch.testing.assert_close(second[:, a:b], second_alone, atol=2e-5, rtol=2e-5)


def test_per_batch_documents():
    model = _model()
    cus = [[0, 4, 9], [0, 9]]
    tokens = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        packed = model.ar_forward(tokens, cu_seqlens=cus)
        torch.testing.assert_close(packed[1], model.ar_forward(tokens[1:])[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(packed[0, 4:], model.ar_forward(tokens[:1, 4:])[0], atol=2e-5, rtol=2e-5)


def test_per_batch_cu_seqlens_must_match_the_batch():
    """Issue #29 item 13: a per-batch cu_seqlens of one row broadcast silently over a larger batch."""
    import pytest

    model = _model()
    tokens = torch.randint(0, 50, (2, 14))
    noise = torch.rand(2, 14, 2)
    for cu in (torch.tensor([[0, 5, 14]]), [[0, 5, 14]], [[0, 5, 14]] * 3):
        with pytest.raises(ValueError, match=r"^cu_seqlens: expected one row per batch element \(2 rows\)"):
            model.ar_forward(tokens, cu_seqlens=cu)
        with pytest.raises(ValueError, match=r"^cu_seqlens: expected one row per batch element \(2 rows\)"):
            model.single_forward(tokens, noise, cu_seqlens=cu)
    with torch.no_grad():
        shared = model.ar_forward(tokens, cu_seqlens=[0, 5, 14])
        torch.testing.assert_close(model.ar_forward(tokens, cu_seqlens=[[0, 5, 14]] * 2), shared, rtol=0, atol=0)
        torch.testing.assert_close(model.ar_forward(tokens[:1], cu_seqlens=[[0, 5, 14]]), shared[:1], rtol=0, atol=0)
