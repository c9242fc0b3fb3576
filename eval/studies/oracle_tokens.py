"""Perfect perception through the frozen SmolLM2 (issue 28): how far learned tokens carry the scene questions when
the "tower" is handed the generator's ground truth instead of pixels.

    python -m eval.studies.oracle_tokens --steps 300 --batch 32 --out results/oracle_tokens.json

The demo VLMs must answer shape, colour, count and position questions at >= 90% through the frozen
SmolLM2-135M-Instruct, from visual tokens made without seeing the question. This study removes perception: an
encoder reads each scene's objects (colour, shape, size, position) and background from the generator's labels, mixes
them with a small transformer (so that it can also form global facts such as a count, as a tower's attention can),
and writes ``2 x 5 + 1`` tokens where the image tokens go, in the demo prompt's place (the chat template's default
system turn, then the user turn). Only the encoder trains, on the answer loss, as the towers do; the language model
stays frozen. Its held-out accuracy on the demo study's scene questions (seed 1000) bounds what better towers could
reach with this language model at this amount of training: if perfect perception stays far below 90%, the target
is out of reach of any tower; if it gets there, perception is what the towers lack.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from torch import nn

from eval.synth.common import BACKGROUNDS, COLOURS, SIZE
from eval.synth.scenes import SHAPES

from ..jsonout import save_json

SLOTS = 5  # the generator's largest scene
PER_OBJECT = 2
BINS = 12
TRAIN_SEED = 11  # below 1000: never a held-out item
TURN_END = "<|im_end|>"


class OracleEncoder(nn.Module):
    """Scene labels -> ``1 + SLOTS * PER_OBJECT`` tokens of the language model's width."""

    def __init__(self, width: int, scale: float, dim: int = 256, layers: int = 2):
        super().__init__()
        self.colour = nn.Embedding(len(COLOURS), dim)
        self.shape = nn.Embedding(len(SHAPES), dim)
        self.size = nn.Embedding(2, dim)
        self.x = nn.Embedding(BINS, dim)
        self.y = nn.Embedding(BINS, dim)
        self.where = nn.Linear(3, dim)
        self.background = nn.Embedding(len(BACKGROUNDS), dim)
        self.slot = nn.Embedding(SLOTS + 1, dim)
        self.absent = nn.Parameter(torch.zeros(dim))
        block = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.mix = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.out = nn.Linear(dim, PER_OBJECT * width)
        self.bg_out = nn.Linear(dim, width)
        self.width, self.scale = width, scale

    def forward(self, feats: dict) -> torch.Tensor:
        present = feats["present"]  # [B, SLOTS] bool
        obj = (self.colour(feats["colour"]) + self.shape(feats["shape"]) + self.size(feats["size"])
               + self.x(feats["xbin"]) + self.y(feats["ybin"]) + self.where(feats["xyr"]))
        obj = torch.where(present[..., None], obj, self.absent)
        slots = torch.arange(SLOTS + 1, device=obj.device)
        seq = torch.cat([self.background(feats["background"])[:, None], obj], 1) + self.slot(slots)
        seq = self.mix(seq)
        b = seq.shape[0]
        toks = torch.cat([self.bg_out(seq[:, :1]), self.out(seq[:, 1:]).reshape(b, SLOTS * PER_OBJECT, self.width)], 1)
        return self.scale * toks / toks.norm(dim=-1, keepdim=True).clamp_min(1e-6)


