"""Element-wise mask definitions written from the papers and the original public code.

Each function loops over (query, key) pairs and states the rule in the paper's own
terms; none of them uses WindowLayout. Tests compare layouts' dense masks and the
backends' outputs against these.
"""

import torch


def kforcing_single_elementwise(n, k):
    """K-Forcing App. C.2, SingleForward M_S over [ctx (N) | noise (N*k)].

    1. context -> context: causal.  2. noise group at position t -> context x_1..x_t
    (0-indexed: context 0..t).  3. noise -> noise: block-diagonal causal.
    """
    size = n + n * k
    mask = torch.zeros(size, size, dtype=torch.bool)
    for qi in range(size):
        for ki in range(size):
            if qi < n:
                mask[qi, ki] = ki < n and ki <= qi
            else:
                t, i = divmod(qi - n, k)
                if ki < n:
                    mask[qi, ki] = ki <= t
                else:
                    t2, j = divmod(ki - n, k)
                    mask[qi, ki] = t2 == t and j <= i
    return mask


def kforcing_double_elementwise(n, k):
    """K-Forcing App. C.2, DoubleForward M_D: queries [F1 | F2], keys [ctx | F1 | F2].

    F1 -> ctx / F1 as in SingleForward; F2 -> ctx staircase; F2 -> F1 full within the
    window; F2 -> F2 block-diagonal causal. F1 never sees F2.
    """
    mask = torch.zeros(2 * n * k, n + 2 * n * k, dtype=torch.bool)
    for qi in range(2 * n * k):
        q_stream, (t, i) = qi // (n * k), divmod(qi % (n * k), k)
        for ki in range(n + 2 * n * k):
            if ki < n:
                mask[qi, ki] = ki <= t
                continue
            k_stream, (t2, j) = (ki - n) // (n * k), divmod((ki - n) % (n * k), k)
            if t2 != t:
                continue
            if q_stream == 0:
                mask[qi, ki] = k_stream == 0 and j <= i
            else:
                mask[qi, ki] = k_stream == 0 or j <= i
    return mask


def sbd_elementwise(n, block):
    """SBD Figure 9's mask_mod, transcribed, with seq_len = 2L."""
    seq_len = 2 * n
    half = seq_len // 2
    mask = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for q_idx in range(seq_len):
        for kv_idx in range(seq_len):
            top_left = q_idx < half and kv_idx < half and kv_idx <= q_idx
            bottom_right = q_idx >= half and kv_idx >= half and (q_idx - half) // block == (kv_idx - half) // block
            bottom_left = q_idx >= half and kv_idx < half and (q_idx - half) // block > kv_idx // block
            mask[q_idx, kv_idx] = top_left or bottom_right or bottom_left
    return mask


def ptp_elementwise(n_ctx, starts, completion_len, doc_starts):
    """PTP completion pass: completion c's aux token j sees its document's context
    [doc_start_c, start_c) and aux tokens 0..j of the same completion."""
    nc = len(starts)
    mask = torch.zeros(nc * completion_len, n_ctx + nc * completion_len, dtype=torch.bool)
    for qi in range(nc * completion_len):
        c, j = divmod(qi, completion_len)
        for p in range(doc_starts[c], starts[c]):
            mask[qi, p] = True
        for j2 in range(j + 1):
            mask[qi, n_ctx + c * completion_len + j2] = True
    return mask


def jacobi_elementwise(n_prompt, n_noisy):
    """Jacobi Forcing noise-conditioned mask over [prompt | clean | noisy]: prompt+clean is
    AR; noisy token i sees the prompt and noisy tokens 0..i."""
    size = n_prompt + 2 * n_noisy
    mask = torch.zeros(size, size, dtype=torch.bool)
    ctx = n_prompt + n_noisy
    for qi in range(size):
        for ki in range(size):
            if qi < ctx:
                mask[qi, ki] = ki <= qi
            else:  # noisy token qi - ctx
                mask[qi, ki] = ki < n_prompt or (ctx <= ki <= qi)
    return mask


def doc_of(cu, i):
    """Index of the document holding position i (cu: FlashAttention offsets)."""
    return max(d for d in range(len(cu) - 1) if cu[d] <= i < cu[d + 1])


def causal_packed_elementwise(n, cu, block=None):
    """Token i sees token j iff same document and j <= i (block-causal: j's block <= i's block,
    blocks counted from the document start)."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            d = doc_of(cu, i)
            if doc_of(cu, j) != d:
                continue
            if block is None:
                mask[i, j] = j <= i
            else:
                mask[i, j] = (j - cu[d]) // block <= (i - cu[d]) // block
    return mask


def kforcing_single_packed_elementwise(n, k, cu):
    """SingleForward with documents: the window after context t sees context j iff j <= t and j is
    in t's document; noise slots causal inside their window; context rows document-causal."""
    size = n + n * k
    mask = torch.zeros(size, size, dtype=torch.bool)
    mask[:n, :n] = causal_packed_elementwise(n, cu)
    for t in range(n):
        for i in range(k):
            q = n + t * k + i
            for j in range(n):
                mask[q, j] = j <= t and doc_of(cu, j) == doc_of(cu, t)
            for i2 in range(i + 1):
                mask[q, n + t * k + i2] = True
    return mask


