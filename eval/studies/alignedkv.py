"""AlignedKV on a real model's K/V: bits read per element vs context length (paper Fig. 9) and the relative-error
distribution of q.K and p.V against fp16 (paper Table 1).

``--windows`` windows of ``--context`` WikiText-2 *test* tokens go through the model (plain forwards, no cache); a
capturing attention keeps every layer's q, k (after RoPE) and v, rounded to fp16 as an fp16 cache holds them. For
each context length n in ``--lengths`` the decode query at position n-1 attends to the n keys [0, n) stored as an
AlignedKV segment (``kernels.reference.aligned_attention``, the spec of the kernel):

* bits read per element, K and V, averaged over windows, layers and KV heads; "per head" is what the read would
  be if each query head decided alone (MHA, or the paper's code), "group" what GQA reads (widest need of the G
  heads of a KV head);
* Table 1 buckets of the element-wise relative error ``|R - R_fp16| / |R_fp16|`` (both results rounded to fp16,
  as an fp16 GEMM writes them): q.K^T with K read by Rule 1; S.V with the exact softmax S and V read by Rule 2
  (decided from that S, so that each GEMM is measured alone); and the attention output of the whole aligned read.
  "Truncated to 13 bits" zeroes the 3 low mantissa bits of every K/V element (the paper's comparison).

    python -m eval.studies.alignedkv --windows 4 --context 4096 --out results/alignedkv_study.json
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from kernels.layouts import bits_fp16, fp16_bits, join_planes
from kernels.reference import (
    aligned_attention,
    bits_read,
    key_levels,
    output_estimate,
    value_levels,
    value_levels_paper,
)
from mmkv.calibrate.collect import collect_qkv
from mmkv.methods.alignedkv import AlignedKV

from ..jsonout import save_json
from .common import wikitext_test

EDGES = (1 / 1024, 1 / 512, 1 / 256, 1 / 128)
BUCKETS = ("0", "(0, 1/1024)", "[1/1024, 1/512)", "[1/512, 1/256)", "[1/256, 1/128)", "[1/128, inf)")
LOG2E = 1.4426950408889634


def bucket_counts(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Counts per Table 1 bucket of |approx - exact| / |exact| over elements with exact != 0 (fp16-rounded)."""
    a, e = approx.half().float().flatten(), exact.half().float().flatten()
    keep = e != 0
    rel = ((a - e).abs() / e.abs())[keep]
    idx = torch.bucketize(rel, torch.tensor(EDGES), right=True) + 1
    idx[rel == 0] = 0
    return torch.bincount(idx, minlength=len(BUCKETS)).double()


def truncate13(x: torch.Tensor) -> torch.Tensor:
    return bits_fp16(fp16_bits(x) & ~0x7).float()


