"""AQUA-KV (arXiv:2501.19392): predict each layer's K/V from the previous layer, store the residual.

* Predictors (Sec. 3.2, Alg. 1): per layer ``l >= 1`` a linear map of all KV heads' channels, keys from the
  previous layer's reconstructed keys, values from ``[previous layer's reconstructed values ; this layer's
  reconstructed keys]``; fitted in closed form by ``mmkv-calibrate aquakv`` (``mmkv/calibrate/aquakv.py``).
* Storage (Fig. 3, Alg. 2): per layer only the quantized residual (``aquakv_quant``: HIGGS by default, as the
  paper's headline runs; or uniform per-token groups of ``group`` channels, or the same after a random-sign
  Hadamard rotation of each group) at ``bits``; layer 0 has no
  predictor and is quantized directly at ``first_bits`` (4, Table 1). Keys are pre-RoPE (Sec. 3.3): the flush
  un-rotates them with each token's position (``mmkv.cache.positions``), the read re-rotates.
* Sinks and the recent window stay in the model dtype (the spec's ``sinks=``/``window=``; paper: 4 and 128); the
  window is flushed ``block`` tokens at a time, layer by layer in layer order (Sec. 3.3 "Inference Algorithm").
* Reading (Alg. 3): a layer's cache cannot be read without its predecessor's reconstruction. ``resolve`` rebuilds
  the layer's text tokens (post-RoPE, model dtype) as a dense segment for the decode kernel from the previous
  layer's reconstruction, keeps its own for the next layer and drops the previous one: at most two layers'
  reconstructions are alive, one between layers. Every decode step dequantizes every layer's text tokens: this is
  the method's inherent cost (docs/AQUAKV.md says how it compares with fp16).

Bytes per text token per layer: ``C * bits / 8 + 4 * C / group`` for K and again for V (``C = H * D``), i.e.
``bits + 32 / group`` bits per element (``first_bits + 32 / group`` for layer 0; ``higgs``: ``16 / g`` instead of
``32 / group``, one fp16 norm per Hadamard group of ``g``), plus one shared int32 position
per text token; the predictors (``predictor_nbytes``) are per model, not per token.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.layouts import DenseSeg

from .aquakv_codec import Predictors, decode, encode
from .aquakv_memo import ReadMemo, wanted
from .aquakv_quant import QUANTIZERS, Codes, Quantizer
from .base import Method
from .rope import Rope, rotate, unrotate


@dataclass
class AquaSeg:
    """One layer's residual codes, token-major: every tensor ``[B, 1, T, ...]`` (token axis at dim 2), the last axis
    the ``C = H * D`` channels of a token packed (``*_codes``: low plane; ``*_codes1``: the 1-bit high plane of
    3-bit codes, else None) and fp16 ``*_scale, *_zero [B, 1, T, C / group]`` (``higgs``: the group norms
    ``[B, 1, T, C / g]`` and no zero). Only ``AquaKVLayer.resolve`` can
    turn it into K/V (it needs the previous layer), so attention never sees this layout."""

    k_codes: torch.Tensor
    k_codes1: torch.Tensor | None
    k_scale: torch.Tensor
    k_zero: torch.Tensor | None
    v_codes: torch.Tensor
    v_codes1: torch.Tensor | None
    v_scale: torch.Tensor
    v_zero: torch.Tensor | None
    bits: int
    lens: torch.Tensor

    def token_fields(self) -> list[tuple[str, int]]:
        names = ("k_codes", "k_codes1", "k_scale", "k_zero", "v_codes", "v_codes1", "v_scale", "v_zero")
        return [(n, 1) for n in names if getattr(self, n) is not None]

    def codes(self, kind: str, width: int) -> Codes:
        """The first ``width`` tokens' codes of ``kind`` ("k"/"v") as ``[B, width, ...]``."""
        planes = tuple(p[:, 0, :width] for p in (getattr(self, f"{kind}_codes"), getattr(self, f"{kind}_codes1"))
                       if p is not None)
        zero = getattr(self, f"{kind}_zero")
        return Codes(planes, getattr(self, f"{kind}_scale")[:, 0, :width], None if zero is None else zero[:, 0, :width])


def _seg(kq: Codes, vq: Codes, bits: int, n: int) -> AquaSeg:
    def f(t):
        return None if t is None else t.unsqueeze(1)

    k1 = kq.planes[1] if len(kq.planes) > 1 else None
    v1 = vq.planes[1] if len(vq.planes) > 1 else None
    lens = torch.tensor([n], dtype=torch.int32, device=kq.scale.device)
    return AquaSeg(f(kq.planes[0]), f(k1), f(kq.scale), f(kq.zero), f(vq.planes[0]), f(v1), f(vq.scale),
                   f(vq.zero), bits, lens)


