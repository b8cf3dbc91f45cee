"""The web UI in headless Chromium against the real API over real and crafted stores.

Every check compares what the page shows with the API's own JSON for the same thing, so a test
fails when the UI drops, misplaces or misformats what the API says. Screenshots of each view go
to ``$TOKENTRACE_TEST_ARTIFACTS`` (default ``build/test-artifacts/ui/``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import pytest

from tests.ui.conftest import ServedApp, UiPage
from tests.ui.stores import (
    IMG_PAYLOAD,
    PAYLOAD_ADVICE,
    PAYLOAD_ATTRIBUTE,
    PAYLOAD_ATTRIBUTE_KEY,
    PAYLOAD_CAUSE,
    PAYLOAD_MODEL,
    PAYLOAD_REQUEST_ID,
    PAYLOAD_SENTENCE,
    PAYLOAD_SERVICE,
    PAYLOAD_SLO_TARGET,
    PAYLOAD_TRACE_LINK,
    SCRIPT_PAYLOAD,
    CraftedStore,
    RealStore,
)
from tokentrace.agent import semconv
from tokentrace.collector.api import ApiSettings
from tokentrace.collector.store import query as store_query

pytestmark = pytest.mark.slow

Serve = Callable[[ApiSettings], ServedApp]
OpenUi = Callable[[ServedApp], UiPage]

_AUTH_TOKEN: Final = "tt-ui-test-token-42"
_PX_TOLERANCE: Final = 0.25
"""The UI rounds SVG coordinates to 0.1 px."""
MAX_TICKS_DRAWN: Final = 3000
"""timeline.js's MAX_TICKS_DRAWN: above it, ticks are thinned (every outlier kept)."""
_RENDER_BUDGET_S: Final = 5.0
"""Generous for a 2-core CI machine; the page draws 4096 tokens in well under a second."""
_CLEAR_CHANGE: Final = 0.1
"""A relative p99 change the compare view must mark as better or worse."""
_MS_NUMBER = re.compile(r"^([+-]?[\d,]*\.?\d+)( ms)?$")


# --- helpers -------------------------------------------------------------------------------------


def shown_ms(text: str) -> float | None:
    """A duration cell as the UI formats it ("12.34", "1.5 ms", "-") back to ms."""
    text = text.strip()
    if text == "-":
        return None
    match = _MS_NUMBER.match(text)
    assert match, f"not a duration: {text!r}"
    return float(match.group(1).replace(",", ""))


def assert_shows_ms(text: str, expected: float | None, where: str) -> None:
    """The cell shows ``expected`` ms to the precision it prints (or "-" for no value)."""
    value = shown_ms(text)
    if expected is None:
        assert value is None, f"{where}: shows {text!r} for no value"
        return
    assert value is not None, f"{where}: shows '-' for {expected}"
    decimals = len(text.strip().split(" ")[0].partition(".")[2])
    tolerance = 0.5 * 10**-decimals + 1e-9
    assert abs(value - expected) <= tolerance, f"{where}: shows {text!r}, the API says {expected}"


def cell_texts(row: Any) -> dict[str, str]:
    """``data-cell`` name -> text of one table row."""
    result: dict[str, str] = row.evaluate(
        "row => Object.fromEntries([...row.querySelectorAll('[data-cell]')]"
        ".map(cell => [cell.dataset.cell, cell.textContent]))"
    )
    return result


Key = tuple[str, str, str, str]


def keyed_rows(page: UiPage, testid: str) -> dict[tuple[Key, str], dict[str, Any]]:
    """Every row with that test id, read in one call: ((service, model, operation, prompt
    bucket), metric) -> {cells: data-cell -> text, classes: data-cell -> class}."""
    rows: list[dict[str, Any]] = page.testid(testid).evaluate_all(
        """rows => rows.map((row) => ({
          key: [row.dataset.service, row.dataset.model, row.dataset.operation,
                row.dataset.promptBucket].map((value) => value ?? ""),
          metric: row.dataset.metric ?? "",
          cells: Object.fromEntries([...row.querySelectorAll("[data-cell]")]
            .map((cell) => [cell.dataset.cell, cell.textContent])),
          classes: Object.fromEntries([...row.querySelectorAll("[data-cell]")]
            .map((cell) => [cell.dataset.cell, cell.className])),
        }))"""
    )
    found: dict[tuple[Key, str], dict[str, Any]] = {}
    for row in rows:
        where = (tuple(row["key"]), row["metric"])
        assert where not in found, f"two rows for {where}"
        found[where] = row
    return found


