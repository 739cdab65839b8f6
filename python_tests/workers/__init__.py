"""Scripts that the torchrun tests launch, one process per rank (python_tests/helpers/train_helpers.torchrun)."""
