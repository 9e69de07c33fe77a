"""Tokenizer: the model's tokenizer.json through the tokenizers library, as exllamav3 does
(exllamav3/tokenizer/tokenizer.py, v1.6.5): ``Tokenizer.from_config(config)``, ``encode``,
``decode``, ``single_token``, ``single_id``, ``get_id_to_piece_list``, the special tokens,
``tokenizer_config_dict`` and ``actual_vocab_size``/``raw_vocab_size``. As in 1.6.5, the HF
tokenizer's padding and truncation are off, its post-processor never adds BOS, and
``encode_special_tokens=False`` encodes special-token strings as plain text (the backend's
split-special-tokens mode)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from exllamav3._tensor import Tensor


class Tokenizer:
    def __init__(self, config: Any) -> None:
        from tokenizers import Tokenizer

        self.config = config
        path = os.path.join(config.directory, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"No such file or directory: {path!r}")  # HFTokenizer.from_file
        self._hf = Tokenizer.from_file(path)
        self._hf.no_truncation()
        self._hf.no_padding()
        self.tokenizer = self._hf  # exllamav3's name for the HF tokenizer (llguidance builds from it)
        self.extended_piece_to_id: dict[str, int] = {}
        self.unspecial_piece_to_id: dict[str, int] = {}
        with open(path, encoding="utf8") as f:
            for v in json.load(f).get("added_tokens", []):
                target = self.extended_piece_to_id if v["special"] else self.unspecial_piece_to_id
                target[v["content"]] = v["id"]
        cfg_path = os.path.join(config.directory, "tokenizer_config.json")
        self.tokenizer_config_dict: dict[str, Any] | None = None
        if os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf8") as f:
                self.tokenizer_config_dict = json.load(f)
        self.extended_id_to_piece = {v: k for k, v in self.extended_piece_to_id.items()}

        def default_id(key: str, current: int | None, default: int | None) -> int | None:
            if current is not None:
                return current
            if self.tokenizer_config_dict and key in self.tokenizer_config_dict:
                st = self.tokenizer_config_dict[key]
                st = st.get("content") if isinstance(st, dict) else st
                return self._hf.token_to_id(st) if isinstance(st, str) else None
            return default

        self.pad_token_id = default_id("pad_token", config.pad_token_id, None)
        self.bos_token_id = default_id("bos_token", config.bos_token_id, 1)
        self.eos_token_id = default_id("eos_token", config.eos_token_id, 2)
        # exllamav3 widens the config's EOS list with tokenizer_config.json's (1.6.5: only when it
        # names one, no id-2 fallback) and generation_config.json's
        e = default_id("eos_token", None, None)
        if e:
            if config.eos_token_id != e:
                config.eos_token_id = e
            if e not in config.eos_token_id_list:
                config.eos_token_id_list.append(e)
        gen_path = os.path.join(config.directory, "generation_config.json")
        self.generation_config_dict: dict[str, Any] = {}
        if os.path.exists(gen_path):
            with open(gen_path, encoding="utf8") as f:
                self.generation_config_dict = json.load(f)
        ee = self.generation_config_dict.get("eos_token_id")
        for e in ee if isinstance(ee, list) else [ee] if ee else []:
            if e not in config.eos_token_id_list:
                config.eos_token_id_list.append(e)
        self.bos_token = self.extended_id_to_piece.get(self.bos_token_id) or self._hf.id_to_token(
            self.bos_token_id
        )
        self.eos_token = self.extended_id_to_piece.get(self.eos_token_id) or self._hf.id_to_token(
            self.eos_token_id
        )
        if self.pad_token_id is None:  # "<pad>" (id 0 is a valid one), else EOS unless it is BOS
            pad_test = self._hf.token_to_id("<pad>")
            if pad_test is not None:
                self.pad_token_id = pad_test
            elif self.eos_token_id != self.bos_token_id:
                self.pad_token_id = self.eos_token_id
            else:
                self.pad_token_id = -1
        self.raw_vocab_size = self._hf.get_vocab_size()
        self.actual_vocab_size = 1 + max([*self.extended_id_to_piece, self.raw_vocab_size - 1])
        self._pieces: list[str] | None = None
        self._pieces_special: list[str] | None = None
        self._special_re = re.compile(
            "(" + "|".join(map(re.escape, sorted(self.extended_piece_to_id, key=len, reverse=True))) + ")"
        )

    @staticmethod
    def from_config(config: Any) -> Tokenizer:
        return Tokenizer(config)

    def single_token(self, token_id: int) -> Tensor:
        return Tensor([[token_id]])

    def single_id(self, token: str) -> int | None:
        tid = self.extended_piece_to_id.get(token)
        return tid if tid is not None else self._hf.token_to_id(token)

    def _encode_text(self, text: str, special: bool) -> list[int]:
        self._hf.encode_special_tokens = not special  # False: special-token strings as text
        if not special or not self.extended_piece_to_id:
            return list(self._hf.encode(text, add_special_tokens=False).ids)
        ids: list[int] = []
        parts = self._special_re.split(text)
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(self.extended_piece_to_id[part])
            elif part:
                ids.extend(self._hf.encode(part, add_special_tokens=False).ids)
        return ids

    def encode(
        self,
        text: str | list[str],
        add_bos: bool = False,
        add_eos: bool = False,
        encode_special_tokens: bool = False,
        return_offsets: bool = False,
        embeddings: Any = None,
    ) -> Tensor:
        """A tensor of shape (1, n) for a string (lists of strings are not faked)."""
        assert isinstance(text, str), "the fake encodes one string at a time"
        ids = self._encode_text(text, encode_special_tokens)
        if add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        if add_eos and self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return Tensor([ids])

    def _decode(self, seq: list[int], decode_special_tokens: bool) -> str:
        vocab = self._hf.get_vocab_size()
        if not decode_special_tokens:
            seq = [t for t in seq if t != self.pad_token_id and t < vocab and t != self.eos_token_id]
            return str(self._hf.decode(seq))
        seq = [t for t in seq if t != self.pad_token_id and t < vocab]
        text, start = "", 0
        for end, t in enumerate(seq):
            if t in self.extended_id_to_piece:
                text += self._hf.decode(seq[start:end]) + self.extended_id_to_piece[t]
                start = end + 1
        return text + self._hf.decode(seq[start:])

    def decode(self, ids: Tensor | list[Tensor], decode_special_tokens: bool = False) -> str | list[str]:
        """A string for a 1-D tensor, a list of strings for (batch, n) or a list of tensors."""
        if isinstance(ids, list):
            return [self.decode(i, decode_special_tokens) for i in ids]  # type: ignore[misc]
        assert isinstance(ids, Tensor), "ids must be Tensor"
        if ids.dim() > 1:
            return [self._decode(row, decode_special_tokens) for row in ids.tolist()]
        return self._decode(ids.tolist(), decode_special_tokens)

    def get_id_to_piece_list(self, include_special_tokens: bool = False) -> list[str]:
        if self._pieces is None:
            self._pieces = [self._hf.decode([i]) for i in range(self._hf.get_vocab_size())]
        if not include_special_tokens:
            return self._pieces
        if self._pieces_special is None:
            self._pieces_special = list(self._pieces)
            for k, v in self.extended_id_to_piece.items():
                self._pieces_special[k] = v
        return self._pieces_special
