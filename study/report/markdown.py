"""report.md and a standalone report.html, generated from the results (nothing is written by hand).

Both are rendered from one list of blocks (`Doc`), so the two never say different things.
"""

from __future__ import annotations

import datetime
import html
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from study.record import COSTS
from study.report.collect import Declaration, SweepResults, metric_column, metric_name, ran_off_plan
from study.report.family import NOT_COMPARABLE, PairedTest, family_size, paired_family
from study.report.figures import FigureInfo
from study.report.stats import (
    NO_SPREAD_TEST,
    NO_SPREAD_WHY,
    finite,
    no_spread_text,
    paired_differences,
    small_n_note,
    summarize,
    t_critical,
)

COST_COLUMNS = (  # column, header, formatter
    ("cost.parameters", "params", "int"),
    ("cost.train_flops_per_token", "train FLOPs/token", "sci"),
    # per token the cache grows (0 where every layer's window bounds it), and what it holds at the training length
    ("cost.kv_cache_bytes_per_token", "KV growth bytes/token", "int"),
    ("cost.kv_cache_bytes_at_seq_len", "KV bytes at seq_len", "int"),
    ("cost.train_tokens_per_s", "train tokens/s", "int"),
    ("cost.peak_memory_bytes", "peak memory (MiB)", "mib"),
    ("cost.wall_seconds", "wall time per trial (min)", "min"),
)


def fmt(x: Any, kind: str = "num") -> str:
    """Numbers for tables: 4 significant digits, thousands separators for integers, '–' for missing."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, str):
        return x
    x = float(x)
    if not math.isfinite(x):
        return str(x)
    if kind == "int":
        return f"{round(x):,}"
    if kind == "sci":
        return f"{x:.3g}"
    if kind == "mib":  # bytes in binary mebibytes (2**20), headed MiB: not the decimal MB (10**6) of a byte count
        return f"{x / 2**20:,.0f}"
    if kind == "min":
        return f"{x / 60:,.1f}"
    if kind == "signed":
        return f"{x:+.4g}"
    return f"{x:.4g}"


def fmt_uncertain(half_width: float, *values: float) -> list[str]:
    """`values` (a mean, an interval's ends) to the decimal of the half-width's second significant digit, and the
    half-width to two: 1.990 ± 0.063, not 1.99 ± 0.06288, whose digits past the uncertainty's say nothing."""
    decimals = max(0, 1 - math.floor(math.log10(abs(half_width)))) if half_width and math.isfinite(half_width) else 3
    return [f"{x:,.{decimals}f}" for x in (*values, half_width)]


# -- a tiny document model ---------------------------------------------------------------------------------
@dataclass
class Doc:
    blocks: list[tuple[str, Any]] = field(default_factory=list)

    def h(self, level: int, text: str): self.blocks.append(("h", (level, text)))
    def p(self, text: str): self.blocks.append(("p", text))
    def note(self, text: str): self.blocks.append(("note", text))
    def code(self, text: str, lang: str = ""): self.blocks.append(("code", (text, lang)))
    def ul(self, items: Iterable[str]): self.blocks.append(("ul", list(items)))
    def img(self, alt: str, path: str, links: list[tuple[str, str]]): self.blocks.append(("img", (alt, path, links)))

    def table(self, headers: list[str], rows: list[list[str]], align: str | None = None):
        self.blocks.append(("table", (headers, rows, align or "l" + "r" * (len(headers) - 1))))

    def to_markdown(self) -> str:
        out = []
        for kind, v in self.blocks:
            if kind == "h":
                out.append(f"{'#' * v[0]} {v[1]}")
            elif kind == "p":
                out.append(v)
            elif kind == "note":
                out.append("\n".join(f"> {line}" for line in v.splitlines()))
            elif kind == "code":
                out.append(f"```{v[1]}\n{v[0].rstrip()}\n```")
            elif kind == "ul":
                out.append("\n".join(f"- {i}" for i in v) if v else "- (none)")
            elif kind == "img":
                alt, path, links = v
                out.append(f"![{alt}]({path})\n\n" + " · ".join(f"[{t}]({u})" for t, u in links))
            elif kind == "table":
                headers, rows, align = v
                cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
                sep = ["---:" if a == "r" else "---" for a in align]
                lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "| " + " | ".join(sep) + " |"]
                lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
                out.append("\n".join(lines))
        return "\n\n".join(out) + "\n"

    def to_html(self, title: str) -> str:
        def inline(text: str) -> str:
            import re

            out = []
            for i, part in enumerate(re.split(r"`([^`]+)`", html.escape(text))):  # odd parts: code spans, as written
                if i % 2:
                    out.append(f"<code>{part}</code>")
                    continue
                part = re.sub(r"\[([^\]]+)\]\(([^)]+)\)", r'<a href="\2">\1</a>', part)
                part = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", part)
                out.append(re.sub(r"(?<![*\w])\*([^*\s][^*]*?)\*(?![*\w])", r"<em>\1</em>", part))  # *better*
            return "".join(out)

        body = []
        for kind, v in self.blocks:
            if kind == "h":
                body.append(f"<h{v[0]}>{inline(v[1])}</h{v[0]}>")
            elif kind == "p":
                body.append(f"<p>{inline(v)}</p>")
            elif kind == "note":
                body.append(f'<div class="note">{"<br>".join(inline(x) for x in v.splitlines())}</div>')
            elif kind == "code":
                body.append(f"<pre><code>{html.escape(v[0])}</code></pre>")
            elif kind == "ul":
                body.append("<ul>" + "".join(f"<li>{inline(i)}</li>" for i in v) + "</ul>")
            elif kind == "img":
                alt, path, links = v
                body.append(f'<figure><img src="{html.escape(path)}" alt="{html.escape(alt)}"><figcaption>'
                            + " · ".join(f'<a href="{html.escape(u)}">{html.escape(t)}</a>' for t, u in links)
                            + "</figcaption></figure>")
            elif kind == "table":
                headers, rows, align = v
                th = "".join(f"<th>{inline(str(h))}</th>" for h in headers)
                trs = "".join("<tr>" + "".join(f'<td class="{"r" if a == "r" else "l"}">{inline(str(c))}</td>'
                                               for c, a in zip(r, align)) + "</tr>" for r in rows)
                body.append(f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>")
        style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
                 "table{border-collapse:collapse;margin:1em 0;font-size:.9em}th,td{border:1px solid #ccc;"
                 "padding:.3em .6em}th{background:#f3f3f3}td.r{text-align:right;font-variant-numeric:tabular-nums}"
                 ".note{background:#fff6d6;border-left:4px solid #e0b000;padding:.6em 1em;margin:1em 0}"
                 "img{max-width:100%}figure{margin:1em 0}pre{background:#f6f6f6;padding:.8em;overflow:auto}")
        return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
                f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def scale_text(spec: Declaration) -> str:
    """'nats/token; lower is better': a column's declared scale and direction, for table headers."""
    return f"{spec.scale}; {spec.better} is better" if spec.scale else f"{spec.better} is better"


