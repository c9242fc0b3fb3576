"""SKVQ ablation ladder (arXiv:2405.06219 Table 3) as WikiText-2 test perplexity, fast on a CPU.

Rungs, for each bit/group setting (``--settings k2v2-g128,k2v1.5-g64``): RTN (per-token groups, natural order, no
window, no sinks) -> + window-128 -> + group clipping -> + channel reorder -> + attention sinks (5) -> + FP8 scales.
Tokens leave the window one at a time (``block=1``), as Algorithm 1 does; ``--default-block`` adds the runtime
default (32 at a time) as a last row.

Why it is fast and still exact. ``Engine.score(chunk=1)`` (eval/studies/ppl.py) feeds one token per step through the
real cache: ~1 s per step here, hours for a ladder. SKVQ quantizes every token on its own (per-token groups;
scales, zeros, clipping ratios and permutations depend only on that token and the artifact), so the cache entry of
token ``j`` is the same whenever it is quantized; what changes with the step ``i`` is only *whether* ``j`` is
already quantized. That is a fixed function of (i, window, sinks, block), emulated here from the cache's own flush
rule. So one teacher-forced forward whose attention uses, for query ``i`` and key ``j``, the dequantized entry where
the cache at step ``i`` would hold codes and the fp entry elsewhere, computes exactly what token-by-token decoding
computes (same quantizer, same reference dequantizer). ``--check N`` compares both on the first N tokens of each
window; tests/test_skvq_study.py does so on a tiny random model.

    python -m eval.studies.skvq --model smollm2-135m --artifact DIR --windows 4 --context 1024 \
        --settings k2v2-g128,k2v1.5-g64,k2v2-g32 --out results/skvq_ladder.json
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kernels.reference import dequantize_segment
from mmkv.cache import segments as S
from mmkv.spec import CacheSpec

from ..jsonout import save_json
from .ppl import windows

SIM = "mmkv_skvq_sim"
_STATE: dict = {}


def quantized_counts(t: int, window: int, sinks: int, block: int) -> list[int]:
    """Tokens held as codes when step ``i`` attends (MMKVLayer's flush rule under ``Engine.score(chunk=1)``): the
    first step is a prefill (attention before routing), later steps append, flush, then attend."""
    dense, moved, out = 0, 0, []
    for i in range(t):
        dense += 1
        m = max(dense - min(sinks, dense) - window, 0) // block * block
        if i == 0:
            out.append(moved)
        if m and (i == 0 or dense - min(sinks, dense) >= window + block):
            moved += m
            dense -= m
        if i > 0:
            out.append(moved)
    return out


def _mixed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """Causal attention where key/value ``j`` is read dequantized for the queries at whose step it is stored as codes."""
    st = _STATE
    method = st["layers"][module.layer_idx]
    b, hq, t, d = query.shape
    h = key.shape[1]
    seg = method.quantize(key, value, torch.full((b,), t, dtype=torch.int32))
    kq, vq = dequantize_segment(seg)
    if module.layer_idx == 0:
        st["seg"] = seg
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    qmask = st["qmask"][:t, :t]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    out = torch.empty(b, hq, t, d, dtype=torch.float32)
    for row in range(b):  # one row at a time keeps the [Hq, T, T] temporaries small
        q = query[row].float().view(h, hq // h, t, d)
        x_fp = q @ key[row].float()[:, None].transpose(-1, -2)
        x_q = q @ kq[row][:, None].transpose(-1, -2)
        x = torch.where(qmask, x_q, x_fp).mul_(scale).masked_fill_(~causal, float("-inf"))
        p = torch.softmax(x, dim=-1)
        o = (p * ~qmask) @ value[row].float()[:, None] + (p * qmask) @ vq[row][:, None]
        out[row] = o.reshape(hq, t, d)
    return out.transpose(1, 2).to(query.dtype), None


@torch.inference_mode()
def score(model, adapter, ids: torch.Tensor, spec: str) -> dict:
    """NLL of ``ids [B, T]`` under ``spec`` with the cache's quantized/fp split emulated exactly (module doc)."""
    parsed = CacheSpec.parse(spec)
    method = parsed.text.bind(adapter)
    b, t = ids.shape
    counts = quantized_counts(t, parsed.window, parsed.sinks, method.flush_block)
    j = torch.arange(t)
    qn = torch.tensor(counts)
    qmask = (j[None, :] >= parsed.sinks) & (j[None, :] < parsed.sinks + qn[:, None])
    _STATE.clear()
    _STATE.update(layers=[method.for_layer(i, adapter.num_layers) for i in range(adapter.num_layers)], qmask=qmask)
    AttentionInterface.register(SIM, _mixed_attention)
    AttentionMaskInterface.register(SIM, sdpa_mask)
    cfg = adapter.lm_config
    previous = cfg._attn_implementation
    cfg._attn_implementation = SIM
    try:
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    finally:
        cfg._attn_implementation = previous
    nll = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
    n = ids[:, 1:].numel()
    seg = _STATE["seg"]
    text_bits = 8.0 * S.used_nbytes(seg, [t] * b) / (b * t * 2 * adapter.num_kv_heads * adapter.head_dim)
    q_end = counts[-1]
    total_bits = (text_bits * q_end + 16.0 * (t - q_end)) / t
    return {"nll": nll, "tokens": n, "ppl": math.exp(nll / n), "text_bits": text_bits, "total_bits_fp16": total_bits,
            "quantized_at_end": q_end}


def ladder(kb: int, vb: float, group: int, artifact: str, window: int = 128, sinks: int = 5) -> list[tuple[str, str]]:
    base = f"text=skvq:k_bits={kb},v_bits={vb:g},group={group},block=1"
    art = f",artifact={artifact}" if artifact else ""
    return [
        ("RTN", f"{base},reorder=off,clip=off window=0 sinks=0"),
        (f"+ window-{window}", f"{base},reorder=off,clip=off window={window} sinks=0"),
        ("+ group clipping", f"{base},reorder=off{art} window={window} sinks=0"),
        ("+ channel reorder", f"{base}{art} window={window} sinks=0"),
        (f"+ attention sinks ({sinks})", f"{base}{art} window={window} sinks={sinks}"),
        ("+ FP8 (E4M3) scales", f"{base},fp8=true{art} window={window} sinks={sinks}"),
    ]


def parse_setting(text: str) -> tuple[int, float, int]:
    """``k2v1.5-g64`` -> (2, 1.5, 64)."""
    try:
        kv, g = text.strip().lower().split("-g")
        k, v = kv[1:].split("v")
        return int(k), float(v), int(g)
    except ValueError:
        raise ValueError(f"setting {text!r} is not like k2v1.5-g64") from None


def format_table(res: dict) -> str:
    out = [f"SKVQ ablation ladder (Table 3), WikiText-2 test, {res['label']}, {res['windows']} windows x "
           f"{res['context']} tokens, quantized/fp split of token-by-token decoding emulated exactly (block 1)",
           f"fp16 (parallel pass): PPL {res['fp16_ppl']:.3f}", "",
           "| setting | rung | PPL | quantized-token bits/elem (incl. scale/zero) | all tokens, fp16 window |",
           "|---|---|---:|---:|---:|"]
    for r in res["rows"]:
        out.append(f"| {r['setting']} | {r['rung']} | {r['ppl']:.3f} | {r['text_bits']:.3f} | "
                   f"{r['total_bits_fp16']:.2f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--artifact", default="", help="SKVQ artifact folder (default: the method's default folder)")
    ap.add_argument("--settings", default="k2v2-g128,k2v1.5-g64")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--sinks", type=int, default=5)
    ap.add_argument("--default-block", action="store_true", help="also the last rung with block=32")
    ap.add_argument("--spec", action="append", default=[], help="extra specs to score (any skvq/fp16 spec)")
    ap.add_argument("--check", type=int, default=0, help="also run Engine.score(chunk=1) on the first N tokens")
    ap.add_argument("--wikitext", type=Path, default=None)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import mmkv

    lm = mmkv.load_model(args.model, device="cpu")
    model, tok, adapter = lm
    ids = windows(getattr(tok, "tokenizer", tok), args.wikitext, args.windows, args.context)
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        fp16 = math.exp(F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).item())
    label = f"{args.model} ({model.dtype}, cpu)" + (f", {adapter.synthetic}" if adapter.synthetic else "")
    res = {"label": label, "windows": args.windows, "context": args.context, "fp16_ppl": fp16, "rows": []}
    print(f"fp16 parallel pass: PPL {fp16:.3f}", flush=True)
    jobs = []
    for setting in filter(None, args.settings.split(",")):
        kb, vb, g = parse_setting(setting)
        rungs = ladder(kb, vb, g, args.artifact, args.window, args.sinks)
        if args.default_block:
            rungs.append(("+ FP8, block 32 (runtime default)", rungs[-1][1].replace(",block=1", "")))
        jobs += [(setting, rung, spec) for rung, spec in rungs]
    jobs += [("extra", "-", spec) for spec in args.spec]
    for setting, rung, spec in jobs:
        t0 = time.perf_counter()
        row = {"setting": setting, "rung": rung, "spec": spec, **score(model, adapter, ids, spec),
               "seconds": time.perf_counter() - t0}
        if args.check:
            eng = mmkv.Engine(lm)
            ref = eng.score(ids[:, : args.check], spec=spec, chunk=1)
            sim = score(model, adapter, ids[:, : args.check], spec)
            row["check"] = {"tokens": args.check, "engine_nll": ref["nll"], "emulated_nll": sim["nll"]}
        res["rows"].append(row)
        print(f"{setting:12s} {rung:28s} ppl {row['ppl']:8.3f}  bits {row['text_bits']:.3f}  "
              f"({row['seconds']:.0f} s){'  check ' + str(row['check']) if 'check' in row else ''}", flush=True)
    print(format_table(res))
    save_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
