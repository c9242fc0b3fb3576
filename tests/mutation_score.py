"""Mutation score per module from mutmut's result files (``mutants/**/*.py.meta``): ``make mutate`` prints it,
``tests/test_mutation_smoke.py`` asserts on it.

    python tests/mutation_score.py [ROOT] [--markdown] [--classes tests/mutation_equivalent.tsv] [--only PATH ...]

A mutant is *killed* when a test failed (mutmut exit codes 1 and 3), *survived* when every selected test passed,
*no tests* when no selected test reaches its function, *timeout* when it ran past mutmut's CPU limit (counted as
killed: the mutation hangs the code), *not checked* when the run did not get to it. The score is
killed / (killed + survived + no tests); docs/TESTING.md subtracts the survivors judged equivalent.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

KILLED = {1, 3}
TIMEOUT = {24, -24, 36, 152, 255}
SURVIVED = {0}
NO_TESTS = {5, 33}


def classify(code: int | None) -> str:
    if code is None:
        return "not checked"
    if code in KILLED:
        return "killed"
    if code in TIMEOUT:
        return "timeout"
    if code in SURVIVED:
        return "survived"
    if code in NO_TESTS:
        return "no tests"
    return "suspicious"


def load_classes(path: Path | str) -> dict[str, str]:
    """{mutant name: "equivalent" | "device"} from a tab-separated file (``tests/mutation_equivalent.tsv``)."""
    out = {}
    for line in Path(path).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, cls, _ = line.split("\t", 2)
            out[name] = cls
    return out


def counts(root: Path | str = ".", only: list[str] | None = None,
           classes: dict[str, str] | None = None) -> dict[str, Counter]:
    """{source path: Counter(status)} for every mutated file under ROOT/mutants (optionally only some paths).
    With ``classes``, survivors named there count as "equivalent" or "device" instead of "survived"."""
    out: dict[str, Counter] = {}
    base = Path(root) / "mutants"
    for meta in sorted(base.rglob("*.py.meta")):
        path = meta.relative_to(base).as_posix()[: -len(".meta")]
        if only and path not in only:
            continue
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        if codes:
            c = Counter()
            for name, code in codes.items():
                status = classify(code)
                if status == "survived" and classes and name in classes:
                    status = classes[name]
                c[status] += 1
            out[path] = c
    return out


def score(c: Counter) -> float | None:
    """Killed (timeouts included) over everything that was checked."""
    done = c["killed"] + c["timeout"] + c["survived"] + c["no tests"] + c["suspicious"]
    return (c["killed"] + c["timeout"]) / done if done else None


def table(by_path: dict[str, Counter]) -> str:
    cols = ["killed", "timeout", "survived", "no tests", "suspicious", "not checked"]
    rows = [f"{'module':34s} " + " ".join(f"{c:>11s}" for c in cols) + "   score"]
    total: Counter = Counter()
    for path, c in by_path.items():
        total += c
        s = score(c)
        rows.append(f"{path:34s} " + " ".join(f"{c[k]:11d}" for k in cols) + (f"  {s:6.1%}" if s is not None else "       -"))
    s = score(total)
    rows.append(f"{'total':34s} " + " ".join(f"{total[k]:11d}" for k in cols) + (f"  {s:6.1%}" if s is not None else "       -"))
    return "\n".join(rows)


def classified_markdown(by_path: dict[str, Counter]) -> str:
    """Table with equivalent and device survivors split out: score = killed / (killed + other survivors + no
    tests); "incl. device" also counts the device survivors as not killed."""
    cols = ["killed", "timeout", "equivalent", "device", "survived", "no tests", "not checked"]
    rows = ["| module | " + " | ".join(cols).replace("survived", "other survivors") + " | score | score incl. device |",
            "|---" * (len(cols) + 3) + "|"]
    total: Counter = Counter()

    def fmt(c):
        k = c["killed"] + c["timeout"]
        den, den_dev = k + c["survived"] + c["no tests"], k + c["survived"] + c["no tests"] + c["device"]
        return (f"{k / den:.1%}" if den else "-") + " | " + (f"{k / den_dev:.1%}" if den_dev else "-")

    for path, c in by_path.items():
        total += c
        rows.append(f"| `{path}` | " + " | ".join(str(c[k]) for k in cols) + f" | {fmt(c)} |")
    rows.append("| total | " + " | ".join(str(total[k]) for k in cols) + f" | {fmt(total)} |")
    return "\n".join(rows)


def markdown(by_path: dict[str, Counter]) -> str:
    cols = ["killed", "timeout", "survived", "no tests", "not checked"]
    rows = ["| module | " + " | ".join(cols) + " | killed / checked |", "|---" * (len(cols) + 2) + "|"]
    for path, c in by_path.items():
        s = score(c)
        rows.append(f"| `{path}` | " + " | ".join(str(c[k]) for k in cols) + (f" | {s:.1%} |" if s is not None else " | - |"))
    return "\n".join(rows)


def main(argv: list[str]) -> None:
    md = "--markdown" in argv
    argv = [a for a in argv if a != "--markdown"]
    classes = None
    if "--classes" in argv:
        i = argv.index("--classes")
        classes = load_classes(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    only = argv[argv.index("--only") + 1:] if "--only" in argv else None
    args = argv[: argv.index("--only")] if "--only" in argv else argv
    by_path = counts(args[0] if args else ".", only, classes)
    if classes is not None:
        print(classified_markdown(by_path))
    else:
        print(markdown(by_path) if md else table(by_path))


if __name__ == "__main__":
    main(sys.argv[1:])