def secondary_columns(results: SweepResults, task: str, done: pd.DataFrame,
                      primary: str) -> list[tuple[str, Declaration]]:
    """The other quality metrics worth a column beside the objective: those declared by name, or by a one-level
    pattern (`*_ppl_at_2x`), that may rank a sweep and have values; never counts or bookkeeping. Families of
    columns (GLUE's `*/accuracy`, `test_sets.*.bleu`) stay out of the table (study compare has them)."""
    out = []
    for col in done.columns:
        if not col.startswith("metric.") or col == primary or not pd.api.types.is_numeric_dtype(done[col]) \
                or not done[col].notna().any():
            continue
        spec = results.declaration(col, task)
        if spec is None or not spec.objective or ("*" in spec.declared_as and any(c in spec.declared_as
                                                                                    for c in "/.")):
            continue
        out.append((col, spec))
    return out


def undeclared_columns(results: SweepResults, task: str, done: pd.DataFrame) -> list[str]:
    """Metric columns of numbers that no declaration covers: shown as 'direction not declared', never ranked
    (flags such as GLUE's glue_score_complete, and text, are not measurements)."""
    return [c for c in done.columns if c.startswith("metric.") and pd.api.types.is_numeric_dtype(done[c])
            and not pd.api.types.is_bool_dtype(done[c]) and done[c].notna().any()
            and results.declaration(c, task) is None]


# -- report sections -------------------------------------------------------------------------------------------
def status_sentence(results: SweepResults) -> str:
    c = results.status_counts
    total = sum(c.values())
    parts = [f"{c[s]} {s}" + (_pending_words(results) if s == "pending" else "")
             for s in ("running", "pending", "failed", "diverged") if c.get(s)]
    text = f"{c['completed']} of {total} planned trials completed"
    return text + ("; " + ", ".join(parts) if parts else "")


def _pending_words(results: SweepResults) -> str:
    """Which pending trials never ran and which ran an attempt that ended unfinished (its worker killed or lost:
    `study.sweep.results` says `last attempt ...`), which rerunning the sweep resumes."""
    table = results.table
    why = table.loc[table["status"] == "pending", "error"] if "error" in table else pd.Series(dtype=object)
    tried = int(why.fillna("").astype(str).str.startswith("last attempt").sum())
    never = int((table["status"] == "pending").sum()) - tried
    if not tried:
        return " (never ran)"
    resumed = "rerunning `study sweep` resumes " + ("it" if tried == 1 else "them")
    return f" ({never} never ran, {tried} interrupted: {resumed})" if never else f" (interrupted: {resumed})"


