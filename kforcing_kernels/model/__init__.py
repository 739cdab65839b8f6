"""The reference model: a GPT-style decoder run as AR teacher or push-forward LM."""

from .config import PRESETS, ModelConfig
from .gpt import KForcingLM, double_positions, single_positions

__all__ = ["ModelConfig", "PRESETS", "KForcingLM", "single_positions", "double_positions"]
