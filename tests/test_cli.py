"""`study` command line, called in-process through study.cli.main."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from study.cli import main
from study.config import PRESETS, axis_choices

CONFIG = {
    "name": "cli-tiny",
    "model": {"preset": "gpt2", "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 16, "dropout": 0.0},
    "task": {"name": "lm", "dataset": "tinyshakespeare", "seq_len": 16, "eval_lengths": [1, 2]},
    "train": {"max_steps": 2, "batch_size": 4, "eval_every": 2, "eval_batches": 1, "warmup_steps": 1,
              "progress_bar": False, "accelerator": "cpu"},
}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A clean working directory, no data folder from the environment, the hub offline."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("STUDY_DATA_DIR", raising=False)
    monkeypatch.delenv("STUDY_CACHE_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump(CONFIG, sort_keys=False))
    return tmp_path


def _no_training(monkeypatch):
    """Fail the test if anything tries to build a model or prepare data."""
    import study.run

    def forbidden(*args, **kwargs):
        raise AssertionError("study run trained although the config is invalid")

    monkeypatch.setattr(study.run, "run_experiment", forbidden)


def test_invalid_value_exits_2_naming_the_field_and_valid_values(workdir, monkeypatch, capsys):
    _no_training(monkeypatch)
    out = workdir / "run"
    code = main(["run", str(workdir / "exp.yaml"), "--set", "model.norm=batchnorm", "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("study run: ")
    from study.axes import NORMS

    assert f"norm: 'batchnorm' is not one of {sorted(NORMS.names())}" in err  # the registry's values, whatever they are
    assert not out.exists()


def test_invalid_value_in_the_yaml_file_and_several_problems_at_once(workdir, monkeypatch, capsys):
    _no_training(monkeypatch)
    bad = dict(CONFIG, train={**CONFIG["train"], "schedule": "exponential", "lr": -1})
    (workdir / "bad.yaml").write_text(yaml.safe_dump(bad))
    assert main(["run", str(workdir / "bad.yaml"), "--out", str(workdir / "run")]) == 2
    err = capsys.readouterr().err
    assert "schedule: 'exponential' is not one of ['constant', 'cosine', 'inverse_sqrt', 'linear']" in err
    assert "lr: must be > 0" in err
    assert not (workdir / "run").exists()


def test_window_zero_is_rejected_naming_window(workdir, monkeypatch, capsys):
    _no_training(monkeypatch)
    assert main(["run", str(workdir / "exp.yaml"), "--set", "model.window=0", "--out", str(workdir / "run")]) == 2
    err = capsys.readouterr().err
    assert "window: must be >= 1" in err
    assert not (workdir / "run").exists()


@pytest.mark.parametrize(
    "override, words",
    [
        ("model.nonsense=1", ["nonsense", "unknown field"]),
        ("modle.norm=rmsnorm", ["modle.norm", "model.FIELD"]),
        ("task.dataset=imagenet", ["dataset", "'imagenet'", "tinyshakespeare", "wikitext-2"]),
        ("model.n_layers=two", ["n_layers", "'two' is not a valid int"]),
    ],
)
def test_other_bad_overrides_exit_2(workdir, monkeypatch, capsys, override, words):
    _no_training(monkeypatch)
    assert main(["run", str(workdir / "exp.yaml"), "--set", override, "--out", str(workdir / "run")]) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err
    assert not (workdir / "run").exists()


def test_missing_config_file_exits_2(workdir, capsys):
    assert main(["run", str(workdir / "nope.yaml")]) == 2
    assert "nope.yaml does not exist" in capsys.readouterr().err


def test_missing_data_exits_2_with_the_data_error(workdir, capsys):
    empty = workdir / "empty-data"  # a data folder without this dataset, and no hub: one error naming both
    empty.mkdir()
    out = workdir / "run"
    code = main(["run", str(workdir / "exp.yaml"), "--data-dir", str(empty), "--out", str(out),
                 "--cache-dir", str(workdir / "cache")])
    assert code == 2
    err = capsys.readouterr().err
    assert "dataset 'tinyshakespeare' is not available." in err
    assert "offline mode (HF_HUB_OFFLINE=1)" in err
    assert "tinyshakespeare/input.txt" in err
    assert "--data-dir" in err and "STUDY_DATA_DIR" in err
    assert not out.exists()


def test_no_data_dir_at_all_exits_2(workdir, capsys):
    code = main(["run", str(workdir / "exp.yaml"), "--out", str(workdir / "run"), "--cache-dir", str(workdir / "c")])
    assert code == 2
    err = capsys.readouterr().err
    assert "dataset 'tinyshakespeare' is not available." in err
    assert "no data folder given" in err
    assert not (workdir / "run").exists()


def test_run_trains_and_prints_a_summary(workdir, capsys):
    import random

    rng = random.Random(1)
    text = "".join(f"ROMEO:\n{' '.join(rng.choice(['my', 'love', 'night', 'fair', 'day']) for _ in range(6))}.\n\n"
                   for _ in range(80))
    (workdir / "data" / "tinyshakespeare").mkdir(parents=True)
    (workdir / "data" / "tinyshakespeare" / "input.txt").write_text(text)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = main(["run", str(workdir / "exp.yaml"), "--set", "train.lr=2e-3", "--set", "model.position=rope",
                     "--data-dir", str(workdir / "data"), "--out", str(workdir / "run"),
                     "--cache-dir", str(workdir / "cache")])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    stdout = capsys.readouterr().out
    summary = json.loads(stdout[stdout.index("{"):])
    assert summary["run_dir"] == str(workdir / "run") and summary["status"] == "completed" and summary["steps"] == 2
    assert set(summary) >= {"valid_loss", "valid_ppl"} and "test_loss" not in summary  # Tiny Shakespeare: no test
    metrics = json.loads((workdir / "run" / "metrics.json").read_text())
    assert metrics["metrics"]["valid_loss"] == summary["valid_loss"]
    saved = yaml.safe_load((workdir / "run" / "config.yaml").read_text())
    assert saved["train"]["lr"] == 2e-3 and saved["model"]["position"] == "rope"
    assert not Path(workdir / "runs").exists()  # --out was used, not the default

    # the same command again: the finished run is not repeated, and says so; a different config conflicts
    assert main(["run", str(workdir / "exp.yaml"), "--set", "train.lr=2e-3", "--set", "model.position=rope",
                 "--data-dir", str(workdir / "data"), "--out", str(workdir / "run")]) == 0
    assert json.loads((workdir / "run" / "metrics.json").read_text()) == metrics
    assert f"{workdir / 'run'} already finished (completed); nothing to do" in capsys.readouterr().err
    capsys.readouterr()
    assert main(["run", str(workdir / "exp.yaml"), "--data-dir", str(workdir / "data"),
                 "--out", str(workdir / "run")]) == 2
    assert "different config" in capsys.readouterr().err


def test_axes_lists_every_axis(capsys):
    assert main(["axes"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if not line.startswith(" ")]  # indented lines describe values
    choices = axis_choices()
    assert len(lines) == len(choices)
    for line, (axis, values) in zip(lines, choices.items()):
        name, _, rest = line.partition(": ")
        assert name == axis
        assert rest.strip() == ", ".join(values)
    assert "    alibi        linear distance penalty" in out  # each registered value with its description


def test_presets_lists_the_six_presets(capsys):
    assert main(["presets"]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.split() == ["preset", "arch", "norm_position", "norm", "position", "activation", "attention",
                              "window"]  # the model fields they set
    assert len(PRESETS) == 6
    assert [line.split()[0] for line in lines] == list(PRESETS)
    assert set(PRESETS) == {"vaswani", "bert", "gpt2", "t5", "llama2", "mistral"}
    by_name = {line.split()[0]: line for line in lines}
    assert "encoder-decoder" in by_name["vaswani"] and "sinusoidal" in by_name["vaswani"]
    assert by_name["mistral"].split()[-1] == "4096" and by_name["llama2"].split()[-1] == "null"
    assert "rmsnorm" in by_name["llama2"] and "swiglu" in by_name["llama2"]


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2


@pytest.mark.parametrize("flag,value", [("--workers", "0"), ("--workers", "-1"), ("--threads", "-2"),
                                        ("--workers", "two")])
def test_a_sweep_with_no_worker_or_thread_is_refused_before_anything_runs(workdir, capsys, flag, value):
    with pytest.raises(SystemExit) as stop:
        main(["sweep", str(workdir / "exp.yaml"), flag, value])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "must be an integer >= 1" in err and "Traceback" not in err
    assert not (workdir / "results").exists()


@pytest.mark.parametrize("url", [
    "postgresql://alice:s3cret@db.example:5432/study",
    "postgresql://:s3cret@db.example/study",
    "postgresql://postgres@db.example:5432/study?password=s3cret",
    "postgresql://postgres@db.example/study?sslmode=require&PASSWORD=s3cret&connect_timeout=3",
    "could not connect to 'postgresql+psycopg://bob:s3cret@10.0.0.1/db': timeout",
])
def test_no_form_of_a_storage_password_survives_redaction(url):
    from study.sweep.storage import redact

    assert "s3cret" not in redact(url) and "***" in redact(url)
    assert redact("sqlite:///results/t/study.db") == "sqlite:///results/t/study.db"


@pytest.mark.parametrize("text,words", [
    ("- a\n- b\n", ["bad.yaml", "got list"]),                                   # a list at the top
    ("", ["bad.yaml", "got an empty file"]),                                      # nothing: not the defaults
    ("model: {preset: gpt2}\ntrain: {max_steps: 5}\n", ["bad.yaml", "no task"]),  # no task: not the defaults
    ("model: 5\ntask: {name: lm, dataset: tinyshakespeare}\ntrain: [1, 2]\n",
     ["model: must be a mapping of fields, got int 5", "train: must be a mapping of fields, got list [1, 2]"]),
    ("model: {preset: [llama2]}\ntask: {name: lm, dataset: tinyshakespeare}\n", ["model.preset: unknown preset"]),
    ("model: {preset: gpt2, d_model: ~, n_heads: ~, tie_embeddings: ~, nsp: ~}\n"
     "task: {name: lm, dataset: tinyshakespeare}\n",
     ["model.d_model: must be an integer, got null", "model.n_heads: must be an integer, got null",
      "model.tie_embeddings: must be true or false, got null", "model.nsp: must be true or false, got null"]),
    ("model: {preset: llama2, rope_theta: .inf, norm_eps: .nan}\ntask: {name: lm, dataset: tinyshakespeare}\n",
     ["model.rope_theta: inf is not a valid float", "model.norm_eps: nan is not a valid float"]),
])
def test_a_malformed_config_file_is_one_clear_error_listing_every_problem(workdir, monkeypatch, capsys, text, words):
    _no_training(monkeypatch)
    (workdir / "bad.yaml").write_text(text)
    assert main(["run", str(workdir / "bad.yaml"), "--out", str(workdir / "run")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(w in err for w in words), err
    assert not (workdir / "run").exists()


@pytest.mark.parametrize("argv", [["run", "exp.yaml", "--set", "model.d_model={a: 1"],
                                  ["run", "exp.yaml", "--set", "model.d_model=null"]])
def test_an_override_that_is_not_a_value_names_its_field(workdir, monkeypatch, capsys, argv):
    _no_training(monkeypatch)
    assert main([*argv, "--out", str(workdir / "run")]) == 2
    err = capsys.readouterr().err
    assert "model.d_model" in err and "Traceback" not in err


def test_a_sweep_override_that_is_not_a_value_names_its_field(workdir, capsys):
    assert main(["sweep", "exp.yaml", "--set", "seeds=[0,"]) == 2
    err = capsys.readouterr().err
    assert "override seeds" in err and "not a YAML value" in err and "Traceback" not in err
    assert not (workdir / "results").exists()


def test_an_interrupted_forced_run_is_resumed_by_the_command_without_force(tmp_path):
    """Given again, --force would discard the checkpoint (and a pipeline's finished stages) once more."""
    from study.cli import _resumes_from

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "last.ckpt").write_bytes(b"")
    said = _resumes_from(tmp_path / "run", forced=True)
    assert "the same command without --force resumes" in said and "start again from scratch" in said
    assert "the same command resumes" in _resumes_from(tmp_path / "run")


@pytest.mark.parametrize("argv, flag", [
    (["sweep", "experiments/ablation_default.yaml", "--dry-run", "--peak-flops", "0"], "--peak-flops"),
    (["sweep", "experiments/ablation_default.yaml", "--dry-run", "--peak-flops", "nan"], "--peak-flops"),
    (["report", "results/default", "--formats", "jpg"], "--formats"),
])
def test_a_rate_or_a_figure_format_that_cannot_be_is_refused_by_the_parser(argv, flag, capsys):
    """--peak-flops 0 divided the time estimate by zero (a traceback), -1 or nan printed a negative or nan time; an
    unknown figure format failed after every figure was drawn."""
    from study.cli import main

    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2 and flag in capsys.readouterr().err


def test_a_report_drawn_in_svg_alone_embeds_its_svgs(tmp_path):
    """`--formats svg` failed at the first figure: the report embedded each figure's PNG."""
    from study.report.figures import FigureInfo

    svg = tmp_path / "f.svg"
    assert FigureInfo("f", "t", "metric", "lm", "norm", [], paths=[svg]).png == svg