def _interval_text(row) -> tuple[str, str]:
    if row["n"] == 0:
        # completed runs that wrote no value are not "no run": a metric may not apply to a variant (NSP accuracy
        # without NSP); where the primary metric is missing, the problems section names the seeds
        done = int(row.get("n_rows", 0) or 0)
        if done:
            return f"not written by its {done} completed run{'s' if done > 1 else ''}", "–"
        return "no completed run", "–"
    if row["n"] == 1:
        return f"{fmt(row['mean'])} (n=1, no CI)", "–"
    if pd.isna(row["ci_lo"]):  # n equal values (stats.mean_ci): no interval, never ± 0 [d, d]
        return f"{fmt(row['mean'])}, {no_spread_text(int(row['n']))}", "–"
    mean, lo, hi, half = fmt_uncertain(row["ci_half"], row["mean"], row["ci_lo"], row["ci_hi"])
    return f"{mean} ± {half}", f"[{lo}, {hi}]"


def _env_lines(results: SweepResults) -> list[str]:
    lines = []

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            lines.append(f"`{prefix}`: {value}")

    walk("", results.plan.get("environment") or {})
    t = results.table
    for col in [c for c in t.columns if c.startswith(("env.", "data."))]:
        vals = [str(v) for v in t[col].dropna().unique() if str(v)]
        if len(vals) == 1:
            lines.append(f"`{col}` (every trial): {vals[0]}")
        elif len(vals) > 1:
            lines.append(f"`{col}`: **{len(vals)} different values across trials**: " + ", ".join(vals[:6]))
    return lines


def build_doc(results: SweepResults, figures: list[FigureInfo], out: Path, generated: str | None = None) -> Doc:
    doc = Doc()
    generated = generated or datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    doc.h(1, f"Sweep report: {results.sweep}")
    doc.p(f"Generated by `study report` from `{results.root}` ({results.source}) on {generated}. "
          "Every number, table and figure here is computed from the results table; nothing is written by hand.")
    if results.is_partial:
        doc.note(f"**Partial results: this sweep is still running or incomplete.** {status_sentence(results)}. "
                 "Every number below may change when it finishes.")
    elif results.status_counts["completed"] < len(results.table):
        doc.note(f"**Not every trial completed.** {status_sentence(results)}. The failed and diverged trials are "
                 "listed under *Trials that did not complete* and are left out of every mean.")
    unvalued = completed_without_value(results)
    if len(unvalued):
        doc.note(f"**{len(unvalued)} completed trial(s) wrote no value of the primary metric** "
                 f"({', '.join(sorted(set(unvalued['metric'])))}): they are named under *Trials that did not "
                 "complete* and are left out of the main table's means and of the primary metric's paired "
                 "differences; a table of another metric (a GLUE task's, perplexity at twice the length) counts "
                 "every seed that wrote it.")
    _sweep_section(doc, results)
    counts = results.status_counts
    doc.h(2, "Trials")
    doc.table(["status", "trials"], [[s, str(n)] for s, n in counts.items()], align="lr")
    family = paired_family(results)
    for task in results.tasks:
        _task_section(doc, results, task, figures, out, family)
    _problems_section(doc, results)
    doc.h(2, "Figures")
    drawn = [f for f in figures if f.paths]
    if drawn:
        doc.ul([f"{f.title} ({f.task}): " + " · ".join(f"[{p.suffix[1:].upper()}]({p.relative_to(out).as_posix()})"
                                                       for p in f.paths) for f in drawn])
    elif not counts.get("completed"):
        doc.p("No figures: no trial has completed yet.")
    else:
        doc.p("No figures: none could be drawn from the completed trials.")
    missing = [f for f in figures if not f.paths]
    if missing:
        doc.p("Figures not drawn, and why:")
        doc.ul([f"{f.title} ({f.task}): {f.reason}" for f in missing])
    return doc


def _sweep_section(doc: Doc, results: SweepResults) -> None:
    """Design, declared objective, seeds, axes (with the config fields each sets), the spec and environment."""
    doc.h(2, "Sweep")
    base_values = ", ".join(f"{a}={v}" for a, v in results.baseline_values().items())
    obj = results.plan["objective"]
    doc.table(["design", "objective (declared)", "seeds", "baseline", "variants besides it"],
              [[results.design, f"{obj['direction']} {obj['metric']} ({obj.get('scale') or '?'}; task "
                f"`{obj['task']}`)" + (f"; stages {' → '.join(results.stages)}" if results.stages else ""),
                ", ".join(map(str, results.seeds)),
                f"{results.baseline_label}" + (f" ({base_values})" if base_values else ""),
                str(sum(label != results.baseline_label for label in results.variant_order))]], align="lllll")
    _wall_time(doc, results)
    if results.axes:
        fields = results.plan.get("axis_fields") or {}
        doc.table(["axis", "values (first: baseline)", "config fields"],
                  [[a, ", ".join(v), ", ".join(f"`{f}`" for f in fields.get(a, [])) or "–"]
                   for a, v in results.axes.items()], align="lll")
        doc.p("Each trial's axis values are read from its resolved config.yaml (what ran), not from the spec.")
    duplicates = results.plan.get("duplicates") or []
    if duplicates:  # an axis value listed above whose points all built another point's config never ran as itself
        doc.note(f"**{len(duplicates)} point(s) of the design were not run**: each builds the same config as another "
                 "point, whose trials stand for both: " + ", ".join(f"{a} (as {b})" for a, b in duplicates) + ".")
    off = off_plan(results)
    if len(off):
        doc.note(f"**{len(off)} trial(s) did not run as planned**: their resolved config differs from the spec "
                 "on an axis; they are listed under the label of what ran: "
                 + ", ".join(sorted(set(off["label"].astype(str)))) + ".")
    if results.spec_text:
        doc.p("The spec as written (`spec.yaml`):")
        doc.code(results.spec_text, "yaml")
    env = _env_lines(results)
    if env:
        doc.h(3, "Environment")
        doc.ul(env)


