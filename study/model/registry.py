"""A tiny name -> implementation registry, one per design axis.

Each axis file (norms, residual, positions, ffn) owns its registry, so adding a
value to an axis touches that one file. `ModelConfig` validation asks these same
registries for the valid names, so errors always list what really exists.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, axis: str):
        self.axis = axis
        self._items: dict[str, T] = {}
        self._docs: dict[str, str] = {}

    def register(self, name: str, doc: str = "") -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise KeyError(f"{self.axis} {name!r} registered twice")
            self._items[name] = obj
            self._docs[name] = doc or (getattr(obj, "__doc__", "") or "").strip().split("\n")[0]
            return obj

        return deco

    def add(self, name: str, obj: T, doc: str = "") -> T:
        return self.register(name, doc)(obj)

    def __getitem__(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(f"unknown {self.axis} {name!r}; valid: {sorted(self._items)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def names(self) -> list[str]:
        return list(self._items)

    def doc(self, name: str) -> str:
        return self._docs[name]
