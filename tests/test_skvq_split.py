"""SKVQ's batch-1 levers (``kernels/decode/skvq_rules.py``, issue 26): ``MMKV_SKVQ_SPLIT`` / ``MMKV_SKVQ_TPS``
(tiles per split) and ``MMKV_SKVQ_PDL`` (the merge launch started early by the Gluon kernel).

The rules are device-free. The splits they plan run here under Triton's interpreter on CPU (the Triton SKVQ
kernel; compiled on CUDA) against the torch reference (``kernels.reference``): odd and ragged lengths (one row
empty), GQA groups 1-8, head_dim 64 and 128, 1/2/3-bit keys, 1/1.5/2-bit values, fp16 and FP8 scales, an SKVQ
segment beside a dense one, outputs pre-filled with NaN; relative L2 error < 2e-3 (fp16 MMA operands, fp32
accumulation, as in ``test_skvq_kernel.py``). The Gluon kernel's trigger needs sm_90: ``test_skvq_gluon.py``
compiles it on CPU and runs it on the GPU (``-m gpu``)."""

from __future__ import annotations

import torch
from triton_switch import CUDA, fixtures, switch_on

IN_PROCESS, _WE_SET_INTERPRET = switch_on()  # before triton and the kernels are imported

import pytest  # noqa: E402

import kernels  # noqa: E402
from kernels import testing  # noqa: E402
from kernels.decode import dispatch, skvq_rules  # noqa: E402
from kernels.decode import plan as plan_mod  # noqa: E402
from kernels.reference import decode_reference  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
_in_process_only, _restore_env, test_interpreter_subprocess = fixtures(__file__, IN_PROCESS, _WE_SET_INTERPRET)

NAMES = ("MMKV_SKVQ_SPLIT", "MMKV_SKVQ_TPS", "MMKV_SKVQ_PDL", "MMKV_SKVQ_WAVES")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)


def test_waves_rule(monkeypatch):
    """``MMKV_SKVQ_WAVES`` unset (or set empty): one wave below 32 (row, KV head) pairs, from there the text kernel's
    ``waves.whole_waves`` (one nearly full wave for rows under 8192 tokens at head_dim 128, else 3 or more); 0 the
    byte rule, a count 1-8;
    anything else is refused by name."""
    assert skvq_rules.skvq_waves(1, 8, 4, 132, 32768) == 1  # 8 pairs: one wave of 64 splits
    assert skvq_rules.skvq_waves(3, 10, 4, 132, 32768) == 1  # 30 pairs
    assert skvq_rules.skvq_waves(16, 8, 4, 132, 32768) == 3  # the step's measurement: 3 waves, not one
    assert skvq_rules.skvq_waves(16, 8, 4, 132, 4096) == 1
    assert skvq_rules.skvq_waves(4, 8, 4, 132, 8192) == 3  # 32 pairs of 8192 tokens
    assert skvq_rules.skvq_waves(16, 3, 4, 132, 8192, 64) == 1  # head_dim 64: rows of half the elements
    monkeypatch.setenv("MMKV_SKVQ_WAVES", "")
    assert skvq_rules.skvq_waves(16, 8, 4, 132, 32768) == 3
    for v in ("0", "1", "3", "8"):
        monkeypatch.setenv("MMKV_SKVQ_WAVES", v)
        assert skvq_rules.skvq_waves(16, 8, 4, 132, 32768) == int(v)
    for bad in ("9", "-1", "x"):
        monkeypatch.setenv("MMKV_SKVQ_WAVES", bad)
        with pytest.raises(ValueError, match="MMKV_SKVQ_WAVES must be 0-8"):
            skvq_rules.skvq_waves(16, 8, 4, 132, 32768)


def test_wave_tiles_fill_the_waves_asked(monkeypatch):
    """``skvq._wave_tiles`` on a planned Gluon segment: ``waves x resident x SMs // pairs`` splits, the tiles spread
    over them (InternVL heads B16 at 4 programs per SM of 132 SMs: one wave 4 splits, three 12); 0 for the byte
    rule and for the Triton tile."""
    from kernels.decode import skvq
    seg = testing.skvq_seg(1, 8, 64, 128, [64], 2, 2.0, 2)
    monkeypatch.setattr(skvq, "launch_key", lambda *a: None)
    monkeypatch.setattr(skvq, "resident", lambda *a: 4)
    short = {"tt": 128, "tiles": 32, "T": 4096}
    assert skvq._wave_tiles(seg, short, 16, 8, 4, 128, 132) == 8  # 528 slots: 4 splits of 128 pairs
    long = {"tt": 128, "tiles": 256, "T": 32768}
    assert skvq._wave_tiles(seg, long, 16, 8, 4, 128, 132) == 22  # 3 waves: 12 splits, ceil(256 / 12)
    monkeypatch.setenv("MMKV_SKVQ_WAVES", "1")
    assert skvq._wave_tiles(seg, long, 16, 8, 4, 128, 132) == 64
    assert skvq._wave_tiles(seg, {"tt": skvq.TILE, "tiles": 256, "T": 32768}, 16, 8, 4, 128, 132) == 0
    monkeypatch.setenv("MMKV_SKVQ_WAVES", "0")
    assert skvq._wave_tiles(seg, long, 16, 8, 4, 128, 132) == 0