def off_plan(results: SweepResults) -> pd.DataFrame:
    """The trials whose resolved config differs from the plan on an axis (listed under the label of what ran)."""
    return results.table[ran_off_plan(results.table)]


def _wall_time(doc: Doc, results: SweepResults) -> None:
    """The sweep's measured wall-clock cost, from invocations.json (every `study sweep` command that ran it)."""
    runs = [r for r in results.invocations if isinstance(r.get("wall_seconds"), (int, float))]
    if not runs:
        return
    shapes = sorted({f"{r.get('workers', '?')} worker(s) x {r.get('threads', '?')} thread(s)" for r in runs})
    doc.p(f"Wall-clock time of the sweep: {sum(r['wall_seconds'] for r in runs) / 60:,.1f} min over {len(runs)} "
          f"`study sweep` command(s) ({', '.join(shapes)}; measured, `invocations.json`).")


def _task_section(doc: Doc, results: SweepResults, task: str, figures: list[FigureInfo], out: Path,
                  family: list[PairedTest]) -> None:
    done = results.completed(task)
    metric, direction = results.objective(task)
    mcol = metric_column(metric)
    spec = results.declared(metric, task)
    labels = results.labels_for(task)
    datasets = results.datasets_for(task)
    doc.h(2, f"Task `{task}`" + (f" on {datasets}" if datasets else ""))
    ns = [int(n) for n in summarize(done, mcol, order=labels)["n"] if n > 0] if mcol in done and len(done) else []
    doc.p(f"Primary metric: **{metric}** ({scale_text(spec)}; declared by task `{spec.task}`"
          + (f": {spec.description}" if spec.description else "") + "). Means with a two-sided 95% confidence "
          "interval from the t distribution over seeds (mean ± half-width, then the interval); one seed gives "
          "no interval (n=1, no CI). " + small_n_note(min(ns, default=0), max(ns, default=0)))
    if results.stages:
        doc.p(f"A trial is one run of the study in stages ({' → '.join(results.stages)}); its seed is the "
              f"{results.stages[0]} stage's, so n counts {results.stages[0]} runs"
              + (", each GLUE number the mean over its record's fine-tuning seeds." if task == "glue" else "."))
    _summary_table(doc, results, task, done, mcol, spec, labels)
    undeclared = undeclared_columns(results, task, done)
    if undeclared:
        doc.p("Columns without a declaration (direction not declared, so never ranked or compared): "
              + ", ".join(f"`{metric_name(c)}`" for c in undeclared) + ".")
    _paired_section(doc, results, task, metric, direction, family)
    if task == "glue":
        _glue_tasks_section(doc, results, task, labels)
    _earlier_stages_section(doc, results, task, labels)
    task_figs = [f for f in figures if f.task == task and f.paths]
    if task_figs:
        doc.h(3, "Figures")
        for f in task_figs:
            doc.h(4, f.title)
            doc.img(f.title, f.png.relative_to(out).as_posix(),
                    [(p.suffix[1:].upper(), p.relative_to(out).as_posix()) for p in f.paths])


def _cost_columns(done: pd.DataFrame, results: SweepResults | None = None,
                  task: str | None = None) -> list[tuple[str, str, str]]:
    """(column, header, formatter) of the costs with values: the record's, then those the task declares it
    measures (`cost=True`: a translation's decode time and the KV cache its beam search held)."""
    out = [(c, h, k) for c, h, k in COST_COLUMNS if c in done and done[c].notna().any()]
    for col in done.columns if results is not None else []:
        if not col.startswith("metric.") or not pd.api.types.is_numeric_dtype(done[col]) or done[col].isna().all():
            continue
        d = results.declaration(col, task)
        if d is not None and d.cost:
            in_bytes = d.scale == "bytes"
            out.append((col, f"{metric_name(col)} ({'MiB' if in_bytes else d.scale}; measured)",
                        "mib" if in_bytes else "num"))
    return out


