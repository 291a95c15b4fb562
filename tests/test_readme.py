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


def test_axis_table_matches_the_config():
    documented = {}
    for _, field, values in _table_rows():
        name = field.strip("`")
        if name in axis_choices():
            documented[name] = set(re.findall(r"`([^`]+)`", values.split("(")[0]))
    choices = axis_choices()
    assert set(documented) == set(choices)
    for name, values in choices.items():
        assert documented[name] == set(values), name


def test_every_preset_is_documented():
    for name in PRESETS:
        assert f"| `{name}` |" in README
