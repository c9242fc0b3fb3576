"""Cache controls built from the method registry (``mmkv.methods.describe()``), and the spec string they make.

Nothing here names a method: a new method in the registry shows up with its knobs. ``build_spec`` is pure so the
unit tests check the strings; ``CacheControls`` lays the widgets out and wires them to one spec textbox.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NONE = "fp16"  # the choice that leaves a modality unquantized
DEFAULT_WINDOW, DEFAULT_SINKS = 128, 4


def registry() -> list[dict]:
    try:
        from mmkv import methods

        return list(methods.describe())
    except Exception:  # registry not importable (yet): the UI still comes up, with fp16 only
        return []


PREFERRED = {"visual": "calibquant", "text": "kivi"}  # the default pick when the registry has it
ALWAYS_SHOWN = ("bits",)  # knobs written into the spec even at their default, so the spec says the bit-width


def methods_for(methods: list[dict], modality: str) -> list[dict]:
    return [m for m in methods if modality in m.get("modalities", []) and m["name"] != NONE]


def default_method(methods: list[dict], modality: str) -> str:
    names = [m["name"] for m in methods_for(methods, modality)]
    if PREFERRED.get(modality) in names:
        return PREFERRED[modality]
    return names[0] if names else NONE


@dataclass(frozen=True)
class Slot:
    """One knob: which modality and method it belongs to, and the registry's description of it."""

    modality: str
    method: str
    name: str
    info: dict = field(hash=False, compare=False)


def slots_of(methods: list[dict]) -> list[Slot]:
    out = []
    for modality in ("visual", "text"):
        for m in methods_for(methods, modality):
            for pname, pinfo in m.get("params", {}).items():
                out.append(Slot(modality, m["name"], pname, pinfo))
    return out