def planned_trials(results: SweepResults) -> dict[str, int]:
    """label -> trials the plan lists for it (its point x the plan's seeds). A trial that ran off-plan is listed under
    the label of what ran, which the plan lists no time, so it never swells a planned count nor shrinks the
    baseline's. A plan without points (one written by hand): the table's trials that ran as planned."""
    points = [str(p["label"]) for p in results.plan.get("points") or [] if "label" in p]
    if points:
        return {label: points.count(label) * len(results.seeds) for label in points}
    t = results.table
    return {str(k): int(v) for k, v in t[~ran_off_plan(t)].groupby("label").size().items()}


def _n_text(r, planned: int) -> str:
    """'2 / 3', with the completed runs that wrote no value and a label the plan does not list said so."""
    text = f"{int(r['n'])} / {planned}"
    unvalued = int(r["n_rows"]) - int(r["n"])
    notes = ([f"{unvalued} completed without a value"] if unvalued else []) + (
        ["not in the plan"] if planned == 0 and int(r["n_rows"]) else [])
    return text + (f" ({'; '.join(notes)})" if notes else "")


def _summary_table(doc: Doc, results: SweepResults, task: str, done: pd.DataFrame, mcol: str, spec: Declaration,
                   labels: list[str]) -> None:
    """One row per variant: the objective's mean and interval, the other declared metrics, the costs; every column
    over the same seeds, those with a value of the objective."""
    planned = planned_trials(results)
    secondary = secondary_columns(results, task, done, mcol)
    costs = _cost_columns(done, results, task)
    extras = [*(c for c, _ in secondary), *(c for c, _, _ in costs)]
    summary = summarize(done, mcol, order=labels, extra=extras)
    differ = defined_differently(results, task, [mcol, *(c for c, _ in secondary)], list(summary["label"]))
    mark = {c: " †" if c in differ else "" for c in [mcol, *(c for c, _ in secondary)]}
    headers = ["variant", "n / planned", f"{metric_name(mcol)}{mark[mcol]} ({scale_text(spec)}; 95% CI)", "interval",
               *[f"{metric_name(c)}{mark[c]} ({scale_text(d)})" for c, d in secondary], *[h for _, h, _ in costs]]
    rows = []
    for _, r in summary.iterrows():
        mean_text, interval = _interval_text(r)
        is_base = r["label"] == results.baseline_label and r["label"] != "baseline"
        rows.append([r["label"] + (" (baseline)" if is_base else ""),
                     _n_text(r, planned.get(r["label"], 0)), mean_text, interval,
                     *[fmt(r.get(c)) for c, _ in secondary], *[fmt(r.get(c), k) for c, _, k in costs]])
    doc.table(headers, rows)
    _defined_differently_note(doc, differ)
    constructed = [h for c, h, _ in costs if c.startswith("cost.") and COSTS[c.removeprefix("cost.")][2]]
    measured = [h for c, h, _ in costs if h not in constructed]
    doc.p(f"`n / planned`: seeds with a value of {metric_name(mcol)} out of the trials the plan lists (its points x "
          "seeds; a trial that ran off-plan is counted under the label of what ran, which the plan does not list). "
          "Secondary metrics and costs are means over the same seeds as the primary metric."
          + (f" {', '.join(constructed)} follow from the config by arithmetic (by construction, not measurements)"
             if constructed else "")
          + (f"; {', '.join(measured)} are measured on this machine." if measured else ".")
          + (" A – among them: a seed of the row has no value of that column, so no mean over the row's seeds "
             "exists (one over fewer seeds would pass for one over n)." if _gaps(summary, done[finite(done, mcol)], extras)
             else ""))


def defined_differently(results: SweepResults, task: str, columns: list[str],
                        labels: list[str]) -> dict[str, dict[str, list[str]]]:
    """column -> {field: values} for the columns that the cells `labels` measure differently
    (SweepResults.defined_differently)."""
    return {c: d for c in columns if (d := results.defined_differently(c, task, labels))}


def _defined_differently_note(doc: Doc, differ: dict[str, dict[str, list[str]]]) -> None:
    """Under a table with columns marked †: which fields define them differently across its rows. The plan refuses
    to rank a sweep by such a metric; a secondary column (or a stage's own metric) may still be one."""
    if not differ:
        return
    what = dict.fromkeys(_WHAT_A_FIELD_CHANGES.get(".".join(f.split(".")[-2:]), "another setting")
                         for fields in differ.values() for f in fields)  # (a stage's field: its section.field)
    doc.note("**† Not comparable across these variants:** " + "; ".join(
        f"`{metric_name(c)}` is defined by " + ", ".join(f"`{f}`" for f in fields) + ", which the variants ran "
        "differently (" + "; ".join(f"`{f}`: {', '.join(v)}" for f, v in fields.items()) + ")"
        for c, fields in differ.items()) + f". Such a column measures a different quantity in each variant (here: "
        f"{', '.join(what)}): its values are shown, but a difference between them is not evidence for either variant.")