def svg_number(locator: Any, attribute: str) -> float:
    return float(locator.get_attribute(attribute))


def check_request_page(page: UiPage, detail: Mapping[str, Any]) -> None:
    """What the request page shows against the API's detail document of that request."""
    doc = detail["request"]
    assert page.testid("verdict").text_content() == detail["verdict_text"]
    panel = page.testid("verdict-panel")
    assert panel.get_attribute("data-metric") == detail["verdict_metric"]
    verdict = detail["verdict"] or {}
    assert panel.get_attribute("data-segment") == verdict.get("segment")
    assert panel.get_attribute("data-clock") == verdict.get("clock")
    for key in verdict.get("numbers") or {}:
        # The metric and its clock are the panel's own attributes, not numbers.
        expected_count = 0 if key in ("metric", "clock") else 1
        assert page.testid("verdict-numbers", f' [data-key="{key}"]').count() == expected_count

    rows = page.page.eval_on_selector_all(
        '[data-testid="waterfall-row"]',
        "rows => rows.map(row => [row.dataset.segment, row.dataset.label,"
        " row.querySelectorAll('rect.seg').length, row.dataset.dominant === 'true'])",
    )
    expected = [
        [r["segment"], r["label"], len(r["intervals_ms"]), r["dominant"]]
        for r in detail["waterfall"]
    ]
    assert rows == expected
    assert len(expected) > 0

    offsets = doc.get("token_offsets_us") or []
    ticks = page.testid("token-tick")
    assert ticks.count() == len(offsets) == len(detail["tokens"]["ticks_ms"])
    outliers = [gap for gap in detail["tokens"]["gaps"] if gap["outlier"]]
    assert page.testid("token-tick", '[data-outlier="true"]').count() == len(outliers)
    assert page.testid("outlier-gap").count() == len(outliers)
    assert page.testid("engine-step").count() == len(detail["engine_steps"])

    # One time axis: decode's bar starts where the first token's tick is drawn.
    if offsets:
        decode_bar = page.testid("waterfall-row", '[data-segment="decode"] rect.seg').first
        first_tick = ticks.first
        assert abs(svg_number(decode_bar, "x") - svg_number(first_tick, "x1")) <= _PX_TOLERANCE


def page_is_inert(page: UiPage) -> None:
    """No hostile string became markup: nothing ran, no element or handler came from data."""
    state = page.page.evaluate(
        """() => ({
          pwned: typeof window.__pwned,
          images: document.querySelectorAll("img").length,
          scripts: [...document.scripts].map((script) => script.getAttribute("src")),
          handlers: [...document.querySelectorAll("*")].flatMap((node) =>
            [...node.attributes].filter((a) => a.name.startsWith("on"))
              .map((a) => `${node.tagName} ${a.name}`)),
          links: [...document.querySelectorAll("a[href]")].map((a) => a.getAttribute("href"))
            .filter((href) => !/^(https?:\\/\\/|#)/.test(href)),
          frames: document.querySelectorAll("iframe, object, embed").length,
        })"""
    )
    assert state["pwned"] == "undefined"
    assert state["images"] == 0
    assert state["scripts"] == ["ui/app.js"]
    assert state["handlers"] == []
    assert state["links"] == []
    assert state["frames"] == 0


def body_text(page: UiPage) -> str:
    text: str = page.page.evaluate("document.body.textContent")
    return text


# --- real traces -----------------------------------------------------------------------------


