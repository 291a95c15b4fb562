"""Sweeps: expand a spec into points and refuse what would not reach the model (plan, reach),
estimate the cost (estimate), queue (point, seed) trials on Optuna's storage (queue, storage),
run each trial in its own process (worker, trial; tuning mode: tuning), and rebuild the results
table from the run directories (results; where the files live: layout). `runner.run_sweep` ties
them together.

Names are imported lazily so that `python -m study.sweep.worker` / `.trial` start clean."""

import importlib

_EXPORTS = {
    "Plan": "plan", "Point": "plan", "SweepSpecError": "plan", "expand": "plan", "load_spec": "plan",
    "check": "plan", "SweepOptions": "runner", "run_sweep": "runner", "status": "runner",
    "SweepInterrupted": "runner",
    "StorageError": "storage", "redact": "storage",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"study.sweep.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'study.sweep' has no attribute {name!r}")
