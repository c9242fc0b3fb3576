"""``mmkv-bench`` (also ``python -m eval.bench``): every benchmark, each printing a table and writing JSON.

    mmkv-bench budget     ...  throughput under a KV-memory budget (eval/bench/budget.py)
    mmkv-bench decode     ...  text-cache decode speed vs FP16 and transformers' QuantizedCache (eval/bench/decode.py)
    mmkv-bench aquakv     ...  AQUA-KV decode speed and memory (eval/bench/aquakv.py)
    mmkv-bench kernels    ...  decode-attention kernel vs FP16 SDPA (eval/bench/attention.py)
    mmkv-bench text       ...  KIVI/XQuant text-segment kernel (eval/bench/text_attention.py)
    mmkv-bench skvq       ...  SKVQ decode kernel (eval/bench/skvq_attention.py)
    mmkv-bench alignedkv  ...  AlignedKV decode kernel (eval/bench/alignedkv_attention.py)
    mmkv-bench ab         ...  kernel variants side by side, from kernels/switches.py (eval/bench/ab.py)
    mmkv-bench sass       ...  registers and loop SASS of the Gluon kernels, no GPU needed (eval/bench/sass.py)
    mmkv-bench cpu        ...  CPU generation vs transformers' own generate, same model object (eval/bench/cpu.py)
    mmkv-bench load       ...  Poisson request load against a local mmkv-serve (eval/bench/load.py)
    mmkv-bench overhead   ...  the scheduler's step against the bare decode step at batch B (eval/bench/overhead.py)
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {"budget": "eval.bench.budget", "decode": "eval.bench.decode", "aquakv": "eval.bench.aquakv",
            "kernels": "eval.bench.attention", "text": "eval.bench.text_attention",
            "skvq": "eval.bench.skvq_attention", "alignedkv": "eval.bench.alignedkv_attention",
            "ab": "eval.bench.ab", "sass": "eval.bench.sass", "cpu": "eval.bench.cpu", "load": "eval.bench.load",
            "overhead": "eval.bench.overhead"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]) or 0