def test_slowest_request_from_real_traces(
    real_store: RealStore, serve: Serve, open_ui: OpenUi
) -> None:
    app = serve(ApiSettings(store_path=str(real_store.path)))
    page = open_ui(app)
    page.goto("#/requests")
    page.wait_for("request-row")
    listed = app.api("requests", {"limit": 50})
    assert page.testid("request-row").count() == len(listed["items"]) > 0
    page.screenshot("list")

    page.testid("sort-e2e").click()
    page.wait_for("sort-e2e", '[aria-sort="descending"]')
    page.wait_for("request-row")
    by_e2e = app.api("requests", {"sort": "e2e", "order": "desc", "limit": 50})
    shown_ids = [
        page.testid("request-row").nth(i).get_attribute("data-trace-id")
        for i in range(page.testid("request-row").count())
    ]
    assert shown_ids == [item["trace_id"] for item in by_e2e["items"]]
    e2e_cells = page.testid("request-row").locator('[data-metric="e2e"]').all_text_contents()
    for text, item in zip(e2e_cells, by_e2e["items"], strict=True):
        assert_shows_ms(text, item["e2e_ms"], f"E2E of {item['trace_id']}")

    slowest = by_e2e["items"][0]
    page.testid("request-row").first.locator('[data-testid="request-link"]').click()
    page.wait_for("verdict")
    assert slowest["trace_id"] in page.page.url
    detail = app.api(f"requests/{slowest['trace_id']}", {"span_id": slowest["span_id"]})
    assert detail["request"]["trace_id"] == slowest["trace_id"]
    check_request_page(page, detail)
    assert page.testid("trace-id").text_content() == slowest["trace_id"]
    page.screenshot("request")
    page.assert_clean()


def test_fleet_view_shows_the_api_numbers(
    real_store: RealStore, serve: Serve, open_ui: OpenUi
) -> None:
    app = serve(ApiSettings(store_path=str(real_store.path)))
    page = open_ui(app)
    page.goto("#/fleet?last=1h")
    page.wait_for("fleet-table")
    fleet = app.api("fleet", {"last": "1h"})
    report = fleet["window"]
    assert report["requests"] > 0

    rows = keyed_rows(page, "fleet-row")
    assert len(rows) == len(report["keys"])
    for key in report["keys"]:
        where = (key["service"], key["model"], key["operation"], key["prompt_bucket"])
        cells = rows[(where, "")]["cells"]
        assert cells["requests"] == f"{key['requests']:,}"
        for metric in ("ttft", "tpot", "itl", "e2e"):
            for quantile in ("p50", "p99"):
                expected = (key["metrics"].get(metric) or {}).get(quantile)
                assert_shows_ms(cells[f"{metric}.{quantile}"], expected, f"{metric} {quantile}")

    slo_rows = page.testid("slo-row")
    assert slo_rows.count() == len(report["slo"])
    for index, entry in enumerate(report["slo"]):
        cells = cell_texts(slo_rows.nth(index))
        assert slo_rows.nth(index).get_attribute("data-target") == entry["target"]
        assert_shows_ms(cells["value"], entry["value_ms"], entry["target"])
        status = {True: "met", False: "breached", None: "no data"}[entry["met"]]
        assert cells["status"] == status

    for metric, histogram in fleet["distributions"].items():
        chart = page.testid("histogram", f'[data-metric="{metric}"]')
        assert chart.count() == 1, metric
        bars = chart.locator("rect.hist-bar")
        assert bars.count() == sum(1 for count in histogram["counts"] if count > 0), metric

    for band in ("p50", "p99"):
        segments = fleet["budget"][band].get("segments") or {}
        bar = page.testid("budget-bar", f'[data-percentile="{band}"]')
        shown = bar.locator("rect[data-segment]").evaluate_all(
            "rects => rects.map(r => r.dataset.segment)"
        )
        assert sorted(shown) == sorted(name for name, ms in segments.items() if ms and ms > 0)

    slowest_ids = page.testid("slowest-row").evaluate_all(
        "rows => rows.map(row => row.dataset.traceId)"
    )
    assert slowest_ids == [item["trace_id"] for item in fleet["slowest"]]
    page.screenshot("fleet")

    page.assert_clean()


# --- crafted traces --------------------------------------------------------------------------


