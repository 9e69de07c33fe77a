"""What the llama.cpp backend does around ``llama_cpp.Llama()``: the model's shape from the facts,
the GPU layer counts its fallback steps go down through, the checks before the load (a truncated
file, a CPU load larger than the free RAM), the metadata a lazy header left unread, the log capture
and chat-handler guard while ``Llama()`` runs, and the error map.

Used by ``unillm.engines.llamacpp`` only; it does not import that module.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unillm import ConfigError, GenerationError, ModelFormatError, ModelLoadError, OutOfMemory
from unillm.backend import available_ram_bytes, check_chat_template, kv_bytes_per_token

if TYPE_CHECKING:
    from unillm import ModelInfo
    from unillm.backend import Facts, GGUFHeader

__all__ = [
    "LlamaLog",
    "Shape",
    "check_fits",
    "checked_header",
    "eval_error",
    "fewer_gpu_layers",
    "full_metadata",
    "load_error",
    "model_shape",
    "no_chat_handlers",
]

_TEMPLATE = "tokenizer.chat_template"


# ---- the model, from the facts ----


@dataclass(frozen=True)
class Shape:
    """What the load needs of the model: its trained context, its weights and its attention shape."""

    trained_context: int | None
    weights_bytes: int | None
    layers: int | None
    kv_heads: int | None
    head_dim: int | None
    value_dim: int | None

    def kv_bytes_per_token(self, dtype: str) -> int | None:
        """K and V bytes per token over all layers (``unillm.backend.kv_bytes_per_token``)."""
        if not (self.layers and self.kv_heads and self.head_dim):
            return None
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, dtype, value_dim=self.value_dim)


def model_shape(model: ModelInfo | None, header: GGUFHeader) -> Shape:
    """The shape from the facts' ``ModelInfo`` (inspection read it from this GGUF), else, when
    unillm could not inspect the model, from the header itself."""

    def arch(key: str) -> int | None:
        value = header.arch_value(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    value_dim = arch("attention.value_length")
    if model is not None and model.format == "gguf":
        return Shape(
            model.context_length,
            model.weights_bytes,
            model.layers,
            model.kv_heads,
            model.head_dim,
            value_dim,
        )
    heads, embd = arch("attention.head_count"), arch("embedding_length")
    head_dim = arch("attention.key_length") or (embd // heads if embd and heads else None)
    return Shape(
        arch("context_length"),
        header.tensor_bytes,
        arch("block_count"),
        arch("attention.head_count_kv") or heads,
        head_dim,
        value_dim,
    )


# ---- fallback steps ----


def fewer_gpu_layers(now: Any, facts: Facts) -> list[int]:
    """The GPU layer counts to step down through, from ``n_gpu_layers`` as the user set it (None,
    -1 and "auto" mean all): first what the plan says fits, else half the model's layers; an
    explicit count halves from itself; then half again down to 1. Empty when nothing is left."""
    if isinstance(now, bool):
        return []
    if now in (None, -1, "auto"):
        total = getattr(facts.model, "layers", None)
        planned = getattr(facts.plan, "gpu_layers", None)
        if isinstance(planned, int) and (total is None or planned < total):
            n = planned
        elif isinstance(total, int) and total > 1:
            n = total // 2
        else:
            return []
        out = [n]
    elif isinstance(now, int):
        n, out = now, []
    else:
        return []
    while n > 1:
        n //= 2
        out.append(n)
    return out


# ---- checks before the load ----


def checked_header(header: GGUFHeader, path: Path) -> GGUFHeader:
    if header.truncated:
        raise ModelFormatError(
            f"{str(path)!r} is truncated: its tensors end at byte {header.data_end} but the file has "
            f"{header.file_size} bytes. Download or convert it again."
        )
    return header


def check_fits(shape: Shape, n_ctx: int, dtype: str, model: str) -> None:
    """Refuse a CPU load whose weights and KV cache cannot fit in the free RAM, before llama.cpp
    allocates (it would grow the process until the machine swaps or kills it)."""
    bpt = shape.kv_bytes_per_token(dtype)
    free = available_ram_bytes()
    if bpt is None or not free:
        return
    weights = shape.weights_bytes or 0
    kv = bpt * n_ctx
    need = kv + weights
    if need <= free:
        return
    gib = 1 << 30
    fit = max(0, (free - weights) // bpt)
    raise OutOfMemory(
        f"{model!r} at a context of {n_ctx} needs {need / gib:.1f} GiB ({kv / gib:.1f} GiB of KV "
        f"cache at {bpt} bytes/token, {weights / gib:.1f} GiB of weights) but "
        f"{free / gib:.1f} GiB of RAM is free; use a context of at most {fit} tokens, "
        "kv_cache_type='q8_0', or skip_memory_check=True to try anyway"
    )


def full_metadata(llm: Any, header: GGUFHeader, *, check_template: bool, source: str) -> Mapping[str, Any]:
    """The GGUF's metadata with every key: the header's when it was read whole; after a lazy read
    (inspection's: it stops at the vocabulary, before the token ids and the chat template), what
    llama.cpp read at load, token ids as ints. A chat template the header did not hold is checked
    here (``check_template``), as the load checks the header's before ``Llama()``."""
    if header.unread is None:
        return header.metadata
    md: dict[str, Any] = dict(llm.metadata)
    for key, value in md.items():
        if key.endswith("_token_id") and isinstance(value, str) and value.isdigit():
            md[key] = int(value)
    template = md.get(_TEMPLATE)
    if check_template and _TEMPLATE not in header.metadata and isinstance(template, str):
        try:
            check_chat_template(template, source=source)
        except BaseException:
            llm.close()
            raise
    return md


# ---- while Llama() runs ----


@contextmanager
def no_chat_handlers(llama_cpp: Any) -> Iterator[None]:
    """Keep ``Llama()`` from compiling the GGUF's chat templates into chat handlers unillm never
    uses: llama-cpp-python compiles them in an environment that folds constant expressions, so a
    template like ``{{ 10 ** (10 ** 10) }}`` in a downloaded file would hang the load. unillm
    renders templates itself, bounded (unillm._chat._template). Swapped only while ``Llama()`` runs, under
    ``LlamaLog``'s lock, which serializes loads."""
    fmt = llama_cpp.llama_chat_format
    real = fmt.Jinja2ChatFormatter

    class _Unused:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def to_chat_handler(self) -> Any:
            def refuse(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("unillm renders chat templates itself; use engine.chat()")

            return refuse

    fmt.Jinja2ChatFormatter = _Unused
    try:
        yield
    finally:
        fmt.Jinja2ChatFormatter = real


class LlamaLog:
    """Collect llama.cpp's log lines while loading, so load errors can say what llama.cpp said;
    lines starting with one of ``handled`` (what unillm itself takes care of) are kept from stderr."""

    _lock = threading.Lock()

    def __init__(self, llama_cpp: Any, *, handled: tuple[str, ...] = ()) -> None:
        self._lc = llama_cpp
        self._lines: list[str] = []
        self._handled = handled

    def __enter__(self) -> LlamaLog:
        import ctypes

        self._lock.acquire()
        lines, handled = self._lines, self._handled
        from llama_cpp import _logger

        self._forward = _logger.llama_log_callback

        @self._lc.llama_log_callback
        def collect(level: int, text: bytes, user_data: Any) -> None:
            line = text.decode("utf-8", "replace")
            lines.append(line)
            if not (handled and line.lstrip().startswith(handled)):
                self._forward(level, text, user_data)

        self._callback = collect  # keep the C callback alive while installed
        self._lc.llama_log_set(collect, ctypes.c_void_p(0))
        return self

    def __exit__(self, *exc: object) -> None:
        import ctypes

        self._lc.llama_log_set(self._forward, ctypes.c_void_p(0))
        self._lock.release()

    def text(self) -> str:
        return "".join(self._lines)


# ---- error map ----


def load_error(exc: Exception, log: str, header: GGUFHeader, model: str) -> Exception:
    detail = log.strip().splitlines()[-3:] if log.strip() else [str(exc)]
    why = " | ".join(line.strip() for line in detail)
    lower = (log + str(exc)).lower()
    if "unknown model architecture" in lower:
        return ModelFormatError(
            f"this llama.cpp build does not support the architecture {header.architecture!r} of "
            f"{model!r}; upgrade llama-cpp-python or use another backend ({why})"
        )
    if "lora adapter" in str(exc).lower():  # llama-cpp-python's "Failed to initialize LoRA adapter"
        return ConfigError(f"llama.cpp could not apply the LoRA adapter to {model!r} ({why})")
    if "not within the file bounds" in lower:  # a truncated file the header could not tell
        return ModelFormatError(f"{model!r} is truncated ({why}). Download or convert it again.")
    if any(
        s in lower
        for s in ("failed to allocate", "out of memory", "unable to allocate", "cudamalloc", "bad_alloc")
    ):
        return OutOfMemory(
            f"llama.cpp could not allocate memory for {model!r} ({why}); use a smaller context "
            "length, fewer GPU layers (n_gpu_layers) or kv_cache_type='q8_0'"
        )
    if "failed to create llama_context" in lower:
        return OutOfMemory(
            f"llama.cpp could not create a context for {model!r} ({why}); most often the KV cache "
            "does not fit: use a smaller context length or kv_cache_type='q8_0'"
        )
    return ModelLoadError(f"llama.cpp failed to load {model!r}: {why}")


def eval_error(exc: Exception) -> Exception:
    text = str(exc)
    if "returned 1" in text or "kv" in text.lower():
        return OutOfMemory(f"llama.cpp found no room in the KV cache ({text}); use a larger context")
    return GenerationError(f"llama.cpp failed to evaluate the prompt: {text}")


def gguf_adapter(path: Path, backend: str, facts: Facts) -> Path:
    """``path`` if it is a GGUF LoRA adapter (``general.type`` adapter), else a ConfigError: llama.cpp
    loads a model's GGUF as an adapter without a word, one that changes nothing."""
    want = (
        f"{backend} reads a LoRA adapter as one GGUF file (general.type 'adapter'; llama.cpp's "
        "convert_lora_to_gguf.py writes one from a PEFT adapter)"
    )
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) != 1:
            raise ConfigError(f"{want}; {str(path)!r} is a directory holding {len(found)} .gguf files")
        path = found[0]
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ConfigError(f"{want}; {str(path)!r} is not a GGUF file")
    kind = facts.for_path(str(path)).gguf_header.metadata.get("general.type")
    if kind != "adapter":
        raise ConfigError(f"{want}; {str(path)!r} is a GGUF of type {kind!r}, not an adapter")
    return path
