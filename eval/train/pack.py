"""Shared-prefix packing for the demo towers' trainer (``python -m eval.train.towers --pack``): one training row holds
one image (or clip) once and then every one of its questions, and its caption, each as its own block.

Why: the towers saw about an order of magnitude fewer scene questions than perfect perception needed
(docs/BENCHMARKS.md, "Perfect perception through the frozen SmolLM2"), and a row's cost is its ~600 image and
template tokens, not its 2-30 answer tokens. Packed, a scene's ~10 questions cost ~1.3 rows instead of 10.

Exactness: block ``k`` sees the shared prefix (everything up to the image's last token, exactly the ids
``prepare_inputs`` makes) and itself, causally, at the positions it would have alone (a 4D attention mask and
``position_ids``), so each answer's loss is the one its own unpacked row gives (``tests/test_train_pack.py`` checks it
against the unpacked path). Each block weighs the same in the loss (``answer_w``: 1 / its answer's tokens), so a
caption's 25 tokens do not outweigh a "yes".
"""

from __future__ import annotations

import torch


def _common_suffix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    eq = (a[len(a) - n:] == b[len(b) - n:]).flip(0).long()
    return int(eq.cumprod(0).sum())


def split_prefix(adapter, processor, item: dict, prompts: list[str]):
    """(``prepare_inputs``' output for the first prompt, the expanded prefix ids every prompt shares, each prompt's
    ids after that prefix). The prefix ends where the first prompt's template text, placeholders expanded, stops
    ending as its unexpanded text does, and never before the last visual token: the processor touches the pixels
    once."""
    from mmkv.models.inputs import prepare_inputs, template_ids

    chats = [[{"role": "user", "content": [item, {"type": "text", "text": p}]}] for p in prompts]
    prep = prepare_inputs(adapter, chats[0], processor)
    full = prep.input_ids[0]
    raw = [template_ids(adapter, c, processor) for c in chats]
    tail = _common_suffix(full, raw[0])
    visual = adapter.visual_mask(full[None])[0].nonzero()
    if len(visual):  # a placeholder token can equal the expansion's last token: the image stays in the prefix
        tail = min(tail, len(full) - 1 - int(visual.max()))
    head = raw[0][:len(raw[0]) - tail]
    tails = []
    for p, r in zip(prompts, raw, strict=True):
        if len(r) < len(head) or not torch.equal(r[:len(head)], head):
            raise ValueError(f"the template puts question text before the image for {p!r}: no shared prefix")
        tails.append(r[len(head):])
    return prep, full[:len(full) - tail], tails


def encode_packed(adapter, processor, rows, end_id: int) -> dict:
    """Right-padded ``input_ids``, ``labels`` (-100 but on answers), ``seg`` (0: shared prefix, ``k``: block ``k``,
    -1: padding), ``position_ids``, ``answer_at`` / ``answer_w`` and the pixel tensors, for rows of (content item,
    [(prompt, answer), ...])."""
    tok = processor.tokenizer
    ids, labels, segs, pos, pixels = [], [], [], [], []
    for item, pairs in rows:
        prep, prefix, tails = split_prefix(adapter, processor, item, [q for q, _ in pairs])
        p = len(prefix)
        r_ids, r_lab, r_seg, r_pos = [prefix], [torch.full_like(prefix, -100)], [torch.zeros_like(prefix)], \
            [torch.arange(p)]
        for k, (tail, (_, answer)) in enumerate(zip(tails, pairs, strict=True), 1):
            ans = answer_ids(tok, answer, end_id)
            r_ids.append(torch.cat([tail, ans]))
            r_lab.append(torch.cat([torch.full_like(tail, -100), ans]))
            r_seg.append(torch.full((len(tail) + len(ans),), k))
            r_pos.append(torch.arange(p, p + len(tail) + len(ans)))
        ids.append(torch.cat(r_ids))
        labels.append(torch.cat(r_lab))
        segs.append(torch.cat(r_seg))
        pos.append(torch.cat(r_pos))
        pixels.append(prep.model_kwargs["pixel_values"])
    out = pad_right({"input_ids": (ids, tok.pad_token_id), "labels": (labels, -100), "seg": (segs, -1),
                     "position_ids": (pos, 0)})
    out["pixel_values"] = torch.cat(pixels)
    out["answer_at"] = answer_positions(out["labels"])
    out["answer_w"] = block_weights(out["labels"], out["seg"], out["answer_at"])
    out["answers"] = torch.tensor(sum(len(pairs) for _, pairs in rows))
    return out


