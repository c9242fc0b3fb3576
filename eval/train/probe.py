"""Linear probes on a demo tower's features: does the tower see what the questions ask, whatever the language model
makes of it? (issue 28's diagnosis: a bad probe blames the tower, a good probe with bad answers blames the
projector-to-LM interface or the answer format.)

    python -m eval.train.probe --model demo-llava --tower assets/demo_towers/demo-llava --n 1200

Scenes come from ``eval.synth.make("scene", random.Random("mmkv-probe/<i>"))``: string seeds, like the trainer's, so
never one of the held-out seeds (``generate``'s crc32 seeds). Probes, each a softmax/logistic regression fitted on
the first 75% of the scenes and scored on the rest:

* global (mean over the image's tokens): the background's colour, the number of shapes, each colour's presence;
* local (the token of the patch under an object's centre): that object's colour, shape and size, and where it is:
  its side (left or right half) and which quarter of the width (chance 0.5 / ~0.25; the pixels of a patch say
  nothing about where it is, so their probe is the floor).
* any token (``token_positions``: 6000 tokens drawn at random from all images, mostly background): its own side and
  column of the grid (chance 0.5 / 1/grid). Why both: position heads on every token taught the background tokens
  where they are and not the tokens under an object (docs/BENCHMARKS.md), which only the two probes together show.

Word readout (no fitting): for the projector's output, the share of objects whose centre token lies nearest, by cosine,
to SmolLM2's embedding of the object's own colour (among the palette's words) and shape word (``eval/train/anchor.py``'s
anchors): whether the language model could read the label off the token as a word, what ``--anchor`` trains.

Features: the tower's last layer (what demo-llava's projector reads; for demo-internvl, pixel-shuffled to 16 x 16
tokens, the projector's input) and the projector's output (what the language model sees); for demo-llava the same
probes on the raw pixels of the patch (local) or the image's mean colour histogram (global) say what a probe gets
with no tower at all, and a random tower of the same size what it gets for free.

    python -m eval.train.probe --model demo-internvl --tower assets/demo_towers/demo-internvl --tower random --n 400
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from eval.synth.common import BACKGROUNDS, COLOURS
from eval.synth.make import make
from eval.synth.scenes import SHAPES

PATCH, GRID = 14, 24  # demo-llava: 336 px / 14 = 24 x 24 tokens


def scenes(n: int) -> list:
    return [make("scene", random.Random(f"mmkv-probe/{i}")) for i in range(n)]


def labels(items, grid: int = GRID) -> dict:
    """Per-image and per-object targets, with the token index of each object's centre in a ``grid`` x ``grid``
    token map of the image (demo-llava 24, demo-internvl 16 after its pixel shuffle)."""
    colours, bgs = sorted(COLOURS), sorted(BACKGROUNDS)
    g = {"background": [bgs.index(it.meta["background"]) for it in items],
         "count": [len(it.meta["objects"]) - 1 for it in items],
         "present": [[any(o["colour"] == c for o in it.meta["objects"]) for c in colours] for it in items]}
    obj = {"image": [], "token": [], "colour": [], "shape": [], "size": [], "side": [], "column": []}
    for k, it in enumerate(items):
        for o in it.meta["objects"]:
            obj["image"].append(k)
            size = it.meta["size"]
            obj["token"].append(int(o["y"] * grid // size) * grid + int(o["x"] * grid // size))
            obj["colour"].append(colours.index(o["colour"]))
            obj["shape"].append(SHAPES.index(o["shape"]))
            obj["size"].append(int(o["size"] == "large"))
            obj["side"].append(int(o["x"] >= it.meta["size"] / 2))  # what "on the left or the right?" asks
            obj["column"].append(int(o["x"] * 4 // it.meta["size"]))  # quarter of the width
    return {"global": g, "object": obj}


@torch.no_grad()
def features(model, processor, items, batch: int = 16) -> dict[str, torch.Tensor]:
    """Token features ``[n, 576, d]`` of the tower's last layer and of the projector's output, and raw pixels."""
    inner = model.model
    tower, proj, pix = [], [], []
    for s in range(0, len(items), batch):
        images = [it.image for it in items[s:s + batch]]
        pv = processor.image_processor(images, return_tensors="pt")["pixel_values"]
        h = inner.vision_tower(pv, output_hidden_states=True).hidden_states[-1][:, 1:]
        tower.append(h.half())
        proj.append(inner.multi_modal_projector(h).half())
        # the processor's own pixels, cut into the same 14 px patches: [n, 576, 588]
        p = pv.unfold(2, PATCH, PATCH).unfold(3, PATCH, PATCH)  # n, 3, 24, 24, 14, 14
        pix.append(p.permute(0, 2, 3, 1, 4, 5).reshape(pv.shape[0], GRID * GRID, -1).half())
    return {"tower": torch.cat(tower), "projector": torch.cat(proj), "pixels": torch.cat(pix)}


@torch.no_grad()
def features_internvl(model, processor, items, batch: int = 16) -> dict[str, torch.Tensor]:
    """demo-internvl's token features ``[n, 256, d]``: the projector's input (the tower's last layer, pixel-shuffled
    to 16 x 16 tokens: what ``--aux`` heads read) and its output (what the language model reads); one 448 px tile
    per scene (square images tile once)."""
    inner, grab = model.model, {}
    hook = inner.multi_modal_projector.register_forward_hook(
        lambda _m, i, o: grab.update(inp=i[0].detach().half(), out=o.detach().half()))
    tower, proj = [], []
    try:
        for s in range(0, len(items), batch):
            pv = processor.image_processor([it.image for it in items[s:s + batch]], return_tensors="pt",
                                           crop_to_patches=False)["pixel_values"]
            inner.get_image_features(pixel_values=pv)
            tower.append(grab["inp"])
            proj.append(grab["out"])
    finally:
        hook.remove()
    return {"tower": torch.cat(tower), "projector": torch.cat(proj)}


def fit_score(x: torch.Tensor, y: torch.Tensor, train: torch.Tensor, multi: bool = False, epochs: int = 300) -> float:
    """Held-out accuracy of a linear classifier (standardized inputs, weight decay, full-batch Adam)."""
    x = x.float()
    mu, sd = x[train].mean(0), x[train].std(0) + 1e-4
    x = (x - mu) / sd
    classes = y.shape[1] if multi else int(y.max()) + 1
    lin = torch.nn.Linear(x.shape[1], classes)
    opt = torch.optim.Adam(lin.parameters(), lr=1e-2, weight_decay=1e-4)
    loss_fn = torch.nn.BCEWithLogitsLoss() if multi else torch.nn.CrossEntropyLoss()
    for _ in range(epochs):
        opt.zero_grad()
        loss_fn(lin(x[train]), y[train].float() if multi else y[train]).backward()
        opt.step()
    with torch.no_grad():
        out = lin(x[~train])
        pred = out > 0 if multi else out.argmax(1)
        return float((pred == y[~train].bool() if multi else pred == y[~train]).float().mean())


def word_readout(proj: torch.Tensor, lab: dict, words: dict[str, torch.Tensor]) -> dict:
    """Share of objects whose centre token (``proj [n, 576, d]``) is nearest, by cosine, to its own colour / shape
    word among ``words`` (``anchor.label_words``: palette order, ``SHAPES`` order)."""
    from eval.train.anchor import anchor_logits
    from eval.train.dense import PALETTE_NAMES

    obj = {k: torch.tensor(v) for k, v in lab["object"].items()}
    tok = proj[obj["image"], obj["token"]]
    colours = sorted(COLOURS)
    colour_ids = torch.tensor([PALETTE_NAMES.index(c) for c in colours])[obj["colour"]]
    return {"object colour (nearest word)": float((anchor_logits(tok, words["colour"]).argmax(1) == colour_ids)
                                                  .float().mean()),
            "object shape (nearest word)": float((anchor_logits(tok, words["shape"]).argmax(1) == obj["shape"])
                                                 .float().mean())}


def token_positions(n: int, tokens: int, k: int = 6000, seed: int = 0) -> dict[str, torch.Tensor]:
    """``k`` (image, token) pairs drawn without replacement from ``n`` images of ``tokens`` tokens each (a square
    grid), with each token's column and side: the targets of the "token column" / "token side" probes."""
    grid = round(tokens ** 0.5)
    pick = torch.randperm(n * tokens, generator=torch.Generator().manual_seed(seed))[:min(k, n * tokens)]
    column = pick % tokens % grid
    return {"image": pick // tokens, "token": pick % tokens, "column": column, "side": column * 2 // grid}


def probe(feats: dict, lab: dict, n: int) -> dict:
    train_img = torch.arange(n) < int(0.75 * n)
    obj = {k: torch.tensor(v) for k, v in lab["object"].items()}
    train_obj = train_img[obj["image"]]
    out = {}
    for name, f in feats.items():
        pooled = f.float().mean(1)
        if name == "pixels":  # no tower: a mean-colour summary, the fair global baseline for a linear probe
            pooled = f.float().reshape(n, -1, 3, PATCH * PATCH).mean(3).reshape(n, -1)
        row = {t: fit_score(pooled, torch.tensor(lab["global"][t]), train_img, multi=t == "present")
               for t in ("background", "count", "present")}
        local = f[obj["image"], obj["token"]]
        row.update({f"object {t}": fit_score(local, obj[t], train_obj)
                    for t in ("colour", "shape", "size", "side", "column")})
        if name != "pixels":
            tok = token_positions(n, f.shape[1])
            x, train_tok = f[tok["image"], tok["token"]], train_img[tok["image"]]
            row.update({f"token {t}": fit_score(x, tok[t], train_tok) for t in ("side", "column")})
        out[name] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.train.probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo-llava", choices=["demo-llava", "demo-internvl"])
    ap.add_argument("--tower", action="append", required=True,
                    help="trained tower folder, or 'random' (a random tower of the trained one's size); repeatable")
    ap.add_argument("--n", type=int, default=1200, help="scenes (75%% fit, 25%% scored)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from mmkv.models.demo import load_demo

    torch.manual_seed(0)
    items = scenes(args.n)
    internvl = args.model == "demo-internvl"
    lab = labels(items, 16 if internvl else GRID)
    result = {"n": args.n, "objects": len(lab["object"]["image"]), "towers": {}}
    vision = None
    for t in args.tower:
        if t == "random":
            if vision is None:
                raise SystemExit("--tower random needs a trained --tower before it (for the size)")
            model, processor, _ = load_demo(args.model, "cpu", torch.float32, vision=vision, tower_dir="random")
        else:
            model, processor, _ = load_demo(args.model, "cpu", torch.float32, tower_dir=t)
            vision = model.config.vision_config.to_dict()
            vision = {k: vision[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                             "num_attention_heads")}
        feats = features_internvl(model, processor, items) if internvl else features(model, processor, items)
        if result["towers"]:
            feats.pop("pixels", None)
        result["towers"][t] = probe(feats, lab, args.n)
        from eval.train.anchor import label_words

        words = label_words(processor.tokenizer, model.get_input_embeddings().weight.detach())
        result["towers"][t]["projector"].update(word_readout(feats["projector"], lab, words))
        print(t, json.dumps(result["towers"][t], indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
