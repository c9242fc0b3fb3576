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
