"""Fixtures for the web UI's end-to-end tests: Debian's headless Chromium driven by playwright,
the API + UI app served over a store on loopback, and screenshots saved as test artifacts.

The browser is the system's ``/usr/bin/chromium`` (``tests/ui/install_browser.sh`` installs it);
playwright never downloads one. Without either, these tests skip with that hint.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import httpx
import pytest

from tests.api.replayed import replayed_store
from tests.ui.stores import CraftedStore, RealStore, crafted_store, real_trace_store
from tests.vllm.shared_server import INSTALL_HINT as VLLM_INSTALL_HINT
from tests.vllm.shared_server import vllm_available
from tokentrace.collector.api import ApiSettings, create_app
from tokentrace.collector.api.server import ApiServer

if TYPE_CHECKING:
    from playwright.sync_api import Browser, BrowserContext, ConsoleMessage, Page, Request

CHROMIUM: Final = Path(os.environ.get("TOKENTRACE_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS: Final = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
INSTALL_HINT: Final = (
    "the UI tests need Chromium at /usr/bin/chromium (run tests/ui/install_browser.sh) and the "
    "Python package playwright (the dev extra)"
)
VIEWPORT: Final = {"width": 1400, "height": 900}
DEFAULT_TIMEOUT_MS: Final = 15_000
_REPO_ROOT: Final = Path(__file__).resolve().parents[2]
_DEFAULT_ARTIFACTS: Final = _REPO_ROOT / "build" / "test-artifacts" / "ui"

# Recorded in every page before the app runs: CSP violations the browser reports as events.
_CSP_RECORDER: Final = """
window.__cspViolations = [];
document.addEventListener("securitypolicyviolation", (event) => {
  window.__cspViolations.push(`${event.violatedDirective} ${event.blockedURI}`);
});
"""


def artifacts_dir() -> Path:
    """Where screenshots go: ``$TOKENTRACE_TEST_ARTIFACTS`` or ``build/test-artifacts/ui``."""
    configured = os.environ.get("TOKENTRACE_TEST_ARTIFACTS")
    path = Path(configured) if configured else _DEFAULT_ARTIFACTS
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """One headless Chromium per module (each test gets fresh contexts: own storage). Not per
    session: the sync API keeps its event loop running in this thread until it stops, and
    later tests that call asyncio.run() would fail."""
    if not CHROMIUM.exists():
        pytest.skip(INSTALL_HINT)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip(INSTALL_HINT)
    with sync_playwright() as playwright:
        # launch() gives the browser a fresh temporary profile (user-data-dir), removed on close.
        launched = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=list(CHROMIUM_ARGS)
        )
        try:
            yield launched
        finally:
            launched.close()


@dataclass
class ServedApp:
    url: str
    settings: ApiSettings

    def api(
        self, path: str, params: Mapping[str, Any] | None = None, *, token: str | None = None
    ) -> Any:
        """GET ``/api/v1/<path>`` as JSON (what the page itself is given)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        response = httpx.get(
            f"{self.url}/api/v1/{path}", params=dict(params or {}), headers=headers, timeout=30
        )
        response.raise_for_status()
        return response.json()


@pytest.fixture
def serve() -> Iterator[Callable[[ApiSettings], ServedApp]]:
    """Serve the API + UI app for some settings on 127.0.0.1 (a free port), on a thread."""
    with ExitStack() as stack:

        def start(settings: ApiSettings) -> ServedApp:
            server = stack.enter_context(ApiServer(create_app(settings), endpoint="127.0.0.1:0"))
            return ServedApp(url=server.url, settings=settings)

        yield start