@dataclass
class AquaKV(Method):
    """AQUA-KV: cross-layer linear predictors, only the quantized residual stored, pre-RoPE keys (needs calibration)."""

    name = "aquakv"
    modalities = ("text",)
    needs_artifact = True
    needs_positions = True
    graphable = False  # every step records its token's position host-side (mmkv/cache/positions.py)
    choices = {"bits": (2, 3, 4), "first_bits": (2, 3, 4), "quantizer": QUANTIZERS, "group": (32, 64, 128)}
    bits: int = 2
    quantizer: str = "higgs"
    first_bits: int = 4
    group: int = 64
    seed: int = 0
    block: int = 32
    predictors: bool = True
    artifact: str = ""

    def __post_init__(self):
        super().__post_init__()
        if self.block < 1:
            raise ValueError(f"aquakv: block={self.block} must be >= 1 (tokens flushed from the window at once)")

    @property
    def flush_block(self) -> int:
        return self.block

    def check(self, head_dim: int, num_layers: int) -> None:
        if self.quantizer == "higgs":  # groups come from the row width; codes of a token must fill whole bytes
            if head_dim % 8:
                raise ValueError(f"aquakv: higgs needs head_dim divisible by 8, got {head_dim}")
            return
        if head_dim % self.group:
            raise ValueError(f"aquakv: group={self.group} must divide the model's head_dim={head_dim}")

    def config(self) -> dict:
        """What the predictors were trained for (Alg. 1 trains on this quantizer's reconstructions)."""
        out = {"bits": self.bits, "first_bits": self.first_bits, "quantizer": self.quantizer}
        if self.quantizer != "higgs":  # higgs's groups follow the row width, not the group knob
            out["group"] = self.group
        if self.quantizer == "hadamard":
            out["seed"] = self.seed
        return out

    def calibrate_command(self, model_name: str) -> str:
        cmd = f"mmkv-calibrate aquakv --model {model_name} --bits {self.bits} --quantizer {self.quantizer}"
        for flag, value, default in (("--first-bits", self.first_bits, 4), ("--group", self.group, 64),
                                     ("--seed", self.seed, 0)):
            if value != default and (flag == "--first-bits" or flag[2:] in self.config()):
                cmd += f" {flag} {value}"
        return cmd

    def default_folder(self, model_name: str) -> Path:
        from .artifacts import default_dir

        tag = f"{self.quantizer}-b{self.bits}-f{self.first_bits}"
        if self.quantizer != "higgs":
            tag += f"-g{self.group}"
        if self.quantizer == "hadamard" and self.seed:
            tag += f"-s{self.seed}"
        return default_dir(model_name, self.name) / tag

    def bind(self, adapter) -> AquaKV:
        """A copy holding the model's RoPE tables and (``predictors=true``) the predictors of the artifact."""
        bound = dataclasses.replace(self)
        bound._rope = Rope.from_config(adapter.lm_config, adapter.head_dim)
        bound._pred = None
        if self.predictors:
            folder = Path(self.artifact).expanduser() if self.artifact else self.default_folder(adapter.name)
            if not (folder / "meta.json").is_file():
                raise FileNotFoundError(f"aquakv: no calibration artifact for model {adapter.name!r} "
                                        f"({self.config()}) in {folder}; make one with: "
                                        f"{self.calibrate_command(adapter.name)}")
            art = _load(str(folder), (folder / "tensors.safetensors").stat().st_mtime_ns, adapter.name,
                        adapter.num_layers, adapter.num_kv_heads, adapter.head_dim)
            made_for = art.meta.get("config")
            if made_for != self.config():
                raise ValueError(f"aquakv: the artifact in {folder} was calibrated for {made_for}, not for "
                                 f"{self.config()} (predictors are trained on one quantizer's reconstructions); "
                                 f"make one with: {self.calibrate_command(adapter.name)}")
            pred = Predictors.from_tensors(art.tensors)
            c = adapter.num_kv_heads * adapter.head_dim
            if pred.num_layers != adapter.num_layers or pred.channels != c:
                raise ValueError(f"aquakv: predictors for {pred.num_layers} layers x {pred.channels} channels do "
                                 f"not fit {adapter.name!r} ({adapter.num_layers} layers x {c})")
            bound._pred = pred
        return bound

    def predictor_nbytes(self) -> int:
        """Bytes of the predictors as stored (fp16), shared by every sequence of the model; 0 without them."""
        pred = getattr(self, "_pred", None)
        return pred.nbytes() if pred is not None else 0

    def for_layer(self, layer_idx: int, num_layers: int) -> AquaKVLayer:
        if not hasattr(self, "_rope"):
            raise ValueError("aquakv needs the model: build the cache with MMKVCache.for_model(spec, adapter)")
        return AquaKVLayer(self, layer_idx, num_layers)

    def quantize(self, k, v, lens):
        raise TypeError("aquakv quantizes per layer: the cache calls for_layer() first")


