"""The Hugging Face recipe: an HF causal LM as the trainer's model, its files, and the transformers.Trainer route."""
