"""`study run` and its run directory under a kill, Ctrl-C, a second process, a forced rerun and damaged files; the
other commands' bad input: each one clear line and a non-zero exit, never a traceback or a wrong result."""

from __future__ import annotations

import argparse
import json
import os
import signal
import stat

import pytest
import yaml

import study.cli
from study.cli import main
from tests.test_cli import _no_training, workdir  # noqa: F401  (fixture)
from tests.test_lm_task import Killed, LMModule, corpus, main_run, make_cfg, run  # noqa: F401  (fixtures)


class KilledDuringStep3(LMModule):
    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        if self.global_step == 3:
            raise Killed()


class CtrlCDuringStep3(LMModule):
    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        if self.global_step == 3:
            raise KeyboardInterrupt


def _with_module(monkeypatch, module) -> None:
    from study.tasks.lm import LanguageModelling, LMDataModule

    monkeypatch.setattr(LanguageModelling, "implementation", lambda self: (LMDataModule, module))


SHORT = {"model": {"n_layers": 1}, "train": {"max_steps": 6, "eval_every": 2, "checkpoint_every": 2}}


# --- a forced rerun ------------------------------------------------------------------------------------------------
def test_a_forced_rerun_of_another_config_killed_midway_never_hands_back_the_old_result(corpus, monkeypatch):
    old = run(corpus, make_cfg(**SHORT), "forced")
    new_cfg = make_cfg(**{**SHORT, "train": {**SHORT["train"], "lr": 1e-2}})
    with monkeypatch.context() as mp:
        _with_module(mp, KilledDuringStep3)
        with pytest.raises(Killed):
            run(corpus, new_cfg, "forced", force=True)
    d = corpus["root"] / "forced"
    assert yaml.safe_load((d / "config.yaml").read_text())["train"]["lr"] == 1e-2
    # the old config's record and weights went with it: the directory holds the new config's unfinished run
    assert not (d / "metrics.json").exists() and not (d / "model.pt").exists()
    new = run(corpus, new_cfg, "forced")  # resumes the new config's run, never answers with the old result
    assert new["steps"] == 6 and new["metrics"] != old["metrics"]


# --- Ctrl-C --------------------------------------------------------------------------------------------------------
def test_ctrl_c_during_training_stays_a_keyboard_interrupt_and_ctrl_c_works_afterwards(corpus, monkeypatch):
    _with_module(monkeypatch, CtrlCDuringStep3)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):  # not Lightning's sys.exit(1), which reads as an error
        run(corpus, make_cfg(**SHORT), "ctrl-c")
    assert signal.getsignal(signal.SIGINT) is before  # Lightning had left SIGINT ignored
    assert (corpus["root"] / "ctrl-c" / "checkpoints" / "last.ckpt").is_file()
    assert not (corpus["root"] / "ctrl-c" / "metrics.json").exists()


def test_ctrl_c_in_study_run_is_one_line_saying_how_to_resume(workdir, monkeypatch, capsys):  # noqa: F811
    import study.run

    def interrupted(cfg, out, **kwargs):
        (out / "checkpoints").mkdir(parents=True)
        (out / "checkpoints" / "last.ckpt").write_bytes(b"")
        raise KeyboardInterrupt

    monkeypatch.setattr(study.run, "run_experiment", interrupted)
    assert main(["run", "exp.yaml", "--out", "run"]) == 130
    err = capsys.readouterr().err
    assert err == "study run: interrupted; no result recorded; the same command resumes run from its last checkpoint\n"


# --- one process per run directory ---------------------------------------------------------------------------------
def test_a_run_directory_being_run_by_another_process_is_refused(workdir, monkeypatch, capsys):  # noqa: F811
    from study.run.pipeline import run_dir_lock

    _no_training(monkeypatch)
    with run_dir_lock(workdir / "run"):  # the lock a sweep's trial (or another `study run`) holds
        assert main(["run", "exp.yaml", "--out", str(workdir / "run")]) == 2
    err = capsys.readouterr().err
    assert "is being run by another process" in err and "Traceback" not in err


# --- damaged or unreadable files ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["garbage: [\n", "model: {preset: gpt2, no_such_field: 1}\ntask: {name: lm}\n"])
def test_a_run_directory_whose_config_yaml_cannot_be_read_is_named(workdir, capsys, text):  # noqa: F811
    (workdir / "run").mkdir()
    (workdir / "run" / "config.yaml").write_text(text)
    assert main(["run", "exp.yaml", "--out", "run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("study run: run/config.yaml cannot be read") and "--force" in err
    assert (workdir / "run" / "config.yaml").read_text() == text


@pytest.mark.parametrize("command", ["status", "results"])
@pytest.mark.parametrize("text", ["name: [x\n", "- a\n- b\n", "name: 5\n"])
def test_status_and_results_of_a_spec_that_is_not_one_are_one_clear_error(workdir, capsys, command, text):  # noqa: F811
    (workdir / "spec.yaml").write_text(text)
    assert main([command, "spec.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"study {command}: spec.yaml: ") and "Traceback" not in err


def test_a_folder_given_as_the_config_is_named_as_a_folder(workdir, monkeypatch, capsys):  # noqa: F811
    _no_training(monkeypatch)
    assert main(["run", str(workdir)]) == 2
    assert "is a folder; give an experiment YAML" in capsys.readouterr().err


def test_score_mt_refuses_a_bad_out_or_data_dir_before_it_scores(workdir, monkeypatch, capsys):  # noqa: F811
    import study.tasks.score_mt

    monkeypatch.setattr(study.tasks.score_mt, "score_newstest2014", lambda *a, **k: pytest.fail("scored"))
    (workdir / "afile").write_text("")
    for argv, words in ((["--out", "afile/x.json"], "lies under afile, which is a file"),
                        (["--out", str(workdir)], "is a folder"),
                        (["--data-dir", "nowhere"], "--data-dir nowhere does not exist")):
        assert main(["score-mt", "some/model", *argv]) == 2
        assert words in capsys.readouterr().err


def test_every_option_of_every_command_says_what_it_does():
    parser = study.cli._parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    undocumented = [f"{name} {action.option_strings[0]}" for name, command in commands.items()
                    for action in command._actions
                    if action.option_strings and action.help is None and action.dest != "help"]
    assert undocumented == []


# --- atomic writes ---------------------------------------------------------------------------------------------------
def test_an_atomic_write_syncs_its_folder_after_the_rename(tmp_path, monkeypatch):
    import study.io

    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append("folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(study.io.os, "fsync", fsync)
    study.io.atomic_write_json(tmp_path / "metrics.json", {"status": "completed"})
    assert synced == ["file", "folder"]  # the data, then the rename that makes it the file
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"status": "completed"}


def test_a_record_of_a_newer_or_damaged_schema_is_refused_not_read_as_this_versions():
    """Schema 2 changed the scale of task metrics: a record of a schema this version does not know would be read
    with the wrong rules (and a damaged `schema` failed with int()'s own message)."""
    from study.record import SCHEMA, flatten_record, make_record

    record = make_record("completed", {"valid_loss": 1.5}, {}, steps=10)
    assert flatten_record(record)["schema"] == SCHEMA and flatten_record({"metrics": {}})["schema"] == 1
    with pytest.raises(ValueError, match=rf"schema {SCHEMA + 1}: .*newer version"):
        flatten_record({**record, "schema": SCHEMA + 1})
    for damaged in ("2", 0, True, None):
        with pytest.raises(ValueError, match="damaged"):
            flatten_record({**record, "schema": damaged})
