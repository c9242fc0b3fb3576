"""The one-row CPU decode path (``kernels/decode/cpu_row.py``: one compiled call a segment) against the torch
reference, and where it must step aside for the block path of ``cpu.py``.

Random, odd-sized inputs: token counts that end inside a key block, empty segments beside full ones, GQA groups 1,
3 and 8, head_dim 64 and 128, KIVI/XQuant codes at 1/2/4/8 bits with key blocks of 32-128 tokens, value groups of
8-64 channels, fp16 and fp32 scales. The C loops accumulate in their own order and take exp from a degree-7
polynomial (relative error < 2e-7): outputs agree with the fp32 reference to 2e-5 relative, lse to 1e-4 absolute.
The thread's work buffer is filled with NaN before every call, so nothing stale may leak into a result.
"""

from __future__ import annotations

import math

import pytest
import torch

import kernels.decode.cpu as cpu
import kernels.decode.cpu_native as cpu_native
import kernels.decode.cpu_row as cpu_row
from kernels.reference import decode_reference
from kernels.testing import channel_seg, dense_seg, kivi_seg, skvq_seg

TOL = 2e-5

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler: the compiled loops are absent")


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def lse_close(a, b) -> bool:
    fin = torch.isfinite(b)
    return bool(torch.equal(fin, torch.isfinite(a)) and torch.allclose(a[fin], b[fin], atol=1e-4, rtol=1e-5))


def _poison(hq, g, d):
    with torch.inference_mode():  # the buffers may have been made under it (an engine test in the same worker)
        cpu_row._work(hq, g, d).fill_(float("nan"))
        cpu_row._scratch("l", hq).fill_(float("nan"))


def _scales_fp32(seg):
    for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
        setattr(seg, name, getattr(seg, name).float())
    return seg


def check(segs, H, G, D, g, scale=0.1, q_scale=1.0):
    q = torch.randn(1, H * G, D, generator=g) * q_scale
    todo = cpu_row.plan(q.unsqueeze(2), segs)
    assert todo is not None, "the row path should read these segments"
    _poison(H * G, G, D)
    out, lse = cpu.decode_attention_cpu(q, segs, scale)
    ref, ref_lse = decode_reference(q, segs, scale)
    assert torch.isfinite(out).all()
    assert rel(out, ref) < TOL, rel(out, ref)
    assert lse_close(lse, ref_lse)


CASES = [  # H, G, D, KIVI tokens (lens), k_bits, v_bits, block, group, fp32 scales
    (3, 3, 64, 197, 2, 2, 32, 32, False),  # SmolLM2's heads, the app's default text spec
    (2, 4, 128, 301, 2, 1, 32, 64, False),  # XQuant's K2/V1 layer, InternVL heads
    (1, 8, 64, 77, 1, 4, 64, 16, True),
    (4, 1, 128, 129, 4, 2, 128, 8, False),
    (2, 3, 64, 33, 8, 8, 32, 32, True),
]


@pytest.mark.parametrize("case", CASES, ids=[f"H{c[0]}G{c[1]}D{c[2]}-n{c[3]}-k{c[4]}v{c[5]}-b{c[6]}g{c[7]}"
                                             + ("-fp32" if c[8] else "") for c in CASES])
def test_row_path_matches_reference(case):
    H, G, D, n, kb, vb, block, group, fp32 = case
    g = torch.Generator().manual_seed(n * 7 + D + kb)
    kv = kivi_seg(1, H, n + 40, D, [n], k_bits=kb, v_bits=vb, block=block, group=group, g=g)
    segs = [dense_seg(1, H, 4, D, [4], dtype=torch.float32, g=g),
            _scales_fp32(kv) if fp32 else kv,
            dense_seg(1, H, 150, D, [131], dtype=torch.float32, g=g)]
    check(segs, H, G, D, g)


SKVQ_CASES = [  # H, G, D, tokens, k_bits, v_bits, groups, fixed, permuted, fp8
    (3, 3, 64, 197, 2, 2, 1, True, True, False),  # SmolLM2's default: one group of 64 per head
    (2, 4, 128, 301, 2, 1.5, 2, False, True, True),  # K2/V1.5, FP8 scales, variable groups
    (1, 8, 64, 77, 3, 4, 4, False, True, False),  # 3-bit keys (two planes)
    (2, 1, 128, 129, 1, 2, 2, True, False, False),  # natural order (RTN)
]


