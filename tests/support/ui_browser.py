"""A real Chromium for the web UI's tests, driven by Playwright.

Chromium comes from Debian's package (``apt-get install chromium``); Playwright is
pointed at it and never downloads a browser of its own. Without it the browser tests
skip with a message, unless ``TORCHYARD_REQUIRE_BROWSER=1`` (CI), where that is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

REQUIRE_BROWSER = os.environ.get("TORCHYARD_REQUIRE_BROWSER") == "1"
CHROMIUM_CANDIDATES = ("chromium", "chromium-browser")
# A 4xx answer is logged by the browser as a failed resource: the tests check the answers
# themselves (a 401 before sign-in, the form's 422s). Script errors and CSP refusals count.
EXPECTED_CONSOLE = ("Failed to load resource: the server responded with a status of 4",)
# Where the page may show the words null and undefined: code, logs, specs and form fields.
_RAW_TEXT = "pre, code, textarea, script, style"
# The word null or undefined in a text: a value missing where text was expected
# (replaceChildren(null) writes "null", a template string "undefined").
_MISSING = r"(^|[^\w.$-])(null|undefined)([^\w.-]|$)"
# Run in every page before its own scripts: each such text put into the page (outside
# _RAW_TEXT) is logged as a console error, which UiPage.errors records, and kept in
# window.__textProblems; window.__textScan() finds those the page holds now.
_WATCH_TEXT = """(() => {
  const raw = RAW, word = new RegExp(MISSING);
  const problems = (window.__textProblems = []);
  const problem = (node) => {
    const parent = node.parentElement;
    if (!node.data || !word.test(node.data) || !parent || parent.closest(raw)) return null;
    const where = parent.id ? "#" + parent.id : parent.tagName.toLowerCase() + "." + parent.className;
    return "the page shows " + JSON.stringify(node.data.trim().slice(0, 80)) + " in " + where;
  };
  const texts = (node) => {
    if (node.nodeType === Node.TEXT_NODE) return [node];
    if (node.nodeType !== Node.ELEMENT_NODE) return [];
    const out = [], walker = document.createTreeWalker(node, NodeFilter.SHOW_TEXT);
    for (let n = walker.nextNode(); n; n = walker.nextNode()) out.push(n);
    return out;
  };
  const check = (node) => {
    const found = problem(node);
    if (found) {
      problems.push(found);
      console.error(found);
    }
  };
  window.__textScan = () => texts(document.body).map(problem).filter(Boolean);
  new MutationObserver((records) => {
    for (const r of records) {
      if (r.type === "characterData") check(r.target);
      else r.addedNodes.forEach((n) => texts(n).forEach(check));
    }
  }).observe(document, { childList: true, subtree: true, characterData: true });
})();""".replace("RAW", json.dumps(_RAW_TEXT)).replace("MISSING", json.dumps(_MISSING))


def chromium_path() -> str | None:
    configured = os.environ.get("TORCHYARD_CHROMIUM")
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    for name in CHROMIUM_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def _unavailable(message: str) -> None:
    if REQUIRE_BROWSER:
        pytest.fail(message + " and TORCHYARD_REQUIRE_BROWSER=1")
    pytest.skip(message + "; install Debian's chromium (apt-get install chromium) to run the browser tests")


@pytest.fixture(scope="module", name="chromium")
def chromium_fixture() -> Iterator[Any]:
    """A headless Chromium browser for the module's tests. Not for the session: Playwright's
    sync API keeps an event loop running in the thread while it is open, and later tests of the
    same process that call ``asyncio.run`` would fail."""
    path = chromium_path()
    if path is None:
        _unavailable("Chromium not found (chromium on PATH or TORCHYARD_CHROMIUM)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is not installed (pip install -e '.[dev]')")
    manager = sync_playwright().start()
    # The sandbox needs user namespaces, which a root process (containers, CI) cannot use.
    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    browser = manager.chromium.launch(executable_path=path, headless=True, args=args)
    try:
        yield browser
    finally:
        browser.close()
        manager.stop()


class UiPage:
    """A browser tab of its own (own cookies) on the service, recording console errors."""

    def __init__(self, browser: Any, base_url: str) -> None:
        self.context = browser.new_context(base_url=base_url, viewport={"width": 1280, "height": 900})
        self.context.set_default_timeout(30_000)
        self.context.add_init_script(_WATCH_TEXT)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda exc: self.errors.append(f"page error: {exc}"))
        # Cancel and delete ask for confirmation: the tests say yes.
        self.page.on("dialog", lambda dialog: dialog.accept())

    def _console(self, message: Any) -> None:
        if message.type == "error" and not any(e in message.text for e in EXPECTED_CONSOLE):
            self.errors.append(message.text)

    def sign_in(self, token: str) -> None:
        self.page.goto("/")
        self.page.fill("#token", token)
        self.page.click("#signin-submit")
        self.page.wait_for_selector("#whoami")

    def text_problems(self) -> list[str]:
        """The texts reading null or undefined (outside code, logs and fields) that the page
        holds now or showed since it was loaded."""
        found: list[str] = self.page.evaluate(
            "() => [...new Set([...(window.__textProblems || []), ...window.__textScan()])]"
        )
        return found

    def assert_clean_text(self) -> None:
        """No text of the page reads null or undefined where a value should be."""
        problems = self.text_problems()
        assert problems == [], problems

    def close(self) -> None:
        self.context.close()


@pytest.fixture(name="open_ui")
def open_ui_fixture(chromium: Any) -> Iterator[Any]:
    """``open_ui(base_url)``: a new signed-out tab; closed at the end of the test."""
    pages: list[UiPage] = []

    def factory(base_url: str) -> UiPage:
        ui = UiPage(chromium, base_url)
        pages.append(ui)
        return ui

    yield factory
    for ui in pages:
        ui.close()