@functools.lru_cache(maxsize=8)
def _load(folder: str, mtime: int, name: str, num_layers: int, num_kv_heads: int, head_dim: int):
    """The artifact, read once per file version (every cache of the model binds it)."""
    from types import SimpleNamespace

    from .artifacts import load

    shape = SimpleNamespace(name=name, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)
    return load(folder, "aquakv", shape)


@dataclass
class _Recon:
    """A layer's reconstruction (pre-RoPE ``k``, ``v`` fp32, token-major) of its first ``lens[row]`` tokens per row."""

    k: torch.Tensor
    v: torch.Tensor
    lens: list[int]
    offset: int = 0  # for a flushed block: the text offset of its first token


class AquaKVLayer:
    """One layer's share of an AquaKV config (made by ``AquaKV.for_layer``, one per cache layer). Holds the
    per-cache scratch this layer hands to the next: its last read reconstruction and its last flushed blocks."""

    def __init__(self, parent: AquaKV, layer_idx: int, num_layers: int):
        self.parent, self.layer_idx, self.num_layers = parent, layer_idx, num_layers
        pred = parent._pred
        if pred is not None and pred.num_layers != num_layers:
            raise ValueError(f"aquakv: predictors for {pred.num_layers} layers, the cache has {num_layers}")
        self.predicts = pred is not None and layer_idx > 0
        self.keeps = pred is not None and layer_idx < num_layers - 1  # the next layer will need this one
        bits = parent.first_bits if layer_idx == 0 else parent.bits
        self.bits = bits
        self.qk = self.qv = Quantizer(bits, parent.group, parent.quantizer, parent.seed)
        self.recon: _Recon | None = None
        self.blocks: dict[int, _Recon] = {}
        self.memo: ReadMemo | None = None  # the read kept on the CPU (aquakv_memo.py); None: rebuilt every step
        self.memo_on: bool | None = None  # decided at the layer's first flush, for the cache's life

    flush_block = property(lambda self: self.parent.block)

    @property
    def share_from(self) -> int | None:
        return self.layer_idx - 1 if self.predicts else None

    def _predictors(self, device) -> Predictors | None:
        if self.parent._pred is None:
            return None
        key = str(device)
        cache = self.parent.__dict__.setdefault("_pred_on", {})
        if key not in cache:
            cache[key] = self.parent._pred.to(device)
        return cache[key]

    # --- flush: Alg. 2 on the tokens that leave the window -------------------------------------------------------
    def quantize_block(self, layer, row: int, offset: int, k: torch.Tensor, v: torch.Tensor) -> AquaSeg:
        m, c = k.shape[2], k.shape[1] * k.shape[3]
        pos = layer.positions.take(row, layer.spec.sinks + offset, m)
        cos, sin = self.parent._rope.cos_sin(pos)
        k_pre = unrotate(k[0].transpose(0, 1).float(), cos[:, None], sin[:, None]).reshape(1, m, c)
        v_t = v[0].transpose(0, 1).float().reshape(1, m, c)
        prev = None
        if self.predicts:
            src = layer.partner.text_method.blocks.pop(row, None)
            if src is None or src.offset != offset or src.lens != [m]:
                got = "nothing" if src is None else f"tokens {src.offset}..{src.offset + src.lens[0] - 1}"
                raise RuntimeError(f"aquakv: layer {self.layer_idx} flushes text tokens {offset}..{offset + m - 1} "
                                   f"of row {row} but layer {self.layer_idx - 1} holds {got}: layers flushed out "
                                   "of order")
            prev = (src.k, src.v)
        kq, vq, k_hat, v_hat = encode(self.layer_idx, k_pre, v_t, prev, self._predictors(k.device), self.qk, self.qv)
        if self.keeps:
            self.blocks[row] = _Recon(k_hat, v_hat, [m], offset)
        if self.memo_on is None:
            self.memo_on = wanted(k.device)
        if self.memo_on:  # what resolve would rebuild from these codes: the same arithmetic, done once
            h = k.shape[1]
            if self.memo is None:
                self.memo = ReadMemo(len(layer.dense_len), h, k.shape[3], k.dtype, k.device)
            k_rot = rotate(k_hat.view(m, h, -1), cos[:, None], sin[:, None])
            self.memo.append(row, offset, k_rot.transpose(0, 1), v_hat.view(m, h, -1).transpose(0, 1))
        return _seg(kq, vq, self.bits, m)

    def tile(self, batch: int) -> None:
        """The cache's rows repeated ``batch`` times (a benchmark's batch from one request): the kept read too."""
        if self.memo is not None:
            self.memo.tile(batch)

    def merge_rows(self, other, na: int, nb: int) -> None:
        """``other``'s rows (the same layer of a joining request's cache) after this layer's (``rows.merge_rows``)."""
        self.memo = ReadMemo.cat(self.memo, na, other.memo, nb)
        if self.memo_on is None:
            self.memo_on = other.memo_on

    def keep_rows(self, idx: torch.Tensor) -> None:
        if self.memo is not None:
            self.memo.take(idx)

    # --- read: Alg. 3 on every text token of the layer -----------------------------------------------------------
    def reconstruct(self, seg: AquaSeg, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE ``(K^, V^)`` fp32 ``[B, T, C]`` of the layer's text tokens (``T`` = the longest row); takes (and
        drops) the previous layer's reconstruction, keeps this one for the next layer."""
        lens = list(layer.text_len)
        width = max(lens)
        prev = None
        if self.predicts:
            src = layer.partner.text_method
            held = src.recon
            src.recon = None  # used once: the previous layer's reconstruction dies here
            if held is None or any(h < n for h, n in zip(held.lens, lens)):
                raise RuntimeError(f"aquakv: layer {self.layer_idx} is read but layer {self.layer_idx - 1}'s "
                                   "reconstruction of its text tokens is not held: layers must be read in order "
                                   "0..L-1 within a forward")
            prev = (held.k[:, :width], held.v[:, :width])
            del held
        k_hat, v_hat = decode(self.layer_idx, seg.codes("k", width), seg.codes("v", width), prev,
                              self._predictors(seg.lens.device), self.qk, self.qv)
        del prev
        self.recon = _Recon(k_hat, v_hat, lens) if self.keeps else None
        return k_hat, v_hat

    def _cos_sin(self, layer, width: int):
        """cos/sin of the layer's text tokens: every layer of a forward reads the same tokens, so the first layer
        computes them and the last one drops them."""
        tp = layer.positions
        key = (id(tp), tp.version, tuple(layer.text_len), width)
        memo = self.parent.__dict__.get("_cos_sin")
        if memo is None or memo[0] != key:
            memo = (key, *self.parent._rope.cos_sin(tp.rows(layer.spec.sinks, list(layer.text_len), width)))
            self.parent._cos_sin = memo
        if self.layer_idx == self.num_layers - 1:
            self.parent._cos_sin = None
        return memo[1], memo[2]

    def resolve(self, seg: AquaSeg, layer) -> DenseSeg:
        """The layer's text tokens as attention reads them: post-RoPE keys and values in the model dtype."""
        if self.memo_on:
            if self.memo is None or self.memo.lens != list(layer.text_len):
                raise RuntimeError(f"aquakv: layer {self.layer_idx}'s kept read holds "
                                   f"{None if self.memo is None else self.memo.lens} text tokens, the cache "
                                   f"{list(layer.text_len)}")
            return DenseSeg(self.memo.k, self.memo.v, seg.lens)
        k_hat, v_hat = self.reconstruct(seg, layer)
        b, width, _ = k_hat.shape
        h, dtype = layer.dense.k.shape[1], layer.dense.k.dtype
        cos, sin = self._cos_sin(layer, width)
        k = rotate(k_hat.view(b, width, h, -1), cos[:, :, None], sin[:, :, None])
        out_k = torch.empty(b, h, width, k.shape[-1], dtype=dtype, device=k.device)
        out_v = torch.empty_like(out_k)
        out_k.copy_(k.transpose(1, 2))  # cast and transpose in one pass
        out_v.copy_(v_hat.view(b, width, h, -1).transpose(1, 2))
        return DenseSeg(out_k, out_v, seg.lens)
