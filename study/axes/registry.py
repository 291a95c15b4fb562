"""A registry per design axis whose values are classes, each checked against the axis's contract when registered.

An axis value is one class: its implementation, its parameter count, its rules for the rest of the config and its
description, all declared on the class (torchtitan's typed registries; one owner per value). `ModelConfig`
validation, the cost accounting, `study axes` and the tests all ask the registry, so adding a value is one class and
its test. A class that misses part of the contract (an abstract method left unimplemented, no description) fails
here, when it is registered, not after a trial has trained.
"""

from __future__ import annotations

import inspect
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T", bound=type)


class AxisRegistry(Generic[T]):
    """Axis value name -> class. `contract`: the base class every value must subclass and complete."""

    def __init__(self, axis: str, contract: type):
        self.axis = axis
        self.contract = contract
        self._items: dict[str, T] = {}
        self._descriptions: dict[str, str] = {}

    def register(self, name: str, description: str | None = None) -> Callable[[T], T]:
        def deco(cls: T) -> T:
            self._check(name, cls)
            own_doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "")  # the class's own, never its contract's
            text = description or cls.__dict__.get("description", "") or own_doc.split("\n")[0]
            if not text.strip():
                raise TypeError(f"{self.axis} value {name!r} ({cls.__name__}) has no description: pass one to "
                                "register(), or give the class a `description` or a docstring")
            self._items[name] = cls
            self._descriptions[name] = text.strip()
            return cls

        return deco

    def _check(self, name: str, cls: type) -> None:
        if name in self._items:
            raise KeyError(f"{self.axis} {name!r} registered twice")
        if not (isinstance(cls, type) and issubclass(cls, self.contract)):
            raise TypeError(f"{self.axis} value {name!r}: {cls!r} is not a {self.contract.__name__} (the contract "
                            f"every {self.axis} value implements)")
        missing = sorted(getattr(cls, "__abstractmethods__", ()) if inspect.isabstract(cls) else ())
        missing += [a for a in getattr(self.contract, "required_attributes", ()) if not hasattr(cls, a)]
        if missing:
            raise TypeError(f"{self.axis} value {name!r} ({cls.__name__}) does not implement {missing} of "
                            f"{self.contract.__name__}")

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

    def items(self) -> list[tuple[str, T]]:
        return list(self._items.items())

    def describe(self, name: str) -> str:
        return self._descriptions[name]
