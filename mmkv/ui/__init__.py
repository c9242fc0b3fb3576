"""The Gradio app: ``build_app`` (Blocks) and ``main`` (flags, load, serve). Gradio is imported only when used."""


def main(argv=None):
    from mmkv.ui.launch import main as _main

    return _main(argv)


__all__ = ["main"]
