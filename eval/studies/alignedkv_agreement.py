"""Greedy-output agreement of AlignedKV with an exact fp16 cache (the paper's Table 3 claim, measured).

``--prompts`` WikiText-2 *test* windows of ``--prompt-tokens`` tokens (consecutive, non-overlapping) are
prefilled together (exact attention), then ``--new-tokens`` tokens are decoded greedily, every decode step
reading the cache through ``kernels.decode_attention`` (on CPU: ``reference.decode_reference``, i.e. the
precision-aligned read of ``reference.aligned_attention``). Specs compared (window=0, sinks=0, so that every token
older than one block is in the AlignedKV segment):

* ``alignedkv:min_bits=16``: fp16 storage read in full, the exact fp16 cache (the reference);
* ``alignedkv``: the precision-aligned read (Rule 1 keys, the authors' value rule ``values=paper``); with
  ``--conservative`` also ``alignedkv:values=conservative`` (mmkv's earlier value rule), with ``--keys-only`` also
  ``alignedkv:values=full`` (Rule 1 keys, V read in full);
* ``fp16``: the plain cache in the model's dtype (fp32 on CPU), to show what fp16 storage itself changes.

Reported per spec against the reference: prompts whose whole continuation is identical, mean length of the
identical prefix, and the share of positions with the same token.

    python -m eval.studies.alignedkv_agreement --prompts 20 --prompt-tokens 256 --new-tokens 32 --out results/agree.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from mmkv.cache import MMKVCache, cache_kwargs

from ..jsonout import save_json
from .common import prompts

REFERENCE = "text=alignedkv:min_bits=16 window=0 sinks=0"
SPECS = (REFERENCE, "text=alignedkv window=0 sinks=0", "fp16")
KEYS_ONLY = "text=alignedkv:values=full window=0 sinks=0"
CONSERVATIVE = "text=alignedkv:values=conservative window=0 sinks=0"


@torch.inference_mode()
def greedy(model, adapter, ids: torch.Tensor, spec: str, new_tokens: int) -> torch.Tensor:
    cache = MMKVCache.for_model(spec, adapter)
    b, p = ids.shape
    pos = torch.arange(p)[None].expand(b, -1)
    logits = model(input_ids=ids, position_ids=pos, **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
    out = []
    for step in range(new_tokens):
        nxt = logits.argmax(-1)
        out.append(nxt)
        if step + 1 == new_tokens:
            break
        pos = torch.full((b, 1), p + step, dtype=torch.long)
        logits = model(input_ids=nxt[:, None], position_ids=pos, **cache_kwargs(model, cache),
                       use_cache=True).logits[:, -1]
    return torch.stack(out, 1)


def agreement(a: torch.Tensor, ref: torch.Tensor) -> dict:
    same = a == ref
    prefix = same.long().cumprod(1).sum(1).float()
    return {"identical": int(same.all(1).sum()), "prompts": a.shape[0], "mean_prefix": prefix.mean().item(),
            "token_match": same.float().mean().item(),
            "first_divergence": [int(x) if x < a.shape[1] else None for x in prefix.long().tolist()]}


def run(lm, n_prompts: int, prompt_tokens: int, new_tokens: int, specs=SPECS) -> dict:
    model, processor, adapter = lm
    tok = getattr(processor, "tokenizer", processor)
    ids = prompts(tok, n_prompts, prompt_tokens)
    outs, rows = {}, []
    for spec in specs:
        t0 = time.perf_counter()
        outs[spec] = greedy(model, adapter, ids, spec, new_tokens)
        print(f"{spec:50s} {time.perf_counter() - t0:6.1f} s", flush=True)
    for spec in specs:
        if spec != REFERENCE:
            rows.append({"spec": spec, **agreement(outs[spec], outs[REFERENCE])})
    samples = [{"prompt_tail": tok.decode(ids[i, -24:]), **{s: tok.decode(outs[s][i]) for s in specs}}
               for i in range(min(3, n_prompts))]
    return {"reference": REFERENCE, "prompts": n_prompts, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "rows": rows, "samples": samples}


def format_table(res: dict) -> str:
    out = [f"Greedy agreement with `{res['reference']}` (exact fp16 cache), {res['prompts']} WikiText-2 test prompts "
           f"x {res['prompt_tokens']} tokens, {res['new_tokens']} new tokens",
           "| spec | identical continuations | mean identical prefix (tokens) | same token at a position |",
           "|---|---:|---:|---:|"]
    for r in res["rows"]:
        out.append(f"| `{r['spec']}` | {r['identical']}/{r['prompts']} | {r['mean_prefix']:.1f} | "
                   f"{100 * r['token_match']:.1f}% |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--keys-only", action="store_true", help=f"also run {KEYS_ONLY!r}")
    ap.add_argument("--conservative", action="store_true", help=f"also run {CONSERVATIVE!r}")
    ap.add_argument("--no-model-dtype", action="store_true", help="skip the plain `fp16` (model dtype) cache")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import mmkv

    t0 = time.perf_counter()
    lm = mmkv.load_model(args.model, device="cpu")
    specs = tuple(s for s in SPECS if not (args.no_model_dtype and s == "fp16")) + ((KEYS_ONLY,) if args.keys_only else ())
    specs += (CONSERVATIVE,) if args.conservative else ()
    res = run(lm, args.prompts, args.prompt_tokens, args.new_tokens, specs)
    res["model"], res["seconds"] = args.model, time.perf_counter() - t0
    print(format_table(res))
    save_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
