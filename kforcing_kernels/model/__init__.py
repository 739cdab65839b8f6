"""The reference model: a GPT-style decoder run as AR teacher or push-forward LM."""

from ..layouts.positions import double_positions, single_positions
from .config import PRESETS, ModelConfig
from .decode_paths import PagedPast
from .gpt import KForcingLM

__all__ = ["ModelConfig", "PRESETS", "KForcingLM", "PagedPast", "single_positions", "double_positions"]
