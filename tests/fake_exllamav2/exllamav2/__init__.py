"""A fake of exllamav2 for unillm's tests: the public names of exllamav2 0.3.x, no GPU needed.

See README.md beside this package for what is real and what is simulated.
"""

from exllamav2.cache import (
    ExLlamaV2Cache,
    ExLlamaV2Cache_8bit,
    ExLlamaV2Cache_Q4,
    ExLlamaV2Cache_Q6,
    ExLlamaV2Cache_Q8,
    ExLlamaV2CacheBase,
)
from exllamav2.config import ExLlamaV2Config
from exllamav2.lora import ExLlamaV2Lora
from exllamav2.model import ExLlamaV2
from exllamav2.tokenizer import ExLlamaV2Tokenizer
from exllamav2.version import __version__

__all__ = [
    "ExLlamaV2",
    "ExLlamaV2Cache",
    "ExLlamaV2CacheBase",
    "ExLlamaV2Cache_8bit",
    "ExLlamaV2Cache_Q4",
    "ExLlamaV2Cache_Q6",
    "ExLlamaV2Cache_Q8",
    "ExLlamaV2Config",
    "ExLlamaV2Lora",
    "ExLlamaV2Tokenizer",
    "__version__",
]
