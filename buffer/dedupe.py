"""A bounded memory of recent ids, for de-duplication (docs/design.md §6: nothing trained twice).

The oldest entry is forgotten first once ``capacity`` entries are held: memory stays bounded
whatever the run length. A deque plus a dict keeps both ends O(1) (a dict alone, popped from its
front, slows down as deleted slots pile up there).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any


class RecentKeys:
    """Remembers the last ``capacity`` keys added, each with a small value."""

    __slots__ = ("capacity", "_order", "_values")

    def __init__(self, capacity: int):
        if type(capacity) is not int or capacity < 0:
            raise ValueError(f"dedupe window must be an integer >= 0, got {capacity!r}")
        self.capacity = capacity
        self._order: deque[str] = deque()
        self._values: dict[str, Any] = {}

    def add(self, key: str, value: Any = None) -> None:
        if key in self._values:
            self._values[key] = value
            return
        if self.capacity == 0:
            return
        self._order.append(key)
        self._values[key] = value
        if len(self._order) > self.capacity:
            del self._values[self._order.popleft()]

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def get(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)

    def __len__(self) -> int:
        return len(self._order)

    def items(self) -> list[tuple[str, Any]]:
        """Oldest first."""
        return [(k, self._values[k]) for k in self._order]

    def update(self, items: Iterable[tuple[str, Any]]) -> None:
        for k, v in items:
            self.add(k, v)