@pytest.mark.parametrize("case", SKVQ_CASES, ids=[f"H{c[0]}G{c[1]}D{c[2]}-n{c[3]}-k{c[4]}v{c[5]}-ng{c[6]}"
                                                   + ("-fix" if c[7] else "-var") + ("" if c[8] else "-nat")
                                                   + ("-fp8" if c[9] else "") for c in SKVQ_CASES])
def test_skvq_row_path_matches_reference(case):
    H, G, D, n, kb, vb, ng, fixed, perm, fp8 = case
    g = torch.Generator().manual_seed(n + D + ng)
    segs = [dense_seg(1, H, 4, D, [4], dtype=torch.float32, g=g),
            skvq_seg(1, H, n + 20, D, [n], k_bits=kb, v_bits=vb, ng=ng, fixed=fixed, perm=perm, fp8=fp8, g=g),
            dense_seg(1, H, 140, D, [129], dtype=torch.float32, g=g)]
    check(segs, H, G, D, g)


CHANNEL_CASES = [  # H, G, D, tokens (capacity, lens), bits, block (None: one), calibration, fp32 scales
    (3, 3, 64, (576, 576), 1, None, (0.0, 3.0), False),  # demo-llava's image, the app's default visual spec
    (2, 4, 128, (517, 500), 1, 64, (0.0, 3.0), True),  # blocks of 64 (a video), ragged end
    (1, 8, 64, (97, 97), 2, None, None, False),  # 2 bits, not calibrated
    (2, 2, 64, (40, 40), 1, None, (0.0, 0.1), False),  # a narrow range: the slope floor acts
]


@pytest.mark.parametrize("case", CHANNEL_CASES, ids=["llava-1bit-calib", "blocks64-fp32", "2bit-nocalib",
                                                     "slope-floor"])
def test_channel_row_path_matches_reference(case):
    """CalibQuant's segments (every logit held for the per-query calibration, values post-scaled per block) beside
    a window, against the reference's calibrate_logits."""
    H, G, D, (cap, n), bits, block, calib, fp32 = case
    g = torch.Generator().manual_seed(cap + bits)
    seg = channel_seg(1, H, cap, D, bits, [n], calib, block=block, g=g)
    segs = [_scales_fp32(seg) if fp32 else seg, dense_seg(1, H, 50, D, [37], dtype=torch.float32, g=g)]
    check(segs, H, G, D, g, scale=0.2)


def test_dense_only_and_empty_segments():
    """fp16 specs hold only dense segments; an empty one (a window just flushed) is skipped, and the state starts
    from the first segment that has tokens."""
    g = torch.Generator().manual_seed(5)
    segs = [dense_seg(1, 3, 16, 64, [0], dtype=torch.float32, g=g), kivi_seg(1, 3, 64, 64, [0], g=g),
            dense_seg(1, 3, 300, 64, [257], dtype=torch.float32, g=g),
            dense_seg(1, 3, 9, 64, [9], dtype=torch.float32, g=g)]
    check(segs, 3, 3, 64, g)


def test_nothing_stored():
    q = torch.randn(1, 6, 1, 64)
    out, lse = cpu.history_attention_cpu(q, [dense_seg(1, 2, 8, 64, [0], dtype=torch.float32)], 0.1)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())


def test_peaked_logits_underflow_cleanly():
    """Logits hundreds apart: every exp but the largest underflows (the polynomial clamps below -87)."""
    g = torch.Generator().manual_seed(9)
    segs = [kivi_seg(1, 2, 96, 64, [95], g=g), dense_seg(1, 2, 40, 64, [37], dtype=torch.float32, g=g)]
    check(segs, 2, 2, 64, g, scale=1.0, q_scale=30.0)


def _fallback_cases():
    g = torch.Generator().manual_seed(3)
    one = [dense_seg(1, 3, 40, 64, [33], dtype=torch.float32, g=g)]
    return {
        "two-rows": (torch.randn(2, 9, 1, 64), [dense_seg(2, 3, 40, 64, [33, 20], dtype=torch.float32, g=g)]),
        "two-new-tokens": (torch.randn(1, 9, 2, 64), one),
        "fp16-dense": (torch.randn(1, 9, 1, 64), [dense_seg(1, 3, 40, 64, [33], g=g)]),
        "bf16-query": (torch.randn(1, 9, 1, 64).bfloat16(), one),
        "calibrated-g12": (torch.randn(1, 12, 1, 64), [channel_seg(1, 1, 64, 64, 1, [60], (0.0, 3.0), g=g)]),
        "head-dim-8": (torch.randn(1, 4, 1, 8), [dense_seg(1, 2, 40, 8, [33], dtype=torch.float32, g=g)]),
        "too-long": (torch.randn(1, 9, 1, 64), [kivi_seg(1, 3, cpu_row.ROW_TOKENS, 64, [cpu_row.ROW_TOKENS], g=g),
                                                dense_seg(1, 3, 8, 64, [1], dtype=torch.float32, g=g)]),
    }


