"""The fp16 window's splits (``window_rules.window_tps``, ``MMKV_WINDOW_TPS``, issue 26): a dense segment of up to
``WINDOW_TOKENS`` tokens beside a segment of 8x its tokens takes at most one tile a split, where the byte rule (sized
by the whole layer) gave it one split of every tile per (row, KV head).

The plan is device-free: ``plan_items`` runs on shapes (zero-stride views stand in for a batch-16 body of 16k tokens).
The splits it plans run here under Triton's interpreter on CPU (compiled on CUDA) against the torch reference: a
window of odd, ragged lengths (one row empty) beside a dense body of 8x its tokens and a KIVI segment, GQA groups
1-8, head_dim 64 and 128, outputs pre-filled with NaN; relative L2 error < 2e-3 (fp16 operands, fp32 accumulation,
as ``test_kernels.py``).

The window beside the text kernel (``window_rules.window_overlap``, ``MMKV_WINDOW_OVERLAP``): the rule on CPU; on an
sm_90 GPU the outputs with the text or SKVQ kernel launched beside the window's equal, bit for bit, those with the
two launched one after the other."""

from __future__ import annotations

import torch
from triton_switch import CUDA, fixtures, switch_on

IN_PROCESS, _WE_SET_INTERPRET = switch_on()  # before triton and the kernels are imported

import pytest  # noqa: E402

import kernels  # noqa: E402
from kernels import testing  # noqa: E402
from kernels.decode import plan as plan_mod  # noqa: E402
from kernels.decode import window_rules  # noqa: E402
from kernels.layouts import DenseSeg  # noqa: E402
from kernels.reference import decode_reference  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
_in_process_only, _restore_env, test_interpreter_subprocess = fixtures(__file__, IN_PROCESS, _WE_SET_INTERPRET)


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("MMKV_WINDOW_TPS", raising=False)
    monkeypatch.delenv("MMKV_WINDOW_OVERLAP", raising=False)
    monkeypatch.delenv("MMKV_OVERLAP", raising=False)


def test_window_tps_rule(monkeypatch):
    assert window_rules.window_tps(256, 8, 32768) == 1  # a window beside a long body: capped
    assert window_rules.window_tps(1024, 32, 8192) == 1
    assert window_rules.window_tps(1025, 8, 32768) == 8  # a body: the byte rule's
    assert window_rules.window_tps(256, 8, 2047) == 8  # no segment 8x as long: a short cache keeps the byte rule
    assert window_rules.window_tps(256, 8, 256) == 8
    monkeypatch.setenv("MMKV_WINDOW_TPS", "0")
    assert window_rules.window_tps(256, 8, 32768) == 8
    monkeypatch.setenv("MMKV_WINDOW_TPS", "2")
    assert window_rules.window_tps(256, 8, 32768) == 2
    assert window_rules.window_tps(256, 1, 32768) == 1  # never raised
    for bad in ("x", "-1", ""):
        monkeypatch.setenv("MMKV_WINDOW_TPS", bad)
        with pytest.raises(ValueError, match="MMKV_WINDOW_TPS"):
            window_rules.window_tps(256, 8, 32768)


def _shape_only(B, H, T, D):
    """A dense segment of B x H x T x D fp16 that holds one element (a zero-stride view): plans read shapes only."""
    one = torch.zeros(1, 1, 1, D, dtype=torch.float16)
    return DenseSeg(one.expand(B, H, T, D), one.expand(B, H, T, D), torch.full((B,), T, dtype=torch.int32))


@pytest.mark.parametrize("cap,want", [(None, 8), ("0", 1), ("2", 4)])
def test_window_beside_a_long_body_at_batch_16(cap, want, monkeypatch):
    """InternVL heads B16, a 256-token window (8 tiles of 32) beside 16384 dense tokens on 132 SMs: the byte rule
    gives the window all 8 tiles in one split (``MMKV_WINDOW_TPS=0``), the cap one tile (8 splits), 2 tiles 4; the
    body's splits do not move and the split offsets stay consecutive."""
    if cap is not None:
        monkeypatch.setenv("MMKV_WINDOW_TPS", cap)
    B, H, G, D = 16, 8, 4, 128
    q = torch.zeros(B, H * G, D, dtype=torch.float16)
    segs = [_shape_only(B, H, 256, D), _shape_only(B, H, 16384, D)]
    items, S, fin = plan_mod.plan_items(q, segs, B, H, G, D, 132, None, 2, True, None, None, 64)
    win, body = items
    assert (win["tiles"], win["nsplit"]) == (8, want)
    monkeypatch.setenv("MMKV_WINDOW_TPS", "0")
    ref_body = plan_mod.plan_items(q, segs, B, H, G, D, 132, None, 2, True, None, None, 64)[0][1]
    assert (body["tps"], body["nsplit"]) == (ref_body["tps"], ref_body["nsplit"])
    assert (win["s_off"], body["s_off"], S) == (0, want, want + body["nsplit"]) and fin is None


