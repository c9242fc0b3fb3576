"""Train a demo VLM's vision tower and projector on generated images and clips (``eval/synth``) with the real
SmolLM2 frozen.

    python -m eval.train.towers --model demo-llava --minutes 8.3 --stop-after 8.7 --batch 48 --workers 7 \
        --out runs/towers/demo-llava --export     # the shipped demo-llava tower: one call on one H100
    python -m eval.train.towers --model demo-llava --steps 3 --batch 2 --workers 0 --out /tmp/t   # CPU smoke run

Data. Each step is one batch of fresh items, produced by ``--workers`` DataLoader processes (step ``s`` is dataset
index ``s``, so a resumed run continues the same stream). A step's mode is drawn from ``random.Random("mmkv-train-
step/<s>")``: an image step (rows: scenes, text cards, documents, charts, at ``IMAGE_MIX``), a clip step (8-16-frame
clips, fewer rows: a clip is ``default_video_frames`` images) or, for demo-internvl, a tiled step (images on a
wider or larger canvas, dynamically tiled by the processor up to ``MAX_TILES``, fewer rows). Row ``i`` draws from
``random.Random("mmkv-train/<s>/<i>")``; the held-out sets (``eval.synth.generate``, any seed) seed from
``crc32(...)`` < 2**32, a string seed is a SHA-512-sized integer, so the two never share a stream. A row asks for the
caption (``CAPTION_SHARE``) or one of the item's questions, and is encoded by ``mmkv.models.inputs.prepare_inputs``
itself, so prompts, image tokens, tiling and video frames (``{"type": "video", "frames": ...}``: "Frame{i}: " +
one image per sampled frame, InternVL frames untiled) are exactly those of inference. Loss: next-token cross-entropy
on the answer and its ``<|im_end|>`` (``turn_end_id``) only; the LM head runs on those positions alone.

Model. The language model, embeddings and head are frozen (bf16 on CUDA): answers about text stay SmolLM2's. The
tower (``VISION``, ``config_for``; ``--layers N`` builds a new tower N layers deep, ``--init`` keeps its tower's
depth, stored in the plan) and projector train in fp32 under bf16 autocast, AdamW (fused on CUDA), linear warmup
then cosine decay to ``LR_FLOOR`` x lr at the end of the plan. On CUDA each transformer layer is ``torch.compile``d
(``compile_layers``; ``--compile off`` for eager): a profile of the step (``eval.train.step_profile``, H100) found
its time in unfused elementwise kernels, not in data (0.1 ms wait) or padding (4-9%). Plan: ``--minutes`` of
training time (summed over calls; the first step's compile counts) or ``--steps``. The plan is stored in the
checkpoint and a resumed run keeps it.

``--anchor W`` (``eval/train/anchor.py``) classifies each visual token the language model reads against SmolLM2's own
input-embedding rows of its patch's colour, shape and character words (same per-patch labels), weighted W and by
default decayed linearly to 0 at the end of the plan (``--anchor-decay``); nothing is added to the model.
``--mix scene=..,text=..,document=..,chart=..`` sets the image steps' kinds (default ``IMAGE_MIX``: scene questions
are ~20% of rows). Both are stored in the plan.

``--pack`` (``eval/train/pack.py``) puts an item's every question and its caption in one row, each its own block
behind the shared image prefix (a block mask and positions make each answer's loss the one its own row gives), each
block weighing the same; stored in the plan. ``--attention flex`` runs those rows' language model through
FlexAttention with the block mask, skipping masked tiles (CUDA only; the same loss; not stored: it changes speed,
not what is trained).

``--aux W`` adds dense auxiliary losses (``eval/train/dense.py``: per-patch colour, shape and characters, per-scene
count, from the generator's own labels; ``--aux-kinds`` picks them, ``position`` adds each token's row and column,
``place`` the same on the tokens under a scene's shapes) on image steps, weighted W, through heads on the projector's
input (``--aux-at output``: on its output, what the language model reads) that are checkpointed but never exported;
``--init DIR`` starts a new run from an exported tower instead of a random one.

Checkpoints (``ckpt.pt``: tower, projector, optimizer, step, plan, training seconds; read back with
``weights_only=True``) are written every ``--save-every`` steps, at the end, and on SIGTERM/SIGINT; ``--stop-after``
ends this call after that many minutes (a device call's limit) with the plan unfinished, and the next call with
the same ``--out`` resumes. ``--export`` writes the fp16 weights and their vision config (``tower.safetensors``,
``tower.json``) that ``mmkv.models.demo`` loads; ``--export-only`` does just that from the checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time

import torch

from eval.train import anchor, dense, pack
from eval.train.pack import answer_positions
from eval.train.resume import read_checkpoint, start
from eval.train.rows import (  # noqa: F401
    CAPTION_SHARE,
    CLIP_STEPS,
    IMAGE_MIX,
    TILED_STEPS,
    parse_mix,
    rows_for,
    sample,
    sample_item,
    sample_packed,
    step_mode,
)
from eval.train.towers_args import parser
from eval.train.weights import export, sizes
from mmkv.models.demo import tower_vision

LR_FLOOR = 0.05
# Tower size (issue 28: both fp16 exports <= 40 MB). The language model dominates a step's cost (135M frozen
# parameters over 300-4600 tokens a row, against a tower of ~7M), so the tower is sized by the shipping limit, not
# by compute. Width over depth: a 14 px patch of a 15 pt glyph row carries fine detail, and width 384 (heads of 64)
# keeps it where 256 would squeeze it; 4 layers (all read: demo-llava takes the last layer, see mmkv.models.demo),
# MLP 3x. llava 6.37M + 0.55M projector, internvl 6.54M + 1.22M (``python -m eval.train.towers --sizes``): 29.4 MB fp16.
VISION = {"hidden_size": 384, "intermediate_size": 1152, "num_hidden_layers": 4, "num_attention_heads": 6}


def config_for(name: str, layers: int | None = None) -> dict:
    """The tower's config: ``VISION``, with ``layers`` transformer layers where given (``--layers``)."""
    cfg = dict(VISION)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return cfg


