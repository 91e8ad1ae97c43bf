"""The KV page pool: reference-counted pages, and the prefix cache over them. Host only.

Page 0 is scratch, never handed out. A page's reference count is the number of requests whose block
tables name it. A full page whose contents are known is published under its content key; when its
last holder lets it go it stays cached, idle, until a fresh page is needed and none is free: the
idle page used least recently is then evicted.

A page's key is its tokens and the one after, chained to the previous page's key: the drafter's KV
at position t is computed from the target's capture at t and the token at t + 1, so keyed so, a
cached page's target and drafter KV are exactly what a prefill of the same tokens writes.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

from eagle3_jax.config import SCRATCH_PAGE

ROOT_KEY = b""  # the parent key of a sequence's first page


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a page whose tokens and the token after it are `tokens`, after the page `parent`."""
    return hashlib.blake2b(parent + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()


def page_keys(tokens: Sequence[int], page_size: int, known: Sequence[bytes] = ()) -> list[bytes]:
    """The keys of every full page of `tokens` followed by a token, extending those `known`."""
    keys = list(known)
    for p in range(len(keys), (len(tokens) - 1) // page_size):
        keys.append(page_key(keys[-1] if keys else ROOT_KEY, tokens[p * page_size:(p + 1) * page_size + 1]))
    return keys


class PrefixCache:
    """Content keys of published pages, and the idle ones (no holder) in least recently used order."""

    def __init__(self):
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._page_of)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def page(self, key: bytes) -> int | None:
        return self._page_of.get(key)

    def holds(self, page: int) -> bool:
        return page in self._key_of

    def publish(self, page: int, key: bytes) -> None:
        """Cache `page` under `key`, unless the key or the page is cached already."""
        if key not in self._page_of and page not in self._key_of:
            self._page_of[key], self._key_of[page] = page, key

    def idle(self, page: int) -> None:
        self._idle[page] = None

    def busy(self, page: int) -> None:
        self._idle.pop(page, None)

    def evict(self) -> int:
        """Forget the idle page used least recently: -> that page."""
        page, _ = self._idle.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        return page


class PagePool:
    """Pages 1..num_pages-1, reference-counted. Free pages are those no request holds and no key
    caches; `num_free` also counts the idle cached ones, which `allocate` evicts when it must."""

    def __init__(self, num_pages: int, prefix_caching: bool = True):
        self.capacity = num_pages - 1
        self.cache = PrefixCache() if prefix_caching else None
        self._free = list(range(num_pages - 1, SCRATCH_PAGE, -1))
        self._refs = np.zeros(num_pages, np.int32)

    @property
    def num_free(self) -> int:
        return len(self._free) + (self.cache.num_idle if self.cache is not None else 0)

    @property
    def num_held(self) -> int:
        return int(np.count_nonzero(self._refs))

    def refs(self, page: int) -> int:
        return int(self._refs[page])

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages (none for n <= 0), free ones first, then evicted ones; None if fewer are free."""
        if n > self.num_free:
            return None
        if n <= 0:
            return []
        taken = [self._free.pop() if self._free else self.cache.evict() for _ in range(n)]
        self._refs[taken] += 1
        return taken

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest prefix of `keys`, each now held once more."""
        pages = []
        for key in keys if self.cache is not None else ():
            page = self.cache.page(key)
            if page is None:
                break
            pages.append(page)
            self.cache.busy(page)
        self._refs[pages] += 1
        return pages

    def publish(self, pages: Sequence[int], keys: Sequence[bytes]) -> None:
        """Cache held pages under their keys (written by programs dispatched before any reader)."""
        for page, key in zip(pages, keys) if self.cache is not None else ():
            self.cache.publish(page, key)

    def release(self, pages: Sequence[int]) -> None:
        """Drop one hold on each page: a page no request holds is idle if cached, else free."""
        for page in reversed(pages):  # a sequence's last page first: the first evicted
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if self.cache is not None and self.cache.holds(page):
                    self.cache.idle(page)
                else:
                    self._free.append(page)