def test_short_cache_keeps_the_byte_rule():
    """A short fp16 cache at batch 64 (a 256-token window beside 1024 tokens, no segment 8x the window's) keeps the
    byte rule's splits: one-tile splits of every row are unmeasured there."""
    B, H, G, D = 64, 8, 4, 128
    q = torch.zeros(B, H * G, D, dtype=torch.float16)
    win = plan_mod.plan_items(q, [_shape_only(B, H, 256, D), _shape_only(B, H, 1024, D)], B, H, G, D, 132, None, 2,
                              True, None, None, 64)[0][0]
    assert win["tps"] == win["tiles"] == 8 and win["nsplit"] == 1


@pytest.mark.parametrize("G,D", [(1, 64), (4, 128), (8, 64)])
def test_capped_window_splits_match_the_reference(G, D, monkeypatch):
    """A window whose byte rule is one split (``programs_per_sm`` tiny) split by the cap into one-tile splits, beside
    a dense body of 8x its tokens and a KIVI segment, against the reference; the same with the cap off."""
    g = torch.Generator().manual_seed(100 + G + D)
    B, H, Tw = 3, 2, 147
    lens_w = [147, 0, 61]
    win = testing.dense_seg(B, H, Tw, D, lens_w, g=g, device=DEV)
    body = testing.dense_seg(B, H, 8 * Tw, D, [8 * Tw, 700, 1], g=g, device=DEV)
    kivi = testing.kivi_seg(B, H, 96, D, [96, 33, 71], g=g, device=DEV)
    q = testing.rand_q(B, H * G, D, g=g, device=DEV)
    want = decode_reference(q, [win, body, kivi])[0]
    for cap, splits in (("1", -(-Tw // (64 if D <= 64 else 32))), ("0", 1)):
        monkeypatch.setenv("MMKV_WINDOW_TPS", cap)
        items = plan_mod.plan_items(q, [win, body, kivi], B, H, G, D, 132, None, 2, True, 0.01, None, 64)[0]
        assert items[0]["nsplit"] == splits > 0
        out = torch.full_like(q, float("nan"))
        kernels.decode_attention(q, [win, body, kivi], out=out, programs_per_sm=0.01)
        err = (out.float() - want).norm() / want.norm()
        assert torch.isfinite(out).all() and err < 2e-3, (cap, float(err))


def test_window_overlap_rule(monkeypatch):
    """``window_overlap``: only a window (a dense segment of up to ``WINDOW_TOKENS``) followed by the Gluon text
    kernel or a layout that honours ``it["dep"]`` (SKVQ's, not AlignedKV's), never after a clustered (``fin``)
    kernel, never another order; the switch's values, and a bad one refused by name."""
    from kernels.decode.registry import KIND_CHANNEL, KIND_DENSE, KIND_KIVI, KIND_PLUGIN
    from kernels.layouts import AlignedSeg, SkvqSeg

    win = dict(kind=KIND_DENSE, T=window_rules.WINDOW_TOKENS)
    text = dict(kind=KIND_KIVI, tgl=True)
    skvq = dict(kind=KIND_PLUGIN, seg=SkvqSeg.__new__(SkvqSeg))
    aligned = dict(kind=KIND_PLUGIN, seg=AlignedSeg.__new__(AlignedSeg))
    assert window_rules.window_overlap([win, text]) and window_rules.window_overlap([win, skvq])
    assert not window_rules.window_overlap([win, aligned])
    assert not window_rules.window_overlap([win, dict(kind=KIND_KIVI, tgl=False)])  # the Triton kernel: no wait
    assert not window_rules.window_overlap([win, dict(text, fin=True)])
    assert not window_rules.window_overlap([text, win]) and not window_rules.window_overlap([text])
    assert not window_rules.window_overlap([win, dict(kind=KIND_CHANNEL), text][1:])
    assert not window_rules.window_overlap([dict(win, T=window_rules.WINDOW_TOKENS + 1), text])  # a dense body
    monkeypatch.setenv("MMKV_WINDOW_OVERLAP", "0")
    assert not window_rules.window_overlap([win, text])
    for bad in ("2", "", "on"):
        monkeypatch.setenv("MMKV_WINDOW_OVERLAP", bad)
        with pytest.raises(ValueError, match="MMKV_WINDOW_OVERLAP"):
            window_rules.window_overlap([win, text])


def test_channel_overlap_rule(monkeypatch):
    """``channel_overlap``: the clustered fused channel kernel (the plan's ``fin``, last) beside a dense or KIVI
    segment kernel before it, never beside a plug-in's or an unclustered channel kernel; ``MMKV_OVERLAP=0`` never;
    the window rule and this one never hold together."""
    from kernels.decode.registry import KIND_CHANNEL, KIND_DENSE, KIND_KIVI, KIND_PLUGIN

    fused = dict(kind=KIND_CHANNEL, fin=True)
    win = dict(kind=KIND_DENSE, T=256)
    for before in (win, dict(kind=KIND_KIVI, tgl=True), dict(kind=KIND_KIVI, tgl=False)):
        assert window_rules.channel_overlap([before, fused])
        assert not window_rules.window_overlap([before, fused])
    assert not window_rules.channel_overlap([dict(kind=KIND_PLUGIN), fused])
    assert not window_rules.channel_overlap([win, dict(kind=KIND_CHANNEL)]) and not window_rules.channel_overlap([fused])
    assert not window_rules.channel_overlap([win, dict(kind=KIND_KIVI, tgl=True)])
    monkeypatch.setenv("MMKV_OVERLAP", "0")
    assert not window_rules.channel_overlap([win, fused])


def test_no_overlap_off_sm90():
    """Off sm_90 or without compiled kernels (the CPU under the interpreter) the plan never marks the window or the
    text item."""
    if CUDA and plan_mod._pdl_ok(torch.device("cuda")):
        pytest.skip("sm_90: the marks are test_gpu_window_overlap_is_bit_equal's")
    g = torch.Generator().manual_seed(5)
    win = testing.dense_seg(2, 2, 64, 128, [64, 3], g=g, device=DEV)
    kivi = testing.kivi_seg(2, 2, 512, 128, [512, 77], g=g, device=DEV)
    q = testing.rand_q(2, 8, 128, g=g, device=DEV)
    items = plan_mod.plan_items(q, [win, kivi], 2, 2, 4, 128, 132, None, 2, True, None, None, 64)[0]
    assert not any(it.get("trig") or it.get("dep") for it in items)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs compiled CUDA kernels")
@pytest.mark.parametrize("layout", ["kivi2", "k2v1", "kivi1", "skvq"])
@pytest.mark.parametrize("B,T,Tw", [(1, 8192 + 37, 160), (16, 8192 + 37, 160), (1, 96, 1024), (16, 96, 1024)])
def test_gpu_window_overlap_is_bit_equal(layout, B, T, Tw, monkeypatch):
    """On sm_90 the plan launches the text (or SKVQ) kernel beside the window's (``trig``/``dep``, with
    ``launch_pdl``); the output and log-sum-exp are bit-equal to one after the other (``MMKV_WINDOW_OVERLAP=0``),
    with NaN-prefilled outputs, ragged lengths (one row with an empty window) and the Gluon kernel having run; and
    close to the reference. The last two shapes are the stress case: a full 1024-token window (in one long split per
    (row, KV head): ``MMKV_WINDOW_TPS=0``) beside a 96-token text segment whose kernel lets the merge launch start
    at once (``MMKV_TEXT_PDL=2``, ``MMKV_SKVQ_PDL=2``), the order in which a text kernel that did not wait for the
    window would let the merge read unfinished partials. On an H100 it did not show: with the wait removed from both
    kernels these tests still passed (five runs, two of them with the batch-1 stress case; 2026-11-27), as the GPU
    appears to signal the kernels' completions in stream order; ``test_dependent_kernels_wait_before_writing``
    (SASS) is what guards the wait CUDA's rules ask for."""
    from switch_outputs import bit_equal_by_switch

    from kernels.decode.gluon.text import _TEXT_LAUNCHER
    from kernels.decode.plan import _GLUON_BROKEN, _pdl_ok

    if not _pdl_ok(torch.device("cuda")):
        pytest.skip("needs sm_90 and programmatic dependent launch")
    if T < Tw:
        for name, value in (("MMKV_WINDOW_TPS", "0"), ("MMKV_TEXT_PDL", "2"), ("MMKV_SKVQ_PDL", "2")):
            monkeypatch.setenv(name, value)
    g = torch.Generator().manual_seed(B + T)
    H, G, D = 8, 4, 128
    lens = [T - 5 * r for r in range(B)]
    wl = [Tw - (r % 7) * 23 if r != 1 else 0 for r in range(B)]
    win = testing.dense_seg(B, H, Tw, D, wl, g=g, device="cuda")
    if layout == "skvq":
        body = testing.skvq_seg(B, H, T, D, lens, 2, 1.5, 2, g=g, device="cuda")
    else:
        kb, vb = {"kivi2": (2, 2), "k2v1": (2, 1), "kivi1": (1, 1)}[layout]
        body = testing.kivi_seg(B, H, T, D, lens, kb, vb, 32, 32, g=g, device="cuda", order="tiles")
    q = testing.rand_q(B, H * G, D, g=g, device="cuda")
    # a first call compiles the variant and records how many of its programs an SM holds, which the plan's whole
    # waves read from then on: without it the two calls below would split the text segment differently
    kernels.decode_attention(q, [win, body])
    items = plan_mod.plan_items(q, [win, body], B, H, G, D, 132, None, 2, True, None, None, 64)[0]
    assert items[0].get("trig") and items[1].get("dep")
    outs = bit_equal_by_switch(q, [win, body], monkeypatch, "MMKV_WINDOW_OVERLAP")
    assert not _GLUON_BROKEN, _GLUON_BROKEN
    if layout != "skvq":  # the text kernel's launch took the programmatic dependent launch
        assert any(("launch_pdl", True) in key[1] for key in _TEXT_LAUNCHER[0].cache), list(_TEXT_LAUNCHER[0].cache)
    want = decode_reference(q, [win, body])[0]
    err = (outs[None, "1"][0].float() - want).norm() / want.norm()
    assert err < 2e-3, float(err)


WAIT_CASES = [  # text_report / skvq_report arguments of the variants decode_attention launches beside a window
    "text_report(tmp, G=4, D=128, bits=2, vbits=2, post=True, pfd=1, dep={})",
    "text_report(tmp, G=4, D=128, bits=1, vbits=1, post=True, qsm=True, maxnreg=168, dep={})",
    "text_report(tmp, G=3, D=64, bits=2, vbits=1, post=True, dep={})",
    "skvq_report(tmp, G=4, D=128, kbits=2, vbits=1.5, ng=2, tlane=True, maxnreg=128, dep={})",
    "skvq_report(tmp, G=3, D=64, kbits=2, vbits=2, ng=2, dep={})",
]


@pytest.fixture(scope="module")
def wait_reports(tmp_path_factory):
    from gluon_reports import compiled_reports

    calls = [c.format(dep) for c in WAIT_CASES for dep in (True, False)]
    return compiled_reports(tmp_path_factory.mktemp("wait_sass"), f"[{', '.join(calls)}]", timeout=900)


@pytest.mark.parametrize("i", range(len(WAIT_CASES)), ids=["text-k2v2", "text-k1v1", "text-d64", "skvq-tern", "skvq-d64"])
def test_dependent_kernels_wait_before_writing(wait_reports, i):
    """Launched beside the window's kernel (``dep``), the text and SKVQ kernels wait for it (``griddepcontrol.wait``,
    SASS ``ACQBULK``) once, past their loops and before their first store of the partials, so that their end implies
    the window's; not launched so, they never wait. sm_90, compiled on CPU."""
    with_dep, without = wait_reports[2 * i], wait_reports[2 * i + 1]
    assert with_dep["wait"] == "before stores", with_dep["wait"]
    assert without["wait"] is None, without["wait"]
    assert with_dep["loops"] == without["loops"] == 2  # the unmasked copy and the masked loop, either way
