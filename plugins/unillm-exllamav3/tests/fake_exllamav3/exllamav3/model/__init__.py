from .config import Config
from .model import Model

__all__ = ["Config", "Model"]
