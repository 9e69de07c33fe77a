"""A fake of exllamav3's public API for tests on machines without CUDA (see ../README.md).

The names exported here are those of exllamav3/__init__.py (v1.6.5, the PyPI wheel) that the
plugin and its checks use: Config, Model, Tokenizer, Cache and its layer types, Generator, Job,
Filter, LLGuidanceFilter and the samplers (not MMEmbedding, AsyncGenerator, AsyncJob or
FormatronFilter, which are not modelled).
"""

from .cache import Cache, CacheLayer_fp16, CacheLayer_quant
from .generator import Filter, Generator, Job, LLGuidanceFilter
from .generator.sampler import *  # noqa: F403
from .model.config import Config
from .model.model import Model
from .tokenizer import Tokenizer
from .version import __version__

__all__ = [
    "Cache",
    "CacheLayer_fp16",
    "CacheLayer_quant",
    "Config",
    "Filter",
    "Generator",
    "Job",
    "LLGuidanceFilter",
    "Model",
    "Tokenizer",
    "__version__",
]
