"""Fixtures for the browser tests: the app as a subprocess on a free localhost port, and headless Chromium.

Chromium is Debian's ``chromium`` package driven by Playwright's Python client (``executable_path``); nothing is
downloaded (no ``playwright install``). Without them the tests skip locally and fail under CI (``CI`` set).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("MMKV_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
START_TIMEOUT_S = 300


def _missing(why: str):
    if os.environ.get("CI"):
        pytest.fail(f"browser tests need {why} (make test installs it)")
    pytest.skip(f"browser tests need {why}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"app exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"app did not come up in {START_TIMEOUT_S}s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="session")
def app_url(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("app") / "app.log"
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(ROOT / "app.py"), "--model", "smollm2-135m", "--port", str(port),
           "--max-new-tokens", "6"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_up(url, proc, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        print(f"\n--- app log tail ---\n{log.read_text()[-2000:]}")


@pytest.fixture(scope="session")
def open_page(app_url):
    """Opens the app in a fresh browser context (its own profile: no shared storage), as a new visitor would."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright Python package")
    if not Path(CHROMIUM).exists():
        _missing(f"Chromium at {CHROMIUM} (apt-get install chromium)")
    profiles, contexts = [], []
    with sync_playwright() as p:
        def open_one():
            profiles.append(tempfile.mkdtemp(prefix="mmkv-chromium-"))
            ctx = p.chromium.launch_persistent_context(profiles[-1], executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                                       headless=True, viewport={"width": 1400, "height": 1000})
            contexts.append(ctx)
            pg = ctx.new_page()
            pg.set_default_timeout(30_000)
            pg.goto(app_url)
            pg.locator("#msg textarea").wait_for()
            return pg

        yield open_one
        for ctx in contexts:
            ctx.close()
    for profile in profiles:
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="session")
def page(open_page):
    return open_page()
