"""Review of configs, commands and files as input: what a user wrote is what runs, or one clear error says why not.

A YAML key written twice dropped the first (a whole `model:` section) without a word; a pipeline without `name:` was
refused for a null nobody wrote; an empty stage, a damaged sweep base, a damaged metrics.json, or a file named `runs`
gave tracebacks; a sweep spec without `name:` ran in `results/sweep` while `study status SPEC` looked in
`results/<stem>`; `--set name=..` made the working directory the run directory; `study score-mt --limit 5` replaced
a full score; a kill during a checkpoint write left a checkpoint-sized temporary file in the run directory for good."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

import study.tasks.score_mt
from study.cli import main
from study.config import ConfigError, ExperimentConfig, load_experiment
from study.io import atomic_write_json, load_yaml, read_json_or_none
from study.record import RunDir
from study.sweep.plan import SweepSpecError, expand, load_spec
from tests.test_cli import _no_training, workdir  # noqa: F401  (a fixture, a helper)

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
TINY = {"model": {"preset": "gpt2", "d_model": 64, "n_layers": 2, "n_heads": 2, "max_seq_len": 64},
        "task": {"name": "lm", "dataset": "tinyshakespeare", "seq_len": 32, "eval_lengths": [1]}}


def test_a_key_written_twice_is_refused_naming_it_and_both_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("name: dup\nmodel: {preset: gpt2, d_model: 64}\ntask: {name: lm, dataset: tinyshakespeare}\n"
                    "model: {dropout: 0.0}\n")
    with pytest.raises(ConfigError, match=r"found the key 'model' twice \(first on line 2\)"):
        load_experiment(path)
    with pytest.raises(yaml.YAMLError, match="found the key 'lr' twice"):
        load_yaml("train:\n  lr: 1.0e-3\n  lr: 1.0e-4\n")
    assert load_yaml("a: &x {b: 1}\nc:\n  <<: *x\n  b: 2\n") == {"a": {"b": 1}, "c": {"b": 2}}  # a merge overrides


def _pipeline(tmp_path, stages) -> Path:
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    return path


def test_a_pipeline_without_a_name_is_named_as_in_python_and_an_empty_stage_is_refused_by_name(tmp_path):
    encoder = {"arch": "encoder", "objective": "mlm"}
    stages = {"pretrain": {"model": encoder, "task": {"name": "pretrain", "dataset": "wikitext-2", "vocab_size": 1000}},
              "glue": {"model": encoder, "task": {"name": "glue", "dataset": "sst2", "init_from": "stage:pretrain"}}}
    assert load_experiment(_pipeline(tmp_path, stages)).name == "pipeline"
    with pytest.raises(ConfigError, match="stages.glue: must be a mapping of sections"):
        load_experiment(_pipeline(tmp_path, {"lm": TINY, "glue": ["task"]}))
    with pytest.raises(ConfigError, match="stages: must be a mapping of sections .* by stage name"):
        load_experiment(_pipeline(tmp_path, ["lm", "glue"]))


@pytest.mark.parametrize("base, words", [
    ("model: {d_model: [", "not valid YAML"),
    ("- a\n- b\n", "holds a list, not an experiment"),
    (None, "is a folder, not an experiment YAML"),
])
def test_a_sweep_base_that_is_no_experiment_is_refused_naming_it(tmp_path, base, words):
    if base is not None:
        (tmp_path / "base.yaml").write_text(base)
    spec = {"name": "s", "base": "base.yaml" if base is not None else str(tmp_path), "seeds": [0],
            "axes": {"model.norm": ["layernorm", "rmsnorm"]}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(SweepSpecError, match=words):
        expand(*load_spec(tmp_path / "spec.yaml"))


def test_a_sweep_spec_without_a_name_runs_where_status_and_results_look(tmp_path):
    (tmp_path / "positions.yaml").write_text(yaml.safe_dump({"base": str(EXPERIMENTS / "ablation_base.yaml"),
                                                             "axes": {"model.norm": ["layernorm", "rmsnorm"]}}))
    spec, _ = load_spec(tmp_path / "positions.yaml")
    assert spec.name == "positions"


@pytest.mark.parametrize("name", ["..", "."])
def test_a_name_of_dots_alone_is_refused_as_it_would_name_the_working_directory(name):
    with pytest.raises(ConfigError, match="not dots alone"):
        ExperimentConfig.from_dict({**TINY, "name": name})
    ExperimentConfig.from_dict({**TINY, "name": "v1.2"})


def test_a_damaged_record_reads_as_no_record(tmp_path):
    (tmp_path / "metrics.json").write_bytes(b"\xff\xfe\x00")
    assert read_json_or_none(tmp_path / "metrics.json") is None and RunDir(tmp_path).read() is None
    (tmp_path / "metrics.json").write_text("[1]")
    assert RunDir(tmp_path).read() is None and RunDir(tmp_path).finished() is None


def test_study_results_names_a_record_of_a_newer_schema_instead_of_a_traceback(tmp_path, capsys):
    import shutil

    from study.sweep.layout import SweepLayout

    sweep = tmp_path / "default"
    shutil.copytree(Path(__file__).resolve().parents[1] / "results" / "default", sweep)
    plan = json.loads((sweep / "plan.json").read_text())
    record = SweepLayout(sweep).run_dir(plan["points"][0]["point"], plan["seeds"][0]) / "metrics.json"
    atomic_write_json(record, {"schema": 99, "status": "completed", "metrics": {}})
    assert main(["results", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert "study results:" in err and "schema" in err and str(record) in err


def test_a_file_in_the_way_of_the_default_run_directory_is_refused_before_training(workdir, monkeypatch, capsys):
    _no_training(monkeypatch)
    (workdir / "runs").write_text("")
    assert main(["run", str(EXPERIMENTS / "shakespeare_char_gpt2.yaml")]) == 2
    assert "run directory runs/shakespeare-char-gpt2 lies under runs, which is a file" in capsys.readouterr().err


def test_a_partial_newstest_score_does_not_replace_the_full_one(workdir, monkeypatch):
    def scored(model, src, tgt, data_dir, beam_size, batch_size, limit):
        return {"model": model, "sentences": limit or 3003, "bleu": 1.0, "bleu_signature": "-", "chrf": 1.0,
                "decode_seconds": 0.0}

    monkeypatch.setattr(study.tasks.score_mt, "score_newstest2014", scored)
    assert main(["score-mt", "org/model"]) == 0 and main(["score-mt", "org/model", "--limit", "5"]) == 0
    full, partial = (json.loads(p.read_text())["sentences"] for p in (
        workdir / "runs" / "newstest2014-de-en-model-beam4.json",
        workdir / "runs" / "newstest2014-de-en-model-beam4-first5.json"))
    assert (full, partial) == (3003, 5)


def test_a_killed_writes_temporary_file_is_removed_when_the_run_starts_again(tmp_path):
    run = RunDir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    killed = [tmp_path / "checkpoints" / ".last.ckpt.k1x2.tmp", tmp_path / ".model.pt.a9b8.tmp"]
    kept = [tmp_path / ".trial.json.q7.tmp",  # a sweep worker's, written under trial.json's lock while the run trains
            tmp_path / ".metrics.json.n3.tmp"]  # being written now (new)
    for p in killed + kept:
        p.write_bytes(b"x" * 10)
    old = time.time() - 3600
    for p in [*killed, kept[0]]:
        os.utime(p, (old, old))
    assert sorted(run.remove_stale_temp_files()) == sorted(killed)
    assert all(p.exists() for p in kept) and not any(p.exists() for p in killed)


def test_values_are_named_with_the_field_they_belong_to():
    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_dict({"model": {"arch": "encoder-decoder"},
                                    "task": {"name": "translation", "dataset": "multi30k", "tokenizer": "bpe",
                                             "vocab_size": 1000, "max_len_a": -1}})
    assert "task.max_len_a: must be >= 0, got -1" in str(err.value) and "max_len_b" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        ExperimentConfig.from_dict({**TINY, "task": {**TINY["task"], "eval_lengths": None},
                                    "train": {"max_time_s": 10**400}})
    text = str(err.value)
    assert "task.eval_lengths: must be a list (write [] for none), got null" in text
    assert "train.max_time_s: 1000000" in text and "is not a valid float" in text


def test_one_glue_suite_spelled_two_ways_is_one_run_to_the_duplicate_check():
    """The suite runs the set of tasks however they are spelled or ordered, and a per-task 3 and 3.0 set one value:
    a plan must find such points to be one run (same_run_hash), though their directories keep their names."""
    from study.config.hashing import same_run_hash
    from study.config.task import GLUE_DATASETS

    def suite(**task):
        return ExperimentConfig.from_dict({"model": {"arch": "encoder", "objective": "mlm"},
                                           "task": {"name": "glue", "dataset": "glue", "vocab_size": 1000, **task}})

    one = suite(glue_tasks=["SST-2", "CoLA"], per_task={"cola": {"task.epochs": 3}})
    other = suite(glue_tasks=["cola", "sst2", "sst-2"], per_task={"CoLA": {"task.epochs": 3.0}})
    assert same_run_hash(one) == same_run_hash(other)
    assert same_run_hash(suite(glue_tasks=list(GLUE_DATASETS))) == same_run_hash(suite())
    assert same_run_hash(suite(glue_tasks=["sst2"])) != same_run_hash(suite(glue_tasks=["cola"]))


def test_a_section_given_as_a_mapping_in_python_names_its_own_problems():
    with pytest.raises(ConfigError) as err:
        ExperimentConfig(model={"d_model": "abc"})
    assert "model.d_model: 'abc' is not a valid int" in str(err.value)


def test_a_sweep_specs_stage_keys_in_a_pipeline_for_study_run_are_named_as_such(tmp_path):
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump({"name": "p", "stages": {"pretrain": {"base": "x.yaml", "set": {}},
                                                            "glue": {"base": "y.yaml", "init_from": "pretrain"}}}))
    with pytest.raises(ConfigError, match="keys of a sweep spec's stages; a pipeline YAML for `study run` writes each "
                                          "stage out in full, as experiments/pretrain_then_glue.yaml"):
        load_experiment(path)


def test_the_not_comparable_note_says_what_the_differing_field_changes():
    from study.report.markdown import Doc, _defined_differently_note

    doc = Doc()
    _defined_differently_note(doc, {"metric.pretrain.valid_mlm_loss": {"model.nsp": ["false", "true"]}})
    text = doc.blocks[-1][1]
    assert "another input format (segment pairs or full sentences)" in text and "another vocabulary" not in text


def test_a_suite_parts_own_data_error_names_the_part(tmp_path, monkeypatch):
    """A vocabulary one GLUE task's text cannot fill failed the suite, after the tasks before it had trained, with
    no word of which task."""
    import study.run.suite
    from study.tasks.data import DataError

    called = []

    def too_small(cfg, run_dir, **kwargs):  # the part's own run meets the data error (the pre-flight check passed)
        called.append(Path(run_dir))
        raise DataError("vocab_size=1000 is more than this data yields")

    monkeypatch.setattr(study.run.suite, "run_single", too_small)
    cfg = ExperimentConfig.from_dict({"name": "g", "model": {"arch": "encoder", "objective": "mlm"},
                                      "task": {"name": "glue", "dataset": "glue", "glue_tasks": ["wnli"],
                                               "vocab_size": 1000}})
    data = Path(__file__).resolve().parents[2] / "shared" / "data"
    if not (data / "glue" / "WNLI").is_dir():
        pytest.skip("real GLUE data not found")
    with pytest.raises(DataError, match=r"g: part WNLI/seed0: vocab_size=1000 is more than this data yields"):
        study.run.suite.run_suite(cfg, tmp_path / "g", data_dir=data, cache_dir=tmp_path / "cache")
    assert called == [tmp_path / "g" / "WNLI" / "seed0"]


def test_a_suite_refuses_a_vocabulary_a_later_task_cannot_fill_before_its_first_part_trains(tmp_path, monkeypatch):
    """From scratch, each task trains its own tokenizer: RTE's text fills 4,000 WordPiece tokens, WNLI's cannot. The
    suite found out only when it reached WNLI, after RTE had trained; every part's tokenizer is trained (into the
    cache its run reads back) before the first part runs."""
    import study.run.suite
    from study.tasks.data import DataError

    trained = []
    monkeypatch.setattr(study.run.suite, "run_single", lambda cfg, run_dir, **kw: trained.append(run_dir))
    cfg = ExperimentConfig.from_dict({"name": "g", "model": {"arch": "encoder", "objective": "mlm"},
                                      "task": {"name": "glue", "dataset": "glue", "glue_tasks": ["rte", "wnli"],
                                               "vocab_size": 4000}})
    data = Path(__file__).resolve().parents[2] / "shared" / "data"
    if not (data / "glue" / "WNLI").is_dir() or not (data / "glue" / "RTE").is_dir():
        pytest.skip("real GLUE data not found")
    with pytest.raises(DataError, match=r"g: part WNLI/seed0: vocab_size=4000 is more than this data yields"):
        study.run.suite.run_suite(cfg, tmp_path / "g", data_dir=data, cache_dir=tmp_path / "cache")
    assert trained == []
    cached = [p for p in (tmp_path / "cache" / "tokenizers").glob("wordpiece-4000-*.json") if ".meta" not in p.name]
    assert len(cached) == 1  # RTE's, which its run reads back


def test_a_comparison_without_paired_tests_says_so_instead_of_dividing_by_zero():
    from study.report.compare import holm_sentence

    assert "0.05/0" not in holm_sentence(0) and "No paired test was made" in holm_sentence(0)
    assert "0.05/3, the next with 0.05/2" in holm_sentence(3)


def test_the_status_table_keeps_its_columns_under_long_point_labels():
    import pandas as pd

    from study.sweep.results import summary

    labels = ["norm_position=pre,warmup=with,attention=mha", "baseline"]
    df = pd.DataFrame({"label": [labels[0], labels[0], labels[1]], "status": ["completed", "queued", "completed"],
                       "metric.bleu": [19.0, None, 18.0]})
    header, *rows = summary(df, "bleu").splitlines()
    # every row's status text starts under the header's "status", the long label's row too
    assert rows[0].index("completed 1, queued 1") == rows[1].index("completed 1") == header.index("status"), rows
    assert [r.split()[0] for r in rows] == labels


def test_two_axes_named_alike_by_their_field_paths_are_refused_naming_both_as_written(tmp_path):
    """A field path's axis is named by its last part: pretrain.train.lr and glue.train.lr were refused as
    `axes.lr: two axes have this name`, an axis the spec never wrote, with no way out."""
    from test_sweep_refusals import LM, refused

    text = refused(tmp_path, **LM, axes={"model.norm": ["rmsnorm", "layernorm"],
                                         "norm": {"pre": {"model.norm_position": "pre"},
                                                  "post": {"model.norm_position": "post"}}})
    assert "axes.norm: two axes have this name (model.norm and norm)" in text
    assert "norm_2: {field: model.norm, values: [...]}" in text


def test_a_progress_bar_axis_is_refused_as_reaching_no_model(tmp_path):
    from test_sweep_refusals import LM, refused

    text = refused(tmp_path, **LM, axes={"train.progress_bar": [True, False], "model.norm": ["rmsnorm", "layernorm"]})
    assert "axes.progress_bar: train.progress_bar does not reach the trained model" in text


def test_an_axis_with_values_and_no_field_is_told_the_field_is_missing(tmp_path):
    from test_sweep_refusals import LM, plan_of

    from study.sweep import SweepSpecError

    with pytest.raises(SweepSpecError, match=r"axes.win: has values \[16, 32\] but no field"):
        plan_of(tmp_path, **LM, axes={"model.norm": ["rmsnorm", "layernorm"],
                                      "win": {"values": [16, 32], "when": {"norm": "rmsnorm"}}})
