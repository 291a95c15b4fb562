"""The reviews' findings left from earlier rounds: each command's bad input is one clear error and a non-zero exit,
never a traceback, a wrong path or a wrong status; a killed sweep's trials are not reported as running; a sweep whose
data cannot be read is refused before any trial starts; a model without biases has none in its classifier."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from study.cli import main
from study.record import host_id
from tests.synthetic_sweep import make_synthetic_sweep
from tests.test_sweep_reliability import _shipped_default

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.delenv("STUDY_DATA_DIR", raising=False)
    monkeypatch.delenv("STUDY_STORAGE", raising=False)
    return tmp_path


def _gone_pid() -> int:
    """The pid of a process that has ended (a worker a `kill -9` took)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# --- report and compare: their output folder and the runs they are given -------------------------------------------
@pytest.mark.parametrize("command", ["report", "compare"])
def test_an_output_folder_that_is_a_file_or_under_one_is_refused_before_anything_is_drawn(here, capsys, command):
    make_synthetic_sweep(here / "results" / "s")
    (here / "afile").write_text("")
    for out, words in (("afile", "--out afile is a file"), ("afile/x", "--out afile/x lies under afile")):
        assert main([command, "results/s", "--out", out]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"study {command}: {words}") and "Traceback" not in err
    assert not (here / "reports").exists() and (here / "afile").read_text() == ""


def test_compare_names_each_run_it_was_given_that_is_not_a_recorded_run(here, capsys):
    make_synthetic_sweep(here / "results" / "s")
    (here / "bad.json").write_text("not json")
    (here / "list.json").write_text("[1, 2]")
    (here / "unfinished").mkdir()
    assert main(["compare", "results/s", "--runs", "bad.json", "list.json", "unfinished", "--out", "c"]) == 2
    err = capsys.readouterr().err
    assert "study compare: bad.json cannot be read as a recorded run: JSONDecodeError" in err
    assert "list.json holds a JSON list, not a recorded run" in err
    assert "unfinished is neither a recorded run (run-*.json) nor a run directory with a readable result" in err
    assert "Traceback" not in err and not (here / "c").exists()


def test_runs_a_pattern_or_the_default_finds_are_left_out_when_they_hold_none_but_named_when_damaged(here, capsys):
    (here / "bench" / "results").mkdir(parents=True)
    (here / "bench" / "results" / "run-other.json").write_text('{"something": "else"}')
    (here / "newer").mkdir()
    (here / "newer" / "metrics.json").write_text(json.dumps({"schema": 99, "status": "completed", "metrics": {}}))
    assert main(["compare", "--runs", "bench/results/*.json", "--out", "c"]) == 0  # no run there: none compared
    capsys.readouterr()
    assert main(["compare", "--runs", "newer", "--out", "c"]) == 2  # a record this version cannot read: named
    assert capsys.readouterr().err.startswith("study compare: newer: ")
    (here / "bench" / "results" / "run-cut.json").write_text('{"metrics": ')
    assert main(["compare", "--out", "c"]) == 2
    err = capsys.readouterr().err
    assert "run-cut.json cannot be read as a recorded run" in err and "give --no-runs" in err
    assert "run-other.json" not in err


# --- status and results: which folder, and what the exit code says -------------------------------------------------
@pytest.mark.parametrize("command", ["status", "results"])
def test_a_mistyped_sweep_folder_is_named_as_given_with_the_sweeps_close_to_it(here, capsys, command):
    make_synthetic_sweep(here / "results" / "default")
    assert main([command, "results/defualt"]) == 2
    assert capsys.readouterr().err.strip() == (f"study {command}: no sweep folder results/defualt; did you mean "
                                               "results/default?")  # (it was looked for in results/results/defualt)
    assert main([command, "defualt"]) == 2  # a name is looked for under --results
    assert "no sweep folder results/defualt; did you mean results/default?" in capsys.readouterr().err
    assert main([command, "elsewhere/s"]) == 2
    assert "no sweep folder elsewhere/s; run `study sweep SPEC` first" in capsys.readouterr().err
    assert main([command, "specs/nsp.yaml"]) == 2  # a spec that is not there (was: no sweep folder results/nsp.yaml)
    assert "no spec file specs/nsp.yaml; give the sweep's spec YAML" in capsys.readouterr().err


def test_status_exits_2_on_a_storage_url_it_cannot_read_and_1_when_the_queue_cannot_be_opened(here, capsys):
    _shipped_default(here)
    assert main(["status", "results/default", "--storage", "bogus://x"]) == 2
    assert capsys.readouterr().err.startswith("study status: storage URL 'bogus://x' is not one of")
    (here / "not-a-db.db").write_text("hello")
    assert main(["status", "results/default", "--storage", f"sqlite:///{here}/not-a-db.db"]) == 1
    out = capsys.readouterr().out  # the run directories are still reported
    assert "not-a-db.db is not an Optuna SQLite queue (file is not a database)" in out
    assert "finished seed-trial run directories: 0/33" in out
    assert main(["status", "results/default"]) == 0  # no queue file: nothing was queued here, which is no failure
    assert "no queue file at" in capsys.readouterr().out


