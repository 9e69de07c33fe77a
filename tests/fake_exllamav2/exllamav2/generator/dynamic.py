"""ExLlamaV2DynamicGenerator and ExLlamaV2DynamicJob: exllamav2's continuous-batching generator.

The job queue, page table, chunked prefill, stop conditions, filters and result dicts follow
exllamav2/generator/dynamic.py (0.3.x); the forward pass is the fake model's table. Filters as
there: ``receive_logits`` begins a job's filters before its first token and samples under them,
``receive_sample`` feeds each filter the sampled token (before any stop check) and queues the
filters that use the background worker, whose ``next()`` the generator then runs on its thread
pool while the next forward pass runs; a sampled end token ends the job (``eos_reason``
"end_filter"), after the stop-token and ``max_new_tokens`` checks.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from exllamav2 import _fake
from exllamav2._tensor import Tensor
from exllamav2.attn import assert_paged_attn
from exllamav2.cache import ExLlamaV2Cache_8bit
from exllamav2.generator.filters import ExLlamaV2Filter
from exllamav2.generator.sampler import ExLlamaV2Sampler

PAGED_PAGE_SIZE = 256
_serials = itertools.count()


def _randomhash() -> bytes:
    return next(_serials).to_bytes(16, byteorder="big")


def _page_hash(ids: list[int], prev_hash: bytes | None) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    if prev_hash is not None:
        h.update(prev_hash)
    h.update(repr(ids).encode())
    return h.digest()


def _partial_strings_match(q: str, strings: list[str]) -> int:
    """exllamav2's ext_c.partial_strings_match: for each string in turn, the index of a full match
    in ``q``, or -2 as soon as one overlaps ``q``'s end partially; -1 when nothing matches."""
    for s in strings:
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


class CachePage:
    def __init__(self, generator: ExLlamaV2DynamicGenerator, page_index: int) -> None:
        self.generator = generator
        self.page_index = page_index
        self.phash = _randomhash()
        self.prev_hash: bytes | None = None
        self.ref_count = 0
        self.access_serial = page_index
        self.kv_position = 0
        self.sequence: list[int] = []

    def add_ref(self, serial: int) -> None:
        g = self.generator
        if self.ref_count == 0:
            del g.unreferenced_pages[self.phash]
            g.referenced_pages[self.phash] = self
        self.ref_count += 1
        self.access_serial = max(serial, self.access_serial)

    def _take(self, serial: int, newhash: bytes) -> None:
        g = self.generator
        assert self.ref_count == 0
        del g.unreferenced_pages[self.phash]
        self.phash = newhash
        g.referenced_pages[newhash] = self
        self.ref_count = 1
        self.access_serial = serial
        self.prev_hash = None
        self.kv_position = 0
        self.sequence = []

    def add_ref_clear(self, serial: int, newhash: bytes) -> None:
        self._take(serial, newhash)

    def add_ref_unique(self, serial: int) -> None:
        self._take(serial, _randomhash())

    def sub_ref(self) -> None:
        g = self.generator
        self.ref_count -= 1
        if self.ref_count == 0:
            del g.referenced_pages[self.phash]
            if self.phash in g.unreferenced_pages:
                self.phash = _randomhash()
                self.prev_hash = None
            g.unreferenced_pages[self.phash] = self

    def clear(self) -> None:
        g = self.generator
        del g.unreferenced_pages[self.phash]
        self.phash = _randomhash()
        self.prev_hash = None
        self.kv_position = 0
        self.sequence = []
        g.unreferenced_pages[self.phash] = self

    def update_hash(self, newhash: bytes) -> None:
        g = self.generator
        del g.referenced_pages[self.phash]
        self.phash = newhash
        g.referenced_pages[newhash] = self