def answer_ids(tok, answer: str, end_id: int) -> torch.Tensor:
    """The answer's token ids and the turn's end (``end_id``): what a row's labels train."""
    ids = tok(answer, add_special_tokens=False, return_tensors="pt").input_ids[0]
    return torch.cat([ids, ids.new_tensor([end_id])])


def pad_right(columns: dict) -> dict:
    """``{name: (rows of 1-D id tensors, fill)}`` -> ``{name: [rows, n] long tensor}``, every column right-padded
    with its fill to one width: the longest row rounded up to 16 (fewer distinct shapes for the GPU's kernels)."""
    n = max(len(r) for rows, _ in columns.values() for r in rows)
    n = -(-n // 16) * 16
    out = {}
    for name, (rows, fill) in columns.items():
        t = torch.full((len(rows), n), fill, dtype=torch.long)
        for r, x in enumerate(rows):
            t[r, :len(x)] = x
        out[name] = t
    return out


def answer_positions(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices ``r * n + j`` of the positions whose next token is an answer token: built in the data worker so
    that the training step picks them with ``index_select`` instead of a boolean mask (a host sync every step)."""
    n = labels.shape[1]
    r, j = (labels[:, 1:] != -100).nonzero(as_tuple=True)
    return r * n + j


def block_weights(labels: torch.Tensor, seg: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Weight of each picked answer token (``at``: flat positions predicting it): 1 / the tokens of its block's
    answer, so that every block adds the same weight to the loss."""
    target_seg = seg.reshape(-1)[at + 1]
    row = (at + 1) // seg.shape[1]
    key = row * (int(seg.max()) + 1) + target_seg
    _, inverse, counts = torch.unique(key, return_inverse=True, return_counts=True)
    return 1.0 / counts[inverse].float()


def attention_mask(seg: torch.Tensor) -> torch.Tensor:
    """``[B, 1, L, L]`` boolean mask (True: may attend): causal, and a token sees the shared prefix and its own
    block only. Padding (-1) forms its own block, so no row of the mask is empty (no NaN from the softmax)."""
    n = seg.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=seg.device).tril()
    key, query = seg[:, None, :], seg[:, :, None]
    return (((key == 0) | (key == query)) & causal)[:, None]


def block_mask(seg: torch.Tensor):
    """``attention_mask(seg)`` as FlexAttention's ``BlockMask``: the same pairs, but tiles with no pair that may
    attend (the upper triangle, other blocks' questions) are skipped, where cuDNN's SDPA computes every pair of a
    dense boolean mask (56% of a packed demo-llava step's device time, docs/BENCHMARKS.md)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, kv):
        return (kv <= q) & ((seg[b, kv] == 0) | (seg[b, kv] == seg[b, q]))

    n = seg.shape[1]
    return create_block_mask(mask_mod, seg.shape[0], None, n, n, device=seg.device)


FLEX = "flex_attention"


def use_flex(model, device) -> None:
    """The language model attends through FlexAttention with ``block_mask`` (``--attention flex``); CUDA only: torch
    has no FlexAttention backward on the CPU."""
    if device.type != "cuda":
        raise ValueError("--attention flex needs a CUDA device: FlexAttention has no backward pass on the CPU")
    model.model.language_model.set_attn_implementation(FLEX)


def flex_on(model) -> bool:
    """Whether ``use_flex`` switched this model's language model (False for a wrapper without one)."""
    lm = getattr(getattr(model, "model", None), "language_model", None)
    return lm is not None and getattr(lm.config, "_attn_implementation", None) == FLEX


def model_kwargs(batch: dict, flex: bool = False) -> dict:
    """The language model's mask arguments: the block mask (dense, or ``block_mask`` with ``flex``) and positions
    for packed batches, else the 2D padding mask."""
    if "seg" in batch:
        mask = block_mask(batch["seg"]) if flex else attention_mask(batch["seg"])
        return {"attention_mask": mask, "position_ids": batch["position_ids"]}
    return {"attention_mask": batch["attention_mask"]}
