"""The live stats panel: numbers as HTML (with data- attributes the browser tests read) and plot frames.

Everything reads a stats dict with the keys of ``Engine.stream(...).stats`` (``cache_bytes``, ``effective_bits``,
``prefill_ms``, ``decode_tokens_per_s``, ``peak_memory_bytes``, ``prompt_tokens``, ``new_tokens``,
``fp16_equivalent_bytes``, ``spec``, ``timeline``).
"""

from __future__ import annotations

import html
import math

import pandas as pd

from mmkv.ui.session import Session


def human_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def total_cache_bytes(stats: dict | None, used: bool = False) -> int | None:
    """Bytes the cache holds (capacity included), or with ``used`` the bytes its valid tokens occupy."""
    key = "cache_bytes_used" if used else "cache_bytes"
    if not stats or not stats.get(key):
        return None
    return int(sum(stats[key].values()))


def _num(v, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def headline(stats: dict) -> str:
    """Bytes in use against a plain cache of the same tokens in the same dtype: held bytes include the window's and
    the segments' spare capacity, which the baseline does not, so comparing them would blame the method for it."""
    used, held = total_cache_bytes(stats, used=True), total_cache_bytes(stats)
    base, dtype = stats.get("fp16_equivalent_bytes"), stats.get("cache_dtype") or "fp16"
    if used is None:  # an engine that reports only held bytes: say so rather than compare unlike things
        return f"KV cache {human_bytes(held)} reserved"
    text = f"KV cache {human_bytes(used)} in use"
    if base and used:
        r = base / used
        rel = (f"{r:.1f}× smaller than" if r >= 1.05 else f"{1 / r:.1f}× the size of" if r <= 0.95
               else "about the size of")
        text += f" · {rel} a plain {dtype} cache of the same tokens ({human_bytes(base)})"
    text += f" · {human_bytes(held)} reserved"
    prompt = stats.get("prompt_tokens") or {}
    tokens = stats.get("cache_tokens") or {}
    if tokens and not (tokens.get("visual") or tokens.get("text")) and sum(prompt.values()):
        text += f" · every token is still in the {dtype} sinks and window: nothing is quantized yet"
    return text


def segment_name(mod: str, dtype: str) -> str:
    return f"sinks + window ({dtype})" if mod == "fp16" else mod


def stats_html(stats: dict | None, live: bool = False, label: str = "", gen: int = 0) -> str:
    """``gen`` (the session's answer counter) lets a browser test tell a new answer's panel from the last one."""
    if not stats:
        return (f'<div id="stats" data-state="empty" data-gen="{gen}">No answer yet: stats appear here while the '
                "model writes.</div>")
    total, used_total = total_cache_bytes(stats), total_cache_bytes(stats, used=True)
    dtype = stats.get("cache_dtype") or "fp16"
    rows = []
    prompt = stats.get("prompt_tokens") or {}
    bits = stats.get("effective_bits") or {}
    used = stats.get("cache_bytes_used") or {}
    for mod, nbytes in (stats.get("cache_bytes") or {}).items():
        b = bits.get(mod) if nbytes else None
        rows.append(f'<tr id="stat-mod-{html.escape(mod)}" data-bytes="{int(nbytes)}" data-used="{used.get(mod, 0)}">'
                    f"<td>{html.escape(segment_name(mod, dtype))}</td>"
                    f"<td>{prompt.get(mod, '–')}</td><td>{human_bytes(used[mod]) if mod in used else '–'}</td>"
                    f"<td>{human_bytes(nbytes)}</td><td>{_num(b, '.2f')}</td></tr>")
    state = "live" if live else "done"
    head = f"{html.escape(label)} · " if label else ""
    if bits.get("total") is not None:
        head += f"{bits['total']:.2f} bits/element overall · "
    return (
        f'<div id="stats" data-state="{state}" data-gen="{gen}">'
        f'<div class="mmkv-big" id="stat-cache-bytes" data-bytes="{used_total or 0}" data-reserved="{total or 0}" '
        f'data-baseline="{stats.get("fp16_equivalent_bytes") or 0}">{html.escape(headline(stats))}</div>'
        f'<div id="stat-spec">{head}spec <code>{html.escape(str(stats.get("spec", "")))}</code></div>'
        '<table class="mmkv-table"><tr><th>segment</th><th>prompt tokens</th><th>in use</th><th>reserved</th>'
        "<th>eff. bits</th></tr>"
        + "".join(rows) + "</table>"
        f'<div>prefill <b id="stat-prefill" data-ms="{stats.get("prefill_ms") or 0}">'
        f'{_num(stats.get("prefill_ms"), ".0f")} ms</b> · decode <b id="stat-tps">'
        f'{_num(stats.get("decode_tokens_per_s"), ".1f")} tok/s</b> · new tokens <b id="stat-new">'
        f'{stats.get("new_tokens", 0)}</b> · peak memory <b id="stat-peak">'
        f'{human_bytes(stats.get("peak_memory_bytes"))}</b></div>{shared_html(stats.get("shared"))}</div>'
    )


def shared_html(shared: dict | None) -> str:
    """``--shared`` (mmkv/ui/shared.py): this answer's decode batch, the KV bytes all answers' cache tensors hold
    (what the budget counts: spare and pad rows and capacity included) against the budget, and the bytes their
    tokens use; the decode speed above is this answer's own."""
    if not shared:
        return ""
    budget = shared.get("kv_budget")
    held = shared.get("kv_held", shared["kv_used"])
    return (f'<div id="stat-shared" data-batch="{shared["batch"]}" data-batch-max="{shared["batch_max"]}" '
            f'data-kv-used="{shared["kv_used"]}" data-kv-held="{held}" '
            f'data-kv-budget="{budget if budget is not None else ""}">'
            f'shared batch <b id="stat-batch">{shared["batch"]}</b> requests (at most {shared["batch_max"]} with '
            f'this answer) · {shared["waiting"]} waiting · KV held by all <b id="stat-kv-shared">'
            f'{human_bytes(held)} of {human_bytes(budget) if budget is not None else "no limit"}</b> '
            f'({human_bytes(shared["kv_used"])} in use by their tokens)</div>')


def timeline_frames(stats: dict | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(tokens/s over steps, cache MiB over steps) for two LinePlots."""
    tl = ((stats or {}).get("timeline") or [])[1:]  # step 1 is the token prefill produced: no decode time yet
    steps = [p.get("step", i + 1) for i, p in enumerate(tl)]
    tps = pd.DataFrame({"step": steps, "tokens/s": [float(p.get("tokens_per_s") or 0) for p in tl]})
    mib = pd.DataFrame({"step": steps, "cache MiB": [float(p.get("cache_bytes") or 0) / 2**20 for p in tl]})
    return tps, mib


def nice_top(frame: pd.DataFrame) -> float | None:
    """A y-axis top above the tallest bar, on a 1-2-5 step, so no bar runs past the last tick."""
    if frame.empty:
        return None
    top = float(frame.iloc[:, 1].max()) * 1.1
    if top <= 0:
        return None
    step = 10 ** math.floor(math.log10(top))
    return next(m * step for m in (1, 2, 5, 10) if m * step >= top)


def baseline_name(stats: dict | None) -> str:
    """The uncompressed run's bar label: the dtype it really holds (fp32 on CPU), not a promise of fp16."""
    return f"{(stats or {}).get('cache_dtype') or 'fp16'} cache"


def compare_frames(quant: dict | None, fp16: dict | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(KV cache MiB in use, decode tok/s) for the uncompressed cache vs quantized. Its memory falls back to the
    exact equivalent the engine reports; its speed needs a compare-mode run."""
    mem_rows, speed_rows = [], []
    if quant:
        base = baseline_name(quant)
        fp16_mem = (total_cache_bytes(fp16, used=True) if fp16 else None) or quant.get("fp16_equivalent_bytes")
        if fp16_mem:
            mem_rows.append((base, fp16_mem / 2**20))
        mine = total_cache_bytes(quant, used=True)
        if mine is not None:
            mem_rows.append(("quantized", mine / 2**20))
        if fp16 and fp16.get("decode_tokens_per_s"):
            speed_rows.append((base, float(fp16["decode_tokens_per_s"])))
        if quant.get("decode_tokens_per_s"):
            speed_rows.append(("quantized", float(quant["decode_tokens_per_s"])))
    mem = pd.DataFrame(mem_rows, columns=["run", "KV cache MiB"])
    speed = pd.DataFrame(speed_rows, columns=["run", "decode tok/s"])
    return mem, speed


def current(session: Session) -> tuple[dict | None, bool, str]:
    """(stats to show, live?, label): the in-flight generation's live dict, else the last finished answer's."""
    s = session.stream
    if s is not None and getattr(s, "stats", None):
        return s.stats, True, session.live_label
    return session.last_stats, False, ""


def snapshot(stats: dict | None) -> dict | None:
    """A copy safe to read while the decode thread keeps writing the live dict."""
    if not stats:
        return stats
    snap = dict(stats)
    for key in ("cache_bytes", "cache_bytes_used", "cache_tokens", "effective_bits", "prompt_tokens"):
        if isinstance(snap.get(key), dict):
            snap[key] = dict(snap[key])
    snap["timeline"] = list(snap.get("timeline") or [])
    return snap
