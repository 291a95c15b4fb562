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

from study.report.collect import PPL_AT_2X, SweepResults, metric_column
from study.report.figures import FigureInfo, metric_label
from study.report.stats import paired_differences, small_n_note, summarize, t_critical

COST_COLUMNS = (  # column, header, formatter
    ("cost.parameters", "params", "int"),
    ("cost.train_flops_per_token", "train FLOPs/token", "sci"),
    ("cost.kv_cache_bytes_per_token", "KV bytes/token", "int"),
    ("cost.train_tokens_per_s", "train tokens/s", "int"),
    ("cost.peak_memory_bytes", "peak memory (MB)", "mb"),
)
SECONDARY = ("metric.valid_ppl", "metric.test_loss", "metric.test_ppl", PPL_AT_2X, "metric.bleu", "metric.chrf")


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
    if kind == "mb":
        return f"{x / 2**20:,.0f}"
    if kind == "signed":
        return f"{x:+.4g}"
    return f"{x:.4g}"


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

            t = html.escape(text)
            t = re.sub(r"\[([^\]]+)\]\(([^)]+)\)", r'<a href="\2">\1</a>', t)
            t = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", t)
            t = re.sub(r"`([^`]+)`", r"<code>\1</code>", t)
            return t

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


# -- report sections -------------------------------------------------------------------------------------------
def status_sentence(results: SweepResults) -> str:
    c = results.status_counts
    total = sum(c.values())
    parts = [f"{c[s]} {s}" for s in ("running", "pending", "failed", "diverged") if c.get(s)]
    text = f"{c['completed']} of {total} planned trials completed"
    return text + ("; " + ", ".join(parts).replace("pending", "pending (never ran)") if parts else "")


def _interval_text(row) -> tuple[str, str]:
    if row["n"] == 0:
        return "no completed run", "–"
    if row["n"] == 1:
        return f"{fmt(row['mean'])} (n=1, no CI)", "–"
    return f"{fmt(row['mean'])} ± {fmt(row['ci_half'])}", f"[{fmt(row['ci_lo'])}, {fmt(row['ci_hi'])}]"


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

    # spec and environment
    doc.h(2, "Sweep")
    base_values = ", ".join(f"{a}={v}" for a, v in results.baseline_values().items())
    doc.table(["design", "objective", "seeds", "baseline", "variants"],
              [[results.design, " ".join(results.objective(results.tasks[0])), ", ".join(map(str, results.seeds)),
                f"{results.baseline_label}" + (f" ({base_values})" if base_values else ""),
                str(len(results.variant_order))]], align="lllll")
    if results.axes:
        doc.table(["axis", "values (first: baseline)"],
                  [[a, ", ".join(v)] for a, v in results.axes.items()], align="ll")
    if results.spec_text:
        doc.p("The spec as written (`spec.yaml`):")
        doc.code(results.spec_text, "yaml")
    env = _env_lines(results)
    if env:
        doc.h(3, "Environment")
        doc.ul(env)

    counts = results.status_counts
    doc.h(2, "Trials")
    doc.table(["status", "trials"], [[s, str(n)] for s, n in counts.items()], align="lr")

    for task in results.tasks:
        _task_section(doc, results, task, figures, out)

    _problems_section(doc, results)

    doc.h(2, "Figures")
    if figures:
        doc.ul([f"{f.title} ({f.task}): " + " · ".join(f"[{p.suffix[1:].upper()}]({p.relative_to(out).as_posix()})"
                                                       for p in f.paths) for f in figures])
    else:
        doc.p("No figures: no trial has completed yet.")
    return doc


