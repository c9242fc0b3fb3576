"""Data-parallel ``mmkv-eval``: under ``accelerate launch`` (or ``torchrun``) each process takes a shard of the
samples, and the main process merges the shards into the table one process would have written.

    accelerate launch --multi_gpu --num_processes 8 -m eval.run coco_caption --model ... --out runs/coco

* The shard comes from accelerate's ``PartialState``: process ``i`` of ``N`` runs ``--shard i/N`` (every N-th
  sample from i, ``run.select``) on its own GPU (``cuda:<local rank>``), writing ``OUT/shards/i-of-N/`` — an ordinary
  resumable run folder, so rerunning the same command with the same N resumes every shard.
* Each process then sends its folder's files (config + JSONL records, a few MB) to the main process through
  ``gather_object`` on a gloo process group; the main process writes them under its own ``OUT/shards/`` (on several
  machines that is how the other machines' records arrive: no shared filesystem needed) and merges them into
  ``OUT`` with ``eval.merge``. The gather is the barrier: the main process merges only after every shard is done.
* gloo, not NCCL, carries the gather: only Python objects travel, and its timeout (``MMKV_EVAL_DIST_TIMEOUT_S``,
  default 48 h) is set long because shards of a long eval can finish hours apart.
* ``--device-map`` under the launcher shards each process's model over its own GPUs: with G GPUs on a machine and
  P processes on it, process p gets GPUs ``[p*G/P, (p+1)*G/P)`` (:func:`process_gpus`).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

from kernels.switches import SWITCHES, switch

from .results import KINDS

TIMEOUT_ENV = "MMKV_EVAL_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = int(SWITCHES[TIMEOUT_ENV].default)  # 48 h


def launched(environ=None) -> bool:
    """True inside a multi-process launch (``accelerate launch`` / ``torchrun`` set WORLD_SIZE)."""
    env = os.environ if environ is None else environ
    try:
        return int(env.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def shard_of(state) -> tuple[int, int]:
    """(I, N) of ``--shard I/N`` for this process, from accelerate's ``PartialState`` (or anything with
    ``process_index`` and ``num_processes``)."""
    i, n = int(state.process_index), int(state.num_processes)
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"process {i} of {n}: not a valid rank / world size")
    return i, n


def shard_dir(out: str | Path, rank: int, world: int) -> Path:
    return Path(out) / "shards" / f"{rank}-of-{world}"


def process_gpus(local_rank: int, local_world: int, n_gpus: int) -> list[int]:
    """The GPUs of one process when ``local_world`` processes share ``n_gpus`` GPUs of a machine (contiguous,
    equal shares; ValueError when they do not divide evenly or there are fewer GPUs than processes)."""
    if n_gpus < local_world or n_gpus % local_world:
        raise ValueError(f"{local_world} processes cannot share {n_gpus} GPUs evenly; launch a number of processes "
                         "that divides the GPU count")
    k = n_gpus // local_world
    return list(range(local_rank * k, (local_rank + 1) * k))


def restrict_max_memory(max_memory: dict | None, gpus: list[int]) -> dict:
    """``max_memory`` limited to this process's GPUs (every one of them: the free memory when not given)."""
    import torch

    out = {}
    for g in gpus:
        if max_memory and g in max_memory:
            out[g] = max_memory[g]
        else:
            out[g] = torch.cuda.mem_get_info(g)[0] if torch.cuda.is_available() else 0
    return out


def read_folder(folder: Path) -> dict[str, str]:
    """The files a run folder's table is rebuilt from (config.json, samples/*.jsonl, judge/*.jsonl), by path."""
    folder = Path(folder)
    files = {}
    if (folder / "config.json").is_file():
        files["config.json"] = (folder / "config.json").read_text()
    for kind in KINDS:
        for p in sorted((folder / kind).glob("*.jsonl")):
            files[f"{kind}/{p.name}"] = p.read_text()
    return files


def write_folder(folder: Path, files: dict[str, str]) -> None:
    """Write gathered files; a file that already holds the same text is left alone (the usual case on one
    machine, where every shard folder is already on the main process's disk)."""
    folder = Path(folder)
    for rel, text in files.items():
        if rel != "config.json" and not (rel.count("/") == 1 and rel.split("/")[0] in KINDS):
            raise ValueError(f"unexpected file {rel!r} from a shard")
        path = folder / rel
        if path.is_file() and path.read_text() == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@dataclass
class Context:
    """This process's place in the launch."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    device: object  # torch.device of this process (cuda:<local rank>, or cpu)
    state: object = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def gather(self, obj) -> list | None:
        """``obj`` of every process, in rank order, on the main process (None elsewhere). Blocks until all arrive."""
        import torch.distributed as dist

        out = [None] * self.world if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def close(self) -> None:
        """Tear the process group down before the interpreter exits: left to the destructors at exit, gloo's threads
        can outlive it, and a process then dies with ``terminate called without an active exception`` (SIGABRT)
        after its work is done (seen once in the CI suite's two-process launch)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def context() -> Context | None:
    """The launch this process belongs to, or None when it runs alone. Initializes accelerate's ``PartialState``
    (gloo process group, long timeout) and makes this process's GPU the current one."""
    if not launched():
        return None
    import torch
    from accelerate import PartialState

    timeout = datetime.timedelta(seconds=float(switch(TIMEOUT_ENV)))
    state = PartialState(cpu=not torch.cuda.is_available(), backend="gloo", timeout=timeout)
    rank, world = shard_of(state)
    local_rank = int(state.local_process_index)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = state.device if state.device.type == "cuda" else torch.device("cpu")
    return Context(rank, world, local_rank, local_world, device, state)


def run_sharded(opts: dict, ctx: Context, run, merge, loader=None, log=print) -> int:
    """One process's part of a data-parallel eval: run its shard, gather, and (main process) merge. Returns the
    exit code; the merged table is printed by the main process."""
    final = Path(opts["out"])
    shard = (ctx.rank, ctx.world)
    if opts.get("shard") is not None and tuple(opts["shard"]) != shard:
        raise ValueError(f"--shard {opts['shard'][0]}/{opts['shard'][1]} contradicts the launch (process "
                         f"{ctx.rank} of {ctx.world}); leave --shard out under accelerate launch")
    mine = shard_dir(final, *shard)
    opts = {**opts, "shard": shard, "out": str(mine)}
    if opts.get("device_map"):
        import torch

        if ctx.device.type == "cuda":
            gpus = process_gpus(ctx.local_rank, ctx.local_world, torch.cuda.device_count())
            opts["max_memory"] = restrict_max_memory(opts.get("max_memory"), gpus)
    else:
        opts["device"] = str(ctx.device)
    error = None
    try:
        run(opts, loader=loader, log=lambda *a: log(f"[process {ctx.rank}/{ctx.world}]", *a))
    except (ValueError, ImportError, FileNotFoundError) as e:
        error = f"{type(e).__name__}: {e}"
    payload = {"rank": ctx.rank, "error": error, "files": {} if error else read_folder(mine)}
    got = ctx.gather(payload)
    if not ctx.is_main:
        return 2 if error else 0
    failed = [p for p in got if p["error"]]
    if failed:
        for p in failed:
            log(f"mmkv-eval: process {p['rank']} failed: {p['error']}")
        return 2
    folders = []
    for p in got:
        folder = shard_dir(final, p["rank"], ctx.world)
        write_folder(folder, p["files"])
        folders.append(folder)
    merge(final, folders)
    return 0
