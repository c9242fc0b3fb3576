"""The "Attention lens" tab: re-run the last answered prompt once with exact attention, keep each layer's K/V and
the last prompt token's query, and show what quantizing the visual span does to them (math in ``lens.py``)."""

from __future__ import annotations

import pandas as pd
import torch

from mmkv.models.inputs import prepare_inputs
from mmkv.ui import lens
from mmkv.ui.session import Session

CAPTURE = "mmkv_lens"
SERIES = {"exact": "#2563eb", "quantized": "#f97316", "calibrated": "#16a34a"}
KINDS = {"quantized": "#f97316", "quantized + calibrated": "#16a34a"}


def legend_html(colors: dict[str, str]) -> str:
    items = "".join(f'<span class="mmkv-legend-item" style="margin-right:14px"><span style="display:inline-block;'
                    f'width:12px;height:12px;border-radius:2px;background:{c};margin-right:4px"></span>{name}</span>'
                    for name, c in colors.items())
    return f'<div class="mmkv-legend">{items}</div>'


def _capture_fn(store: dict):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def capture(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        i = getattr(module, "layer_idx", len(store))
        store[i] = {"q": query[0, :, -1].detach().float().cpu(), "k": key[0].detach().half().cpu(),
                    "v": value[0].detach().half().cpu(), "scale": scaling}
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kw)

    return capture


@torch.inference_mode()
def capture_prompt(lm, messages, video_frames=None, video_fps=None) -> dict:
    """One exact forward of the prompt (no mmkv cache) -> {"layers": [{"q","k","v","scale"}], "visual": bool [T]}."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    model, processor, adapter = lm
    device = model.get_input_embeddings().weight.device
    prep = prepare_inputs(adapter, messages, processor, device=device, video_frames=video_frames,
                          video_fps=video_fps)
    store: dict = {}
    AttentionInterface.register(CAPTURE, _capture_fn(store))
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)
    cfg = adapter.lm_config
    before = cfg._attn_implementation
    cfg._attn_implementation = CAPTURE
    try:
        model(input_ids=prep.input_ids, attention_mask=prep.attention_mask, use_cache=False, logits_to_keep=1,
              **prep.model_kwargs)
    finally:
        cfg._attn_implementation = before
    layers = [store[i] for i in sorted(store)]
    return {"layers": layers, "visual": prep.visual_mask[0].cpu()}


def calib_info(methods: list[dict]) -> dict:
    """Bits choices and tau defaults of the visual method that calibrates (from the registry)."""
    for m in methods:
        p = m.get("params", {})
        if "visual" in m.get("modalities", []) and {"tau1", "tau2"} <= set(p):
            return {"bits": list(p.get("bits", {}).get("choices") or [1, 2, 4, 8]),
                    "tau1": float(p["tau1"]["default"]), "tau2": float(p["tau2"]["default"])}
    return {"bits": [1, 2, 4, 8], "tau1": 0.0, "tau2": 3.0}


def analyze(session: Session, lm, layer: int, head: int, bits: int, tau1: float, tau2: float, capture=capture_prompt):
    """-> (logit distribution frame, summary frame, per-layer error frame, markdown). Never raises."""
    empty = pd.DataFrame(columns=["logit", "share", "series"]), pd.DataFrame(), pd.DataFrame(
        columns=["layer", "relative error", "kind"])
    if lm is None:
        return (*empty, "Load a model first.")
    if not session.last_messages:
        return (*empty, "Ask something in the Chat tab first; the lens looks at the last answered prompt.")
    try:
        key = (session.generation, id(lm))
        if getattr(session, "lens_key", None) != key:
            session.lens_data, session.lens_key = capture(lm, session.last_messages), key
        data = session.lens_data
        visual = data["visual"]
        if not bool(visual.any()):
            return (*empty, "The last prompt has no visual tokens: send an image (or video) to a vision model.")
        layers = data["layers"]
        li = int(min(max(layer, 0), len(layers) - 1))
        L = layers[li]
        hi = int(min(max(head, 0), L["q"].shape[0] - 1))
        tau = (float(tau1), float(tau2))
        logits = lens.visual_logits(L["q"], L["k"].float(), L["v"].float(), visual, hi, int(bits), tau, L["scale"])
        f32 = [{**x, "k": x["k"].float(), "v": x["v"].float()} for x in layers]
        errs = lens.layer_errors(f32, visual, int(bits), tau)
        note = (f"Layer {li}, head {hi}: {int(visual.sum())} visual tokens of {visual.numel()}, {bits}-bit "
                f"channel-wise K/V, calibration tau1={tau[0]:g}, tau2={tau[1]:g}. Exact = fp16 prompt K/V.")
        return lens.logit_distribution(logits), lens.logit_summary(logits).round(3), errs, note
    except Exception as e:  # noqa: BLE001 - the lens must never take the app down
        return (*empty, f"⚠️ Lens failed: {type(e).__name__}: {e}")


def slider_limits(info: dict | None):
    """Layer and head sliders sized to the loaded model."""
    import gradio as gr

    layers, heads = (info or {}).get("num_layers") or 64, (info or {}).get("num_q_heads") or 64
    return gr.Slider(maximum=layers - 1), gr.Slider(maximum=heads - 1)


def build(session_state, host, methods: list[dict]):
    """Lay out the tab inside the current Blocks context and wire its button into the GPU queue."""
    import gradio as gr

    info = calib_info(methods)
    gr.Markdown("For the last answered prompt: pre-softmax logits of the last prompt token over the visual tokens, "
                "exact vs quantized vs quantized + calibrated (CalibQuant Fig. 1), and per-layer attention-output "
                "error.")
    with gr.Row():
        layers, heads = (host.info or {}).get("num_layers") or 64, (host.info or {}).get("num_q_heads") or 64
        layer = gr.Slider(0, layers - 1, 0, step=1, label="Layer", elem_id="lens-layer")
        head = gr.Slider(0, heads - 1, 0, step=1, label="Query head", elem_id="lens-head")
        bits = gr.Dropdown(info["bits"], value=info["bits"][0], label="Bits", elem_id="lens-bits")
        tau1 = gr.Number(info["tau1"], label="tau1")
        tau2 = gr.Number(info["tau2"], label="tau2")
    run = gr.Button("Analyze last prompt", variant="primary", elem_id="lens-run")
    note = gr.Markdown("", elem_id="lens-note")
    # Gradio puts a plot's colour legend below the chart, where the block's fixed height cut it off; each plot's
    # legend is drawn above it instead, in the same colours.
    with gr.Row():
        with gr.Column():
            gr.HTML(legend_html(SERIES), elem_id="lens-dist-legend")
            dist = gr.LinePlot(x="logit", y="share", color="series", label="Visual logits distribution", height=320,
                               color_map=SERIES, colors_in_legend=[], elem_id="lens-dist")
        with gr.Column():
            gr.HTML(legend_html(KINDS), elem_id="lens-err-legend")
            errs = gr.LinePlot(x="layer", y="relative error", color="kind", label="Attention output error",
                               height=320, y_lim=[0, None], color_map=KINDS, colors_in_legend=[], elem_id="lens-err")
    summary = gr.Dataframe(label="Logit range per series", interactive=False)

    def on_run(sess, li, h, b, t1, t2):
        d, s, e, n = analyze(sess, host.lm, li, h, b, t1, t2)
        return d, e, s, n

    run.click(on_run, [session_state, layer, head, bits, tau1, tau2], [dist, errs, summary, note],
              concurrency_id="gpu", concurrency_limit=1, api_visibility="private")
    return layer, head
