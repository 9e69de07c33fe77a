"""A stand-in for flash-attn, so that it is found where the fake exllamav2 is (its paged attention is
what batching needs). Nothing imports it: the backend only looks it up (``find_spec``), and the fake
``exllamav2.attn`` says what exllamav2 found."""

__version__ = "2.7.4"
