"""AQUA-KV: ridge predictors, backbone quantizers, residual codec, pre-RoPE keys with tracked positions, the
layer-by-layer reconstruction scratch, exact bytes, artifacts; calibrate -> save -> load -> generate on SmolLM2."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig

from kernels.layouts import DenseSeg, pack_planes, unpack_planes
from kernels.reference import attention_over_segments
from mmkv.cache import MMKVCache
from mmkv.calibrate.aquakv import calibrate, explained_variance, rel_error, ridge
from mmkv.methods import aquakv as A
from mmkv.methods.aquakv_codec import decode, encode
from mmkv.methods.aquakv_quant import Quantizer, _rotation
from mmkv.methods.artifacts import Artifact, shape_of
from mmkv.methods.rope import Rope, rotate
from mmkv.models.adapter import Adapter
from mmkv.spec import CacheSpec

H, D, L = 3, 64, 4
C = H * D


def adapter(name="toy", layers=L):
    cfg = LlamaConfig(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=H, head_dim=D,
                      num_hidden_layers=layers, rope_theta=10000.0)
    return Adapter(name=name, family="text", num_layers=layers, num_q_heads=H, num_kv_heads=H, head_dim=D,
                   lm_config=cfg)


def layered_kv(n: int, seed: int, layers: int = L):
    """Pre-RoPE keys and values ``[n, C]`` per layer, each layer a noisy linear map of the previous one (as the
    paper observes for real models), with per-channel offsets like real keys."""
    g = torch.Generator().manual_seed(1234)  # the maps are the model: fixed across calls
    maps = [(torch.randn(C, C, generator=g) / C**0.5 * 0.9 + torch.eye(C) * 0.4,
             torch.randn(C, C, generator=g) / C**0.5 * 0.5) for _ in range(layers)]
    offset = torch.randn(C, generator=g) * 3
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, C, generator=g) + offset
    v = torch.randn(n, C, generator=g)
    ks, vs = [k], [v]
    for a, b in maps[1:]:
        k = k @ a + 0.2 * torch.randn(n, C, generator=g)
        v = v @ a * 0.5 + k @ b + 0.2 * torch.randn(n, C, generator=g)
        ks.append(k)
        vs.append(v)
    return ks, vs


@pytest.fixture(scope="module")
def artifact_dir(tmp_path_factory):
    """Predictors calibrated (Alg. 1) on synthetic layered data, saved like ``mmkv-calibrate aquakv`` does."""
    folder = tmp_path_factory.mktemp("aquakv")
    ks, vs = layered_kv(3000, seed=1)
    train = torch.arange(3000) < 2400
    cfg = A.AquaKV(bits=2, quantizer="hadamard")
    res = calibrate(ks, vs, train, cfg, log=lambda *a: None)
    Artifact("aquakv", "toy", shape_of(adapter()), res["predictors"].tensors(), {"config": cfg.config()}).save(folder)
    return folder


def spec(artifact_dir, extra="", window=16, sinks=4, block=8):
    return f"text=aquakv:quantizer=hadamard,artifact={artifact_dir},block={block}{extra} window={window} sinks={sinks}"


def post_rope(x: torch.Tensor, positions: torch.Tensor, rope: Rope) -> torch.Tensor:
    """``[n, C]`` pre-RoPE -> ``[1, H, n, D]`` post-RoPE at ``positions [n]``."""
    cos, sin = rope.cos_sin(positions)
    return rotate(x.view(-1, H, D), cos[:, None], sin[:, None]).transpose(0, 1)[None]


def heads(x: torch.Tensor) -> torch.Tensor:
    return x.view(-1, H, D).transpose(0, 1)[None]


# --- predictors, quantizers, codec ------------------------------------------------------------------------------
def test_ridge_recovers_a_known_linear_map():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 24, generator=g) * torch.linspace(0.5, 3, 24) + 2
    w, b = torch.randn(24, 10, generator=g), torch.randn(10, generator=g)
    y = x @ w + b + 0.01 * torch.randn(4000, 10, generator=g)
    w_hat, b_hat = ridge(x, y, alpha=0.0)
    assert ((w_hat - w).norm() / w.norm()).item() < 1e-3
    assert ((b_hat - b).norm() / b.norm()).item() < 1e-2
    w_reg, b_reg = ridge(x, y)  # App. A's 1e-3: a slight shrinkage of the low-variance inputs' weights
    assert ((w_reg - w).norm() / w.norm()).item() < 1e-2
    assert explained_variance(y, x @ w_reg + b_reg) > 0.999


def test_probe_scores_full_and_per_head_maps_on_the_holdout():
    from mmkv.calibrate.aquakv import probe

    ks, vs = layered_kv(1500, seed=9)
    rows = probe(ks, vs, torch.arange(1500) < 1100, D)
    assert [r["layer"] for r in rows] == list(range(1, L))
    for r in rows:  # the synthetic maps mix heads: a per-head (block-diagonal) probe must explain less
        assert 0.8 < r["k_prev_to_k"] <= 1 and r["k_prev_to_k_per_head"] < r["k_prev_to_k"] - 0.1
        assert r["v_prev_k_to_v"] > max(r["v_prev_to_v"], r["k_to_v"])


def test_hadamard_rotation_is_orthogonal_and_seeded():
    r = _rotation(64, 3, "cpu")
    assert torch.allclose(r @ r.T, torch.eye(64), atol=1e-5)
    assert torch.equal(r, _rotation(64, 3, "cpu")) and not torch.equal(r, _rotation(64, 4, "cpu"))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_hadamard_beats_uniform_on_outlier_channels(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(777, C, generator=g)
    x[:, [5, 70, 150]] *= 25  # a few outlier channels, as keys have
    err = {kind: rel_error(x, Quantizer(bits, 64, kind).round_trip(x)) for kind in ("uniform", "hadamard")}
    assert err["hadamard"] < 0.6 * err["uniform"]
    assert err["hadamard"] < {2: 0.15, 3: 0.04, 4: 0.01}[bits]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codes_are_packed_planes_and_round_trip(bits):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 37, C, generator=g)
    q = Quantizer(bits, 64, "hadamard", seed=1)
    c = q.encode(x)
    assert sum(p.shape[-1] for p in c.planes) == C * bits // 8 and all(p.dtype == torch.uint8 for p in c.planes)
    assert len(c.planes) == (2 if bits == 3 else 1)
    codes = unpack_planes(c.planes, bits, -1)
    assert codes.max() < 2**bits and torch.equal(pack_planes(codes, bits, -1)[0], c.planes[0])
    assert c.scale.shape == (2, 37, C // 64) and c.scale.dtype == torch.float16
    assert q.bits_per_element() == bits + 0.5


@pytest.mark.parametrize("kind", ["uniform", "hadamard", "higgs"])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_encode_decode_is_encode_then_decode(kind, bits):
    """The flush's one call gives the codes of ``encode`` and exactly the values ``decode`` rebuilds from them (HIGGS
    takes them from its indices, not from the packed planes)."""
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(3, 29, C, generator=g) * 2.0 + 0.5
    q = Quantizer(bits, 64, kind, seed=2)
    codes, rebuilt = q.encode_decode(x)
    want = q.encode(x)
    assert all(torch.equal(a, b) for a, b in zip(codes.planes, want.planes, strict=True))
    assert torch.equal(codes.scale, want.scale)
    assert torch.equal(rebuilt, q.decode(want)) and rebuilt.shape == x.shape and rebuilt.dtype == torch.float32


@pytest.mark.parametrize("bits,higgs_max,uniform_min", [(2, 0.34, 0.44), (3, 0.18, 0.185), (4, 0.09, 0.088)])
@pytest.mark.parametrize("channels", [C, 1024])
def test_higgs_error_on_gaussian_data(bits, higgs_max, uniform_min, channels):
    # relative L2 error; issue 27 measured HIGGS 0.332 vs uniform 0.453 at 2 bits; the 2-D grid's gain shrinks
    # with more points
    g = torch.Generator().manual_seed(bits + channels)
    x = torch.randn(2048, channels, generator=g)
    err = {kind: rel_error(x, Quantizer(bits, 64, kind).round_trip(x)) ** 0.5 for kind in ("uniform", "higgs")}
    assert err["higgs"] < higgs_max and err["uniform"] > uniform_min and err["higgs"] < err["uniform"]


def test_higgs_is_insensitive_to_outlier_channels():
    # after the rotation and the norm scaling every group looks Gaussian: outliers cost HIGGS nothing extra
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2048, C, generator=g)
    plain = rel_error(x, Quantizer(2, 64, "higgs").round_trip(x)) ** 0.5
    x[:, [5, 70, 150]] *= 25
    assert rel_error(x, Quantizer(2, 64, "higgs").round_trip(x)) ** 0.5 < plain + 0.02


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_higgs_codes_pack_like_the_others_with_one_norm_per_group(bits):
    x = torch.randn(2, 37, C, generator=torch.Generator().manual_seed(bits))
    c = Quantizer(bits, 64, "higgs").encode(x)
    assert sum(p.shape[-1] for p in c.planes) == C * bits // 8 and len(c.planes) == (2 if bits == 3 else 1)
    assert c.zero is None and c.scale.shape == (2, 37, C // 64) and c.scale.dtype == torch.float16
    assert torch.allclose(c.scale.float(), x.view(2, 37, -1, 64).norm(dim=-1), rtol=1e-3)


def test_higgs_is_the_default_and_counts_its_bytes():
    assert A.AquaKV().quantizer == "higgs"
    cache = MMKVCache.for_model("text=aquakv:predictors=false,block=8 window=16 sinks=4", adapter())
    rope = Rope.from_config(adapter().lm_config, D)
    ks, vs = layered_kv(100, seed=2)
    for l in range(L):
        cache.update(post_rope(ks[l], torch.arange(100), rope), heads(vs[l]), l)
    cache.finalize()
    n_text = cache.layers[0].text_len[0]
    per_tok = sum(2 * (C * b // 8 + 2 * C // 64) for b in [4] + [2] * (L - 1))  # codes + one fp16 norm / 64
    assert n_text > 0 and cache.nbytes_by_modality(used=True)["text"] == n_text * (per_tok + 4)


def test_bad_quantizer_settings_raise():
    with pytest.raises(ValueError, match=r"allowed values: \[2, 3, 4\]"):
        CacheSpec.parse("text=aquakv:bits=1")
    with pytest.raises(ValueError, match="allowed values: \\['uniform', 'hadamard', 'higgs'\\]"):
        CacheSpec.parse("text=aquakv:quantizer=lattice")
    with pytest.raises(ValueError, match="block=0"):
        CacheSpec.parse("text=aquakv:block=0")


def test_encode_and_decode_agree_and_predictors_shrink_the_error(artifact_dir):
    bound = CacheSpec.parse(spec(artifact_dir)).text.bind(adapter())
    pred = bound._pred.to("cpu")
    ks, vs = layered_kv(500, seed=7)
    prev_e = prev_d = None
    for l in range(L):
        q = Quantizer(4 if l == 0 else 2, 64, "hadamard")
        kq, vq, k_hat, v_hat = encode(l, ks[l], vs[l], prev_e, pred, q, q)
        k_dec, v_dec = decode(l, kq, vq, prev_d, pred, q, q)
        assert torch.allclose(k_dec, k_hat, atol=1e-5) and torch.allclose(v_dec, v_hat, atol=1e-5)
        if l > 0:
            direct = rel_error(ks[l], q.round_trip(ks[l]))
            assert rel_error(ks[l], k_hat) < 0.5 * direct
        prev_e, prev_d = (k_hat, v_hat), (k_dec, v_dec)


def test_rope_tables_match_the_models_rotary_embedding():
    import mmkv
    from mmkv.calibrate.collect import rope_cos_sin

    model, _, ad = mmkv.load_model("random:smollm2-135m", tiny=True, dtype=torch.float32)
    pos = torch.tensor([0, 1, 5, 300, 4097])
    cos, sin = Rope.from_config(ad.lm_config, ad.head_dim).cos_sin(pos)
    cos_m, sin_m = rope_cos_sin(model, pos)
    assert torch.allclose(cos, cos_m, atol=1e-5) and torch.allclose(sin, sin_m, atol=1e-5)


# --- the method in the cache ------------------------------------------------------------------------------------
def fill(artifact_dir, n=120, extra="", window=16, sinks=4, block=8, decode_steps=0, seed=3):
    """A batch-1 cache holding ``n`` prompt tokens and ``decode_steps`` decoded ones, from synthetic layered K/V.
    Returns the cache and the true (pre-RoPE) K/V ``[n, C]`` per layer."""
    ad = adapter()
    cache = MMKVCache.for_model(spec(artifact_dir, extra, window, sinks, block), ad)
    rope = Rope.from_config(ad.lm_config, D)
    ks, vs = layered_kv(n + decode_steps, seed=seed)
    pos = torch.arange(n + decode_steps)
    for l in range(L):
        cache.update(post_rope(ks[l][:n], pos[:n], rope), heads(vs[l][:n]), l)
    cache.finalize()
    for t in range(n, n + decode_steps):
        for l in range(L):
            cache.update(post_rope(ks[l][t : t + 1], pos[t : t + 1], rope), heads(vs[l][t : t + 1]), l)
            cache.layers[l].segments()  # what attention reads at this layer, in order
    return cache, ks, vs, rope


def test_reconstruction_is_close_to_the_true_post_rope_keys(artifact_dir):
    cache, ks, vs, rope = fill(artifact_dir, n=150, decode_steps=20)
    for l, layer in enumerate(cache.layers):
        seg = layer.segments()[-1]
        assert isinstance(seg, DenseSeg)
        n = layer.text_len[0]
        assert n == 144  # prefill flushes (150-4-16)//8*8 = 128, the 20 decode steps two blocks of 8
        idx = torch.arange(4, 4 + n)  # text segment = tokens after the sinks, in order
        true_k = post_rope(ks[l][idx], idx, rope)
        assert rel_error(true_k, seg.k[:, :, :n]) < (0.02 if l == 0 else 0.1), l
        assert rel_error(heads(vs[l][idx]), seg.v[:, :, :n]) < (0.03 if l == 0 else 0.15), l


def test_attention_through_the_cache_equals_attention_over_the_methods_reconstruction(artifact_dir):
    cache, _, _, rope = fill(artifact_dir, n=97, decode_steps=11)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, H * 2, 1, D, generator=g)
    pos = cache.positions
    prev = None
    bound = cache.spec.text
    for l, layer in enumerate(cache.layers):
        through_cache, _ = attention_over_segments(q, layer.segments(), D**-0.5)
        # the same reconstruction written out by hand: Alg. 3 from the stored codes, layer after layer
        seg, n = layer.text, layer.text_len[0]
        qz = Quantizer(4 if l == 0 else 2, 64, "hadamard")
        k_hat, v_hat = decode(l, seg.codes("k", n), seg.codes("v", n), prev, bound._pred.to("cpu"), qz, qz)
        prev = (k_hat, v_hat)
        k = post_rope(k_hat[0], pos.take(0, 4, n), rope)
        own = DenseSeg(k, heads(v_hat[0]), torch.tensor([n], dtype=torch.int32))
        by_hand, _ = attention_over_segments(q, [layer.dense, own], D**-0.5)
        assert torch.allclose(through_cache, by_hand, atol=1e-5), l


def test_layers_read_out_of_order_fail_loudly(artifact_dir, monkeypatch):
    monkeypatch.setenv("MMKV_AQUAKV_CPU_MEMO", "0")  # the rebuild every step (a GPU's read)
    cache, *_ = fill(artifact_dir, n=80)
    cache.layers[0].segments()
    cache.layers[1].segments()
    with pytest.raises(RuntimeError, match="layer 3 is read but layer 2's reconstruction"):
        cache.layers[3].segments()
    cache.layers[2].segments()  # in order again: fine
    with pytest.raises(RuntimeError, match="layers must be read in order"):
        cache.layers[2].segments()  # layer 1's reconstruction was used once already


def test_at_most_two_layers_reconstructions_are_alive(artifact_dir, monkeypatch):
    monkeypatch.setenv("MMKV_AQUAKV_CPU_MEMO", "0")
    cache, *_ = fill(artifact_dir, n=90)
    alive = []

    def held():
        return sum(l.text_method.recon is not None for l in cache.layers)

    orig = A.AquaKVLayer.reconstruct

    def spy(self, seg, layer):
        alive.append(held())
        out = orig(self, seg, layer)
        alive.append(held() + 1)  # + the one just returned, still alive in the caller
        return out

    monkeypatch.setattr(A.AquaKVLayer, "reconstruct", spy)
    for _ in range(2):  # two forwards' worth of reads
        for layer in cache.layers:
            layer.segments()
        assert held() == 0  # nothing outlives a forward: the last layer keeps nothing
    assert max(alive) <= 2 and len(alive) == 4 * L


def test_bytes_are_exact(artifact_dir):
    for bits in (2, 3, 4):
        extra = f",bits={bits}"
        ad = adapter()
        try:
            cache = MMKVCache.for_model(spec(artifact_dir, extra), ad)
        except ValueError:  # the fixture's predictors are for 2 bits: the no-predictor variant has no such tie
            cache = MMKVCache.for_model(spec(artifact_dir, extra + ",predictors=false"), ad)
        rope = Rope.from_config(ad.lm_config, D)
        ks, vs = layered_kv(100, seed=2)
        for l in range(L):
            cache.update(post_rope(ks[l], torch.arange(100), rope), heads(vs[l]), l)
        cache.finalize()
        n_text = cache.layers[0].text_len[0]
        n_dense = cache.layers[0].dense_len[0]
        assert n_text + n_dense == 100 and n_text % 8 == 0
        per_tok_text = sum(2 * (C * b // 8 + 4 * C // 64) for b in [4] + [bits] * (L - 1))
        used = cache.nbytes_by_modality(used=True)
        assert used["text"] == n_text * (per_tok_text + 4)  # + one int32 position per text token
        assert used["fp16"] == n_dense * (L * 2 * C * 4 + 4)  # fp32 window on CPU + its positions
        bits_text = cache.effective_bits()["text"]
        assert bits_text == pytest.approx(8 * (per_tok_text + 4) / (2 * L * C))


def test_positions_follow_padding_and_visual_spans(artifact_dir):
    """Left padding and an image span in the prompt: the text tokens after the image keep the gap in positions;
    the reconstruction is right only if the keys are un-rotated and re-rotated at those positions."""
    ad = adapter()
    cache = MMKVCache.for_model(spec(artifact_dir), ad)
    rope = Rope.from_config(ad.lm_config, D)
    t = 140
    mask = torch.ones(2, t, dtype=torch.long)
    mask[1, :9] = 0  # row 1 left-padded
    visual = torch.zeros(2, t, dtype=torch.bool)
    visual[:, 30:70] = True  # an image span
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    ks, vs = layered_kv(2 * t, seed=4)
    cache.set_inputs(mask, visual)
    for l in range(L):
        k = torch.cat([post_rope(ks[l][r * t : (r + 1) * t], pos[r], rope) for r in range(2)])
        v = torch.cat([heads(vs[l][r * t : (r + 1) * t]) for r in range(2)])
        cache.update(k, v, l)
    cache.finalize()
    text = mask.bool() & ~visual
    for r in range(2):
        want = pos[r][text[r]]
        assert torch.equal(cache.positions.take(r, 0, len(want)), want)
    for l, layer in enumerate(cache.layers):
        seg = layer.segments()[-1]
        for r in range(2):
            n = layer.text_len[r]
            idx = torch.nonzero(text[r]).squeeze(1)[4 : 4 + n]
            true_k = post_rope(ks[l][r * t + idx], pos[r][idx], rope)
            assert rel_error(true_k, seg.k[r : r + 1, :, :n]) < 0.1, (l, r)


def test_chunked_forwards_and_crop_keep_layers_in_order(artifact_dir):
    """Later chat turns / chunked scoring: several tokens per forward over the stored history, routed lazily (the
    last layer at the next forward), then a crop of the window; reads keep working and stay accurate."""
    ad = adapter()
    cache = MMKVCache.for_model(spec(artifact_dir), ad)
    rope = Rope.from_config(ad.lm_config, D)
    ks, vs = layered_kv(200, seed=6)
    start = 0
    for chunk in (40, 13, 1, 1, 29, 7, 30):
        idx = torch.arange(start, start + chunk)
        for l in range(L):
            cache.update(post_rope(ks[l][idx], idx, rope), heads(vs[l][idx]), l)
            if start:
                cache.layers[l].segments()
        start += chunk
    for layer in cache.layers:
        layer.crop(3)
    idx = torch.arange(start - 3, start + 5)
    for l in range(L):
        cache.update(post_rope(ks[l][idx], idx, rope), heads(vs[l][idx]), l)
        seg = cache.layers[l].segments()[-1]
        n = cache.layers[l].text_len[0]
        true_k = post_rope(ks[l][4 : 4 + n], torch.arange(4, 4 + n), rope)
        assert rel_error(true_k, seg.k[:, :, :n]) < 0.1
    cache.finalize()
    assert cache.positions.lens[0] == start + 5 and cache.positions.next[0] == start + 5


def test_no_predictor_variant_needs_no_artifact_and_reads_layers_independently():
    cache = MMKVCache.for_model("text=aquakv:predictors=false,bits=3 window=16", adapter())
    rope = Rope.from_config(adapter().lm_config, D)
    ks, vs = layered_kv(90, seed=8)
    for l in range(L):
        cache.update(post_rope(ks[l], torch.arange(90), rope), heads(vs[l]), l)
    cache.finalize()
    seg = cache.layers[2].segments()[-1]  # no predecessor needed
    assert isinstance(seg, DenseSeg) and cache.layers[2].text_method.share_from is None


# --- spec and artifacts -----------------------------------------------------------------------------------------
def test_spec_round_trips_and_holds_no_tensors(artifact_dir):
    s = spec(artifact_dir, ",bits=2,first_bits=4")
    parsed = CacheSpec.parse(s)
    assert CacheSpec.parse(str(parsed)) == parsed
    bound = parsed.text.bind(adapter())
    assert str(bound) == str(parsed.text) and bound == parsed.text
    assert not any(isinstance(getattr(bound, f.name), torch.Tensor) for f in dataclasses.fields(bound))
    assert bound.predictor_nbytes() == 2 * (L - 1) * (C * C + C + 2 * C * C + C)
    assert "bits" in A.AquaKV.describe()["params"] and A.AquaKV.describe()["needs_artifact"]


def test_missing_or_mismatched_artifact_errors(artifact_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MMKV_CACHE_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="make one with: mmkv-calibrate aquakv --model toy --bits 2"):
        MMKVCache.for_model("text=aquakv", adapter())
    with pytest.raises(ValueError, match="calibrated for .*'quantizer': 'hadamard'.*--quantizer higgs"):
        MMKVCache.for_model(f"text=aquakv:artifact={artifact_dir}", adapter())
    with pytest.raises(ValueError, match="made for model 'toy'"):
        MMKVCache.for_model(spec(artifact_dir), adapter(name="other"))
    with pytest.raises(ValueError, match="made for model"):
        MMKVCache.for_model(spec(artifact_dir), adapter(layers=5))


def test_gpu_bench_smoke_runs_on_cpu(tmp_path):
    import json

    from eval.bench import aquakv as bench_aquakv

    assert bench_aquakv.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench_aquakv.json").read_text())["rows"]
    assert [r["spec"].split()[0].split(":")[0] for r in rows] == ["fp16", "text=aquakv", "text=aquakv", "text=kivi"]
    aqua = rows[1]
    assert aqua["predictor_bytes"] == 2 * 1 * (3 * 64 * 64 + 2 * 64)  # tiny model: 2 layers, 1 KV head
    assert aqua["text_tokens"] > 0 and aqua["step_ms"] > 0 and aqua["effective_bits"]["text"] < 4


# --- real model ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_calibrate_save_load_generate_on_smollm2(smollm2, tmp_path):
    import mmkv
    from mmkv.calibrate.aquakv import run
    from mmkv.paths import EXCERPT

    cfg = A.AquaKV(bits=2, quantizer="hadamard")
    folder, report = run(smollm2, cfg, EXCERPT / "valid.txt", fraction=1.0, seq_len=128, max_tokens=768,
                         out=tmp_path / "art", log=lambda *a: None)
    assert (folder / "tensors.safetensors").is_file() and (folder / "probe.json").is_file()
    assert report["predictor_bytes"] == 2 * 29 * (3 * 192 * 192 + 2 * 192)
    assert len(report["probe"]) == 29 and all(0 < r["k_prev_to_k"] < 1 for r in report["probe"])
    eng = mmkv.Engine(smollm2)
    s = f"text=aquakv:quantizer=hadamard,artifact={folder},block=8 window=16"
    turn1 = [{"role": "user", "content": "Write three sentences about Paris."}]
    out = eng.generate(turn1, spec=s, max_new_tokens=24)
    assert out.text[0].strip() and out.cache.layers[0].text_len[0] > 0  # history was quantized
    turn2 = turn1 + [{"role": "assistant", "content": out.text[0]}, {"role": "user", "content": "And Italy?"}]
    again = eng.generate(turn2, spec=s, max_new_tokens=6, past=out)  # a later chat turn over the stored cache
    assert again.text[0].strip() and again.cache is out.cache
    ids = eng.tokenizer("The tower is 324 metres tall, about the same height as an 81-storey building, and the "
                        "tallest structure in Paris. Its base is square, measuring 125 metres on each side.",
                        return_tensors="pt").input_ids
    # one parallel pass: an fp16 cache scores the same token by token (test_engine.py checks that equality)
    fp16 = eng.score(ids, "fp16 window=16", chunk=ids.shape[1])["ppl"]
    aqua = eng.score(ids, s, chunk=1)["ppl"]
    chunked = eng.score(ids, s, chunk=5)["ppl"]
    assert aqua < 1.5 * fp16 and chunked < 1.5 * fp16


def test_tiled_bench_cache_decodes_every_row(artifact_dir):
    from eval.bench.common import tile_cache

    cache, ks, vs, rope = fill(artifact_dir, n=70)
    cache = tile_cache(cache, 3)
    assert cache.positions.pos.shape[0] == 3 and cache.layers[2].positions is cache.positions
    for l in range(L):
        k = post_rope(ks[l][-1:], torch.tensor([70]), rope).expand(3, -1, -1, -1)
        cache.update(k, heads(vs[l][-1:]).expand(3, -1, -1, -1), l)
        seg = cache.layers[l].segments()[-1]
        assert seg.k.shape[0] == 3 and torch.equal(seg.k[0], seg.k[2])


@pytest.mark.slow
def test_text_positions_around_an_image_match_the_engines(demo_llava, cat_image_path):
    """A real VLM prompt (576 image tokens between text): the positions the cache learned for its text tokens are
    the engine's position ids, gap included, and generation over the pre-RoPE cache runs."""
    import mmkv

    msgs = [{"role": "user", "content": [{"type": "image", "image": str(cat_image_path)},
                                         {"type": "text", "text": "Describe the picture in one long sentence."}]}]
    prep = demo_llava.prepare(msgs)
    s = "visual=calibquant:bits=2 text=aquakv:predictors=false,bits=4,quantizer=hadamard,block=8 window=16"
    out = mmkv.Engine(demo_llava).generate(msgs, spec=s, max_new_tokens=12)
    ref = mmkv.Engine(demo_llava).generate(msgs, spec="visual=calibquant:bits=2 window=16", max_new_tokens=12)
    mask, visual = prep.attention_mask[0].bool(), prep.visual_mask[0]
    want = (mask.long().cumsum(0) - 1)[mask & ~visual]
    n_new = out.tokens.shape[1] - 1  # the last token is never fed
    want = torch.cat([want, torch.arange(n_new) + int(mask.sum())])
    got = out.cache.positions.take(0, 0, len(want))
    assert torch.equal(got, want) and bool((want[1:] - want[:-1] > 1).any())  # the image's gap
    assert out.cache.layers[5].text_len[0] > 0
    assert torch.equal(out.tokens[0, :2], ref.tokens[0, :2])


