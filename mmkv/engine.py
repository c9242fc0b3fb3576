"""Streaming generation over an MMKVCache, with the stats the app, eval and bench report.

One request: prepare inputs (the model family's adapter) -> prefill (exact attention; the cache routes visual
spans, sinks, text and window at the end) -> decode one token per step through the ``mmkv`` attention, which
reads the stored segments directly. ``Stream`` is the generator; ``Engine.generate`` drains one.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .cache import MODALITIES, MMKVCache, cache_kwargs
from .graphs import DecodeStepper
from .models.cpu_forward import cpu_forward
from .models.inputs import prepare_inputs
from .models.last_row import last_row
from .models.mrope import prompt_positions, step_positions
from .models.sharding import model_devices
from .sampling import choose, validate
from .spec import CacheSpec


@dataclass
class GenerationOutput:
    tokens: torch.Tensor            # [B, new_tokens]
    text: list[str]
    stats: dict
    cache: MMKVCache
    fed_ids: torch.Tensor           # [B, n] every id the cache has seen (prompt + generated but the last)
    attention_mask: torch.Tensor    # [B, n] padding of fed_ids
    next_position: torch.Tensor     # [B] position id of the next token
    spec: CacheSpec = field(default_factory=CacheSpec)
    rope_delta: torch.Tensor | None = None  # [B] M-RoPE models: 3-D position of a text token minus its 1-D one


def _sync(devices) -> None:
    """Wait for every GPU the model runs on (one, or each shard of a sharded model)."""
    for device in devices if isinstance(devices, (list, tuple)) else [devices]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _eos_ids(model, tok) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tok.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}


CACHE_STATS_EVERY_S = 0.25


def first_positions(engine, ids, mask, kwargs):
    """Position ids of a fresh prompt and, for M-RoPE models, the per-row delta of its later text tokens."""
    if engine.adapter.mrope:  # [4, B, T]: the 1-D positions, then the model's own 3-D ones (models/mrope.py)
        return prompt_positions(engine.model, ids, mask, kwargs)
    return (mask.long().cumsum(-1) - 1).clamp(min=0), None


MEDIA_KWARGS = ("pixel", "image", "video", "second_per_grid", "token_type", "batch_num")


def without_media(kwargs: dict) -> dict:
    """The processor's outputs less the media and their per-token markers: what a forward of text tokens over a
    cache that already holds the prompt's images takes (a later chat turn, a later prefill chunk)."""
    return {k: v for k, v in kwargs.items() if not k.startswith(MEDIA_KWARGS)}


def prefill(engine, cache, ids, mask, full_mask, visual, positions, kwargs, tee=()) -> torch.Tensor:
    """One forward of new tokens into ``cache`` (routed when it returns); the last position's logits ``[B, V]``.

    ``tee``: more fresh caches (other specs) that take the same keys and values layer by layer. A prompt's attention
    is exact whatever the spec (the cache hands attention the fp16 keys and values it was given), so one forward
    fills them all as a forward of each would; each routes its own copy when the forward returns."""
    model = engine.model
    for c in (cache, *tee):
        c.set_inputs(mask, visual)
    if tee:
        own = cache.update

        def update(key_states, value_states, layer_idx, *args, **kw):
            for c in tee:
                c.update(key_states, value_states, layer_idx, *args, **kw)
            return own(key_states, value_states, layer_idx, *args, **kw)  # last: its tag is the one attention reads

        cache.update = update
    try:
        with torch.inference_mode(), cpu_forward(model), last_row(model, engine.devices):
            out = model(input_ids=ids, attention_mask=full_mask, position_ids=positions,
                        **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1, **kwargs)
            for c in (cache, *tee):
                c.finalize()
    finally:
        cache.__dict__.pop("update", None)
    return out.logits[:, -1].to(engine.device)  # a sharded model's LM head may sit on another GPU


