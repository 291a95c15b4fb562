"""Folders given on the command line are checked before anything is read or written: a --data-dir that is a file,
an --out or --results that is a file or lies under one, and a folder that cannot be written are one clear error
(exit 2, no traceback) naming the flag and the path; existing files are left as they were."""

from __future__ import annotations

import os

import pytest

from study.cli import main
from tests.test_cli import _no_training, workdir  # noqa: F401  (the fixture)


def test_a_data_dir_that_is_a_file_is_named_as_a_file(workdir, monkeypatch, capsys):
    _no_training(monkeypatch)
    data = workdir / "data.txt"
    data.write_text("not a folder")
    assert main(["run", str(workdir / "exp.yaml"), "--data-dir", str(data)]) == 2
    err = capsys.readouterr().err
    assert f"--data-dir {data} is a file" in err and "Traceback" not in err


def test_run_out_that_is_an_existing_file_is_refused_before_the_data_is_read(workdir, monkeypatch, capsys):
    _no_training(monkeypatch)
    out = workdir / "results.json"
    out.write_text('{"kept": true}\n')
    assert main(["run", str(workdir / "exp.yaml"), "--out", str(out)]) == 2
    assert f"--out {out} is a file" in capsys.readouterr().err
    assert out.read_text() == '{"kept": true}\n'


@pytest.mark.parametrize("make", ["file", "under-file"])
def test_sweep_results_that_is_or_lies_under_a_file_is_refused(workdir, capsys, make):
    blocker = workdir / "blocker"
    blocker.write_text("x")
    results = blocker if make == "file" else blocker / "results"
    assert main(["sweep", str(workdir / "exp.yaml"), "--results", str(results)]) == 2
    err = capsys.readouterr().err
    assert "--results" in err and str(results) in err and "Traceback" not in err
    assert blocker.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_sweep_results_in_a_read_only_folder_is_refused(workdir, capsys):
    locked = workdir / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        assert main(["sweep", str(workdir / "exp.yaml"), "--results", str(locked / "results")]) == 2
        assert "cannot write" in capsys.readouterr().err
    finally:
        locked.chmod(0o755)


def test_a_permission_error_while_writing_is_one_line_naming_the_file(workdir, monkeypatch, capsys):
    import study.run

    def unwritable(cfg, out, **kwargs):
        raise PermissionError(13, "Permission denied", str(out / "config.yaml"))

    monkeypatch.setattr(study.run, "run_experiment", unwritable)
    assert main(["run", str(workdir / "exp.yaml"), "--out", str(workdir / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"study run: cannot write {workdir / 'run' / 'config.yaml'}: Permission denied"


def test_a_binary_sweep_spec_is_named_as_not_yaml(workdir, capsys):
    spec = workdir / "spec.yaml"
    spec.write_bytes(b"\xff\xfe\x00binary")
    assert main(["sweep", str(spec)]) == 2
    err = capsys.readouterr().err
    assert f"{spec}: not valid YAML" in err and "Traceback" not in err


def test_a_data_dir_that_does_not_exist_is_refused_rather_than_read_from_the_hub(workdir, monkeypatch, capsys):
    """A mistyped --data-dir would otherwise fall back to the hub's copy after a warning (different bytes, perhaps
    different splits); only a folder left out reads the hub."""
    _no_training(monkeypatch)
    missing = workdir / "no-such-data"
    assert main(["run", str(workdir / "exp.yaml"), "--data-dir", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"--data-dir {missing} does not exist" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_a_cache_dir_that_is_a_file_is_refused_before_the_data_is_read(workdir, monkeypatch, capsys, command):
    _no_training(monkeypatch)
    cache = workdir / "cachefile"
    cache.write_text("x")
    assert main([command, str(workdir / "exp.yaml"), "--cache-dir", str(cache)]) == 2
    assert f"--cache-dir {cache} is a file" in capsys.readouterr().err
    assert cache.read_text() == "x"


@pytest.mark.parametrize("flag", ["--beam", "--batch-size", "--limit"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_score_mt_counts_must_be_positive(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["score-mt", "some/model", flag, value])
    assert exit_.value.code == 2 and "must be an integer >= 1" in capsys.readouterr().err
