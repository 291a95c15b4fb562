"""Frozen, validated, YAML-serialisable configuration dataclasses.

Every config in `study` is a flat frozen dataclass. Construction validates the
whole object and reports *every* problem in one `ConfigError`, each naming the
field and what would be valid, so a bad sweep point fails before any weights are
built. Configs round-trip through plain dicts and YAML.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import typing
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml

from study.io import dump_yaml, load_yaml

T = TypeVar("T", bound="Config")


class ConfigError(ValueError):
    """One or more invalid fields; `problems` lists them as `field: message`."""

    def __init__(self, cls_name: str, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid {cls_name} ({len(self.problems)} problem(s)):\n{lines}")


class Problems:
    """Collects validation problems so they can all be reported at once."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, field: str, message: str) -> None:
        self.items.append(f"{field}: {message}")

    def check(self, ok: bool, field: str, message: str) -> bool:
        if not ok:
            self.add(field, message)
        return ok

    def choice(self, field: str, value: Any, choices: typing.Iterable[str]) -> bool:
        choices = sorted(choices)
        return self.check(value in choices, field, f"{value!r} is not one of {choices}")


def _strip_optional(tp: Any) -> Any:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", typing.Union)) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else tp
    return tp


def _coerce(field_name: str, tp: Any, value: Any, problems: Problems) -> Any:
    """Light type coercion for values coming from YAML or `--set key=value`. null is accepted only where the field
    is optional (a null elsewhere would silently mean something else); floats must be finite."""
    if value is None:
        if _strip_optional(tp) is tp and tp is not Any:
            kind = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
                    "dict": "a mapping (write {} for none)", "tuple": "a list (write [] for none)"}
            problems.add(field_name, f"must be {kind.get(getattr(tp, '__name__', ''), tp)}, got null")
        return None
    tp = _strip_optional(tp)
    origin = typing.get_origin(tp)
    try:
        if tp is bool:
            if isinstance(value, str):
                low = value.strip().lower()
                if low in ("true", "yes", "1", "on"):
                    return True
                if low in ("false", "no", "0", "off"):
                    return False
                raise ValueError
            if isinstance(value, (bool, int)) and value in (0, 1, True, False):
                return bool(value)
            raise ValueError
        if tp is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if tp is float:
            if isinstance(value, bool) or not math.isfinite(float(value)):
                raise ValueError
            return float(value)
        if tp is str:
            if not isinstance(value, str):
                raise ValueError
            return value
        if origin is tuple:
            if isinstance(value, str):
                value = [v for v in value.split(",") if v]
            (inner, *_), = [typing.get_args(tp)]
            return tuple(_coerce(field_name, inner, v, problems) for v in value)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return value if isinstance(value, tp) else tp.from_dict(value)
    except ConfigError as err:  # a section given as a mapping: its own problems, under its name
        for problem in err.problems:
            problems.items.append(f"{field_name}.{problem}")
        return value
    except (TypeError, ValueError, OverflowError):  # (an integer too large for a float overflows)
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        problems.add(field_name, f"{shown} is not a valid {getattr(tp, '__name__', tp)}")
        return value
    return value


@dataclasses.dataclass(frozen=True)
class Config:
    """Base class: subclasses implement `_validate(problems)`."""

    yaml_tag: ClassVar[str] = "config"

    def __post_init__(self) -> None:
        problems = Problems()
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            coerced = _coerce(f.name, hints[f.name], value, problems)
            if coerced is not value:
                object.__setattr__(self, f.name, coerced)
        if not problems.items:
            self._resolve_defaults()
            self._validate(problems)
        if problems.items:
            raise ConfigError(type(self).__name__, problems.items)

    # Subclasses override these two.
    def _resolve_defaults(self) -> None:
        """Fill derived defaults (e.g. n_kv_heads=None -> n_heads) in place."""

    def _validate(self, problems: Problems) -> None:
        """Add a problem for every invalid field or combination."""

    def resolved(self, name: str) -> Any:
        """Field `name` as it runs: its value, or where it is unset (None) the value this config derives from its
        other fields (a `resolved_<name>` property, or `resolved_<name less n_>`: n_kv_heads -> n_heads)."""
        value = getattr(self, name)
        for derived in (f"resolved_{name}", f"resolved_{name.removeprefix('n_')}"):
            if value is None and isinstance(getattr(type(self), derived, None), property):
                return getattr(self, derived)
        return value

    def differences(self, other: Config) -> dict[str, tuple[Any, Any]]:
        """`field` (`section.field` in nested configs) -> (this value, `other`'s) wherever the two differ."""
        out: dict[str, tuple[Any, Any]] = {}
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name, None)
            if isinstance(mine, Config) and isinstance(theirs, Config):
                out.update({f"{f.name}.{k}": v for k, v in mine.differences(theirs).items()})
            elif mine != theirs:
                out[f.name] = (mine, theirs)
        return out

    # Serialisation -------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Config):
                v = v.to_dict()
            elif isinstance(v, tuple):
                v = list(v)
            elif isinstance(v, dict):
                v = copy.deepcopy(v)  # the config stays frozen: nobody edits its mappings through the dict
            out[f.name] = v
        return out

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any] | None) -> T:
        if data is not None and not isinstance(data, dict):
            raise ConfigError(cls.__name__, [f"must be a mapping of fields, got {type(data).__name__} {data!r}"])
        data = dict(data or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(
                cls.__name__, [f"{k}: unknown field; valid fields are {sorted(names)}" for k in unknown]
            )
        return cls(**data)

    def replace(self: T, **changes: Any) -> T:
        return type(self).from_dict({**self.to_dict(), **changes})

    def to_yaml(self) -> str:
        return dump_yaml(self.to_dict())

    @classmethod
    def from_yaml(cls: type[T], text_or_path: str | Path) -> T:
        """A config from YAML text, or from a file given as a Path (a str is always read as the text itself)."""
        text = Path(text_or_path).read_text() if isinstance(text_or_path, Path) else text_or_path
        return cls.from_dict(load_yaml(text))


def parse_overrides(pairs: typing.Iterable[str]) -> dict[str, Any]:
    """Parse `key=value` strings (as given to `--set`) with YAML scalars."""
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"override {pair!r} must look like key=value")
        key, value = pair.split("=", 1)
        try:
            out[key.strip()] = load_yaml(value)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ValueError(f"override {key.strip()}: {value!r} is not a YAML value ({mark})") from None
    return out