def test_engine_steps_and_gpu_lanes_share_the_request_time_axis(
    crafted: CraftedStore, serve: Serve, open_ui: OpenUi
) -> None:
    app = serve(ApiSettings(store_path=str(crafted.path)))
    page = open_ui(app)
    page.goto(f"#/request/{crafted.spiky_trace_id}")
    page.wait_for("timeline")
    detail = app.api(f"requests/{crafted.spiky_trace_id}")
    check_request_page(page, detail)

    steps = detail["engine_steps"]
    outlier_steps = [step for step in steps if step["outlier"]]
    assert len(steps) > 1 and len(outlier_steps) == 1
    assert page.testid("engine-step", '[data-outlier="true"]').count() == 1
    # The table lists the steps that coincided with the outlier gaps, with their batch.
    table_rows = page.testid("engine-step-row")
    assert table_rows.count() == len(outlier_steps)
    stalled = outlier_steps[0]
    row = table_rows.first
    assert row.get_attribute("data-span-id") == stalled["span_id"]
    assert row.locator('[data-field="batch_size"]').text_content() == str(stalled["batch_size"])
    assert row.locator('[data-field="prefill_tokens"]').text_content() == (
        f"{stalled['prefill_tokens']:,}"
    )

    # Same x scale: the stalled step spans exactly the outlier gap between its two ticks.
    gap = next(gap for gap in detail["tokens"]["gaps"] if gap["outlier"])
    ticks = page.testid("token-tick")
    before = svg_number(ticks.nth(gap["index"] - 1), "x1")
    after = svg_number(ticks.nth(gap["index"]), "x1")
    step_rect = page.testid("engine-step", '[data-outlier="true"]')
    gap_rect = page.testid("outlier-gap").first
    for rect in (step_rect, gap_rect):
        left = svg_number(rect, "x")
        assert abs(left - before) <= _PX_TOLERANCE
        assert abs(left + svg_number(rect, "width") - after) <= 2 * _PX_TOLERANCE + 0.5

    # GPU lanes: one bar per engine step that carries GPU aggregates, with the step's values.
    lanes = {"utilization": "utilization_mean", "bandwidth": "bandwidth_peak_ratio"}
    for lane, field_name in lanes.items():
        values = page.testid("gpu-lane", f'[data-metric="{lane}"] [data-testid="gpu-bar"]')
        shown = sorted(
            float(v) for v in values.evaluate_all("bars => bars.map(b => b.dataset.value)")
        )
        expected = sorted(step["gpu"][field_name] for step in steps if step.get("gpu"))
        assert shown == pytest.approx(expected)
    assert page.testid("gpu-phase-row").count() == len(detail["gpu"])

    # Clicking the stalled step on the lane selects its row in the table.
    step_rect.click()
    page.wait_for("engine-step-row", ".selected")
    page.screenshot("request-engine-steps")
    page.assert_clean()


def test_compare_view_shows_both_windows_against_the_targets(
    crafted: CraftedStore, serve: Serve, open_ui: OpenUi
) -> None:
    app = serve(ApiSettings(store_path=str(crafted.path)))
    windows = {
        "a_since": crafted.before_s[0],
        "a_until": crafted.before_s[1],
        "b_since": crafted.after_s[0],
        "b_until": crafted.after_s[1],
    }
    compare = app.api("compare", windows)
    assert compare["a"]["requests"] > 0 and compare["b"]["requests"] > 0
    page = open_ui(app)
    page.goto("#/compare?" + "&".join(f"{name}={value}" for name, value in windows.items()))
    page.wait_for("compare-table")

    shown_rows = keyed_rows(page, "compare-row")
    assert len(shown_rows) == len(compare["metrics"])
    better = 0
    for entry in compare["metrics"]:
        key = (entry["service"], entry["model"], entry["operation"], entry["prompt_bucket"])
        row = shown_rows[(key, entry["metric"])]
        cells = row["cells"]
        for side in ("a", "b"):
            for quantile in ("p50", "p95", "p99"):
                expected = (entry[side] or {}).get(quantile)
                assert_shows_ms(cells[f"{side}.{quantile}"], expected, f"{side} {quantile}")
        for quantile in ("p50", "p95", "p99"):
            delta = (entry["delta"] or {}).get(quantile)
            assert_shows_ms(cells[f"delta.{quantile}"], delta, f"delta {quantile}")
        change = (entry["change"] or {}).get("p99")
        classes = row["classes"]["change.p99"].split()
        if change is not None and change < -_CLEAR_CHANGE:
            assert "good" in classes
            better += 1
        elif change is not None and change > _CLEAR_CHANGE:
            assert "bad" in classes
    assert better > 0  # the "after" traffic lost its queueing tail

    slo_rows = page.testid("compare-slo-row")
    assert slo_rows.count() == len(compare["slo"])
    for index, entry in enumerate(compare["slo"]):
        cells = cell_texts(slo_rows.nth(index))
        for side in ("a", "b"):
            assert_shows_ms(cells[f"{side}.value"], (entry[side] or {}).get("value_ms"), side)
    for side in ("a", "b"):
        shown = page.testid(f"window-{side}").locator('[data-cell="requests"]').text_content()
        assert shown == f"{compare[side]['requests']:,}"
    bars = page.testid("compare-budget-bar")
    assert bars.count() == 4
    page.screenshot("compare")
    page.assert_clean()


