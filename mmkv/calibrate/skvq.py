"""SKVQ offline calibration (arXiv:2405.06219 Sec. 3.1, App. A prologue): channel reorder + clipping.

    mmkv-calibrate skvq --model smollm2-135m [--data FILE] [--fraction F] [--group 128,64,32]
                        [--k-bits 2] [--v-bits 2,1.5] [--tokens 2048] [--out DIR]

1. Collect every layer's q, k (post-RoPE: what the cache stores) and v on calibration text (WikiText-2
   ``valid.txt``; ``--tokens`` 2048 by default = 4 windows of 512, about a minute for SmolLM2 on 2 CPU cores).
2. Reorder (``get_permutation_matrix``): per layer, per KV head and per K/V, each channel's statistics over the
   calibration tokens (its min and max, RPTQ's features) are clustered with KMeans into ``D / group`` clusters;
   channels are then stored cluster by cluster, so each quantization group is one cluster (variable sizes,
   average ``group``). Permutations stay within one KV head, unlike the paper's code which reorders the whole
   hidden size: a kernel program then owns one head's channels and needs only ``q[perm]`` and a scatter of its
   output. Consequence: a group never spans more than ``head_dim`` channels; with head_dim 64, ``group`` 128 and
   64 both mean one group per head, for which reordering changes nothing (every channel is in the one group).
   The fixed-size variant (``groups=fixed`` at runtime) reuses the same order and cuts it into equal groups.
3. Clipping (``get_group_clipping``, Eq. 3): per group, alpha is chosen on a grid (1.0 down to 0.3 by 0.05) to
   minimize the MSE of the head's attention output (its query heads over causal calibration windows, every
   ``--q-stride``-th query) with the cache quantized vs not. Coordinate descent, one pass over the groups; the K
   ratios are chosen with V exact and the V ratios with K exact, so a K ratio does not depend on the V bits.
   Ratios depend on the bit-width, so they are stored per (variant, group, bits); ``nat`` is the natural-order
   grouping that the ``reorder=off`` ablation uses.

Artifact (``mmkv.methods.artifacts``): ``{k,v}.perm.g{G}`` and ``{k,v}.gid.g{G}`` uint8 ``[L, H, D]``,
``{k,v}.alpha.{nat,var,fix}.g{G}.b{bits}`` fp32 ``[L, H, D/G]``, with the model name, its shape, the data and
every parameter in ``meta.json``.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from ..methods import artifacts
from ..methods.skvq import bits_key
from ..methods.skvq_quant import dequant_range, fake_quant

GRID = tuple(round(1.0 - 0.05 * i, 2) for i in range(15))  # 1.0 down to 0.3


# ---------------------------------------------------------------------------------------------------------------
# reorder: per-channel statistics, KMeans, order
# ---------------------------------------------------------------------------------------------------------------


def channel_features(x: torch.Tensor) -> torch.Tensor:
    """``x [N, D]`` -> ``[D, 2]``: each channel's min and max over the calibration tokens."""
    xf = x.float()
    return torch.stack([xf.amin(0), xf.amax(0)], dim=1)


def kmeans(points: torch.Tensor, k: int, iters: int = 50, restarts: int = 3, seed: int = 0):
    """Lloyd's KMeans with k-means++ seeding, best of ``restarts`` by inertia. Returns ``(labels [n], centers)``.

    An emptied cluster is re-seeded with the point farthest from its center, so exactly ``k`` clusters come out
    (``k <= n``)."""
    n = points.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"kmeans: k={k} must be in [1, {n}]")
    g = torch.Generator().manual_seed(seed)
    x = points.double().cpu()
    best = None
    for _ in range(restarts):
        centers = x[torch.randint(n, (1,), generator=g)]
        while centers.shape[0] < k:
            d2 = torch.cdist(x, centers).amin(1) ** 2
            if float(d2.sum()) <= 0:
                nxt = torch.randint(n, (1,), generator=g)
            else:
                nxt = torch.multinomial(d2 / d2.sum(), 1, generator=g)
            centers = torch.cat([centers, x[nxt]])
        labels = None
        for _ in range(iters):
            dist = torch.cdist(x, centers)
            new = dist.argmin(1)
            for c in range(k):
                if not bool((new == c).any()):
                    far = dist.gather(1, new[:, None])[:, 0].argmax()
                    new[far] = c
            if labels is not None and torch.equal(new, labels):
                break
            labels = new
            centers = torch.stack([x[labels == c].mean(0) for c in range(k)])
        inertia = float(((x - centers[labels]) ** 2).sum())
        if best is None or inertia < best[0]:
            best = (inertia, labels.clone(), centers.clone())
    return best[1], best[2].to(points.dtype)


