from exllamav2.generator.dynamic import ExLlamaV2DynamicGenerator, ExLlamaV2DynamicJob
from exllamav2.generator.sampler import ExLlamaV2Sampler
from exllamav2.version import __version__

__all__ = ["ExLlamaV2DynamicGenerator", "ExLlamaV2DynamicJob", "ExLlamaV2Sampler", "__version__"]