# what a metric's defining field changes when the variants differ in it (the † note's words)
_WHAT_A_FIELD_CHANGES = {
    "task.tokenizer": "a loss per token of another tokenizer", "task.vocab_size": "a loss over another vocabulary",
    "task.lowercase": "lowercased text", "task.dataset": "another corpus",
    "task.eval_tokens": "another part of the split",
    "task.mlm_probability": "another share of masked tokens", "model.nsp": "another input format (segment pairs or "
    "full sentences)", "task.seq_len": "another sequence length (context, or inputs cut)", "task.glue_tasks":
    "a mean over other tasks", "task.test_sets": "another test set", "task.src_lang": "another translation direction",
    "task.tgt_lang": "another translation direction", "task.joint_vocab": "another vocabulary",
}


def _gaps(summary: pd.DataFrame, done: pd.DataFrame, extras: list[str]) -> bool:
    """Whether a summary row leaves an extra column empty although some of its seeds have a value of it."""
    return any(pd.isna(r.get(c)) and done.loc[done["label"] == r["label"], c].notna().any()
               for _, r in summary.iterrows() for c in extras if c in done)


def _p_text(p: float) -> str:
    return "–" if not math.isfinite(p) else "<0.0001" if p < 1e-4 else f"{p:.4f}"


def _no_spread(r) -> bool:
    return r.get("test") == NO_SPREAD_TEST


def _paired_ci_text(r) -> str:
    """A paired row's interval: '–' below two pairs; with no spread, no interval and why (never [d, d])."""
    if r["n_pairs"] < 2:
        return "–"
    if _no_spread(r):
        return f"none: no spread ({r['n_pairs']} equal differences)"
    return f"[{fmt(r['ci_lo'], 'signed')}, {fmt(r['ci_hi'], 'signed')}]"


def _paired_p_text(r) -> str:
    return _p_text(r["p_value"]) + (" (exact sign-flip)" if _no_spread(r) else "")


def _verdict_text(r, column: str = "verdict") -> str:
    """A paired row's verdict cell: the verdict, and what diverged where the other side did not (left out of the
    pairs, it is why a 'better' on the surviving seeds is withheld)."""
    diverged = r.get("diverged")
    return f"**{r[column]}**" + (f" ({diverged})" if isinstance(diverged, str) and diverged else "")


def _divergence_note(doc: Doc, tables: list[pd.DataFrame]) -> None:
    """Where one side diverged on a seed the other finished: why its verdict is not the pairs' alone."""
    if not any(isinstance(d, str) and d for t in tables for d in t.get("diverged", [])):
        return
    doc.p("*Diverged*: a seed on which one side diverged and the other did not has no pair, yet it is a result "
          "against the side that blew up: a variant that diverged there is never *better* on the seeds it survived, "
          "nor is it *worse* where the baseline diverged (*inconclusive* instead, the verdict cell says which seeds).")


def _no_spread_note(doc: Doc, tables: list[pd.DataFrame]) -> None:
    """Where a paired table has a row with no spread, what its interval, p-value and verdict are instead."""
    if not any(_no_spread(r) for t in tables for _, r in t.iterrows()):
        return
    doc.p(f"*No spread*: {NO_SPREAD_WHY}, and the verdict follows that p at 0.05.")


def _paired_section(doc: Doc, results: SweepResults, task: str, metric: str, direction: str,
                    family: list[PairedTest]) -> None:
    """Paired differences against the baseline for the objective and, for language models, the perplexity at
    twice the training length: each test's 95% verdict and its verdict after Holm's correction over the family."""
    base, m = results.baseline_label, family_size(family)
    doc.h(3, f"Paired differences against the baseline ({base})")
    t3 = t_critical(3)
    doc.p(f"For each variant, {metric}(variant) − {metric}(baseline) on the same seed, averaged over the seeds both "
          "completed, with the 95% t interval of that mean "
          f"(t for n − 1 degrees of freedom; e.g. {t3:.2f} for n = 3). "
          f"*better* / *worse* ({'lower' if direction == 'minimize' else 'higher'} is better, as declared) only "
          "when the interval excludes zero; *inconclusive* when it contains zero; n = 1 gives no interval.")
    doc.p(f"**Multiplicity: this report makes {m} paired test{'s' if m != 1 else ''}** (every variant against the "
          "baseline, on each metric of the paired tables of every task; those with two or more pairs), each at 95%, "
          "so some *better* / *worse* may be chance. The *after Holm* column applies Holm's step-down correction "
          "(Holm 1979) over all of them, which keeps the chance of any false *better* / *worse* among them at most "
          "5%: a verdict whose adjusted p-value is not below 0.05 becomes *inconclusive*.")
    for t in [t for t in family if t.task == task]:
        if t.name != metric:
            split = "validation" if t.name.startswith("valid") else "test"
            doc.p(f"Length extrapolation, **{t.name}** ({split} perplexity at twice the training length; "
                  f"{'lower' if t.direction == 'minimize' else 'higher'} is better):")
        rows = []
        for _, r in t.table.iterrows():
            rows.append([r["label"], str(r["n_pairs"]) + (f" (seeds {r['seeds']})" if r["seeds"] else ""),
                         fmt(r["diff"], "signed"), _paired_ci_text(r), _paired_p_text(r), _verdict_text(r),
                         _p_text(r["p_holm"]), _verdict_text(r, "verdict_holm")])
        doc.table(["variant", "pairs", f"Δ {t.name}", "95% CI", "p (paired t)", "verdict (95%)",
                   "Holm-adjusted p", f"after Holm (family of {m})"], rows, align="lrrrrlrl")
    _no_spread_note(doc, [t.table for t in family if t.task == task])
    _divergence_note(doc, [t.table for t in family if t.task == task])
    if any(v == NOT_COMPARABLE for t in family if t.task == task for v in t.table["verdict"]):
        doc.p(f"*{NOT_COMPARABLE}*: the variant ran a field that defines the metric differently from the baseline "
              "(the † note above names it), so the difference is not tested and is not in the Holm family.")


