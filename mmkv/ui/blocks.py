"""The Gradio Blocks: layout and event wiring. Handlers are the plain functions in ``chat.py``/``stats.py``/
``lens_tab.py``; this file only adapts them to components. Generation, model loading and the lens share one GPU
queue (``concurrency_id="gpu"``, one at a time); Stop and the stats timer run outside it."""

from __future__ import annotations

import gradio as gr

from mmkv.ui import api, chat, examples, lens_tab, stats
from mmkv.ui.compare import COLORS
from mmkv.ui.models import MODEL_BOX_HELP, ModelHost, badge_html, model_choices
from mmkv.ui.session import drop_session, new_session
from mmkv.ui.spec_controls import CacheControls, check_spec, registry
from mmkv.ui.uploads import IMAGE_EXTS, VIDEO_EXTS, Limits

# UI events are private: a script calls the named endpoints of ``api.py``, not the page's internals.
HIDDEN = {"api_visibility": "private"}
GPU = {"concurrency_id": "gpu", "concurrency_limit": 1, **HIDDEN}
QUICK = {"queue": False, "show_progress": "hidden", **HIDDEN}
RUNS = {"fp16 cache": "#6b7280", "fp32 cache": "#6b7280", "bf16 cache": "#6b7280", "quantized": "#f97316"}
CSS = """
.mmkv-badge {background:#fef3c7;color:#92400e;border:1px solid #f59e0b;border-radius:6px;padding:1px 6px;font-weight:600}
.mmkv-error {color:#b91c1c;font-weight:600}
.mmkv-big {font-size:1.3em;font-weight:700;margin:4px 0}
.mmkv-table td, .mmkv-table th {padding:2px 8px}
"""
INTRO = ("# mmkv · multimodal chat with a 1–4 bit KV cache\n"
         "Visual tokens go to CalibQuant, text tokens to a text method, sinks and the recent window stay FP16. "
         "The panel on the right shows, live, the exact bytes the cache holds and what decoding costs.")


