"""One L2 prefetch request for several iterations in the Gluon text and SKVQ kernels (``MMKV_TEXT_PREFETCH_SPAN``,
``text_rules.text_prefetch_span``, ``gluon/text_prefetch.py``; ``MMKV_SKVQ_PREFETCH_SPAN``,
``skvq_rules.skvq_prefetch_span``, ``gluon/skvq_prefetch.py``).

On CPU (CI): compiled for sm_90, the six bulk prefetches and their address arithmetic sit behind one forward branch
of the loop body, so an iteration that requests nothing skips them: at a span of 4 the loop issues at least 8% (text)
or 4% (SKVQ, whose iterations are longer) fewer instructions an iteration on average than at 1, with the same MMAs.
On the GPU (``-m gpu``): spans 1, 3 and 8 give the same bits (a prefetch moves bytes into L2 and nothing else) on
ragged rows whose splits take a few or many iterations, and match the torch reference.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")
from gluon_reports import compiled_reports, loop_count  # noqa: E402
from reference_match import assert_matches_reference  # noqa: E402

CUDA = torch.cuda.is_available()

# (head_dim, G, K bits, V bits, post-scaled, prefetch distance)
CASES = [(128, 4, 2, 1, True, 1), (64, 3, 2, 2, True, 1)]  # XQuant's K2/V1 layers at B16; SmolLM2's heads


# SKVQ: (warps, V bits, FP8 scales): the batch-1 variant the plan prefetches in
SKVQ_CASES = [(2, 1.5, True)]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    calls = [f"text_report(tmp, G={g}, D={d}, bits={k}, vbits={v}, post={p}, pfd={f}, pfn={n})"
             for d, g, k, v, p, f in CASES for n in (1, 4)]
    calls += [f"skvq_report(tmp, W={w}, vbits={v}, fp8={f}, pfd=1, pfn={n})" for w, v, f in SKVQ_CASES for n in (1, 4)]
    out = compiled_reports(tmp_path_factory.mktemp("span_sass"), f"[{', '.join(calls)}]", timeout=900)
    keys = [(c, n) for c in CASES + SKVQ_CASES for n in (1, 4)]
    return dict(zip(keys, out, strict=True))


@pytest.mark.parametrize("case", CASES, ids=[f"D{c[0]}G{c[1]}-k{c[2]}v{c[3]}-{'post' if c[4] else 'pre'}-pfd{c[5]}"
                                             for c in CASES])
def test_prefetch_request_is_skipped_between_spans(reports, case):
    one, four = reports[case, 1], reports[case, 4]
    for r in (one, four):
        assert r["UBLKPF"] == 6 and r["local"] == 0, r  # key codes, value codes, 4 scale/zero ranges; no spill
        assert r["prefetch_block"] >= 60, r  # the request's addresses and sizes, skipped as a whole
    assert four["HMMA"] == one["HMMA"] and four["reg"] <= one["reg"] + 8, (one, four)
    per_iteration = loop_count(four) - four["prefetch_block"] * 3 / 4  # one iteration in four takes the block
    assert per_iteration < 0.92 * loop_count(one), (per_iteration, loop_count(one))


@pytest.mark.parametrize("case", SKVQ_CASES, ids=[f"W{w}-v{v}-{'fp8' if f else 'fp16'}" for w, v, f in SKVQ_CASES])
def test_skvq_prefetch_request_is_skipped_between_spans(reports, case):
    one, four = reports[case, 1], reports[case, 4]
    assert one["UBLKPF"] == four["UBLKPF"] == 6 and one["local"] == four["local"] == 0, (one, four)
    assert four["prefetch_block"] >= 50, four  # span 1 requests every iteration: no branch around it
    assert four["HMMA"] == one["HMMA"], (one, four)
    per_iteration = loop_count(four) - four["prefetch_block"] * 3 / 4
    assert per_iteration < 0.96 * loop_count(one), (per_iteration, loop_count(one))


def test_prefetch_span_rules(monkeypatch):
    from kernels.decode.skvq_rules import skvq_prefetch_span
    from kernels.decode.text_rules import text_prefetch_span
    assert text_prefetch_span(8) == text_prefetch_span(31) == 1 and skvq_prefetch_span() == 1  # batch 1: measured slower
    assert text_prefetch_span(32) == text_prefetch_span(480) == 4  # B16 / B60 x 8 KV heads
    monkeypatch.setenv("MMKV_TEXT_PREFETCH_SPAN", "2")
    monkeypatch.setenv("MMKV_SKVQ_PREFETCH_SPAN", "3")
    assert text_prefetch_span(1) == 2 and text_prefetch_span(128) == 2 and skvq_prefetch_span() == 3
    for bad in ("0", "9", "x"):
        monkeypatch.setenv("MMKV_TEXT_PREFETCH_SPAN", bad)
        monkeypatch.setenv("MMKV_SKVQ_PREFETCH_SPAN", bad)
        with pytest.raises(ValueError, match="MMKV_TEXT_PREFETCH_SPAN"):
            text_prefetch_span(1)
        with pytest.raises(ValueError, match="MMKV_SKVQ_PREFETCH_SPAN"):
            skvq_prefetch_span()


def test_plan_carries_the_span_with_a_prefetch_only(monkeypatch):
    """The plan's item takes the span where the kernel prefetches (sm_90 and the Gluon kernel faked on CPU), and 1
    without a prefetch, so the launch key and programs-per-SM key stay those of the variant before."""
    from kernels import testing
    from kernels.decode import plan
    monkeypatch.setattr(plan, "_capability", lambda dev: (9, 0))
    monkeypatch.setattr(plan, "_text_gluon_ok", lambda *a: True)
    g = torch.Generator().manual_seed(3)
    small = testing.kivi_seg(16, 8, 64, 128, None, 2, 2, 32, 32, g=g)
    # the plan reads shapes only: every token-axis field of 40000 tokens as a broadcast view (no 40k-token quantize)
    seg = dataclasses.replace(small, lens=testing.lens_tensor(40000, 16), **{
        n: getattr(small, n)[:, :, :1].expand(16, 8, 40000 // p, *getattr(small, n).shape[3:])
        for n, p in small.token_fields()})
    q = torch.randn(16, 32, 128, generator=g, dtype=torch.float16)

    def item():
        return plan.plan_items(q, [seg], 16, 8, 4, 128, 132, None, 2, True, None, None, 64)[0][0]

    assert (item()["pfd"], item()["pfn"]) == (1, 4)  # B16 x 8 heads x 40k tokens: the plan prefetches, span 4
    monkeypatch.setenv("MMKV_TEXT_PREFETCH_SPAN", "2")
    assert (item()["pfd"], item()["pfn"]) == (1, 2)
    monkeypatch.setenv("MMKV_TEXT_PREFETCH", "0")
    assert (item()["pfd"], item()["pfn"]) == (0, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("kbits,vbits,D,order", [(2, 1, 128, "tiles"), (2, 2, 64, "tiles"), (1, 1, 128, "tiles"),
                                                 (2, 2, 128, "natural")])
def test_gpu_prefetch_spans_give_the_same_bits(kbits, vbits, D, order, monkeypatch):
    import kernels
    from kernels import testing
    from kernels.decode.plan import _GLUON_BROKEN, plan_items
    from kernels.reference import decode_reference

    per_it = 4 * 8 * (8 // kbits)
    lens = [13 * per_it + 5, 7 * per_it, 3 * per_it - 1, 1, 0]
    g = torch.Generator().manual_seed(kbits * 10 + vbits + D)
    seg = testing.kivi_seg(5, 2, 13 * per_it + 40, D, lens, kbits, vbits, 32, 32, g=g, device="cuda", order=order)
    q = torch.randn(5, 8, D, generator=g).to("cuda", torch.float16)
    monkeypatch.setenv("MMKV_TEXT_PREFETCH", "1")
    monkeypatch.setenv("MMKV_TEXT_WARPS", "4")
    outs = {}
    for tps in ("3", "20"):  # splits of 3 iterations (one request covers past their end) and of 20
        monkeypatch.setenv("MMKV_TEXT_TPS", tps)
        for span in ("1", "3", "8"):
            monkeypatch.setenv("MMKV_TEXT_PREFETCH_SPAN", span)
            it = plan_items(q, [seg], 5, 2, 4, D, 132, None, 2, True, None, None, 64)[0][0]
            assert it["tgl"] and it["pfd"] == 1 and it["pfn"] == int(span), it
            outs[tps, span] = kernels.decode_attention(q, [seg], out=torch.full_like(q, float("nan")),
                                                       return_lse=True)
        for span in ("3", "8"):
            assert torch.equal(outs[tps, span][0], outs[tps, "1"][0]), (tps, span)
            assert torch.equal(outs[tps, span][1], outs[tps, "1"][1]), (tps, span)
    assert not _GLUON_BROKEN, _GLUON_BROKEN
    ref, _ = decode_reference(q, [seg])
    got = outs["20", "8"][0][:4].float()
    assert not torch.isnan(got).any()
    assert (got - ref[:4].float()).norm() / ref[:4].float().norm() < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("vbits,fp8,warps", [(1.5, True, "2"), (2, False, "4")])
def test_gpu_skvq_prefetch_spans_give_the_same_bits(vbits, fp8, warps, monkeypatch):
    import kernels
    from kernels import testing
    from kernels.decode.gluon.skvq_ok import launch_key

    lens = [16391, 9000, 1, 0]
    g = torch.Generator().manual_seed(11)
    seg = testing.skvq_seg(4, 2, 16400, 128, lens, 2, float(vbits), 2, fp8=fp8, g=g, device="cuda")
    q = torch.randn(4, 8, 128, generator=g).to("cuda", torch.float16)
    monkeypatch.setenv("MMKV_SKVQ_PREFETCH", "1")
    monkeypatch.setenv("MMKV_SKVQ_WARPS", warps)
    outs = {}
    for tps in ("3", "40"):
        monkeypatch.setenv("MMKV_SKVQ_TPS", tps)
        for span in ("1", "3", "8"):
            monkeypatch.setenv("MMKV_SKVQ_PREFETCH_SPAN", span)
            assert launch_key(seg, 4, 128)[-2:] == (1, int(span))
            outs[tps, span] = kernels.decode_attention(q, [seg], out=torch.full_like(q, float("nan")),
                                                       return_lse=True)
        for span in ("3", "8"):
            assert torch.equal(outs[tps, span][0], outs[tps, "1"][0]), (tps, span)
            assert torch.equal(outs[tps, span][1], outs[tps, "1"][1]), (tps, span)
    assert_matches_reference(q, [seg], lens)
