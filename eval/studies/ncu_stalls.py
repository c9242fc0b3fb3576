"""Where a kernel's warps stall, from Nsight Compute's per-instruction source page: total samples by stall reason,
the split between the hot loop and the code run once per warp (prologue, epilogue), the loop's global loads in
SASS order, and the instructions with the most samples.

    ncu --set full --import-source no -o rep ...; ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv
    python -m eval.studies.ncu_stalls src.csv --top 20
"""

from __future__ import annotations

import argparse
import collections
import csv


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    rows = list(csv.reader(open(args.csv)))
    hdr, data = rows[1], rows[2:]
    ix = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    samples = [int(r[ix["Warp Stall Sampling (All Samples)"]] or 0) for r in data]
    execd = [int(r[ix["Instructions Executed"]] or 0) for r in data]
    total = sum(samples)
    warps = execd[0]  # the first instruction runs once per warp
    loop = [i for i, e in enumerate(execd) if e > 2 * warps]
    first, last = loop[0], loop[-1]
    print(f"{total} samples, {sum(execd)} warp instructions, {warps} warps; loop = SASS lines {first}-{last}")
    by = collections.Counter({h[6:]: sum(int(r[ix[h]] or 0) for r in data) for h in reasons})
    print("by reason: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by.most_common(8)))
    pro, body, epi = sum(samples[:first]), sum(samples[first:last + 1]), sum(samples[last + 1:])
    print(f"prologue {100 * pro / total:.1f}%, loop {100 * body / total:.1f}%, epilogue {100 * epi / total:.1f}%")
    print("loop loads (line, samples, SASS):")
    for i in range(first, last + 1):
        if "LDG" in data[i][1]:
            print(f"  {i:5d} {samples[i]:5d}  {data[i][1].strip()[:64]}")
    print(f"top {args.top} instructions (line, samples, executed, SASS, top reasons):")
    for i in sorted(range(len(data)), key=lambda i: -samples[i])[:args.top]:
        top = sorted(((int(data[i][ix[h]] or 0), h[6:]) for h in reasons), reverse=True)[:2]
        print(f"  {i:5d} {samples[i]:5d} {execd[i]:7d}  {data[i][1].strip()[:56]:56s} "
              + ", ".join(f"{k} {v}" for v, k in top if v))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