def build_app(host: ModelHost, limits: Limits | None = None, default_model: str | None = None,
              max_new_tokens: int = 64, shared: bool = False) -> gr.Blocks:
    """``shared``: the host's engine is a ``SharedEngine`` (launch.py ``--shared``): chat answers run at once, in
    one batch, instead of one at a time in the GPU queue."""
    limits = limits or Limits()
    answering = {"concurrency_id": "shared", "concurrency_limit": None, **HIDDEN} if shared else GPU
    methods = registry()
    with gr.Blocks(title="mmkv", delete_cache=(1800, 3600)) as demo:
        # Filled by the page's load event: a callable State value would add a public /new_session endpoint.
        session = gr.State(None, delete_callback=drop_session)
        gr.Markdown(INTRO)
        with gr.Row(equal_height=True):
            names = model_choices()
            picked = default_model or (host.info or {}).get("name") or names[0]
            model_box = gr.Dropdown(names, value=picked, allow_custom_value=True, scale=3, elem_id="model-name",
                                    label="Model (a name from the list, a hub id, or a local folder)",
                                    info=MODEL_BOX_HELP)
            load_btn = gr.Button("Load", scale=1, elem_id="load-model")
        model_status = gr.HTML(badge_html(host.info, host.error), elem_id="model-status-box")
        with gr.Tabs():
            with gr.Tab("Chat", id="chat"):
                with gr.Row():
                    with gr.Column(scale=3):
                        with gr.Row():
                            fp16_chat = gr.Chatbot(label="FP16 cache", visible=False, elem_id="fp16-chat", height=460)
                            chatbot = gr.Chatbot(label="Answer", elem_id="chat", height=460)
                        diff = gr.HighlightedText(label="Token diff: FP16 vs quantized", visible=False,
                                                  color_map=COLORS, combine_adjacent=False, elem_id="diff")
                        box = gr.MultimodalTextbox(
                            placeholder="Ask something; attach images (several) or a video.",
                            file_count="multiple", file_types=list(IMAGE_EXTS + VIDEO_EXTS), elem_id="msg",
                            show_label=False, sources=["upload"])
                        with gr.Row():
                            stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                            regen_btn = gr.Button("Regenerate", elem_id="regenerate")
                            clear_btn = gr.Button("Clear", elem_id="clear")
                            compare = gr.Checkbox(False, label="Compare with FP16", elem_id="compare")
                        ex = examples.collect()
                        gr.Examples(ex[:1], inputs=[box], label="Example", elem_id="examples", **HIDDEN)
                        with gr.Column(visible=takes_media(host.info), elem_id="media-examples") as media_ex:
                            if ex[1:]:
                                gr.Examples(ex[1:], inputs=[box], label="Image and video examples (assets/)",
                                            **HIDDEN)
                    with gr.Column(scale=2):
                        stats_box, tps_plot, mib_plot, mem_bar, speed_bar = stats_panel()
                        with gr.Accordion("KV cache", open=True):
                            cache = CacheControls(methods, show_visual=takes_media(host.info))
                        with gr.Accordion("Generation", open=False):
                            max_new = gr.Slider(1, 1024, max_new_tokens, step=1, label="Max new tokens",
                                                elem_id="max-new")
                            temperature = gr.Slider(0, 2, 0, step=0.05, label="Temperature (0 = greedy)")
                            top_p = gr.Slider(0.05, 1, 1, step=0.05, label="Top-p")
                            seed = gr.Number(-1, label="Seed (-1 = none)", precision=0)
                            with gr.Column(visible=takes_media(host.info), elem_id="video-controls") as video_box:
                                frames = gr.Slider(1, 64, 8, step=1, label="Video frames")
                                fps = gr.Number(0, label="Video fps (0 = spread frames evenly)")
            with gr.Tab("Attention lens", id="lens"):
                lens_layer, lens_head = lens_tab.build(session, host, methods)
            with gr.Tab("Methods", id="methods"):
                gr.Markdown(methods_markdown(methods))
        timer = gr.Timer(0.5, active=False)
        cache.wire(lambda: (host.info or {}).get("name"))

        media = [cache.visual_box, media_ex, video_box]
        wire_model(demo, host, session, model_box, load_btn, model_status, [lens_layer, lens_head], media)

        # --- chat ------------------------------------------------------------------------------------------
        gen_inputs = [session, cache.spec, compare, max_new, temperature, top_p, seed, frames, fps]
        plots = [stats_box, tps_plot, mib_plot, mem_bar, speed_bar]

        def on_submit(sess, message):
            chat_value, accepted = chat.add_turn(sess, message, host.info, limits)
            return chat_value, gr.MultimodalTextbox(value=None), gr.Timer(active=accepted)  # polls only while it writes

        def on_respond(sess, spec, cmp, n, temp, tp, sd, nf, f):
            params = chat.GenParams(n, temp, tp, sd, nf, f)
            if chat.pending(sess):
                problem = "" if host.ready else "No model is loaded; pick one and press Load."
                problem = problem or check_spec(spec)
                if problem:
                    sess.turns.append(chat.Turn("assistant", problem, error=True))
            yield from chat.respond(sess, host.engine, host.info or {}, spec, params, cmp)

        def on_done(sess):
            shown = stats.snapshot(sess.last_stats)
            mem, speed = stats.compare_frames(shown, sess.fp16_stats)
            return (gr.Timer(active=False), stats.stats_html(shown, gen=sess.generation), *stats.timeline_frames(shown),
                    gr.BarPlot(mem, y_lim=[0, stats.nice_top(mem)]), gr.BarPlot(speed, y_lim=[0, stats.nice_top(speed)]))

        def on_tick(sess):
            live, is_live, label = stats.current(sess)
            shown = stats.snapshot(live)
            if not is_live:
                return (gr.skip(),) * 5
            return (stats.stats_html(shown, live=True, label=label, gen=sess.generation), *stats.timeline_frames(shown),
                    gr.skip(), gr.skip())

        answer = [chatbot, fp16_chat, diff]
        box.submit(on_submit, [session, box], [chatbot, box, timer], **QUICK).then(
            on_respond, gen_inputs, answer, **answering).then(on_done, session, [timer, *plots], **QUICK)

        def on_regenerate(sess):
            value, _ = chat.regenerate(sess)
            return value, gr.Timer(active=True)

        regen_btn.click(on_regenerate, session, [chatbot, timer], **QUICK).then(
            on_respond, gen_inputs, answer, **answering).then(on_done, session, [timer, *plots], **QUICK)
        stop_btn.click(chat.stop, session, None, **QUICK)
        for clearing in (clear_btn.click, chatbot.clear):  # the Clear button and the chat's own trash icon
            clearing(lambda s: (chat.clear(s), [], [], stats.stats_html(None, gen=s.generation)), session,
                     [chatbot, fp16_chat, diff, stats_box], **QUICK)
        compare.change(lambda c: (gr.Chatbot(visible=c), gr.HighlightedText(visible=c),
                                  gr.Chatbot(label="Quantized cache (the spec)" if c else "Answer")), compare,
                       [fp16_chat, diff, chatbot], **QUICK)
        timer.tick(on_tick, session, plots, concurrency_limit=None, show_progress="hidden", **HIDDEN)
        api.build(host, limits)
    return demo


