"""mmkv.paths.wikitext: $MMKV_WIKITEXT first, then the full splits beside the checkout, then the shipped excerpt (warned)."""

from __future__ import annotations

import pytest

from mmkv import paths as W


def test_env_folder_wins_and_must_hold_the_split(tmp_path, monkeypatch):
    (tmp_path / "valid.txt").write_text(" = Valkyria = \n")
    monkeypatch.setenv("MMKV_WIKITEXT", str(tmp_path))
    assert W.wikitext("valid") == tmp_path / "valid.txt"
    with pytest.raises(FileNotFoundError, match="has no test.txt"):
        W.wikitext("test")


def test_falls_back_to_the_excerpt_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.delenv("MMKV_WIKITEXT", raising=False)
    monkeypatch.setattr(W, "SHARED", tmp_path / "missing")
    with pytest.warns(UserWarning, match="excerpt"):
        p = W.wikitext("test")
    assert p == W.EXCERPT / "test.txt"
    text = p.read_text(encoding="utf-8")
    assert len(text) > 60_000 and " @-@ " in text  # the tokenized release, enough for the tests that read it


def test_unknown_split():
    with pytest.raises(ValueError, match="split"):
        W.wikitext("train")