def _task_section(doc: Doc, results: SweepResults, task: str, figures: list[FigureInfo], out: Path) -> None:
    done = results.completed(task)
    metric, direction = results.objective(task)
    mcol = metric_column(metric)
    labels = results.labels_for(task)
    planned = results.table[results.table["task"] == task].groupby("label").size()
    datasets = results.datasets_for(task)
    doc.h(2, f"Task `{task}`" + (f" on {datasets}" if datasets else ""))
    n_typical = int(summarize(done, mcol, order=labels)["n"].max()) if mcol in done and len(done) else 0
    doc.p(f"Primary metric: **{metric}** ({metric_label(mcol)}; {direction}). Means with a two-sided 95% confidence "
          f"interval from the t distribution over seeds (mean ± half-width, then the interval). "
          + small_n_note(n_typical))

    secondary = [c for c in SECONDARY if c != mcol and c in done and done[c].notna().any()]
    costs = [(c, h, k) for c, h, k in COST_COLUMNS if c in done and done[c].notna().any()]
    summary = summarize(done, mcol, order=labels, extra=[*secondary, *(c for c, _, _ in costs)]) if mcol in done \
        else pd.DataFrame({"label": labels, "n": 0, "mean": math.nan, "ci_half": math.nan, "ci_lo": math.nan,
                           "ci_hi": math.nan})
    headers = ["variant", "n / planned", f"{metric} (95% CI)", "interval",
               *[c.split(".", 1)[1] for c in secondary], *[h for _, h, _ in costs]]
    rows = []
    for _, r in summary.iterrows():
        mean_text, interval = _interval_text(r)
        is_base = r["label"] == results.baseline_label and r["label"] != "baseline"
        rows.append([r["label"] + (" (baseline)" if is_base else ""),
                     f"{int(r['n'])} / {int(planned.get(r['label'], 0))}", mean_text, interval,
                     *[fmt(r.get(c)) for c in secondary], *[fmt(r.get(c), k) for c, _, k in costs]])
    doc.table(headers, rows)
    doc.p("Secondary metrics and costs are means over the completed seeds. "
          "`n / planned`: seeds that completed out of those planned.")

    base = results.baseline_label
    doc.h(3, f"Paired differences against the baseline ({base})")
    t3 = t_critical(3)
    doc.p(f"For each variant, {metric}(variant) − {metric}(baseline) on the same seed, averaged over the seeds both "
          "completed, with the 95% t interval of that mean "
          f"(t for n − 1 degrees of freedom; e.g. {t3:.2f} for n = 3). "
          f"*better* / *worse* ({'lower' if direction == 'minimize' else 'higher'} is better) only when the interval "
          "excludes zero; *inconclusive* when it contains zero; n = 1 gives no interval.")
    for col, name, dirn in [(mcol, metric, direction)] + (
            [(PPL_AT_2X, "test_ppl_at_2x", "minimize")] if PPL_AT_2X in done and done[PPL_AT_2X].notna().any()
            and mcol != PPL_AT_2X else []):
        if col != mcol:
            doc.p(f"Length extrapolation, **{name}** (test perplexity at twice the training length; lower is better):")
        pd_ = paired_differences(results.table[results.table["task"] == task].query("status == 'completed'"),
                                 col, base, labels, dirn)
        rows = []
        for _, r in pd_.iterrows():
            ci = "–" if r["n_pairs"] < 2 else f"[{fmt(r['ci_lo'], 'signed')}, {fmt(r['ci_hi'], 'signed')}]"
            rows.append([r["label"], str(r["n_pairs"]) + (f" (seeds {r['seeds']})" if r["seeds"] else ""),
                         fmt(r["diff"], "signed"), ci, f"**{r['verdict']}**"])
        doc.table(["variant", "pairs", f"Δ {name}", "95% CI", "verdict"], rows, align="lrrrl")

    task_figs = [f for f in figures if f.task == task]
    if task_figs:
        doc.h(3, "Figures")
        for f in task_figs:
            doc.h(4, f.title)
            doc.img(f.title, f.png.relative_to(out).as_posix(),
                    [(p.suffix[1:].upper(), p.relative_to(out).as_posix()) for p in f.paths])


def _problems_section(doc: Doc, results: SweepResults) -> None:
    doc.h(2, "Trials that did not complete")
    bad = results.problems()
    if bad.empty:
        doc.p("Every planned trial completed.")
        return
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
    """summary.csv (per task and variant) and paired.csv (differences against the baseline)."""
    summaries, paireds = [], []
    for task in results.tasks:
        done = results.completed(task)
        metric, direction = results.objective(task)
        mcol = metric_column(metric)
        labels = [lbl for lbl in results.variant_order
                  if lbl in set(results.table.loc[results.table["task"] == task, "label"])]
        if mcol not in done:
            continue
        extra = [c for c in [*SECONDARY, *(c for c, _, _ in COST_COLUMNS)] if c in done]
        summaries.append(summarize(done, mcol, order=labels, extra=extra).assign(task=task, metric=metric))
        paireds.append(paired_differences(done, mcol, results.baseline_label, labels, direction)
                       .assign(task=task, metric=metric, direction=direction))
    paths = []
    for name, frames in (("summary.csv", summaries), ("paired.csv", paireds)):
        if frames:
            path = out / name
            pd.concat(frames, ignore_index=True).to_csv(path, index=False)
            paths.append(path)
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
