"""WikiText-2 (tokenized release) from the shared data folder, tokenized once per run."""

from __future__ import annotations

from pathlib import Path

from ..runtime import REPO, Runtime

DEFAULT = REPO.parent / "shared" / "data" / "wikitext-2" / "test.txt"

OPTION = (["--wikitext"], {"default": None,
                           "help": f"wikitext-2 test.txt (or its folder); default {DEFAULT}"})


def path(opts: dict) -> Path:
    p = Path(opts.get("wikitext") or DEFAULT)
    p = p / "test.txt" if p.is_dir() else p
    if not p.exists():
        raise ValueError(f"wikitext-2 text not found at {p}; pass --wikitext PATH")
    return p


def token_ids(rt: Runtime, opts: dict) -> list[int]:
    key = ("wikitext", str(path(opts)))
    if key not in rt.cache:
        text = path(opts).read_text()
        rt.cache[key] = rt.tokenizer(text, add_special_tokens=False)["input_ids"]
    return rt.cache[key]