def wire_model(demo, host, session, model_box, load_btn, model_status, lens_sliders: list, media: list) -> None:
    """The Load button, and the page load that shows every visitor the model the server runs now."""

    def on_load(name, progress=gr.Progress()):  # noqa: B008 - Gradio injects progress this way
        progress(0.1, desc=f"Loading {name} …")
        try:
            host.load(name)
        except Exception as e:  # noqa: BLE001 - the app keeps serving the previous model
            gr.Warning(f"Could not load {name}: {e}")
            return (badge_html(host.info, f"Could not load {name}: {type(e).__name__}: {e}"),
                    *(gr.skip(),) * (len(lens_sliders) + len(media)))
        progress(1.0, desc="Loaded")
        return (badge_html(host.info), *lens_tab.slider_limits(host.info), *media_shown(host.info))

    load_btn.click(on_load, model_box, [model_status, *lens_sliders, *media], **GPU)

    def on_page_load():
        """It may have changed since the Blocks were built (another tab or the API loaded one): show it, with its
        badge, the lens sliders sized to it and the media controls it takes. A fresh session per page."""
        info = host.info
        name = gr.skip() if info is None else gr.Dropdown(value=info["name"])
        badge = badge_html(info) if info else badge_html(None, host.error)  # a failed load keeps the old model
        return (new_session(), name, badge, *lens_tab.slider_limits(info), *media_shown(info))

    demo.load(on_page_load, None, [session, model_box, model_status, *lens_sliders, *media], **QUICK)


def takes_media(info: dict | None) -> bool:
    return bool(info and (info.get("takes_images") or info.get("takes_video")))


def media_shown(info: dict | None):
    """Visual cache controls, image/video examples and video settings: shown only for a model that reads media."""
    import gradio as gr

    return tuple(gr.Column(visible=takes_media(info)) for _ in range(3))


def stats_panel():
    """The live numbers, two line plots over the generation, two FP16-vs-quantized bar charts."""
    with gr.Column(elem_id="stats-panel"):
        box = gr.HTML(stats.stats_html(None), elem_id="stats-box")
        with gr.Row():
            tps = gr.LinePlot(x="step", y="tokens/s", height=170, y_lim=[0, None], label="Decode tokens/s")
            mib = gr.LinePlot(x="step", y="cache MiB", height=170, y_lim=[0, None], label="KV cache (MiB)")
        with gr.Row():
            # the bars' x labels name the runs, so the colour legend (a second "run" title) is left out
            bars = {"x": "run", "color": "run", "height": 170, "y_lim": [0, None], "color_map": RUNS,
                    "colors_in_legend": [], "x_title": "cache"}
            mem = gr.BarPlot(y="KV cache MiB", label="KV cache in use: uncompressed vs quantized", **bars)
            speed = gr.BarPlot(y="decode tok/s", label="Decode speed: uncompressed vs quantized", **bars)
    return box, tps, mib, mem, speed


def plain_number(v) -> str:
    """As a person writes it: 1/6 as 0.1667, 3.0 as 3, True as true."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def methods_markdown(methods: list[dict]) -> str:
    if not methods:
        return "The method registry (`mmkv.methods`) is not available; only the FP16 cache can be used."
    rows = ["| method | tokens | knobs | needs artifact |", "|---|---|---|---|"]
    for m in methods:
        knobs = ", ".join(f"{k}={plain_number(v.get('default'))}" for k, v in m.get("params", {}).items())
        rows.append(f"| **{m['name']}** | {', '.join(m.get('modalities', []))} | {knobs} | "
                    f"{'yes' if m.get('needs_artifact') else 'no'} |")
    docs = "\n\n".join(f"**{m['name']}**: {m.get('doc', '').strip()}" for m in methods)
    return "\n".join(rows) + "\n\n" + docs