def kforcing_double_packed_elementwise(n, k, cu):
    """DoubleForward with documents: queries [F1 | F2], keys [ctx | F1 | F2] (stream-major)."""
    mask = torch.zeros(2 * n * k, n + 2 * n * k, dtype=torch.bool)
    for qi in range(2 * n * k):
        qs, (t, i) = qi // (n * k), divmod(qi % (n * k), k)
        for j in range(n):
            mask[qi, j] = j <= t and doc_of(cu, j) == doc_of(cu, t)
        for ks in range(2):
            for i2 in range(k):
                seen = (ks < qs) or (ks == qs and i2 <= i)
                mask[qi, n + ks * n * k + t * k + i2] = seen
    return mask


def sbd_packed_elementwise(n, block, cu):
    """SBD Figure 9's mask_mod restricted to one document (boundaries at multiples of block)."""
    mask = torch.zeros(2 * n, 2 * n, dtype=torch.bool)
    mask[:n, :n] = causal_packed_elementwise(n, cu)
    for q in range(n):
        for kv in range(2 * n):
            if kv >= n:
                mask[n + q, kv] = q // block == (kv - n) // block
            else:
                mask[n + q, kv] = q // block > kv // block and doc_of(cu, q) == doc_of(cu, kv)
    return mask


def bd3lm_block_diff_mask(n, block_size):
    """kuleshov-group/bd3lms `block_diff_mask`, transcribed, over its [x_t (n) | x_0 (n)] order."""
    size = 2 * n
    mask = torch.zeros(size, size, dtype=torch.bool)
    for q_idx in range(size):
        for kv_idx in range(size):
            x0_flag_q, x0_flag_kv = q_idx >= n, kv_idx >= n
            block_q = (q_idx - n) // block_size if x0_flag_q else q_idx // block_size
            block_kv = (kv_idx - n) // block_size if x0_flag_kv else kv_idx // block_size
            block_diagonal = block_q == block_kv and x0_flag_q == x0_flag_kv
            offset_block_causal = block_q > block_kv and x0_flag_kv and not x0_flag_q
            block_causal = block_q >= block_kv and x0_flag_kv and x0_flag_q
            mask[q_idx, kv_idx] = block_diagonal or offset_block_causal or block_causal
    return mask


def ptp_truncated_elementwise(n_ctx, starts, length, doc_starts, doc_ends):
    """PTP completion pass; aux token j of completion c predicts position starts[c] + j and is blank
    (sees nothing) when that position is at or past its document's end."""
    nc = len(starts)
    mask = torch.zeros(nc * length, n_ctx + nc * length, dtype=torch.bool)
    for qi in range(nc * length):
        c, j = divmod(qi, length)
        if starts[c] + j >= doc_ends[c]:
            continue
        for p in range(doc_starts[c], starts[c]):
            mask[qi, p] = True
        for j2 in range(j + 1):
            mask[qi, n_ctx + c * length + j2] = True
    return mask


def dflash_elementwise(n_ctx, anchors, block, keep=None, intra="full", window=None, window_mode="block", cu=None):
    """DFlash anchor-block mask (SpecForge's create_dflash_sdpa_mask, written out), bool [B, 1, Q, S + Q].

    KV ``[context (S) | block_0 | ... | block_{n-1}]``, Q the blocks. Block i (anchor a) sees context
    kv < a (and, packed, only a's document), its own block (all of it, or slots <= its own when
    causal), nothing else; a dropped block sees nothing. Sliding windows: "block" (vLLM speculators)
    kv >= a - W for the whole block; "slot" (SpecForge) kv >= a + o - (W - 1) for slot o.
    ``anchors``/``keep``: lists of rows (one per batch element); ``cu``: one offsets list per row or None.
    """
    rows = len(anchors)
    n = len(anchors[0])
    q_len = n * block
    mask = torch.zeros(rows, 1, q_len, n_ctx + q_len, dtype=torch.bool)
    for b in range(rows):
        for qi in range(q_len):
            i, o = qi // block, qi % block
            a = anchors[b][i]
            if keep is not None and not keep[b][i]:
                continue
            for kv in range(n_ctx + q_len):
                if kv < n_ctx:
                    ok = kv < a
                    if cu is not None:
                        ok = ok and doc_of(cu[b], kv) == doc_of(cu[b], min(a, n_ctx - 1))
                    if window is not None:
                        ok = ok and kv >= (a - window if window_mode == "block" else a + o - (window - 1))
                else:
                    j, r = (kv - n_ctx) // block, (kv - n_ctx) % block
                    ok = j == i and (intra == "full" or r <= o)
                mask[b, 0, qi, kv] = ok
    return mask


def jacobi_batched_elementwise(prompts, noisy):
    """Batched Jacobi Forcing: sample b is jacobi_elementwise(P_b, T_b) placed in the padded frame
    ``[prompt_b | clean_b | pad (to C = max P+T) || noisy_b | pad (to max T)]``, bool [B, 1, L, L]."""
    c = max(p + t for p, t in zip(prompts, noisy))
    size = c + max(noisy)
    mask = torch.zeros(len(prompts), 1, size, size, dtype=torch.bool)
    for b, (p, t) in enumerate(zip(prompts, noisy)):
        where = list(range(p + t)) + list(range(c, c + t))  # sample position -> frame position
        one = jacobi_elementwise(p, t)
        for qi, fq in enumerate(where):
            for ki, fk in enumerate(where):
                mask[b, 0, fq, fk] = one[qi, ki]
    return mask
