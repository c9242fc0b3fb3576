"""A tower training run's start: resume from its checkpoint with the plan it stored, or begin (from ``--init``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eval.train.weights import init_from


def load_state(state: dict, model, opt, heads=None) -> None:
    """Put a checkpoint's tower, projector, heads and optimizer state into the run's objects."""
    model.model.vision_tower.load_state_dict(state["tower"])
    model.model.multi_modal_projector.load_state_dict(state["projector"])
    if heads is not None and "heads" in state:
        heads.load_state_dict(state["heads"])
    if opt is not None:
        opt.load_state_dict(state["opt"])


def read_checkpoint(ckpt: Path, args, plan: dict) -> dict | None:
    """The checkpoint's state (None without one), read once and checked against this call's options before any model
    is built: a resume with other auxiliary heads fails at once, not after the model's load."""
    if not ckpt.is_file():
        return None
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    stored = json.loads(state["plan"])
    stored_aux = stored.get("aux", 0.0)
    if stored_aux != args.aux:  # the heads' parameters are in the stored optimizer state, or are not
        raise SystemExit(f"{ckpt} was trained with --aux {stored_aux}; resume it with the same --aux")
    if stored.get("aux_kinds") != plan.get("aux_kinds"):  # other heads: other parameters
        raise SystemExit(f"{ckpt} was trained with auxiliary heads {stored.get('aux_kinds', 'default')}; "
                         "resume it with the same --aux-kinds")
    if stored.get("aux_at") != plan.get("aux_at"):  # heads of another width
        raise SystemExit(f"{ckpt} was trained with --aux-at {stored.get('aux_at', 'input')}; "
                         "resume it with the same --aux-at")
    return state


def start(args, state: dict | None, plan: dict, model, opt, heads) -> tuple[int, float, dict, list]:
    """(step, training seconds, plan, log): a checkpoint's (``read_checkpoint``; resumed with its stored plan), else a
    new run's, from ``--init`` when given."""
    if state is not None:
        stored = json.loads(state["plan"])
        load_state(state, model, opt, heads)
        step, trained_s = int(state["step"]), float(state["trained_s"])
        if stored != plan:
            print(f"resuming with the stored plan {stored} (this call asked for {plan})")
        print(f"resumed at step {step} after {trained_s:.0f} s of training")
        return step, trained_s, stored, json.loads((args.out / "log.json").read_text())
    if args.init is not None:
        init_from(model, args.init)
        print(f"initialized tower and projector from {args.init}")
    return 0, 0.0, plan, []
