"""The structure the guide promises: dependencies point one way, each concept has one home, functions stay short.

    study/io, study/record  <-  study/axes  <-  study/config  <-  study/model, study/interop  <-  study/tasks
        <-  study/run  <-  study/sweep  <-  study/cli          (study/report reads result files: io and record only)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

STUDY = Path(__file__).resolve().parents[1] / "study"
# each package and the lowest layer number it may import from; a module may import its own layer and any lower one
LAYERS = {"io": 0, "record": 0, "interrupts": 0, "axes": 1, "config": 2, "model": 3, "interop": 3, "tasks": 4, "run": 5, "sweep": 6,
          "cli": 8, "__init__": 0}
REPORT_MAY_IMPORT = {"io", "record", "report"}
LONG_FUNCTION = 60


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _modules():
    for path in sorted(STUDY.rglob("*.py")):
        rel = path.relative_to(STUDY.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        yield name, path, ast.parse(path.read_text())


def _imports(tree: ast.AST) -> list[tuple[str, int]]:
    """Every `study.*` module a file imports, at top level or inside functions, with its line."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("study")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("study") and node.level == 0:
            out.append((node.module, node.lineno))
    return out


def test_dependencies_point_one_way():
    wrong = []
    for name, path, tree in _modules():
        own = _package(name)
        for target, line in _imports(tree):
            other = _package(target)
            if own == "report":
                if other not in REPORT_MAY_IMPORT:
                    wrong.append(f"{path.name}:{line} study.report imports {target} (it reads result files only)")
            elif other == "report":
                if own != "cli":
                    wrong.append(f"{path.name}:{line} {name} imports {target}")
            elif LAYERS[other] > LAYERS[own]:
                wrong.append(f"{path.relative_to(STUDY)}:{line} {name} (layer {own}) imports {target} (layer {other})")
    assert not wrong, "\n".join(wrong)


def test_no_task_imports_the_run_layer():
    offenders = [f"{path}" for name, path, tree in _modules() if _package(name) == "tasks"
                 and any(_package(t) in ("run", "sweep") for t, _ in _imports(tree))]
    assert not offenders


def test_importing_the_config_stays_light():
    code = ("import sys, study.config; print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', "
            "'torch') or m.startswith(('study.model.transformer', 'study.tasks', 'study.run', 'study.sweep'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_every_task_familys_declaration_loads_without_lightning_or_torch():
    """`study sweep` reads each point's task declaration while it plans: importing Lightning for it cost 6-9 s on two
    cores before any trial started. A declaration imports its implementation only when a run asks for it."""
    code = ("import sys; from study.tasks import FAMILIES, family; [family(n).metrics for n in FAMILIES]; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_run_record_has_one_home():
    """Statuses and the metrics.json flattening are defined in study/record.py only."""
    for name, path, tree in _modules():
        if name == "study.record":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in ("FINISHED", "STATUSES")
                                                    for t in node.targets):
                pytest.fail(f"{path}: defines {[t.id for t in node.targets]}, which study.record owns")
            if isinstance(node, ast.FunctionDef) and node.name in ("flatten_record", "flatten_metrics", "_flatten"):
                pytest.fail(f"{path}: defines {node.name}; a record is flattened by study.record.flatten_record")


def test_functions_are_short_or_say_why():
    long = []
    for name, path, tree in _modules():
        source = path.read_text().splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                body = "\n".join(source[node.lineno - 1:node.end_lineno])
                if length > LONG_FUNCTION and "(long:" not in body:
                    long.append(f"{path.relative_to(STUDY)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, "\n".join(long)
