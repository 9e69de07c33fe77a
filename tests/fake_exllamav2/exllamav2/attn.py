"""Which attention kernels exllamav2 found at import; the real module sets these from flash-attn."""

has_flash_attn = True
has_flash_attn_with_paged = True
has_flash_attn_with_window = True
has_flash_attn_with_softcap = True
has_xformers = False
has_lower_right_sdpa = False


def assert_paged_attn() -> None:
    """Raise an exception if paged attention is not available (as exllamav2 does)."""
    assert has_flash_attn_with_paged, "Paged attention required Flash Attention 2.5.7 or later"