def features(metas: list[dict]) -> dict:
    colours, bgs = sorted(COLOURS), sorted(BACKGROUNDS)
    b = len(metas)
    f = {k: torch.zeros(b, SLOTS, dtype=torch.long) for k in ("colour", "shape", "size", "xbin", "ybin")}
    f["xyr"] = torch.zeros(b, SLOTS, 3)
    f["present"] = torch.zeros(b, SLOTS, dtype=torch.bool)
    f["background"] = torch.tensor([bgs.index(m["background"]) for m in metas])
    for i, m in enumerate(metas):
        for j, o in enumerate(m["objects"]):
            f["colour"][i, j] = colours.index(o["colour"])
            f["shape"][i, j] = SHAPES.index(o["shape"])
            f["size"][i, j] = int(o["size"] == "large")
            f["xbin"][i, j] = min(BINS - 1, int(o["x"] / SIZE * BINS))
            f["ybin"][i, j] = min(BINS - 1, int(o["y"] / SIZE * BINS))
            f["xyr"][i, j] = torch.tensor([o["x"] / SIZE, o["y"] / SIZE, o["r"] / SIZE])
            f["present"][i, j] = True
    return f


class Prompt:
    """The demo prompt around the visual tokens: ``head`` (system turn, user turn start) is the same for every row,
    so its keys and values are computed once; ``tail(question)`` follows the tokens."""

    def __init__(self, tok, model, device):
        text = tok.apply_chat_template([{"role": "user", "content": "<V>"}], tokenize=False,
                                       add_generation_prompt=True)
        head, self.tail_fmt = text.split("<V>")
        self.tok, self.model = tok, model
        self.head = tok(head, add_special_tokens=False, return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            self.head_kv = model.model(input_ids=self.head, use_cache=True, **self.with_cache(None)).past_key_values
        self.end = tok.convert_tokens_to_ids(TURN_END)

    def with_cache(self, cache) -> dict:
        """The keyword the installed transformers names the cache with (``cache`` from 5.2x, else
        ``past_key_values``)."""
        from mmkv.cache.kwarg import cache_kwargs

        return cache_kwargs(self.model.model, cache)

    def cache(self, batch: int):
        from transformers import DynamicCache

        c = DynamicCache()
        for i, layer in enumerate(self.head_kv.layers):
            c.update(layer.keys.expand(batch, -1, -1, -1).contiguous(),
                     layer.values.expand(batch, -1, -1, -1).contiguous(), i)
        return c

    def tail(self, question: str) -> list[int]:
        return self.tok("\n" + question + self.tail_fmt, add_special_tokens=False).input_ids


def embed_rows(model, prompt: Prompt, vis: torch.Tensor, rows: list, with_answer: bool):
    """Right-padded embeddings [visual tokens, question tail, (answer, turn end)] and their labels."""
    emb = model.get_input_embeddings()
    dev = vis.device
    seqs, labels = [], []
    for (q, a), v in zip(rows, vis, strict=True):
        tail = prompt.tail(q)
        ans = prompt.tok(a, add_special_tokens=False).input_ids + [prompt.end] if with_answer else []
        ids = torch.tensor(tail + ans, device=dev)
        seqs.append(torch.cat([v, emb(ids)]))
        labels.append([-100] * (len(v) + len(tail) - 1) + ans + [-100])
    n = max(len(s) for s in seqs)
    x = torch.zeros(len(seqs), n, vis.shape[-1], device=dev, dtype=vis.dtype)
    y = torch.full((len(seqs), n), -100, device=dev)
    for i, (s, lab) in enumerate(zip(seqs, labels, strict=True)):
        x[i, :len(s)] = s
        y[i, :len(lab)] = torch.tensor(lab, device=dev)
    return x, y, [len(s) for s in seqs]


def answer_loss(model, prompt, enc, metas, rows, device) -> torch.Tensor:
    vis = enc({k: t.to(device) for k, t in features(metas).items()})
    x, y, _ = embed_rows(model, prompt, vis, rows, with_answer=True)
    h = model.model(inputs_embeds=x, **prompt.with_cache(prompt.cache(len(rows)))).last_hidden_state
    at = (y != -100).nonzero(as_tuple=True)
    logits = model.lm_head(h[at]).float()
    return nn.functional.cross_entropy(logits, y[at])


@torch.no_grad()
def answer(model, prompt, enc, meta, question, device, max_new: int = 6) -> str:
    vis = enc({k: t.to(device) for k, t in features([meta]).items()})
    x, _, _ = embed_rows(model, prompt, vis, [(question, "")], with_answer=False)
    cache = prompt.cache(1)
    out = []
    for _ in range(max_new):
        h = model.model(inputs_embeds=x, use_cache=True, **prompt.with_cache(cache)).last_hidden_state
        nxt = int(model.lm_head(h[0, -1]).argmax())
        if nxt == prompt.end:
            break
        out.append(nxt)
        x = model.get_input_embeddings()(torch.tensor([[nxt]], device=device))
    return prompt.tok.decode(out).strip()


def held_out(n: int, seed: int) -> list[dict]:
    """The scene questions of ``demo_quality --tasks vqa --n n --seed seed``, each with its scene's labels."""
    from .demo_quality import questions

    return [x for x in questions("vqa", n, seed) if x["kind"] == "scene"]


def evaluate(model, prompt, enc, samples, device) -> dict:
    from .demo_quality import normalize_answer

    enc.eval()
    preds = [answer(model, prompt, enc, x["meta"], x["question"], device) for x in samples]
    enc.train()
    hit = [normalize_answer(p) == normalize_answer(x["answer"]) for x, p in zip(samples, preds, strict=True)]
    m = {"normalized": sum(hit) / len(hit), "n": len(hit)}
    for c in ("shape", "colour", "count", "position"):
        idx = [i for i, x in enumerate(samples) if x["category"] == c]
        if idx:
            m[c] = sum(hit[i] for i in idx) / len(idx)
    return {"metrics": m, "predictions": [{"id": x["id"], "question": x["question"], "gold": x["answer"],
                                           "prediction": p} for x, p in zip(samples, preds, strict=True)]}


def train_rows(n_scenes: int, seed: int) -> list:
    from eval.synth import generate

    return [(it.meta, q, a) for it in generate("scene", n_scenes, seed) for q, a in it.qa]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.studies.oracle_tokens", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--scenes", type=int, default=4000, help="training scenes (seed 11); every question of each")
    ap.add_argument("--n", type=int, default=200, help="demo_quality's vqa n: its scene share is evaluated")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from mmkv.models.smollm2 import ensure_converted, load_tokenizer

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    folder, _ = ensure_converted()  # the embedded GGUF, converted once and cached
    tok = load_tokenizer(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device)
    model.requires_grad_(False).eval()
    scale = float(model.get_input_embeddings().weight.norm(dim=-1).median())
    prompt = Prompt(tok, model, device)
    torch.manual_seed(0)
    enc = OracleEncoder(model.config.hidden_size, scale).to(device)
    opt = torch.optim.AdamW(enc.parameters(), lr=args.lr, weight_decay=0.0)
    rows, rng = train_rows(args.scenes, TRAIN_SEED), random.Random(0)
    samples = held_out(args.n, 1000)
    log, evals, t0 = [], [], time.perf_counter()
    for step in range(1, args.steps + 1):
        lr = args.lr * min(1.0, step / 20) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = rng.sample(rows, args.batch)
        loss = answer_loss(model, prompt, enc, [m for m, _, _ in batch], [(q, a) for _, q, a in batch], device)
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.append(loss.item())
        if step % 10 == 0:
            print(f"step {step} loss {sum(log[-10:]) / 10:.3f} {time.perf_counter() - t0:.0f} s", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            ev = evaluate(model, prompt, enc, samples, device)
            evals.append({"step": step, "rows": step * args.batch, **ev})
            print(f"step {step}: held-out {json.dumps(ev['metrics'])}", flush=True)
    result = {"config": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                         "device": str(device), "torch": torch.__version__, "train_rows_available": len(rows)},
              "losses": log, "evals": evals, "seconds": time.perf_counter() - t0}
    save_json(args.out, result)
    if args.out:
        print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
