"""composite_cuda's routing of the composite pieces, on CPU with stand-ins for the CUDA ops.

Each stand-in follows its op's calling convention (flash-attn's packed varlen layout and
[H, total] LSE; the aten flash op with same-head K/V and opaque bookkeeping outputs; the
memory-efficient op with an additive bias and its LSE padded to 32 rows) and computes in
float64, independently of the code under test. The composite backend is then checked
end to end against the float64 reference, that the stand-in really ran, and that a
refusing or missing kernel degrades to the next one with its reason recorded.
"""

import math
import types

import pytest
import torch

from helpers.attention import assert_within_2x_torch_error, compare_with_reference
from kforcing_kernels import WindowLayout
from kforcing_kernels.ops.window_attention.composite import cuda as composite_cuda

LAYOUTS = {
    "single": WindowLayout.kforcing_single(40, 4),  # staircase: slot-major causal + small intra
    "double": WindowLayout.kforcing_double(33, 3),  # two streams
    "sbd": WindowLayout.sbd(70, 7),  # masked prefix chunks (bias path)
    "fold": WindowLayout.kforcing_single(64, 32),  # large windows: causal calls per window
    "sbd_fold": WindowLayout.sbd(100, 32),  # full intra + short last window: masked fold
}


def _math(q, k, v, causal, bias, scale):
    """float64 attention: q [B, H, Lq, D], k/v [B, H, Lk, D], bias [B, H, Lq, Lk] or None -> (out, lse)."""
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    if bias is not None:
        s = s + bias.double()
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ v.double(), lse


def _math_grads(dout, q, k, v, out, lse, causal, bias, scale):
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    if bias is not None:
        s = s + bias.double()
    p = torch.exp(s - lse.double()[..., None]).nan_to_num(0.0)
    do = dout.double()
    delta = (do * out.double()).sum(-1, keepdim=True)
    ds = p * (do @ v.double().transpose(-1, -2) - delta) * scale
    return ds @ k.double(), ds.transpose(-1, -2) @ q.double(), p.transpose(-1, -2) @ do