TURN_END = "<|im_end|>"  # SmolLM2's end of a chat turn: what the engine stops on


def turn_end_id(tok) -> int:
    """The id of ``TURN_END``, appended as an id (not as text through ``tok.eos_token``): the first H100 run
    (2026-11-26, transformers 5.17 there) taught the towers to end answers with ``<|im_start|>`` (id 1) instead,
    so every answer ran on into a new turn at inference."""
    ids = tok.convert_tokens_to_ids([TURN_END])
    if len(ids) != 1 or ids[0] is None or ids[0] == tok.unk_token_id:
        raise ValueError(f"the tokenizer has no single {TURN_END!r} token")
    return int(ids[0])


def encode(adapter, processor, rows) -> dict:
    """Right-padded ``input_ids``, ``attention_mask``, ``labels`` (-100 on the prompt and padding) and the pixel
    tensors for rows of (content item, prompt, answer); each prompt is exactly what ``prepare_inputs`` makes."""
    from mmkv.models.inputs import prepare_inputs

    tok = processor.tokenizer
    ids, labels, pixels = [], [], []
    for item, prompt, answer in rows:
        chat = [{"role": "user", "content": [item, {"type": "text", "text": prompt}]}]
        prep = prepare_inputs(adapter, chat, processor)
        head = prep.input_ids[0]
        tail = pack.answer_ids(tok, answer, turn_end_id(tok))
        ids.append(torch.cat([head, tail]))
        labels.append(torch.cat([torch.full_like(head, -100), tail]))
        pixels.append(prep.model_kwargs["pixel_values"])
    mask = [torch.ones_like(x) for x in ids]
    out = pack.pad_right({"input_ids": (ids, tok.pad_token_id), "attention_mask": (mask, 0), "labels": (labels, -100)})
    out["pixel_values"] = torch.cat(pixels)
    out["answer_at"] = answer_positions(out["labels"])
    return out


class Steps(torch.utils.data.Dataset):
    """Dataset index = step; item = that step's encoded batch (built in a worker process); ``pack``: each row holds
    its item's every question and caption (``eval/train/pack.py``)."""

    def __init__(self, model: str, adapter, processor, batch: int, total: int, aux_grid: int | None = None,
                 mix: dict | None = None, pack: bool = False, positions: bool = False):
        self.model, self.adapter, self.processor, self.batch, self.total = model, adapter, processor, batch, total
        self.aux_grid = aux_grid  # tokens a side that the projector reads: image steps carry dense targets
        self.mix, self.pack, self.positions = mix, pack, positions

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, step: int) -> dict:
        mode = step_mode(step, self.model)
        rows = rows_for(mode, self.batch, self.adapter.default_video_frames)
        if self.pack:
            drawn = [sample_packed(step, i, mode, self.mix, self.positions) for i in range(rows)]
            out = pack.encode_packed(self.adapter, self.processor, [d[1:] for d in drawn],
                                     turn_end_id(self.processor.tokenizer))
        else:
            drawn = [sample_item(step, i, mode, self.mix) for i in range(rows)]
            out = encode(self.adapter, self.processor, [d[1:] for d in drawn])
        if self.aux_grid and mode == "image":
            out.update(dense.collate([dense.targets(d[0], self.aux_grid) for d in drawn]))
        out["step"] = torch.tensor(step)
        return out


