"""The reference model: a GPT-style decoder run as AR teacher or push-forward LM."""

from .config import PRESETS, ModelConfig
from .gpt import KForcingLM, PagedPast, double_positions, single_positions

__all__ = ["ModelConfig", "PRESETS", "KForcingLM", "PagedPast", "single_positions", "double_positions"]