# --- a killed sweep's trials -----------------------------------------------------------------------------------------
def test_a_trial_whose_worker_was_killed_is_pending_in_the_results_table_not_running():
    from study.sweep.results import _status

    dead = {"id": "s#3@1.0", "worker": f"{host_id()}:{_gone_pid()}", "started": 1.0}
    status, why = _status(None, [dead])
    assert status == "pending" and why.startswith("last attempt interrupted: its worker") and "study sweep" in why
    import os

    alive = dead | {"worker": f"{host_id()}:{os.getppid()}"}  # a worker that still runs (this test's parent)
    assert _status(None, [alive]) == ("running", "")
    assert _status(None, [dead | {"worker": f"another-host:{_gone_pid()}"}]) == ("running", "")  # (it may run there)


def test_the_report_reads_the_running_row_of_a_killed_sweep_as_pending(tmp_path):
    """The table is the sweep's last write: after a kill -9 it said `running` until the next sweep."""
    from study.report.collect import load_results

    root = make_synthetic_sweep(tmp_path / "s")
    results = load_results(root)
    row = results.table[results.table["status"] == "running"].iloc[0]
    run_dir = results.run_dir(row)
    attempt = {"id": "synthetic#7@1.0", "worker": f"{host_id()}:{_gone_pid()}", "started": 1.0}
    (run_dir / "trial.json").write_text(json.dumps({"attempts": [attempt]}))
    table = load_results(root).table
    now = table[(table["point"] == row["point"]) & (table["seed"] == row["seed"])].iloc[0]
    assert now["status"] == "pending" and (table["status"] != "running").all()
    assert now["error"] == f"last attempt interrupted: its worker ({attempt['worker']}) is gone; rerunning `study " \
                           "sweep` resumes it"  # as `study results` says it
    (run_dir / "trial.json").write_text(json.dumps({"attempts": [attempt | {"id": "other#7@1.0"}]}))
    assert (load_results(root).table["status"] == "running").sum() == 1  # another sweep's attempt says nothing


# --- score-mt: a local folder that is not there -----------------------------------------------------------------------
@pytest.mark.parametrize("model", ["./models/opus-mt-de-en", "/nowhere/opus", "runs/a/b", "~/nowhere/opus"])
def test_score_mt_names_a_local_folder_that_is_not_there_not_a_bad_hub_id(here, model):
    from study.tasks.score_mt import ModelUnavailable, load_hf_translator

    named = str(Path(model).expanduser()) if model.startswith("~") else model
    with pytest.raises(ModelUnavailable, match=re.escape(f"no local folder {named}: give the folder")):
        load_hf_translator(model)


# --- a sweep whose data cannot be read --------------------------------------------------------------------------------
def test_a_sweep_whose_data_dir_lacks_the_dataset_is_refused_before_any_trial_starts(here):
    """Each trial failed with the data error three times, each in a process that imported torch first."""
    from study.sweep import SweepOptions, SweepSpecError, run_sweep

    (here / "data").mkdir()
    opts = SweepOptions(results=str(here / "results"), data_dir=str(here / "data"))
    spec = REPO / "experiments" / "ablation_default.yaml"
    with pytest.raises(SweepSpecError, match="(?s)cannot be read.*none was started.*'tinyshakespeare' is not "
                                             "available.*input.txt"):
        run_sweep(spec, opts, say=lambda _: None, overrides={"seeds": [0]})
    assert not (here / "results" / "default" / "runs").exists()
    # a dry run plans for the machine that will run it, and reads no data (online it would download it)
    assert run_sweep(spec, SweepOptions(**{**opts.__dict__, "dry_run": True}), say=lambda _: None,
                     overrides={"seeds": [0]}) == {}


@pytest.mark.parametrize("config", ["shakespeare_char_llama2", "multi30k_de_en", "wikitext2_bert_pretrain_nsp",
                                    "glue_finetune"])
def test_every_task_family_checks_the_data_its_runs_read(here, config):
    from study.config import load_experiment
    from study.tasks import family
    from study.tasks.data import DatasetUnavailable

    (here / "data").mkdir()
    cfg = load_experiment(REPO / "experiments" / f"{config}.yaml", [])
    with pytest.raises(DatasetUnavailable):
        family(cfg.task.name).check_data(cfg, here / "data")


def test_every_registered_task_family_overrides_the_data_check():
    from study.tasks import FAMILIES, family
    from study.tasks.contract import TaskFamily

    assert {name for name in FAMILIES if type(family(name)).check_data is TaskFamily.check_data} == set()


