"""Every task mmkv-eval runs, as plain dicts (one per task folder). A task dict holds:

    title, paper        what the table is and which paper table it mirrors
    load(opts, rt)      -> samples (dicts with a unique "id"), cheap: media are read in run()
    run(rt, sample, spec, opts) -> record for one sample under one cache spec
    score(records, fp16_records, opts) -> ({metric: value}, notes)   pure: tables are rebuilt from files
    metrics             column names, or a function of opts returning them
    digits              decimals shown in the Markdown table
    needs               "images" | "video" | "text": what the model must accept
    defaults            per-task defaults of common options (max_new_tokens)
    options             extra argparse arguments [(flags, kwargs)]
    post, annotations   optional: a step after inference (the MMBench-Video judge) and the record kind it writes
"""

from __future__ import annotations

from .tasks.coco_caption.task import TASK as COCO_CAPTION
from .tasks.docvqa.task import TASK as DOCVQA
from .tasks.mmbench_video.task import TASK as MMBENCH_VIDEO
from .tasks.text.agreement import TASK as AGREEMENT
from .tasks.text.needle import TASK as NEEDLE
from .tasks.text.perplexity import TASK as PERPLEXITY

TASKS: dict[str, dict] = {
    "coco_caption": COCO_CAPTION,
    "docvqa": DOCVQA,
    "mmbench_video": MMBENCH_VIDEO,
    "perplexity": PERPLEXITY,
    "needle": NEEDLE,
    "agreement": AGREEMENT,
}


def metric_names(task: dict, opts: dict) -> list[str]:
    m = task["metrics"]
    return list(m(opts) if callable(m) else m)
