from .filter import Filter
from .llguidance import LLGuidanceFilter

__all__ = ["Filter", "LLGuidanceFilter"]