def test_split_rule(monkeypatch):
    gl4k = {"T": 4096, "tt": 128}  # the Gluon kernel's 128-token tile
    assert skvq_rules.skvq_split(gl4k, 1, 8, 1) == 2  # unset: 256 tokens for the Gluon kernel at head_dim 128
    assert skvq_rules.skvq_split(gl4k, 1, 3, 1, 64) == 1  # head_dim 64: the plan's (one wave of one-tile splits)
    assert skvq_rules.skvq_split({"T": 4096, "tt": 32}, 1, 8, 3, 128, False) == 3  # the Triton kernel: the plan's
    assert skvq_rules.skvq_split({"T": 32768, "tt": 128}, 1, 8, 4) == 4  # long rows: one wave
    assert skvq_rules.skvq_split(gl4k, 4, 8, 1) == 1  # 32 pairs
    monkeypatch.setenv("MMKV_SKVQ_SPLIT", "0")
    assert skvq_rules.skvq_split(gl4k, 1, 8, 1) == 1
    monkeypatch.setenv("MMKV_SKVQ_SPLIT", "1")
    assert skvq_rules.skvq_split(gl4k, 1, 8, 1) == 2  # 256 tokens: raised from one wave's 128
    assert skvq_rules.skvq_split(gl4k, 1, 3, 5) == 2  # and lowered from a longer split
    assert skvq_rules.skvq_split({"T": 4096, "tt": 32}, 1, 8, 3) == 8  # Triton tiles: the same 256 tokens
    assert skvq_rules.skvq_split({"T": 16383, "tt": 128}, 3, 10, 4) == 2  # 30 pairs, just under 16k tokens
    assert skvq_rules.skvq_split({"T": 16384, "tt": 128}, 1, 8, 4) == 4  # long rows: the plan's one wave
    assert skvq_rules.skvq_split(gl4k, 4, 8, 1) == 1  # 32 pairs and up: the plan's
    assert skvq_rules.skvq_split(gl4k, 16, 8, 1) == 1
    assert skvq_rules.skvq_split({"T": 100, "tt": 512}, 1, 1, 1) == 1  # a tile longer than a split: one
    monkeypatch.setenv("MMKV_SKVQ_TPS", "3")
    assert skvq_rules.skvq_split(gl4k, 1, 8, 1) == 3  # replaces the plan's and SPLIT's
    assert skvq_rules.skvq_split(gl4k, 16, 8, 7) == 3
    for bad in ("0", "x", "-1"):
        monkeypatch.setenv("MMKV_SKVQ_TPS", bad)
        with pytest.raises(ValueError):
            skvq_rules.skvq_split(gl4k, 1, 8, 1)
    monkeypatch.delenv("MMKV_SKVQ_TPS")
    monkeypatch.setenv("MMKV_SKVQ_SPLIT", "2")
    with pytest.raises(ValueError):
        skvq_rules.skvq_split(gl4k, 1, 8, 1)


def test_pdl_rule(monkeypatch):
    assert skvq_rules.skvq_pdl(1, 8, 4096, 128) == 1  # unset: past the loop below 32 pairs
    assert skvq_rules.skvq_pdl(1, 3, 32768, 64) == 1
    assert skvq_rules.skvq_pdl(3, 10, 4096, 128) == 1
    assert skvq_rules.skvq_pdl(4, 8, 4096, 128) == 0  # 32 pairs and up: never
    assert skvq_rules.skvq_pdl(16, 8, 32768, 128) == 0
    for v in ("0", "1", "2"):
        monkeypatch.setenv("MMKV_SKVQ_PDL", v)
        assert skvq_rules.skvq_pdl(16, 8, 32768, 128) == int(v)
    monkeypatch.setenv("MMKV_SKVQ_PDL", "3")
    with pytest.raises(ValueError):
        skvq_rules.skvq_pdl(1, 8, 4096, 128)


@pytest.mark.parametrize("shape,B,T,wave,default,split", [
    ("internvl", 1, 4096, (1, 32), (2, 16), (2, 16)), ("internvl", 1, 32768, (4, 64), (4, 64), (4, 64)),
    ("internvl", 16, 32768, (22, 12), (22, 12), (22, 12)), ("smollm2", 1, 4096, (1, 32), (1, 32), (2, 16)),
    ("smollm2", 1, 32768, (2, 128), (2, 128), (2, 128)), ("smollm2", 16, 32768, (8, 32), (8, 32), (8, 32))])
