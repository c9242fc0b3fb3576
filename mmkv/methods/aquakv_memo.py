"""AQUA-KV on the CPU: the read's reconstruction of the flushed text tokens, kept instead of rebuilt every step.

A decode step's read (Alg. 3) rebuilds every text token of every layer from its codes: the quantizer's decode, the
predictor's matrix products over the previous layer's reconstruction and RoPE, for the whole context, each step.
On a 2-core CPU that was most of a step (SmolLM2, 2k tokens: ~0.3 tok/s against 10 for fp16, issue 34). Flushed
tokens never change (the text segment only grows, by whole blocks), and the flush already computes exactly the
reconstruction the read would (``encode`` returns ``K^, V^``, the same arithmetic as ``decode`` on the same
codes), so the layer keeps it, post-RoPE in the model dtype, and appends each flushed block.

The price is memory: the kept copy is as large as a plain cache of the text tokens in the model's dtype, on top of
the codes. ``cache.nbytes()`` still counts what the method stores (the codes); docs/AQUAKV.md says what the CPU
holds. ``MMKV_AQUAKV_CPU_MEMO=0`` rebuilds every step instead (what a GPU always does: there the read is one pass
over the codes and memory is what the method saves).
"""

from __future__ import annotations

import torch

from kernels.switches import switch


def wanted(device: torch.device) -> bool:
    return device.type == "cpu" and switch("MMKV_AQUAKV_CPU_MEMO") != "0"


class ReadMemo:
    """Post-RoPE ``k, v [B, H, capacity, D]`` of one layer's flushed text tokens; row ``r`` holds ``lens[r]``."""

    def __init__(self, batch: int, heads: int, head_dim: int, dtype, device):
        self.k = torch.zeros(batch, heads, 0, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.lens = [0] * batch

    def append(self, row: int, offset: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Tokens ``offset ..`` of ``row``: ``k, v [H, m, D]`` (cast to the memo's dtype)."""
        if offset != self.lens[row]:
            raise RuntimeError(f"aquakv: row {row} flushes text tokens from {offset}, the kept read holds "
                               f"{self.lens[row]}")
        m = k.shape[1]
        cap = self.k.shape[2]
        if offset + m > cap:  # grow by half again, as the text segment does
            grown = max(offset + m, cap + cap // 2)
            for name in ("k", "v"):
                t = getattr(self, name)
                bigger = t.new_zeros(*t.shape[:2], grown, t.shape[3])
                bigger[:, :, :cap] = t
                setattr(self, name, bigger)
        self.k[row, :, offset:offset + m] = k
        self.v[row, :, offset:offset + m] = v
        self.lens[row] = offset + m

    def tile(self, batch: int) -> None:
        """The same rows repeated ``batch`` times (``eval.bench.common.tile_cache`` tiles the codes likewise)."""
        self.k = self.k.repeat(batch, 1, 1, 1)
        self.v = self.v.repeat(batch, 1, 1, 1)
        self.lens = self.lens * batch

    def take(self, idx: torch.Tensor) -> None:
        """Keep rows ``idx`` (a batch's requests leaving, ``mmkv/cache/rows.keep_rows``)."""
        self.k = self.k.index_select(0, idx.to(self.k.device))
        self.v = self.v.index_select(0, idx.to(self.v.device))
        self.lens = [self.lens[r] for r in idx.tolist()]

    @staticmethod
    def cat(a: ReadMemo | None, na: int, b: ReadMemo | None, nb: int) -> ReadMemo | None:
        """The rows of ``a`` (``na`` of them) then those of ``b`` (a request joining a batch, ``rows.merge_rows``);
        a side without a kept read (no flush yet) brings empty rows."""
        if a is None and b is None:
            return None
        ref = a if a is not None else b
        h, d = ref.k.shape[1], ref.k.shape[3]
        a = a if a is not None else ReadMemo(na, h, d, ref.k.dtype, ref.k.device)
        b = b if b is not None else ReadMemo(nb, h, d, ref.k.dtype, ref.k.device)
        cap = max(a.k.shape[2], b.k.shape[2])
        out = ReadMemo(0, h, d, ref.k.dtype, ref.k.device)
        for name in ("k", "v"):
            parts = [t if t.shape[2] == cap else torch.cat([t, t.new_zeros(*t.shape[:2], cap - t.shape[2], d)], 2)
                     for t in (getattr(a, name), getattr(b, name).to(ref.k.device))]
            setattr(out, name, torch.cat(parts))
        out.lens = a.lens + b.lens
        return out

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