def shown_trace_ids(page: UiPage) -> list[str]:
    ids: list[str] = page.testid("request-row").evaluate_all(
        "rows => rows.map(row => row.dataset.traceId)"
    )
    return ids


def test_list_filters_sorting_and_pages_follow_the_api(
    crafted: CraftedStore, serve: Serve, open_ui: OpenUi
) -> None:
    app = serve(ApiSettings(store_path=str(crafted.path)))
    page = open_ui(app)
    query = {"limit": 20, "sort": "ttft", "order": "asc"}
    page.goto("#/requests?limit=20&sort=ttft&order=asc")
    page.wait_for("sort-ttft", '[aria-sort="ascending"]')

    # Next, next, then back twice: the same pages as the API's cursors give.
    pages = [app.api("requests", query)]
    assert pages[0]["next_cursor"]
    assert shown_trace_ids(page) == [item["trace_id"] for item in pages[0]["items"]]
    for _ in range(2):
        pages.append(app.api("requests", {**query, "cursor": pages[-1]["next_cursor"]}))
        first_id = pages[-1]["items"][0]["trace_id"]
        page.testid("next-page").click()
        page.wait_for("request-row", f'[data-trace-id="{first_id}"]')
        assert shown_trace_ids(page) == [item["trace_id"] for item in pages[-1]["items"]]
    for expected in (pages[1], pages[0]):
        first_id = expected["items"][0]["trace_id"]
        page.testid("prev-page").click()
        page.wait_for("request-row", f'[data-trace-id="{first_id}"]')
        assert shown_trace_ids(page) == [item["trace_id"] for item in expected["items"]]
    assert page.testid("prev-page").is_disabled()

    # Filters from the form reach the API as its parameters.
    page.page.locator('input[data-filter="model"]').fill("plain-model")
    page.page.locator('select[data-filter="slo_breached"]').select_option("true")
    page.page.locator('input[data-filter="min_e2e_ms"]').fill("150")
    page.testid("apply-filters").click()
    page.page.wait_for_function("location.hash.includes('slo_breached=true')")
    filtered = app.api(
        "requests",
        {**query, "model": "plain-model", "slo_breached": "true", "min_e2e_ms": "150"},
    )
    assert 0 < len(filtered["items"]) < pages[0]["total"]
    page.wait_for("list-summary", f":text('{filtered['total']} matching')")
    assert shown_trace_ids(page) == [item["trace_id"] for item in filtered["items"]]
    assert set(page.testid("request-row").locator('[data-field="model"]').all_text_contents()) == {
        "plain-model"
    }

    # Search by request id.
    page.goto("#/requests?q=cmpl-long")
    page.wait_for("list-summary", ":text('1 matching request')")
    assert shown_trace_ids(page) == [crafted.long_trace_id]
    page.assert_clean()


