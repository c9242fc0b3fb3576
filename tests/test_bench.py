"""The GPU benchmarks' machinery, run on CPU with tiny random models: caches built, tiled, decoded, tabled."""

import os

import pytest
import torch

import mmkv
from eval.bench import budget as bench_budget
from eval.bench import common as bench_common
from eval.bench import decode as bench_decode


def test_budget_bench_picks_the_largest_batch_that_fits_and_decodes():
    model, _, adapter = mmkv.load_model("random:internvl2.5-8b", tiny=True, dtype=torch.float32)
    per_req = bench_common.one_request_cache("visual=calibquant:bits=1", adapter, 64, 16, torch.device("cpu"),
                                             torch.float32).nbytes()
    budget_gb = 3 * per_req / 1e9
    rows = bench_budget.run(model, adapter, ["hf-fp16", "fp16", "visual=calibquant:bits=1"], [budget_gb], 64, 16,
                            steps=2, max_batch=8)
    by = {r["spec"]: r for r in rows}
    assert by["visual=calibquant:bits=1"]["max_batch"] == 3
    assert by["visual=calibquant:bits=1"]["cache_bytes"] <= budget_gb * 1e9
    assert by["hf-fp16"]["max_batch"] < by["visual=calibquant:bits=1"]["max_batch"]
    assert all(r["tokens_per_s"] > 0 for r in rows if r["max_batch"] >= 1)
    assert "| visual=calibquant:bits=1 |" in bench_budget.format_table(rows, "tiny")


def test_budget_bench_rounds_alternate_the_order_and_keep_medians(monkeypatch):
    model, _, adapter = mmkv.load_model("random:internvl2.5-8b", tiny=True, dtype=torch.float32)
    specs = ["hf-fp16", "fp16", "text=kivi:bits=2"]
    per_req = bench_common.one_request_cache("text=kivi:bits=2", adapter, 0, 80, torch.device("cpu"),
                                             torch.float32).nbytes()
    budgets = [0.5 * per_req / 1e9, 2 * per_req / 1e9]  # the first holds no request of any spec
    seen, clock = [], iter(range(100, 1000))

    def measure(model, adapter, spec, batch, *a):
        seen.append(spec)
        ms = float(next(clock))
        return {"cache_bytes": 1, "tokens_per_s": batch * 1000.0 / ms, "step_ms": ms, "peak_memory_bytes": None}

    monkeypatch.setattr(bench_budget, "_measure", measure)
    rows = bench_budget.run(model, adapter, specs, budgets, 0, 80, steps=2, max_batch=8, rounds=3)
    assert seen == specs + specs[::-1] + specs  # one budget fits: fp16 is not always timed before the methods
    assert [(r["spec"], r["budget_gb"]) for r in rows] == [(s, b) for s in specs for b in budgets]
    for r in rows:
        if r["budget_gb"] == budgets[0]:
            assert r["max_batch"] == 0 and r["tokens_per_s"] == 0.0 and "rounds_tokens_per_s" not in r
            continue
        assert len(r["rounds_tokens_per_s"]) == 3 and r["tokens_per_s"] == sorted(r["rounds_tokens_per_s"])[1]
        assert r["step_ms"] == pytest.approx(r["max_batch"] * 1000.0 / r["tokens_per_s"]) and "room" not in r
    by = {r["spec"]: r for r in rows if r["budget_gb"] == budgets[1]}
    assert by["fp16"]["speedup_vs_fp16"] == 1.0
    assert by["text=kivi:bits=2"]["speedup_vs_fp16"] == pytest.approx(
        by["text=kivi:bits=2"]["tokens_per_s"] / by["fp16"]["tokens_per_s"])


def test_tiled_cache_holds_every_row_separately():
    _, _, adapter = mmkv.load_model("random:smollm2-135m", tiny=True, dtype=torch.float32)
    one = bench_common.one_request_cache("text=kivi:bits=2", adapter, 0, 300, torch.device("cpu"), torch.float32)
    n1 = one.nbytes(used=True)
    tiled = bench_common.tile_cache(one, 4)
    assert tiled.nbytes(used=True) == 4 * n1
    seg = tiled.layers[0].text
    assert seg.k_codes.shape[0] == 4 and seg.k_codes.stride(0) > 0  # real copies, not broadcast views


def test_decode_bench_rows_and_ratios():
    model, _, adapter = mmkv.load_model("random:smollm2-135m", tiny=True, dtype=torch.float32)
    rows = bench_decode.run(model, adapter, ["hf-fp16", "fp16", "text=xquant:kq=1,vq=0,km=0,vm=0"], [200], [2], 2)
    assert len(rows) == 3 and all(r["step_ms"] > 0 for r in rows)
    assert rows[0]["speedup_vs_hf_fp16"] == 1.0
    assert "| 200 | 2 | fp16 |" in bench_decode.format_table(rows, "tiny")


