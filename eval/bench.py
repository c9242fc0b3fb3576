"""``mmkv-bench``: benchmarks that print a table and write JSON.

    mmkv-bench budget  ...   throughput under a KV-memory budget (eval/bench_budget.py)
    mmkv-bench decode  ...   text-cache decode speed vs FP16 and transformers' QuantizedCache (eval/bench_decode.py)
    mmkv-bench kernels ...   decode-attention kernel vs FP16 SDPA (eval/bench_kernels.py)
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {"budget": "eval.bench_budget", "decode": "eval.bench_decode", "kernels": "eval.bench_kernels"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    raise SystemExit(main())
