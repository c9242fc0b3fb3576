"""Where a training step of ``eval.train.towers`` spends its time (the step is the trainer's own: same batches, same
model, same loss), for deciding what to speed up.

    python -m eval.train.step_profile --model demo-llava --compile off --steps 30 --out prof_llava_eager.json

Three passes over consecutive steps of the training stream, after ``--warmup`` steps (which also cover every step
mode, so compiled graphs exist before timing): ``free`` runs ``--steps`` steps as the trainer does (no host syncs
but the one every 10 steps) and gives rows/s; ``sections`` runs them again with a device sync after each section
(data wait, host-to-device copy, forward + loss, backward, optimizer) and gives milliseconds per section and mode;
``kernels`` (``--kernels N``) records N steps with the torch profiler and lists the kernels that took most device
time. Also counted: tokens per step and the share of them that is padding. ``--data-only N`` times the data
pipeline alone (synthesis, processor, tokenizer) in rows/s per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import torch

from eval.train import pack, towers
from eval.train.rows import parse_mix


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def profile(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model, processor, adapter = towers.build(args.model, device, towers.config_for(args.model))
    if args.attention == "flex":
        pack.use_flex(model, device)
    compiled = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    if compiled:
        towers.compile_layers(model)
    params = towers.trainable(model)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=device.type == "cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    total = args.warmup + 2 * args.steps + args.kernels
    ds = towers.Steps(args.model, adapter, processor, args.batch, args.start + total, mix=parse_mix(args.mix),
                      pack=args.pack, positions=args.positions)
    it = iter(towers.loader(ds, args.start, args.workers, pin=device.type == "cuda"))

    def step(timer=None):
        t = time.perf_counter()
        batch = next(it)
        step_no = int(batch.pop("step"))
        answers = int(batch.pop("answers", batch["input_ids"].shape[0]))
        marks = [("data", time.perf_counter() - t)]

        def mark(name):
            nonlocal t
            if timer is not None:
                _sync(device)
                now = time.perf_counter()
                marks.append((name, now - t))
                t = now

        t = time.perf_counter()
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        mark("h2d")
        with autocast:
            loss = towers.answer_loss(model, batch)
        mark("forward")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        mark("backward")
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        mark("optimizer")
        if timer is not None:
            mode = towers.step_mode(step_no, args.model)
            for name, s in marks:
                timer[mode][name].append(s)
            real_tokens = batch["seg"] >= 0 if "seg" in batch else batch["attention_mask"]
            n_tok, real = real_tokens.numel(), int(real_tokens.sum())
            timer[mode]["tokens"].append(n_tok)
            timer[mode]["pad_share"].append(1 - real / n_tok)
        return loss, batch["input_ids"].shape[0], answers

    t0, first_losses = time.perf_counter(), []
    for i in range(args.warmup):
        loss = step()[0]
        if i < 5:  # same stream, same init: two --attention runs must start on the same losses
            first_losses.append(round(loss.item(), 5))
    _sync(device)
    out = {"model": args.model, "compiled": compiled, "batch": args.batch, "warmup_s": time.perf_counter() - t0,
           "first_losses": first_losses, "attention": args.attention,
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}
    t0, rows, answers = time.perf_counter(), 0, 0
    for i in range(args.steps):
        loss, r, a = step()
        rows, answers = rows + r, answers + a
        if i % 10 == 9:
            loss.item()
    _sync(device)
    dt = time.perf_counter() - t0
    out["free"] = {"steps": args.steps, "rows_per_s": rows / dt, "answers_per_s": answers / dt,
                   "ms_per_step": 1e3 * dt / args.steps}
    timer = defaultdict(lambda: defaultdict(list))
    for _ in range(args.steps):
        step(timer)
    out["sections_ms"] = {mode: {"steps": len(v["data"]), **{k: round(1e3 * sum(x) / len(x), 2) for k, x in v.items()
                                                              if k not in ("tokens", "pad_share")},
                                 "tokens": round(sum(v["tokens"]) / len(v["tokens"])),
                                 "pad_share": round(sum(v["pad_share"]) / len(v["pad_share"]), 3)}
                          for mode, v in timer.items()}
    if args.kernels:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch_profile(activities=acts) as prof:
            for _ in range(args.kernels):
                step()
            _sync(device)
        key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        out["kernels"] = prof.key_averages().table(sort_by=key, row_limit=args.top, max_name_column_width=70)
    return out


def bench_data(model: str, n: int, workers: int) -> dict:
    """Items/s of the data pipeline alone (synthesis + processor + tokenizer), per mode."""
    from mmkv.models.demo import load_demo

    _, processor, adapter = load_demo(model, "cpu", torch.float32, tower_dir="random")
    out = {}
    for mode in ("image", "tiled", "clip") if model == "demo-internvl" else ("image", "clip"):
        steps = [s for s in range(100000) if towers.step_mode(s, model) == mode][:n]
        rows = towers.rows_for(mode, 8, adapter.default_video_frames)
        ds = towers.Steps(model, adapter, processor, 8, 100000)
        t0 = time.perf_counter()
        if workers == 0:
            for s in steps:
                ds[s]
        else:
            for _ in torch.utils.data.DataLoader(torch.utils.data.Subset(ds, steps), batch_size=None,
                                                 num_workers=workers, worker_init_fn=towers._worker_init):
                pass
        dt = time.perf_counter() - t0
        out[mode] = {"rows_per_s": len(steps) * rows / dt, "steps": len(steps), "rows_per_step_at_batch_8": rows}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.train.step_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo-llava", choices=["demo-llava", "demo-internvl"])
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30, help="steps in each of the free and sectioned passes")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--start", type=int, default=0, help="first step of the training stream to draw")
    ap.add_argument("--kernels", type=int, default=0, help="steps recorded with the torch profiler (0: none)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--workers", type=int, default=min(7, (os.cpu_count() or 2) - 1))
    ap.add_argument("--data-only", type=int, default=0, metavar="N",
                    help="time the data pipeline alone (no model step) over N steps of each mode, batch 8, and exit")
    ap.add_argument("--pack", action="store_true", help="packed rows, as the trainer's --pack")
    ap.add_argument("--positions", action="store_true", help="with --pack: the trainer's --positions")
    ap.add_argument("--mix", default=None, help="image steps' kinds, as the trainer's --mix")
    ap.add_argument("--attention", choices=["sdpa", "flex"], default="sdpa", help="as the trainer's --attention")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.data_only:
        print(json.dumps(bench_data(args.model, args.data_only, args.workers), indent=1))
        return 0
    if args.steps < 1 or args.warmup < 0 or args.kernels < 0:
        ap.error("--steps must be >= 1, --warmup and --kernels >= 0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = profile(args)
    text = json.dumps({k: v for k, v in out.items() if k != "kernels"}, indent=1)
    print(text)
    if "kernels" in out:
        print(out["kernels"])
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