def _worker_init(_):
    torch.set_num_threads(1)


def loader(ds: Steps, start: int, workers: int, pin: bool, prefetch: int = 4):
    kw = {"num_workers": workers, "batch_size": None, "sampler": range(start, len(ds)), "pin_memory": pin}
    if workers:
        kw.update(prefetch_factor=prefetch, persistent_workers=False, worker_init_fn=_worker_init)
    return torch.utils.data.DataLoader(ds, **kw)


def trainable(model) -> list:
    inner = model.model
    return [*inner.vision_tower.parameters(), *inner.multi_modal_projector.parameters()]


def build(name: str, device, vision: dict):
    from mmkv.models.demo import load_demo

    model, processor, adapter = load_demo(name, device, torch.float32, vision=vision, tower_dir="random")
    for p in model.parameters():
        p.requires_grad_(False)
    if device.type == "cuda":  # frozen: bf16 halves its traffic; the trained tower stays fp32 under autocast
        model.model.language_model.to(torch.bfloat16)
        model.lm_head.to(torch.bfloat16)
    for p in trainable(model):
        p.requires_grad_(True)
    model.train()
    return model, processor, adapter


def answer_loss(model, batch: dict) -> torch.Tensor:
    """Cross-entropy of the answer tokens; the LM head (49k x 576) runs on those positions only (``answer_at``:
    position ``p`` predicts the label at ``p + 1``); packed rows weigh each block alike (``answer_w``)."""
    hidden = model.model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"],
                         **pack.model_kwargs(batch, pack.flex_on(model))).last_hidden_state
    at = batch["answer_at"]
    logits = model.lm_head(hidden.reshape(-1, hidden.shape[-1]).index_select(0, at))
    ce = torch.nn.functional.cross_entropy(logits.float(), batch["labels"].reshape(-1).index_select(0, at + 1),
                                           reduction="none")
    w = batch.get("answer_w")
    return ce.mean() if w is None else (ce * w).sum() / w.sum()


def compile_layers(model) -> int:
    """``torch.compile`` each transformer layer of the language model and the tower in place (regional
    compilation: the layers of a stack share their compiled code, about a minute on the H100 box for both stacks,
    and the state_dict keys stay those of the uncompiled model). Why: at width 576 (LM) / 384 (tower) a step's time
    goes to unfused elementwise kernels (RMSNorm in fp32, rotary, SiLU x up, residual adds), not to the matmuls;
    fusing them is the throughput lever. Dynamic shapes: rows and lengths differ by step mode."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    inner, n = model.model, 0
    for stack in (inner.language_model, inner.vision_tower):
        for m in stack.modules():
            if isinstance(m, torch.nn.ModuleList) and m and all(type(x).__name__.endswith("Layer") for x in m):
                for layer in m:  # LlamaDecoderLayer, CLIPEncoderLayer, InternVLVisionLayer
                    layer.compile(dynamic=True)
                    n += 1
    return n


def lr_at(progress: float, step: int, args) -> float:
    warm = min(1.0, (step + 1) / args.warmup)
    cos = LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * warm * cos


def _step_losses(model, batch, dense_parts, anchor_parts, progress: float):
    """(answer loss, the loss to minimize, dense aux losses, anchor losses) of one step: the answer loss plus the
    weighted auxiliary ones that are on (``dense_parts``: heads, their held features, weight; ``anchor_parts``:
    anchors, the held projector output, the plan)."""
    heads, held, aux_w = dense_parts
    anchors, out_held, plan = anchor_parts
    loss = answer_loss(model, batch)
    aux = dense.losses(heads, held, batch)
    total = loss + aux_w * sum(aux.values()) if aux else loss
    anc = anchor.losses(anchors, out_held, batch)
    if anc:
        w = anchor.weight(plan["anchor"], progress, plan["anchor_decay"])
        total = total + w * sum(anc[k] for k in anchor.VOCABS) / len(anchor.VOCABS)
    return loss, total, aux, anc


def _device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return torch.device("cuda")


def _check_turn_end(model, tok) -> None:
    """Answers are trained to end with the turn's end token: the engine must stop on it."""
    from mmkv.engine import _eos_ids

    end, stops = turn_end_id(tok), _eos_ids(model, tok)
    print(f"tokenizer: eos {tok.eos_token!r} {tok.eos_token_id}, {TURN_END} {end}; engine stops on {sorted(stops)}",
          flush=True)
    if end not in stops:
        raise SystemExit(f"answers would end with id {end} but the engine stops on {sorted(stops)}")


