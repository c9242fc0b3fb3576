"""Train a demo VLM's vision tower and projector on generated images (``eval/synth``) with the real SmolLM2 frozen.

    python -m eval.train.towers --model demo-llava --minutes 20 --out runs/towers/demo-llava   # one H100
    python -m eval.train.towers --model demo-llava --steps 3 --batch 2 --out /tmp/t           # CPU smoke run

Each step draws a batch of fresh items (a scene, text card, document or chart; seeds ``0..`` in step order, so a
run repeats and never meets the held-out sets' seed 1000+), asks either for the caption or for one of the item's
questions, and trains on the next-token loss of the answer only (the prompt, image tokens included, is masked).
The language model, its embeddings and head are frozen: answers about text stay SmolLM2's. Checkpoints
(``ckpt.pt``: tower, projector, optimizer, step; read back with ``weights_only=True``) are written every
``--save-every`` steps and at the end, and a run with the same ``--out`` resumes from them, so training can span
several device calls. ``--export`` writes the fp16 weights and their vision config (``tower.safetensors``,
``tower.json``) that ``mmkv.models.demo`` loads.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from eval.synth.make import generate as synth

KINDS = ("scene", "text", "document", "chart")
CAPTION_PROMPT = "Describe the image in one sentence."
VISION = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4}


def sample(step: int, i: int):
    """(image, prompt, answer) of batch row ``i`` at ``step``."""
    rng = random.Random(step * 1009 + i)
    kind = rng.choice(KINDS)
    it = synth(kind, 1, seed=step * 64 + i)[0]
    if rng.random() < 0.3:
        return it.image, CAPTION_PROMPT, it.caption
    q, a = rng.choice(it.qa)
    return it.image, q, a


def encode(processor, rows, device):
    """Right-padded ``input_ids``, ``attention_mask``, ``labels`` (-100 on the prompt and padding) and the processor's
    image tensors for rows of (image, prompt, answer)."""
    tok = processor.tokenizer
    ids, labels, extra = [], [], {}
    for image, prompt, answer in rows:
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        head = processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        enc_head = processor(text=[head], images=[image], return_tensors="pt")
        tail = tok(answer + (tok.eos_token or ""), add_special_tokens=False, return_tensors="pt").input_ids[0]
        row = torch.cat([enc_head["input_ids"][0], tail])
        ids.append(row)
        labels.append(torch.cat([torch.full_like(enc_head["input_ids"][0], -100), tail]))
        for k, v in enc_head.items():
            if k not in ("input_ids", "attention_mask", "token_type_ids"):
                extra.setdefault(k, []).append(v)
    n = max(len(r) for r in ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    out = {"input_ids": torch.full((len(ids), n), pad), "attention_mask": torch.zeros(len(ids), n, dtype=torch.long),
           "labels": torch.full((len(ids), n), -100)}
    for r, (x, y) in enumerate(zip(ids, labels, strict=True)):
        out["input_ids"][r, :len(x)] = x
        out["attention_mask"][r, :len(x)] = 1
        out["labels"][r, :len(y)] = y
    for k, v in extra.items():
        out[k] = torch.cat(v)
    return {k: v.to(device) for k, v in out.items()}


def trainable(model) -> list:
    inner = model.model
    return [*inner.vision_tower.parameters(), *inner.multi_modal_projector.parameters()]


def build(name: str, device, vision: dict):
    from mmkv.models.demo import load_demo

    model, processor, _ = load_demo(name, device, torch.float32, vision=vision)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in trainable(model):
        p.requires_grad_(True)
    model.train()
    return model, processor


def export(model, vision: dict, out: Path) -> Path:
    from safetensors.torch import save_file

    inner = model.model
    tensors = {f"{prefix}.{k}": v.detach().half().cpu().contiguous()
               for prefix, module in (("vision_tower", inner.vision_tower),
                                      ("multi_modal_projector", inner.multi_modal_projector))
               for k, v in module.state_dict().items()}
    save_file(tensors, str(out / "tower.safetensors"))
    (out / "tower.json").write_text(json.dumps({"vision": vision}, indent=1))
    return out / "tower.safetensors"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.train.towers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo-llava", choices=["demo-llava", "demo-internvl"])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--minutes", type=float, default=None, help="stop after this much training time")
    ap.add_argument("--steps", type=int, default=100000, help="stop after this many steps (in total)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--export", action="store_true", help="also write tower.safetensors / tower.json at the end")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt = args.out / "ckpt.pt"
    model, processor = build(args.model, device, VISION)
    opt = torch.optim.AdamW(trainable(model), lr=args.lr, weight_decay=0.01)
    step, log = 0, []
    if ckpt.is_file():
        state = torch.load(ckpt, map_location=device, weights_only=True)
        model.model.vision_tower.load_state_dict(state["tower"])
        model.model.multi_modal_projector.load_state_dict(state["projector"])
        opt.load_state_dict(state["opt"])
        step, log = int(state["step"]), json.loads((args.out / "log.json").read_text())
        print(f"resumed at step {step}")

    def save():
        torch.save({"tower": model.model.vision_tower.state_dict(),
                    "projector": model.model.multi_modal_projector.state_dict(), "opt": opt.state_dict(),
                    "step": torch.tensor(step)}, ckpt)
        (args.out / "log.json").write_text(json.dumps(log))

    t0 = time.perf_counter()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu",
                                                                                                          enabled=False)
    while step < args.steps and (args.minutes is None or time.perf_counter() - t0 < args.minutes * 60):
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / args.warmup)
        batch = encode(processor, [sample(step, i) for i in range(args.batch)], device)
        with autocast:
            loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable(model), 1.0)
        opt.step()
        step += 1
        loss_v = loss.detach().item()
        log.append({"step": step, "loss": loss_v, "t_s": time.perf_counter() - t0})
        if step % 10 == 0 or step == 1:
            print(f"step {step} loss {loss_v:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if step % args.save_every == 0:
            save()
    save()
    if args.export:
        print("wrote", export(model, VISION, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
