"""The ops: one folder each, holding the public function, its torch custom-op
registration, a naive reference beside the fast backends, and their kernels.

    window_attention/   prefix-window attention (reference, composite, cpp, triton, flex)
    paged_attention/    one decode step over a paged KV cache (reference, composite, cpp, triton)
    sampling/           inverse-CDF sampling and noise inversion (reference, cpp, triton)
    common/             what more than one op shares: the backend registry, argument checks, acc_dtype,
                        the Triton availability rules (a piece one op alone uses stays in its folder)
"""
