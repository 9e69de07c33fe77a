"""Job: one prompt to complete (exllamav3/generator/job.py, v1.6.5).

The constructor's arguments and assertions, ``max_new_tokens`` as exllamav3 1.6.5 counts it
(exactly: a job asked for n tokens streams n, ends there inside a draft window too; ``None`` or a
limit past the cache is capped at what the cache holds when the job is queued), the stop
conditions, the held text (partial stop strings, unfinished characters, re-decoded together
when the job ends), filters (fed each token, their masks applied; a completed one with
``eos_after_completed`` ends the job with ``end_filter``) and the streaming result dicts follow
the real one. Token healing, banned strings, embeddings, requeueing, loop detection, top tokens
and forced output (``constrain_output_now``) are not modelled (asserted off).
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np

from exllamav3 import _fake
from exllamav3._tensor import Tensor
from exllamav3.constants import PAGE_SIZE
from exllamav3.generator.pagetable import CachePage, tensor_hash_checksum
from exllamav3.generator.sampler import DefaultSampler


def partial_strings_match(q: str, strings: list[str]) -> int:
    """exllamav3's ext.partial_strings_match: for each string in turn, the index of a full match
    in ``q``, or -2 as soon as one overlaps ``q``'s end partially; -1 when nothing matches. Empty
    strings are dropped (1.6.5's _strings_to_utf32: an empty needle matches nothing)."""
    for s in (s for s in strings if s):
        for a0 in range(len(q)):
            a, b = a0, 0
            while q[a] == s[b]:
                a += 1
                b += 1
                if b == len(s):
                    return a0
                if a == len(q):
                    return -2
    return -1


class Job:
    def __init__(
        self,
        input_ids: Any,
        max_new_tokens: int | None = None,
        min_new_tokens: int = 0,
        max_skips: int | None = 4,
        sampler: Any = None,
        seed: int | None = None,
        stop_conditions: list[Any] | tuple[Any, ...] | set[Any] | None = None,
        decode_special_tokens: bool = False,
        return_top_tokens: int = 0,
        return_logits: bool = False,
        return_probs: bool = False,
        filters: list[Any] | None = None,
        token_healing: bool = False,
        identifier: object | None = None,
        banned_strings: list[str] | None = None,
        embeddings: list[Any] | None = None,
        max_rq_tokens: int | None = None,
        stop_on_loop: tuple[int, int] | None = None,
        rq_state: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        assert all(ids.device.type == "cpu" for ids in input_ids), "input_ids must reside in system memory"
        if not isinstance(input_ids, list):
            input_ids = [input_ids]
        assert not (token_healing or banned_strings or embeddings or stop_on_loop), (
            "the fake does not model token healing, banned strings, embeddings or loop detection"
        )
        assert max_rq_tokens is None and rq_state is None, "the fake does not model requeueing"
        assert not return_top_tokens, "the fake does not model top tokens"
        for ids in input_ids:
            assert ids.shape[-1] > 0, "Input IDs cannot be empty."
            assert ids.shape[0] == 1, "input_ids must be [1, seq_len] tensor or list of [1, seq_len] tensors"
        assert len(input_ids) == 1, "A job holds exactly one sequence (multi-sequence jobs are not supported)"
        ids = input_ids[0]
        self.input_ids: list[int] = [int(t) for t in ids[0].tolist()]
        self.sequence_ids: list[int] = list(self.input_ids)
        self.generator: Any = None
        self.pagetable: Any = None
        self.serial_number: int | None = None
        self.identifier = identifier
        self.max_skips = max_skips
        self.skips = 0
        self.sampler = sampler if sampler is not None else DefaultSampler()
        self.seed = seed
        self.rng = random.Random() if seed is None else random.Random(seed)
        assert max_new_tokens is None or max_new_tokens >= 1, (
            "max_new_tokens must be >= 1, or None for no limit"
        )
        # None: no limit beyond what the cache can hold; resolved against the generator in prepare_for_queue
        self.max_new_tokens: int | None = max_new_tokens
        self.min_new_tokens = min_new_tokens
        self.new_tokens = 0
        self.decode_special_tokens = decode_special_tokens
        self.return_probs = return_probs
        self.return_logits = return_logits
        self.stop_strings: set[str] = set()
        self.stop_tokens: set[int] = set()
        if stop_conditions is not None:
            if isinstance(stop_conditions, (str, int)):
                stop_conditions = [stop_conditions]
            for t in stop_conditions:
                if isinstance(t, int):
                    self.stop_tokens.add(t)
                elif isinstance(t, str):
                    self.stop_strings.add(t)
                else:
                    raise ValueError("Unsupported type in stop_conditions")
        self.stop_strings_list = list(self.stop_strings)
        self.stop_string_max_length = max([0] + [len(x) for x in self.stop_strings_list])
        self.held_text = ""
        self.held_tokens: list[int] = []
        self.held_probs: list[float] = []
        self.held_logits: list[Any] = []
        self.last_logits: Any = None
        self.full_completion = ""
        self.time_enqueue: float | None = None
        self.time_first_prefill: float | None = None
        self.time_first_token: float | None = None
        self.time_last_token: float | None = None
        self.time_enqueued = self.time_prefill = self.time_generate = 0.0
        self.accepted_draft_tokens = 0
        self.rejected_draft_tokens = 0
        self.cached_pages = 0
        self.cached_tokens = 0
        self.is_finished = False
        self.kv_position = 0
        self.page_hashes: list[bytes] = []
        self.new_unique_pages = 0
        self.allocated_pages: list[CachePage] = []
        self.prefill_complete = False
        self.filters: list[Any] = filters if filters is not None else []

    def __repr__(self) -> str:
        return f"Job #{self.serial_number}"

    # ---- queueing and pages ----

    def prepare_for_queue(self, generator: Any, serial_number: int, rq: bool = False) -> None:
        self.serial_number = serial_number
        self.generator = generator
        self.pagetable = generator.pagetable
        self.skips = 0
        # the cache bounds the response: no limit means what the cache holds past the prompt (and
        # the draft window), and a larger limit is capped to it (a prompt with no room keeps its
        # limit and fails the page check below)
        room = generator.max_total_tokens - len(self.input_ids) - 1 - generator.max_draft_tokens
        if self.max_new_tokens is None:
            self.max_new_tokens = max(1, room)
        elif room >= 1:
            self.max_new_tokens = min(self.max_new_tokens, room)
        # the default budget: the whole response plus one speculative window past the limit
        self.max_rq_tokens = self.max_new_tokens + 1 + generator.max_draft_tokens
        # hash the full pages of the prompt (all but its last token, which the first step reads)
        context = len(self.input_ids) - 1
        prev = None
        for p in range(context // PAGE_SIZE):
            prev = tensor_hash_checksum(self.input_ids[p * PAGE_SIZE : (p + 1) * PAGE_SIZE], prev)
            self.page_hashes.append(prev)
        total_pages = -(-(len(self.input_ids) + self.max_rq_tokens) // PAGE_SIZE)
        self.new_unique_pages = total_pages - len(self.page_hashes)
        max_pages = self.pagetable.max_pages
        assert total_pages <= max_pages, (
            f"Job requires {total_pages} pages (only {max_pages} available) and cannot "
            + f"be enqueued. Total cache allocated is {max_pages} * {PAGE_SIZE} = "
            + f"{self.generator.max_total_tokens} tokens"
        )
        self.time_enqueue = time.time()

    def current_new_pages_required(self) -> int:
        pt = self.pagetable
        return sum(1 for h in self.page_hashes if h not in pt.referenced_pages) + self.new_unique_pages

    def allocate_pages(self) -> None:
        pt = self.pagetable
        pt.access_serial += 1
        serial = pt.access_serial
        reusing = True
        for h in self.page_hashes:
            page = pt.referenced_pages.get(h) or pt.unreferenced_pages.get(h)
            if page is not None and reusing and page.kv_position == PAGE_SIZE:
                page.add_ref(serial)
                self.cached_pages += 1
            else:
                reusing = False
                page = self._oldest_free()
                page.add_ref_unique(serial)
                if h not in pt.referenced_pages:  # the same prompt still prefilling: keep it unique
                    page.update_hash(h)
            self.allocated_pages.append(page)
        for _ in range(self.new_unique_pages):
            page = self._oldest_free()
            page.add_ref_unique(serial)
            self.allocated_pages.append(page)
        self.kv_position = self.cached_pages * PAGE_SIZE

    def _oldest_free(self) -> CachePage:
        pt = self.pagetable
        return min(pt.unreferenced_pages.values(), key=lambda p: p.access_serial)

    def deallocate_pages(self) -> None:
        for page in self.allocated_pages:
            page.sub_ref()
        self.allocated_pages = []

    def _advance(self, n: int) -> None:
        """Write ``n`` more positions of the KV cache."""
        for _ in range(n):
            page = self.allocated_pages[self.kv_position // PAGE_SIZE]
            page.kv_position = self.kv_position % PAGE_SIZE + 1
            self.kv_position += 1

    # ---- prefill and sampling ----

    def is_prefill_done(self) -> bool:
        return self.kv_position == len(self.sequence_ids) - 1

    def prefill(self, results: list[dict[str, Any]], chunk_size: int | None = None) -> None:
        """One chunk of the prompt: up to ``max_chunk_size`` tokens ending on a page boundary (or
        the prompt's last token but one), ``chunk_size`` when given (prompt ingestion alongside
        generating jobs); a progress result only when it did something."""
        if self.time_first_prefill is None:
            self.time_first_prefill = time.time()
        if self.prefill_complete:
            return
        end = len(self.input_ids) - 1
        start = self.kv_position
        stop = min((start + self.generator.max_chunk_size) // PAGE_SIZE * PAGE_SIZE, end)
        if chunk_size is not None:
            stop = min(stop, (start + chunk_size) // PAGE_SIZE * PAGE_SIZE)
        if stop > start:
            _fake.prefill_step()  # the forward pass, which may fail (FAIL_NEXT_PREFILL)
            self._advance(stop - start)
        if self.kv_position >= end:
            self.prefill_complete = True
        if stop <= start:
            return
        r: dict[str, Any] = {
            "job": self,
            "stage": "prefill",
            "eos": False,
            "curr_progress": self.kv_position,
            "max_progress": end,
            "serial": self.serial_number,
        }
        if self.identifier is not None:
            r["identifier"] = self.identifier
        results.append(r)

    def activate(self) -> None:
        """Mark the job active: its filters attached and reset (active unless they wait for a
        trigger token)."""
        for f in self.filters:
            f.attach(self)
            f.reset()
            f.is_active = f.trigger_token is None

    def fake_mark_first_token(self) -> None:
        if self.time_first_token is None:
            self.time_first_token = time.time()

    def fake_sample(self) -> int:
        logits = np.array(self.generator.model.fake_logits(self.sequence_ids), dtype=np.float64)
        self.last_logits = logits.copy()  # what return_logits hands back: before the sampler
        if self.new_tokens < self.min_new_tokens:
            for t in self.stop_tokens:
                logits[t] = -np.inf
        for f in self.filters:  # each active filter's packed bitmask: bit clear = masked out
            if f.is_active:
                bits = np.unpackbits(f.get_next_logit_mask().view(np.uint8), bitorder="little")
                allowed = np.zeros(len(logits), dtype=bool)
                n = min(len(bits), len(logits))
                allowed[:n] = bits[:n].astype(bool)
                logits = np.where(allowed, logits, -np.inf)
        return self.sampler.fake_sample(
            logits, self.sequence_ids, self.rng, self.generator.tokenizer.actual_vocab_size
        )

    def fake_draft(self, n: int) -> list[int]:
        draft = self.generator.draft_model
        seq = list(self.sequence_ids)
        out = []
        for _ in range(n):
            t = int(np.argmax(draft.fake_logits(seq)))
            out.append(t)
            seq.append(t)
        return out

    def receive_sample(self, next_token: int, results: list[dict[str, Any]]) -> tuple[bool, int]:
        filter_eos_condition = False
        for f in self.filters:
            filter_eos_condition |= f.feed(next_token)
        self.new_tokens += 1
        self._advance(1)
        self.sequence_ids.append(next_token)
        if self.kv_position % PAGE_SIZE == 0:  # a page filled up: hash it for later reuse
            i = self.kv_position // PAGE_SIZE - 1
            prev = self.allocated_pages[i - 1].phash if i else None
            page = self.allocated_pages[i]
            h = tensor_hash_checksum(self.sequence_ids[i * PAGE_SIZE : (i + 1) * PAGE_SIZE], prev)
            if page.ref_count == 1 and h not in self.pagetable.referenced_pages:
                page.update_hash(h)

        def emit(
            emit_eos: bool = False,
            eos_reason: str | None = None,
            emit_held: bool = False,
            stop_token: int | None = None,
            stop_string: str | None = None,
            rem_held_text: str | None = None,
        ) -> tuple[bool, int]:
            r: dict[str, Any] = {
                "job": self,
                "stage": "streaming",
                "eos": emit_eos,
                "serial": self.serial_number,
            }
            if eos_reason is not None:
                r["eos_reason"] = eos_reason
                if eos_reason == "stop_token":
                    pieces = self.generator.tokenizer.get_id_to_piece_list(True)
                    r["eos_triggering_token_id"] = stop_token
                    r["eos_triggering_token_str"] = pieces[stop_token]  # type: ignore[index]
                if eos_reason == "stop_string":
                    r["eos_triggering_string"] = stop_string
            if emit_held:
                if emit_eos and "\ufffd" in self.held_text and self.held_tokens:
                    # the job ends with pieces still held: characters split across them are
                    # repaired by decoding them together
                    self.held_text = self.generator.tokenizer.decode(
                        Tensor([self.held_tokens]), decode_special_tokens=self.decode_special_tokens
                    )[0]
                if self.held_text != "":
                    self.full_completion += self.held_text
                    r["text"] = self.held_text
                    self.held_text = ""
                if self.held_tokens:
                    r["token_ids"] = Tensor([self.held_tokens])
                    self.held_tokens = []
                if self.held_probs:
                    r["token_probs"] = Tensor([self.held_probs], np.float32)
                    self.held_probs = []
                if self.held_logits:
                    r["logits"] = Tensor([self.held_logits], np.float32)
                    self.held_logits = []
            if emit_eos:
                self.time_last_token = time.time()
                self.time_enqueued += self.time_first_prefill - self.time_enqueue  # type: ignore[operator]
                self.time_prefill += self.time_first_token - self.time_first_prefill  # type: ignore[operator]
                self.time_generate += self.time_last_token - self.time_first_token  # type: ignore[operator]
                self.is_finished = True
                r.update(
                    {
                        "full_completion": self.full_completion,
                        "new_tokens": self.new_tokens,
                        "prompt_tokens": len(self.input_ids),
                        "time_enqueued": self.time_enqueued,
                        "time_prefill": self.time_prefill,
                        "time_generate": self.time_generate,
                        "cached_pages": self.cached_pages,
                        "cached_tokens": self.cached_pages * PAGE_SIZE + self.cached_tokens,
                    }
                )
                if self.generator.draft_model or self.generator.ngram_match_min:
                    r["accepted_draft_tokens"] = self.accepted_draft_tokens
                    r["rejected_draft_tokens"] = self.rejected_draft_tokens
                if eos_reason == "stop_string":
                    self.held_text = rem_held_text or ""
                rh: dict[str, Any] = {}
                if self.held_text:
                    rh["text"] = self.held_text
                if self.held_tokens:
                    rh["token_ids"] = Tensor([self.held_tokens])
                if self.held_probs:
                    rh["token_probs"] = Tensor([self.held_probs], np.float32)
                if self.held_logits:
                    rh["logits"] = Tensor([self.held_logits], np.float32)
                if rh:
                    r["held"] = rh
            if self.identifier is not None:
                r["identifier"] = self.identifier
            results.append(r)
            return emit_eos, next_token

        tok = self.generator.tokenizer
        new_text = tok.get_id_to_piece_list(self.decode_special_tokens)[next_token]
        self.held_text += new_text
        self.held_tokens.append(next_token)
        if self.return_probs:
            self.held_probs.append(1.0)  # the fake's probabilities are not modelled
        if self.return_logits:  # padded to a multiple of 32, as exllamav3's are
            row = np.full(self.generator.padded_vocab_size, -np.inf, dtype=np.float32)
            row[: len(self.last_logits)] = self.last_logits
            self.held_logits.append(row)

        if next_token in self.stop_tokens:
            return emit(emit_eos=True, eos_reason="stop_token", stop_token=next_token)
        # exact, also inside a draft window (the generator drops the window's remaining drafts)
        if self.new_tokens >= self.max_new_tokens:  # type: ignore[operator]
            return emit(emit_eos=True, emit_held=True, eos_reason="max_new_tokens")
        if filter_eos_condition:
            return emit(emit_eos=True, emit_held=True, eos_reason="end_filter")
        if "\ufffd" in self.held_text:
            test = tok.decode(Tensor([self.held_tokens]), decode_special_tokens=self.decode_special_tokens)[0]
            if test.endswith("\ufffd") and len(test) <= self.stop_string_max_length + 20:
                return emit()
            self.held_text = test
        if self.stop_strings_list:
            match = partial_strings_match(self.held_text, self.stop_strings_list)
            if match >= 0:
                held = self.held_text[match:]
                self.held_text = self.held_text[:match]
                for s in self.stop_strings:
                    if held.startswith(s):
                        return emit(
                            emit_eos=True,
                            emit_held=True,
                            eos_reason="stop_string",
                            stop_string=s,
                            rem_held_text=held,
                        )
                raise AssertionError("Detected stop string but couldn't identify it (logic error)")
            if match == -2:
                return emit()
        return emit(emit_held=True)
