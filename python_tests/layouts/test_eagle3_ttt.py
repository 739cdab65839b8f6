"""``WindowLayout.eagle3_ttt``: one step of EAGLE-3's training-time test, only that step's rows.

Oracles written from the semantics, sharing nothing with the layout code: step j's queries are the L
rows of step j over keys ``[base (L) | step 1 (L) | ... | step j (L)]``; row i, when valid, sees base
keys ``[doc_start(i), i]`` (within a sliding window if given) and key ``t * L + i`` of every step
t = 1..j; an invalid row (past its valid length, less ``j * drop_per_step``) sees nothing. A second
oracle is SpecForge's flex mask_mod formula (causal and padding on the base, the diagonal of every
step block) evaluated element-wise, with its per-step drop of one valid row. Attention: every
row-subset backend in fp64 (forward and gradients) against the dense-mask softmax written out here.
"""

import pytest
import torch

from kforcing_kernels.layouts import QueryRowsLayout, WindowLayout
from kforcing_kernels.ops.window_attention import backends_available, window_attention
from kforcing_kernels.ops.window_attention.op import ROW_SUBSET_BACKENDS

CPP = backends_available()["cpp"]


def semantic_mask(length, step, valid=None, drop=0, docs=None, window=None):
    """bool [L, (step + 1) * L] for one sample, loop by loop from the definition."""
    valid = length if valid is None else valid
    live = max(0, valid - step * drop)
    starts = [0] * length
    if docs is not None:
        for a, b in zip(docs[:-1], docs[1:]):
            for i in range(a, b):
                starts[i] = a
    mask = torch.zeros(length, (step + 1) * length, dtype=torch.bool)
    for i in range(live):
        for c in range(length):
            in_doc = starts[i] <= c <= i
            in_window = window is None or c >= i - window + 1
            mask[i, c] = in_doc and in_window
        for t in range(1, step + 1):
            mask[i, t * length + i] = True
    return mask


def specforge_mask(length, step, seq_len):
    """SpecForge's EAGLE-3 flex mask at test step ``step`` (KV = (step + 1) L) with valid length ``seq_len``,
    element-wise over the L query rows: base part causal, both indices below seq_len; step blocks on the
    diagonal (kv - q a multiple of L) at a key position below seq_len."""
    q = torch.arange(length)[:, None]
    kv = torch.arange((step + 1) * length)[None, :]
    base = (q >= kv) & (kv < seq_len) & (q < seq_len)
    suffix = (kv >= length) & (kv % length < seq_len) & ((kv - q) % length == 0)
    return base | suffix


CASES = {
    "shared": dict(length=9, step=3),
    "step1": dict(length=6, step=1),
    "valid_per_batch": dict(length=8, step=2, valid_lengths=[8, 5]),
    "drop_per_step": dict(length=8, step=3, valid_lengths=[8, 6], drop_per_step=1),
    "packed": dict(length=11, step=2, cu_seqlens=[0, 4, 4, 11]),
    "packed_per_batch": dict(length=10, step=2, cu_seqlens=[[0, 10], [0, 3, 10]]),
    "sliding": dict(length=12, step=3, window=4),
    "sliding_packed_valid": dict(length=12, step=4, window=3, cu_seqlens=[0, 7, 12], valid_lengths=[11, 12]),
    "long_step": dict(length=5, step=20),  # window of 20 slots: the kernels' tile-product path (> 16)
}


def _expected(case) -> torch.Tensor:
    length, step = case["length"], case["step"]
    valid = case.get("valid_lengths")
    docs = case.get("cu_seqlens")
    batch = len(valid) if isinstance(valid, list) else (len(docs) if docs and isinstance(docs[0], list) else None)
    masks = [
        semantic_mask(
            length,
            step,
            valid[b] if isinstance(valid, list) else valid,
            case.get("drop_per_step", 0),
            docs[b] if docs and isinstance(docs[0], list) else docs,
            case.get("window"),
        )
        for b in range(batch or 1)
    ]
    return torch.stack(masks) if batch else masks[0]


def _layout(case):
    kwargs = {key: v for key, v in case.items() if key not in ("length", "step")}
    return WindowLayout.eagle3_ttt(case["length"], case["step"], **kwargs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_mask_is_the_semantics(name):
    case = CASES[name]
    layout = _layout(case)
    assert isinstance(layout, QueryRowsLayout)
    assert layout.n_queries == case["length"] and layout.n_keys == (case["step"] + 1) * case["length"]
    want = _expected(case)
    assert torch.equal(layout.dense_mask(), want)
    assert (layout.num_pairs() == want.sum((-1, -2))).all()


@pytest.mark.parametrize("step", [1, 2, 4])
@pytest.mark.parametrize("seq_len", [16, 11])
def test_drop_one_row_per_step_is_specforges_flex_mask(step, seq_len):
    # SpecForge's flex path passes the valid length minus the step (one fewer valid row per step).
    layout = WindowLayout.eagle3_ttt(16, step, valid_lengths=[seq_len], drop_per_step=1)
    assert torch.equal(layout.dense_mask()[0], specforge_mask(16, step, seq_len - step))


def test_padding_as_one_token_documents_sees_only_its_own_position():
    # speculators: a padding position sees only its own keys (base and every step).
    layout = WindowLayout.eagle3_ttt(6, 2, cu_seqlens=[0, 4, 5, 6])
    mask = layout.dense_mask()
    for i in (4, 5):
        assert mask[i].nonzero().flatten().tolist() == [i, 6 + i, 12 + i]


def _dense_attention(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    m = mask[:, None] if mask.dim() == 3 else mask
    s = s.masked_fill(~m, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a row that sees nothing: output 0
    return p @ v


def _backends():
    # triton: test_triton_interpreter_cases.py::test_row_subsets_match_the_fp64_reference[eagle3-*]
    return [
        pytest.param(b, marks=pytest.mark.skipif(b == "cpp" and CPP is not None, reason=f"cpp: {CPP}"))
        for b in ROW_SUBSET_BACKENDS
        if b != "triton"
    ]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("name", sorted(CASES))
def test_attention_matches_the_dense_softmax_in_fp64(backend, name):
    case = CASES[name]
    layout = _layout(case)
    mask = _expected(case)
    b = layout.range_batch or 2
    g = torch.Generator().manual_seed(len(name))
    q = torch.randn(b, 4, layout.n_queries, 16, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(b, 2, layout.n_keys, 16, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(b, 2, layout.n_keys, 16, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(q.shape, dtype=torch.float64, generator=g)
    got = window_attention(q, k, v, layout, backend=backend)
    want = _dense_attention(q, k, v, mask, 16**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    got_grads = torch.autograd.grad((got * weight).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * weight).sum(), (q, k, v))
    for label, x, y in zip(("dq", "dk", "dv"), got_grads, want_grads):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10, msg=label)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(length=0, step=1), "^length: "),
        (dict(length=4, step=0), "^step: "),
        (dict(length=4, step=1, valid_lengths=[5]), "^valid_lengths: "),
        (dict(length=4, step=1, valid_lengths=[0]), "^valid_lengths: "),
        (dict(length=4, step=1, drop_per_step=-1), "^drop_per_step: "),
        (dict(length=4, step=1, window=0), "^window: "),
        (dict(length=4, step=1, cu_seqlens=[0, 3]), "^cu_seqlens: "),
        (dict(length=4, step=1, valid_lengths=[4, 4, 4], cu_seqlens=[[0, 4], [0, 2, 4]]), "^valid_lengths: "),
    ],
)
def test_invalid_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WindowLayout.eagle3_ttt(kwargs.pop("length"), kwargs.pop("step"), **kwargs)