def one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, method: AlignedKV, sm_scale: float):
    """q [Hq, D], k/v [n, H, D] fp16 -> bits and Table 1 bucket counts for one decode step of one layer."""
    n, h, d = k.shape
    hq = q.shape[0]
    g = hq // h
    kk, vv = k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None]  # [1, H, n, D]
    seg = method.quantize(kk, vv, torch.tensor([n], dtype=torch.int32))
    qb = q[None].float()
    out, _, lk, lv = aligned_attention(qb, seg, sm_scale)
    res = {"k_bits": bits_read(lk, seg.lens, seg.block), "v_bits": bits_read(lv, seg.lens, seg.block)}
    # per-head decisions (no GQA sharing): mean over the G heads of each head's own width
    qg = qb.reshape(1, h, g, d)
    t = seg.k_hi.shape[2] * seg.block
    per_head_k = key_levels(qg, seg.k_colmax).clamp(min=method.min_bits).float().mean(2)
    res["k_bits_per_head"] = bits_read(per_head_k, seg.lens, seg.block)

    kf, vf = kk.float(), vv.float()
    x_exact = torch.einsum("bhgd,bhtd->bhgt", qg, kf)  # [1, H, G, n]
    k_al = join_planes(seg.k_hi, seg.k_mid, seg.k_low, lk).float()[:, :, :n]
    x_al = torch.einsum("bhgd,bhtd->bhgt", qg, k_al)
    x_tr = torch.einsum("bhgd,bhtd->bhgt", qg, truncate13(kk))
    # S.V alone: exact softmax, V levels decided from it (Rule 2, the method's value rule)
    xs = x_exact * (sm_scale * LOG2E)
    xs_pad = torch.full((1, h, g, t), float("-inf"))
    xs_pad[..., :n] = xs
    lse2 = torch.logsumexp(xs / LOG2E, -1) * LOG2E
    s = torch.exp2(xs - lse2[..., None])
    paper = method.values == "paper"
    rule = value_levels_paper if paper else value_levels
    o_est = output_estimate(xs_pad, lse2, seg.v_hi, seg.block, absolute=paper)
    logp = (xs_pad.reshape(1, h, g, -1, seg.block).amax(-1) - lse2[..., None]).nan_to_num(-1e9, neginf=-1e9)
    lv_s = rule(logp, o_est, seg.v_colmax)
    # the same rule decided per token (each token its own "block", every channel of a token row read at the row's
    # widest need: the authors' token-major V layout), GQA group max; padding not counted
    logp_t = (xs_pad - lse2[..., None]).nan_to_num(-1e9, neginf=-1e9)
    lv_t = rule(logp_t, o_est, seg.v_colmax.repeat_interleave(seg.block, dim=2)).amax(-1).amax(2)  # [1, H, t]
    if method.values == "full":
        lv_s, lv_t = torch.full_like(lv_s, 16), torch.full_like(lv_t, 16)
    res["v_bits_per_head"] = bits_read(lv_s.clamp(min=method.min_bits).float().mean(2), seg.lens, seg.block)
    res["v_bits_per_token"] = lv_t[..., :n].clamp(min=method.min_bits).float().mean().item()
    v_al = join_planes(seg.v_hi, seg.v_mid, seg.v_low, lv_s.amax(2).clamp(min=method.min_bits)).float()[:, :, :n]
    sv_exact = torch.einsum("bhgt,bhtd->bhgd", s, vf)
    sv_al = torch.einsum("bhgt,bhtd->bhgd", s, v_al)
    sv_tr = torch.einsum("bhgt,bhtd->bhgd", s, truncate13(vv))
    attn_exact = sv_exact.reshape(1, hq, d)
    res["qk_aligned"] = bucket_counts(x_al, x_exact)
    res["qk_trunc13"] = bucket_counts(x_tr, x_exact)
    res["sv_aligned"] = bucket_counts(sv_al, sv_exact)
    res["sv_trunc13"] = bucket_counts(sv_tr, sv_exact)
    res["attn_aligned"] = bucket_counts(out, attn_exact)
    res["attn_l2"] = ((out - attn_exact).norm() / attn_exact.norm()).item()
    return res


