"""AQUA-KV measurements on CPU (issue 5): calibrate every config from one collection, then perplexity per spec.

    python -m eval.studies.aquakv calibrate --model smollm2-135m --bits 2,3,4 --quantizers uniform,hadamard \\
        --out results/aquakv
    python -m eval.studies.aquakv ppl --windows 4 --context 512 --out results/aquakv/ppl.json \\
        --spec "fp16 window=32" --spec "text=aquakv:bits=2 window=32" ...
    python -m eval.studies.aquakv table --out results/aquakv/ppl.json

``calibrate`` runs the model once over the calibration text (WikiText-2 valid) and fits Algorithm 1 for each
(bits, quantizer) into the folder the spec looks in by default; it prints the explained-variance probe (Sec. 3.1)
and the per-layer reconstruction errors. ``ppl`` scores WikiText-2 test windows with the cache maintained token by
token (``eval.studies.ppl.run``: ``Engine.score(chunk=1)``) and appends rows to ``--out`` (specs already there are
skipped, so the study can be run in slices). Rows carry the cache's true bits per element and, for AQUA-KV, the
predictors' bytes amortized over one sequence of ``--context`` tokens (the predictors are per model: one copy
serves every sequence, so their share per token falls with the context; the table also gives it at 8k and 128k).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mmkv.paths import wikitext
from mmkv.spec import CacheSpec

from .ppl import run as ppl_run
from .ppl import windows


def predictor_bytes(spec: str, adapter) -> int:
    text = CacheSpec.parse(spec).text
    return text.bind(adapter).predictor_nbytes() if text.name == "aquakv" else 0


def calibrate_all(args) -> int:
    import mmkv
    from mmkv.calibrate.aquakv import collect, error_table, fit, probe, probe_table
    from mmkv.methods.aquakv import AquaKV

    lm = mmkv.load_model(args.model)
    data = collect(lm, args.data, args.fraction, args.seq_len, args.max_tokens, args.sinks)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = probe(data["keys"], data["values"], data["train"], lm.adapter.head_dim)
    print("Explained variance ratio of linear probes on true K/V (Sec. 3.1, Fig. 2), holdout windows, "
          f"{lm.adapter.describe()}, {data['meta']}:")
    print(probe_table(rows), flush=True)
    (out / "probe.json").write_text(json.dumps({"model": lm.adapter.name, "calibration": data["meta"],
                                                "probe": rows}, indent=1))
    if args.probe_only:
        return 0
    reports = []
    for q in args.quantizers.split(","):
        for bits in (int(b) for b in args.bits.split(",")):
            cfg = AquaKV(bits=bits, quantizer=q)
            folder, rep = fit(lm, data, cfg, log=lambda *a: None, with_probe=False)
            reports.append({"folder": str(folder), **rep})
            print(f"\n{cfg.config()} -> {folder} ({rep['predictor_bytes']:,} predictor bytes)")
            print(error_table(rep["errors"]), flush=True)
    (out / "calibration.json").write_text(json.dumps(reports, indent=1))
    return 0


def ppl(args) -> int:
    import mmkv

    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.is_file() else {"rows": []}
    if doc["rows"] and (doc["windows"], doc["context"]) != (args.windows, args.context):
        raise SystemExit(f"{out} holds {doc['windows']} x {doc['context']}; use another --out")
    done = {r["spec"] for r in doc["rows"]}
    specs = [s for s in args.spec if s not in done]
    lm = mmkv.load_model(args.model)
    eng = mmkv.Engine(lm)
    ids = windows(eng.tokenizer, args.wikitext, args.windows, args.context)
    res = ppl_run(eng, ids, specs)
    ad = lm.adapter
    per_token = 2 * ad.num_layers * ad.num_kv_heads * ad.head_dim
    for r in res["rows"][1:]:
        r["predictor_bytes"] = predictor_bytes(r["spec"], ad)
        r["predictor_bits_per_elem"] = 8 * r["predictor_bytes"] / (args.context * per_token)
    if not doc["rows"]:
        doc = {"label": f"{args.model} ({lm.model.dtype}, CPU)", "windows": args.windows, "context": args.context,
               "elements_per_token": per_token, "rows": [res["rows"][0]]}
    doc["rows"] += res["rows"][1:]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(format_table(doc))
    return 0


def format_table(doc: dict) -> str:
    ctx, e = doc["context"], doc["elements_per_token"]
    out = [f"WikiText-2 test perplexity, {doc['label']}, {doc['windows']} windows x {ctx} tokens, cache maintained "
           "token by token. Bits per K/V element: text = the compressed text tokens (codes, scales, zeros, "
           f"positions); +pred = plus the predictors amortized over one {ctx}-token sequence; all = every token "
           "(fp16 sinks + window included) + predictors.",
           f"| spec | PPL | text bits | +pred ({ctx}) | all tokens +pred ({ctx}) | +pred at 8k | +pred at 128k | "
           "predictor bytes |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        if "text_bits" not in r:
            out.append(f"| {r['spec']} | {r['ppl']:.3f} | - | - | - | - | - | - |")
            continue
        pb = r.get("predictor_bytes", 0)
        share = r.get("predictor_bits_per_elem", 0.0)
        at = [r["text_bits"] + 8 * pb / (n * e) for n in (8192, 131072)]
        out.append(f"| {r['spec']} | {r['ppl']:.3f} | {r['text_bits']:.3f} | {r['text_bits'] + share:.3f} | "
                   f"{r['total_bits'] + share:.3f} | {at[0]:.3f} | {at[1]:.3f} | {pb:,} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("calibrate")
    c.add_argument("--model", default="smollm2-135m")
    c.add_argument("--bits", default="2,3,4")
    c.add_argument("--quantizers", default="higgs,uniform,hadamard")
    c.add_argument("--data", default=str(wikitext("valid")))
    c.add_argument("--fraction", type=float, default=1.0)
    c.add_argument("--seq-len", type=int, default=512)
    c.add_argument("--max-tokens", type=int, default=8192)
    c.add_argument("--sinks", type=int, default=4)
    c.add_argument("--out", default="results/aquakv")
    c.add_argument("--probe-only", action="store_true", help="collect and probe; fit and save nothing")
    p = sub.add_parser("ppl")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--spec", action="append", required=True)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--wikitext", type=Path, default=None)
    p.add_argument("--out", default="results/aquakv/ppl.json")
    t = sub.add_parser("table")
    t.add_argument("--out", default="results/aquakv/ppl.json")
    args = ap.parse_args(argv)
    if args.cmd == "calibrate":
        return calibrate_all(args)
    if args.cmd == "ppl":
        return ppl(args)
    print(format_table(json.loads(Path(args.out).read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