def _glue_tasks_section(doc: Doc, results: SweepResults, task: str, labels: list[str]) -> None:
    """Per GLUE task: each variant's task score and metrics with their interval over trials, the fine-tuning spread
    beside them, and the paired difference of every variant against the baseline."""
    done = results.completed(task)
    names = sorted({c[len("metric."):-len("/score")] for c in done.columns
                    if c.startswith("metric.") and c.endswith("/score") and done[c].notna().any()})
    if not names:
        return
    within = "pretraining runs" if results.stages else "seeds"
    doc.h(3, "Per GLUE task")
    doc.p(f"Each task's score ({scale_text(results.declared(f'{names[0]}/score', task))}; the mean of its official "
          f"dev metrics) per variant: the mean and 95% t interval over {within}; *fine-tuning sd*: the mean over "
          "trials of the sample standard deviation over each trial's fine-tuning seeds (– for one seed: one seed "
          "has no spread). The metrics are means over trials of each trial's mean over its fine-tuning seeds.")
    rows = []
    for name in names:
        metrics = [c for c in done.columns if c.startswith(f"metric.{name}/") and not c.endswith(("_std", "/score"))
                   and pd.api.types.is_numeric_dtype(done[c])]
        table = summarize(done, f"metric.{name}/score", order=labels,
                          extra=[f"metric.{name}/score_std", *metrics])
        for _, r in table.iterrows():
            mean_text, interval = _interval_text(r)
            rows.append([name, r["label"], str(int(r["n"])), mean_text, interval,
                         fmt(r.get(f"metric.{name}/score_std")),
                         ", ".join(f"{metric_name(c).split('/', 1)[1]} {fmt(r.get(c))}" for c in metrics)])
    doc.table(["task", "variant", "n", "score (95% CI)", "interval", "fine-tuning sd", "metrics"], rows,
              align="llrrrrl")
    base = results.baseline_label
    paired, tables = [], []
    for name in names:
        score = f"metric.{name}/score"
        tables.append(paired_differences(results.finished(task), score, base, labels,
                                         results.declared(score, task).direction))
        for _, r in tables[-1].iterrows():
            paired.append([name, r["label"], str(r["n_pairs"]), fmt(r["diff"], "signed"), _paired_ci_text(r),
                           _verdict_text(r)])
    doc.p(f"Paired by {within[:-1]} seed against the baseline ({base}), task by task (each at 95%, no correction "
          "for the several tasks: `compare.md` sets the published effects beside these with a Holm-adjusted "
          "verdict):")
    doc.table(["task", "variant", "pairs", "Δ score", "95% CI", "verdict"], paired, align="llrrrl")
    _no_spread_note(doc, tables)
    _divergence_note(doc, tables)


def _earlier_stages_section(doc: Doc, results: SweepResults, task: str, labels: list[str]) -> None:
    """A study in stages: the earlier stages' declared quality metrics per variant (pretraining: MLM loss on the
    same input with or without NSP, NSP accuracy), with intervals over trials."""
    done = results.completed(task)
    for stage in results.stages[:-1]:
        cols = [c for c in done.columns if c.startswith(f"metric.{stage}.") and pd.api.types.is_numeric_dtype(done[c])
                and done[c].notna().any() and (d := results.declaration(c, task)) is not None and d.objective]
        if not cols:
            continue
        doc.h(3, f"The {stage} stage")
        differ = defined_differently(results, task, cols, labels)
        rows = []
        for col in cols:
            spec = results.declared(col, task)
            for _, r in summarize(done, col, order=labels).iterrows():
                mean_text, interval = _interval_text(r)
                rows.append([metric_name(col) + (" †" if col in differ else ""), scale_text(spec), r["label"],
                             str(int(r["n"])), mean_text, interval])
        doc.p(f"The {stage} stage's own metrics, as its task declares them, per variant (mean and 95% t interval "
              "over trials). A metric that only one variant writes (NSP accuracy without NSP) is missing, not zero.")
        doc.table(["metric", "scale", "variant", "n", "mean (95% CI)", "interval"], rows, align="lllrrr")
        _defined_differently_note(doc, differ)


