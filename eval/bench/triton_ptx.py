"""Compile the plain Triton decode kernels for sm_90 on any machine (no GPU needed) and fingerprint their SASS.

A refactor of ``@triton.jit`` code that should not change what the kernels compute (helpers moved between files,
inlined by Triton) is checked here: the same constexpr variants are compiled before and after, and registers,
SASS instruction count and a hash of the SASS text without addresses are compared. Run it once with the old tree
first on ``PYTHONPATH`` and once with the new one (the script itself only needs ``kernels`` importable):

    PYTHONPATH=/tmp/base python eval/bench/triton_ptx.py --out before.json
    PYTHONPATH=$PWD python eval/bench/triton_ptx.py --out after.json
    python eval/bench/triton_ptx.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

DENSE, CHANNEL, KIVI = 1, 2, 3
# pointer element types of each kernel's pointer arguments (everything else not listed is an int32 scalar)
FLOATS = {"qk_scale", "tau1", "tau2"}


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _seg_variants():
    out = []
    base = dict(MODE=0, BITS=8, VBITS=8, GROUP=1, SDK=1, SDV=1, SINGLE=True, CALIB=False, IEEE=False, KBLK=1,
                TRIG=False)
    for D in (64, 128):
        for G in (1, 4, 8):
            tt = 64 if D <= 64 else 32
            out.append((f"seg dense D{D} G{G}", dict(base, KIND=DENSE, G=G, D=D, TT=tt), "*fp16", 4, 3))
    out.append(("seg dense fp32 ieee D128 G4", dict(base, KIND=DENSE, G=4, D=128, TT=32, IEEE=True), "*fp32", 4, 3))
    out.append(("seg dense D128 G4 trig", dict(base, KIND=DENSE, G=4, D=128, TT=32, TRIG=True), "*fp16", 4, 3))
    for D, G, bits, single, calib, mode in [(64, 4, 2, True, False, 0), (128, 4, 4, False, False, 0),
                                            (128, 8, 2, True, True, 0), (64, 1, 4, False, True, 0),
                                            (128, 4, 2, False, False, 1), (64, 8, 8, True, False, 0)]:
        c = dict(base, KIND=CHANNEL, MODE=mode, G=G, D=D, BITS=bits, TT=64, SINGLE=single, CALIB=calib)
        out.append((f"seg channel {bits}b D{D} G{G}{' multi' if not single else ''}{' calib' if calib else ''}"
                    f"{' range' if mode else ''}", c, "*u8", 4, 3))
    for D, G, kb, vb, tt, single, trig in [(128, 4, 2, 2, 64, True, False), (64, 8, 4, 4, 128, False, False),
                                           (128, 1, 4, 2, 64, False, True), (64, 4, 2, 4, 128, True, False)]:
        c = dict(base, KIND=KIVI, G=G, D=D, BITS=kb, VBITS=vb, GROUP=32, TT=tt, SINGLE=single, KBLK=32, TRIG=trig)
        out.append((f"seg kivi k{kb}v{vb} D{D} G{G} TT{tt}{' multi' if not single else ''}{' trig' if trig else ''}",
                    c, "*u8", 4, 3))
    return out


def _gp(G: int) -> int:
    return 1 << max(0, (G - 1).bit_length())


def _compile_one(fn, consts: dict, ptr_types: dict, warps: int, stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else ptr_types.get(n, "fp32" if n in FLOATS else "i32") for n in names}
    # pointers 16-byte aligned, as every launch passes them (the loads vectorize on it)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in ptr_types}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def variants():
    """(name, kernel, constexprs, pointer types, warps, stages) of every variant compared."""
    from kernels.decode.alignedkv import _keys_pass, _stats_pass, _values_pass
    from kernels.decode.segment_kernel import _segment_kernel
    from kernels.decode.skvq import _skvq_kernel
    from kernels.decode.states import _merge_kernel

    rows = []
    for name, c, code_t, warps, stages in _seg_variants():
        c = dict(c, GP=_gp(c["G"]))
        ptrs = {"q_ptr": "*fp16", "lens_ptr": "*i32", "cal_ptr": "*fp32", "po_ptr": "*fp32", "pml_ptr": "*fp32"}
        if c["KIND"] == DENSE:
            ptrs.update(P0=code_t, P1=code_t, P2="*fp32", P3="*fp32", P4="*fp32", P5="*fp32")
        else:
            ptrs.update(P0="*u8", P1="*u8", P2="*fp16", P3="*fp16", P4="*fp16", P5="*fp16")
        if c["KIND"] == KIVI:
            stages = 3
        rows.append((name, _segment_kernel, c, ptrs, warps, stages))
    sk_ptrs = {n: "*u8" for n in ("kc_ptr", "kh_ptr", "vc_ptr", "vh_ptr")}
    sk_ptrs.update(q_ptr="*fp16", pk_ptr="*i32", gk_ptr="*i32", pv_ptr="*i32", gv_ptr="*i32", lens_ptr="*i32",
                   po_ptr="*fp32", pml_ptr="*fp32")
    for D, G, kb, vb, tern, fk, fv, perm, fp8 in [(128, 4, 4, 2, False, 0, 0, True, False),
                                                  (128, 4, 3, 2, False, 16, 16, False, False),
                                                  (64, 8, 2, 0, True, 0, 0, True, False),
                                                  (128, 1, 4, 0, True, 16, 16, False, True),
                                                  (64, 4, 4, 4, False, 0, 16, True, True)]:
        ng = D // 16
        c = dict(G=G, GP=_gp(G), D=D, NG=ng, KBITS=kb, VBITS=vb, TERN=tern, NB=max(16, _gp(-(-D // 5))),
                 FIXED_K=fk, FIXED_V=fv, KPERM=perm, VPERM=perm, FP8=fp8, TT=32)
        p = dict(sk_ptrs, **{n: "*u8" if fp8 else "*fp16" for n in ("ks_ptr", "kz_ptr", "vs_ptr", "vz_ptr")})
        rows.append((f"skvq k{kb}v{'1.5' if tern else vb} D{D} G{G}{' fixed' if fk else ''}"
                     f"{' perm' if perm else ''}{' fp8' if fp8 else ''}", _skvq_kernel, c, p, 4, 3))
    ak = {n: "*u8" for n in ("KH", "KM", "KL", "KC", "VH", "VM", "VL", "VC", "lev_ptr")}
    ak.update(q_ptr="*fp16", lens_ptr="*i32", x_ptr="*fp32", ml_ptr="*fp32", oe_ptr="*fp32", lse_ptr="*fp32",
              est_ptr="*fp32", po_ptr="*fp32", pml_ptr="*fp32")
    # the values rule: paper (the default: |v| in O_est and the authors' thresholds), conservative, full
    for D, G, blk, est, stats, paper in [(128, 4, 64, True, False, True), (64, 8, 32, False, True, False),
                                         (128, 1, 64, True, True, False)]:
        c = dict(G=G, GP=_gp(G), D=D, BLK=blk, MIN_BITS=8, FULL=False, FORCE=0, EST=est, ABS=paper, STATS=stats)
        rows.append((f"aligned keys D{D} G{G} B{blk}{' est' if est else ''}{' abs' if paper else ''}"
                     f"{' stats' if stats else ''}", _keys_pass,
                     c, {k: v for k, v in ak.items() if k in _keys_pass.arg_names}, 4, 3))
        c = dict(G=G, GP=_gp(G), D=D, BLK=blk, MIN_BITS=8, FULL=not est, FORCE=0, PAPER=paper, STATS=stats)
        rows.append((f"aligned values D{D} G{G} B{blk}{' full' if not est else ' paper' if paper else ''}"
                     f"{' stats' if stats else ''}",
                     _values_pass, c, {k: v for k, v in ak.items() if k in _values_pass.arg_names}, 4, 3))
    for D in (64, 128):
        for est in (True, False):
            rows.append((f"aligned stats D{D}{' est' if est else ''}", _stats_pass, dict(D=D, BS=16, EST=est),
                         {k: v for k, v in ak.items() if k in _stats_pass.arg_names}, 4, 3))
    mp = {"po_ptr": "*fp32", "pml_ptr": "*fp32", "out_ptr": "*fp16", "lse_ptr": "*fp32"}
    for D in (64, 128):
        for lse, pdl in ((False, False), (True, False), (True, True)):
            rows.append((f"merge D{D}{' lse' if lse else ''}{' pdl' if pdl else ''}", _merge_kernel,
                         dict(D=D, BS=16, HAS_LSE=lse, PDL=pdl, DC=D), mp, 4, 3))
    return rows


def _sass(cubin: bytes, tmp: str) -> tuple[list[str], int]:
    path = os.path.join(tmp, "k.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    text = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True, check=True).stdout
    # instruction text without its address; branch targets are addresses too, but they move only if code moves
    body = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", text)]
    return body, int(re.search(r"\bREG:(\d+)", res).group(1))


def measure(only: str | None, sass_dir: str | None) -> dict:
    import triton
    from triton import knobs

    import kernels

    out = {"triton": triton.__version__, "kernels": os.path.dirname(kernels.__file__),
           "lineinfo": not knobs.compilation.disable_line_info, "rows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn, c, ptrs, warps, stages in variants():
            if only and only not in name:
                continue
            t0 = time.time()
            k = _compile_one(fn, c, ptrs, warps, stages)
            body, reg = _sass(k.asm["cubin"], tmp)
            ptx = k.asm["ptx"].split(".section")[0]  # debug sections and .loc lines name source lines, which move
            ptx_lines = [ln for ln in ptx.splitlines()
                         if ln.strip() and not ln.lstrip().startswith(("//", ".loc", ".file", "$L__tmp"))]
            # the instructions with their operands, sorted, register/predicate names, reuse flags and branch
            # targets aside: equal where only the schedule and the register assignment differ
            mix = sorted(re.sub(r"\bU?R\d+\b|\bU?P\d\b|\.reuse|0x[0-9a-f]+$", "_", t) for t in body)
            out["rows"][name] = {"reg": reg, "instructions": len(body),
                                 "sass_sha": hashlib.sha256("\n".join(body).encode()).hexdigest()[:16],
                                 "mix_sha": hashlib.sha256("\n".join(mix).encode()).hexdigest()[:16],
                                 "ptx_lines": len(ptx_lines),
                                 "ptx_sha": hashlib.sha256("\n".join(ptx_lines).encode()).hexdigest()[:16]}
            if sass_dir:
                os.makedirs(sass_dir, exist_ok=True)
                with open(os.path.join(sass_dir, re.sub(r"\W+", "_", name) + ".sass"), "w") as f:
                    f.write("\n".join(body) + "\n")
                with open(os.path.join(sass_dir, re.sub(r"\W+", "_", name) + ".ptx"), "w") as f:
                    f.write("\n".join(ptx_lines) + "\n")
            r = out["rows"][name]
            print(f"{name:48s} reg {r['reg']:4d} sass {r['instructions']:6d} {r['sass_sha']} ({time.time() - t0:.1f}s)",
                  flush=True)
    return out


def compare(a: dict, b: dict) -> int:
    print(f"triton {a['triton']} -> {b['triton']}; before: {a['kernels']}; after: {b['kernels']}; "
          f"line info {a.get('lineinfo')} -> {b.get('lineinfo')}")
    print("| variant | regs before | regs after | SASS instr. before | after | SASS text | SASS mix | PTX |")
    print("|---|---:|---:|---:|---:|---|---|---|")
    diff = 0
    for name, r in a["rows"].items():
        s = b["rows"].get(name)
        if s is None:
            print(f"| {name} | {r['reg']} | - | {r['instructions']} | - | missing | missing |")
            diff += 1
            continue
        same = r["sass_sha"] == s["sass_sha"]
        same_ptx = r["ptx_sha"] == s["ptx_sha"]
        diff += not same
        same_mix = r["mix_sha"] == s["mix_sha"]
        print(f"| {name} | {r['reg']} | {s['reg']} | {r['instructions']} | {s['instructions']} | "
              f"{'identical' if same else 'DIFFERS'} | {'identical' if same_mix else 'differs'} | "
              f"{'identical' if same_ptx else 'differs'} |")
    print(f"{len(a['rows']) - diff} of {len(a['rows'])} variants with identical SASS")
    return 1 if diff else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--only", help="variants whose name contains this")
    ap.add_argument("--sass-dir", help="write each variant's SASS (no addresses) here, for diff")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args(argv)
    if args.compare:
        with open(args.compare[0]) as f, open(args.compare[1]) as g:
            return compare(json.load(f), json.load(g))
    res = measure(args.only, args.sass_dir)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
