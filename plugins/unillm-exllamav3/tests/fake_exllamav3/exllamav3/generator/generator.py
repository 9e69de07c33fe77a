"""Generator: exllamav3's continuous-batching generator (exllamav3/generator/generator.py, v1.4.1).

The constructor's arguments and assertions, the job queues, ``enqueue``/``cancel``/``clear_queue``,
``num_remaining_jobs`` and ``iterate()`` with its result dicts follow the real one; the forward
pass is the fake model's table, one token per job per step (one per draft token more with a
draft model, accepted while the draft model agrees).
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
        max_q_size: int = 8,
        draft_model: Any = None,
        draft_cache: Any = None,
        num_draft_tokens: int | None = None,
        show_visualizer: bool = False,
        enable_defrag: bool = True,
        cpu_cache_size: int = 0,
        recurrent_cache_size: int = 4 * 1024**3,
        recurrent_checkpoint_interval: int | None = None,
        recurrent_checkpoint_interval_pp: int = 32768,
        ngram_match_min: int = 0,
        dynamic_draft_tokens: bool = False,
        **kwargs: Any,
    ) -> None:
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        cfg = model.config
        self.padded_vocab_size = ((cfg.vocab_size + 31) // 32) * 32
        self.pagetable = PageTable(self, cache)
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
        self.max_batch_size = max_batch_size
        self.max_chunk_size = max_chunk_size
        self.job_serial = 0
        self.pending_jobs: list[Job] = []
        self.active_jobs: list[Job] = []
        self.recurrent_cache = None
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
        for job in self.active_jobs + self.pending_jobs:
            job.deallocate_pages()
        self.active_jobs.clear()
        self.pending_jobs.clear()

    def enqueue(self, job: Job | list[Job]) -> int | list[int]:
        if isinstance(job, list):
            return [self.enqueue(j) for j in job]  # type: ignore[misc]
        job.prepare_for_queue(self, self.job_serial)
        self.job_serial += 1
        self.pending_jobs.append(job)
        return job.serial_number  # type: ignore[return-value]

    def cancel(self, job: Job) -> None:
        """Cancel a single pending or active job (an active one frees its pages)."""
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
