"""The ops: one folder each, holding the public function, its torch custom-op
registration, a naive reference beside the fast backends, and their kernels.

    window_attention/   prefix-window attention (reference, composite, cpp, triton)
    sampling/           inverse-CDF sampling and noise inversion (reference, cpp, triton)
"""
