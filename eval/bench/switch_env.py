"""Environment switches (``kernels/switches.py``) set for a block of a benchmark and put back after, and the
``name:K=V;K=V,name2:`` variant lists the side-by-side benches and studies take."""

from __future__ import annotations

import os


class switches:
    """``with switches({"MMKV_X": "0"}):`` sets environment switches for the block and restores them after."""

    def __init__(self, env: dict):
        self.env, self.old = env, {}

    def __enter__(self):
        self.old = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        return self

    def __exit__(self, *exc):
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        return False


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """``name:K=V;K=V,name2:`` -> [(name, env)]."""
    out = []
    for item in filter(None, text.split(",")):
        name, _, rest = item.partition(":")
        out.append((name, dict(kv.split("=", 1) for kv in filter(None, rest.split(";")))))
    return out
