"""Decode attention over a paged KV cache: ``paged_attention(q, k_new, v_new, k_pages, v_pages, block_table,
context_lens)``.

    op.py         the public function, validation, backend registry
    reference.py  gather the pages into a contiguous cache, dense masked attention (the oracle)
    composite.py  torch ops over chunks of pages with an online-softmax merge (no whole-cache gather)
    cpp.py        the C++ CPU kernel (csrc/paged_attention.cpp)
    triton.py     the Triton kernel (triton_kernels.py): CUDA, or the interpreter under TRITON_INTERPRET=1
"""

from .op import PAGED_BACKENDS, paged_attention, paged_backends_available

__all__ = ["paged_attention", "PAGED_BACKENDS", "paged_backends_available"]
