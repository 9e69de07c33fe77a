"""PageTable and CachePage (exllamav3/generator/pagetable.py, v1.6.5), less defragmentation, the
tree eviction order (the fake takes the least recently used free page) and the CPU and disk
tiers: 256-token pages with reference counts and content hashes, so that full pages of a
finished prompt are found again by a later job with the same prefix."""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

from exllamav3.constants import PAGE_SIZE

_serials = itertools.count()


def _randomhash() -> bytes:
    return b"r" + next(_serials).to_bytes(15, byteorder="big")


def tensor_hash_checksum(ids: list[int], prev_hash: bytes | None) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    if prev_hash is not None:
        h.update(prev_hash)
    h.update(repr(ids).encode())
    return h.digest()


class CachePage:
    def __init__(self, pagetable: PageTable, page_index: int) -> None:
        self.pagetable = pagetable
        self.page_index = page_index
        self.phash = _randomhash()
        self.prev_hash: bytes | None = None
        self.ref_count = 0
        self.access_serial = page_index
        self.kv_position = 0

    def add_ref(self, serial: int) -> None:
        pt = self.pagetable
        if self.ref_count == 0:
            del pt.unreferenced_pages[self.phash]
            pt.referenced_pages[self.phash] = self
        self.ref_count += 1
        self.access_serial = max(serial, self.access_serial)

    def add_ref_unique(self, serial: int) -> None:
        pt = self.pagetable
        assert self.ref_count == 0
        del pt.unreferenced_pages[self.phash]
        self.phash = _randomhash()
        pt.referenced_pages[self.phash] = self
        self.ref_count = 1
        self.access_serial = serial
        self.prev_hash = None
        self.kv_position = 0

    def sub_ref(self) -> None:
        pt = self.pagetable
        self.ref_count -= 1
        if self.ref_count == 0:
            del pt.referenced_pages[self.phash]
            if self.phash in pt.unreferenced_pages or self.kv_position < PAGE_SIZE:
                self.phash = _randomhash()  # a partial page is never found again
                self.prev_hash = None
            pt.unreferenced_pages[self.phash] = self

    def update_hash(self, newhash: bytes) -> None:
        pt = self.pagetable
        del pt.referenced_pages[self.phash]
        stale = pt.unreferenced_pages.pop(newhash, None)
        if stale is not None:  # an unreferenced page with the same content: forget it
            stale.phash = _randomhash()
            pt.unreferenced_pages[stale.phash] = stale
        self.phash = newhash
        pt.referenced_pages[newhash] = self


class PageTable:
    def __init__(self, generator: Any, cache: Any) -> None:
        self.generator = generator
        self.cache = cache
        self.max_pages = cache.max_num_tokens // PAGE_SIZE
        self.access_serial = self.max_pages
        self.reset_page_table()

    def reset_page_table(self) -> None:
        self.referenced_pages: dict[bytes, CachePage] = {}
        self.unreferenced_pages: dict[bytes, CachePage] = {}
        self.all_pages = [CachePage(self, i) for i in range(self.max_pages)]
        for page in self.all_pages:
            self.unreferenced_pages[page.phash] = page

    def num_unreferenced_pages(self) -> int:
        return len(self.unreferenced_pages)

    def defrag(self) -> None:
        """Not modelled (page order does not matter to the fake)."""
