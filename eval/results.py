"""On-disk layout of one eval run, and the append-only JSONL that makes runs resumable.

    OUT/config.json            what ran: task, options, model, synthetic label, specs, versions, device, commit
    OUT/samples/<slug>.jsonl   one line per (sample, spec): prediction, references, cache stats
    OUT/judge/<slug>.jsonl     one line per judged sample (MMBench-Video), kept apart so judging can resume too
    OUT/results.md / .csv      the paper-style table, always rebuilt from the JSONL files alone

Lines are written and flushed one at a time, so an interrupted run loses at most the sample in flight; a torn
last line is ignored on reading and that sample simply runs again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

KINDS = ("samples", "judge")


def spec_slug(spec: str) -> str:
    """A file name for a spec string: readable, and unique through a short hash of the exact text."""
    if spec == "fp16":
        return "fp16"
    readable = re.sub(r"[^A-Za-z0-9.=,-]+", "_", spec).strip("_")[:80]
    return f"{readable}-{hashlib.sha1(spec.encode()).hexdigest()[:8]}"


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by an interruption: that sample is redone
    return out


class ResultStore:
    def __init__(self, out: str | Path):
        self.out = Path(out)
        for kind in KINDS:
            (self.out / kind).mkdir(parents=True, exist_ok=True)

    def path(self, kind: str, spec: str) -> Path:
        return self.out / kind / f"{spec_slug(spec)}.jsonl"

    def records(self, spec: str, kind: str = "samples") -> dict[str, dict]:
        """Finished records by sample id (a later line for the same id wins; errored samples are not finished)."""
        return {r["id"]: r for r in read_jsonl(self.path(kind, spec)) if "error" not in r}

    def append(self, spec: str, record: dict, kind: str = "samples") -> None:
        path = self.path(kind, spec)
        # A run killed mid-write leaves a torn last line; start on a fresh line so this record stays whole.
        torn = False
        if path.exists() and path.stat().st_size > 0:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        with open(path, "a") as f:
            f.write(("\n" if torn else "") + json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def errors(self, spec: str) -> list[dict]:
        done = self.records(spec)
        return [r for r in read_jsonl(self.path("samples", spec)) if "error" in r and r["id"] not in done]

    def write_config(self, config: dict) -> None:
        (self.out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")

    def read_config(self) -> dict | None:
        path = self.out / "config.json"
        return json.loads(path.read_text()) if path.exists() else None
