"""eval/studies/skvq: the teacher-forced emulation of SKVQ's quantized/fp split equals token-by-token scoring through the
real cache (Engine.score, chunk=1) on a tiny random model; the CLI runs end to end in smoke mode."""

from __future__ import annotations

import pytest
import torch

import mmkv
from eval.studies import skvq as skvq_study
from mmkv.calibrate.skvq import calibrate, synthetic_qkv
from mmkv.methods import artifacts


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only add synchronization (badly so on a busy shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    lm = mmkv.load_model("random:smollm2-135m", tiny=True, dtype=torch.float32)
    ad = lm.adapter
    qs, ks, vs = synthetic_qkv(ad.num_layers, ad.num_q_heads, ad.num_kv_heads, ad.head_dim, 256, seed=3)
    t = calibrate(qs, ks, vs, [32], [2], [1.5, 2.0], seq_len=128, q_stride=8, grid=(1.0, 0.8, 0.6),
                  log=lambda m: None)
    folder = tmp_path_factory.mktemp("tiny-skvq")
    artifacts.Artifact("skvq", ad.name, artifacts.shape_of(ad), t, {"data": "synthetic"}).save(folder)
    return lm, folder


def test_quantized_counts_follow_the_cache_flush_rule():
    assert skvq_study.quantized_counts(6, 0, 0, 1) == [0, 2, 3, 4, 5, 6]  # step 0 attends before routing
    c = skvq_study.quantized_counts(200, 16, 3, 8)
    assert c[18] == 0 and c[3 + 16 + 8 - 1] == 8 and max(c) == 200 - 3 - 16 - (200 - 3 - 16) % 8
    assert all(0 <= n - c[i] - min(3, n) - 16 < 8 for i, n in enumerate(range(1, 201)) if i > 0 and c[i])


@pytest.mark.parametrize("spec", [
    "text=skvq:group=32,v_bits=1.5,reorder=off,clip=off,block=1 window=0 sinks=0",
    "text=skvq:group=32,v_bits=1.5,fp8=true,block=8,artifact={art} window=16 sinks=3",
    "text=skvq:group=32,k_bits=2,v_bits=2,groups=fixed,block=1,artifact={art} window=9 sinks=5",
])
def test_emulated_nll_equals_token_by_token_scoring(tiny, spec):
    lm, art = tiny
    spec = spec.format(art=art)
    ids = torch.randint(100, 5000, (2, 41), generator=torch.Generator().manual_seed(1))
    ref = mmkv.Engine(lm).score(ids, spec=spec, chunk=1)
    sim = skvq_study.score(lm.model, lm.adapter, ids, spec)
    assert sim["tokens"] == ref["tokens"]
    assert abs(sim["nll"] - ref["nll"]) / ref["nll"] < 1e-5
    assert sim["text_bits"] == pytest.approx(ref["stats"]["effective_bits"]["text"])


def test_study_cli_smoke(tiny, tmp_path, monkeypatch):
    lm, art = tiny
    monkeypatch.setattr(mmkv, "load_model", lambda name, device="cpu", **kw: lm)
    out = tmp_path / "ladder.json"
    assert skvq_study.main(["--model", "random:smollm2-135m", "--artifact", str(art), "--settings", "k2v1.5-g32",
                            "--windows", "1", "--context", "48", "--window", "8", "--sinks", "2",
                            "--check", "20", "--out", str(out)]) == 0
    import json

    res = json.loads(out.read_text())
    assert [r["rung"] for r in res["rows"]][0] == "RTN" and len(res["rows"]) == 6
    for r in res["rows"]:
        c = r["check"]
        assert abs(c["engine_nll"] - c["emulated_nll"]) / c["engine_nll"] < 1e-5