def reorder(features: torch.Tensor, ng: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel order and group ids of one head: ``(perm [D], gid [D])``, stored channel ``j`` = natural channel
    ``perm[j]``, in group ``gid[j]`` (non-decreasing). Clusters (and channels inside one) are ordered along the
    features' principal axis, so neighbouring groups hold similar channels; ``ng == 1`` is the identity."""
    d = features.shape[0]
    if ng == 1:
        return torch.arange(d), torch.zeros(d, dtype=torch.long)
    labels, centers = kmeans(features, ng, seed=seed)
    f = features.double()
    mean = f.mean(0)
    axis = torch.linalg.svd(f - mean, full_matrices=False).Vh[0]
    proj = (f - mean) @ axis
    rank = torch.argsort((centers.double() - mean) @ axis)  # cluster order along the axis
    pos = torch.empty_like(rank)
    pos[rank] = torch.arange(ng)
    key = pos[labels].double() * (proj.abs().max() * 4 + 1) + proj  # cluster first, then projection
    perm = torch.argsort(key)
    return perm, pos[labels][perm]


# ---------------------------------------------------------------------------------------------------------------
# clipping: Eq. 3 on one head's attention output
# ---------------------------------------------------------------------------------------------------------------


class HeadProblem:
    """One KV head's calibration attention: queries ``[W, M, D]`` (its ``Gq`` query heads at every
    ``q_stride``-th position of each window, flattened to ``M``), keys/values ``[W, S, D]``, causal mask; the
    exact probabilities and output are kept. Candidates are evaluated as batched matmuls over the W windows."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, q_stride: int):
        n, gq, d = q.shape
        w = n // seq_len
        self.scale = 1.0 / math.sqrt(d)
        self.k = k[: w * seq_len].float().reshape(w, seq_len, d)
        self.v = v[: w * seq_len].float().reshape(w, seq_len, d)
        pos = torch.arange(q_stride - 1, seq_len, q_stride)
        qw = q[: w * seq_len].float().reshape(w, seq_len, gq, d)[:, pos]  # [W, Sq, Gq, D]
        self.q = qw.reshape(w, len(pos) * gq, d)
        self.mask = (torch.arange(seq_len)[None, :] > pos[:, None]).repeat_interleave(gq, 0)  # [M, S]
        x = (self.q @ self.k.transpose(1, 2)) * self.scale
        self.p = torch.softmax(x.masked_fill(self.mask, float("-inf")), dim=-1)  # [W, M, S]
        self.out = self.p @ self.v  # [W, M, D]

    def k_error(self, k_hat: torch.Tensor, perm, chans, k_base: torch.Tensor) -> torch.Tensor:
        """Output MSE per candidate, keys ``k_hat [C, W, S, m]`` on stored channels ``chans`` and ``k_base
        [W, S, D]`` elsewhere (stored order; q is permuted to match): only the candidates' logits are recomputed."""
        c, w, s, m = k_hat.shape
        qs = self.q[..., perm]
        other = torch.ones(qs.shape[-1], dtype=torch.bool)
        other[chans] = False
        base = qs[..., other] @ k_base[..., other].transpose(1, 2)  # [W, M, S]
        kk = k_hat.permute(1, 3, 0, 2).reshape(w, m, c * s)
        x = (qs[..., chans] @ kk).view(w, -1, c, s) + base[:, :, None]
        x = x.mul_(self.scale).masked_fill_(self.mask[None, :, None], float("-inf"))
        p = torch.softmax(x, dim=-1)
        o = (p.view(w, -1, s) @ self.v).view(w, -1, c, self.v.shape[-1])
        return ((o - self.out[:, :, None]) ** 2).mean(dim=(0, 1, 3))

    def v_error(self, v_hat: torch.Tensor, perm, chans) -> torch.Tensor:
        """Output MSE per candidate over the output channels ``perm[chans]`` only (an output channel depends on its
        own value channel alone, so groups are independent), values ``v_hat [C, W, S, m]`` in stored order."""
        c, w, s, m = v_hat.shape
        o = (self.p @ v_hat.permute(1, 2, 0, 3).reshape(w, s, c * m)).view(w, -1, c, m)
        return ((o - self.out[..., perm[chans]][:, :, None]) ** 2).mean(dim=(0, 1, 3))


def search_alpha(prob: HeadProblem, kind: str, x: torch.Tensor, perm, gid, ng: int, group: int, bits: float,
                 grid=GRID) -> torch.Tensor:
    """Per-group clipping ratios ``[ng]`` for one head's K or V (``x [N, D]`` natural order), coordinate descent:
    group by group, the ratio with the least output error given the others' current ratios (1 until chosen)."""
    w, s, d = prob.k.shape
    xs = x[: w * s].float()[:, perm]
    cand = torch.tensor(grid, dtype=torch.float32)[:, None, None]
    alpha = torch.ones(ng)
    k_base = fake_quant(xs[None, None], bits, gid[None], ng, group, None)[0, 0].reshape(w, s, d) if kind == "k" \
        else None
    for gi in range(ng):
        chans = torch.nonzero(gid == gi)[:, 0]
        xg = xs[:, chans]
        lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
        hat = dequant_range(xg, lo * cand, hi * cand, bits).reshape(len(grid), w, s, -1)  # Eq. 2 per candidate
        err = prob.k_error(hat, perm, chans, k_base) if kind == "k" else prob.v_error(hat, perm, chans)
        best = int(err.argmin())
        alpha[gi] = cand[best, 0, 0]
        if kind == "k":
            k_base[..., chans] = hat[best]
    return alpha


# ---------------------------------------------------------------------------------------------------------------
# whole model
# ---------------------------------------------------------------------------------------------------------------


def calibrate(qs, ks, vs, groups, k_bits, v_bits, seq_len: int, q_stride: int = 8, grid=GRID, log=print) -> dict:
    """Per-layer lists ``q [N, Hq, D]``, ``k, v [N, H, D]`` -> the artifact's tensors (see the module doc)."""
    n_layers = len(ks)
    _, h, d = ks[0].shape
    gq = qs[0].shape[1] // h
    sizes = sorted({min(g, d) for g in groups}, reverse=True)
    for g in sizes:
        if d % g:
            raise ValueError(f"skvq calibration: group {g} does not divide head_dim {d}")
    out: dict[str, list] = {}

    def put(name, layer, head, t):
        out.setdefault(name, [[None] * h for _ in range(n_layers)])[layer][head] = t

    t0 = time.perf_counter()
    for l in range(n_layers):
        for hh in range(h):
            prob = HeadProblem(qs[l][:, hh * gq : (hh + 1) * gq], ks[l][:, hh], vs[l][:, hh], seq_len, q_stride)
            for kind, x, bit_list in (("k", ks[l][:, hh], k_bits), ("v", vs[l][:, hh], v_bits)):
                feats = channel_features(x)
                for g in sizes:
                    ng = d // g
                    perm, gid = reorder(feats, ng, seed=l * 1000 + hh)
                    put(f"{kind}.perm.g{g}", l, hh, perm.to(torch.uint8))
                    put(f"{kind}.gid.g{g}", l, hh, gid.to(torch.uint8))
                    nat = torch.arange(d)
                    fixed_gid = nat // g
                    variants = {"nat": (nat, fixed_gid, g)}
                    if ng > 1:
                        variants.update(var=(perm, gid, 0), fix=(perm, fixed_gid, g))
                    for bits in bit_list:
                        found = {v: search_alpha(prob, kind, x, p, gi, ng, gs, bits, grid)
                                 for v, (p, gi, gs) in variants.items()}
                        for v in ("nat", "var", "fix"):
                            put(f"{kind}.alpha.{v}.g{g}.b{bits_key(bits)}", l, hh, found.get(v, found["nat"]))
        log(f"  layer {l + 1}/{n_layers} done ({time.perf_counter() - t0:.0f} s)")
    # a group larger than head_dim is stored (and looked up) under min(group, head_dim)
    return {name: torch.stack([torch.stack(row) for row in rows]) for name, rows in out.items()}


def synthetic_qkv(num_layers: int, hq: int, h: int, d: int, n: int, seed: int = 0):
    """Random q/k/v with per-channel offsets and spreads (channels differ, as real keys do): for speed benchmarks on
    random-weight models, where text gives no meaningful statistics anyway."""
    g = torch.Generator().manual_seed(seed)
    qs, ks, vs = [], [], []
    for _ in range(num_layers):
        spread = torch.rand(1, h, d, generator=g) * 3 + 0.2
        offset = torch.randn(1, h, d, generator=g) * 2
        ks.append(torch.randn(n, h, d, generator=g) * spread + offset)
        vs.append(torch.randn(n, h, d, generator=g))
        qs.append(torch.randn(n, hq, d, generator=g))
    return qs, ks, vs


def parse_list(text: str, cast) -> list:
    return [cast(x) for x in str(text).split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mmkv-calibrate skvq", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", help="calibration text (default: WikiText-2 valid.txt, see mmkv.paths.wikitext)")
    ap.add_argument("--fraction", type=float, default=1.0, help="use only this fraction of the text file")
    ap.add_argument("--group", default="128,64,32", help="average group sizes to calibrate (comma list)")
    ap.add_argument("--k-bits", default="2", help="key bit-widths whose clipping ratios to fit (comma list)")
    ap.add_argument("--v-bits", default="2,1.5", help="value bit-widths whose clipping ratios to fit")
    ap.add_argument("--tokens", type=int, default=2048, help="calibration tokens (windows of --seq-len)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--q-stride", type=int, default=8, help="use every n-th query position in Eq. 3's objective")
    ap.add_argument("--synthetic", action="store_true",
                    help="random q/k/v instead of text (speed benchmarks on random-weight models only)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, help="torch CPU threads (1 is much faster on a busy shared machine)")
    ap.add_argument("--out", help="output folder (default: the folder the skvq method reads)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    groups = parse_list(args.group, int)
    k_bits = parse_list(args.k_bits, int)
    v_bits = parse_list(args.v_bits, float)
    from ..methods.skvq import SKVQ

    for kb in k_bits:
        SKVQ(k_bits=kb)  # validates against the method's allowed values
    for vb in v_bits:
        SKVQ(v_bits=vb)
    for g in groups:
        SKVQ(group=g)
    from ..models import load_model
    from .collect import collect_qkv

    t0 = time.perf_counter()
    lm = load_model(args.model, device=args.device)
    ad = lm.adapter
    if args.synthetic:
        qs, ks, vs = synthetic_qkv(ad.num_layers, ad.num_q_heads, ad.num_kv_heads, ad.head_dim, args.tokens)
        data = {"data": "synthetic random q/k/v (speed benchmarks only)", "tokens": args.tokens,
                "seq_len": args.seq_len}
    else:
        col = collect_qkv(lm, args.data, seq_len=args.seq_len, max_tokens=args.tokens, fraction=args.fraction,
                          dtype=torch.float32)
        qs, ks, vs, data = col.q, col.k, col.v, col.meta
    print(f"skvq: {data.get('tokens')} calibration tokens collected ({time.perf_counter() - t0:.0f} s); fitting "
          f"groups {groups}, K bits {k_bits}, V bits {v_bits}", flush=True)
    tensors = calibrate(qs, ks, vs, groups, k_bits, v_bits, args.seq_len, args.q_stride,
                        log=lambda m: print(m, flush=True))
    meta = {**data, "params": {"groups": groups, "k_bits": k_bits, "v_bits": v_bits, "grid": list(GRID),
                               "q_stride": args.q_stride, "features": "per-channel min, max (post-RoPE K, V)",
                               "reorder": "per KV head"}, "seconds": round(time.perf_counter() - t0, 1)}
    folder = artifacts.Artifact("skvq", ad.name, artifacts.shape_of(ad), tensors, meta).save(
        args.out or artifacts.default_dir(ad.name, "skvq"))
    print(f"skvq: artifact for {ad.name} written to {folder} ({meta['seconds']} s)")
    return 0


def attach_synthetic_artifacts(specs: list[str], adapter, folder, tokens: int = 1024) -> list[str]:
    """For speed benchmarks on random-weight models: calibrate on synthetic q/k/v (``synthetic_qkv``) for every
    ``skvq`` spec that names no ``artifact=`` and needs one, save under ``folder`` and point the spec at it."""
    from ..methods.skvq import SKVQ
    from ..spec import CacheSpec

    out = []
    for spec in specs:
        try:
            parsed = CacheSpec.parse(spec)
        except ValueError:
            out.append(spec)  # baselines such as hf-fp16 are not specs
            continue
        m = parsed.text
        if not isinstance(m, SKVQ) or m.artifact or not m.calibrated:
            out.append(spec)
            continue
        sub = Path(folder) / f"g{m.group}-k{bits_key(m.k_bits)}-v{bits_key(m.v_bits)}"
        if not (sub / artifacts.META).is_file():
            qs, ks, vs = synthetic_qkv(adapter.num_layers, adapter.num_q_heads, adapter.num_kv_heads,
                                       adapter.head_dim, tokens)
            t = calibrate(qs, ks, vs, [m.group], [m.k_bits], [m.v_bits], seq_len=min(512, tokens), log=lambda s: None)
            artifacts.Artifact("skvq", adapter.name, artifacts.shape_of(adapter), t,
                               {"data": "synthetic random q/k/v (speed benchmark only)", "tokens": tokens}).save(sub)
        out.append(spec.replace("text=skvq:", f"text=skvq:artifact={sub},", 1) if "text=skvq:" in spec
                   else spec.replace("text=skvq", f"text=skvq:artifact={sub}", 1))
    return out