def run(lm, windows: int, context: int, lengths: list[int], method: AlignedKV, data: Path | None = None) -> dict:
    model, processor, adapter = lm
    sm_scale = 1.0 / math.sqrt(adapter.head_dim)
    data = data or wikitext_test()
    col = collect_qkv(lm, path=data, seq_len=context, max_tokens=windows * context, dtype=torch.float16)
    per_len = {n: {"k": [], "v": [], "kh": [], "vh": [], "vt": [], "l2": []} for n in lengths}
    table = {key: torch.zeros(len(BUCKETS), dtype=torch.float64)
             for key in ("qk_aligned", "qk_trunc13", "sv_aligned", "sv_trunc13", "attn_aligned")}
    for layer in range(adapter.num_layers):
        q, k, v = col.q[layer], col.k[layer], col.v[layer]
        for w in range(col.meta["windows"]):
            off = w * context
            for n in lengths:
                r = one_query(q[off + n - 1], k[off : off + n], v[off : off + n], method, sm_scale)
                for key in table:
                    table[key] += r[key]
                for a, b in (("k", "k_bits"), ("v", "v_bits"), ("kh", "k_bits_per_head"), ("vh", "v_bits_per_head"),
                             ("vt", "v_bits_per_token"), ("l2", "attn_l2")):
                    per_len[n][a].append(r[b])
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    rows = [{"context": n, "k_bits": mean(d["k"]), "v_bits": mean(d["v"]), "kv_bits": (mean(d["k"]) + mean(d["v"])) / 2,
             "k_bits_per_head": mean(d["kh"]), "v_bits_per_head": mean(d["vh"]),
             "kv_bits_per_head": (mean(d["kh"]) + mean(d["vh"])) / 2, "v_bits_per_token": mean(d["vt"]),
             "attn_rel_l2_mean": mean(d["l2"]),
             "attn_rel_l2_max": max(d["l2"]), "samples": len(d["k"])} for n, d in per_len.items()]
    dist = {key: {"buckets": dict(zip(BUCKETS, (c / c.sum()).tolist())), "elements": int(c.sum())}
            for key, c in table.items()}
    return {"method": str(method), "values": method.values,
            "data": str(data), "windows": col.meta["windows"], "context": context, "rows": rows, "table1": dist}


def format_tables(res: dict) -> str:
    out = [f"Bits read per K/V element by AlignedKV ({res['method']}), decode query at position n-1 over n keys; "
           f"{res['windows']} WikiText-2 test windows x {res['context']} tokens, all layers (fp16 K/V)",
           "| context n | K bits | V bits | K+V bits | K+V bits, per-head decisions (no GQA) | V bits, per-token "
           "decisions | attention rel. L2 (mean / max) |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        out.append(f"| {r['context']} | {r['k_bits']:.2f} | {r['v_bits']:.2f} | {r['kv_bits']:.2f} | "
                   f"{r['kv_bits_per_head']:.2f} | {r['v_bits_per_token']:.2f} | "
                   f"{r['attn_rel_l2_mean']:.1e} / {r['attn_rel_l2_max']:.1e} |")
    out += ["", "Relative error of results vs fp16 (Table 1 buckets; results rounded to fp16)",
            "| result | read | " + " | ".join(BUCKETS) + " | elements |", "|---|---|" + "---:|" * (len(BUCKETS) + 1)]
    names = {"qk_aligned": ("q.K^T", "AlignedKV (Rule 1)"), "qk_trunc13": ("q.K^T", "truncated to 13 bits"),
             "sv_aligned": ("S.V", f"AlignedKV (Rule 2, values={res.get('values', '?')})"), "sv_trunc13": ("S.V", "truncated to 13 bits"),
             "attn_aligned": ("attention output", "AlignedKV (both)")}
    for key, (what, how) in names.items():
        d = res["table1"][key]
        out.append(f"| {what} | {how} | " + " | ".join(f"{100 * p:.2f}%" for p in d["buckets"].values())
                   + f" | {d['elements']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--lengths", default="128,256,512,1024,2048,4096")
    ap.add_argument("--spec", default="alignedkv", help="the AlignedKV method string, e.g. alignedkv:block=32")
    ap.add_argument("--data", type=Path, default=None, help="WikiText-2 test.txt (default: mmkv.paths.wikitext)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import mmkv
    from mmkv.spec import parse_method

    method = parse_method(args.spec, "text")
    if not isinstance(method, AlignedKV):
        raise ValueError(f"--spec must be an alignedkv method string, got {args.spec!r}")
    lengths = [int(x) for x in args.lengths.split(",")]
    if max(lengths) > args.context:
        raise ValueError(f"--lengths must not exceed --context {args.context}")
    t0 = time.perf_counter()
    lm = mmkv.load_model(args.model, device="cpu")
    res = run(lm, args.windows, args.context, lengths, method, args.data)
    res["seconds"] = time.perf_counter() - t0
    res["model"] = args.model
    print(format_tables(res))
    save_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
