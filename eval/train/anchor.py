"""Anchor a demo tower's projector to SmolLM2's own word embeddings: each visual token the language model reads is
classified, by cosine similarity, against the frozen input-embedding rows of the label words of its patch (the
colour under it, the shape under it, the character it holds), with the generator's per-patch labels
(``eval/train/dense.py``). Used only in training (``eval/train/towers.py --anchor W``); nothing is added to the
model, so nothing is exported.

Why: a linear probe reads every patch's colour from demo-llava's tokens perfectly, yet SmolLM2 names the colour 30%
of the time (docs/BENCHMARKS.md, "Why the towers barely see"), and separate auxiliary heads taught the tower its
labels without helping the answers: those heads' features live in a space of their own. Pulling a red square's
tokens towards the rows of " red" and " square" puts them where the frozen language model already knows the words
(SmolLM2 ties its input embeddings to its output head, so these are also the rows it answers with).

Logits: ``normalize(token) @ normalize(anchor)^T / tau`` over one label vocabulary at a time (the palette's 11
colours, the 3 shapes, the printable characters); cross-entropy where the label applies. A word's anchor is the
mean of its normalized token rows, averaged over its spellings in a sentence (" red") and at an answer's start
("red"); a character's is its own token's row.
"""

from __future__ import annotations

import torch

from eval.train.dense import CHARS, IGNORE, PALETTE_NAMES, SHAPES, aux_grid

TAU = 0.05  # label words' rows are close (cosine up to ~0.75 between colour words): a sharp softmax separates them
VOCABS = ("colour", "shape", "chars")


def word_vector(tok, embed: torch.Tensor, spellings: list[str]) -> torch.Tensor:
    """Unit vector of a label: mean over ``spellings`` of the normalized mean of their tokens' normalized rows."""
    vs = []
    for s in spellings:
        ids = tok(s, add_special_tokens=False).input_ids
        rows = torch.nn.functional.normalize(embed[ids].float(), dim=-1)
        vs.append(torch.nn.functional.normalize(rows.mean(0), dim=0))
    return torch.nn.functional.normalize(torch.stack(vs).mean(0), dim=0)


def label_words(tok, embed: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{vocab: [classes, dim]}`` unit anchors: colours in ``PALETTE_NAMES`` order, shapes in ``SHAPES`` order,
    characters in ``CHARS`` order (the dense targets' class order, shifted by the "none" class where it has one)."""
    def words(names):
        return torch.stack([word_vector(tok, embed, [" " + w, w]) for w in names])

    return {"colour": words(PALETTE_NAMES), "shape": words(SHAPES),
            "chars": torch.stack([word_vector(tok, embed, [c]) for c in CHARS])}


def anchor_targets(batch: dict) -> dict[str, torch.Tensor]:
    """Per-token class indices (``IGNORE`` where none applies) from the dense targets of a batch: colour as is,
    shape without its "none" class (a patch with no shape is not pulled to any shape word), and one character per
    patch (the one in its left half, else its right half; the token is a single vector)."""
    shape = batch["aux_shape"]
    chars = batch["aux_chars"]  # [rows, tokens, 2], 0 = none
    one = torch.where(chars[..., 0] > 0, chars[..., 0], chars[..., 1])
    return {"colour": batch["aux_colour"],
            "shape": torch.where(shape > 0, shape - 1, IGNORE),
            "chars": torch.where(one > 0, one - 1, IGNORE)}


def anchor_logits(tokens: torch.Tensor, anchors: torch.Tensor, tau: float = TAU) -> torch.Tensor:
    """``[..., classes]`` cosine similarities of ``tokens [..., dim]`` to unit ``anchors [classes, dim]``, over tau."""
    return torch.nn.functional.normalize(tokens.float(), dim=-1) @ anchors.t() / tau


def _ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # mean over the positions a label applies to, 0 (not NaN) where none does; no host sync
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2), target.flatten(), ignore_index=IGNORE,
                                             reduction="sum")
    return loss / (target != IGNORE).sum().clamp(min=1)


class Anchors(torch.nn.Module):
    """The label words' unit rows as buffers (frozen: nothing here trains)."""

    def __init__(self, vectors: dict[str, torch.Tensor], tau: float = TAU):
        super().__init__()
        self.tau = tau
        for name in VOCABS:
            self.register_buffer(name, vectors[name].float(), persistent=False)

    def forward(self, tokens: torch.Tensor, batch: dict) -> dict[str, torch.Tensor]:
        """Each vocabulary's cross-entropy and top-1 accuracy (``acc <vocab>``, detached) over the tokens
        ``[rows, tokens, dim]`` whose label applies."""
        out = {}
        for name, target in anchor_targets(batch).items():
            logits = anchor_logits(tokens, getattr(self, name), self.tau)
            out[name] = _ce(logits, target)
            valid = target != IGNORE
            hit = ((logits.argmax(-1) == target) & valid).sum()
            out[f"acc {name}"] = (hit / valid.sum().clamp(min=1)).detach()
        return out


def projector_output(model) -> dict:
    """A dict that holds the projector's latest output (``"y"``: ``[images, tokens, dim]``, what the language model
    reads in place of the image tokens) through a forward hook."""
    held: dict = {}
    model.model.multi_modal_projector.register_forward_hook(lambda _m, _a, out: held.__setitem__("y", out))
    return held


def attach(model, tok, device, tau: float = TAU) -> tuple[Anchors, dict, int]:
    """(anchors on ``device``, the dict holding the projector's latest output, tokens a side of one image)."""
    embed = model.get_input_embeddings().weight.detach()
    return Anchors(label_words(tok, embed), tau).to(device), projector_output(model), aux_grid(model)


def losses(anchors: Anchors | None, held: dict, batch: dict) -> dict[str, torch.Tensor]:
    """The anchor losses (and accuracies) of this step, or {} (off, or no dense targets: a clip or tiled step)."""
    if anchors is None or "aux_colour" not in batch or "y" not in held:
        return {}
    if held["y"].shape[0] != batch["aux_colour"].shape[0]:  # one image a row, else targets and tokens misalign
        return {}
    return anchors(held["y"], batch)


def weight(base: float, progress: float, decay: str) -> float:
    """The anchor loss's weight at ``progress`` (0..1) of the plan: constant, or falling linearly to 0 at the end so
    that the last steps train on the answers alone."""
    if decay == "linear":
        return base * max(0.0, 1.0 - progress)
    return base