@pytest.mark.parametrize("bias", [True, False])
def test_the_classification_head_has_a_bias_only_where_the_model_has_biases(bias):
    from study.config import ModelConfig
    from study.model import SequenceClassificationHead

    head = SequenceClassificationHead(ModelConfig(arch="encoder", objective="mlm", bias=bias), 3)
    assert (head.proj.bias is not None) == bias


def test_a_checkpoint_resumes_where_only_the_tokenizers_cache_key_changed_not_its_vocabulary():
    """bpe and wordpiece cache format 2 gave every such tokenizer a new key: an interrupted run whose text holds no
    special token (Multi30k, GLUE) was refused its checkpoint for a vocabulary that had not changed."""
    from study.run.conflict import data_differences

    there = {"source": "local", "files": {"input.txt": "aa"}, "tokenizer": "key-format-1", "vocab_sha256": "v1"}
    assert data_differences(there, {**there, "tokenizer": "key-format-2"}) == []
    assert data_differences(there, {**there, "tokenizer": "key-format-2", "vocab_sha256": "v2"}) == [
        "tokenizer: 'key-format-1' there, 'key-format-2' here", "vocab_sha256: 'v1' there, 'v2' here"]
    older = {k: v for k, v in there.items() if k != "vocab_sha256"}  # a data.json from before vocab_sha256
    assert data_differences(older, {**there, "tokenizer": "key-format-2"}) == [
        "tokenizer: 'key-format-1' there, 'key-format-2' here"]


def test_status_writes_nothing_into_a_storage_it_is_shown_and_keeps_to_the_folders_own(here, capsys):
    """`study status --storage` appended an Optuna operation to a text file given as a journal, and created Optuna's
    tables in an unrelated SQLite database; a folder as the storage was 'nothing queued', exit 0."""
    import sqlite3

    _shipped_default(here)
    (here / "notes.txt").write_text("hello\n")
    with sqlite3.connect(here / "other.db") as db:
        db.execute("CREATE TABLE mine (a)")
    (here / "a-folder").mkdir()
    for url, words in ((f"journal:///{here}/notes.txt", "notes.txt is not an Optuna journal"),
                       (f"sqlite:///{here}/other.db", "other.db is not an Optuna SQLite queue (it has no `studies`"),
                       (f"sqlite:///{here}/a-folder", "a-folder is a folder, not a queue file")):
        assert main(["status", "results/default", "--storage", url]) == 1
        assert words in capsys.readouterr().out
    assert (here / "notes.txt").read_text() == "hello\n"
    with sqlite3.connect(here / "other.db") as db:
        assert [t for (t,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")] == ["mine"]
    from study.sweep.layout import SweepLayout, record_storage

    record_storage(SweepLayout(here / "results" / "default"), f"sqlite:///{here}/queue.db")
    assert main(["status", "results/default", "--storage", f"sqlite:///{here}/else.db"]) == 2  # as `study sweep`
    assert "belongs to storage" in capsys.readouterr().err


def test_a_spec_and_an_experiment_given_to_the_others_command_say_which_command_they_are_for(here, capsys):
    spec, experiment = REPO / "experiments" / "ablation_default.yaml", REPO / "experiments" / "wikitext2_llama2.yaml"
    assert main(["sweep", str(experiment), "--dry-run"]) == 2  # it listed model, task, train as unknown fields
    assert f"{experiment} is an experiment config: run it with `study run {experiment}`" in capsys.readouterr().err
    assert main(["run", str(spec)]) == 2  # it said "got no task"
    assert f"{spec} is a sweep spec: run it with `study sweep {spec}`" in capsys.readouterr().err
    for command in ("status", "results"):
        assert main([command, str(experiment)]) == 2
        assert "is an experiment config (for `study run`), not a sweep spec" in capsys.readouterr().err
        assert main([command, str(spec)]) == 2  # never run here: it said "results/default holds no sweep"
        assert f"no sweep folder results/default (the sweep {spec} names): run `study sweep {spec}` first" in \
            capsys.readouterr().err


def test_the_documented_cost_of_a_spec_says_it_is_the_spec_as_written_once_set_changed_the_plan():
    from study.sweep.plan import describe, expand, load_spec

    path = REPO / "experiments" / "ablation_default.yaml"
    plan = expand(*load_spec(path, {"seeds": [0], "train.max_steps": 3}))
    assert "documented cost of the spec as written, before --set: 33 trials of 240 steps" in describe(plan, None, True)
    assert "  documented cost: 33 trials" in describe(expand(*load_spec(path)))


@pytest.mark.parametrize("command", ["report", "compare"])
def test_report_and_compare_suggest_the_sweep_folder_close_to_a_mistyped_or_bare_name(here, capsys, command):
    make_synthetic_sweep(here / "results" / "default")
    for given in ("results/defualt", "default"):
        assert main([command, given]) == 2
        assert capsys.readouterr().err.strip() == (f"study {command}: no results directory at {given}; did you mean "
                                                   "results/default?")
