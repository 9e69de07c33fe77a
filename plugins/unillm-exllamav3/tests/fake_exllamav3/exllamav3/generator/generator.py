"""Generator: exllamav3's continuous-batching generator (exllamav3/generator/generator.py, v1.6.5).

The constructor's arguments and assertions, the job queues, ``enqueue``/``cancel``/``clear_queue``,
``num_remaining_jobs``, ``close`` and ``iterate()`` with its result dicts follow the real one:
its assertion that the cache was allocated (created before ``model.load()``) and is still owned
by this generator, prompt ingestion alongside generating jobs (one prompting job per pass, with
``shared_chunk_size`` and ``prefill_cooldown``), and a job whose prompt fails contained to that
job (an ``error`` result, the others carry on; a failing generation step still raises). The
forward pass is the fake model's table, one token per job per step (one per draft token more with
a draft model, accepted while the draft model agrees).
"""

from __future__ import annotations

from typing import Any

from exllamav3 import _fake
from exllamav3.constants import PAGE_SIZE
from exllamav3.generator.job import Job
from exllamav3.generator.pagetable import PageTable


class Generator:
    """Fake only, for tests: ``fake_batch_sizes`` records how many jobs shared each forward
    pass, ``fake_finished`` every final (``eos``) result dict."""

    def __init__(
        self,
        model: Any,
        cache: Any,
        tokenizer: Any,
        max_batch_size: int = 256,
        max_chunk_size: int = 2048,
        shared_chunk_size: int | None = None,
        prefill_cooldown: int | None = 4,
        max_q_size: int = 8,
        draft_model: Any = None,
        draft_cache: Any = None,
        num_draft_tokens: int | None = None,
        show_visualizer: bool = False,
        enable_defrag: bool = True,
        cpu_cache_size: int = 0,
        disk_cache_dir: str | None = None,
        disk_cache_size: int = 50 * 1024**3,
        disk_cache_flush_on_idle: bool = True,
        disk_cache_checkpoint_interval: int = 4096,
        disk_cache_write_interval: float = 2.0,
        recurrent_cache_size: int = 4 * 1024**3,
        recurrent_checkpoint_interval: int | None = None,
        recurrent_checkpoint_interval_pp: int = 32768,
        ngram_match_min: int = 0,
        dynamic_draft_tokens: bool = False,
        draft_confidence: float = 0.4,
        record_draft_stats: bool = False,
        ngram_corpus: str | None = None,
        hybrid_draft_tokens: int = 0,
        draft_max_rows: int = 0,
        sparse_draft_head: int = 0,
        **kwargs: Any,
    ) -> None:
        assert not (cpu_cache_size or disk_cache_dir), "the fake does not model the CPU and disk page tiers"
        assert not (hybrid_draft_tokens or ngram_corpus), "the fake does not model n-gram drafts"
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        cfg = model.config
        self.padded_vocab_size = ((cfg.vocab_size + 31) // 32) * 32
        self.pagetable = PageTable(self, cache)
        # a cache has one owning generator: a newer one over the same cache supersedes this one
        cache.owner_serial = getattr(cache, "owner_serial", 0) + 1
        self.cache_owner_serial = cache.owner_serial
        self.max_total_tokens = PAGE_SIZE * self.pagetable.max_pages
        self.draft_model = draft_model
        self.draft_cache = draft_cache
        if draft_model:
            assert not ngram_match_min, "Cannot use both draft model and n-gram draft."
            assert draft_cache is not None, "Must supply cache for draft model"
            assert draft_cache.max_num_tokens == cache.max_num_tokens, (
                "Cache and draft cache must be same size"
            )
            self.num_draft_tokens = num_draft_tokens or draft_model.caps.get("default_draft_size", 4)
        elif ngram_match_min:
            raise AssertionError("the fake does not model n-gram drafts")
        else:
            self.num_draft_tokens = 0
        self.ngram_match_min = ngram_match_min
        # the widest verification pass any round can take
        self.hybrid_draft_tokens = 0
        self.max_draft_tokens = max(self.num_draft_tokens, self.hybrid_draft_tokens)
        self.max_batch_size = max_batch_size
        self.max_chunk_size = max_chunk_size
        if shared_chunk_size is None:
            shared_chunk_size = (max_chunk_size // 2 + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE
        assert 0 < shared_chunk_size <= max_chunk_size and shared_chunk_size % PAGE_SIZE == 0, (
            "shared_chunk_size must be a multiple of the page size (256) and no larger than max_chunk_size"
        )
        if prefill_cooldown is None:
            prefill_cooldown = 4
        assert prefill_cooldown >= 0, "prefill_cooldown must not be negative"
        self.shared_chunk_size = shared_chunk_size
        self.prefill_cooldown = prefill_cooldown
        self.prefill_cooldown_left = 0
        self.prefill_rotation = 0
        self.job_serial = 0
        self.pending_jobs: list[Job] = []
        self.active_jobs: list[Job] = []
        self.recurrent_cache = None
        self.fake_closed = False
        self.fake_batch_sizes: list[int] = []
        self.fake_finished: list[dict[str, Any]] = []

    def num_remaining_jobs(self) -> int:
        return len(self.pending_jobs) + len(self.active_jobs)

    def num_active_jobs(self) -> int:
        return len(self.active_jobs)

    def num_pending_jobs(self) -> int:
        return len(self.pending_jobs)

    def clear_queue(self) -> None:
        """Abort all active and pending jobs."""
        num_jobs = self.num_remaining_jobs()
        for job in self.active_jobs + self.pending_jobs:
            job.deallocate_pages()
        self.active_jobs.clear()
        self.pending_jobs.clear()
        if num_jobs and not self.num_remaining_jobs():
            self.on_queue_drained()

    def on_queue_drained(self) -> None:
        """Idle-transition housekeeping (the real one defragments the page table): nothing to do."""
        self.pagetable.defrag()

    def close(self) -> None:
        """Release what a retired generator holds (the real one: recurrent and CPU-tier caches,
        pinned buffers, the filter pool); it is not reusable afterwards. Safe to call twice."""
        self.fake_closed = True

    def enqueue(self, job: Job | list[Job]) -> int | list[int]:
        if isinstance(job, list):
            return [self.enqueue(j) for j in job]  # type: ignore[misc]
        job.prepare_for_queue(self, self.job_serial)
        self.job_serial += 1
        self.pending_jobs.append(job)
        return job.serial_number  # type: ignore[return-value]

    def cancel(self, job: Job) -> None:
        """Cancel a single pending or active job (an active one frees its pages)."""
        num_jobs = self.num_remaining_jobs()
        if job in self.pending_jobs:
            self.pending_jobs.remove(job)
        elif job in self.active_jobs:
            job.deallocate_pages()
            self.active_jobs.remove(job)
        if num_jobs and not self.num_remaining_jobs():
            self.on_queue_drained()

    def iterate(self) -> list[dict[str, Any]]:
        assert self.cache.initialized, (
            "Cache tensors were never allocated. Construct the Cache BEFORE calling model.load()"
        )
        owner = getattr(self.cache, "owner_serial", None)
        if owner is not None and owner != self.cache_owner_serial:
            self.pending_jobs.clear()
            self.active_jobs.clear()
            raise RuntimeError(
                "This Generator no longer owns its Cache: a newer Generator was created over the same "
                "Cache. Close or discard the old Generator before creating a new one."
            )
        assert self.fake_closed is False, "the fake: this generator was closed"
        results: list[dict[str, Any]] = []
        self.iterate_start_jobs(results)
        # while a job generates, at most one job with prompt left runs a chunk per iteration, of
        # shared_chunk_size, once prefill_cooldown iterations have passed since the last one
        prefilling = [job for job in self.active_jobs if not job.is_prefill_done()]
        chunk_size = None
        deferred: list[Job] = []
        if (
            prefilling
            and len(prefilling) < len(self.active_jobs)
            and (self.shared_chunk_size < self.max_chunk_size or self.prefill_cooldown > 0)
        ):
            if self.shared_chunk_size < self.max_chunk_size:
                chunk_size = self.shared_chunk_size
            if self.prefill_cooldown_left > 0:
                self.prefill_cooldown_left -= 1
                deferred = prefilling
            else:
                self.prefill_cooldown_left = self.prefill_cooldown
                selected = prefilling[self.prefill_rotation % len(prefilling)]
                self.prefill_rotation += 1
                deferred = [job for job in prefilling if job is not selected]
        else:
            self.prefill_cooldown_left = 0
        for job in list(self.active_jobs):
            if any(job is d for d in deferred):
                continue
            try:
                job.prefill(results, chunk_size)
            except Exception as e:
                self.reap_failed_job(job, e, results)
        self.iterate_gen(results)
        self.fake_finished.extend(r for r in results if r["eos"])
        return results

    def reap_failed_job(self, job: Job, error: BaseException, results: list[dict[str, Any]]) -> None:
        """A job that failed alone: its pages freed, out of the active set, and an error result."""
        job.deallocate_pages()
        if job in self.active_jobs:
            self.active_jobs.remove(job)
        results.append(
            {"job": job, "serial": job.serial_number, "stage": "error", "eos": True, "error": error}
        )

    def iterate_start_jobs(self, results: list[dict[str, Any]]) -> None:
        current = len(self.active_jobs)
        skipped: list[Job] = []
        for job in self.pending_jobs.copy():
            if current + 1 > self.max_batch_size or job.current_new_pages_required() > len(
                self.pagetable.unreferenced_pages
            ):
                skipped.append(job)
                continue
            if any(j.skips >= j.max_skips for j in skipped if j.max_skips is not None):
                return
            for j in skipped:
                j.skips += 1
            self.pending_jobs.remove(job)
            self.active_jobs.append(job)
            job.activate()
            try:
                job.allocate_pages()
            except Exception as e:
                self.reap_failed_job(job, e, results)
                continue
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
        completed = []
        for job in batch:
            job.fake_mark_first_token()
            drafts = job.fake_draft(self.num_draft_tokens) if self.draft_model else []
            for i in range(len(drafts) + 1):
                eos, token = job.receive_sample(job.fake_sample(), results)
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
