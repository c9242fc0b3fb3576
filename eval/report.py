"""Rebuild results.md / results.csv for a run folder from its config.json and JSONL files alone, so a resumed
run, a merged data-parallel run and a single-process run of the same samples give the same table."""

from __future__ import annotations

from pathlib import Path

from .registry import TASKS, metric_names
from .results import ResultStore
from .runtime import mean_kv_mib
from .tables import method_label, render


def ordered_records(store: ResultStore, spec: str, task: dict, ids: set[str] | None) -> list[dict]:
    recs = store.records(spec)
    if task.get("annotations"):  # e.g. judge scores, stored apart from predictions
        for i, extra in store.records(spec, task["annotations"]).items():
            if i in recs:
                recs[i] = {**recs[i], **{k: v for k, v in extra.items() if k != "id"}}
    chosen = [r for i, r in recs.items() if ids is None or i in ids]
    return sorted(chosen, key=lambda r: (r.get("idx", 0), r["id"]))


def write_tables(out: str | Path, config: dict, ids: set[str] | None = None) -> tuple[str, str]:
    store = ResultStore(out)
    task, opts = TASKS[config["task"]], config["options"]
    baseline = ordered_records(store, "fp16", task, ids)
    rows, notes = [], []
    for spec in config["specs"]:
        recs = ordered_records(store, spec, task, ids)
        values, spec_notes = task["score"](recs, baseline, opts)
        rows.append({"spec": spec, "metrics": values, "kv_mib": mean_kv_mib(recs), "n": len(recs)})
        label = " ".join(method_label(spec))
        for note in spec_notes:
            if note not in notes:
                notes.append(note)
        errors = [e for e in store.errors(spec) if ids is None or e["id"] in ids]
        if errors:
            notes.append(f"{label}: {len(errors)} samples failed and are left out, e.g. {errors[0]['error']}")
    notes.append(f"{config.get('device', '?')}; mmkv {config.get('versions', {}).get('mmkv')}, torch "
                 f"{config.get('versions', {}).get('torch')}, transformers "
                 f"{config.get('versions', {}).get('transformers')}; commit {config.get('git_commit')}")
    title = f"{task['title']} ({task['paper']})"
    md, csv_text = render(title, config, metric_names(task, opts), rows, notes, task.get("digits", 3))
    Path(out, "results.md").write_text(md)
    Path(out, "results.csv").write_text(csv_text)
    return md, csv_text
