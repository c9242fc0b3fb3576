"""eval/studies/calibquant_{fidelity,agreement}: the --clip values name the intended quantizer, and the agreement
study's span really goes through the CalibQuant segment (on a tiny random model: plumbing, not quality)."""

from __future__ import annotations

import pytest
import torch

import mmkv
from eval.studies import calibquant_agreement as agree
from eval.studies.calibquant_fidelity import clip_params
from mmkv.spec import CacheSpec


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only add synchronization on a busy shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_clip_values_name_the_intended_clip_factors():
    for bits, clip, want in ((1, "off", (1.0, 1.0)), (1, "authors", (0.5, 0.3)), (2, "authors", (1.0, 1.0)),
                             (2, "0.5/0.3", (0.5, 0.3)), (1, "0.7", (0.7, 0.7))):
        method = CacheSpec.parse(agree.spec_of(bits, clip, True)).visual
        assert method.clips == want and method.bits == bits and method.calibrate
    assert clip_params("off") == {"clip": "off"} and CacheSpec.parse(agree.spec_of(1, "off", False)).visual.calib is None


def test_agreement_reads_the_span_from_the_calibquant_segment():
    lm = mmkv.load_model("random:smollm2-135m", tiny=True, dtype=torch.float32)
    ids = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(0))
    visual = torch.zeros(ids.shape, dtype=torch.bool)
    visual[:, 4:36] = True
    ref = agree.greedy(lm.model, lm.adapter, ids, visual, "fp16 " + agree.TAIL, 4)
    # fed its own tokens back, the reference reproduces itself: forcing changes nothing but the inputs
    assert torch.equal(agree.greedy(lm.model, lm.adapter, ids, visual, "fp16 " + agree.TAIL, 4, forced=ref), ref)
    # 8 bits keeps the logits within rounding of fp16; 1 bit with the authors' clip moves them (the span is read)
    logits = {}
    for spec in (agree.spec_of(8, "off", False), agree.spec_of(1, "authors", False), "fp16 " + agree.TAIL):
        cache = mmkv.MMKVCache.for_model(spec, lm.adapter)
        cache.set_inputs(visual_mask=visual)
        with torch.inference_mode():
            lm.model(input_ids=ids, **mmkv.cache.cache_kwargs(lm.model, cache), use_cache=True)
            cache.finalize()
            assert sum(int(s.lens.sum()) for s in cache.layers[0].segments()) == 80
            out = lm.model(input_ids=ids[:, -1:], position_ids=torch.full((2, 1), 40),
                           **mmkv.cache.cache_kwargs(lm.model, cache), use_cache=True)
        logits[spec.split()[0]] = out.logits[:, -1]
    ref_logits = logits["fp16"]
    err = {k: ((v - ref_logits).norm() / ref_logits.norm()).item() for k, v in logits.items() if k != "fp16"}
    eight = err["visual=calibquant:bits=8,calibrate=false,clip=off"]
    assert eight < 1e-2
    assert err["visual=calibquant:bits=1,calibrate=false,clip=authors"] > 10 * eight


def test_one_side_keeps_only_the_named_side_at_one_bit():
    from eval.studies.calibquant_sides import main as sides_main
    from eval.studies.calibquant_sides import one_side
    from kernels.reference import dequantize_segment
    from mmkv.methods import CalibQuant

    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 3, 37, 16, generator=g) * 2, torch.randn(2, 3, 37, 16, generator=g)
    lens = torch.tensor([37, 29])
    method = CalibQuant(bits=1)
    kd1, vd1 = dequantize_segment(method.quantize(k, v, lens))  # the real 1-bit sides
    for side, want_k, want_v, calib in (("none", k, v, None), ("k", kd1, v, method.calib),
                                        ("v", k, vd1, None), ("kv", kd1, vd1, method.calib)):
        seg = one_side(method, k, v, lens, side)
        kd, vd = dequantize_segment(seg)
        assert seg.bits == 8 and seg.calib == calib, side
        for row, n in enumerate(lens.tolist()):
            for got, want in ((kd, want_k), (vd, want_v)):
                ref = want[row, :, :n].float()
                step = (ref.amax(1) - ref.amin(1)).max() / 255  # 8 bits: within about half a step (fp16 scale)
                assert (got[row, :, :n] - ref).abs().max() <= 0.6 * step + 1e-3, (side, row)
    with pytest.raises(ValueError, match="side"):
        one_side(method, k, v, lens, "q")
    for argv in (["--model", "demo-llava"], ["--side", "x"]):  # --side is required and one of SIDES
        with pytest.raises(SystemExit) as e:
            sides_main(argv)
        assert e.value.code == 2
    assert CalibQuant.quantize.__module__ == "mmkv.methods.calibquant"  # nothing left patched
