"""Upload checks (images, videos, limits), examples from assets/, the launcher's flags and safe defaults."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from mmkv.ui import examples
from mmkv.ui.launch import parse_args
from mmkv.ui.session import Session, drop_session
from mmkv.ui.uploads import Limits, UploadError, sort_uploads

ROOT = Path(__file__).resolve().parents[1]
VIDEOS = sorted((ROOT / "assets" / "videos").glob("*.mp4"))


def test_truncated_image_is_rejected(tmp_path):
    good = tmp_path / "good.png"
    Image.new("RGB", (64, 64), "blue").save(good)
    cut = tmp_path / "cut.png"
    cut.write_bytes(good.read_bytes()[:60])
    with pytest.raises(UploadError, match="not a readable image"):
        sort_uploads([str(cut)], Limits(), True, True)
    assert sort_uploads([str(good)], Limits(), True, False) == ([str(good)], None)


def test_too_many_images_and_two_videos(tmp_path):
    p = tmp_path / "a.png"
    Image.new("RGB", (8, 8)).save(p)
    with pytest.raises(UploadError, match="At most"):
        sort_uploads([str(p)] * 9, Limits(), True, True)


@pytest.mark.skipif(not VIDEOS, reason="assets/videos not present")
def test_video_length_limit_and_corrupt_video(tmp_path):
    pytest.importorskip("decord")
    v = str(VIDEOS[0])
    assert sort_uploads([v], Limits(), True, True) == ([], v)
    with pytest.raises(UploadError, match="--max-video-seconds"):
        sort_uploads([v], Limits(max_video_seconds=0.5), True, True)
    with pytest.raises(UploadError, match="One video"):
        sort_uploads([v, v], Limits(), True, True)
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"\x00\x00\x00\x18ftypmp42 garbage")
    with pytest.raises(UploadError, match="not a readable video"):
        sort_uploads([str(bad)], Limits(), True, True)
    with pytest.raises(UploadError, match="does not take video"):
        sort_uploads([v], Limits(), True, False)


def test_examples_come_from_assets(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "videos").mkdir()
    for n in ("a.png", "b.jpg"):
        Image.new("RGB", (8, 8)).save(tmp_path / "images" / n)
    (tmp_path / "images" / "a.txt").write_text("What colour is it?")
    (tmp_path / "videos" / "c.mp4").write_bytes(b"")
    ex = examples.collect(tmp_path)
    assert ex[0]["files"] == [] and ex[1]["text"] == "What colour is it?"
    assert [len(e["files"]) for e in ex] == [0, 1, 1, 2, 1]
    assert examples.collect(tmp_path / "nothing") == [{"text": examples.TEXT_PROMPT, "files": []}]


def test_launcher_defaults_are_safe():
    a = parse_args([])
    assert a.host == "127.0.0.1" and a.share is False and a.model == "smollm2-135m"
    assert not a.trust_remote_code and a.max_upload_mb > 0 and a.max_video_seconds > 0
    a = parse_args(["--host", "0.0.0.0", "--share", "--max-upload-mb", "5", "--max-video-seconds", "9"])
    assert (a.host, a.share, a.max_upload_mb, a.max_video_seconds) == ("0.0.0.0", True, 5.0, 9.0)


def test_session_uploads_deleted_when_session_ends(tmp_path):
    f = tmp_path / "up.png"
    f.write_bytes(b"x")
    s = Session()
    s.uploads.add(str(f))
    drop_session(s)
    assert not f.exists() and s.stop.is_set()


def test_build_app_with_fake_engine():
    pytest.importorskip("gradio")
    from mmkv.ui.blocks import build_app
    from mmkv.ui.fake import fake_loader
    from mmkv.ui.models import ModelHost

    host = ModelHost(loader=fake_loader)
    host.load("fake-vlm")
    demo = build_app(host, Limits())
    ids = {getattr(b, "elem_id", None) for b in demo.blocks.values()}
    assert {"chat", "fp16-chat", "msg", "stop", "regenerate", "clear", "compare", "spec", "stats-box",
            "lens-run", "model-name", "load-model"} <= ids
    from mmkv.ui.models import MODEL_BOX_HELP

    box = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "model-name")
    assert box.info == MODEL_BOX_HELP  # the families a user can load, under the box