@pytest.mark.parametrize("name", list(_fallback_cases()))
def test_other_inputs_take_the_block_path(name):
    q, segs = _fallback_cases()[name]
    assert cpu_row.plan(q, segs) is None
    out, lse = cpu.history_attention_cpu(q, segs, 0.1)
    ref = decode_reference(q[:, :, 0], segs, 0.1)[0] if q.shape[2] == 1 else None
    if ref is not None:  # a bf16 query is attended in bf16
        assert rel(out[:, :, 0], ref) < (1e-2 if q.dtype == torch.bfloat16 else TOL)


@pytest.mark.parametrize("switch", ["MMKV_CPU_NATIVE", "MMKV_CPU_ROW"])
def test_switched_off_loops_take_the_block_path(switch, monkeypatch):
    segs = [dense_seg(1, 3, 40, 64, [33], dtype=torch.float32)]
    assert cpu_row.plan(torch.randn(1, 9, 1, 64), segs) is not None
    monkeypatch.setenv(switch, "0")
    assert cpu_row.plan(torch.randn(1, 9, 1, 64), segs) is None


def test_an_app_like_step_is_one_call_per_segment(monkeypatch):
    """The app's first answer: sinks + window dense and a KIVI-2 segment, 323 tokens. The row path answers, and
    the block path's fused attention is never called."""
    g = torch.Generator().manual_seed(11)
    segs = [dense_seg(1, 3, 323, 64, [133], dtype=torch.float32, g=g), kivi_seg(1, 3, 256, 64, [192], g=g)]
    monkeypatch.setattr(cpu, "_attend", lambda *a: pytest.fail("the block path ran"))
    q = torch.randn(1, 9, 64, generator=g)
    out, _ = cpu.decode_attention_cpu(q, segs, 1 / math.sqrt(64))
    assert rel(out, decode_reference(q, segs, 1 / math.sqrt(64))[0]) < TOL


def test_softmax_sum_to_float64_precision():
    """The polynomial exp, checked where it shows most: the log-sum-exp of 1000 logits spread over several
    units (every reduced argument of the polynomial's range is hit) against float64, to 3e-6 (a coefficient off by
    4% in the x^4 term moves it by ~2e-5)."""
    g = torch.Generator().manual_seed(17)
    seg = dense_seg(1, 1, 1100, 64, [1000], dtype=torch.float32, g=g)
    q = torch.randn(1, 2, 64, generator=g)
    assert cpu_row.plan(q.unsqueeze(2), [seg]) is not None
    out, lse = cpu.decode_attention_cpu(q, [seg], 0.3)
    logits = torch.einsum("hd,td->ht", q[0].double(), seg.k[0, 0, :1000].double()) * 0.3
    want = torch.logsumexp(logits, -1)
    assert float(logits.std()) > 1.0
    assert (lse[0].double() - want).abs().max().item() < 3e-6
    p = torch.softmax(logits, -1)
    assert rel(out[0], p @ seg.v[0, 0, :1000].double()) < 1e-6


def test_halves_cut_kivi_on_key_blocks():
    g = torch.Generator().manual_seed(2)
    dense, kv = dense_seg(1, 2, 150, 64, [133], dtype=torch.float32, g=g), kivi_seg(1, 2, 512, 64, [500], block=64, g=g)
    first, second = cpu_row._halves([(dense, 0, 133), (kv, 0, 500)])
    assert first[0] == (dense, 0, 133) and first[1][:2] == (kv, 0) and second[0][0] is kv
    cut = first[1][2]
    assert cut % 64 == 0 and second[0][1:] == (cut, 500) and abs(cut + 133 - 633 / 2) <= 64
    assert [] in cpu_row._halves([(dense, 0, 1)])  # nothing to share: one thread