class ExLlamaV2DynamicGenerator:
    """Runs jobs in batches: ``enqueue(job)``, then ``iterate()`` until ``num_remaining_jobs()`` is 0.

    Fake only, for tests: ``fake_batch_sizes`` records how many jobs shared each forward pass,
    ``fake_finished`` every final (``eos``) result dict.
    """

    def __init__(
        self,
        model: Any,
        cache: Any,
        tokenizer: Any,
        max_batch_size: int | None = None,
        max_seq_len: int | None = None,
        max_chunk_size: int | None = None,
        max_q_size: int = 8,
        draft_model: Any = None,
        draft_cache: Any = None,
        num_draft_tokens: int = 4,
        use_ngram_draft: bool = False,
        max_ngram: int = 4,
        max_sampling_threads: int = 16,
        min_sampling_threads: int = 3,
        paged: bool = True,
        filter_background_eval: bool = True,
        **kwargs: Any,
    ) -> None:
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        cfg = model.config
        self.padded_vocab_size = ((cfg.vocab_size + 31) // 32) * 32
        self.draft_model = draft_model
        self.draft_cache = draft_cache
        self.current_loras: list[Any] = []
        if draft_model or use_ngram_draft:
            assert num_draft_tokens <= max_q_size, "num_draft_tokens cannot be larger than max_q_size."
            self.num_draft_tokens = num_draft_tokens
        else:
            self.num_draft_tokens = 0
        assert not use_ngram_draft, "the fake does not do n-gram drafts"
        if draft_model:
            assert draft_cache is not None, "Must supply cache for draft model"
            assert (
                draft_cache.max_seq_len == cache.max_seq_len and draft_cache.batch_size == cache.batch_size
            ), "Cache and draft cache must be same dimensions"
            assert draft_model.config.max_seq_len >= model.config.max_seq_len, (
                "Draft model seq len must be >= model seq len"
            )
        if paged:
            assert_paged_attn()
            assert not cfg.no_flash_attn, (
                "Paged mode requires flash-attn, but flash-attn is disabled in model config."
            )
        assert not isinstance(cache, ExLlamaV2Cache_8bit), (
            "Dynamic generator does not currently work with 8-bit cache. Use either FP16 or Q4."
        )
        if not max_batch_size:
            max_batch_size = cfg.max_input_len // max_q_size
        else:
            model_max_q = cfg.max_batch_size * cfg.max_input_len
            assert max_q_size * max_batch_size <= model_max_q, (
                f"Model has max_batch_size * max_input_len = {cfg.max_batch_size} * {cfg.max_input_len} "
                "tokens, "
                f"generator requires max_batch_size * max_q_size = {max_batch_size} * {max_q_size} tokens."
            )
        self.max_batch_size = max_batch_size
        if max_seq_len is not None:
            assert max_seq_len <= model.config.max_seq_len
            self.max_seq_len = max_seq_len
        else:
            self.max_seq_len = model.config.max_seq_len
        self.paged = paged
        self.page_size = PAGED_PAGE_SIZE if paged else cache.max_seq_len
        assert cache.batch_size == 1, (
            f"DynamicGenerator requires cache to have batch_size = 1, got {cache.batch_size}"
        )
        assert cache.max_seq_len % PAGED_PAGE_SIZE == 0, (
            f"cache.max_seq_len must be multiple of {PAGED_PAGE_SIZE}, received {cache.max_seq_len}"
        )
        self.max_pages = max(cache.max_seq_len // self.page_size, 1)
        self.max_total_tokens = cache.max_seq_len
        self.reset_page_table()
        if max_chunk_size is not None:
            assert max_chunk_size <= model.config.max_input_len, (
                f"max_chunk_size must be less than model max_input_len ({model.config.max_input_len}), "
                f"received {max_chunk_size}"
            )
            self.max_chunk_size = max_chunk_size
        else:
            self.max_chunk_size = model.config.max_input_len
        if paged:
            assert self.max_chunk_size % self.page_size == 0, (
                f"max_chunk_size must be multiple of {self.page_size}, received {max_chunk_size}"
            )
        # filters' next() overlaps the forward pass on this pool (filter_background_eval)
        self.filter_pool = ThreadPoolExecutor(max_workers=16) if filter_background_eval else None
        self.filter_queue: list[tuple[ExLlamaV2Filter, bool]] | None = [] if filter_background_eval else None
        self.job_serial = 0
        self.pending_jobs: list[ExLlamaV2DynamicJob] = []
        self.active_jobs: list[ExLlamaV2DynamicJob] = []
        self.fake_batch_sizes: list[int] = []
        self.fake_finished: list[dict[str, Any]] = []

    def reset_page_table(self) -> None:
        self.referenced_pages: dict[bytes, CachePage] = {}
        self.unreferenced_pages: dict[bytes, CachePage] = {}
        self.all_pages = [CachePage(self, i) for i in range(self.max_pages)]
        for page in self.all_pages:
            self.unreferenced_pages[page.phash] = page
        self.access_serial = self.max_pages

    def set_loras(self, loras: Any) -> None:
        """Enable LoRAs (a list, one, or None for none) for every job; the queue must be empty."""
        assert not self.num_remaining_jobs(), (
            "LoRAs cannot be updated while there are jobs in the generator queue."
        )
        if loras is None:
            self.current_loras = []
        elif isinstance(loras, list):
            self.current_loras = loras
        else:
            self.current_loras = [loras]

    def fake_lora_logits(self, ids: list[int]) -> Any:
        """Fake only: the model's toy logits plus each enabled LoRA's delta."""
        logits = self.model.fake_logits(ids)
        for lora in self.current_loras:
            logits = logits + lora.fake_delta(ids)
        return logits

    def num_remaining_jobs(self) -> int:
        return len(self.pending_jobs) + len(self.active_jobs)

    def clear_queue(self) -> None:
        for job in self.active_jobs + self.pending_jobs:
            job.deallocate_pages()
        self.active_jobs.clear()
        self.pending_jobs.clear()

    def enqueue(self, job: ExLlamaV2DynamicJob | list[ExLlamaV2DynamicJob]) -> int | list[int]:
        if isinstance(job, list):
            return [self.enqueue(j) for j in job]  # type: ignore[misc]
        job.prepare_for_queue(self, self.job_serial)
        self.job_serial += 1
        self.pending_jobs.append(job)
        job.time_enqueue = time.time()
        return job.serial_number  # type: ignore[return-value]

    def cancel(self, job: ExLlamaV2DynamicJob) -> None:
        if job in self.pending_jobs:
            self.pending_jobs.remove(job)
        elif job in self.active_jobs:
            job.deallocate_pages()
            self.active_jobs.remove(job)

    def iterate(self) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = []
        self.iterate_start_jobs(results)
        for job in self.active_jobs:
            job.prefill(results)
        self.iterate_gen(results)
        self.fake_finished.extend(r for r in results if r["eos"])
        return results

    def iterate_start_jobs(self, results: list[dict[str, Any]]) -> None:
        current = len(self.active_jobs)
        if not (self.unreferenced_pages and self.pending_jobs and current < self.max_batch_size):
            return
        skipped: list[ExLlamaV2DynamicJob] = []
        for job in self.pending_jobs.copy():
            if current + 1 > self.max_batch_size or job.current_new_pages_required() > len(
                self.unreferenced_pages
            ):
                skipped.append(job)
                continue
            if any(j.skips >= j.max_skips for j in skipped if j.max_skips is not None):
                return
            for j in skipped:
                j.skips += 1
            self.pending_jobs.remove(job)
            self.active_jobs.append(job)
            job.allocate_pages()
            current += 1
            r: dict[str, Any] = {"job": job, "stage": "started", "eos": False, "serial": job.serial_number}
            if job.identifier is not None:
                r["identifier"] = job.identifier
            results.append(r)

    def iterate_gen(self, results: list[dict[str, Any]]) -> None:
        batch = [job for job in self.active_jobs if job.is_prefill_done()]
        if not batch:
            return
        self.fake_batch_sizes.append(len(batch))
        _fake.step()
        # the forward pass is scheduled: run the queued filters' next() meanwhile
        if self.filter_queue:
            assert self.filter_pool is not None
            for f, p in self.filter_queue:
                if p:
                    f.background_prepare_logit_mask(self.filter_pool)
                else:
                    f.background_next(self.filter_pool)
            self.filter_queue.clear()
        completed = []
        for job in batch:
            if job.time_first_token is None:
                job.time_first_token = time.time()
            drafts = job.fake_draft(self.num_draft_tokens) if self.draft_model else []
            for i in range(len(drafts) + 1):
                eos, token = job.receive_sample(job.receive_logits(), results, i == 0)
                if eos:
                    completed.append(job)
                    break
                if i < len(drafts):
                    if token != drafts[i]:
                        job.rejected_draft_tokens += len(drafts) - i
                        break
                    job.accepted_draft_tokens += 1
        for job in completed:
            job.deallocate_pages()
            self.active_jobs.remove(job)


class _Sequence:
    def __init__(self, ids: list[int]) -> None:
        self.input_ids = list(ids)
        self.sequence_ids = list(ids)
        self.kv_position = 0
        self.page_hashes: list[bytes] = []
        self.new_unique_pages = 0
        self.allocated_pages: list[CachePage] | None = None
        self.prefill_complete = False


class ExLlamaV2DynamicJob:
    """One prompt to complete, with its sampling settings and stop conditions."""

    def __init__(
        self,
        input_ids: Any,
        max_new_tokens: int,
        min_new_tokens: int = 0,
        max_skips: int | None = 4,
        gen_settings: ExLlamaV2Sampler.Settings | None = None,
        seed: int | None = None,
        stop_conditions: list[Any] | tuple[Any, ...] | set[Any] | None = None,
        decode_special_tokens: bool = False,
        return_top_tokens: int = 0,
        return_logits: bool = False,
        return_probs: bool = False,
        filters: list[Any] | None = None,
        filter_prefer_eos: bool = False,
        token_healing: bool = False,
        identifier: object | None = None,
        banned_strings: list[str] | None = None,
        embeddings: list[Any] | None = None,
        **kwargs: Any,
    ) -> None:
        assert all(ids.device.type == "cpu" for ids in input_ids), "input_ids must reside in system memory"
        assert not (token_healing or banned_strings or embeddings or return_top_tokens), "not faked"
        self.generator: ExLlamaV2DynamicGenerator | None = None
        self.serial_number: int | None = None
        self.identifier = identifier
        self.max_skips = max_skips
        if not isinstance(input_ids, list):
            input_ids = [input_ids]
        assert len(input_ids) == 1, "the fake runs one sequence per job (no CFG)"
        ids = input_ids[0]
        assert ids.shape[-1] > 0, "Input IDs cannot be empty."
        assert ids.shape[0] == 1, "input_ids must be [1, seq_len] tensor or list of [1, seq_len] tensors"
        self.sequences = [_Sequence(ids[0].tolist())]
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = min_new_tokens
        self.new_tokens = 0
        self.gen_settings = gen_settings if gen_settings is not None else ExLlamaV2Sampler.Settings()
        self.rng = random.Random() if seed is None else random.Random(seed)
        self.decode_special_tokens = decode_special_tokens
        self.return_probs = return_probs
        self.stop_strings: set[str] = set()
        self.stop_tokens: set[int] = set()
        for t in stop_conditions or ():
            if isinstance(t, int):
                self.stop_tokens.add(t)
            elif isinstance(t, str):
                self.stop_strings.add(t)
            else:
                raise ValueError("Unsupported type in stop_conditions")
        self.filters: list[ExLlamaV2Filter] = filters if filters is not None else []
        self.filter_prefer_eos = filter_prefer_eos
        self.stop_tokens_list = list(self.stop_tokens)
        self.stop_strings_list = list(self.stop_strings)
        self.time_enqueue: float | None = None
        self.time_first_prefill: float | None = None
        self.time_first_token: float | None = None
        self.time_last_token: float | None = None
        self.accepted_draft_tokens = 0
        self.rejected_draft_tokens = 0
        self.cached_pages = 0
        self.cached_tokens = 0
        self.is_finished = False
        self.skips = 0

    def __repr__(self) -> str:
        return (
            "ExLlamaV2DynamicJob (new)"
            if self.serial_number is None
            else f"ExLlamaV2DynamicJob #{self.serial_number}"
        )

    @property
    def _gen(self) -> ExLlamaV2DynamicGenerator:
        assert self.generator is not None
        return self.generator

    # ---- queueing and pages ----

    def prepare_for_queue(self, generator: ExLlamaV2DynamicGenerator, serial_number: int) -> None:
        self.serial_number = serial_number
        self.generator = generator
        self.skips = 0
        ps = generator.page_size
        seq = self.sequences[0]
        max_len = len(seq.sequence_ids) + self.max_new_tokens
        context_pages = (len(seq.sequence_ids) - 1) // ps
        total_pages = (max_len + ps - 1) // ps
        r_hash = None
        seq.page_hashes = []
        for i in range(context_pages):
            r_hash = _page_hash(seq.sequence_ids[i * ps : (i + 1) * ps], r_hash)
            seq.page_hashes.append(r_hash)
        seq.new_unique_pages = total_pages - context_pages
        self.all_unique_hashes = list(dict.fromkeys(seq.page_hashes))
        total = len(self.all_unique_hashes) + seq.new_unique_pages
        assert total <= generator.max_pages, (
            f"Job requires {total} pages (only {generator.max_pages} available) and cannot "
            f"be enqueued. Total cache allocated is {generator.max_pages} * {ps} = "
            f"{generator.max_total_tokens} tokens"
        )
        self.held_text = ""
        self.held_tokens: list[int] = []
        self.held_probs: list[float] = []
        self.full_completion = ""

    def current_new_pages_required(self) -> int:
        new = sum(1 for h in self.all_unique_hashes if h not in self._gen.referenced_pages)
        return new + self.sequences[0].new_unique_pages

    def _oldest_free(self) -> CachePage:
        return min(self._gen.unreferenced_pages.values(), key=lambda p: p.access_serial)

    def allocate_pages(self) -> None:
        g, seq = self._gen, self.sequences[0]
        seq.allocated_pages = []
        for h in seq.page_hashes:
            g.access_serial += 1
            page = g.referenced_pages.get(h) or g.unreferenced_pages.get(h)
            if page is not None:
                page.add_ref(g.access_serial)
            else:
                page = self._oldest_free()
                page.add_ref_clear(g.access_serial, h)
            seq.allocated_pages.append(page)
        for _ in range(seq.new_unique_pages):
            g.access_serial += 1
            page = self._oldest_free()
            page.add_ref_unique(g.access_serial)
            seq.allocated_pages.append(page)
        for page in seq.allocated_pages:
            if page.kv_position != g.page_size:
                break
            seq.kv_position += g.page_size
            self.cached_pages += 1

    def deallocate_pages(self) -> None:
        for seq in self.sequences:
            for page in seq.allocated_pages or ():
                page.sub_ref()
            seq.allocated_pages = []

    # ---- prefill and sampling ----

    def is_prefill_done(self) -> bool:
        return all(seq.kv_position == len(seq.sequence_ids) - 1 for seq in self.sequences)

    def _write(self, seq: _Sequence, start: int, end: int) -> None:
        ps = self._gen.page_size
        assert seq.allocated_pages is not None
        for p in range(start // ps, (end - 1) // ps + 1):
            page = seq.allocated_pages[p]
            lo, hi = max(start, p * ps), min(end, (p + 1) * ps)
            page.sequence[lo - p * ps : hi - p * ps] = seq.sequence_ids[lo:hi]
            page.kv_position = max(page.kv_position, hi - p * ps)
            page.prev_hash = seq.allocated_pages[p - 1].phash if p else None

    def prefill(self, results: list[dict[str, Any]]) -> None:
        g = self._gen
        ps = g.page_size
        if self.time_first_prefill is None:
            self.time_first_prefill = time.time()
        seq = self.sequences[0]
        if seq.prefill_complete:
            return
        target = len(seq.sequence_ids) - 1
        assert seq.allocated_pages is not None
        if g.paged:  # pages another job filled meanwhile are reused, not evaluated again
            while seq.kv_position < target and seq.allocated_pages[seq.kv_position // ps].kv_position == ps:
                seq.kv_position += ps
                self.cached_pages += 1
            seq.kv_position = min(seq.kv_position, target)
            start = seq.kv_position
            end = min((start + g.max_chunk_size) // ps * ps, target)
        else:
            start = seq.kv_position
            end = min(start + g.max_chunk_size, target)
        if end > start:
            _fake.step()
            self._write(seq, start, end)
            seq.kv_position = end
            r: dict[str, Any] = {
                "job": self,
                "stage": "prefill",
                "eos": False,
                "curr_progress": seq.kv_position,
                "max_progress": target,
                "serial": self.serial_number,
            }
            if self.identifier is not None:
                r["identifier"] = self.identifier
            results.append(r)
        if seq.kv_position >= target:
            seq.prefill_complete = True

    def receive_logits(self) -> tuple[int, float, bool]:
        """The next token, its probability and whether it ends a filter: the model's logits
        sampled under the job's settings and filters (the filters begin before the first token)."""
        g, seq = self._gen, self.sequences[0]
        if self.new_tokens == 0:
            for f in self.filters:
                f.background_drop()
                f.begin("")
        blocked = self.stop_tokens_list if self.new_tokens < self.min_new_tokens else None
        token, _, _, prob, filter_eos = ExLlamaV2Sampler.sample(
            g.fake_lora_logits(seq.sequence_ids),
            self.gen_settings,
            seq.sequence_ids,
            self.rng.random(),
            g.tokenizer,
            blocked_tokens=blocked,
            filters=self.filters,
            filter_prefer_eos=self.filter_prefer_eos,
        )
        return int(token.item()), float(prob.item()), bool(filter_eos)

    def fake_draft(self, n: int) -> list[int]:
        ids = list(self.sequences[0].sequence_ids)
        for _ in range(n):
            ids.append(int(self._gen.draft_model.fake_logits(ids).argmax()))
        return ids[-n:]

    def receive_sample(
        self,
        sample: tuple[int, float, bool],
        results: list[dict[str, Any]],
        first_sample_in_sd_batch: bool = True,
    ) -> tuple[bool, int]:
        g, seq = self._gen, self.sequences[0]
        ps = g.page_size
        token, prob, filter_eos = sample
        # feed the filters (as a (1, 1) tensor, as exllamav2 does) and queue the background ones
        all_mask = True
        for f in self.filters:
            f.feed(Tensor([[token]]))
            if not f.can_mask_logits() or not f.use_background_worker():
                all_mask = False
        if first_sample_in_sd_batch and g.filter_queue is not None:
            for f in self.filters:
                if all_mask:
                    g.filter_queue.append((f, True))
                elif f.use_background_worker():
                    g.filter_queue.append((f, False))
        self.new_tokens += 1
        assert seq.allocated_pages is not None
        page_before = seq.kv_position // ps
        self._write(seq, seq.kv_position, seq.kv_position + 1)  # the step's input token enters the cache
        seq.sequence_ids.append(token)
        seq.kv_position += 1
        if seq.kv_position // ps > page_before:  # a page filled up: hash it so later prompts reuse it
            page = seq.allocated_pages[page_before]
            last_hash = seq.allocated_pages[page_before - 1].phash if page_before else None
            new_hash = _page_hash(seq.sequence_ids[page_before * ps : (page_before + 1) * ps], last_hash)
            if new_hash not in g.referenced_pages:
                if new_hash in g.unreferenced_pages:
                    g.unreferenced_pages[new_hash].clear()
                page.update_hash(new_hash)
            if page_before + 1 < len(seq.allocated_pages):
                seq.allocated_pages[page_before + 1].prev_hash = page.phash

        new_text = g.tokenizer.get_id_to_piece_list(self.decode_special_tokens)[token]
        self.held_text += new_text
        self.held_tokens.append(token)
        if self.return_probs:
            self.held_probs.append(prob)

        if token in self.stop_tokens:
            return self._emit(results, token, eos_reason="stop_token", stop_token=token)
        if self.new_tokens >= self.max_new_tokens - g.num_draft_tokens:
            return self._emit(results, token, emit_held=True, eos_reason="max_new_tokens")
        if filter_eos:
            return self._emit(results, token, emit_held=True, eos_reason="end_filter")
        if 1 <= self.held_text.count("\ufffd") < 5:
            test = g.tokenizer.decode(
                Tensor([self.held_tokens]), decode_special_tokens=self.decode_special_tokens
            )[0]
            if "\ufffd" not in test:
                self.held_text = test
            else:
                return self._emit(results, token)
        if self.stop_strings:
            match = _partial_strings_match(self.held_text, self.stop_strings_list)
            if match >= 0:
                held = self.held_text[match:]
                self.held_text = self.held_text[:match]
                for s in self.stop_strings:
                    if held.startswith(s):
                        return self._emit(
                            results,
                            token,
                            emit_held=True,
                            eos_reason="stop_string",
                            stop_string=s,
                            rem_held_text=held,
                        )
                raise AssertionError("Detected stop string but couldn't identify it (logic error)")
            if match == -2:
                return self._emit(results, token)
        return self._emit(results, token, emit_held=True)

    def _held(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.held_text:
            out["text"] = self.held_text
        if self.held_tokens:
            out["token_ids"] = Tensor([self.held_tokens])
        if self.held_probs:
            out["token_probs"] = Tensor([self.held_probs], "float32")
        return out

    def _emit(
        self,
        results: list[dict[str, Any]],
        token: int,
        *,
        emit_held: bool = False,
        eos_reason: str | None = None,
        stop_token: int | None = None,
        stop_string: str | None = None,
        rem_held_text: str | None = None,
    ) -> tuple[bool, int]:
        g = self._gen
        eos = eos_reason is not None
        r: dict[str, Any] = {"job": self, "stage": "streaming", "eos": eos, "serial": self.serial_number}
        if eos_reason is not None:
            r["eos_reason"] = eos_reason
            if eos_reason == "stop_token":
                assert stop_token is not None
                r["eos_triggering_token_id"] = stop_token
                r["eos_triggering_token_str"] = g.tokenizer.get_id_to_piece_list(True)[stop_token]
            if eos_reason == "stop_string":
                r["eos_triggering_string"] = stop_string
        if emit_held:
            held = self._held()
            if "text" in held:
                self.full_completion += self.held_text
            r.update(held)
            self.held_text = ""
            self.held_tokens = []
            self.held_probs = []
        if eos:
            self.is_finished = True
            self.time_last_token = time.time()
            assert self.time_first_prefill is not None and self.time_enqueue is not None
            assert self.time_first_token is not None
            r.update(
                {
                    "full_completion": self.full_completion,
                    "new_tokens": self.new_tokens,
                    "prompt_tokens": len(self.sequences[0].input_ids),
                    "time_enqueued": self.time_first_prefill - self.time_enqueue,
                    "time_prefill": self.time_first_token - self.time_first_prefill,
                    "time_generate": self.time_last_token - self.time_first_token,
                    "cached_pages": self.cached_pages,
                    "cached_tokens": self.cached_pages * g.page_size + self.cached_tokens,
                }
            )
            if g.draft_model:
                r["accepted_draft_tokens"] = self.accepted_draft_tokens
                r["rejected_draft_tokens"] = self.rejected_draft_tokens
            if eos_reason == "stop_string":
                self.held_text = rem_held_text or ""
            held = self._held()
            if held:
                r["held"] = held
        if self.identifier is not None:
            r["identifier"] = self.identifier
        results.append(r)
        return eos, token
