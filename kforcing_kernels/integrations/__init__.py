"""Integrations with other libraries. Each submodule imports its library on use only:

    import kforcing_kernels.integrations.hf   # Hugging Face transformers: attn_implementation="kforcing"
"""
