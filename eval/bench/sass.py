"""Compile the Gluon channel kernels for a GPU target on any machine (no GPU needed) and count what they issue.

Triton compiles for ``GPUTarget("cuda", 90, 32)`` with the ptxas and cuobjdump its wheel ships, so registers,
spills and the SASS of the hot loops can be read before spending device time (docs/KERNELS.md quotes these
counts). The relabellings of ``kernels/decode/gluon/`` are checked here too: a fragment that is not a pure register
renumbering fails to compile (``assert_trivial``).

    python -m eval.bench.sass                      # table: every bit-width and head_dim, both passes, 2 warps
    python -m eval.bench.sass --warps 4 --arch 90 --out results/sass.json
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

from eval.jsonout import save_json

PTRS = {"q_ptr": "*fp16", "kc_ptr": "*i32", "vc_ptr": "*i32", "ks_ptr": "*fp16", "kz_ptr": "*fp16",
        "vs_ptr": "*fp16", "vz_ptr": "*fp16", "lens_ptr": "*i32", "cal_ptr": "*fp32", "out_ptr": "*fp32",
        "ml_ptr": "*fp32", "sync_ptr": "*i32", "fo_ptr": "*fp16", "lse_ptr": "*fp32"}
FLOATS = {"tau1", "tau2", "qk_scale"}
# arguments a real launch has 16-aligned (Triton specializes them so; without it the loads would not vectorize)
ALIGNED = {"sq_b", "sq_h", "sc_b", "sc_h", "sk_b", "sk_h", "sv_b", "sv_h", "HQ", "so_b", "so_h"}


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_channel(bits: int, D: int, G: int, mode: int, warps: int = 2, calib: bool = True, arch: int = 90,
                    maxnreg: int | None = None, stages: int = 0, pdl: bool = False, i8: bool = False,
                    itm: int = 0, cl: int = 0, fin: int = 0):
    """The compiled kernel (``asm`` holds ``cubin``, ``ptx``, ``ttgir``) of one Gluon channel-kernel variant."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels.decode import gluon as gc
    from kernels.decode.gluon.kernel import _channel_kernel

    consts = gc.kernel_consts(G, D, bits, warps, 1, 1, calib, mode, stages, pdl, i8, itm, cl, fin)
    fn = _channel_kernel
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else PTRS.get(n, "fp32" if n in FLOATS else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in PTRS or n in ALIGNED}
    src = GluonASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    opts = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


TEXT_PTRS = {"q_ptr": "*fp16", "kc_ptr": "*i32", "vc_ptr": "*i32", "ks_ptr": "*fp16", "kz_ptr": "*fp16",
             "vs_ptr": "*fp16", "vz_ptr": "*fp16", "lens_ptr": "*i32", "out_ptr": "*fp32", "ml_ptr": "*fp32",
             "fo_ptr": "*fp16", "lse_ptr": "*fp32"}
TEXT_ALIGNED = {"sq_b", "sq_h", "sc_b", "sc_h", "sk_b", "sk_h", "sk_n", "svc_b", "svc_h", "sv_b", "sv_h", "HQ"}


def compile_text(G: int = 8, D: int = 128, bits: int = 2, warps: int = 4, kblk: int = 32, group: int = 32,
                 arch: int = 90, vbits: int = 2, post: bool = False, pfd: int = 0, qsm: bool = False,
                 maxnreg: int | None = None, svec: bool = False, ring: int = 0, ksr: bool = False,
                 pdl: int = 0, cl: int = 0, fin: int = 0, unmasked: bool = True, dep: bool = False, pfn: int = 1,
                 kpair: bool = True, bcol: bool = True):
    """The compiled Gluon KIVI/XQuant kernel (``kernels/decode/gluon/text.py``) of one variant (``post``: values in
    tile order, post-scaled; ``dep``: launched beside the window's kernel, ``window_rules.window_overlap``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels.decode.gluon.text import _text_kernel, text_consts

    consts = text_consts(G, D, bits, warps, kblk, group, 1, vbits, post, pfd, qsm, svec, ring, ksr, pdl, cl, fin,
                         unmasked, dep, pfn, kpair, bcol)
    names = _text_kernel.arg_names
    ptrs = dict(TEXT_PTRS, vc_ptr={4: "*i32", 2: "*i16", 1: "*i8"}[D * vbits // 64])
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in FLOATS else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in TEXT_PTRS or n in TEXT_ALIGNED}
    src = GluonASTSource(_text_kernel, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    opts = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def text_report(tmp: str, **kw) -> dict:
    """Registers and the hot loop's opcode counts of one text-kernel variant (``compile_text``'s arguments): the
    first loop's (the unmasked body of full iterations where the variant has one) and, under ``"masked"``, the
    last loop's (the masked body)."""
    k = compile_text(**kw)
    ins = sass(k.asm["cubin"], tmp)
    loops = hot_loops(ins)
    return {**resources(k.asm["cubin"], tmp), "loops": len(loops), **({} if not loops else dict(loops[0])),
            "masked": dict(loops[-1]) if loops else {}, "wait": _wait_at(ins), "prefetch_block": _prefetch_block(ins)}