@dataclass
class UiPage:
    """One browser tab on the UI, with everything that went wrong in it recorded."""

    page: Page
    base_url: str
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    outside_requests: list[str] = field(default_factory=list)

    def goto(self, route: str) -> None:
        """Open ``/`` at a hash route (``#/requests?...``)."""
        self.page.goto(f"{self.base_url}/{route}")

    def testid(self, name: str, extra: str = "") -> Any:
        return self.page.locator(f'[data-testid="{name}"]{extra}')

    def wait_for(self, name: str, extra: str = "") -> Any:
        """The first element with that test id (and selector suffix), once it is in the page;
        on a timeout the failure says what the page shows instead."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

        locator = self.testid(name, extra).first
        try:
            locator.wait_for(state="attached")
        except PlaywrightTimeoutError:
            shown = self.page.evaluate("document.getElementById('app')?.innerText ?? ''")
            raise AssertionError(
                f"no [data-testid={name}]{extra} at {self.page.url}; the page shows: "
                f"{shown[:800]!r}; console errors: {self.console_errors}"
            ) from None
        return locator

    def screenshot(self, name: str) -> Path:
        path = artifacts_dir() / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def csp_violations(self) -> list[str]:
        return list(self.page.evaluate("window.__cspViolations || []"))

    def assert_clean(self, *, allowed_console: tuple[str, ...] = ()) -> None:
        """No console error, uncaught exception, CSP violation or request off this server."""
        errors = [
            text
            for text in self.console_errors
            if not any(allowed in text for allowed in allowed_console)
        ]
        assert errors == [], f"console errors: {errors}"
        assert self.page_errors == [], f"uncaught page errors: {self.page_errors}"
        assert self.csp_violations() == [], "CSP violations"
        assert self.outside_requests == [], "the page asked for something off this server"
        # A value the page failed to format shows up as one of these words.
        junk = self.page.evaluate(
            "(document.getElementById('app')?.innerText ?? '')"
            ".match(/\\b(undefined|null|NaN|Infinity)\\b|\\[object Object\\]/g) ?? []"
        )
        assert junk == [], f"unformatted values on the page: {junk}"


@pytest.fixture
def open_ui(browser: Browser) -> Iterator[Callable[[ServedApp], UiPage]]:
    """Open a fresh browser context (own session storage) on a served app."""
    contexts: list[BrowserContext] = []

    def open_page(app: ServedApp) -> UiPage:
        context = browser.new_context(viewport=VIEWPORT, service_workers="block")  # type: ignore[arg-type]
        context.set_default_timeout(DEFAULT_TIMEOUT_MS)
        context.add_init_script(_CSP_RECORDER)
        contexts.append(context)
        page = context.new_page()
        ui = UiPage(page=page, base_url=app.url)
        origin = urlsplit(app.url).netloc

        def on_console(message: ConsoleMessage) -> None:
            if message.type == "error":
                ui.console_errors.append(message.text)

        def on_request(request: Request) -> None:
            # Everything the UI needs is on its own server: no CDN, no font service.
            if urlsplit(request.url).scheme in ("http", "https", "ws", "wss") and (
                urlsplit(request.url).netloc != origin
            ):
                ui.outside_requests.append(request.url)

        page.on("console", on_console)
        page.on("pageerror", lambda error: ui.page_errors.append(str(error)))
        page.on("request", on_request)
        return ui

    yield open_page
    for context in contexts:
        context.close()


@pytest.fixture(scope="session")
def real_store(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> RealStore:
    """A store filled by real traces: the demo's load on the session's shared vLLM server,
    through a real collector process."""
    if not vllm_available():
        pytest.skip(VLLM_INSTALL_HINT)
    traced = request.getfixturevalue("traced_server")  # only where vLLM can run
    return real_trace_store(tmp_path_factory.mktemp("ui-real-traces"), traced, tiny_model_dir)


@pytest.fixture(scope="session")
def crafted(tmp_path_factory: pytest.TempPathFactory) -> CraftedStore:
    return crafted_store(tmp_path_factory.mktemp("ui-crafted") / "store.db")


@pytest.fixture(scope="session")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store a real collector filled from ``tokentrace replay``'s mixed traffic: client spans
    on every request (so client- and server-seen figures) and a breached TTFT target."""
    return replayed_store(tmp_path_factory.mktemp("ui-replayed") / "store.db", scenario="mixed")
