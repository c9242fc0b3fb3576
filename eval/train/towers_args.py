"""The command line of ``python -m eval.train.towers`` (its options; the trainer is ``eval/train/towers.py``)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from eval.train import anchor, dense


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval.train.towers", description=description)
    ap.add_argument("--model", default="demo-llava", choices=["demo-llava", "demo-internvl"])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--minutes", type=float, default=None,
                    help="plan: this much training time in all calls (the LR schedule's length)")
    ap.add_argument("--steps", type=int, default=None, help="plan: this many steps in all (without --minutes)")
    ap.add_argument("--stop-after", type=float, default=None,
                    help="end this call after this many minutes (checkpointed; the next call resumes)")
    ap.add_argument("--batch", type=int, default=32, help="rows of an image step (clip/tiled steps take fewer)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--aux", type=float, default=0.0,
                    help="weight of the dense auxiliary losses (eval/train/dense.py) on image steps; 0: off")
    ap.add_argument("--aux-kinds", default=",".join(dense.KINDS),
                    help=f"which auxiliary heads --aux trains, of {','.join(dense.ALL_KINDS)} (position: each "
                         "token's row and column; place: the same on the tokens under a scene's shapes only)")
    ap.add_argument("--aux-at", choices=["input", "output"], default="input",
                    help="where the --aux heads read the tokens: the projector's input, or its output (what the "
                         "language model reads)")
    ap.add_argument("--anchor", type=float, default=0.0,
                    help="weight of the loss anchoring visual tokens to SmolLM2's label-word embeddings "
                         "(eval/train/anchor.py) on image steps; 0: off")
    ap.add_argument("--anchor-decay", choices=["linear", "none"], default="linear",
                    help="linear: the anchor weight falls to 0 at the end of the plan")
    ap.add_argument("--anchor-tau", type=float, default=anchor.TAU, help="temperature of the anchor's cosine logits")
    ap.add_argument("--mix", default=None,
                    help="image steps' kinds, e.g. scene=0.55,text=0.12,document=0.18,chart=0.15 (default: IMAGE_MIX)")
    ap.add_argument("--pack", action="store_true",
                    help="each row: one image with all its questions and caption, as masked blocks "
                         "(eval/train/pack.py)")
    ap.add_argument("--positions", action="store_true",
                    help="with --pack: also every scene shape's side and left-of/right-of pairs, training only "
                         "(eval/train/rows.py position_questions)")
    ap.add_argument("--attention", choices=["sdpa", "flex"], default="sdpa",
                    help="with --pack: the language model's attention; flex: FlexAttention with a block mask that "
                         "skips masked tiles (CUDA only; the same loss)")
    ap.add_argument("--layers", type=int, default=None,
                    help="transformer layers of a new tower (default: VISION's 4, or the --init tower's); stored in "
                         "the plan")
    ap.add_argument("--init", type=Path, default=None,
                    help="start a new run from an exported tower folder (tower.safetensors) instead of random")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--workers", type=int, default=min(14, (os.cpu_count() or 2) - 1))
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                    help="torch.compile the transformer layers (auto: on CUDA only)")
    ap.add_argument("--export", action="store_true", help="also write tower.safetensors / tower.json at the end")
    ap.add_argument("--export-only", action="store_true", help="write tower.safetensors / tower.json from ckpt.pt")
    ap.add_argument("--sizes", action="store_true", help="print both towers' parameter counts and exit")
    return ap
