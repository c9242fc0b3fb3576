"""The mmkv-eval tasks, one folder each (coco_caption, docvqa, mmbench_video, text); eval/registry.py lists them."""
