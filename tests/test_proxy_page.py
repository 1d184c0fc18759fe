"""The proxy's page (GET /lanelock/) in a real browser: Debian's chromium driven by Playwright
(launched from /usr/bin/chromium: Playwright's own browser download needs the internet), at a
phone's width, behind the proxy's token. The page must show what happens after it loaded --
a holder that starts later -- within a couple of seconds, without a reload, with nothing from
outside the proxy and no error in the browser's console. The screenshot stays in the test's
tmp_path (its path is printed).
"""

from __future__ import annotations

import json
import os
import time

import pytest

from support.proxy import CHAT, Proxy, chat_body, request
from support.standin_kind import Served

pytest.importorskip("aiohttp")
CHROMIUM = "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="chromium not installed")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TOKEN = "page-token-1"
PHONE = {"width": 390, "height": 844}


def test_the_page_shows_a_holder_that_came_after_it_loaded(procs, holder, lanelock, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    engine = Served(procs, tmp_path, "--kind", "llama.cpp", "--parallel", "2")
    assert lanelock("seats", "-b", engine.backend, "2").returncode == 0
    proxy = Proxy(procs, engine.backend, "--token-env", "PAGE_TOKEN", env={"PAGE_TOKEN": TOKEN})
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    for session in ("alpha", "beta"):
        assert request(proxy.port, "POST", CHAT, chat_body(),
                       {"X-Lanelock-Session": session, **bearer})[0] == 200
    status, headers, _ = request(proxy.port, "GET", "/lanelock/")
    assert (status, headers["WWW-Authenticate"]) == (401, 'Basic realm="lanelock proxy"')

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            context = browser.new_context(viewport=PHONE, http_credentials={
                "username": "me", "password": TOKEN})
            page = context.new_page()
            errors, elsewhere = [], []
            page.on("console", lambda message: message.type == "error" and
                    errors.append(message.text))
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.on("request", lambda asked: asked.url.startswith(proxy.url) or
                    elsewhere.append(asked.url))
            page.goto(proxy.url + "/lanelock/")
            page.wait_for_selector(".lane .seats td")
            assert "alpha" in page.inner_text("#sessions") and "beta" in page.inner_text(
                "#sessions")
            assert "night-owl" not in page.inner_text("#lanes")
            page.evaluate("window.sameLoad = 42")   # gone if the page were loaded again

            held = holder("-b", engine.backend, "-s", "night-owl", "-m", "qwen")
            started = time.monotonic()
            page.locator(".lane .seats tbody", has_text="night-owl").wait_for(timeout=10_000)
            took = time.monotonic() - started
            seats = page.inner_text(".lane .seats tbody")
            assert page.evaluate("window.sameLoad") == 42   # no reload
            # a phone's width: nothing wider than the screen
            assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
            screenshot = tmp_path / "page.png"
            page.screenshot(path=str(screenshot), full_page=True)
            print(f"\nthe page's screenshot: {screenshot} (the holder shown {took:.2f}s after "
                  "it started)")
        finally:
            browser.close()
    assert held.release() == 0
    assert took < 3.0, took
    assert "qwen" in seats and "free" in seats, seats   # seat 1 held, seat 2 free
    assert errors == [] and elsewhere == [], (errors, elsewhere)
    assert screenshot.stat().st_size > 10_000
    shown = json.loads(request(proxy.port, "GET", "/lanelock/status", headers=bearer)[2])
    assert shown["sessions"]["alpha"]["local"] == 1
