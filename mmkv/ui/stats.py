"""The live stats panel: numbers as HTML (with data- attributes the browser tests read) and plot frames.

Everything reads a stats dict with the keys of ``Engine.stream(...).stats`` (``cache_bytes``, ``effective_bits``,
``prefill_ms``, ``decode_tokens_per_s``, ``peak_memory_bytes``, ``prompt_tokens``, ``new_tokens``,
``fp16_equivalent_bytes``, ``spec``, ``timeline``).
"""

from __future__ import annotations

import html

import pandas as pd

from mmkv.ui.session import Session


def human_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def total_cache_bytes(stats: dict | None) -> int | None:
    if not stats or not stats.get("cache_bytes"):
        return None
    return int(sum(stats["cache_bytes"].values()))


def _num(v, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def stats_html(stats: dict | None, live: bool = False, label: str = "", gen: int = 0) -> str:
    """``gen`` (the session's answer counter) lets a browser test tell a new answer's panel from the last one."""
    if not stats:
        return (f'<div id="stats" data-state="empty" data-gen="{gen}">No answer yet: stats appear here while the '
                "model writes.</div>")
    total = total_cache_bytes(stats)
    fp16 = stats.get("fp16_equivalent_bytes")
    ratio = ""
    if fp16 and total:
        r = fp16 / total
        rel = f"{r:.1f}× smaller than" if r >= 1 else f"{1 / r:.1f}× the size of"
        ratio = f" · {rel} an FP16 cache ({human_bytes(fp16)})"
    rows = []
    prompt = stats.get("prompt_tokens") or {}
    bits = stats.get("effective_bits") or {}
    used = stats.get("cache_bytes_used") or {}
    for mod, nbytes in (stats.get("cache_bytes") or {}).items():
        b = bits.get(mod) if nbytes else None
        rows.append(f'<tr id="stat-mod-{html.escape(mod)}" data-bytes="{int(nbytes)}"><td>{html.escape(mod)}</td>'
                    f"<td>{prompt.get(mod, '–')}</td><td>{human_bytes(nbytes)}</td>"
                    f"<td>{human_bytes(used[mod]) if mod in used else '–'}</td><td>{_num(b, '.2f')}</td></tr>")
    state = "live" if live else "done"
    head = f"{html.escape(label)} · " if label else ""
    if bits.get("total") is not None:
        head += f"{bits['total']:.2f} bits/element overall · "
    return (
        f'<div id="stats" data-state="{state}" data-gen="{gen}">'
        f'<div class="mmkv-big" id="stat-cache-bytes" data-bytes="{total or 0}">KV cache {human_bytes(total)}{ratio}</div>'
        f'<div id="stat-spec">{head}spec <code>{html.escape(str(stats.get("spec", "")))}</code></div>'
        '<table class="mmkv-table"><tr><th>segment</th><th>prompt tokens</th><th>bytes held</th><th>in use</th><th>eff. bits</th></tr>'
        + "".join(rows) + "</table>"
        f'<div>prefill <b id="stat-prefill" data-ms="{stats.get("prefill_ms") or 0}">'
        f'{_num(stats.get("prefill_ms"), ".0f")} ms</b> · decode <b id="stat-tps">'
        f'{_num(stats.get("decode_tokens_per_s"), ".1f")} tok/s</b> · new tokens <b id="stat-new">'
        f'{stats.get("new_tokens", 0)}</b> · peak memory <b id="stat-peak">'
        f'{human_bytes(stats.get("peak_memory_bytes"))}</b></div></div>'
    )


def timeline_frames(stats: dict | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(tokens/s over steps, cache MiB over steps) for two LinePlots."""
    tl = ((stats or {}).get("timeline") or [])[1:]  # step 1 is the token prefill produced: no decode time yet
    steps = [p.get("step", i + 1) for i, p in enumerate(tl)]
    tps = pd.DataFrame({"step": steps, "tokens/s": [float(p.get("tokens_per_s") or 0) for p in tl]})
    mib = pd.DataFrame({"step": steps, "cache MiB": [float(p.get("cache_bytes") or 0) / 2**20 for p in tl]})
    return tps, mib


def compare_frames(quant: dict | None, fp16: dict | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(KV cache MiB, decode tok/s) for FP16 vs quantized. FP16 memory falls back to the exact fp16 equivalent the
    engine reports; FP16 speed needs a compare-mode run."""
    mem_rows, speed_rows = [], []
    if quant:
        fp16_mem = total_cache_bytes(fp16) if fp16 else quant.get("fp16_equivalent_bytes")
        if fp16_mem:
            mem_rows.append(("FP16", fp16_mem / 2**20))
        if total_cache_bytes(quant) is not None:
            mem_rows.append(("quantized", total_cache_bytes(quant) / 2**20))
        if fp16 and fp16.get("decode_tokens_per_s"):
            speed_rows.append(("FP16", float(fp16["decode_tokens_per_s"])))
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
    for key in ("cache_bytes", "effective_bits", "prompt_tokens"):
        if isinstance(snap.get(key), dict):
            snap[key] = dict(snap[key])
    snap["timeline"] = list(snap.get("timeline") or [])
    return snap
