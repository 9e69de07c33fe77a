from .filter import Filter
from .generator import Generator
from .job import Job

__all__ = ["Filter", "Generator", "Job"]
