"""Paper-style result tables (method, bits, metrics) as Markdown and CSV, built only from stored records.

Rows follow the CalibQuant tables: "Baseline 16" first, then one row per spec, named after the method(s) that
quantize something. A synthetic model (random weights or a random vision tower) is named in the table's title
line and in a column of the CSV, so a number from one can never pass for a real result.
"""

from __future__ import annotations

import csv
import io
import math

NOT_AVAILABLE = "n/a"


def _split_spec(spec: str) -> dict[str, str]:
    fields = {}
    for tok in spec.split():
        key, _, value = tok.partition("=")
        fields[key] = value
    return fields


def _method_defaults() -> dict[str, dict]:
    try:
        import mmkv.methods

        return {m["name"]: {p: str(v["default"]).lower() for p, v in m["params"].items()}
                for m in mmkv.methods.describe()}
    except Exception:  # the registry is optional here: without it labels just keep every parameter
        return {}


def _same(default, value) -> bool:
    try:
        return float(default) == float(value)
    except (TypeError, ValueError):
        return str(default).lower() == str(value).lower()


def method_label(spec: str) -> tuple[str, str]:
    """("calibquant", "1") for one quantized modality; ("calibquant + kivi(group=32)", "V1/T2") for two."""
    if spec.strip() == "fp16":
        return "Baseline", "16"
    fields = _split_spec(spec)
    defaults = _method_defaults()
    names, bits = [], []
    for modality in ("visual", "text"):
        name, _, params = fields.get(modality, "fp16").partition(":")
        if name in ("", "fp16"):
            continue
        kv = dict(p.split("=", 1) for p in params.split(",") if "=" in p)
        known = defaults.get(name, {})
        bits.append((modality[0].upper(), kv.pop("bits", known.get("bits", "?"))))  # str(spec) omits defaults
        extra = [f"{k}={v}" for k, v in kv.items() if not _same(known.get(k), v)]
        names.append(name + (f"({','.join(extra)})" if extra else ""))
    for key in ("window", "sinks"):  # only worth showing when a run sweeps them
        if key in fields and fields[key] != {"window": "128", "sinks": "4"}[key]:
            names.append(f"{key}={fields[key]}")
    if not bits:
        return "Baseline", "16"
    label_bits = bits[0][1] if len(bits) == 1 else "/".join(f"{m}{b}" for m, b in bits)
    return " + ".join(names), label_bits


def model_line(config: dict) -> str:
    line = f"Model: {config['model']}"
    if config.get("synthetic"):
        line += f" (SYNTHETIC: {config['synthetic']}; these numbers say nothing about the real model)"
    return line


def _fmt(value, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return NOT_AVAILABLE
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def render(title: str, config: dict, metrics: list[str], rows: list[dict], notes: list[str],
           digits: int = 3) -> tuple[str, str]:
    """rows: {"spec", "metrics": {name: value}, "kv_mib": float|None, "n": int}. Returns (markdown, csv)."""
    head = ["Method", "Bitwidth b", *metrics, "KV cache MiB", "n"]
    lines = [f"# {title}", "", f"**{model_line(config)}**", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["model", "synthetic", "method", "bits", *metrics, "kv_cache_mib", "n", "spec"])
    for row in rows:
        method, bits = method_label(row["spec"])
        vals = [row["metrics"].get(m) for m in metrics]
        cells = [method, bits, *(_fmt(v, digits) for v in vals), _fmt(row.get("kv_mib"), 2), str(row["n"])]
        lines.append("| " + " | ".join(cells) + " |")
        writer.writerow([config["model"], config.get("synthetic") or "", method, bits,
                         *("" if v is None else (round(v, 6) if isinstance(v, float) else v) for v in vals),
                         "" if row.get("kv_mib") is None else round(row["kv_mib"], 4), row["n"], row["spec"]])
    lines += ["", "Specs:"] + [f"- `{r['spec']}`" for r in rows]
    if notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n", buf.getvalue()
