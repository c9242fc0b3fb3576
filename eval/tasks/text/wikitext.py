"""WikiText-2 (tokenized release) from the shared data folder, tokenized once per run."""

from __future__ import annotations

from pathlib import Path

from mmkv.paths import wikitext

from ...runtime import Runtime

OPTION = (["--wikitext"], {"default": None,
                           "help": "wikitext-2 test.txt (or its folder); default: see mmkv.paths ($MMKV_WIKITEXT, "
                                   "shared/data/wikitext-2 beside the checkout, the excerpt in assets/)"})


def path(opts: dict) -> Path:
    p = Path(opts.get("wikitext") or wikitext("test"))
    p = p / "test.txt" if p.is_dir() else p
    if not p.exists():
        raise ValueError(f"wikitext-2 text not found at {p}; pass --wikitext PATH")
    return p


_TOKENS: dict = {}  # per process: tokenizing the 1.2 MB test split takes seconds; several runs may share it


def token_ids(rt: Runtime, opts: dict) -> list[int]:
    tok, p = rt.tokenizer, path(opts)
    key = (getattr(tok, "name_or_path", None) or id(tok), str(p), p.stat().st_mtime)
    if key not in _TOKENS:
        _TOKENS[key] = tok(p.read_text(), add_special_tokens=False)["input_ids"]
    return _TOKENS[key]
