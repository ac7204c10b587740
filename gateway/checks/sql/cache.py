"""The bounded LRU map behind the parse cache and each policy's verdict cache."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Lru(Generic[K, V]):
    """A small thread-safe LRU map, bounded in entries and in total weight (text length)."""

    def __init__(self, size: int, max_weight: int) -> None:
        self.size = size
        self.max_weight = max_weight
        self.hits = 0
        self.misses = 0
        self._data: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._weight = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            entry = self._data.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return entry[0]

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is cached (neither counted as a hit or miss nor made recent)."""
        with self._lock:
            return key in self._data

    def put(self, key: K, value: V, weight: int) -> None:
        if weight > self.max_weight:
            return
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._weight -= old[1]
            self._data[key] = (value, weight)
            self._weight += weight
            while len(self._data) > self.size or self._weight > self.max_weight:
                _, (_, dropped) = self._data.popitem(last=False)
                self._weight -= dropped

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._weight = 0
            self.hits = self.misses = 0

    def info(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "size": len(self._data)}
