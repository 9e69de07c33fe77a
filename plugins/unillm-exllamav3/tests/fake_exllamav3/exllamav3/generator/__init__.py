from .filter import Filter, LLGuidanceFilter
from .generator import Generator
from .job import Job

__all__ = ["Filter", "Generator", "Job", "LLGuidanceFilter"]
