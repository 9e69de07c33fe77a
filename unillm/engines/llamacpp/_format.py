"""The llama.cpp backend's structured output, through llguidance (unillm/backend/llguidance.py, the
compiler every built-in backend uses): a response format becomes a sampler at the head of the
request's llama.cpp sampler chain. Before each draw it sets the logit of every token the format does
not allow to -inf, so every later sampler (bias, penalties, top-k, temperature) sees only allowed
tokens; the chain's ``accept`` tells it the token drawn. The same chain serves the one-sequence
loop, the batcher and speculative decoding (which all sample through it).

llguidance's tokenizer is built once per engine from llama.cpp's own vocabulary (no
``tokenizer.json`` needed), with the model's end-of-sequence set: once the format is complete only
those tokens are allowed, and they end the output. The logprobs a request gets stay the model's own
(they are read from the context's logits, not from the chain).
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Collection
from typing import Any

from unillm.backend import OutputFormat
from unillm.backend.llguidance import Guide

__all__ = ["Formats", "eog_ids"]

INSTALL = "pip install 'unillm[llamacpp]' (it brings llguidance)"
_TOKEN_DATA = [("id", "<i4"), ("logit", "<f4"), ("p", "<f4")]  # llama_token_data, as numpy reads it


def eog_ids(vocab: Any, n_vocab: int) -> frozenset[int]:
    """Every token llama.cpp counts as an end of generation (``llama_vocab_is_eog``)."""
    import llama_cpp

    is_eog = llama_cpp.llama_vocab_is_eog
    return frozenset(t for t in range(n_vocab) if is_eog(vocab, t))


class Formats:
    """One engine's llguidance tokenizer (built from llama.cpp's vocabulary on first use) and the
    samplers it adds to request chains. ``eos``: the tokens that end a completed format."""

    def __init__(self, vocab: Any, n_vocab: int, eos_ids: Collection[int]) -> None:
        self.eos = frozenset(eos_ids) or eog_ids(vocab, n_vocab)
        self.n_vocab = n_vocab

        def tokenizer(llg: Any) -> Any:
            from llguidance.llamacpp import lltokenizer_from_vocab

            with warnings.catch_warnings():  # it reads each token through a call llama-cpp-python deprecates
                warnings.simplefilter("ignore", DeprecationWarning)
                return lltokenizer_from_vocab(vocab, n_vocab=n_vocab, eos_token=sorted(self.eos))

        self._guide = Guide("llama.cpp", INSTALL, None, n_vocab, sorted(self.eos), tokenizer=tokenizer)

    def check(self, fmt: OutputFormat) -> None:
        """Raise ``ConfigError`` now if ``fmt`` cannot be enforced (the same words everywhere)."""
        self._guide.check(fmt)

    def add(self, chain: Any, fmt: OutputFormat) -> None:
        """Add ``fmt``'s sampler to llama-cpp-python's ``LlamaSampler`` ``chain`` (first, so put
        it there before any other); the chain removes it before it is freed."""
        import llama_cpp

        sampler = _Mask(llama_cpp, self._guide.matcher(fmt), self.n_vocab, self.eos)
        llama_cpp.llama_sampler_chain_add(chain.sampler, sampler.pointer)
        # LlamaSampler's close takes its custom samplers out of the chain before freeing it (llama.cpp
        # would free them as its own) and holds them, with their callbacks, until then
        chain.custom_samplers.append((llama_cpp.llama_sampler_chain_n(chain.sampler) - 1, sampler))


class _Mask:
    """A llama.cpp sampler written in Python: ``apply`` masks the candidates with the matcher,
    ``accept`` advances it. Holds its callbacks and structs for as long as the chain uses it."""

    def __init__(self, llama_cpp: Any, matcher: Any, n_vocab: int, eos: frozenset[int]) -> None:
        import numpy as np  # on the first format, never at import

        self._np = np
        self._dtype = np.dtype(_TOKEN_DATA)
        self._matcher = matcher
        self._bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
        self._n_vocab = n_vocab
        self._eos = np.fromiter(sorted(eos), dtype=np.int64)

        def apply(_smpl: Any, cur_p: Any) -> None:
            self._apply(cur_p.contents)

        def accept(_smpl: Any, token: int) -> None:
            matcher.consume_token(token)  # an error leaves the matcher allowing only the end

        iface = llama_cpp.llama_sampler_i()
        iface.apply = self._apply_cb = llama_cpp.llama_sampler_i_apply(apply)
        iface.accept = self._accept_cb = llama_cpp.llama_sampler_i_accept(accept)
        iface.name = llama_cpp.llama_sampler_i_name(0)
        iface.reset = llama_cpp.llama_sampler_i_reset(0)
        iface.clone = llama_cpp.llama_sampler_i_clone(0)
        iface.free = llama_cpp.llama_sampler_i_free(0)
        self._iface = iface
        self._sampler = llama_cpp.llama_sampler()
        self._sampler.iface = ctypes.pointer(iface)
        self._sampler.ctx = None
        self.pointer = ctypes.pointer(self._sampler)

    def _apply(self, cur: Any) -> None:
        np, dtype = self._np, self._dtype
        n, width = int(cur.size), self._n_vocab
        address = ctypes.cast(cur.data, ctypes.c_void_p).value
        if not n or address is None:
            return
        raw = (ctypes.c_char * (n * dtype.itemsize)).from_address(address)
        data = np.frombuffer(raw, dtype)
        bits = self._bits
        self._matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        allowed = np.unpackbits(bits.view(np.uint8), count=width, bitorder="little").view(bool)
        ids = data["id"]
        if n == width and ids[0] == 0 and ids[-1] == width - 1:  # the whole vocabulary in id order,
            keep = allowed  # as llama.cpp hands it to the head of the chain: no gather
        else:
            inside = ids < width
            keep = np.zeros(n, dtype=bool)
            keep[inside] = allowed[ids[inside]]
        if not keep.any():  # done or in error (a parse then says which): only the end is left
            keep = np.isin(ids, self._eos)
        data["logit"][~keep] = -np.inf
