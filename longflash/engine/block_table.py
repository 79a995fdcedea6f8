"""A request's block table as a list that counts its own mutations, so the decode step's host code can
keep an int32 numpy copy and rebuild it only when the table changed (about once per ``block_size``
decode steps) instead of converting every request's whole list at every step (O(context) host work:
0.5 ms per step for 16 requests of 16K tokens on this project's CPU; ``benchmarks/NOTES.md``, session 23)."""

from __future__ import annotations

import numpy as np


class BlockTable(list):
    """``list[int]`` of physical block ids with a mutation counter ``version`` and :meth:`as_array`.

    Every mutating list method bumps ``version``; :meth:`as_array` returns a cached int32 numpy array
    (shape [len(self)], read-only: it is shared) that is rebuilt when ``version`` moved."""

    __slots__ = ("version", "_array", "_array_version")

    def __init__(self, block_ids=()):
        super().__init__(block_ids)
        self.version = 0
        self._array: np.ndarray | None = None
        self._array_version = -1

    def __reduce__(self):  # pickled as its ids (a copy starts at version 0)
        return BlockTable, (list(self),)

    def as_array(self) -> np.ndarray:
        """int32 [len(self)] copy of the ids, rebuilt only after a mutation; read-only (shared)."""
        if self._array_version != self.version:
            self._array = np.array(self, dtype=np.int32)
            self._array.flags.writeable = False  # shared by every reader
            self._array_version = self.version
        return self._array


def block_ids_array(block_ids: list[int]) -> np.ndarray:
    """int32 [n] array of a block table: the cached, read-only copy of a :class:`BlockTable`, a fresh
    conversion of any other list. What every step's host code copies into its table."""
    return block_ids.as_array() if isinstance(block_ids, BlockTable) else np.asarray(block_ids, dtype=np.int32)


def _mutator(name: str):
    base = getattr(list, name)

    def method(self, *args, **kwargs):
        try:
            return base(self, *args, **kwargs)  # list.__iadd__ / __imul__ return self
        finally:  # also when it raises midway: extend(iterator) keeps the items it got
            self.version += 1
    method.__name__ = name
    method.__doc__ = f"``list.{name}``, counted in ``version``."
    return method


for _name in ("append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__",
              "__delitem__", "__iadd__", "__imul__"):
    setattr(BlockTable, _name, _mutator(_name))
