"""The UI's static files, read as files and as served: no browser needed.

The page renders data only through DOM APIs (text nodes, attributes) under a strict CSP; these
checks keep markup-parsing sinks, inline code and remote assets out of the files themselves.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Final

import pytest
from fastapi.testclient import TestClient

from tokentrace.collector.api import ApiSettings, create_app

STATIC: Final = Path(str(resources.files("tokentrace.collector.ui").joinpath("static")))
SCRIPTS: Final = sorted(STATIC.glob("*.js"))

# Sinks that parse strings as markup or code, and inline styles (the CSP refuses them anyway,
# but a refused style is a silent rendering bug).
_FORBIDDEN_IN_SCRIPTS: Final = (
    re.compile(r"\.innerHTML\b"),
    re.compile(r"\.outerHTML\b"),
    re.compile(r"insertAdjacentHTML"),
    re.compile(r"document\.write"),
    re.compile(r"\beval\s*\("),
    re.compile(r"new\s+Function\s*\("),
    re.compile(r"createContextualFragment"),
    re.compile(r"DOMParser"),
    re.compile(r"""setAttribute\(\s*["'](style|on\w+|href|src)["']"""),
    re.compile(r"\.style\."),
    re.compile(r"setTimeout\(\s*[\"'`]"),
)
_SVG_NAMESPACE: Final = "http://www.w3.org/2000/svg"
_URL: Final = re.compile(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}[/\w.-]*", re.IGNORECASE)
_IMPORT: Final = re.compile(r"""\bfrom\s+["'](\.[^"']+)["']""")


def test_static_folder_is_flat_and_has_the_app() -> None:
    # The wheel's package data is `static/*`: a subfolder would be left out of it.
    assert all(path.is_file() for path in STATIC.iterdir())
    for name in ("index.html", "app.js", "app.css"):
        assert (STATIC / name).is_file(), name


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_scripts_have_no_markup_sinks_or_inline_styles(script: Path) -> None:
    text = script.read_text("utf-8")
    for pattern in _FORBIDDEN_IN_SCRIPTS:
        assert not pattern.search(text), f"{script.name}: {pattern.pattern}"


def test_every_module_import_resolves_to_a_local_file() -> None:
    seen: set[str] = set()
    pending = ["app.js"]
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        text = (STATIC / name).read_text("utf-8")
        for target in _IMPORT.findall(text):
            resolved = Path(target).name
            assert target.startswith("./") and (STATIC / resolved).is_file(), f"{name}: {target}"
            pending.append(resolved)
    # Every script is reachable from the entry point (no dead files shipped).
    assert seen == {path.name for path in SCRIPTS}


def test_no_remote_assets_or_inline_code_in_any_file() -> None:
    for path in STATIC.iterdir():
        text = path.read_text("utf-8").replace(_SVG_NAMESPACE, "")
        remote = [match for match in _URL.findall(text) if not match.startswith("//")]
        assert remote == [], f"{path.name} refers to {remote}"
    html = (STATIC / "index.html").read_text("utf-8")
    assert re.findall(r"<script(?![^>]*\bsrc=)[^>]*>", html) == []
    assert "<style" not in html
    assert not re.search(r"\sstyle\s*=", html)
    assert not re.search(r"\son\w+\s*=", html)


def test_the_page_and_its_assets_are_served_with_the_csp(tmp_path: Path) -> None:
    client = TestClient(create_app(ApiSettings(store_path=str(tmp_path / "missing.db"))))
    page = client.get("/")
    assert page.status_code == 200
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "style-src 'self'" in csp
    referenced = re.findall(r'(?:src|href)="(ui/[^"]+)"', page.text)
    assert "ui/app.js" in referenced and "ui/app.css" in referenced
    for asset in [*referenced, *(f"ui/{path.name}" for path in SCRIPTS)]:
        response = client.get(f"/{asset}")
        assert response.status_code == 200, asset
        if asset.endswith(".js"):
            # Module scripts load only with a JavaScript MIME type (and nosniff is on).
            assert "javascript" in response.headers["content-type"], asset
