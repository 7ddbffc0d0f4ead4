"""The chat page at / in a real browser: headless Chromium from Debian's packages, driven by Playwright."""

from __future__ import annotations

import os
import shutil

import pytest

from serving import KEY, live_server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# as root, on a machine with no network: no sandbox, no background connections
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip("Chromium is not installed (Debian package chromium; .ci/run installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()


def test_chat_page_streams_an_answer_about_a_pasted_document(artifact, browser, real_text, tmp_path):
    document = real_text[:6000]  # about 1,400 tokens of the Apache License
    with live_server(artifact, "--ctx-size", "4096") as server:
        page = browser.new_page(viewport={"width": 1100, "height": 760})
        page.goto(server.url + "/")
        page.fill("#api-key", KEY)
        page.dispatch_event("#api-key", "change")
        page.wait_for_function("document.getElementById('model').textContent.includes('context 4096')")
        page.fill("#doc", document)
        page.fill("#question", "Is the software provided with a warranty?")
        # count the changes to the answer's text as they arrive
        page.evaluate("""() => {
            window.updates = 0;
            new MutationObserver(() => { window.updates += 1; })
                .observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
        }""")
        page.click("#send")
        page.wait_for_function("document.getElementById('stats').textContent.includes('decode')", timeout=120_000)
        answer = page.inner_text(".msg.assistant")
        stats = page.inner_text("#stats")
        updates = page.evaluate("window.updates")
        page.screenshot(path=str(tmp_path / "chat-page.png"))
        if os.environ.get("ELLM_SCREENSHOT"):
            page.screenshot(path=os.environ["ELLM_SCREENSHOT"])
    assert len(answer.strip()) > 10
    assert updates >= 5  # streamed: the answer grew piece by piece, not in one go
    assert "tok/s" in stats and "time to first token" in stats
    # the prompt was read whole: its token count is in the stats line
    prompt_n = int(stats.split("prompt ")[1].split(" tokens")[0])
    assert prompt_n > 1000
    assert page.inner_text(".msg.doc") == f"document: {len(document.strip()):,} characters"