def _prefetch_block(ins: list[tuple[int, str]]) -> int:
    """Instructions of the first hot loop's body behind the forward branch that skips every L2 bulk prefetch
    (``UBLKPF``) in it: what an iteration that issues no prefetch request does not execute; 0 without one."""
    spans = loop_spans(ins)
    body = ins[spans[0][0]: spans[0][1] + 1] if spans else []
    at = [i for i, (_, t) in enumerate(body) if re.search(r"\bUBLKPF\b", t)]
    where = {a: i for i, (a, _) in enumerate(body)}
    best = 0
    for i, (_, t) in enumerate(body[: at[0]] if at else []):
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", t)
        if m and where.get(int(m.group(1), 16), -1) > at[-1]:
            best = max(best, where[int(m.group(1), 16)] - i - 1)
    return best


SKVQ_PTRS = {"q_ptr": "*fp16", "ks_ptr": "*fp16", "kz_ptr": "*fp16", "vs_ptr": "*fp16", "vz_ptr": "*fp16",
             "pk_ptr": "*u8", "gk_ptr": "*u8", "pv_ptr": "*u8", "gv_ptr": "*u8", "lens_ptr": "*i32",
             "out_ptr": "*fp32", "ml_ptr": "*fp32"}


def compile_skvq(G: int = 4, D: int = 128, kbits: int = 2, vbits: float = 2, ng: int = 2, fixed: bool = False,
                 perm: bool = True, fp8: bool = False, arch: int = 90, tlane: bool = False, maxnreg: int = 0,
                 pdl: int = 0, unmasked: bool = True, dep: bool = False, W: int = 4, pfd: int = 0, pfn: int = 1):
    """The compiled Gluon SKVQ kernel (``kernels/decode/gluon/skvq.py``) of one variant (fixed-size or variable
    groups, permuted or natural order; ``unmasked``: with the unmasked copy of the loop), as ``launch_skvq``
    launches it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels.decode.gluon.skvq import _skvq_kernel, skvq_consts

    size = D // ng if fixed else 0
    consts = skvq_consts(G, D, ng, kbits, vbits, size, size, perm, perm, fp8, tlane=tlane, pdl=pdl,
                         unmasked=unmasked, dep=dep, W=W, pfd=pfd, pfn=pfn)
    names = _skvq_kernel.arg_names
    words = {4: "*i32", 2: "*i16", 1: "*i8"}
    scale = "*u8" if fp8 else "*fp16"
    ptrs = dict(SKVQ_PTRS, kc_ptr=words[min(4, D * kbits // 32)], vc_ptr="*u8" if vbits == 1.5 else words[D * int(vbits) // 64], ks_ptr=scale,
                kz_ptr=scale, vs_ptr=scale, vz_ptr=scale)
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in FLOATS else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in ptrs}
    src = GluonASTSource(_skvq_kernel, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": W, **({"maxnreg": maxnreg} if maxnreg else {})})


def skvq_report(tmp: str, **kw) -> dict:
    """Registers and the hot loop's opcode counts of one SKVQ-kernel variant (``compile_skvq``'s arguments): the
    first loop's (the unmasked body where the variant has one) and, under ``"masked"``, the last loop's."""
    k = compile_skvq(**kw)
    ins = sass(k.asm["cubin"], tmp)
    loops = hot_loops(ins)
    return {**resources(k.asm["cubin"], tmp), "loops": len(loops), **({} if not loops else dict(loops[0])),
            "masked": dict(loops[-1]) if loops else {}, "trigger": _trigger_at(ins), "wait": _wait_at(ins),
            "prefetch_block": _prefetch_block(ins)}


def append_report(tmp: str, D: int = 128, HB: int = 8, arch: int = 90) -> dict:
    """The decode-append kernel (``kernels/ops/append.py``) compiled for ``arch``: registers, local memory, its block
    barriers and the global stores after the last one (the length's alone: no thread may still read a row's length
    once one has written it back)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.ops.append import _append_kernel

    names = _append_kernel.arg_names
    ptrs = {"k_ptr": "*fp16", "v_ptr": "*fp16", "kc_ptr": "*fp16", "vc_ptr": "*fp16", "lens_ptr": "*i32"}
    consts = {"HB": HB, "DP": D}
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    src = ASTSource(_append_kernel, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
    ins = [t for _, t in sass(k.asm["cubin"], tmp)]
    bars = [i for i, t in enumerate(ins) if re.search(r"\bBAR\.SYNC", t)]
    stores = [i for i, t in enumerate(ins) if re.search(r"\bSTG\b", t)]
    return {**resources(k.asm["cubin"], tmp), "bars": len(bars), "stores": len(stores),
            "stores_after_bar": sum(i > bars[-1] for i in stores) if bars else None}


def _wait_at(ins: list[tuple[int, str]]) -> str | None:
    """Where the wait for the previous kernel (``griddepcontrol.wait``: SASS ``ACQBULK``) sits: ``"before stores"``
    when there is one, past every loop and before the first global store after them (the text / SKVQ kernel launched
    beside the window's, ``DEP``); ``"elsewhere"``, or ``None`` without one."""
    at = [i for i, (_, t) in enumerate(ins) if re.search(r"\bACQBULK\b", t)]
    if not at:
        return None
    spans = loop_spans(ins)
    end = max((b for _, b in spans), default=-1)
    stores = [i for i, (_, t) in enumerate(ins) if i > end and re.search(r"\bSTG\b", t)]
    ok = len(at) == 1 and at[0] > end and (not stores or at[0] < stores[0])
    return "before stores" if ok else "elsewhere"


def _trigger_at(ins: list[tuple[int, str]]) -> str | None:
    """Where the merge launch's trigger (``griddepcontrol.launch_dependents``: SASS ``PREEXIT``) sits against the
    hot loop: before, in or after it; ``None`` without one."""
    at = [i for i, (_, t) in enumerate(ins) if re.search(r"\bPREEXIT\b", t)]
    spans = loop_spans(ins)
    if not at:
        return None
    if not spans:
        return "no loop"
    a, b = spans[0]
    return "before" if at[0] < a else "in" if at[0] <= b else "after"


def _cuobjdump(cubin: bytes, tmp: str, flag: str) -> str:
    path = os.path.join(tmp, "k.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    return subprocess.run([_tool("cuobjdump"), flag, path], capture_output=True, text=True, check=True).stdout


def resources(cubin: bytes, tmp: str) -> dict:
    """Registers, stack and local memory per thread (cuobjdump -res-usage)."""
    out = _cuobjdump(cubin, tmp, "-res-usage")
    return {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", out)}


def sass(cubin: bytes, tmp: str) -> list[tuple[int, str]]:
    """(address, instruction) of every SASS line (cuobjdump -sass)."""
    return [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", _cuobjdump(cubin, tmp, "-sass"))]


def _opcodes(body: list[tuple[int, str]]) -> collections.Counter:
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in body)


def loop_spans(instructions: list[tuple[int, str]], min_mma: int = 4) -> list[tuple[int, int]]:
    """[first, last] instruction index of each loop body (backward branch) that issues at least ``min_mma`` HMMA or
    IMMA, in program order."""
    where = {a: i for i, (a, _) in enumerate(instructions)}
    spans = []
    for i, (a, text) in enumerate(instructions):
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in where:
            ops = _opcodes(instructions[where[int(m.group(1), 16)]: i + 1])
            if ops["HMMA"] + ops["IMMA"] >= min_mma:
                spans.append((where[int(m.group(1), 16)], i))
    return spans


def hot_loops(instructions: list[tuple[int, str]], min_mma: int = 4) -> list[collections.Counter]:
    """Opcode counts of each loop body (backward branch) that issues at least ``min_mma`` HMMA, outermost first."""
    return [_opcodes(instructions[a: b + 1]) for a, b in loop_spans(instructions, min_mma)]


def report(bits: int, D: int, G: int, mode: int, warps: int, arch: int, tmp: str, stages: int | None = None,
           pdl: bool = True, i8: bool | None = None, itm: int = 8, cl: int = 0, fin: int = 0) -> dict:
    """Registers and hot-loop counts of one variant; by default the one an H100 runs (ring stages by bit-width,
    programmatic dependent launch, the K side on int8 tensor cores where ``decode_attention`` puts it). ``mode=2``:
    the fused kernel with ``itm`` logit slots (``cl``, ``fin``: its cluster variant); ``phases`` then holds the
    opcode counts of its K and V loops."""
    from kernels.decode import gluon as gc
    from kernels.decode.plan import _int8_k

    st = (0 if mode == 2 else gc.default_stages(bits)) if stages is None else stages
    i8 = _int8_k(bits, G) if i8 is None else i8
    k = compile_channel(bits, D, G, mode, warps=warps, arch=arch, stages=st, pdl=pdl, i8=i8,
                        itm=itm if mode == 2 else 0, cl=cl, fin=fin)
    res = resources(k.asm["cubin"], tmp)
    code = sass(k.asm["cubin"], tmp)
    loops = hot_loops(code, min_mma=1 if mode == 2 else 4)
    full = loops[0] if loops else collections.Counter()
    gdc = sum(1 for _, t in code if t.split()[0] in ("ACQBULK", "PREEXIT"))
    extra = {}
    if mode == 2:  # unmasked K loop, masked K loop, unmasked V loop, masked V loop
        spans = loop_spans(code, 1)
        # what runs between the last K loop and the first V loop: the (min, max) exchange and the calibration
        between = code[spans[1][1] + 1: spans[2][0]] if len(spans) == 4 else []
        extra = {"phases": [dict(loops[0]), dict(loops[2])] if len(loops) == 4 else [dict(x) for x in loops],
                 "exchange_barriers": _opcodes(between)["BAR"],
                 "atomics": sum(1 for _, t in code if "ATOMG" in t or "REDG" in t),
                 "cluster_barriers": sum(1 for _, t in code if t.split()[0] in ("UCGABAR_ARV", "UCGABAR_WAIT")),
                 "shared": k.metadata.shared}
    return {"bits": bits, "D": D, "G": G, "mode": ("main", "range", "fused")[mode], "warps": warps, "stages": st,
            **res, **extra,
            "int8_k": i8, "loop_instructions": sum(full.values()), "lop3": full["LOP3"], "hmma": full["HMMA"],
            "imma": full["IMMA"],
            "ldg": full["LDG"], "ldgsts": full["LDGSTS"], "bar": full["BAR"], "griddepcontrol": gdc,
            "tokens_per_warp_iteration": gc.rows_per_warp(bits) * (8 // bits)}


def main(argv: list[str] | None = None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warps", type=int, default=2)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for D in (64, 128):
            for bits in (1, 2, 4, 8):
                for i8 in (True, False) if bits == 1 else (False,):
                    for mode in (0, 1):
                        rows.append(report(bits, D, 4, mode, args.warps, args.arch, tmp, i8=i8))
    print("| D | bits | pass | K side | stages | registers | stack | local | loop instructions | lop3 | HMMA | IMMA | "
          "tokens per warp iteration |")
    print("|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['D']} | {r['bits']} | {r['mode']} | {'int8' if r['int8_k'] else 'fp16'} | {r['stages']} | "
              f"{r['reg']} | {r['stack']} | {r['local']} | {r['loop_instructions']} | {r['lop3']} | {r['hmma']} | "
              f"{r['imma']} | {r['tokens_per_warp_iteration']} |")
    if args.out:
        save_json(Path(args.out), {"arch": args.arch, "warps": args.warps, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
