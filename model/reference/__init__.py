"""The unfused reference model in plain PyTorch."""

from .model import Cache, CacheOverflowError, Reference, StepOutput

__all__ = ["Cache", "CacheOverflowError", "Reference", "StepOutput"]