def test_strings_from_spans_are_shown_as_text_and_never_run(
    crafted: CraftedStore, serve: Serve, open_ui: OpenUi
) -> None:
    app = serve(ApiSettings(store_path=str(crafted.path), trace_link=PAYLOAD_TRACE_LINK))
    page = open_ui(app)

    page.goto("#/requests")
    page.wait_for("request-row")
    page_is_inert(page)
    models = page.testid("request-row").locator('[data-field="model"]').all_text_contents()
    services = page.testid("request-row").locator('[data-field="service"]').all_text_contents()
    assert PAYLOAD_MODEL in models
    assert PAYLOAD_SERVICE in services
    verdicts = page.testid("request-row").locator('[data-field="verdict"]').all_text_contents()
    assert PAYLOAD_SENTENCE in verdicts

    page.goto(f"#/request/{crafted.spiky_trace_id}")
    page.wait_for("verdict")
    page.testid("spans").locator("summary").first.click()
    page.testid("span-row").first.locator("summary").click()  # the request span's attributes
    page_is_inert(page)
    assert page.testid("verdict").text_content() == PAYLOAD_SENTENCE
    cause = page.page.locator('[data-testid="verdict-panel"] [data-field="cause"]')
    assert cause.text_content() == PAYLOAD_CAUSE
    assert page.testid("advice").text_content() == PAYLOAD_ADVICE
    assert page.page.locator('[data-field="request_id"]').text_content() == PAYLOAD_REQUEST_ID
    assert page.page.locator('.request-title [data-field="model"]').text_content() == PAYLOAD_MODEL
    # The javascript: trace link is shown, but not as a link.
    trace_link = page.testid("trace-link")
    assert trace_link.evaluate("node => node.tagName") == "SPAN"
    assert trace_link.text_content() == PAYLOAD_TRACE_LINK.replace(
        "{trace_id}", crafted.spiky_trace_id
    )
    attribute_values = page.page.locator('[data-testid="span-row"] dl.attributes dd')
    assert PAYLOAD_ATTRIBUTE in attribute_values.all_text_contents()
    assert PAYLOAD_ATTRIBUTE_KEY in body_text(page)
    marks = page.testid("slo-mark").all_text_contents()
    assert any(PAYLOAD_SLO_TARGET in mark for mark in marks)
    page.screenshot("escaping-request")

    page.goto("#/fleet?last=1h")
    page.wait_for("fleet-table")
    page_is_inert(page)
    assert page.testid("fleet-row", f"[data-model='{PAYLOAD_MODEL}']").count() >= 1
    assert page.testid("slo-row").first.get_attribute("data-target") == PAYLOAD_SLO_TARGET
    assert PAYLOAD_SLO_TARGET in body_text(page)

    # Hostile text in the address bar's route is data too.
    page.goto(f"#/requests?model={IMG_PAYLOAD}&q=x")
    page.wait_for("filters")
    page_is_inert(page)
    assert page.page.locator('input[data-filter="model"]').input_value() == IMG_PAYLOAD
    page.goto(f"#/request/{SCRIPT_PAYLOAD}")
    page.wait_for("error")
    page_is_inert(page)
    page.assert_clean(allowed_console=("status of 400",))


def test_token_prompt_refuses_a_wrong_token_and_loads_with_the_right_one(
    crafted: CraftedStore, serve: Serve, open_ui: OpenUi
) -> None:
    app = serve(ApiSettings(store_path=str(crafted.path), auth_token=_AUTH_TOKEN))
    page = open_ui(app)
    page.goto("#/requests")
    page.wait_for("token-form")
    assert page.testid("request-table").count() == 0
    page.screenshot("token-prompt")

    page.testid("token-input").fill("not-the-token")
    page.testid("token-submit").click()
    page.wait_for("token-error", ":text('refused')")
    assert page.testid("request-table").count() == 0
    assert page.testid("token-form").count() == 1

    page.testid("token-input").fill(_AUTH_TOKEN)
    page.testid("token-submit").click()
    page.wait_for("request-row")
    stored = page.page.evaluate("sessionStorage.getItem('tokentrace.token')")
    assert stored == _AUTH_TOKEN
    listed = app.api("requests", {"limit": 50}, token=_AUTH_TOKEN)
    assert page.testid("request-row").count() == len(listed["items"])
    page.assert_clean(allowed_console=("status of 401",))

    # A link carrying the token in its fragment works once and leaves no token in the URL.
    fresh = open_ui(app)
    fresh.goto(f"#token={_AUTH_TOKEN}")
    fresh.wait_for("request-row")
    assert "token" not in fresh.page.evaluate("location.href")
    fresh.assert_clean()


def test_a_long_request_draws_a_bounded_number_of_ticks_and_every_outlier(
    crafted: CraftedStore, serve: Serve, open_ui: OpenUi
) -> None:
    app = serve(ApiSettings(store_path=str(crafted.path)))
    detail = app.api(f"requests/{crafted.long_trace_id}")
    total = len(detail["tokens"]["ticks_ms"])
    outliers = [gap for gap in detail["tokens"]["gaps"] if gap["outlier"]]
    assert total > MAX_TICKS_DRAWN and outliers
    page = open_ui(app)
    started = time.monotonic()
    page.goto(f"#/request/{crafted.long_trace_id}")
    row = page.wait_for("token-row")
    elapsed_s = time.monotonic() - started
    assert row.get_attribute("data-total") == str(total)
    drawn = page.testid("token-tick").count()
    assert drawn == int(row.get_attribute("data-drawn"))
    assert drawn <= MAX_TICKS_DRAWN + len(outliers)
    assert page.testid("token-tick", '[data-outlier="true"]').count() == len(outliers)
    assert elapsed_s < _RENDER_BUDGET_S, f"the request page took {elapsed_s:.1f} s"
    page.assert_clean()