def test_a_layer_flushed_before_its_predecessor_names_what_that_layer_holds(artifact_dir):
    ad = adapter()
    rope = Rope.from_config(ad.lm_config, D)
    ks, vs = layered_kv(60, seed=3)  # 60 tokens: sinks 4 + window 16 leave 40, five blocks of 8 to flush
    cache = MMKVCache.for_model(spec(artifact_dir), ad)
    cache.positions.record(1, 60, None, None, "cpu")
    layer1 = cache.layers[1]
    layer1.update(post_rope(ks[1], torch.arange(60), rope), heads(vs[1]))
    with pytest.raises(RuntimeError, match=r"layer 1 flushes text tokens 0\.\.39 of row 0 but layer 0 holds "
                                           r"nothing: layers flushed out of order"):
        layer1.finalize()


def test_cpu_keeps_the_flushed_read_equal_to_the_rebuilt_one(artifact_dir, monkeypatch):
    """On the CPU the flush's reconstruction is kept (``aquakv_memo.py``) instead of being rebuilt from the codes
    every step. Over a left-padded batch of 2 with an image span, then decode steps that flush blocks, every layer's
    text segment equals the rebuilt one at every step (fp32: the predictor's product over 8 rows vs all rows may
    round differently, 1e-5), and with the kept read the codes are never decoded."""
    ad = adapter()
    rope = Rope.from_config(ad.lm_config, D)
    t, steps = 90, 19
    mask = torch.ones(2, t, dtype=torch.long)
    mask[1, :9] = 0
    visual = torch.zeros(2, t, dtype=torch.bool)
    visual[:, 30:50] = True
    pos = torch.cat([(mask.cumsum(1) - 1).clamp(min=0), mask.sum(1, keepdim=True) + torch.arange(steps)], 1)
    ks, vs = layered_kv(2 * (t + steps), seed=8)
    rebuilt = []
    real_decode = A.decode
    monkeypatch.setattr(A, "decode", lambda *a: rebuilt.append(1) or real_decode(*a))

    def kv(l, cols):
        rows = [slice(r * (t + steps) + cols.start, r * (t + steps) + cols.stop) for r in range(2)]
        k = torch.cat([post_rope(ks[l][rows[r]], pos[r, cols], rope) for r in range(2)])
        return k, torch.cat([heads(vs[l][rows[r]]) for r in range(2)])

    def reads(memo):
        monkeypatch.setenv("MMKV_AQUAKV_CPU_MEMO", memo)
        cache = MMKVCache.for_model(spec(artifact_dir), ad)
        cache.set_inputs(mask, visual)
        out = []
        for l in range(L):
            cache.update(*kv(l, slice(0, t)), l)
        cache.finalize()
        for s in range(t, t + steps):
            for l in range(L):
                cache.update(*kv(l, slice(s, s + 1)), l)
                seg, lens = cache.layers[l].segments()[-1], cache.layers[l].text_len
                out.append([(seg.k[r, :, :n].clone(), seg.v[r, :, :n].clone()) for r, n in enumerate(lens)])
        return out, cache

    kept, cache = reads("1")
    assert not rebuilt and cache.layers[1].text_method.memo.lens == cache.layers[1].text_len
    assert cache.layers[1].text_len == [64, 56]  # ragged rows; the decode steps flushed a block of each
    again, _ = reads("0")
    assert len(rebuilt) == L * steps
    for a, b in zip(kept, again):
        for (ka, va), (kb, vb) in zip(a, b):
            torch.testing.assert_close(ka, kb, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-5)
