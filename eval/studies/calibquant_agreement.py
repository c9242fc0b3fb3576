"""Greedy agreement of CalibQuant with an fp16 cache on a real model, a span of text routed as if visual.

Each of ``--prompts`` WikiText-2 *test* windows is ``--prefix`` text tokens, a ``--span`` of tokens marked visual
(``MMKVCache.set_inputs(visual_mask=...)``: they go to the CalibQuant segment as an image's tokens would) and
``--tail`` text tokens; the prompt is prefilled (exact attention), then ``--new-tokens`` tokens are decoded
greedily, every decode step reading the quantized span. Each configuration (bits x clip x calibration) is compared
with the same run on an fp16 cache: prompts whose whole continuation is identical, mean identical prefix, share of
positions with the same token; and, teacher-forced (the fp16 run's tokens fed back, so one early flip does not
decide every later position), the share of steps whose next-token argmax equals the fp16 run's.

    python -m eval.studies.calibquant_agreement --bits 1 --bits 2 --clip off --clip authors --out results/cq_agree.json

The model is the real ``smollm2-135m`` (CPU, fp32): real measurements, no random weights.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from mmkv.cache import MMKVCache, cache_kwargs
from mmkv.methods import CalibQuant

from ..jsonout import save_json
from .alignedkv_agreement import agreement
from .calibquant_fidelity import clip_params
from .common import prompts

TAIL = "window=16 sinks=4"


def spec_of(bits: int, clip: str, calibrate: bool) -> str:
    params = {"bits": bits, "calibrate": str(calibrate).lower(), **clip_params(clip)}
    return "visual=calibquant:" + ",".join(f"{k}={v}" for k, v in params.items()) + " " + TAIL


@torch.inference_mode()
def greedy(model, adapter, ids: torch.Tensor, visual: torch.Tensor, spec: str, new_tokens: int,
           forced: torch.Tensor | None = None) -> torch.Tensor:
    """Argmax tokens of ``new_tokens`` decode steps; with ``forced [B, new_tokens]`` those tokens are fed instead."""
    cache = MMKVCache.for_model(spec, adapter)
    b, p = ids.shape
    cache.set_inputs(visual_mask=visual)
    logits = model(input_ids=ids, position_ids=torch.arange(p)[None].expand(b, -1),
                   **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
    cache.finalize()
    out = []
    for step in range(new_tokens):
        out.append(logits.argmax(-1))
        if step + 1 == new_tokens:
            break
        nxt = out[-1] if forced is None else forced[:, step]
        pos = torch.full((b, 1), p + step, dtype=torch.long)
        logits = model(input_ids=nxt[:, None], position_ids=pos, **cache_kwargs(model, cache),
                       use_cache=True).logits[:, -1]
    return torch.stack(out, 1)


def run(lm, n_prompts: int, prefix: int, span: int, tail: int, new_tokens: int, bits_list, clips) -> dict:
    model, processor, adapter = lm
    tok = getattr(processor, "tokenizer", processor)
    ids = prompts(tok, n_prompts, prefix + span + tail)
    visual = torch.zeros(ids.shape, dtype=torch.bool)
    visual[:, prefix : prefix + span] = True
    ref_spec = "fp16 " + TAIL
    ref = greedy(model, adapter, ids, visual, ref_spec, new_tokens)
    rows = []
    for bits in bits_list:
        done = set()
        for clip in clips:
            factors = CalibQuant(bits=bits, **clip_params(clip)).clips
            if factors in done:  # e.g. clip=authors and 0.5/0.3 at 1 bit: the same quantizer
                continue
            done.add(factors)
            for calibrate in (False, True):
                spec = spec_of(bits, clip, calibrate)
                t0 = time.perf_counter()
                out = greedy(model, adapter, ids, visual, spec, new_tokens)
                forced = greedy(model, adapter, ids, visual, spec, new_tokens, forced=ref)
                print(f"{spec:70s} {time.perf_counter() - t0:6.1f} s", flush=True)
                rows.append({"bits": bits, "clip": clip, "clips": factors, "calibrate": calibrate, "spec": spec,
                             **agreement(out, ref), "forced_match": (forced == ref).float().mean().item()})
    return {"reference": ref_spec, "prompts": n_prompts, "prefix": prefix, "span": span, "tail": tail,
            "new_tokens": new_tokens, "rows": rows}


def format_table(res: dict) -> str:
    out = [f"Greedy agreement with `{res['reference']}`, {res['prompts']} WikiText-2 test prompts of {res['prefix']} "
           f"text + {res['span']} 'visual' + {res['tail']} text tokens, {res['new_tokens']} new tokens",
           "| bits | clip (K, V) | calibration | identical continuations | mean identical prefix | same token | "
           "next token, teacher-forced |",
           "|---:|---|---|---:|---:|---:|---:|"]
    for r in res["rows"]:
        out.append(f"| {r['bits']} | {r['clip']} {tuple(r['clips'])} | {'on' if r['calibrate'] else 'off'} | "
                   f"{r['identical']}/{r['prompts']} | {r['mean_prefix']:.1f} | {100 * r['token_match']:.1f}% | "
                   f"{100 * r['forced_match']:.1f}% |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=32)
    ap.add_argument("--span", type=int, default=512)
    ap.add_argument("--tail", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--bits", type=int, action="append")
    ap.add_argument("--clip", action="append", help="off, authors, or K/V factors such as 0.5/0.3 (repeatable)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import mmkv

    t0 = time.perf_counter()
    lm = mmkv.load_model(args.model, device="cpu")
    res = run(lm, args.prompts, args.prefix, args.span, args.tail, args.new_tokens, args.bits or [1],
              args.clip or ["off", "authors"])
    res["model"], res["seconds"] = args.model, time.perf_counter() - t0
    print(format_table(res))
    save_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