class _Shared:
    """One prompt's prefill shared by the streams of ``Engine.streams``: the first stream's forward fills every
    spec's cache (``caches``: the later specs', by their index), then each later stream decodes from its own cache
    and a copy of the prompt's logits."""

    def __init__(self, caches: list):
        self.caches = dict(enumerate(caches, 1))
        self.state = None

    def keep(self, lead: Stream, logits: torch.Tensor, after: tuple) -> None:
        self.state = (lead.stats["prefill_ms"], dict(lead.stats["prompt_tokens"]), logits.clone(), after)

    def take(self, stream: Stream, index: int) -> tuple:
        prefill_ms, prompt_tokens, logits, after = self.state
        cache = self.caches.pop(index)
        # this stream's prefill is the first one's; its decode is its own, timed from when it starts
        stream.stats.update(prefill_ms=prefill_ms, prompt_tokens=prompt_tokens, shared_prefill=True)
        return (cache, logits, *after, time.perf_counter())  # decoding reads logits, never writes them


class Stream:
    """Iterate for text pieces of row 0; ``stats`` is live; ``output`` is set when generation ends."""

    def __init__(self, engine: Engine, inputs, spec, max_new_tokens=128, do_sample=False, temperature=1.0,
                 top_p=1.0, seed=None, stop: threading.Event | None = None, past: GenerationOutput | None = None,
                 video_frames=None, video_fps=None, _shared=None):
        """``_shared`` (``Engine.streams``): ``(_Shared, index)``, whose prefill the stream of index 0 makes for
        every spec and the others take (or make alone, if the first has not made it)."""
        validate(max_new_tokens, temperature, top_p)
        self._shared = _shared
        self.engine = engine
        self.spec = CacheSpec.parse(spec)
        self.inputs, self.past = inputs, past
        self.video = (video_frames, video_fps)
        self.max_new_tokens, self.do_sample = max_new_tokens, do_sample
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        self.stop_event = stop or threading.Event()
        self.stats: dict = {"spec": str(self.spec), "timeline": [], "new_tokens": 0}
        self.output: GenerationOutput | None = None
        self._cache_stats_t = None  # when the live cache figures were last counted (elapsed seconds)

    def stop(self) -> None:
        self.stop_event.set()

    def __iter__(self):
        shared, index = self._shared or (None, 0)
        if index:  # a later spec of Engine.streams: decode from the shared prefill, or prefill alone without one
            if shared.state is not None and index in shared.caches:
                yield from self._decode(*shared.take(self, index))
                return
            shared = None
        eng = self.engine
        adapter, device, devices = eng.adapter, eng.device, eng.devices
        prep = prepare_inputs(adapter, self.inputs, eng.processor, device=device, video_frames=self.video[0],
                               video_fps=self.video[1])
        ids, mask, visual, kwargs = prep.input_ids, prep.attention_mask, prep.visual_mask, dict(prep.model_kwargs)
        delta = None
        if self.past is not None:
            cache, ids, mask, visual, positions, kwargs, delta = eng._continue(self.past, ids, visual, kwargs,
                                                                               self.spec)
        else:
            cache = MMKVCache.for_model(self.spec, adapter)
            positions, delta = first_positions(eng, ids, mask, kwargs)
        text_pos = positions if delta is None else positions[0]
        fed_ids = ids if self.past is None else torch.cat([self.past.fed_ids, ids], 1)
        full_mask = mask if self.past is None else torch.cat([self.past.attention_mask, mask], 1)
        self.stats["prompt_tokens"] = {"visual": int((visual & mask.bool()).sum()),
                                       "text": int((~visual & mask.bool()).sum())}
        for d in devices:
            if d.type == "cuda":
                torch.cuda.reset_peak_memory_stats(d)

        tee = list(shared.caches.values()) if shared is not None else ()
        _sync(devices)
        t0 = time.perf_counter()
        logits = prefill(eng, cache, ids, mask, full_mask, visual, positions, kwargs, tee=tee)
        _sync(devices)
        t1 = time.perf_counter()
        self.stats["prefill_ms"] = (t1 - t0) * 1e3
        after = (fed_ids, full_mask, text_pos[:, -1] + 1, delta)
        if shared is not None:
            shared.keep(self, logits, after)
        yield from self._decode(cache, logits, *after, t1)

    def _decode(self, cache, logits, fed_ids, full_mask, next_pos, delta, t1):
        """The decode loop from a prefilled ``cache`` and its last logits (``t1``: when the prefill ended)."""
        eng = self.engine
        model, tok, device, devices = eng.model, eng.tokenizer, eng.device, eng.devices
        b = fed_ids.shape[0]
        gen = torch.Generator().manual_seed(self.seed) if self.seed is not None else None
        eos = _eos_ids(model, tok)
        pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(eos), 0)
        # Decode reads each row's stored tokens (per-row lens), never the attention mask: steps pass none, which is
        # also what lets them replay from a CUDA graph.
        step = DecodeStepper(model, cache, graphs=eng.graphs)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        new: list[torch.Tensor] = []
        shown = ""
        while True:
            nxt = choose(logits, self.do_sample, self.temperature, self.top_p, gen)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            new.append(nxt)
            done |= torch.isin(nxt, torch.tensor(sorted(eos), device=device)) if eos else done
            self._step_stats(cache, len(new) * b, time.perf_counter() - t1)
            text = tok.decode(torch.stack(new, 1)[0], skip_special_tokens=True)
            if len(text) > len(shown) and not text.endswith("\ufffd"):
                yield text[len(shown):]
                shown = text
            if bool(done.all()) or len(new) >= self.max_new_tokens or self.stop_event.is_set():
                break
            full_mask = torch.cat([full_mask, full_mask.new_ones(b, 1)], 1)
            fed_ids = torch.cat([fed_ids, nxt[:, None]], 1)
            with torch.inference_mode():
                pos = next_pos[:, None] if delta is None else step_positions(next_pos[:, None], delta)
                logits = step(nxt[:, None], pos).to(device)
            next_pos = next_pos + 1
        _sync(devices)
        tokens = torch.stack(new, 1)
        self.stats.update(step.stats())
        self._final_stats(cache, tokens.numel(), time.perf_counter() - t1, device, devices)
        self.output = GenerationOutput(tokens, tok.batch_decode(tokens, skip_special_tokens=True), self.stats,
                                       cache, fed_ids, full_mask, next_pos, self.spec, delta)

    def _step_stats(self, cache: MMKVCache, n_tokens: int, elapsed: float) -> None:
        self.stats["new_tokens"] = n_tokens
        self.stats["decode_tokens_per_s"] = n_tokens / elapsed if elapsed > 0 else 0.0
        # Counting the cache's bytes walks every segment of every layer (about 5 ms a step on a laptop's CPU, 6% of
        # a SmolLM2 step); a page polls twice a second, so the live figures are recounted at most every 0.25 s and
        # the final stats count them exactly.
        if self._cache_stats_t is None or elapsed - self._cache_stats_t >= CACHE_STATS_EVERY_S:
            self._cache_stats_t = elapsed
            self.stats["cache_bytes"] = cache.nbytes_by_modality()
            self.stats["cache_bytes_used"] = cache.nbytes_by_modality(used=True)  # the live headline compares these
            self.stats["effective_bits"] = cache.effective_bits()
            self.stats["fp16_equivalent_bytes"] = cache.fp16_equivalent_bytes()
            self.stats["cache_dtype"] = cache.dense_dtype()
            self.stats["cache_tokens"] = cache.tokens_by_modality()
        self.stats["timeline"].append({"step": len(self.stats["timeline"]) + 1, "t_s": elapsed,
                                       "tokens_per_s": self.stats["decode_tokens_per_s"],
                                       "cache_bytes": sum(self.stats["cache_bytes"].values())})

    def _final_stats(self, cache: MMKVCache, n_tokens: int, elapsed: float, device: torch.device,
                     devices: list) -> None:
        s = self.stats
        s["cache_bytes"] = cache.nbytes_by_modality()
        s["cache_bytes_used"] = cache.nbytes_by_modality(used=True)
        s["cache_tokens"] = cache.tokens_by_modality()
        s["effective_bits"] = cache.effective_bits()
        s["fp16_equivalent_bytes"] = cache.fp16_equivalent_bytes()
        s["cache_dtype"] = cache.dense_dtype()
        s["decode_tokens_per_s"] = n_tokens / elapsed if elapsed > 0 else 0.0
        s["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        if len(devices) > 1:  # sharded model: per GPU (docs/MULTIGPU.md)
            s["cache_bytes_by_device"] = cache.nbytes_by_device()
            s["peak_memory_bytes_by_device"] = {str(d): torch.cuda.max_memory_allocated(d) for d in devices
                                                if d.type == "cuda"}


class Engine:
    """Generation with a per-modality quantized cache for one loaded model."""

    def __init__(self, loaded, graphs: bool = True):
        """``graphs``: replay decode steps from CUDA graphs on GPU (mmkv/graphs.py); ``False`` runs every step
        eagerly (for debugging, or to time the eager path)."""
        self.model, self.processor, self.adapter = loaded
        self.graphs = graphs
        self.model.eval()
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.device = self.model.get_input_embeddings().weight.device  # where inputs go (the first shard)
        self.devices = model_devices(self.model)  # every device a sharded model runs on

    def stream(self, inputs, spec=None, **kw) -> Stream:
        return Stream(self, inputs, spec, **kw)

    def generate(self, inputs, spec=None, **kw) -> GenerationOutput:
        s = self.stream(inputs, spec, **kw)
        for _ in s:
            pass
        return s.output

    def generate_many(self, inputs, specs, **kw) -> list[GenerationOutput]:
        """``generate`` of the same inputs under each spec of ``specs``, with one prefill forward for all of them:
        the prompt's attention is exact under every spec, so the forward is the same; each spec's cache takes the
        keys and values and routes them its own way, then decodes alone. The outputs equal separate ``generate``
        calls' (tests/test_generate_many.py). Each later output's ``stats`` carry the shared ``prefill_ms`` and
        ``shared_prefill: True``. Every spec's cache is held from the prefill until its own decode ends (memory:
        the sum of the specs' caches). Fresh prompts only (no ``past``)."""
        outs = []
        for s in self.streams(inputs, specs, **kw):
            for _ in s:
                pass
            outs.append(s.output)
        return outs

    def streams(self, inputs, specs, **kw) -> list[Stream]:
        """One ``Stream`` of ``inputs`` per spec, sharing one prefill (``generate_many``): iterate them in order; the
        first one's forward fills every spec's cache. A later stream iterated when the first has made no prefill (it
        failed first) prefills alone."""
        specs = [CacheSpec.parse(s) for s in specs]
        if not specs:
            raise ValueError("generate_many needs at least one spec")
        if kw.get("past") is not None:
            raise ValueError("generate_many shares a fresh prompt's prefill; a later chat turn (past=...) takes "
                             "generate() per conversation")
        shared = _Shared([MMKVCache.for_model(s, self.adapter) for s in specs[1:]])
        return [self.stream(inputs, spec, _shared=(shared, i), **kw) for i, spec in enumerate(specs)]

    def _continue(self, past: GenerationOutput, ids, visual, kwargs, spec):
        """Next chat turn: prefill only what the cache has not seen, over the stored (quantized) history."""
        if str(spec) != str(past.spec):
            raise ValueError(f"a later turn must use the spec of the conversation ({past.spec}), got {spec}")
        if ids.shape[0] != 1 or past.fed_ids.shape[0] != 1:
            raise ValueError("multi-turn generation over a stored cache supports one conversation (batch 1)")
        old = past.fed_ids[0].to(ids.device)
        n = min(len(old), ids.shape[1] - 1)  # at least one new token must be fed to get logits
        common = int((old[:n] == ids[0, :n]).long().cumprod(0).sum())
        drop = len(old) - common
        if drop:
            for layer in past.cache.layers:
                layer.crop(drop)
            past.fed_ids = past.fed_ids[:, :common]
            past.attention_mask = past.attention_mask[:, :common]
            past.next_position = past.next_position - drop
        suffix, vis = ids[:, common:], visual[:, common:]
        positions = past.next_position[:, None] + torch.arange(suffix.shape[1], device=ids.device)[None]
        delta = None
        if getattr(self.adapter, "mrope", False):  # the whole conversation's positions, as a fresh run would number it
            full, delta = prompt_positions(self.model, ids, torch.ones_like(ids), kwargs)
            positions = torch.cat([positions[None], full[1:, :, common:]])
            if "mm_token_type_ids" in kwargs:
                kwargs["mm_token_type_ids"] = kwargs["mm_token_type_ids"][:, common:]
        if not bool(vis.any()):  # the images of the history are in the cache already: their pixels are not needed
            kwargs = without_media(kwargs)
        elif self.adapter.family == "gemma3":
            raise ValueError("Gemma 3's image tokens attend to each other in both directions, which new tokens over "
                             "a stored cache cannot do: give the images in the first turn (start a new conversation)")
        elif bool(visual[:, :common].any()) and any(k.startswith("pixel") for k in kwargs):
            if self.adapter.family != "llava":
                raise ValueError("a new image in a later turn is supported for LLaVA models; start a new "
                                 "conversation")
            kwargs["pixel_values"] = kwargs["pixel_values"][_count_spans(visual[0, :common]):]
        return past.cache, suffix, torch.ones_like(suffix), vis, positions, kwargs, delta

    @torch.inference_mode()
    def score(self, ids: torch.Tensor, spec=None, chunk: int = 1) -> dict:
        """Negative log-likelihood of ``ids [B, T]`` (B windows of equal length, scored together) with the
        compressed cache maintained autoregressively.

        ``chunk=1`` feeds one token per step: every prediction reads the cache exactly as decoding would. Larger
        chunks prefill ``chunk`` tokens at a time over the stored history (faster; the tokens of one chunk see each
        other in fp16, a slightly larger fp16 window).
        """
        spec = CacheSpec.parse(spec)
        ids = ids.to(self.device)
        if ids.dim() != 2 or ids.shape[1] < 2:
            raise ValueError("score() takes ids of shape [B, T] with T >= 2")
        cache = MMKVCache.for_model(spec, self.adapter)
        nll, n = 0.0, 0
        b, t = ids.shape
        linears = cpu_forward(self.model, self.devices)
        for start in range(0, t - 1, chunk):
            piece = ids[:, start : min(start + chunk, t - 1)]
            pos = torch.arange(start, start + piece.shape[1], device=self.device)[None].expand(b, -1)
            with linears:
                logits = self.model(input_ids=piece, position_ids=pos, **cache_kwargs(self.model, cache),
                                    use_cache=True).logits
            logits = logits.to(self.device)
            target = ids[:, start + 1 : start + 1 + piece.shape[1]]
            nll += F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), reduction="sum").item()
            n += target.numel()
        cache.finalize()
        stats = {"cache_bytes": cache.nbytes_by_modality(), "effective_bits": cache.effective_bits(),
                 "cache_tokens": cache.tokens_by_modality()}
        return {"nll": nll, "tokens": n, "ppl": float(torch.tensor(nll / n).exp()), "stats": stats}


def _count_spans(mask: torch.Tensor) -> int:
    m = mask.long()
    return int((m[1:] > m[:-1]).sum() + m[0])


__all__ = ["Engine", "GenerationOutput", "MODALITIES", "Stream"]
