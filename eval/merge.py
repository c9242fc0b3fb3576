"""Merge the run folders of a data-parallel eval (one `--shard I/N` process per GPU) into one folder whose
table is the one a single process would have written for the same samples.

    python -m eval.merge OUT SHARD_DIR [SHARD_DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .report import write_tables
from .results import KINDS, ResultStore, read_jsonl


def merge(out: str | Path, shards: list[str | Path]) -> Path:
    shards = [Path(s) for s in shards]
    configs = [json.loads((s / "config.json").read_text()) for s in shards]
    first = configs[0]
    for s, c in zip(shards, configs, strict=True):
        for key in ("task", "model", "specs"):
            if c[key] != first[key]:
                raise ValueError(f"{s}: {key} {c[key]!r} differs from {shards[0]}'s {first[key]!r}")
    store = ResultStore(out)
    for kind in KINDS:
        names = sorted({p.name for s in shards for p in (s / kind).glob("*.jsonl")})
        for name in names:
            rows: dict[str, dict] = {}
            for s in shards:
                for r in read_jsonl(s / kind / name):
                    if "error" not in r or r["id"] not in rows:  # a success anywhere beats an error
                        rows[r["id"]] = r
            ordered = sorted(rows.values(), key=lambda r: (r.get("idx", 0), r["id"]))
            (store.out / kind / name).write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in ordered))
    config = {**first, "shard": None, "merged_from": [str(s) for s in shards],
              "samples": sum(c.get("samples", 0) for c in configs)}
    store.write_config(config)
    write_tables(store.out, config)
    return store.out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = merge(argv[0], argv[1:])
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