@pytest.mark.parametrize("kb,vb,block", [(2, 2, 32), (1, 4, 128)])
def test_two_threads_match_reference(kb, vb, block, monkeypatch):
    """From ``SPLIT_TOKENS`` tokens a second thread reads the later half (here from 64 tokens): the merged
    state equals the reference, and the second thread did run."""
    monkeypatch.setattr(cpu_row, "SPLIT_TOKENS", 64)
    monkeypatch.setattr(cpu_row, "_threads", lambda: 2)
    seen = []
    real = cpu_row._run
    monkeypatch.setattr(cpu_row, "_run", lambda q, parts, *a: seen.append([p[1:] for p in parts]) or real(q, parts, *a))
    g = torch.Generator().manual_seed(kb * 10 + vb)
    segs = [dense_seg(1, 2, 4, 128, [4], dtype=torch.float32, g=g),
            kivi_seg(1, 2, 700, 128, [645], k_bits=kb, v_bits=vb, block=block, group=32, g=g),
            dense_seg(1, 2, 140, 128, [129], dtype=torch.float32, g=g)]
    check(segs, 2, 4, 128, g)
    assert len(seen) == 2  # the worker's half and the caller's, in either order
    first, second = seen if seen[0][0] == (0, 4) else seen[::-1]
    assert second[-1] == (0, 129) and first[1][1] == second[0][0] and first[1][1] % block == 0


def test_two_threads_skvq(monkeypatch):
    monkeypatch.setattr(cpu_row, "SPLIT_TOKENS", 64)
    monkeypatch.setattr(cpu_row, "_threads", lambda: 2)
    g = torch.Generator().manual_seed(31)
    segs = [skvq_seg(1, 2, 520, 64, [511], k_bits=2, v_bits=1.5, ng=2, fp8=True, g=g),
            dense_seg(1, 2, 140, 64, [129], dtype=torch.float32, g=g)]
    assert all(second for second in cpu_row._halves([(s, 0, int(s.lens[0])) for s in segs]))
    check(segs, 2, 3, 64, g)


def test_engine_decode_takes_the_row_path_and_matches_the_reference(smollm2, monkeypatch):
    """A real decode (SmolLM2, the app's default text spec, a prompt long enough to flush into KIVI codes) reaches
    the compiled loops from the attention function, and its greedy tokens equal the torch
    reference path's (``MMKV_CPU_REFERENCE=1``)."""
    from mmkv.engine import Engine

    eng = Engine(smollm2)
    prompt = "The history of the city goes back many centuries, with records of markets and fairs. " * 12
    spec = "text=kivi:bits=2 window=32 sinks=4"
    calls = []
    real = cpu_row.attend
    monkeypatch.setattr(cpu_row, "attend", lambda q, todo, s: calls.append(len(todo)) or real(q, todo, s))
    out = eng.generate(prompt, spec=spec, max_new_tokens=12)
    assert calls and max(calls) == 2  # the window's dense rows and the KIVI codes, each one call
    monkeypatch.setenv("MMKV_CPU_REFERENCE", "1")
    ref = eng.generate(prompt, spec=spec, max_new_tokens=12)
    assert torch.equal(out.tokens, ref.tokens)


def test_mixed_layers_split_between_the_paths(monkeypatch):
    """A layer with a segment this path does not read (here fp16 rows) beside the text cache: the row path reads
    the dense and KIVI segments in one call each, the block path only the other one, and the two partial results
    merge to the reference's."""
    g = torch.Generator().manual_seed(41)
    visual = dense_seg(1, 3, 600, 64, [576], dtype=torch.float16, g=g)
    segs = [dense_seg(1, 3, 150, 64, [133], dtype=torch.float32, g=g), visual, kivi_seg(1, 3, 256, 64, [192], g=g)]
    rows, blocks = [], []
    real_attend, real_blocks = cpu_row.attend, cpu._history_blocks
    monkeypatch.setattr(cpu_row, "attend", lambda q, todo, s: rows.append([t[0] for t in todo]) or real_attend(q, todo, s))
    monkeypatch.setattr(cpu, "_history_blocks", lambda q, ss, s: blocks.append(list(ss)) or real_blocks(q, ss, s))
    q = torch.randn(1, 9, 64, generator=g)
    out, lse = cpu.decode_attention_cpu(q, segs, 0.1)
    ref, ref_lse = decode_reference(q, segs, 0.1)
    assert rel(out, ref) < TOL and lse_close(lse, ref_lse)
    assert rows == [[segs[0], segs[2]]] and len(blocks) == 1 and blocks[0][0] is visual and len(blocks[0]) == 1