class StandIns:
    def __init__(self):
        self.calls = {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    # flash-attn varlen: packed [total, H, D], cu_seqlens, LSE [H, total]; GQA native.
    def flash_attn(self):
        def seqs(x, cu):
            return [x[cu[i] : cu[i + 1]].transpose(0, 1)[None] for i in range(len(cu) - 1)]  # [1, H, L, D]

        def expand(x, h):
            return x.repeat_interleave(h // x.shape[1], dim=1)

        def fwd(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            dropout_p,
            softmax_scale,
            causal,
            *,
            window_size_left,
            window_size_right,
            softcap,
            alibi_slopes,
            return_softmax,
        ):
            self._count("flash_attn_fwd")
            assert dropout_p == 0.0 and window_size_left == window_size_right == -1 and q.dim() == 3
            outs, lses = [], []
            for qs, ks, vs in zip(seqs(q, cu_q), seqs(k, cu_k), seqs(v, cu_k)):
                o, lse = _math(qs, expand(ks, q.shape[1]), expand(vs, q.shape[1]), causal, None, softmax_scale)
                outs.append(o[0].transpose(0, 1))
                lses.append(lse[0])
            return torch.cat(outs).to(q.dtype), torch.cat(lses, 1).float(), None, torch.zeros(2, dtype=torch.int64)

        def bwd(
            dout,
            q,
            k,
            v,
            out,
            lse,
            dq,
            dk,
            dv,
            cu_q,
            cu_k,
            max_q,
            max_k,
            dropout_p,
            softmax_scale,
            causal,
            *,
            window_size_left,
            window_size_right,
            softcap,
            alibi_slopes,
            deterministic,
            rng_state,
        ):
            self._count("flash_attn_bwd")
            h, g = q.shape[1], q.shape[1] // k.shape[1]
            for i in range(len(cu_q) - 1):
                rq, rk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
                one = [x[r].transpose(0, 1)[None] for x, r in ((dout, rq), (q, rq), (k, rk), (v, rk), (out, rq))]
                gq, gk, gv = _math_grads(
                    one[0],
                    one[1],
                    expand(one[2], h),
                    expand(one[3], h),
                    one[4],
                    lse[:, rq][None],
                    causal,
                    None,
                    softmax_scale,
                )
                dq[rq] = gq[0].transpose(0, 1).to(dq.dtype)
                dk[rk] = gk[0].view(-1, g, *gk.shape[2:]).sum(1).transpose(0, 1).to(dk.dtype)
                dv[rk] = gv[0].view(-1, g, *gv.shape[2:]).sum(1).transpose(0, 1).to(dv.dtype)
            return torch.empty(0)

        return types.SimpleNamespace(_flash_attn_varlen_forward=fwd, _flash_attn_varlen_backward=bwd)

    # aten flash: [B, H, L, D] with as many K/V heads as query heads; bookkeeping outputs handed back.
    def sdpa_flash(self):
        token = (None, None, torch.tensor([7, 9]), torch.empty(0))

        def fwd(q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
            self._count("sdpa_flash_fwd")
            assert k.shape[1] == q.shape[1] and dropout_p == 0.0
            o, lse = _math(q, k, v, is_causal, None, scale)
            return (o.to(q.dtype), lse.float(), token[0], token[1], q.shape[2], k.shape[2], token[2], token[3], None)

        def bwd(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *, scale):
            self._count("sdpa_flash_bwd")
            assert k.shape[1] == q.shape[1] and lse.dtype == torch.float32
            assert seed is token[2] and offset is token[3] and cum_q is None and cum_k is None
            return tuple(g.to(q.dtype) for g in _math_grads(dout, q, k, v, out, lse, is_causal, None, scale))

        return {"_scaled_dot_product_flash_attention": fwd, "_scaled_dot_product_flash_attention_backward": bwd}

    # aten memory-efficient: additive bias (rows 16-aligned), LSE padded to a multiple of 32 rows.
    def sdpa_efficient(self):
        def fwd(q, k, v, bias, compute_lse, dropout_p, is_causal, *, scale):
            self._count("sdpa_efficient_fwd" + ("_masked" if bias is not None else ""))
            assert k.shape[1] == q.shape[1] and compute_lse
            assert bias is None or (bias.stride(2) % 16 == 0 and bias.shape == (*q.shape[:3], k.shape[2]))
            o, lse = _math(q, k, v, is_causal, bias, scale)
            padded = torch.zeros(*lse.shape[:2], -(-lse.shape[2] // 32) * 32)
            padded[..., : lse.shape[2]] = lse
            return o.to(q.dtype), padded.float(), torch.tensor(1), torch.tensor(2)

        def bwd(dout, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_mask, is_causal, *, scale):
            self._count("sdpa_efficient_bwd" + ("_masked" if bias is not None else ""))
            assert lse.shape[2] % 32 == 0 and list(grad_mask) == [True, True, True, False]
            grads = _math_grads(dout, q, k, v, out, lse[..., : q.shape[2]], is_causal, bias, scale)
            return (*(g.to(q.dtype) for g in grads), None)

        return {"_scaled_dot_product_efficient_attention": fwd, "_scaled_dot_product_efficient_attention_backward": bwd}


def _only(stand_ins: StandIns, kernel: str) -> dict:
    """Ops dict with ``kernel``'s stand-ins and the other kernels absent."""
    ops = {
        "flash_attn": None,
        "_scaled_dot_product_flash_attention": None,
        "_scaled_dot_product_efficient_attention": None,
    }
    ops.update({"flash_attn": stand_ins.flash_attn()} if kernel == "flash_attn" else getattr(stand_ins, kernel)())
    return ops


@pytest.mark.parametrize("kernel", composite_cuda.KERNELS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_composite_through_each_kernel_matches_reference(kernel, name):
    layout = LAYOUTS[name]
    si = StandIns()
    with composite_cuda.use_ops(_only(si, kernel), devices=("cpu",)):
        ours, ref64, ref_lp = compare_with_reference(layout, "composite", dtype=torch.bfloat16, head_dim=16)
        assert composite_cuda.status()["disabled"] == {}
    assert_within_2x_torch_error(ours, ref64, ref_lp, torch.bfloat16)
    assert any(c.startswith(kernel) and c.endswith("fwd") for c in si.calls), si.calls
    assert any(c.startswith(kernel) and c.endswith("bwd") for c in si.calls), si.calls
    if kernel == "sdpa_efficient" and name.startswith("sbd"):
        assert si.calls.get("sdpa_efficient_fwd_masked", 0) > 0  # the masked pieces' forward ran fused too
        # ... but not their backward: on an H100 it gave NaN for a row with no visible key (GPU check).
        assert si.calls.get("sdpa_efficient_bwd_masked", 0) == 0


def test_masked_pieces_skip_mask_free_kernels():
    """flash kernels take no mask: SBD's masked chunks fall back to the portable path when only they exist."""
    si = StandIns()
    with composite_cuda.use_ops(_only(si, "sdpa_flash"), devices=("cpu",)):
        ours, ref64, ref_lp = compare_with_reference(LAYOUTS["sbd"], "composite", dtype=torch.bfloat16, head_dim=16)
    assert_within_2x_torch_error(ours, ref64, ref_lp, torch.bfloat16)
    assert si.calls.get("sdpa_flash_fwd", 0) > 0  # the context triangle / intra calls still went fused


def test_refusing_kernel_degrades_to_the_next_and_records_why():
    si = StandIns()
    ops = {**si.sdpa_efficient(), "_scaled_dot_product_flash_attention": None}

    def refuse(*args, **kwargs):
        si._count("flash_attn_refused")
        raise RuntimeError("no kernel image is available for execution on the device")

    ops["flash_attn"] = types.SimpleNamespace(_flash_attn_varlen_forward=refuse, _flash_attn_varlen_backward=refuse)
    with composite_cuda.use_ops(ops, devices=("cpu",)):
        ours, ref64, ref_lp = compare_with_reference(LAYOUTS["single"], "composite", dtype=torch.bfloat16, head_dim=16)
        disabled = composite_cuda.status()["disabled"]
    assert_within_2x_torch_error(ours, ref64, ref_lp, torch.bfloat16)
    assert si.calls["flash_attn_refused"] == 1  # switched off after the first refusal for this signature
    assert si.calls.get("sdpa_efficient_fwd", 0) > 0 and si.calls.get("sdpa_efficient_bwd", 0) > 0
    assert any(k.startswith("flash_attn/torch.bfloat16/16") and "no kernel image" in v for k, v in disabled.items())
    assert composite_cuda.status()["disabled"] == {}  # use_ops restores the process state


def test_old_flash_attn_lse_layout_is_refused_not_misread():
    """A flash-attn whose varlen LSE is [B, H, max_seqlen] (older releases) must not be used."""
    si = StandIns()
    fa = si.flash_attn()
    real_fwd = fa._flash_attn_varlen_forward

    def old_layout(q, *args, **kwargs):
        out, lse, s, rng = real_fwd(q, *args, **kwargs)
        b = len(args[2]) - 1  # args: k, v, cu_seqlens_q, ...
        return out, lse.view(lse.shape[0], b, -1).transpose(0, 1).contiguous(), s, rng

    fa._flash_attn_varlen_forward = old_layout
    ops = {
        "flash_attn": fa,
        "_scaled_dot_product_flash_attention": None,
        "_scaled_dot_product_efficient_attention": None,
    }
    with composite_cuda.use_ops(ops, devices=("cpu",)):
        ours, ref64, ref_lp = compare_with_reference(LAYOUTS["double"], "composite", dtype=torch.bfloat16, head_dim=16)
        disabled = composite_cuda.status()["disabled"]
    assert_within_2x_torch_error(ours, ref64, ref_lp, torch.bfloat16)
    assert "flash_attn_bwd" not in si.calls  # no backward ran on an unconfirmed LSE layout
    assert any("expected an LSE" in v for v in disabled.values()), disabled


def test_unsupported_inputs_never_reach_the_kernels():
    si = StandIns()
    ops = {"flash_attn": si.flash_attn(), **si.sdpa_flash(), **si.sdpa_efficient()}
    with composite_cuda.use_ops(ops, devices=("cpu",)):
        # float64 (no fused kernel takes it) and head dim 12 (not a multiple of 8)
        for dtype, d in ((torch.float64, 16), (torch.bfloat16, 12)):
            ours, ref64, ref_lp = compare_with_reference(LAYOUTS["single"], "composite", dtype=dtype, head_dim=d)
            assert_within_2x_torch_error(ours, ref64, ref_lp, dtype) if dtype != torch.float64 else None
            for a, b in zip(ours, ref64):
                assert (a.double() - b).abs().max().item() < (1e-9 if dtype == torch.float64 else 0.1)
    assert si.calls == {}


def test_cpu_tensors_are_not_routed_by_default():
    si = StandIns()
    with composite_cuda.use_ops({"flash_attn": si.flash_attn(), **si.sdpa_flash()}):  # devices: cuda only
        compare_with_reference(LAYOUTS["single"], "composite", dtype=torch.bfloat16, head_dim=16)
    assert si.calls == {}


def _errors_vs_torch(ours, ref64, ref_lp):
    """Per output (out, dq, dk, dv): (our max error, torch's same-dtype max error) against float64."""
    return [
        ((a.double() - b).abs().max().item(), (c.double() - b).abs().max().item())
        for a, b, c in zip(ours, ref64, ref_lp)
    ]


def _smoke_case(layout, backend, d=128, batch=2, heads=4, kv_heads=2, seed=0):
    """(ours, ref64, ref_lp) as the GPU check's smoke step makes them: bf16 inputs drawn directly in bf16."""
    from kforcing_kernels import window_attention

    g = torch.Generator().manual_seed(seed)

    def rand(h, length):
        return torch.randn(batch, h, length, d, dtype=torch.bfloat16, generator=g)

    q, k, v = rand(heads, layout.n_queries), rand(kv_heads, layout.n_keys), rand(kv_heads, layout.n_keys)
    dout = rand(heads, layout.n_queries)

    def run(backend, *tensors):
        q, k, v, do = tensors
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = window_attention(q, k, v, layout, backend=backend)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    return (
        run(backend, q, k, v, dout),
        run("reference", *(t.double() for t in (q, k, v, dout))),
        run("reference", q, k, v, dout),
    )


def test_fused_pieces_round_their_gradients_once_each_hence_the_composite_bound():
    """Why the composite's bf16 dK/dV may err more than 2x torch's own error (GPU check: sbd N=300 b=7, D=128,
    dv 3.9e-2 vs torch 1.5e-2): a key's dK/dV is the sum of the pieces that see it, and each piece that runs in
    a fused CUDA kernel hands its gradients back in bf16 (those kernels write grads in the input dtype), so a
    context key's dK/dV is rounded once in the context piece and again after the fp32 sum with the prefix
    pieces; torch's dense reference rounds once. The portable path (fp32 partials, one rounding) stays within
    2x torch; the fused path (here its stand-ins, exact then rounded: the best a fused kernel can do) goes past
    2x on dK at the smoke's shape and stays within the GPU check's composite bound, 3x torch + the floor (one
    rounding per fused partial a key sums, <= 2 in these layouts, plus the final one)."""
    layout = WindowLayout.sbd(300, 7)
    si = StandIns()
    with composite_cuda.use_ops({**si.sdpa_flash(), **si.sdpa_efficient()}, devices=("cpu",)):
        fused = _smoke_case(layout, "composite")
    assert si.calls.get("sdpa_flash_bwd", 0) > 0  # the context piece's backward ran "fused"
    portable = _smoke_case(layout, "composite")
    floor = 8e-3
    fused_err, portable_err = _errors_vs_torch(*fused), _errors_vs_torch(*portable)
    for label, (f, p) in zip(("out", "dq", "dk", "dv"), zip(fused_err, portable_err)):
        assert f[0] <= 3 * f[1] + floor, f"{label}: fused composite {f[0]:.3g} vs torch {f[1]:.3g}"
        assert p[0] <= 2 * p[1] + floor, f"{label}: portable composite {p[0]:.3g} vs torch {p[1]:.3g}"
    # The extra rounding shows where keys sum pieces (dK/dV), not in out / dQ (one piece per part of a row).
    assert fused_err[2][0] > 2 * fused_err[2][1] and portable_err[2][0] < 1.1 * portable_err[2][1]
    assert fused_err[3][0] > 1.5 * portable_err[3][0]