# --- one metric at a time --------------------------------------------------------------------


def dominant_rows(page: UiPage, testid: str) -> list[str]:
    """The ``data-segment`` of every element marked ``data-dominant`` that is, or is inside,
    an element with that test id."""
    segments: list[str] = page.page.locator(
        f'[data-testid="{testid}"][data-dominant="true"], '
        f'[data-testid="{testid}"] [data-dominant="true"]'
    ).evaluate_all("rows => rows.map(row => row.dataset.segment)")
    return segments


def budget_rows(page: UiPage) -> dict[str, str]:
    """Segment -> ms cell of the budget table shown."""
    rows: dict[str, str] = page.testid("budget-table").evaluate(
        "table => Object.fromEntries([...table.querySelectorAll('tr[data-segment]')]"
        ".map(row => [row.dataset.segment, row.cells[1].textContent]))"
    )
    return rows


def check_budget(page: UiPage, budget: Mapping[str, Any], clock: str) -> None:
    assert page.testid("budget-table").get_attribute("data-clock") == clock
    rows = budget_rows(page)
    assert sorted(rows) == sorted(name for name, ms in budget["segments"].items() if ms > 0)
    for segment, text in rows.items():
        assert_shows_ms(text, budget["segments"][segment], f"{clock} {segment}")
    total = page.testid("budget-table").locator('[data-field="value"]').text_content()
    assert_shows_ms(total, budget["value_ms"], f"{clock} total")


def test_the_metric_switch_answers_about_each_metric_on_its_clock(
    replayed: Path, serve: Serve, open_ui: OpenUi
) -> None:
    app = serve(ApiSettings(store_path=str(replayed)))
    trace_id = app.api("requests", {"sort": "ttft", "limit": 1})["items"][0]["trace_id"]
    default = app.api(f"requests/{trace_id}")
    tpot = app.api(f"requests/{trace_id}", {"metric": "tpot"})
    doc = default["request"]
    # The slowest TTFT breached the TTFT target: queue wait, as the client saw it.
    assert (default["verdict_metric"], default["verdict"]["segment"]) == ("ttft", "queue")
    assert default["verdict"]["clock"] == "client"
    assert (tpot["verdict"]["segment"], tpot["verdict"]["clock"]) == ("decode", "server")

    page = open_ui(app)
    page.goto(f"#/request/{trace_id}")
    page.wait_for("verdict-panel", '[data-metric="ttft"]')
    check_request_page(page, default)
    switch = page.testid("metric-switch").locator("button")
    assert switch.evaluate_all("buttons => buttons.map(b => b.dataset.metric)") == [
        metric for metric in semconv.VERDICT_METRICS if metric in doc["verdicts"]
    ]
    default_button = page.testid("metric-switch").locator('button[data-default="true"]')
    assert default_button.get_attribute("data-metric") == "ttft"
    assert default_button.get_attribute("aria-pressed") == "true"
    heading = page.testid("verdict-heading").text_content()
    assert heading == default["verdict_heading"] and doc["verdict"]["why"] in heading
    assert dominant_rows(page, "waterfall-row") == ["queue"]
    assert dominant_rows(page, "budget-table") == ["queue"]
    check_budget(page, doc["budgets"]["ttft"]["client"], "client")
    assert "client-seen" in page.testid("clock-label").all_text_contents()
    # The latency line says whose clock measured each figure.
    e2e = page.testid("metrics").locator('[data-metric="e2e"] dd')
    server_text, client_text = e2e.locator("[data-clock]").all_text_contents()
    assert server_text.startswith("server ") and client_text.startswith("client ")
    assert_shows_ms(server_text.removeprefix("server "), doc["metrics_ms"]["e2e"], "server E2E")
    assert_shows_ms(
        client_text.removeprefix("client "), doc["budgets"]["e2e"]["client"]["value_ms"], "E2E"
    )
    page.screenshot("request-metric-ttft")

    # With the keyboard: TPOT, decode, on the server's clock; the focus stays on the switch.
    page.testid("metric-switch").locator('button[data-metric="tpot"]').focus()
    page.page.keyboard.press("Enter")
    page.wait_for("verdict-panel", '[data-metric="tpot"]')
    check_request_page(page, tpot)
    assert "metric=tpot" in page.page.url
    page.page.wait_for_function("document.activeElement?.dataset.metric === 'tpot'")
    pressed = page.testid("metric-switch").locator('button[aria-pressed="true"]')
    assert pressed.get_attribute("data-metric") == "tpot"
    assert page.testid("verdict-heading").text_content() == tpot["verdict_heading"]
    assert doc["verdict"]["why"] in page.testid("default-why").text_content()
    assert dominant_rows(page, "waterfall-row") == ["decode"]
    assert dominant_rows(page, "budget-table") == ["decode"]
    check_budget(page, doc["budgets"]["tpot"]["server"], "server")
    assert page.testid("clock-toggle").count() == 0  # TPOT has the server's clock only
    assert "server-seen" in page.testid("clock-label").all_text_contents()
    page.screenshot("request-metric-tpot")

    # Back to the default, and its budget on the server's clock: no network in it.
    page.testid("metric-switch").locator('button[data-metric="ttft"]').click()
    page.wait_for("verdict-panel", '[data-metric="ttft"]')
    assert "metric=" not in page.page.url
    page.testid("clock-toggle").locator('button[data-clock="server"]').click()
    page.wait_for("budget-table", '[data-clock="server"]')
    check_budget(page, doc["budgets"]["ttft"]["server"], "server")
    assert "network" not in budget_rows(page)
    page.assert_clean()