def new_plan(args) -> dict:
    """What a new run stores and a resumed one keeps; options added later enter only when set, so that the plans of
    earlier runs stay equal to what they stored."""
    plan = {"minutes": args.minutes, "steps": args.steps, "batch": args.batch, "lr": args.lr, "aux": args.aux,
            "init": str(args.init) if args.init else None}
    if args.anchor > 0 or args.mix:
        plan.update(anchor=args.anchor, anchor_decay=args.anchor_decay, anchor_tau=args.anchor_tau,
                    mix=parse_mix(args.mix))
    if args.pack:
        plan["pack"] = True
    if args.positions:
        plan["positions"] = True
    if args.aux > 0 and aux_kinds(args) != dense.KINDS:
        plan["aux_kinds"] = list(aux_kinds(args))
    if args.aux > 0 and args.aux_at != "input":
        plan["aux_at"] = args.aux_at
    if args.layers is not None and args.layers != VISION["num_hidden_layers"]:
        plan["layers"] = args.layers
    return plan


def _check_args(ap, args) -> None:
    if args.out is None:
        ap.error("--out is required")
    if args.minutes is None and args.steps is None:
        ap.error("give the plan: --minutes (training time in all calls) or --steps")
    if args.positions and not args.pack:
        ap.error("--positions adds blocks to packed rows: give --pack too")
    if args.attention == "flex" and not args.pack:
        ap.error("--attention flex skips the masked tiles of packed rows: give --pack too")
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers must be at least 1, got {args.layers}")
    if args.init is not None:  # a run from an exported tower goes on at its depth
        held = tower_vision(args.init)["num_hidden_layers"]
        if args.layers is not None and held != args.layers:
            ap.error(f"--init {args.init} holds a tower of {held} layers, not --layers {args.layers}")
        args.layers = held
    if not set(aux_kinds(args)) <= set(dense.ALL_KINDS) or not aux_kinds(args):
        ap.error(f"--aux-kinds: some of {','.join(dense.ALL_KINDS)}, got {args.aux_kinds!r}")


def run_layers(args, state: dict | None) -> int | None:
    """The tower's depth: a resumed run's stored in its plan (none stored: ``VISION``'s), else ``--layers``."""
    return json.loads(state["plan"]).get("layers") if state else args.layers


