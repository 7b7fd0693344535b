"""Model configs, weights and the unfused reference decode (no knowledge of tasks or kernels)."""

from .config import ConfigError, ModelConfig, RopeSpec
from .presets import PRESETS, TINY_PRESETS, preset
from .reference import Cache, CacheOverflowError, Reference, StepOutput
from .weights import CheckpointError, init_weights, load_checkpoint, save_checkpoint

__all__ = [
    "Cache", "CacheOverflowError", "CheckpointError", "ConfigError", "ModelConfig", "PRESETS", "Reference",
    "RopeSpec", "StepOutput", "TINY_PRESETS", "init_weights", "load_checkpoint", "preset", "save_checkpoint",
]