# --- the fleet's diagnosis -----------------------------------------------------------------------


def test_the_fleet_diagnosis_puts_the_missed_target_first_with_its_counterfactual(
    crafted: CraftedStore, serve: Serve, open_ui: OpenUi
) -> None:
    app = serve(ApiSettings(store_path=str(crafted.path)))
    diagnosis = app.api("diagnose", {"last": "1h"})
    findings = diagnosis["findings"]
    assert findings[0]["met"] is False and findings[0]["counterfactual"]
    page = open_ui(app)
    page.goto("#/fleet?last=1h")
    page.wait_for("diagnosis", '[data-state="ready"]')
    page_is_inert(page)  # the first target's name is a hostile string

    cards = page.testid("finding-card")
    assert cards.evaluate_all("cards => cards.map(c => [c.dataset.target, c.dataset.met])") == [
        [f["target"], str(f["met"]).lower()] for f in findings
    ]
    first = cards.first
    assert first.locator('[data-testid="finding-status"]').text_content() == "MISSED"
    assert first.locator(".finding-head").text_content() == "MISSED" + findings[0]["lines"][0]
    lines = first.locator('[data-testid="finding-line"]').all_text_contents()
    assert lines == findings[0]["lines"][1:]
    counterfactual = findings[0]["counterfactual"]
    assert any(
        line.startswith(f"p{findings[0]['percentile']:g} TTFT") and " without " in line
        for line in lines
    ), lines
    assert first.get_attribute("data-segment") == counterfactual["segment"]

    # The metrics no target judges, then how users perceived the window.
    judged = {f["metric"] for f in findings}
    per_metric = [f for f in diagnosis["metric_findings"] if f["metric"] not in judged]
    metric_cards = page.testid("metric-finding-card")
    assert metric_cards.evaluate_all(
        "cards => cards.map(c => [c.dataset.metric, c.dataset.group])"
    ) == [[f["metric"], f["group"]] for f in per_metric]
    assert page.testid("perceived-unknown").count() == 1  # no client spans in this store
    summary = page.testid("diagnosis-summary").text_content()
    assert f"{diagnosis['requests']} requests" in summary
    page.screenshot("fleet-diagnosis")
    page.assert_clean()


def test_the_fleet_diagnosis_says_when_it_ran_past_the_time_budget(
    crafted: CraftedStore, serve: Serve, open_ui: OpenUi, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_query, "QUERY_BUDGET_S", 0.0)
    app = serve(ApiSettings(store_path=str(crafted.path)))
    page = open_ui(app)
    page.goto("#/fleet?last=1h")
    section = page.wait_for("diagnosis", '[data-state="error"]')
    assert section.get_attribute("data-status") == "503"
    error = page.testid("diagnosis-error").text_content()
    assert error.startswith("The diagnosis did not finish: ")
    assert "narrow the window or lower the request limit" in error
    assert page.testid("fleet-table").count() == 1  # the rest of the view is there
    page.assert_clean(allowed_console=("status of 503",))
