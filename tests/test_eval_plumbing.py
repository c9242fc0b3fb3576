"""CLI plumbing with a stand-in engine (no model): every task end to end on the fixtures, resume after an
interruption, data-parallel shards merged into the single-process table, the judge over a local HTTP endpoint."""

import csv
import http.server
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eval import merge, run

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "eval"
DATA = {"coco_caption": ASSETS / "coco_caption", "docvqa": ASSETS / "docvqa",
        "mmbench_video": ASSETS / "mmbench_video"}


class FakeTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [hash(w) % 1000 for w in text.split()]}


class FakeEngine:
    """Deterministic answers that depend on the sample and the spec; counts calls; can 'crash' after N calls."""

    def __init__(self, crash_after=None):
        self.calls, self.crash_after = 0, crash_after

    def _tick(self):
        self.calls += 1
        if self.crash_after is not None and self.calls > self.crash_after:
            raise KeyboardInterrupt("simulated interruption")

    def generate(self, inputs, spec=None, max_new_tokens=8, do_sample=False, **kw):
        self._tick()
        key = json.dumps(inputs, default=str) if not torch.is_tensor(inputs) else str(inputs.sum().item())
        n = 1 + hash(key + ("" if spec == "fp16" else spec)) % 5
        tokens = torch.arange(min(n, max_new_tokens))[None]
        text = "a cat on a table" if "fp16" == spec else "a cat 1001"
        stats = {"cache_bytes": {"visual": 1 << 20, "text": 1 << 19, "fp16": 0}, "prefill_ms": 1.0,
                 "timeline": [{"step": 0}]}
        return SimpleNamespace(text=[text], tokens=tokens, stats=stats)

    def score(self, ids, spec=None, chunk=1):
        self._tick()
        t = ids.shape[1] - 1
        nll = t * (2.0 if spec == "fp16" else 2.1)
        return {"nll": nll, "tokens": t, "ppl": 0.0, "stats": {"cache_bytes": {"text": 4096}}}


def loader(engine):
    adapter = SimpleNamespace(synthetic="random weights", family="llava", takes_images=True, takes_video=True)
    lm = SimpleNamespace(adapter=adapter, processor=SimpleNamespace(tokenizer=FakeTokenizer()))
    return lambda name: (lm, engine)


def cli(task, out, *extra, engine=None, limit=3):
    argv = [task, "--model", "fake-model", "--spec", "visual=calibquant:bits=1", "--out", str(out),
            "--limit", str(limit), "--quiet", *extra]
    if task in DATA:
        argv += ["--data", str(DATA[task])]
    return run.main(argv, loader=loader(engine or FakeEngine()))


TEXT_ARGS = {"perplexity": ["--context", "64"], "needle": ["--contexts", "200,400", "--depths", "0.5"],
             "agreement": ["--prompt-tokens", "32", "--num-prompts", "4"]}


@pytest.mark.parametrize("task", ["coco_caption", "docvqa", "mmbench_video", "perplexity", "needle", "agreement"])
def test_every_task_writes_table_config_and_samples(task, tmp_path):
    assert cli(task, tmp_path, *TEXT_ARGS.get(task, [])) == 0
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["specs"][0] == "fp16" and cfg["synthetic"] == "random weights"
    assert {"versions", "device", "date", "git_commit"} <= set(cfg)
    md = (tmp_path / "results.md").read_text()
    assert "SYNTHETIC: random weights" in md
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [r["method"] for r in rows] == ["Baseline", "calibquant"] and [r["bits"] for r in rows] == ["16", "1"]
    assert all(r["synthetic"] == "random weights" for r in rows)
    lines = (tmp_path / "samples" / "fp16.jsonl").read_text().splitlines()
    assert 1 <= len(lines) <= 3 and "timeline" not in lines[0]


def test_resume_after_interruption_runs_only_missing_samples(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        cli("docvqa", tmp_path, engine=FakeEngine(crash_after=4), limit=3)
    # fp16 finished (3), one calibquant sample finished before the crash
    assert len((tmp_path / "samples" / "fp16.jsonl").read_text().splitlines()) == 3
    # a torn final line (killed mid-write) must not break the resume
    spec_file = next(p for p in (tmp_path / "samples").iterdir() if p.name != "fp16.jsonl")
    with spec_file.open("a") as f:
        f.write('{"id": "torn')
    engine = FakeEngine()
    assert cli("docvqa", tmp_path, engine=engine, limit=3) == 0
    assert engine.calls == 2
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [r["n"] for r in rows] == ["3", "3"]


def test_sharded_runs_merge_into_the_single_process_table(tmp_path):
    # docvqa: the merge is task-agnostic, and this keeps the test free of Java start-up time
    assert cli("docvqa", tmp_path / "single", limit=5) == 0
    for i in range(2):
        assert cli("docvqa", tmp_path / f"s{i}", "--shard", f"{i}/2", limit=5) == 0
    merge.merge(tmp_path / "merged", [tmp_path / "s0", tmp_path / "s1"])
    single = (tmp_path / "single" / "results.csv").read_text()
    assert (tmp_path / "merged" / "results.csv").read_text() == single
    assert single.count("\n") == 3
    md = lambda p: (p / "results.md").read_text().split("Notes:")[0]  # noqa: E731
    assert md(tmp_path / "merged") == md(tmp_path / "single")


def test_fraction_and_limit_select_evenly_spaced_samples():
    samples = [{"id": str(i)} for i in range(10)]
    assert [s["id"] for _, s in run.select(samples, 0.3, None, None)] == ["0", "3", "6"]
    assert [i for i, _ in run.select(samples, None, 4, (1, 2))] == [1, 3]


class _Judge(http.server.BaseHTTPRequestHandler):
    requests: list = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Judge.requests.append(body)
        user = body["messages"][-1]["content"]
        reply = "3" if "Candidate answer: a cat on a table" in user else "Score: 1"
        payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_mmbench_video_infer_only_then_judge_over_http(tmp_path, judge_server):
    assert cli("mmbench_video", tmp_path, "--infer-only") == 0
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert rows[0]["Overall"] == "" and "no judge given" in (tmp_path / "results.md").read_text()
    engine = FakeEngine()
    assert cli("mmbench_video", tmp_path, "--judge-url", judge_server, "--judge-model", "fake-judge",
               engine=engine) == 0
    assert engine.calls == 0  # predictions reused, only judged
    assert len(_Judge.requests) == 6 and _Judge.requests[0]["model"] == "fake-judge"
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert float(rows[0]["Overall"]) == 3.0 and float(rows[1]["Overall"]) == 1.0
    assert rows[0]["judged"] == "3"
    assert "judge: fake-judge via http://127.0.0.1" in (tmp_path / "results.md").read_text()