def test_gluon_splits_of_the_sweep_shapes(shape, B, T, wave, default, split, monkeypatch):
    """(tiles per split, splits per (row, KV head)) of the Gluon kernel's 128-token tiles at 4 programs per SM of
    132 (124-128 registers), with ``MMKV_SKVQ_SPLIT`` 0 / unset / 1: one wave gives splits of one tile at batch 1
    n4096 and long rows at batch 1, three waves long rows at batch 16 (``skvq_waves``); the default halves the
    splits at batch 1 n4096 at head_dim 128 (InternVL heads), ``MMKV_SKVQ_SPLIT=1`` at any head_dim, and both leave
    the rest alone (docs/BENCHMARKS.md, SKVQ, batch-1 levers)."""
    from kernels.decode import skvq

    H, D, G = {"internvl": (8, 128, 4), "smollm2": (3, 64, 3)}[shape]
    monkeypatch.setattr(skvq, "resident", lambda dev, key: 4)
    seg = testing.skvq_seg(1, H, 64, D, [64], 2, 2.0, 2 if D == 128 else 1)
    it = {"tt": 128, "tiles": T // 128, "T": T}
    planned = skvq._wave_tiles(seg, it, B, H, G, D, 132)
    for env, want in (("0", wave), (None, default), ("1", split)):
        if env:
            monkeypatch.setenv("MMKV_SKVQ_SPLIT", env)
        else:
            monkeypatch.delenv("MMKV_SKVQ_SPLIT", raising=False)
        tps = min(skvq_rules.skvq_split(it, B, H, planned, D), it["tiles"])
        assert (tps, -(-it["tiles"] // tps)) == want


def _plan(q, segs, B, H, G, D):
    items, S, _ = plan_mod.plan_items(q, segs, B, H, G, D, 132, None, 2, True, None, None, 64)
    return items, S


def test_plan_takes_the_rules_on_any_device(monkeypatch):
    """The ``Layout.split`` hook runs off CUDA too (the interpreter's splits below are the rule's); the early merge
    launch only where programmatic dependent launch works (sm_90, compiled), never on this device."""
    g = torch.Generator().manual_seed(1)
    B, H, G, D, T = 1, 3, 3, 64, 777
    seg = testing.skvq_seg(B, H, T, D, [T], 2, 2.0, 2, g=g, device=DEV)
    q = torch.randn(B, H * G, D, generator=g).to(DEV, torch.float16)
    base = _plan(q, [seg], B, H, G, D)[0][0]
    fixed = plan_mod.plan_items(q, [seg], B, H, G, D, 132, None, 2, True, 4.0, None, 64)[0][0]  # programs_per_sm
    monkeypatch.setenv("MMKV_SKVQ_SPLIT", "1")
    monkeypatch.setenv("MMKV_SKVQ_PDL", "1")
    it, S = _plan(q, [seg], B, H, G, D)
    it = it[0]
    assert it["tps"] * it["tt"] == 256 and it["nsplit"] == S == -(-T // 256)
    assert it["pdl"] == (1 if plan_mod._pdl_ok(q.device) else 0)
    if not CUDA:
        assert base["tt"] == 32 and it["pdl"] == 0
    monkeypatch.setenv("MMKV_SKVQ_TPS", "100")  # longer than the segment: one split
    it, S = _plan(q, [seg], B, H, G, D)
    assert it[0]["tps"] == it[0]["tiles"] and S == 1
    it = plan_mod.plan_items(q, [seg], B, H, G, D, 132, None, 2, True, 4.0, None, 64)[0][0]
    assert it["tps"] == fixed["tps"] and not it.get("pdl")  # programs_per_sm given: the caller's plan, no rules


def _check(q, segs, tol=2e-3):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    got, lse = kernels.decode_attention(q, segs, out=out, return_lse=True)
    ref, ref_lse = decode_reference(q, segs)
    assert not torch.isnan(got).any(), "unwritten or NaN output"
    live = torch.isfinite(ref_lse)
    err = ((got.float() - ref.float())[live].norm() / ref.float()[live].norm()).item()
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"
    assert torch.equal(torch.isfinite(lse), live)
    assert torch.allclose(lse[live], ref_lse.float()[live], rtol=1e-3, atol=1e-2)
    assert (got[~live] == 0).all()
    return got


CASES = [  # B, H, G, T, lens, D, k bits, v bits, groups, fixed, permuted, fp8
    (1, 3, 3, 601, [601], 64, 2, 2.0, 2, False, True, False),
    (2, 2, 4, 577, [577, 300], 128, 2, 1.5, 2, True, True, True),
    (3, 1, 8, 333, [333, 129, 0], 64, 1, 2.0, 1, True, False, False),
    (1, 2, 1, 1003, [1001], 128, 3, 1.0, 4, False, True, False),
    (2, 3, 5, 259, [259, 257], 128, 2, 2.0, 2, False, True, True),
]
_DEFAULT: dict = {}
MODES = {"split": {"MMKV_SKVQ_SPLIT": "1"}, "tps1": {"MMKV_SKVQ_TPS": "1"}, "tps5": {"MMKV_SKVQ_TPS": "5"},
         "split+pdl2": {"MMKV_SKVQ_SPLIT": "1", "MMKV_SKVQ_PDL": "2"}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}H{c[1]}G{c[2]}T{c[3]}D{c[5]}k{c[6]}v{c[7]:g}ng{c[8]}"
                                             for c in CASES])
def test_splits_match_reference(case, mode, monkeypatch):
    B, H, G, T, lens, D, kb, vb, ng, fixed, perm, fp8 = case
    key = repr(case)
    if key not in _DEFAULT:  # the default splits' output, checked once per case for the four modes
        g = torch.Generator().manual_seed(T + G + D + kb)
        seg = testing.skvq_seg(B, H, T, D, lens, kb, vb, ng, fixed, perm, fp8, g=g, device=DEV)
        q = torch.randn(B, H * G, D, generator=g).to(DEV, torch.float16)
        _DEFAULT[key] = (seg, q, _check(q, [seg]))
    seg, q, before = _DEFAULT[key]
    for k, v in MODES[mode].items():
        monkeypatch.setenv(k, v)
    after = _check(q, [seg])
    assert ((after.float() - before.float()).norm() / before.float().norm()) < 2e-3  # other splits, same result


def test_split_beside_a_dense_segment(monkeypatch):
    """Sinks (dense) + SKVQ split by the rule + window (dense): the SKVQ splits' global offsets in one merge."""
    monkeypatch.setenv("MMKV_SKVQ_SPLIT", "1")
    g = torch.Generator().manual_seed(7)
    B, H, G, D = 2, 3, 3, 64
    segs = [testing.dense_seg(B, H, 5, D, [5, 3], g=g, device=DEV),
            testing.skvq_seg(B, H, 700, D, [700, 1], 2, 1.5, 2, False, True, True, g=g, device=DEV),
            testing.dense_seg(B, H, 17, D, [17, 0], g=g, device=DEV)]
    q = torch.randn(B, H * G, D, generator=g).to(DEV, torch.float16)
    _check(q, segs)


def test_triton_kernel_never_triggers(monkeypatch):
    """A segment planned in Gluon tiles (forced here: the tile the Gluon kernel would take) that the Triton kernel
    reads (8 groups x 4 query heads: more MMA columns than the Gluon kernel takes, on any device) runs the plan's
    splits in Triton tiles, and where the plan asked for the early merge launch (forced as well) the merge is
    launched as an ordinary kernel: the Triton kernel does not trigger it."""
    import dataclasses

    from kernels.decode.gluon.skvq import gluon_tile
    from kernels.decode.registry import LAYOUTS
    from kernels.layouts import SkvqSeg

    monkeypatch.setenv("MMKV_SKVQ_PDL", "1")
    monkeypatch.setenv("MMKV_SKVQ_TPS", "1")
    monkeypatch.setattr(plan_mod, "_pdl_ok", lambda dev: True)
    monkeypatch.setitem(LAYOUTS, SkvqSeg, dataclasses.replace(LAYOUTS[SkvqSeg], tile=lambda seg, d: gluon_tile()))
    seen, planned = [], []
    real_merge, real_plan = dispatch._launch_merge, dispatch.plan_items

    def merge(part_o, part_ml, out, lse, S, pdl):
        seen.append(pdl)
        return real_merge(part_o, part_ml, out, lse, S, False)

    def plan(*a):
        items, S, fin = real_plan(*a)
        planned.append((items[0]["tt"], items[0]["pdl"], S))
        return items, S, fin

    monkeypatch.setattr(dispatch, "_launch_merge", merge)
    monkeypatch.setattr(dispatch, "plan_items", plan)
    g = torch.Generator().manual_seed(3)
    B, H, G, D, T = 2, 2, 4, 128, 300
    seg = testing.skvq_seg(B, H, T, D, [T, 77], 2, 2.0, 8, g=g, device=DEV)
    q = torch.randn(B, H * G, D, generator=g).to(DEV, torch.float16)
    _check(q, [seg])
    assert planned == [(gluon_tile(), 1, -(-T // gluon_tile()))] and seen == [False]
