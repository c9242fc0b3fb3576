"""Several GPUs on a CPU: sharding plans for fake GPUs (meta device), the dispatched model walking accelerate's
hooks, per-device cache placement, the decode-kernel device switch, shards derived from accelerate's state, the
data-parallel merge, per-GPU budget arithmetic and the study's smoke mode (docs/MULTIGPU.md)."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import warnings
from types import SimpleNamespace

import pytest
import torch

import mmkv
from eval import distributed, merge, run
from eval.bench import budget as bench_budget
from eval.bench import common as bench_common
from eval.studies import multigpu as multigpu_study
from kernels._launch import on_device
from mmkv.attention import mmkv_attention
from mmkv.cache import MMKVCache, placement
from mmkv.models import sharding
from mmkv.spec import CacheSpec

H, D, HQ = 3, 64, 9
TWO_GPUS = {0: "40GiB", 1: "40GiB"}


def meta_model(name: str, tiny: bool = False):
    """The full-size architecture with parameters on the meta device (nothing allocated), as load_model builds it."""
    from accelerate import init_empty_weights
    from transformers import InternVLForConditionalGeneration, LlamaForCausalLM, LlavaForConditionalGeneration

    config = mmkv.models.random_config(name, tiny=tiny)
    cls = {"internvl": InternVLForConditionalGeneration, "llava": LlavaForConditionalGeneration}.get(
        getattr(config, "model_type", ""), LlamaForCausalLM)
    with init_empty_weights(include_buffers=False):
        model = cls._from_config(config, dtype=torch.float16)
    model.tie_weights()
    return model


def owner(plan: dict, module: str):
    return sharding._owner_device(plan, module)


def weight_bytes(model, plan: dict) -> dict:
    out: dict = {}
    for name, p in model.named_parameters():
        dev = owner(plan, name.rpartition(".")[0])
        out[dev] = out.get(dev, 0) + p.numel() * p.element_size()
    return out


# --- sharding plans (meta device: fake GPUs) -------------------------------------------------------------------------
def test_auto_plan_splits_internvl_26b_over_two_fake_gpus_within_max_memory():
    model = meta_model("internvl2.5-26b")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Device 0 is not available": these GPUs are planned for, not present
        plan = sharding.plan_device_map(model, "auto", TWO_GPUS, torch.float16)
    layers = [owner(plan, f"model.language_model.layers.{i}") for i in range(48)]
    assert set(layers) == {0, 1} and layers == sorted(layers)  # contiguous: one hand-over between the GPUs
    assert owner(plan, "model.vision_tower") == 0 and owner(plan, "model.language_model.embed_tokens") == 0
    assert owner(plan, "lm_head") == 1
    used = weight_bytes(model, plan)
    assert set(used) == {0, 1} and all(used[g] <= 40 * 2**30 for g in used)
    assert sum(used.values()) == sum(p.numel() * 2 for p in model.parameters())  # every weight placed once


def test_layers_plan_gives_each_gpu_the_same_share_of_decoder_layers_and_kv_cache():
    model = meta_model("internvl2.5-26b")
    plan = sharding.plan_device_map(model, "layers", TWO_GPUS)
    layers = [owner(plan, f"model.language_model.layers.{i}") for i in range(48)]
    assert layers == [0] * 24 + [1] * 24
    assert [owner(plan, m) for m in ("model.vision_tower", "model.multi_modal_projector",
                                     "model.language_model.embed_tokens")] == [0, 0, 0]
    assert [owner(plan, m) for m in ("model.language_model.norm", "lm_head")] == [1, 1]
    three = sharding.layers_map(model, ["cuda:0", "cuda:1", "cuda:2"])
    counts = [sum(owner(three, f"model.language_model.layers.{i}") == d for i in range(48))
              for d in ("cuda:0", "cuda:1", "cuda:2")]
    assert counts == [16, 16, 16]


def test_layers_plan_keeps_a_tied_lm_head_with_the_embeddings():
    model = meta_model("smollm2-135m")  # tie_word_embeddings=True
    assert model.lm_head.weight is model.model.embed_tokens.weight
    plan = sharding.layers_map(model, [0, 1])
    assert owner(plan, "lm_head") == owner(plan, "model.embed_tokens") == 0
    assert owner(plan, "model.layers.29") == 1 and owner(plan, "model.layers.14") == 0


def test_bad_sharding_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="auto"):
        mmkv.load_model("random:smollm2-135m", tiny=True, device_map="everywhere")
    with pytest.raises(ValueError, match="either device or device_map"):
        mmkv.load_model("random:smollm2-135m", tiny=True, device="cpu", device_map="auto")
    with pytest.raises(ValueError, match="only applies with device_map"):
        mmkv.load_model("random:smollm2-135m", tiny=True, max_memory="0=1GiB")
    with pytest.raises(ValueError, match="DEVICE=SIZE"):
        sharding.parse_max_memory("0:70GiB")
    with pytest.raises(ValueError, match="GPU index"):
        sharding.parse_max_memory({"gpu0": "1GiB"})
    assert sharding.parse_max_memory("0=70GiB, cuda:1=60GiB,cpu=1000") == {0: "70GiB", 1: "60GiB", "cpu": "1000"}
    with pytest.raises(ValueError, match="offloaded"):
        sharding.check_placed({"model.layers.0": "cuda:0", "model.layers.1": "cpu"}, allow_offload=False)


# --- a dispatched model on the CPU: the same hooks as two GPUs ------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_sharded():
    plain = mmkv.load_model("random:internvl2.5-8b", tiny=True, dtype=torch.float32, device="cpu")
    plan = {k: "cpu" for k in sharding.layers_map(plain.model, [0, 1])}  # the 2-GPU plan, both halves on the CPU
    lm = mmkv.load_model("random:internvl2.5-8b", tiny=True, dtype=torch.float32, device_map=plan)
    return plain, lm, plan


def test_sharded_random_model_is_placed_initialized_and_hooked(tiny_sharded):
    plain, lm, plan = tiny_sharded
    model = lm.model
    assert model.hf_device_map == plan
    assert not any(p.is_meta for p in model.parameters())
    hooked = [n for n, m in model.named_modules() if hasattr(m, "_hf_hook")]
    assert "model.language_model.layers.0" in hooked and "model.vision_tower" in hooked
    skip = model.model.language_model.layers[1]._hf_hook.skip_keys
    assert {"cache", "past_key_values"} <= set(skip)  # the cache object is never moved, under either keyword
    # the model's own initialization ran on each placed weight (not an empty allocation)
    q = model.model.language_model.layers[1].self_attn.q_proj.weight
    assert 0.015 < float(q.std()) < 0.025 and torch.isfinite(q).all()
    assert torch.equal(model.model.language_model.layers[0].input_layernorm.weight,
                       torch.ones_like(model.model.language_model.layers[0].input_layernorm.weight))
    assert torch.equal(model.model.language_model.rotary_emb.inv_freq, plain.model.model.language_model.rotary_emb.inv_freq)
    assert sharding.layer_devices(model) == [torch.device("cpu")] * 2


def test_generation_through_hooks_equals_the_same_weights_without_hooks(tiny_sharded, square_image_path):
    from accelerate.hooks import remove_hook_from_submodules

    _, lm, _ = tiny_sharded
    msgs = [{"role": "user", "content": [{"type": "image", "image": str(square_image_path)},
                                          {"type": "text", "text": "What is it?"}]}]
    eng = mmkv.Engine(lm)
    hooked = {s: eng.generate(msgs, spec=s, max_new_tokens=4) for s in ("fp16", "visual=calibquant:bits=1")}
    assert hooked["visual=calibquant:bits=1"].stats["prompt_tokens"]["visual"] == 256
    layers = hooked["fp16"].cache.layers
    assert placement.layer_devices(hooked["fp16"].cache) == [torch.device("cpu")] * len(layers)
    copy = mmkv.models.LoadedModel(lm.model, lm.processor, lm.adapter)
    remove_hook_from_submodules(copy.model)
    plain = mmkv.Engine(copy)
    for spec, out in hooked.items():
        assert torch.equal(out.tokens, plain.generate(msgs, spec=spec, max_new_tokens=4).tokens)


# --- per-device cache placement --------------------------------------------------------------------------------------
class Attn(torch.nn.Module):
    is_causal = True
    num_key_value_groups = HQ // H


@contextlib.contextmanager
def default_device(dev):
    torch.set_default_device(dev)
    try:
        yield
    finally:
        torch.set_default_device(None)


def filled_cache(spec: str, layers: int = 2, decode_steps: int = 6, default: str | None = "meta", seed: int = 0):
    """A cache fed CPU key tensors (prefill with padding and a visual span, then decode steps that flush text
    blocks). With ``default="meta"``, any tensor the cache made without taking the keys' device lands on the meta
    device, and mixing it with CPU tensors fails: that is how a layer on cuda:1 would get a cuda:0 tensor."""
    g = torch.Generator().manual_seed(seed)
    cache = MMKVCache(CacheSpec.parse(spec), num_layers=layers, head_dim=D)
    k, v = torch.randn(2, H, 90, D, generator=g) * 2, torch.randn(2, H, 90, D, generator=g)
    mask = torch.ones(2, 90, dtype=torch.long)
    mask[1, :7] = 0
    vis = torch.zeros(2, 90, dtype=torch.bool)
    vis[:, 20:51] = True
    with default_device(default) if default else contextlib.nullcontext():
        cache.set_inputs(mask, vis)
        for layer in range(layers):
            cache.update(k + layer, v, layer)
        cache.finalize()
        cache.prefill_text_len = list(cache.layers[0].text_len)
        for _ in range(decode_steps):
            for layer in range(layers):
                kn = torch.randn(2, H, 1, D, generator=g, device="cpu")
                keys, values = cache.update(kn, torch.randn(2, H, 1, D, generator=g, device="cpu"), layer)
                q = torch.randn(2, HQ, 1, D, generator=g, device="cpu")
                out, _ = mmkv_attention(Attn(), q, keys, values, None, scaling=1 / math.sqrt(D))
                assert out.device.type == "cpu" and torch.isfinite(out).all()
    return cache


@pytest.mark.parametrize("spec", ["visual=calibquant:bits=1 text=kivi:bits=2,group=16 window=8 sinks=4",
                                  "text=xquant:kq=2,vq=1,km=0,vm=0,group=16,share=average window=8 sinks=4"],
                         ids=["calibquant+kivi", "xquant-average"])
def test_every_segment_tensor_follows_the_key_device(spec):
    cache = filled_cache(spec)
    assert cache.layers[0].text_len > cache.prefill_text_len  # decode flushed text blocks too, not only prefill
    for layer in cache.layers:
        for seg in layer.segments():
            assert {str(t.device) for _, t in placement.tensors(seg)} == {"cpu"}  # codes, scales, lens, ...
    assert cache.nbytes_by_device() == {"cpu": cache.nbytes()}


def test_bytes_are_reported_per_device():
    cache = filled_cache("visual=calibquant:bits=2 text=kivi:bits=2,group=16 window=8 sinks=4", default=None)
    per_layer = [sum(placement.S.nbytes(seg) for _, seg, _ in layer.parts()) for layer in cache.layers]
    used_1 = sum(placement.S.used_nbytes(seg, lens) for _, seg, lens in cache.layers[1].parts())
    layer = cache.layers[1]  # as if layer 1 ran on a second device
    layer.dense = placement.to_device(layer.dense, "meta")
    layer.visual = [placement.to_device(s, "meta") for s in layer.visual]
    layer.text = placement.to_device(layer.text, "meta")
    assert cache.nbytes_by_device() == {"cpu": per_layer[0], "meta": per_layer[1]}
    assert sum(cache.nbytes_by_device().values()) == cache.nbytes()
    assert cache.nbytes_by_device(used=True)["meta"] == used_1
    assert placement.layer_devices(cache) == [torch.device("cpu"), torch.device("meta")]
    mixed = layer.dense.__class__(layer.dense.k, layer.dense.v, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="several devices"):
        placement.segment_device(mixed)


def test_codes_shared_across_a_device_boundary_are_brought_to_the_layer():
    cache = filled_cache("text=xquant:kq=2,vq=1,km=0,vm=0,group=16 window=8 sinks=4", default=None)
    even, odd = cache.layers
    assert odd.text.k_codes is None and odd.partner is even  # layer 1 reads layer 0's key codes
    odd.text = placement.to_device(odd.text, "meta")
    odd.dense = placement.to_device(odd.dense, "meta")
    odd.device = torch.device("meta")  # layer 1 on another device than its partner
    text = odd.segments()[-1]
    assert text.k_codes.device.type == "meta" and text.k_codes.shape == even.text.k_codes.shape
    assert even.text.k_codes.device.type == "cpu"  # the partner's own codes stay where they are
    assert placement.segment_device(text) == torch.device("meta")


def test_kernel_device_switch_costs_nothing_off_gpu():
    assert isinstance(on_device(torch.zeros(1)), contextlib.nullcontext)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_gpu_decode_kernel_runs_on_the_segments_gpu_not_the_current_one():
    import kernels
    from kernels.reference import attention_over_segments

    segs_by_dev = {}
    for dev in ("cuda:0", "cuda:1"):
        cache = filled_cache("visual=calibquant:bits=1 text=kivi:bits=2,group=32 window=16 sinks=4",
                             layers=1, decode_steps=0, default=None)
        layer = cache.layers[0]
        segs_by_dev[dev] = [placement.to_device(s, dev) for s in layer.segments()]
    torch.cuda.set_device(0)
    for dev, segs in segs_by_dev.items():
        q = torch.randn(2, HQ, D, device=dev, dtype=torch.float32)
        out = torch.full_like(q, float("nan"))
        kernels.decode_attention(q, [s for s in segs], out=out)
        ref = attention_over_segments(q.unsqueeze(2), segs)[0].squeeze(2)
        assert torch.isfinite(out).all() and ((out - ref).norm() / ref.norm()).item() < 1e-3
        assert torch.cuda.current_device() == 0


# --- data-parallel eval: shards from accelerate's state, merge == single process -------------------------------------
def test_shard_comes_from_accelerate_state():
    assert distributed.shard_of(SimpleNamespace(process_index=3, num_processes=4)) == (3, 4)
    with pytest.raises(ValueError, match="rank"):
        distributed.shard_of(SimpleNamespace(process_index=4, num_processes=4))
    assert distributed.launched({"WORLD_SIZE": "2"}) and not distributed.launched({})
    assert not distributed.launched({"WORLD_SIZE": "1"})
    assert distributed.process_gpus(1, 2, 4) == [2, 3] and distributed.process_gpus(0, 8, 8) == [0]
    with pytest.raises(ValueError, match="evenly"):
        distributed.process_gpus(0, 3, 4)


def test_context_initializes_partial_state_from_the_launch(monkeypatch):
    import accelerate

    seen = {}

    class FakeState:  # what accelerate launch / torchrun leave in the environment, as PartialState reads it
        def __init__(self, cpu=False, **kwargs):
            seen.update(cpu=cpu, **kwargs)
            self.process_index, self.num_processes, self.local_process_index = 5, 8, 1
            self.device = torch.device("cpu", 0)

    monkeypatch.setattr(accelerate, "PartialState", FakeState)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "7200")
    ctx = distributed.context()
    assert (ctx.rank, ctx.world, ctx.local_rank, ctx.local_world) == (5, 8, 1, 4)
    assert not ctx.is_main and ctx.device == torch.device("cpu")
    assert seen["backend"] == "gloo" and seen["timeout"].total_seconds() == 7200
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert distributed.context() is None


class FakeLaunch:
    """N processes of one launch, run one after the other in this process; ``gather`` hands the main process
    every payload (the main process must run last, as it is the one that waits)."""

    def __init__(self, world: int):
        self.world, self.payloads = world, [None] * world

    def context(self, rank: int) -> distributed.Context:
        launch = self

        class Ctx(distributed.Context):
            def gather(self, obj):
                launch.payloads[self.rank] = obj
                return list(launch.payloads) if self.is_main else None

        return Ctx(rank, self.world, rank, self.world, torch.device("cpu"))


def fake_engine_loader():
    from test_eval_plumbing import FakeEngine, loader

    engine = FakeEngine()
    return engine, loader(engine)


def opts_for(out, limit=5, **extra) -> dict:
    argv = ["docvqa", "--model", "fake-model", "--spec", "visual=calibquant:bits=1", "--out", str(out),
            "--limit", str(limit), "--quiet", "--data", str(multigpu_study.FIXTURE)]
    return {**vars(run.build_parser().parse_args(argv)), **extra}


def test_data_parallel_merge_equals_the_single_process_table(tmp_path):
    engine, load = fake_engine_loader()
    assert run.main([*["docvqa", "--model", "fake-model", "--spec", "visual=calibquant:bits=1", "--out",
                       str(tmp_path / "single"), "--limit", "5", "--quiet", "--data",
                       str(multigpu_study.FIXTURE)]], loader=load) == 0
    launch = FakeLaunch(3)
    logs = []
    # rank 2 runs "on another machine": its folder is not under the main process's OUT; its files travel
    other = tmp_path / "machine2"
    assert distributed.run_sharded(opts_for(other), launch.context(2), run.run, merge.merge, loader=load) == 0
    assert distributed.run_sharded(opts_for(tmp_path / "dp"), launch.context(1), run.run, merge.merge,
                                   loader=load) == 0
    assert distributed.run_sharded(opts_for(tmp_path / "dp"), launch.context(0), run.run, merge.merge,
                                   loader=load, log=logs.append) == 0
    merged, single = tmp_path / "dp", tmp_path / "single"
    assert (merged / "results.csv").read_text() == (single / "results.csv").read_text()
    assert sorted(p.name for p in (merged / "shards").iterdir()) == ["0-of-3", "1-of-3", "2-of-3"]
    assert json.loads((merged / "shards" / "2-of-3" / "config.json").read_text())["shard"] == [2, 3]
    rows = lambda p: sorted((p / "samples" / "fp16.jsonl").read_text().splitlines())  # noqa: E731
    assert rows(merged) == rows(single)
    table = list(csv.DictReader((merged / "results.csv").open()))
    assert [r["n"] for r in table] == ["5", "5"]
    # the same launch again resumes every shard: no sample runs twice
    calls = engine.calls
    for rank in (2, 1, 0):
        out = other if rank == 2 else tmp_path / "dp"
        distributed.run_sharded(opts_for(out), launch.context(rank), run.run, merge.merge, loader=load)
    assert engine.calls == calls


def test_a_failed_shard_fails_the_launch_with_its_message(tmp_path):
    _, load = fake_engine_loader()
    launch = FakeLaunch(2)
    bad = opts_for(tmp_path, data=str(tmp_path / "nowhere"))
    assert distributed.run_sharded(bad, launch.context(1), run.run, merge.merge, loader=load) == 2
    logs = []
    good = opts_for(tmp_path)
    assert distributed.run_sharded(good, launch.context(0), run.run, merge.merge, loader=load,
                                   log=lambda *a: logs.append(" ".join(map(str, a)))) == 2
    assert any("process 1 failed" in line for line in logs)
    assert not (tmp_path / "results.csv").exists()  # nothing merged from an incomplete launch
    with pytest.raises(ValueError, match="contradicts the launch"):
        distributed.run_sharded(opts_for(tmp_path, shard=(0, 2)), FakeLaunch(4).context(1), run.run, merge.merge,
                                loader=load)


def test_gathered_files_are_limited_to_run_records(tmp_path):
    with pytest.raises(ValueError, match="unexpected file"):
        distributed.write_folder(tmp_path, {"../escape.txt": "x"})


# --- per-GPU budget arithmetic ---------------------------------------------------------------------------------------
def test_fit_batch_is_bounded_by_the_gpu_with_least_room_per_request():
    per_req = {"cuda:0": 30, "cuda:1": 50}
    assert bench_common.fit_batch(per_req, {"cuda:0": 1000, "cuda:1": 1000}, 10_000) == 20
    assert bench_common.fit_batch(per_req, {"cuda:0": 1000, "cuda:1": 1000}, 7) == 7
    assert bench_common.fit_batch(per_req, {"cuda:0": 20, "cuda:1": 1000}, 10) == 0
    assert bench_common.parse_budgets("5, 30,fit") == [5.0, 30.0, "fit"]
    with pytest.raises(ValueError, match="fit"):
        bench_common.parse_budgets("lots")


def test_reserved_room_equals_what_decode_steps_grow_to():
    _, _, adapter = mmkv.load_model("random:smollm2-135m", tiny=True, dtype=torch.float32)
    spec, dev = "text=kivi:bits=2", torch.device("cpu")
    roomy = bench_common.reserve_room(bench_common.one_request_cache(spec, adapter, 0, 70, dev, torch.float32), 12)
    grown = bench_common.one_request_cache(spec, adapter, 0, 70, dev, torch.float32)
    before = grown.nbytes()
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        for layer in range(adapter.num_layers):
            kv = torch.randn(2, 1, adapter.num_kv_heads, 1, adapter.head_dim, generator=g)
            grown.update(kv[0], kv[1], layer)
    assert grown.nbytes() > before and roomy.nbytes() == grown.nbytes()


def test_budget_rows_report_memory_per_device():
    rows = [{"spec": "fp16", "budget_gb": "fit", "max_batch": 3, "tokens_per_s": 1.0,
             "bytes_per_request": 300, "bytes_per_request_by_device": {"cuda:0": 100, "cuda:1": 200},
             "cache_bytes_by_device": {"cuda:0": 3e9, "cuda:1": 6e9},
             "peak_memory_bytes_by_device": {"cuda:0": 40e9, "cuda:1": 45e9}}]
    text = bench_budget.format_table(rows, "two GPUs")
    assert "| fp16 | fit | 3 | cuda:1 | 200 | 6.00 | 45.00 |" in text
    assert bench_budget.format_device_table([{**rows[0], "bytes_per_request_by_device": {"cpu": 1}}]) == ""


# --- the GPU study's CPU smoke mode ----------------------------------------------------------------------------------
def test_study_smoke_sharded_part(tmp_path):
    assert multigpu_study.main(["--smoke", "--parts", "sharded", "--out", str(tmp_path), "--steps", "1"]) == 0
    report = json.loads((tmp_path / "multigpu.json").read_text())
    res = report["sharded"][0]
    assert res["synthetic"] == "random weights" and res["decoder_layers_by_device"] == {"cpu": 2}
    gen = {g["spec"]: g for g in res["generation"]}
    assert gen["visual=calibquant:bits=1"]["prompt_tokens"]["visual"] == 256
    assert gen["visual=calibquant:bits=1"]["cache_bytes"] < gen["fp16"]["cache_bytes"]
    assert gen["visual=calibquant:bits=1"]["kernel_check"]["max_rel_err_by_device"]["cpu"] < 1e-4
    assert [(r["spec"], r["max_batch"]) for r in res["budget"]] == [("fp16", 3), ("visual=calibquant:bits=1", 3)]
    assert all(r["tokens_per_s"] > 0 for r in res["budget"])
    assert "Sharded: random:internvl2.5-8b" in (tmp_path / "multigpu.md").read_text()


@pytest.mark.slow
def test_study_smoke_data_parallel_launch_equals_one_process(tmp_path):
    """The real launcher: accelerate launch starts 2 processes (gloo on CPU), each runs its shard of the DocVQA
    fixture with demo-llava, the main one merges; one plain process runs the same samples."""
    assert multigpu_study.main(["--smoke", "--parts", "dp", "--out", str(tmp_path)]) == 0
    dp = json.loads((tmp_path / "multigpu.json").read_text())["data_parallel"]
    assert dp["two_processes"]["returncode"] == 0 and dp["one_process"]["returncode"] == 0
    assert dp["same_table"] is True and dp["same_tokens"] is True and dp["records"] == 4
    assert dp["shard_folders"] == ["0-of-2", "1-of-2"]


def test_sharded_text_model_keeps_its_tied_head_one_tensor():
    plan = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu", "model.norm": "cpu",
            "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = mmkv.load_model("random:smollm2-135m", tiny=True, dtype=torch.float32, device_map=plan).model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert 0.015 < float(model.lm_head.weight.std()) < 0.025


def test_folder_model_loads_through_from_pretrained_device_map(tmp_path, smollm2_load_info):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=49152)
    folder = tmp_path / "llama"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    AutoTokenizer.from_pretrained(smollm2_load_info["folder"]).save_pretrained(folder)
    # "layers" for two GPUs, planned on a meta copy of the checkpoint's architecture
    plan = sharding.hub_device_map(str(folder), "layers", TWO_GPUS, torch.float32, AutoModelForCausalLM, cfg)
    assert [owner(plan, f"model.layers.{i}") for i in range(4)] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    assert owner(plan, "lm_head") == "cuda:1" and owner(plan, "model.embed_tokens") == "cuda:0"
    on_cpu = {k: "cpu" for k in plan}  # one device: from_pretrained places it without hooks
    sharded = mmkv.load_model(str(folder), device_map=on_cpu, dtype=torch.float32)
    plain = mmkv.load_model(str(folder), device="cpu", dtype=torch.float32)
    spec = "text=kivi:bits=2,group=16 window=8 sinks=4"
    a = mmkv.Engine(sharded).generate("The capital of France is", spec=spec, max_new_tokens=30)
    b = mmkv.Engine(plain).generate("The capital of France is", spec=spec, max_new_tokens=30)
    assert torch.equal(a.tokens, b.tokens) and a.cache.layers[0].text_len[0] > 0