def completed_without_value(results: SweepResults) -> pd.DataFrame:
    """Completed trials that wrote no finite value of their task's primary metric (task, metric, label, seed): they
    completed, so they are not failures the status lists, yet they enter no mean; the report names them."""
    rows = []
    for task in results.tasks:
        done = results.completed(task)
        mcol = metric_column(results.objective(task)[0])
        for _, r in done[~finite(done, mcol)].iterrows():
            rows.append({"task": task, "metric": metric_name(mcol), "label": str(r["label"]), "seed": r["seed"]})
    return pd.DataFrame(rows, columns=["task", "metric", "label", "seed"])


def _problems_section(doc: Doc, results: SweepResults) -> None:
    doc.h(2, "Trials that did not complete")
    bad, unvalued = results.problems(), completed_without_value(results)
    if bad.empty:
        off = len(off_plan(results))
        text = "Every planned trial completed" + (f" ({off} of them not as planned: see *Sweep*)" if off else "")
        doc.p(text + ("." if unvalued.empty else ", but not every completed trial wrote its primary metric (below)."))
    else:
        _problem_table(doc, bad)
    if len(unvalued):
        doc.p("Completed without a value of the primary metric: they are in no mean of the main table (nor are "
              "their other columns averaged there) and no paired difference of the primary metric, and the `n` of "
              "their variant does not count them; tables of other metrics count them where they wrote those.")
        rows = [[label, ", ".join(str(s) for s in sorted(g["seed"].dropna().astype(int))), task, metric]
                for (task, metric, label), g in unvalued.groupby(["task", "metric", "label"], sort=False)]
        doc.table(["variant", "seeds completed without a value", "task", "metric"], rows, align="llll")


def _problem_table(doc: Doc, bad: pd.DataFrame) -> None:
    doc.p("Failed, diverged, still running and never-run trials, one row each. None of them enters a mean or a "
          "paired difference.")
    rows = []
    for _, r in bad.iterrows():
        err = str(r.get("error") or "").strip().splitlines()
        div = r.get("diverged_at_step")
        rows.append([str(r["label"]), str(r["seed"]), r["status"], fmt(r.get("attempts"), "int"),
                     fmt(div, "int") if r["status"] == "diverged" else "–",
                     (err[0][:140] if err else "") or "–"])
    doc.table(["variant", "seed", "status", "attempts", "diverged at step", "error (first line)"], rows,
              align="lrlrrl")


@dataclass
class ReportOutput:
    out: Path
    markdown: Path
    html: Path
    figures: list[FigureInfo]
    tables: list[Path]


def write_summary_tables(results: SweepResults, out: Path) -> list[Path]:
    """summary.csv (per task and variant, every column over the seeds with a value of the objective) and paired.csv
    (differences against the baseline on the objective, with the report's Holm-adjusted p-values and verdicts)."""
    summaries, paireds = [], []
    family = paired_family(results)
    planned = planned_trials(results)
    for task in results.tasks:
        done = results.completed(task)
        metric, direction = results.objective(task)
        mcol = metric_column(metric)
        labels = results.labels_for(task)
        if mcol not in done:
            continue
        extra = [c for c, _ in secondary_columns(results, task, done, mcol)]
        extra += [c for c, _, _ in _cost_columns(done, results, task)]
        scale = results.declared(metric, task).scale
        summary = summarize(done, mcol, order=labels, extra=extra).rename(columns={"n_rows": "n_completed"})
        summary.insert(2, "n_planned", [planned.get(label, 0) for label in summary["label"]])
        summaries.append(summary.assign(task=task, metric=metric, scale=scale, direction=direction))
        # every table of Holm's family (the objective's, and perplexity at twice the length's): its adjustment can
        # be checked from the file
        paireds += [t.table.assign(holm_family=family_size(family), task=task, metric=t.name,
                                   scale=results.declared(t.name, task).scale, direction=t.direction)
                    for t in family if t.task == task]
    paths = []
    for name, frames in (("summary.csv", summaries), ("paired.csv", paireds)):
        path = out / name
        if frames:
            pd.concat(frames, ignore_index=True).to_csv(path, index=False)
            paths.append(path)
        else:  # an earlier report's table would contradict this one (no trial has a value of the objective yet)
            path.unlink(missing_ok=True)
    return paths


def write_report(results: SweepResults, out: str | Path, figures: list[FigureInfo],
                 generated: str | None = None) -> ReportOutput:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    doc = build_doc(results, figures, out, generated)
    md, page = out / "report.md", out / "report.html"
    md.write_text(doc.to_markdown())
    page.write_text(doc.to_html(f"Sweep report: {results.sweep}"))
    return ReportOutput(out, md, page, figures, write_summary_tables(results, out))
