"""The README's tables say what the code accepts."""

import re
from pathlib import Path

from study.config import PRESETS, axis_choices

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _table_rows():
    for line in README.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("`"):
            yield cells


def test_the_axis_table_names_only_values_that_exist():
    """The README's axis table names every axis, and every value it names is registered. It need not list every
    value (`study axes` does): adding a value is one class and its test, with the whole suite green."""
    documented = {}
    for _, field, values in _table_rows():
        name = field.strip("`")
        if name in axis_choices():
            documented[name] = set(re.findall(r"`([^`]+)`", values.split("(")[0]))
    choices = axis_choices()
    assert set(documented) == set(choices)
    for name, values in documented.items():
        assert values and values <= set(choices[name]), (name, values - set(choices[name]))
    assert "study axes" in README


def test_every_preset_is_documented():
    for name in PRESETS:
        assert f"| `{name}` |" in README
