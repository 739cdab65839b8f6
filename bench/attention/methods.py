"""The methods a sweep times and how they are described (shared by sweep.py and report.py)."""

OURS = ("composite", "cpp", "triton")
PEERS = ("dense_sdpa", "flex_blockmask", "flex_create_block_mask", "flash_attn_ideal")
METHODS = ("ideal",) + PEERS + OURS
METHOD_KIND = {"ideal": "ideal", **{m: "peer" for m in PEERS}, **{m: "ours" for m in OURS}}
METHOD_DESCRIPTION = {
    "ideal": "|M|/causal(N) x causal SDPA over N (the non-zero pairs at causal-attention speed)",
    "dense_sdpa": "SDPA with the dense bool mask: the paper's code, = the reference backend",
    "flex_blockmask": "torch.compile(flex_attention) with the analytic layout.to_block_mask()",
    "flex_create_block_mask": "torch.compile(flex_attention) with create_block_mask(layout.mask_mod())",
    "flash_attn_ideal": "|M|/causal(N) x flash-attn causal over N (the ideal at FlashAttention speed)",
    "composite": "window_attention(backend='composite')",
    "cpp": "window_attention(backend='cpp')",
    "triton": "window_attention(backend='triton')",
}
PHASES = ("fwd", "fwd_bwd")
