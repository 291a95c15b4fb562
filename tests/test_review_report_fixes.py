"""What three reviews of this session found, as specifications. The report: a field one cell leaves unset and
another sets is defined differently (unset is a value of its own, as the sweep's plan counts it), and so is a GLUE
score averaged over other tasks (recorded at run time); a grid's baseline is its first planned point, with that
point's own axis values, where an `exclude` rule removed the all-first cell; a report with no value of the objective
leaves no earlier report's summary.csv or paired.csv behind; completed trials without a figure are not said never to
have completed; interrupted trials are told from those that never ran. The run layer and CLI: `study run` refuses a
`--set` the task replaces; `init_from` a pipeline's folder names its stages; Ctrl-C in a pipeline with finished stages
says they are kept. The sweep: an objective whose data cannot be read is refused before any trial."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import pytest
import pandas as pd

matplotlib.use("Agg")

from study.report import build_report  # noqa: E402
from study.report.collect import load_results  # noqa: E402
from synthetic_sweep import make_synthetic_sweep  # noqa: E402

GRID = {"norm_position": ["pre", "post"], "position": ["rope", "alibi"]}


def _sweep(tmp_path: Path, **kw) -> Path:
    return make_synthetic_sweep(tmp_path / "s", partial=False, problems=False, with_runs=False, **kw)


def _edit_plan(root: Path, edit) -> None:
    plan = json.loads((root / "plan.json").read_text())
    edit(plan)
    (root / "plan.json").write_text(json.dumps(plan))


def _edit_table(root: Path, edit) -> None:
    table = edit(pd.read_parquet(root / "results.parquet"))
    table.to_parquet(root / "results.parquet", index=False)
    (root / "results.csv").unlink(missing_ok=True)


def test_a_field_one_cell_leaves_unset_and_another_sets_defines_the_metric_differently(tmp_path):
    """task.eval_tokens: null is the whole split; 32768 its first tokens: two losses over different text."""
    root = _sweep(tmp_path, axes={"norm": ["rmsnorm", "layernorm"]})

    def cap_baseline_only(plan):
        for point in plan["points"]:
            point["config"]["task"]["eval_tokens"] = 32768 if point["is_baseline"] else None
    _edit_plan(root, cap_baseline_only)
    r = load_results(root)
    assert r.defined_differently("metric.valid_loss", "lm", ["baseline", "norm=layernorm"]) == {
        "task.eval_tokens": ["32768", "(unset)"]}
    assert r.defined_differently("metric.valid_loss", "lm", ["norm=layernorm"]) == {}
    paired = pd.read_csv(build_report(root, tmp_path / "out", kinds=()).out / "paired.csv")
    assert paired.query("metric == 'valid_loss'").set_index("label").loc["norm=layernorm", "verdict"] == \
        "not comparable"


def test_a_grid_whose_all_first_cell_is_excluded_holds_its_baseline_at_the_first_planned_points_values(tmp_path):
    root = _sweep(tmp_path, design="grid", axes=GRID)
    first = "norm_position=pre,position=rope"

    def drop_first(plan):
        assert plan["points"][0]["label"] == first
        plan["points"] = plan["points"][1:]
    _edit_plan(root, drop_first)
    _edit_table(root, lambda t: t[t["label"] != first].reset_index(drop=True))
    r = load_results(root)
    assert r.baseline_label == "norm_position=pre,position=alibi"
    assert r.baseline_values() == {"norm_position": "pre", "position": "alibi"}  # was position=rope: never ran
    assert [label for _, label in r.axis_labels("norm_position")] == [
        "norm_position=pre,position=alibi", "norm_position=post,position=alibi"]


def test_a_report_without_a_value_of_the_objective_removes_an_earlier_reports_tables(tmp_path):
    root = _sweep(tmp_path, axes={"norm": ["rmsnorm", "layernorm"]})
    out = tmp_path / "out"
    first = build_report(root, out, kinds=())
    assert {p.name for p in first.tables} == {"summary.csv", "paired.csv"}
    _edit_table(root, lambda t: t.drop(columns=["metric.valid_loss"]))
    again = build_report(root, out, kinds=())
    assert again.tables == [] and not (out / "summary.csv").exists() and not (out / "paired.csv").exists()


def test_completed_trials_without_a_figure_are_not_said_never_to_have_completed(tmp_path):
    root = _sweep(tmp_path, axes={"norm": ["rmsnorm", "layernorm"]})
    _edit_table(root, lambda t: t.drop(columns=["metric.valid_loss"]))
    md = build_report(root, tmp_path / "out", kinds=("paired", "metric")).markdown.read_text()
    figures = md.split("## Figures", 1)[1]
    assert "no trial has completed yet" not in figures
    assert "No figures: none could be drawn from the completed trials." in figures
    assert "valid_loss: paired differences (lm): no completed trial has a value of valid_loss" in figures


def test_a_glue_score_averaged_over_other_tasks_than_the_baselines_is_not_comparable(tmp_path):
    """Which tasks a suite scores is decided at run time (those whose data it could read; the hub may be
    reachable for one trial and not another): glue_score declares the recorded glue_score_tasks among what defines
    it, and a cell whose trials averaged other tasks gets no verdict."""
    from synthetic_sweep import make_nsp_glue_sweep

    root = make_nsp_glue_sweep(tmp_path / "nsp")
    r = load_results(root)
    assert r.defined_differently("metric.glue_score", "glue", ["baseline", "nsp=false"]) == {}
    _edit_table(root, lambda t: t.assign(**{"metric.glue_score_tasks": t["metric.glue_score_tasks"].where(
        (t["label"] != "nsp=false") | (t["seed"] != 1), "CoLA,MRPC,QNLI")}))
    r = load_results(root)
    assert r.defined_differently("metric.glue_score", "glue", ["baseline", "nsp=false"]) == {
        "metric.glue_score_tasks": ["cola,mrpc", "cola,mrpc | cola,mrpc,qnli"]}
    paired = pd.read_csv(build_report(root, tmp_path / "out", kinds=()).out / "paired.csv")
    assert paired.query("metric == 'glue_score'").set_index("label").loc["nsp=false", "verdict"] == "not comparable"


def test_study_run_refuses_a_set_the_task_replaces_before_anything_runs(tmp_path, capsys):
    """GLUE fine-tuned from a pretrained stage takes its architecture from there: `--set glue.model.norm=rmsnorm`
    ran layernorm, and config.yaml said so, with no word to the user (`study sweep` refuses it in a spec's `set`)."""
    import yaml

    from study.cli import main
    from test_pipeline import stages

    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"name": "p", "stages": stages()}, sort_keys=False))
    assert main(["run", str(path), "--set", "glue.model.norm=rmsnorm", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--set glue.model.norm: replaced when the task resolves the config (asked 'rmsnorm', runs " \
           "'layernorm'): task.init_from takes the architecture from the pretrained run" in err
    assert not (tmp_path / "run").exists()


def test_the_status_sentence_tells_interrupted_trials_from_those_that_never_ran(tmp_path):
    """After a Ctrl-C or kill -9 the report said '4 pending (never ran)' while its own table said two of them had
    an attempt interrupted."""
    from study.report.markdown import status_sentence

    root = make_synthetic_sweep(tmp_path / "s", partial=True, problems=False, with_runs=False)
    why = "last attempt interrupted: its worker (host/1) is gone; rerunning `study sweep` resumes it"
    _edit_table(root, lambda t: t.assign(status=t["status"].replace("running", "pending"),
                                         error=t["error"].where(t["status"] != "running", why)))
    sentence = status_sentence(load_results(root))
    assert sentence.endswith("; 4 pending (3 never ran, 1 interrupted: rerunning `study sweep` resumes it)"), sentence
    _edit_table(root, lambda t: t.assign(error=t["error"].where(t["status"] != "pending", why)))
    r = load_results(root)
    r.table = r.table[r.table["status"].isin(["completed"]) | r.table["error"].fillna("").str.startswith("last")]
    assert status_sentence(r).endswith("; 1 pending (interrupted: rerunning `study sweep` resumes it)")


def test_init_from_a_pipelines_folder_names_where_its_stages_ran(tmp_path):
    from study.tasks.glue.pretrained import pretrained_config

    folder = tmp_path / "pipe"
    folder.mkdir()
    (folder / "metrics.json").write_text(json.dumps({"status": "completed", "stages": {
        "pretrain": {"run_dir": "pipe/stages/abc/seed-0"}, "glue": {"run_dir": "pipe/glue"}}}))
    with pytest.raises(ValueError, match=r"is a pipeline's folder, whose stages ran in pretrain: pipe/stages/abc/"
                                         r"seed-0, glue: pipe/glue; give the pretraining stage's directory"):
        pretrained_config(folder)


def test_an_interrupted_pipeline_with_finished_stages_is_said_to_go_on_not_to_run_again(tmp_path):
    """Ctrl-C after the pretraining stage finished (and before any fine-tuning checkpoint) said the same command
    'runs the pipeline again (no checkpoint had been written)', as if the pretraining were lost."""
    from study.cli import _resumes_from
    from study.record import COMPLETED, RunDir, make_record

    stage = tmp_path / "run" / "stages" / "abc" / "seed-0"
    stage.mkdir(parents=True)
    RunDir(stage).write(make_record(COMPLETED, {"valid_mlm_loss": 4.0}, {"parameters": 1}, steps=3))
    said = _resumes_from(tmp_path / "run")
    assert said == f"no result recorded; the same command goes on with {tmp_path / 'run'} (its 1 finished run(s) " \
                   "inside are kept), starting the rest"


def test_an_objective_of_a_glue_task_whose_data_cannot_be_read_is_refused_before_any_trial_starts(tmp_path):
    """The suite skips a task it cannot read and scores the others: with that task's metric as the objective every
    trial trained, then failed for the missing objective (the data check passed: SST-2 could be read)."""
    import yaml

    from study.sweep import SweepOptions, SweepSpecError, run_sweep
    from test_glue_task import write_glue
    from test_sweep_refusals import GLUE

    data = write_glue(tmp_path / "data")  # QNLI without its training split
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "qnli", "base": GLUE["base"], "set": {**GLUE["set"], "task.glue_tasks": ["SST-2", "QNLI"]},
        "axes": {"train.weight_decay": [0.0, 0.01]}, "seeds": [0], "objective": {"metric": "QNLI/accuracy"}}))
    opts = SweepOptions(results=str(tmp_path / "results"), data_dir=str(data), estimate_rate=1e11)
    with pytest.raises(SweepSpecError, match=r"(?s)none was started.*QNLI/accuracy is never written: the suite "
                                             r"skips QNLI, whose data cannot be read"):
        run_sweep(spec, opts, say=lambda _: None)
    assert not (tmp_path / "results" / "qnli" / "runs").exists()