def test_decode_bench_profile_records_each_rows_kernels():
    """``--profile``: every row gets the largest kernels of extra steps (on CPU, operators' own time), largest first,
    per step and per call consistent; without it no row has them."""
    model, _, adapter = mmkv.load_model("random:smollm2-135m", tiny=True, dtype=torch.float32)
    rows = bench_decode.run(model, adapter, ["fp16", "text=kivi:bits=2"], [200], [2], 2, profile=True)
    for r in rows:
        k = r["kernels"]
        assert 0 < len(k) <= 12 and any("mm" in name or "linear" in name for name in k)
        times = [v["us_per_step"] for v in k.values()]
        assert times == sorted(times, reverse=True) and times[-1] > 0
        for v in k.values():
            assert v["us_per_call"] * v["calls_per_step"] == pytest.approx(v["us_per_step"])
    assert "kernels" not in bench_decode.run(model, adapter, ["fp16"], [200], [2], 2)[0]


def test_kernel_times_runs_the_steps_it_is_given():
    from eval.bench.common import describe, kernel_times
    a, b, seen = torch.randn(64, 64), torch.randn(64, 64), []

    def step(i):
        seen.append(i)
        return (a @ b).relu()

    k = kernel_times(step, 3, ["cpu"])
    assert seen == [0, 1, 2] and "aten::mm" in k and k["aten::mm"]["calls_per_step"] == 1
    assert describe(k, 1).startswith(next(iter(k))[:40])


def test_decode_bench_rounds_alternate_the_order_and_keep_medians(monkeypatch):
    model, _, adapter = mmkv.load_model("random:smollm2-135m", tiny=True, dtype=torch.float32)
    specs = ["hf-fp16", "fp16", "text=kivi:bits=2"]
    seen = []
    real = bench_decode._measure

    def measure(model, adapter, row, spec, *a):
        seen.append(spec)
        real(model, adapter, row, spec, *a)

    monkeypatch.setattr(bench_decode, "_measure", measure)
    rows = bench_decode.run(model, adapter, specs, [200], [2], 2, rounds=3)
    assert seen == specs + specs[::-1] + specs  # fp16 is not always measured before the methods
    for r in rows:
        assert len(r["rounds_ms"]) == 3 and r["step_ms"] == sorted(r["rounds_ms"])[1]
        assert r["tokens_per_s"] == pytest.approx(2 * 1000.0 / r["step_ms"])
    assert rows[1]["speedup_vs_fp16"] == 1.0 and [r["spec"] for r in rows] == specs


def test_gpu_state_reads_each_gpus_clocks_or_nothing(monkeypatch):
    """``gpu_state``: one dict per GPU line of nvidia-smi's CSV, keyed by ``GPU_STATE``; [] with no nvidia-smi, when
    it fails, or when its lines do not have one value per field."""
    import subprocess

    vals = ["1755", "1980", "2619", "312.40", "700.00", "41", "0x0000000000000000"]
    line = ", ".join(vals)

    def fake(out):
        def run(cmd, **kw):
            assert cmd[0] == "nvidia-smi" and all(f in cmd[1] for f in bench_common.GPU_STATE)
            return subprocess.CompletedProcess(cmd, 0, stdout=out)
        return run

    monkeypatch.setattr(bench_common.subprocess, "run", fake(f"{line}\n{line.replace('1755', '1410')}\n"))
    got = bench_common.gpu_state()
    assert [g["clocks.sm"] for g in got] == ["1755", "1410"]
    assert got[0] == dict(zip(bench_common.GPU_STATE, vals, strict=True))
    monkeypatch.setattr(bench_common.subprocess, "run", fake("[N/A], 1980\n"))
    assert bench_common.gpu_state() == []

    def missing(cmd, **kw):
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(bench_common.subprocess, "run", missing)
    assert bench_common.gpu_state() == []

    def failing(cmd, **kw):
        raise subprocess.CalledProcessError(9, cmd)

    monkeypatch.setattr(bench_common.subprocess, "run", failing)
    assert bench_common.gpu_state() == []


def test_switches_set_for_the_block_and_put_back(monkeypatch):
    from eval.bench.switch_env import parse_variants, switches

    monkeypatch.setenv("MMKV_TEXT_WARPS", "4")
    monkeypatch.delenv("MMKV_TEXT_PREFETCH", raising=False)
    (_, env), = parse_variants("v:MMKV_TEXT_WARPS=2;MMKV_TEXT_PREFETCH=1")
    with switches(env):
        assert os.environ["MMKV_TEXT_WARPS"] == "2" and os.environ["MMKV_TEXT_PREFETCH"] == "1"
    assert os.environ["MMKV_TEXT_WARPS"] == "4" and "MMKV_TEXT_PREFETCH" not in os.environ
