"""The benchmark tables beside the anchors are generated: regenerating one from the committed records gives the
committed file byte for byte, and the prose that cites it uses only numbers the table holds."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "multi30k_vs_hf_table.py"


def _table_module():
    spec = importlib.util.spec_from_file_location("multi30k_vs_hf_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _records(module) -> tuple[dict, dict]:
    record = json.loads(module.RECORD.read_text())
    return record, json.loads((ROOT / record["ours"]["record"]).read_text())


def test_the_multi30k_table_regenerates_from_the_committed_records():
    module = _table_module()
    assert module.build(*_records(module)) == module.TABLE.read_text(), \
        "bench/results/multi30k-vs-hf.md is stale: run .venv/bin/python bench/multi30k_vs_hf_table.py"


def test_the_table_reads_its_numbers_from_the_records():
    module = _table_module()
    record, run = _records(module)
    record["hf"]["decode"]["BLEU"] = 12.34
    assert "| 12.3 |" in module.build(record, run) and "| 12.3 |" not in module.TABLE.read_text()


def test_the_readme_multi30k_paragraph_cites_only_numbers_of_the_table():
    """bench/README.md's side-by-side paragraph points to the generated table; each number it prints is there."""
    readme = (ROOT / "bench" / "README.md").read_text()
    start = readme.index("**Side by side on the AVX2 machine")
    paragraph = readme[start:readme.index("\n\n", start)]
    assert "bench/results/multi30k-vs-hf.md" in paragraph
    table = _table_module().TABLE.read_text()
    numbers = re.findall(r"\d[\d,]*(?:\.\d+)?", paragraph)
    assert numbers  # the paragraph does cite the run
    missing = [n for n in numbers if n not in table]
    assert not missing, f"numbers in the README paragraph that the generated table lacks: {missing}"


@pytest.mark.parametrize("name", ["multi30k-vs-hf.json", "run-multi30k-de-en-vs-hf.json"])
def test_the_records_the_table_reads_are_committed(name):
    assert (ROOT / "bench" / "results" / name).is_file()
