"""mmkv's benchmark runner: COCO Caption, DocVQA, MMBench-Video and text tasks (perplexity, needle, agreement).

Entry point: `mmkv-eval TASK ...` (eval.run.main); tasks live in eval.registry.TASKS."""
