"""Where task data comes from: a local path, or the Hugging Face hub through `datasets` (an optional import,
needed only when no local copy is given; nothing is ever downloaded in tests)."""

from __future__ import annotations

import json
from pathlib import Path


def load_hub(repo: str, split: str, name: str | None = None):
    try:
        import datasets
    except ImportError:
        raise ImportError(f"reading {repo} from the hub needs `pip install datasets`; or pass --data with a local "
                          "copy (see this task's README for the layout)") from None
    return datasets.load_dataset(repo, name, split=split)


class HubRows:
    """Rows of a hub split read on demand, so listing samples never decodes every image or video."""

    def __init__(self, dataset, media_column: str):
        self.dataset = dataset
        self.media_column = media_column
        self.meta = dataset.remove_columns([c for c in dataset.column_names if c == media_column])

    def __len__(self) -> int:
        return len(self.meta)

    def row(self, i: int) -> dict:
        return self.meta[i]

    def media(self, i: int):
        return self.dataset[i][self.media_column]


def read_json(path: Path):
    with open(path) as f:
        return json.load(f)


def find_file(root: Path, names: list[str]) -> Path:
    """root itself when it is a file, else the first of names inside it."""
    if root.is_file():
        return root
    for name in names:
        if (root / name).exists():
            return root / name
    raise ValueError(f"{root}: expected a file or a folder holding one of {names}")
