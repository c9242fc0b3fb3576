"""``mmkv-calibrate aquakv``: AQUA-KV's predictors (Alg. 1) and the explained-variance probe (Sec. 3.1, Fig. 2).

    mmkv-calibrate aquakv --model smollm2-135m [--data valid.txt] [--fraction F] [--bits 2|3|4]
                          [--quantizer higgs|uniform|hadamard] [--out DIR]

1. The model runs over windows of the calibration text (``collect.collect_qkv``; WikiText-2 ``valid.txt``); keys
   are turned back into pre-RoPE keys with the model's rotary embedding (``collect.unrotate_keys``).
2. Algorithm 1, one layer at a time: layer 0 is quantized directly (``first_bits``); for layer ``l >= 1`` the key
   predictor is fitted from layer ``l-1``'s *reconstructed* keys, the keys' residual quantized and reconstructed,
   then the value predictor from ``[layer l-1's reconstructed values ; layer l's reconstructed keys]``, the values'
   residual quantized and reconstructed; the reconstructions feed the next layer. Fits are closed-form ridge
   regressions with an intercept (App. A: regularizer 1e-3, taken relative to the inputs' mean variance so it
   does not depend on the scale of keys and values). The predictors are rounded to fp16 (how they are stored)
   *before* they produce the reconstructions that train the next layer, and the reconstructions come from the
   same codec the cache runs (``mmkv.methods.aquakv_codec``): calibration sees what the runtime will see.
3. The first ``--sinks`` tokens of every window are left out of the fits: the cache keeps them in fp16 (Sec. 3.3)
   and their outlier values would pull the regressions.
4. The last quarter of the windows is held out: the probe is fitted on the rest and scored there, and the
   reconstruction errors are reported on both.

The probe (Sec. 3.1) fits plain linear maps on the *true* K/V: previous-layer keys -> keys, previous-layer values
-> values, keys -> values, and the value predictor's input ``[previous values ; keys]`` -> values; it reports the
explained variance ratio with per-channel variances (App. A), per layer, as a table and as JSON (``probe.json``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from ..methods.aquakv import AquaKV
from ..methods.aquakv_codec import Predictors, encode
from ..methods.aquakv_quant import QUANTIZERS, Quantizer
from ..methods.artifacts import Artifact, shape_of
from .collect import collect_qkv, rope_cos_sin, unrotate_keys

ALPHA = 1e-3


def ridge(x: torch.Tensor, y: torch.Tensor, alpha: float = ALPHA) -> tuple[torch.Tensor, torch.Tensor]:
    """``y ~ x @ w + b`` in closed form (float64): ``w = (Xc'Xc/n + lam I)^-1 Xc'Yc/n`` on centred data,
    ``lam = alpha * mean(diag(Xc'Xc/n))``. ``x [n, p]``, ``y [n, q]`` -> ``w [p, q]``, ``b [q]`` (fp32)."""
    x, y = x.double(), y.double()
    mx, my = x.mean(0), y.mean(0)
    xc, yc = x - mx, y - my
    g = xc.T @ xc / x.shape[0]
    lam = alpha * g.diagonal().mean().clamp_min(1e-12)
    w = torch.linalg.solve(g + lam * torch.eye(g.shape[0], dtype=g.dtype), xc.T @ yc / x.shape[0])
    return w.float(), (my - mx @ w).float()


def explained_variance(y: torch.Tensor, y_hat: torch.Tensor) -> float:
    """``1 - sum_c Var(y_c - y^_c) / sum_c Var(y_c)`` (per-channel variances, App. A)."""
    y, y_hat = y.double(), y_hat.double()
    return float(1 - (y - y_hat).var(0).sum() / y.var(0).sum())


def rel_error(y: torch.Tensor, y_hat: torch.Tensor) -> float:
    """Relative squared error ``||y^ - y||^2 / ||y||^2``."""
    return float((y_hat.double() - y.double()).pow(2).sum() / y.double().pow(2).sum())


def _probe(x_tr, y_tr, x_ho, y_ho) -> float:
    w, b = ridge(x_tr, y_tr)
    return explained_variance(y_ho, x_ho @ w + b)


def _fp16(w: torch.Tensor) -> torch.Tensor:
    return w.half().float()


def calibrate(k_layers, v_layers, train: torch.Tensor, cfg: AquaKV, log=print) -> dict:
    """Algorithm 1 and the probe on collected pre-RoPE keys and values (``k_layers[l]: [N, C]`` fp16/fp32).

    ``train [N]`` bool marks the fitting tokens; the other tokens form the holdout. Returns ``{"predictors":
    Predictors (fp16), "probe": [...], "errors": [...]}``."""
    n_layers = len(k_layers)
    q_first = Quantizer(cfg.first_bits, cfg.group, cfg.quantizer, cfg.seed)
    q_rest = Quantizer(cfg.bits, cfg.group, cfg.quantizer, cfg.seed)
    kw, kb, vw, vb = [], [], [], []
    errors = []
    prev = None  # (K, V) true, (K^, V^) train, (K^, V^) holdout
    for l in range(n_layers):
        k, v = k_layers[l].float(), v_layers[l].float()
        k_tr, v_tr, k_ho, v_ho = k[train], v[train], k[~train], v[~train]
        q = q_first if l == 0 else q_rest
        row = {"layer": l, "bits": q.bits}
        if l == 0:
            pred = None
        else:
            _, (hk_tr, hv_tr), _ = prev
            w, b = ridge(hk_tr, k_tr)
            w_k, b_k = _fp16(w), _fp16(b)
            k_pred = torch.addmm(b_k, hk_tr, w_k)
            k_hat_tr = q.round_trip(k_tr - k_pred) + k_pred
            w, b = ridge(torch.cat([hv_tr, k_hat_tr], 1), v_tr)
            pred = Predictors(w_k[None], b_k[None], _fp16(w)[None], _fp16(b)[None])
            kw.append(pred.k_weight[0]), kb.append(pred.k_bias[0]), vw.append(pred.v_weight[0])
            vb.append(pred.v_bias[0])
        recon = []
        for part, (kk, vv) in (("train", (k_tr, v_tr)), ("holdout", (k_ho, v_ho))):
            p = None if l == 0 else (prev[1] if part == "train" else prev[2])
            _, _, k_hat, v_hat = encode(1 if pred is not None else 0, kk, vv, p, pred, q, q)
            recon.append((k_hat, v_hat))
            row[f"k_err_{part}"], row[f"v_err_{part}"] = rel_error(kk, k_hat), rel_error(vv, v_hat)
        row["k_err_direct"] = rel_error(k_ho, q.round_trip(k_ho))
        row["v_err_direct"] = rel_error(v_ho, q.round_trip(v_ho))
        errors.append(row)
        log(f"layer {l:3d}  {q.bits}-bit  rel. error K {row['k_err_holdout']:.4f} (direct {row['k_err_direct']:.4f})"
            f"  V {row['v_err_holdout']:.4f} (direct {row['v_err_direct']:.4f})")
        prev = ((k, v), recon[0], recon[1])
    stack = (torch.stack(kw), torch.stack(kb), torch.stack(vw), torch.stack(vb)) if kw else None
    if stack is None:
        raise ValueError("aquakv needs a model with at least 2 layers")
    return {"predictors": Predictors(*(t.half() for t in stack)), "errors": errors}


def probe(k_layers, v_layers, train: torch.Tensor, head_dim: int, group: int = 64) -> list[dict]:
    """Sec. 3.1 / Fig. 2: explained variance (holdout) of ridge probes fitted on the true K/V of the fitting tokens.

    Over all KV heads' channels at once (what AQUA-KV's predictors use) and, for comparison, per KV head (a
    block-diagonal predictor, ``H`` times fewer weights); plus the explained variance of a plain per-token 2-bit
    uniform quantizer (groups of ``group``) of the same vectors, scored the same way."""
    q2 = Quantizer(2, group, "uniform")
    ho = ~train
    out = []

    def per_head(x, y):
        nh = y.shape[1] // head_dim
        xs = [x[:, i * head_dim : (i + 1) * head_dim] for i in range(x.shape[1] // head_dim)]
        pred = []
        for h in range(nh):  # inputs of head h: its own channels of every input block
            xh = torch.cat(xs[h::nh], 1)
            w, b = ridge(xh[train], y[train, h * head_dim : (h + 1) * head_dim])
            pred.append(xh[ho] @ w + b)
        return explained_variance(y[ho], torch.cat(pred, 1))

    for l in range(1, len(k_layers)):
        pk, pv = k_layers[l - 1].float(), v_layers[l - 1].float()
        k, v = k_layers[l].float(), v_layers[l].float()
        vk = torch.cat([pv, k], 1)
        out.append({"layer": l,
                    "k_prev_to_k": _probe(pk[train], k[train], pk[ho], k[ho]),
                    "v_prev_to_v": _probe(pv[train], v[train], pv[ho], v[ho]),
                    "k_to_v": _probe(k[train], v[train], k[ho], v[ho]),
                    "v_prev_k_to_v": _probe(vk[train], v[train], vk[ho], v[ho]),
                    "k_prev_to_k_per_head": per_head(pk, k),
                    "v_prev_k_to_v_per_head": per_head(vk, v),
                    "uniform_2bit_k": explained_variance(k[ho], q2.round_trip(k[ho])),
                    "uniform_2bit_v": explained_variance(v[ho], q2.round_trip(v[ho]))})
    return out


def probe_table(probe: list[dict]) -> str:
    cols = [("k_prev_to_k", "K(l-1)->K"), ("v_prev_to_v", "V(l-1)->V"), ("k_to_v", "K->V"),
            ("v_prev_k_to_v", "[V(l-1);K]->V"), ("k_prev_to_k_per_head", "K(l-1)->K per head"),
            ("v_prev_k_to_v_per_head", "[V(l-1);K]->V per head"), ("uniform_2bit_k", "2-bit quant. K"),
            ("uniform_2bit_v", "2-bit quant. V")]
    out = ["| layer | " + " | ".join(c[1] for c in cols) + " |", "|---:|" + "---:|" * len(cols)]
    for r in probe:
        out.append(f"| {r['layer']} | " + " | ".join(f"{r[c]:.3f}" for c, _ in cols) + " |")
    out.append("| mean | " + " | ".join(f"{sum(r[c] for r in probe) / len(probe):.3f}" for c, _ in cols) + " |")
    return "\n".join(out)


def error_table(errors: list[dict]) -> str:
    out = ["| layer | bits | K rel. err (AQUA-KV) | K rel. err (direct) | V rel. err (AQUA-KV) | V rel. err (direct) |",
           "|---:|---:|---:|---:|---:|---:|"]
    for r in errors:
        out.append(f"| {r['layer']} | {r['bits']} | {r['k_err_holdout']:.4f} | {r['k_err_direct']:.4f} | "
                   f"{r['v_err_holdout']:.4f} | {r['v_err_direct']:.4f} |")
    mean = {k: sum(r[k] for r in errors) / len(errors) for k in errors[0] if k.endswith(("holdout", "direct"))}
    out.append(f"| mean | | {mean['k_err_holdout']:.4f} | {mean['k_err_direct']:.4f} | {mean['v_err_holdout']:.4f} | "
               f"{mean['v_err_direct']:.4f} |")
    return "\n".join(out)


def collect(lm, data: str | Path | None = None, fraction: float = 1.0, seq_len: int = 512,
            max_tokens: int = 8192, sinks: int = 4) -> dict:
    """Pre-RoPE keys and values ``[N, C]`` (fp16) per layer on the calibration text, the fitting/holdout split
    (the last quarter of the windows is held out) and what was used; the first ``sinks`` tokens of each window
    are dropped."""
    model, _, adapter = lm
    col = collect_qkv(lm, data, seq_len=seq_len, max_tokens=max_tokens, fraction=fraction, dtype=torch.float16)
    windows = col.meta["windows"]
    if windows < 2:
        raise ValueError(f"aquakv calibration needs at least 2 windows of {seq_len} tokens (one is held out), "
                         f"got {windows}: use more text (--fraction) or a shorter --seq-len")
    n, h, d = col.k[0].shape
    cos, sin = rope_cos_sin(model, col.positions)
    used = col.positions >= sinks
    keys = [unrotate_keys(k.float(), cos, sin).reshape(n, h * d)[used].half() for k in col.k]
    values = [v.reshape(n, h * d)[used] for v in col.v]
    window = torch.arange(n)[used] // seq_len
    train = window < windows - max(1, windows // 4)
    meta = {**col.meta, "sinks_skipped": sinks, "train_tokens": int(train.sum()), "holdout_tokens": int((~train).sum())}
    return {"keys": keys, "values": values, "train": train, "meta": meta}


def fit(lm, data: dict, cfg: AquaKV, out: str | Path | None = None, log=print,
        with_probe: bool = True) -> tuple[Path, dict]:
    """Algorithm 1 on collected data; saves the artifact (``out`` or the spec's default folder) with its
    ``probe.json``; returns ``(folder, report)``."""
    _, _, adapter = lm
    meta = data["meta"]
    log(f"aquakv: {adapter.describe()}; {meta['tokens']} tokens in {meta['windows']} windows of {meta['seq_len']} "
        f"from {meta['data']} (fraction {meta['fraction']}); fitting on {meta['train_tokens']}, holdout "
        f"{meta['holdout_tokens']}; config {cfg.config()}")
    res = calibrate(data["keys"], data["values"], data["train"], cfg, log=log)
    if with_probe:
        res["probe"] = probe(data["keys"], data["values"], data["train"], adapter.head_dim, cfg.group)
    pred: Predictors = res["predictors"]
    folder = Path(out).expanduser() if out else cfg.default_folder(adapter.name)
    info = {"config": cfg.config(), "predictor_bytes": pred.nbytes(), "ridge_alpha": ALPHA, "calibration": meta,
            "synthetic": adapter.synthetic}
    Artifact("aquakv", adapter.name, shape_of(adapter), pred.tensors(), {**info, "errors": res["errors"]}).save(folder)
    report = {"model": adapter.name, **info, "probe": res.get("probe"), "errors": res["errors"]}
    (folder / "probe.json").write_text(json.dumps(report, indent=1))
    return folder, report


def run(lm, cfg: AquaKV, data: str | Path | None = None, fraction: float = 1.0, seq_len: int = 512,
        max_tokens: int = 8192, sinks: int = 4, out: str | Path | None = None, log=print) -> tuple[Path, dict]:
    """Collect, calibrate, save: what ``mmkv-calibrate aquakv`` does."""
    return fit(lm, collect(lm, data, fraction, seq_len, max_tokens, sinks), cfg, out, log)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mmkv-calibrate aquakv", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", help="calibration text (default: WikiText-2 valid.txt, see mmkv.paths.wikitext)")
    ap.add_argument("--fraction", type=float, default=1.0, help="use this fraction of the text file")
    ap.add_argument("--bits", type=int, default=2, choices=(2, 3, 4))
    ap.add_argument("--quantizer", default="higgs", choices=QUANTIZERS)
    ap.add_argument("--first-bits", type=int, default=4, choices=(2, 3, 4))
    ap.add_argument("--group", type=int, default=64, choices=(32, 64, 128))
    ap.add_argument("--seed", type=int, default=0, help="Hadamard sign seed")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--sinks", type=int, default=4, help="tokens at the start of each window left out of the fits")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None, help="artifact folder (default: the one the spec looks in)")
    args = ap.parse_args(argv)
    import mmkv

    cfg = AquaKV(bits=args.bits, quantizer=args.quantizer, first_bits=args.first_bits, group=args.group,
                 seed=args.seed)
    lm = mmkv.load_model(args.model, device=args.device)
    cfg.check(lm.adapter.head_dim, lm.adapter.num_layers)
    folder, report = run(lm, cfg, args.data, args.fraction, args.seq_len, args.max_tokens, args.sinks, args.out)
    print("\nReconstruction error on the holdout (relative squared error), AQUA-KV vs the same quantizer alone:")
    print(error_table(report["errors"]))
    print("\nExplained variance ratio of linear probes on true K/V (Sec. 3.1, Fig. 2), holdout:")
    print(probe_table(report["probe"]))
    pb = report["predictor_bytes"]
    print(f"\npredictors: {pb:,} bytes ({pb / 2**20:.2f} MiB, fp16); artifact: {folder}; probe: {folder / 'probe.json'}")
    if not math.isfinite(sum(r["k_err_holdout"] for r in report["errors"])):
        return 1
    return 0
