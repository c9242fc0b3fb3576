"""mmkv-eval / python -m eval.run: run one benchmark task for several cache specs with one model load.

    mmkv-eval coco_caption --model llava-hf/llava-1.5-7b-hf --spec "visual=calibquant:bits=1" --limit 100 --out runs/coco

The FP16 baseline ("fp16") always runs first and every spec is compared with it. Per-sample records are appended
to OUT/samples/*.jsonl, so rerunning the same command resumes where it stopped. --shard I/N runs every N-th sample
(data parallel by hand: one process per GPU, then `python -m eval.merge`). Under `accelerate launch -m eval.run ...`
each process takes its shard from the launch and the main process merges (eval/distributed.py).
--device-map auto shards one model over several GPUs (mmkv/models/sharding.py).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from mmkv.models.sharding import DEVICE_MAPS

from . import distributed
from .merge import merge
from .registry import TASKS
from .report import write_tables
from .results import ResultStore
from .runtime import Runtime, environment


def canonical_spec(text: str) -> str:
    """One spelling per spec, so resumes and tables do not depend on how a spec was typed."""
    if text.strip().lower() in ("", "fp16"):
        return "fp16"
    from mmkv.spec import CacheSpec

    spec = CacheSpec.parse(text)
    return "fp16" if spec.is_fp16 else str(spec)


def select(samples: list[dict], fraction: float | None, limit: int | None, shard: tuple[int, int] | None):
    """Evenly spaced fraction of the data, then the first `limit`, then this shard's share; as (idx, sample)."""
    picks = samples
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise ValueError(f"--fraction must be in (0, 1], got {fraction}")
        k = max(1, math.ceil(fraction * len(samples)))
        picks = [samples[i * len(samples) // k] for i in range(k)]
    if limit is not None:
        picks = picks[:limit]
    indexed = list(enumerate(picks))
    if shard is not None:
        i, n = shard
        indexed = indexed[i::n]
    return indexed


def _shard(text: str) -> tuple[int, int]:
    i, _, n = text.partition("/")
    if not (i.isdigit() and n.isdigit() and 0 <= int(i) < int(n)):
        raise argparse.ArgumentTypeError(f"--shard wants I/N with 0 <= I < N, got {text!r}")
    return int(i), int(n)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmkv-eval", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="task", required=True, metavar="TASK")
    for name, task in TASKS.items():
        p = sub.add_parser(name, help=task["title"], description=f"{task['title']} ({task['paper']})")
        p.add_argument("--model", required=True, help="model name (mmkv.available_models()), hub id or folder")
        p.add_argument("--spec", action="append", default=[], help='cache spec, repeatable, e.g. '
                       '"visual=calibquant:bits=1 text=kivi:bits=2"; fp16 always runs first')
        p.add_argument("--out", required=True, help="run folder (resumes if it exists)")
        p.add_argument("--data", help="local copy of the data (see the task README); default: the hub")
        p.add_argument("--limit", type=int, help="at most N samples")
        p.add_argument("--fraction", type=float, help="evenly spaced fraction of the samples, e.g. 0.1")
        p.add_argument("--max-new-tokens", type=int, default=task["defaults"]["max_new_tokens"])
        p.add_argument("--shard", type=_shard, help="I/N: run only every N-th sample starting at I "
                       "(set by itself under accelerate launch)")
        p.add_argument("--device-map", choices=DEVICE_MAPS, help="shard the model over several GPUs "
                       "(auto: accelerate's balanced plan; layers: equal decoder layers per GPU)")
        p.add_argument("--max-memory", help='per-GPU limit for --device-map, e.g. "0=70GiB,1=70GiB"')
        p.add_argument("--quiet", action="store_true")
        for flags, kwargs in task["options"]:
            p.add_argument(*flags, **kwargs)
    return parser


def check_model(rt: Runtime, task: dict) -> None:
    adapter = rt.lm.adapter
    need = task["needs"]
    if need == "images" and not getattr(adapter, "takes_images", False):
        raise ValueError(f"{rt.model_name} takes no images; this task needs a vision-language model")
    if need == "video" and not getattr(adapter, "takes_video", False):
        raise ValueError(f"{rt.model_name} takes no video; this task needs a video-capable model")


def run(opts: dict, loader=None, log=print) -> ResultStore:
    task = TASKS[opts["task"]]
    store = ResultStore(opts["out"])
    specs = list(dict.fromkeys(["fp16", *(canonical_spec(s) for s in opts["spec"])]))
    rt = Runtime(opts["model"], opts, loader)
    chosen = select(task["load"](opts, rt), opts.get("fraction"), opts.get("limit"), opts.get("shard"))
    ids = {s["id"] for _, s in chosen}
    checked = False
    for spec in specs:
        done = store.records(spec)
        pending = [(i, s) for i, s in chosen if s["id"] not in done]
        for k, (idx, sample) in enumerate(pending):
            if not checked:  # before the first sample, so a text model on an image task fails at once
                check_model(rt, task)
                checked = True
            try:
                rec = task["run"](rt, sample, spec, opts)
            except ValueError as e:  # bad sample (unreadable image, too long...): record it, keep going
                rec = {"error": f"{type(e).__name__}: {e}"}
            rec.update(id=sample["id"], idx=idx, spec=spec)
            store.append(spec, rec)
            if not opts.get("quiet"):
                shown = rec.get("error") or rec.get("prediction", f"nll={rec.get('nll')}")
                log(f"[{opts['task']}] {spec} {k + 1}/{len(pending)} {sample['id']}: {str(shown)[:70]!r}")
    if task.get("post"):
        task["post"](rt, store, specs, ids, opts, log=log)
    prev = store.read_config() or {}
    if rt.loaded or prev.get("model") != opts["model"]:
        synthetic = getattr(rt.lm.adapter, "synthetic", None)
    else:  # nothing ran: keep the label recorded when the model was last loaded for this folder
        synthetic = prev.get("synthetic")
    config = {"task": opts["task"], "model": opts["model"], "synthetic": synthetic, "specs": specs,
              "options": {k: v for k, v in opts.items() if k != "shard"}, "shard": opts.get("shard"),
              "samples": len(chosen), **environment()}
    store.write_config(config)
    write_tables(store.out, config, ids)
    return store


def main(argv: list[str] | None = None, loader=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    opts = vars(args)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    try:
        if opts.get("max_memory") and not opts.get("device_map"):
            raise ValueError("--max-memory only applies with --device-map")
        ctx = distributed.context()  # None unless started by accelerate launch / torchrun with several processes
        if ctx is not None:
            try:
                code = distributed.run_sharded(opts, ctx, run, merge, loader=loader,
                                               log=lambda *a: print(*a, file=sys.stderr, flush=True))
            finally:
                ctx.close()
            if code == 0 and ctx.is_main:
                print((Path(opts["out"]) / "results.md").read_text())
            return code
        store = run(opts, loader=loader, log=log)
    except (ValueError, ImportError, FileNotFoundError) as e:
        print(f"mmkv-eval: error: {e}", file=sys.stderr)
        return 2
    print((store.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
