"""Console scripts: ``mmkv-app``, ``mmkv-eval``, ``mmkv-bench``, ``mmkv-calibrate``. Imports are lazy so each loads only what it needs."""

from __future__ import annotations

import sys


def app_main(argv: list[str] | None = None) -> int:
    from mmkv.ui.launch import main

    return main(argv)


def eval_main(argv: list[str] | None = None) -> int:
    from eval.run import main

    return main(argv)


def calibrate_main(argv: list[str] | None = None) -> int:
    from mmkv.calibrate import main

    return main(argv)


def bench_main(argv: list[str] | None = None) -> int:
    from eval.bench import main

    return main(argv)


if __name__ == "__main__":
    sys.exit(bench_main())
