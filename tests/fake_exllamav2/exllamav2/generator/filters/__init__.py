from exllamav2.generator.filters.base import ExLlamaV2Filter

__all__ = ["ExLlamaV2Filter"]
