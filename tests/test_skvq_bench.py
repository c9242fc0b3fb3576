"""The SKVQ GPU benchmarks' machinery on CPU: decode bench with an on-the-fly synthetic artifact (random-weight
model), and the kernel bench's smoke mode (torch reference; no timing claims)."""

from __future__ import annotations

import json

import pytest
import torch

import mmkv
from eval.bench import decode as bench_decode
from eval.bench import skvq_attention as bench_skvq_kernel
from mmkv.calibrate.skvq import attach_synthetic_artifacts


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add synchronization on a busy machine
    yield
    torch.set_num_threads(threads)


def test_decode_bench_calibrates_skvq_on_the_fly_for_random_models(tmp_path, one_thread):
    model, _, adapter = mmkv.load_model("random:smollm2-135m", tiny=True, dtype=torch.float32)
    specs = ["hf-fp16", "fp16", "text=skvq:v_bits=1.5,group=32 window=32 sinks=5",
             "text=skvq:reorder=off,clip=off window=32", "text=xquant:kq=1,vq=0,km=0,vm=0"]
    got = attach_synthetic_artifacts(specs, adapter, tmp_path, tokens=256)
    assert got[:2] == specs[:2] and got[3:] == specs[3:]  # baselines, RTN and other methods untouched
    assert f"artifact={tmp_path}" in got[2] and (tmp_path / "g32-k2-v1.5" / "meta.json").is_file()
    rows = bench_decode.run(model, adapter, got, [200], [2], 2)
    assert all(r["step_ms"] > 0 for r in rows)
    assert "skvq" in bench_decode.format_table(rows, "tiny")


def test_kernel_bench_smoke(tmp_path):
    out = tmp_path / "k.json"
    assert bench_skvq_kernel.main(["--smoke", "--shapes", "smollm2-135m", "--groups", "32", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    names = {r["layout"] for r in rows}
    assert {"fp16", "kivi-2", "skvq-K2V2-g32-var", "skvq-K2V2-g32-fix", "skvq-K2V2-g32-nat",
            "skvq-K2V1.5-g32-var-fp8"} <= names
    by = {r["layout"]: r["segment_bytes"] for r in rows}
    assert by["skvq-K2V1.5-g32-var-fp8"] < by["skvq-K2V2-g32-var"] < by["fp16"]
