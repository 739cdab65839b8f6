"""Integrations with other libraries. Each submodule imports its library on use only:

    import kforcing_kernels.integrations.hf   # Hugging Face transformers: attn_implementation="kforcing"

``hf_masks`` (pure torch) turns what an HF attention call asks for (packed documents, sliding
windows, materialised masks) into layouts for ``hf``.
``hf_batches`` (pure torch) builds the K-Forcing forward kwargs that ``hf`` re-exports.
"""