def aux_kinds(args) -> tuple[str, ...]:
    return tuple(k.strip() for k in args.aux_kinds.split(",") if k.strip())


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__.split("\n\n")[0])
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are forked after the tokenizer is built
    if args.sizes:
        print(json.dumps(sizes(lambda name: config_for(name, args.layers)), indent=1))
        return 0
    _check_args(ap, args)
    device = _device()
    args.out.mkdir(parents=True, exist_ok=True)
    state = read_checkpoint(args.out / "ckpt.pt", args, new_plan(args))  # a mismatched resume fails before the build
    vision = config_for(args.model, run_layers(args, state))
    model, processor, adapter = build(args.model, device, vision)
    if args.attention == "flex":
        try:
            pack.use_flex(model, device)
        except ValueError as e:  # no CUDA: the one check, use_flex's, as a command-line error
            ap.error(str(e))
    tok = processor.tokenizer
    _check_turn_end(model, tok)
    if args.compile == "on" or (args.compile == "auto" and device.type == "cuda"):
        print(f"compiled {compile_layers(model)} layers", flush=True)
    heads, held, grid = None, {}, None
    if args.aux > 0:
        heads, held, grid = dense.attach(model, device, aux_kinds(args), args.aux_at)
        print(f"auxiliary heads {','.join(heads.kinds)} on {grid}x{grid} tokens at the projector's {args.aux_at}, "
              f"weight {args.aux}", flush=True)
    params = trainable(model) + (list(heads.parameters()) if heads is not None else [])
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, fused=device.type == "cuda")
    step, trained_s, plan, log = start(args, state, new_plan(args), model, opt, heads)
    mix = plan.get("mix") or dict(IMAGE_MIX)
    anchors, out_held = None, {}
    if plan.get("anchor", 0.0) > 0:
        anchors, out_held, grid = anchor.attach(model, tok, device, plan["anchor_tau"])
        print(f"anchoring {grid}x{grid} visual tokens to SmolLM2's label words, weight {plan['anchor']} "
              f"({plan['anchor_decay']} decay), tau {plan['anchor_tau']}; image mix {mix}", flush=True)
    caption = "every row (packed)" if plan.get("pack") else CAPTION_SHARE
    meta = {"model": args.model, "plan": plan, "mix": {"image": mix, "clip_steps": CLIP_STEPS,
                                                        "tiled_steps": TILED_STEPS, "caption": caption}}

    def save():
        torch.save({"tower": model.model.vision_tower.state_dict(),
                    "projector": model.model.multi_modal_projector.state_dict(), "opt": opt.state_dict(),
                    **({"heads": heads.state_dict()} if heads is not None else {}),
                    "step": torch.tensor(step), "trained_s": torch.tensor(trained_s), "plan": json.dumps(plan)},
                   args.out / "ckpt.tmp")
        os.replace(args.out / "ckpt.tmp", args.out / "ckpt.pt")  # a kill mid-write never leaves a torn checkpoint
        (args.out / "log.json").write_text(json.dumps(log))

    if args.export_only:
        print("wrote", export(model, vision, args.out, {**meta, "steps": step, "trained_s": trained_s}))
        return 0

    stop = {"sig": None}

    def on_signal(signum, _frame):
        stop["sig"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def progress() -> float:
        if plan["minutes"] is not None:
            return trained_s / (plan["minutes"] * 60)
        return step / plan["steps"]

    total = plan["steps"] if plan["steps"] is not None else 10 ** 9
    ds = Steps(args.model, adapter, processor, plan["batch"], total, aux_grid=grid, mix=mix,
               pack=plan.get("pack", False), positions=plan.get("positions", False))
    call_t0 = time.perf_counter()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    rows_seen, answers_seen, t_last, data_wait = 0, 0, time.perf_counter(), 0.0
    try:
        it = iter(loader(ds, step, args.workers, pin=device.type == "cuda"))
        while progress() < 1.0 and stop["sig"] is None:
            if args.stop_after is not None and time.perf_counter() - call_t0 > args.stop_after * 60:
                print(f"--stop-after {args.stop_after} min reached: checkpointing for the next call")
                break
            t_step = time.perf_counter()
            batch = next(it)
            data_wait += time.perf_counter() - t_step
            assert int(batch.pop("step")) == step
            answers_seen += int(batch.pop("answers", batch["input_ids"].shape[0]))
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            for g in opt.param_groups:
                g["lr"] = lr_at(progress(), step, args)
            with autocast:
                loss, total_loss, aux, anc = _step_losses(model, batch, (heads, held, args.aux),
                                                          (anchors, out_held, plan), progress())
            opt.zero_grad(set_to_none=True)
            total_loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            rows_seen += batch["input_ids"].shape[0]
            if step % 10 == 0 or step == 1 or step == total:
                loss_v = loss.item()  # syncs: only every 10 steps
                now = time.perf_counter()
                trained_s += now - t_last
                t_last = now
                extras = {**{f"aux {k}": v for k, v in aux.items()}, **{f"anchor {k}": v for k, v in anc.items()}}
                log.append({"step": step, "loss": loss_v, "t_s": trained_s, "lr": opt.param_groups[0]["lr"],
                            **{k: round(v.item(), 4) for k, v in extras.items()}})
                extra = " ".join(f"{k} {v.item():.2f}" for k, v in extras.items())
                print(f"step {step} loss {loss_v:.3f} {extra} lr {log[-1]['lr']:.2e} train {trained_s:.0f} s, "
                      f"{rows_seen / (now - call_t0):.1f} rows/s, {answers_seen / (now - call_t0):.1f} answers/s, "
                      f"waited for data {data_wait:.0f} s", flush=True)
            if step % args.save_every == 0:
                save()
        trained_s += time.perf_counter() - t_last
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    save()
    if stop["sig"] is not None:
        print(f"signal {stop['sig']}: checkpointed at step {step}")
    if args.export:
        print("wrote", export(model, vision, args.out, {**meta, "steps": step, "trained_s": trained_s}))
    print(f"{'done' if progress() >= 1.0 else 'unfinished'}: step {step}, {trained_s:.0f} s of training "
          f"({progress():.0%} of the plan)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