def format_value(v, kind: str | None = None) -> str:
    if isinstance(v, bool) or kind == "bool":
        return "true" if (v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")) else "false"
    if kind == "int" or (isinstance(v, float) and kind is None and v.is_integer()):
        return str(int(float(v)))
    if isinstance(v, float):
        return f"{v:g}"
    return str(v).strip()


def _is_default(s: Slot, v) -> bool:
    d = s.info.get("default")
    if d is None:
        return False
    return format_value(v, s.info.get("type")) == format_value(d, s.info.get("type"))


def method_part(method: str, slots: list[Slot], values: list, modality: str) -> str:
    """``kivi:bits=2,group=64``: bits always, other knobs only where they differ from the default."""
    knobs = [f"{s.name}={format_value(v, s.info.get('type'))}" for s, v in zip(slots, values, strict=True)
             if s.modality == modality and s.method == method and v is not None and v != ""
             and (s.name in ALWAYS_SHOWN or not _is_default(s, v))]
    return method + (":" + ",".join(knobs) if knobs else "")


def build_spec(visual: str, text: str, window, sinks, slots: list[Slot], values: list) -> str:
    """Control values -> spec string, e.g. ``visual=calibquant:bits=1,calibrate=true text=kivi:bits=2 window=128``."""
    parts = []
    if visual and visual != NONE:
        parts.append("visual=" + method_part(visual, slots, values, "visual"))
    if text and text != NONE:
        parts.append("text=" + method_part(text, slots, values, "text"))
    if not parts:
        return "fp16"
    parts.append(f"window={int(window if window is not None else DEFAULT_WINDOW)}")
    parts.append(f"sinks={int(sinks if sinks is not None else DEFAULT_SINKS)}")
    return " ".join(parts)


def default_spec(methods: list[dict] | None = None) -> str:
    """The spec the controls start with (each method's defaults), also the API's default."""
    methods = registry() if methods is None else methods
    slots = slots_of(methods)
    return build_spec(default_method(methods, "visual"), default_method(methods, "text"), DEFAULT_WINDOW,
                      DEFAULT_SINKS, slots, [s.info.get("default") for s in slots])


def check_spec(spec: str) -> str:
    """'' when the spec parses, else the parser's message (which names the allowed values)."""
    spec = (spec or "").strip()
    if not spec:
        return "The cache spec is empty; use 'fp16' for an uncompressed cache."
    try:
        from mmkv import CacheSpec
    except ImportError:
        return ""
    try:
        CacheSpec.parse(spec)
    except ValueError as e:
        return f"Invalid cache spec: {e}"
    return ""


def error_note(problem: str):
    """The note under the spec box, styled as an error when there is one."""
    import gradio as gr

    return gr.Markdown(value=problem, elem_classes=["mmkv-error"] if problem else [])


def controls_for(spec: str, order: list[Slot]) -> list:
    """A valid spec -> values for (visual, text, window, sinks, *knobs): what the controls show for it."""
    from mmkv import CacheSpec

    parsed = CacheSpec.parse(spec)
    chosen = {"visual": parsed.visual, "text": parsed.text}
    knobs = [getattr(chosen[s.modality], s.name) if chosen[s.modality].name == s.method else s.info.get("default")
             for s in order]
    return [parsed.visual.name, parsed.text.name, parsed.window, parsed.sinks, *knobs]


def artifact_note(methods: list[dict], chosen: list[str], model: str | None) -> str:
    """Markdown for chosen methods that need a calibration artifact this model may lack ('' when none)."""
    notes = []
    for m in methods:
        if m["name"] not in chosen or not m.get("needs_artifact"):
            continue
        have, command = artifact_status(m["name"], model)
        if not have:
            notes.append(f"**{m['name']}** needs a calibration artifact for `{model}`. Make it with:\n\n"
                         f"```\n{command}\n```")
    return "\n\n".join(notes)


def artifact_status(method: str, model: str | None) -> tuple[bool, str]:
    """(artifact present, command that makes it), from the calibrate package where it says so."""
    try:
        from mmkv import calibrate

        status = getattr(calibrate, "artifact_status", None)
        if status is not None:
            return tuple(status(method, model))
    except Exception:
        pass
    return False, f"mmkv-calibrate {method} --model {model}"


def is_primary(s: Slot) -> bool:
    """Knobs with a fixed set of values (bits, calibrate, tau) are shown; free numbers go under "More knobs"."""
    return bool(s.info.get("choices")) or s.info.get("type") == "bool" or s.name == "bits"


class CacheControls:
    """The cache accordion: method pickers, one group of knobs per method (shown when picked), window, sinks."""

    def __init__(self, methods: list[dict], show_visual: bool = True):
        import gradio as gr

        self.methods = methods
        self.slots = slots_of(methods)
        vis = [NONE] + [m["name"] for m in methods_for(methods, "visual")]
        txt = [NONE] + [m["name"] for m in methods_for(methods, "text")]
        self.groups: dict[tuple[str, str], gr.Column] = {}
        self.knobs, self.order = [], []  # widgets, and their slots in the same order
        with gr.Column(elem_id="visual-controls", visible=show_visual) as self.visual_box:  # hidden for text models
            self.visual = gr.Dropdown(vis, value=default_method(methods, "visual"), label="Visual tokens",
                                      elem_id="visual-method")
            with gr.Group():
                self._knob_groups("visual", self.visual.value)
        self.text = gr.Dropdown(txt, value=default_method(methods, "text"), label="Text tokens", elem_id="text-method")
        with gr.Group():
            self._knob_groups("text", self.text.value)
        with gr.Row():
            self.window = gr.Number(DEFAULT_WINDOW, label="Recent window (fp16 tokens)", precision=0, minimum=0)
            self.sinks = gr.Number(DEFAULT_SINKS, label="Sink tokens", precision=0, minimum=0)
        self.spec = gr.Textbox(self.spec_of(self.visual.value, self.text.value, DEFAULT_WINDOW, DEFAULT_SINKS,
                                            *[k.value for k in self.knobs]),
                               label="Cache spec (editable)", elem_id="spec", max_lines=2)
        self.note = gr.Markdown("", elem_id="spec-note")

    def _knob_groups(self, modality: str, selected: str):
        import gradio as gr

        for m in methods_for(self.methods, modality):
            mine = [s for s in self.slots if s.modality == modality and s.method == m["name"]]
            with gr.Column(visible=m["name"] == selected) as g:
                for s in mine:
                    if is_primary(s):
                        self.knobs.append(self._widget(s))
                        self.order.append(s)
                more = [s for s in mine if not is_primary(s)]
                if more:
                    with gr.Accordion(f"More {m['name']} knobs", open=False):
                        for s in more:
                            self.knobs.append(self._widget(s))
                            self.order.append(s)
            self.groups[(modality, m["name"])] = g

    @staticmethod
    def _widget(s: Slot):
        import gradio as gr

        label, default, kind = f"{s.method} {s.name}", s.info.get("default"), s.info.get("type")
        eid = f"knob-{s.modality}-{s.method}-{s.name}"
        if s.info.get("choices"):
            return gr.Dropdown(list(s.info["choices"]), value=default, label=label, elem_id=eid)
        if kind == "bool":
            return gr.Checkbox(bool(default), label=label, elem_id=eid)
        if kind in ("int", "float"):
            return gr.Number(default, label=label, precision=0 if kind == "int" else None, elem_id=eid)
        return gr.Textbox("" if default is None else str(default), label=label, elem_id=eid)

    def spec_of(self, visual, text, window, sinks, *values) -> str:
        return build_spec(visual, text, window, sinks, self.order, list(values))

    def wire(self, model_name_fn):
        """A control the user changes rewrites the spec text and the artifact note; a spec typed into the box sets the
        controls. Controls listen to ``input`` (the user's edits), not ``change``: a typed spec sets them, and their
        ``change`` events, arriving after a later typed spec, used to write the earlier one back into the box."""
        import gradio as gr

        inputs = [self.visual, self.text, self.window, self.sinks, *self.knobs]

        def groups_for(visual, text):
            return [gr.Column(visible=(key == ("visual", visual) or key == ("text", text))) for key in self.groups]

        def on_change(visual, text, window, sinks, *values):
            spec = self.spec_of(visual, text, window, sinks, *values)
            note = artifact_note(self.methods, [visual, text], model_name_fn())
            return [spec, note or error_note(check_spec(spec)), *groups_for(visual, text)]

        def on_typed(spec):
            """A spec typed into the box: its error (on Enter and on leaving the box), else the controls follow it."""
            problem = check_spec(spec)
            if problem:
                return [error_note(problem)] + [gr.skip()] * (len(inputs) + len(self.groups))
            values = controls_for(spec, self.order)
            return [error_note(""), *values, *groups_for(values[0], values[1])]

        outputs = [self.spec, self.note, *self.groups.values()]
        quiet = {"queue": False, "show_progress": "hidden", "api_visibility": "private"}
        for c in inputs:
            c.input(on_change, inputs, outputs, **quiet)
        for typed in (self.spec.submit, self.spec.blur):
            typed(on_typed, self.spec, [self.note, *inputs, *self.groups.values()], **quiet)
