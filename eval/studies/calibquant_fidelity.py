"""CalibQuant fidelity on a real model (CalibQuant Fig. 1-2): does pre-softmax calibration lower the error?

A span of wikitext-2 text is treated as if it were visual: its K/V (after RoPE) are quantized channel-wise to
``bits`` per CalibQuant Sec. 2.1; the queries of the following tokens attend to it. Per layer, averaged over heads
and queries, we report

* ``mse_quant`` / ``mse_calib``: MSE of softmax(qK^T/sqrt(d)) over the span, quantized vs exact, without and with
  calibration g(x) (Sec. 2.3);
* ``out_err_quant`` / ``out_err_calib``: relative error ||o - o_exact|| / ||o_exact|| of the attention output
  softmax(.)V over the span, V quantized as well.

    python -m eval.studies.calibquant_fidelity --span 1024 --queries 64 --bits 1 --out results/fidelity.json
    python -m eval.studies.calibquant_fidelity --bits 1 --clip off --clip authors   # range clipping compared

``--clip``: ``off``, ``authors`` (the released code's constants, ``clip=authors``) or ``K/V`` factors (``0.5/0.3``).

The model is the real ``smollm2-135m``: these are real measurements (no random weights).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kernels.layouts import ChannelSeg, DenseSeg
from kernels.reference import attention_over_segments, segment_logits
from mmkv.cache import cache_kwargs
from mmkv.methods import CalibQuant

from ..jsonout import save_json
from .common import wikitext_test


def capture_queries(model, ids: torch.Tensor):
    """Run ``ids`` once; return the DynamicCache (post-RoPE K/V per layer) and each layer's post-RoPE queries."""
    queries: dict[int, torch.Tensor] = {}
    hooks = []
    for idx, layer in enumerate(model.model.layers):
        attn = layer.self_attn

        def hook(mod, args, kwargs, idx=idx):
            h = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            q = mod.q_proj(h).view(*h.shape[:-1], -1, mod.head_dim).transpose(1, 2)
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
            queries[idx] = q.detach()

        hooks.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
    cache = DynamicCache(config=model.config)
    try:
        with torch.inference_mode():
            model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    return cache, queries


def clip_params(clip: str) -> dict:
    """CalibQuant keyword arguments of a ``--clip`` value: ``off``, ``authors`` or ``K/V`` factors."""
    if clip in ("off", "authors"):
        return {"clip": clip}
    ck, _, cv = clip.partition("/")
    return {"clip": "manual", "clip_k": float(ck), "clip_v": float(cv or ck)}


def layer_errors(q, k, v, bits: int, tau1: float, tau2: float, clip: str = "off") -> dict:
    """Errors of one layer: ``q [1, Hq, M, D]`` against the span ``k, v [1, H, N, D]``."""
    lens = torch.tensor([k.shape[2]])
    exact = DenseSeg(k, v, lens)
    seg = CalibQuant(bits=bits, tau1=tau1, tau2=tau2, calib_max_bits=8, **clip_params(clip)).quantize(k, v, lens)
    plain = ChannelSeg(**{**seg.__dict__, "calib": None})
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = {}
    x_exact, _, _ = segment_logits(q, exact, scale)
    p_exact = torch.softmax(x_exact, -1)
    o_exact, _ = attention_over_segments(q, [exact], scale)
    for name, s in (("quant", plain), ("calib", seg)):
        x, _, _ = segment_logits(q, s, scale)
        out[f"mse_{name}"] = torch.mean((torch.softmax(x, -1) - p_exact) ** 2).item()
        o, _ = attention_over_segments(q, [s], scale)
        out[f"out_err_{name}"] = ((o - o_exact).norm() / o_exact.norm()).item()
    return out


def run(model, tok, span: int, n_queries: int, bits: int, tau1: float, tau2: float, prefix: int = 32,
        offset: int = 0, clip: str = "off") -> dict:
    """``prefix`` text tokens precede the span (as a system prompt precedes an image): the first tokens are the
    model's attention sinks, with outlier K/V that mmkv keeps in fp16 and that must not set the span's ranges."""
    text = wikitext_test().read_text(encoding="utf-8")
    total = prefix + span + n_queries
    ids = tok(text[offset : offset + 40 * total], return_tensors="pt").input_ids
    ids = ids[:, :total].to(model.device)
    if ids.shape[1] < total:
        raise ValueError("not enough text for the requested span and queries")
    cache, queries = capture_queries(model, ids)
    rows = []
    for idx, layer in enumerate(cache.layers):
        k = layer.keys[:, :, prefix : prefix + span].float()
        v = layer.values[:, :, prefix : prefix + span].float()
        q = queries[idx][:, :, prefix + span :].float()
        rows.append({"layer": idx, **layer_errors(q, k, v, bits, tau1, tau2, clip)})
    mean = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0] if key != "layer"}
    better = sum(r["mse_calib"] < r["mse_quant"] for r in rows)
    return {"prefix": prefix, "span": span, "queries": n_queries, "bits": bits, "tau1": tau1, "tau2": tau2,
            "clip": clip, "layers": rows,
            "mean": mean, "layers_where_calibration_lowers_mse": better, "n_layers": len(rows)}


def format_table(res: dict) -> str:
    lines = [f"CalibQuant {res['bits']}-bit fidelity, span {res['span']} tokens after {res['prefix']} prefix tokens, "
             f"{res['queries']} queries, "
             f"tau1={res['tau1']} tau2={res['tau2']} clip={res.get('clip', 'off')}",
             "| layer | softmax MSE quant | softmax MSE quant+calib | out rel.err quant | out rel.err quant+calib |",
             "|---:|---:|---:|---:|---:|"]
    for r in res["layers"] + [{"layer": "mean", **res["mean"]}]:
        lines.append(f"| {r['layer']} | {r['mse_quant']:.3e} | {r['mse_calib']:.3e} | {r['out_err_quant']:.3f} | "
                     f"{r['out_err_calib']:.3f} |")
    lines.append(f"calibration lowers the softmax MSE in {res['layers_where_calibration_lowers_mse']} of "
                 f"{res['n_layers']} layers")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--span", type=int, default=1024)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=32)
    ap.add_argument("--bits", type=int, default=1)
    ap.add_argument("--tau1", type=float, default=0.0)
    ap.add_argument("--tau2", type=float, default=3.0)
    ap.add_argument("--clip", action="append", help="off (default), authors, or K/V factors such as 0.5/0.3; "
                    "repeat to compare several in one run")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import mmkv

    model, tok, _ = mmkv.load_model(args.model, dtype=torch.float32)
    tok = getattr(tok, "tokenizer", tok)
    results = []
    for clip in args.clip or ["off"]:
        res = run(model, tok, args.span, args.queries, args.bits, args.tau1, args.tau2, args.prefix, clip=clip)
        print(format_table(res))
        results.append(res)
    save_json(args.out, results[0] if len(results) == 1 else results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
