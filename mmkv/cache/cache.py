"""MMKVCache: a transformers ``Cache`` whose layers store each token kind in its own layout (see layer.py)."""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache

from ..spec import CacheSpec
from . import placement
from . import segments as S
from .layer import MMKVLayer
from .positions import TextPositions
from .sliding import SlidingLayer

MODALITIES = ("visual", "text", "fp16")


class MMKVCache(Cache):
    """Modality-aware quantized KV cache.

    Before a forward that carries a prompt, call :meth:`set_inputs` with the attention mask (padding) and the
    visual-token mask of the new tokens; decode steps need nothing. ``nbytes()`` counts exactly the tensors held.
    ``windows`` (one entry per layer, ``Adapter.windows``) makes a layer with a window a ``SlidingLayer``: it keeps
    only its last ``window`` tokens, in fp16, and the spec's methods apply to the full-attention layers.
    """

    def __init__(self, spec: CacheSpec | str, num_layers: int, head_dim: int | None = None,
                 windows: tuple[int | None, ...] = ()):
        spec = CacheSpec.parse(spec)
        if head_dim is not None:
            spec.check(head_dim, num_layers)
        if windows and len(windows) != num_layers:
            raise ValueError(f"windows gives {len(windows)} layers, the cache has {num_layers}")
        self.spec = spec
        self._valid = None
        self._visual = None
        windows = tuple(windows) or (None,) * num_layers
        super().__init__(layers=[MMKVLayer(spec, i, num_layers) if w is None else SlidingLayer(spec, i, num_layers, w)
                                 for i, w in enumerate(windows)])
        self.positions = TextPositions() if spec.text.needs_positions else None
        for layer in self.layers:
            layer.positions = self.positions
            src = layer.text_method.share_from
            if src is not None and self.layers[src].is_sliding and not layer.is_sliding:
                # a sliding layer keeps no text codes to share: this layer stores its own
                layer.text_method = layer.text_method.without_partner(self.layers[src])
            elif src is not None:
                layer.partner = self.layers[src]

    @classmethod
    def for_model(cls, spec, adapter) -> MMKVCache:
        spec = CacheSpec.parse(spec)
        windows = getattr(adapter, "windows", ())
        for method in (spec.visual, spec.text):
            if method.needs_positions and any(w is not None for w in windows):
                raise ValueError(
                    f"{method.name} predicts each layer's keys from the layer before's quantized keys, and "
                    f"{adapter.name} has sliding-window layers, which keep no quantized text (only their last tokens "
                    "in fp16); use another text method with this model")
            if method.needs_positions and getattr(adapter, "mrope", False):
                from ..methods import METHODS

                others = ", ".join(n for n, m in METHODS.items() if "text" in m.modalities and not m.needs_positions)
                raise ValueError(
                    f"{method.name} stores keys before RoPE and re-applies 1-D RoPE when it reads them; "
                    f"{adapter.name} uses multimodal RoPE (M-RoPE: each token rotated by temporal/height/width "
                    f"positions), so its attention would be wrong. Use another text method with this model: {others}")
        spec = dataclasses.replace(spec, visual=spec.visual.bind(adapter), text=spec.text.bind(adapter))
        return cls(spec, adapter.num_layers, adapter.head_dim, windows)

    def set_inputs(self, attention_mask: torch.Tensor | None = None, visual_mask: torch.Tensor | None = None):
        """Padding and visual masks ``[B, T]`` of the tokens the next forward adds (``None``: all valid / none visual)."""
        self._valid = None if attention_mask is None else attention_mask.bool()
        self._visual = None if visual_mask is None else visual_mask.bool()

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        # Layer l-1 finished its attention before layer l updates: route its prompt now, keeping one layer in fp16.
        if layer_idx > 0:
            self.layers[layer_idx - 1].finalize()
        else:  # a new forward: what the last one left pending is routed first, so layers are always routed in order
            self.layers[-1].finalize()
            if self.positions is not None:
                self.positions.record(key_states.shape[0], key_states.shape[2], self._valid, self._visual,
                                      key_states.device)
        return self.layers[layer_idx].update(key_states, value_states, self._valid, self._visual)

    def finalize(self) -> None:
        """Route whatever prefill tokens are still pending (call after a prefill forward for exact stats)."""
        for layer in self.layers:
            layer.finalize()
        self._valid = self._visual = None

    # --- CUDA-graph decode support (mmkv/graphs.py) ---------------------------------------------------------------
    def decode_steps_free(self) -> int:
        """Decode steps that can replay a captured graph before some layer must flush or grow (0: run eagerly)."""
        if self._valid is not None or self._visual is not None:
            return 0
        return min((layer.decode_steps_free() for layer in self.layers), default=0)

    def advance_decode(self) -> None:
        for layer in self.layers:
            layer.advance_decode()

    def layout_signature(self) -> tuple:
        """The device memory a decode step reads and writes (addresses and shapes of every segment tensor): a graph
        captured under one signature stays valid exactly as long as the signature does."""
        sig = []
        for layer in self.layers:
            for _, seg, _ in layer.parts():
                sig.append((seg.lens.data_ptr(), seg.lens.numel()))
                for name, _ in S.token_fields(seg):
                    t = getattr(seg, name)
                    sig.append((t.data_ptr(), tuple(t.shape), t.stride()))
            sig.append(layer.pending is not None)
        return tuple(sig)

    # --- accounting ----------------------------------------------------------------------------------------------
    def nbytes_by_modality(self, used: bool = False) -> dict[str, int]:
        """Bytes per modality: held tensors (capacity included) or, with ``used=True``, what valid tokens occupy."""
        out = dict.fromkeys(MODALITIES, 0)
        for layer in self.layers:
            for modality, seg, lens in layer.parts():
                out[modality] += S.used_nbytes(seg, lens) if used else S.nbytes(seg)
            out["fp16"] += layer.pending_nbytes()
        if self.positions is not None:  # the text segment's tokens' positions count as text, the rest as fp16
            in_text = 4 * sum(self.layers[0].text_len)
            out["text"] += in_text
            out["fp16"] += self.positions.nbytes(used) - in_text
        return out

    def nbytes_by_layer(self, used: bool = False) -> list[int]:
        """Bytes each layer's segments hold (a sliding-window layer's stop growing at its window)."""
        return [sum(S.used_nbytes(seg, lens) if used else S.nbytes(seg) for _, seg, lens in layer.parts())
                for layer in self.layers]

    def nbytes(self, used: bool = False) -> int:
        return sum(self.nbytes_by_modality(used).values())

    def nbytes_by_device(self, used: bool = False) -> dict[str, int]:
        """Bytes per device (``{"cuda:0": n, "cuda:1": m}``) when the model is sharded (``placement.py``)."""
        return placement.nbytes_by_device(self, used)

    def tokens_by_modality(self) -> dict[str, int]:
        """Token count per modality summed over batch rows, of the first full-attention layer (they all hold every
        token; sliding-window layers hold only their window), or of layer 0 when every layer slides."""
        out = dict.fromkeys(MODALITIES, 0)
        if self.layers:
            layer = next((l for l in self.layers if not l.is_sliding), self.layers[0])
            for modality, _, lens in layer.parts():
                out[modality] += sum(lens)
        return out

    def _layer_elements(self) -> list[tuple[MMKVLayer, int]]:
        """Each layer holding tokens, with the K and V elements one of its tokens occupies."""
        return [(l, 2 * l.dense.k.shape[1] * l.dense.k.shape[3]) for l in self.layers if l.dense is not None]

    def elements_per_token(self) -> int:
        """K and V elements one token occupies over all layers and KV heads."""
        return sum(2 * layer.dense.k.shape[1] * layer.dense.k.shape[3] for layer in self.layers if layer.dense is not None)

    def effective_bits(self) -> dict[str, float]:
        """Bits per stored K/V element, by modality and overall (codes + scales + zeros; no capacity slack)."""
        used = self.nbytes_by_modality(used=True)
        elems = dict.fromkeys(MODALITIES, 0)  # per layer: its tokens of each kind (a sliding layer holds fewer)
        for layer, per_tok in self._layer_elements():
            for modality, _, lens in layer.parts():
                elems[modality] += sum(lens) * per_tok
        out = {m: 8.0 * used[m] / elems[m] if elems[m] else 0.0 for m in MODALITIES}
        n = sum(elems.values())
        out["total"] = 8.0 * sum(used.values()) / n if n else 0.0
        return out

    def dense_dtype(self) -> str:
        """The dtype of the sinks/window segment and of ``fp16_equivalent_bytes``' baseline, as a person names it:
        "fp16" on GPU, "fp32" when the model runs in fp32 on CPU."""
        dt = next((l.dense.k.dtype for l in self.layers if l.dense is not None), torch.float16)
        return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dt, str(dt).split(".")[-1])

    def fp16_equivalent_bytes(self) -> int:
        """What the same tokens would take in a plain cache of the model's dtype (fp16 on GPU; fp32 when the model
        runs in fp32 on CPU), the baseline a user compares against: transformers' own cache, which keeps a
        sliding-window layer's last ``window - 1`` tokens."""
        size = next((l.dense.k.element_size() for l in self.layers if l.dense is not None), 2)
        n = sum(self.tokens_by_modality().values())
        return size * sum(per_tok * (min(n, l.sliding_window - 1) if l.is_sliding else n)
                          for l, per_tok in self._layer_elements())
