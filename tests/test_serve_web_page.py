"""The web page at / in headless Chromium (Debian's chromium, driven by playwright): a message typed and sent
gets a streamed reply, the pool view changes while it streams, a second message shows cached tokens; the page
loads nothing from outside the server and reads in light and dark."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from pagecli.config import SamplingParams
from serve_helpers import checked_idle, running_server, slow_steps

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
LONG = "Tell me how a paged KV cache keeps the prefix of a conversation in blocks of sixteen tokens. " * 2


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        if os.environ.get("PAGECLI_REQUIRE_CHROMIUM"):  # CI: install.sh --dev must have installed it
            pytest.fail(f"chromium is not at {CHROMIUM}, and PAGECLI_REQUIRE_CHROMIUM is set")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; ./install.sh --dev installs it)")
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[dev])")
    with playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server(tiny_llama):
    sampling = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)  # every reply streams 40 tokens
    with running_server(tiny_llama, sampling=sampling) as running:
        slow_steps(running, step_s=0.03)  # about 1.2 s a reply: long enough to watch the pool change
        yield running
        checked_idle(running)


def test_a_chat_streams_while_the_pool_view_changes_and_the_second_turn_is_cached(server, browser, tmp_path):
    # bypass_csp: playwright's wait_for_function evaluates strings, which the page's own policy forbids.
    page = browser.new_page(viewport={"width": 1100, "height": 680}, bypass_csp=True)
    outside = []
    page.on("request", lambda request: None if request.url.startswith(server.base_url) else outside.append(request.url))
    page.goto(server.base_url + "/")
    page.wait_for_function("document.getElementById('model').textContent.includes('blocks')")
    assert page.inner_text("#blocks-active").startswith("0 ")
    page.keyboard.type(LONG)  # the prompt has the focus when the page opens
    page.keyboard.press("Enter")
    # While it streams: requests running and active blocks in the pool view, and a reply growing.
    page.wait_for_function("document.getElementById('running-count').textContent !== '0'", timeout=10_000)
    page.wait_for_function("!document.getElementById('blocks-active').textContent.startsWith('0 ')", timeout=10_000)
    page.wait_for_function("document.querySelector('.msg.assistant').textContent.length > 0", timeout=10_000)
    assert page.is_enabled("#stop")  # still streaming: the reply so far came before the end
    page.wait_for_selector(".msg.assistant .turn", timeout=30_000)
    first = page.inner_text(".msg.assistant .turn")
    page.wait_for_function("document.getElementById('running-count').textContent === '0'", timeout=10_000)
    page.wait_for_function("document.querySelector('#turns tbody tr') !== null", timeout=10_000)

    page.keyboard.type("And what happens on the next turn?")
    page.keyboard.press("Enter")
    page.wait_for_selector(".msg.assistant:nth-of-type(4) .turn", timeout=30_000)
    second = page.inner_text(".msg.assistant:nth-of-type(4) .turn")
    cached = int(re.search(r"cached (\d+)", second).group(1))
    assert cached >= 2 * server.engine.config.block_size, (first, second)  # the first turn's prompt and reply
    page.wait_for_function(f"[...document.querySelectorAll('#turns tbody tr:first-child td')]"
                           f".map(td => td.textContent)[3] === '{cached}'", timeout=10_000)
    assert not outside, f"the page fetched from outside the server: {outside}"

    shot = Path(os.environ.get("PAGECLI_WEB_SCREENSHOT") or tmp_path / "page.png")
    page.screenshot(path=str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    light = page.evaluate("getComputedStyle(document.body).backgroundColor")
    page.emulate_media(color_scheme="dark")
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") != light
    page.close()


def test_the_page_is_one_small_file_with_nothing_from_outside(server):
    import httpx

    response = httpx.get(server.base_url + "/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert len(response.content) < 24_000
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", response.text)
    assert "connect-src 'self'" in response.headers["content-security-policy"]
