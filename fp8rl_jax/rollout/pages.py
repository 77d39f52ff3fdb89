"""Host bookkeeping of the paged KV pool: the free list, each slot's pages and the page table.

The device pool (`fp8rl_jax.rollout.kv_pool.KvPool`) holds the pages; this table says which slot
owns which page, and is sent with every device call (a few KB). Pure host state, no device work.
"""

from __future__ import annotations

import math

import numpy as np


class PageTable:
    """Pages of ``num_pages`` handed to ``slots`` rows of at most ``max_pages`` pages each.

    Attributes:
      free: page ids not held by any slot; the next page handed out is ``free[-1]`` (lowest id first
        on a fresh table).
      pages: per slot, the ids of its pages in token order.
      table: ``[slots, max_pages]`` int32, row ``s`` starting with ``pages[s]`` (the rest is stale).
    """

    def __init__(self, num_pages: int, slots: int, max_pages: int, page_size: int):
        self.page_size = page_size
        self.max_pages = max_pages
        self.free = list(range(num_pages - 1, -1, -1))
        self.pages: list[list[int]] = [[] for _ in range(slots)]
        self.table = np.zeros((slots, max_pages), np.int32)

    def ensure(self, slot: int, tokens: int) -> bool:
        """Gives ``slot`` pages for ``tokens`` tokens (at most ``max_pages``); False if the free list
        ran out first (the pages it did get stay with the slot)."""
        want = min(math.ceil(tokens / self.page_size), self.max_pages)
        held = self.pages[slot]
        while len(held) < want:
            if not self.free:
                return False
            p = self.free.pop()
            self.table[slot, len(held)] = p
            held.append(p)
        return True

    def release(self, slot: int) -> None:
        """Returns the slot's pages to the free list (handed out again last-freed first)."""
        self.free.extend(reversed(self.pages[slot]))
        self.pages[slot] = []

    def move(self, src: int, dst: int) -> None:
        """Gives slot ``src``'s pages to the empty slot ``dst`` (the KV stays where it is)."""
        self.pages[dst], self.pages[src] = self.pages[src], []
        self.table[dst] = self.table[src]
