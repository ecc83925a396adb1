"""attention.html in headless Chromium: no errors, the chosen head is drawn, the controls work.

Dimension legend: N layers, H heads, T tokens. The page is opened from its file:// URL with the
network off, as a user would open it from disk.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from playwright.sync_api import ConsoleMessage, Error, Page, sync_playwright

from attnkit.inspect import write_html

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",  # the tests run as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# as tests/conftest.py computes it (conftest cannot be imported under --import-mode=importlib)
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("ATTNKIT_TEST_ARTIFACTS", REPO / "test-artifacts"))

N, H = 2, 3
TOKENS = ["[CLS]", "the", "<b>&", "cat", '"sat"', "on", "[SEP]"]
T = len(TOKENS)


def softmax_maps(seed: int = 0) -> np.ndarray:
    """(N, H, T, T) float32 rows that sum to 1, some sharp and some flat."""
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(N, H, T, T)) * rng.uniform(0.5, 5.0, size=(N, H, 1, 1))
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    maps: np.ndarray = (weights / weights.sum(-1, keepdims=True)).astype(np.float32)
    return maps


ATT = softmax_maps()


MISSING = (
    f"{CHROMIUM} is missing, so attention.html cannot be tested in a browser. "
    "Run `make test`, which installs Chromium."
)


@dataclass
class Browser:
    """One page shared by the tests of this module; without Chromium every test fails."""

    opened: Page | None
    errors: list[str] = field(default_factory=list)

    @property
    def page(self) -> Page:
        if self.opened is None:
            pytest.fail(MISSING, pytrace=False)
        return self.opened

    def assert_no_errors(self) -> None:
        assert not self.errors, "the page logged errors:\n" + "\n".join(self.errors)

    def show(self, layer: int, head: int | str) -> None:
        self.page.select_option("#layer", str(layer))
        self.page.select_option("#head", str(head))

    def cells(self) -> tuple[np.ndarray, list[str]]:
        """The drawn heatmap: weights (T, T) from data-w, and each cell's background colour."""
        rows = self.page.eval_on_selector_all(
            "#heatmap td.cell",
            "els => els.map(e => [+e.dataset.q, +e.dataset.k, +e.dataset.w,"
            " getComputedStyle(e).backgroundColor])",
        )
        weights = np.full((T, T), np.nan)
        for q, k, w, _ in rows:
            weights[q, k] = w
        return weights, [colour for *_, colour in rows]


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    if not CHROMIUM.exists():
        yield Browser(None)  # each test fails with MISSING: a failure, never a skip
        return
    path = write_html(tmp_path_factory.mktemp("html") / "attention.html", ATT, TOKENS)
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = chromium.new_page(viewport={"width": 1100, "height": 700})
        session = Browser(page)

        def on_console(msg: ConsoleMessage) -> None:
            if msg.type == "error":
                session.errors.append(f"console: {msg.text}")

        def on_page_error(err: Error) -> None:
            session.errors.append(f"page error: {err}")

        page.on("console", on_console)
        page.on("pageerror", on_page_error)
        page.goto(path.as_uri())
        yield session
        chromium.close()


def test_page_loads_and_draws_one_cell_per_pair(browser: Browser) -> None:
    page = browser.page
    assert page.locator("#heatmap td.cell").count() == T * T
    assert page.locator("#overview canvas.thumb").count() == N * (H + 1)  # + a head average
    assert page.eval_on_selector_all("#layer option", "os => os.map(o => o.value)") == ["0", "1"]
    assert page.eval_on_selector_all("#head option", "os => os.map(o => o.value)") == [
        "0",
        "1",
        "2",
        "avg",
    ]
    browser.assert_no_errors()


def test_tokens_are_shown_as_text(browser: Browser) -> None:
    page = browser.page
    keys = page.eval_on_selector_all("#heatmap thead th.key", "ths => ths.map(t => t.textContent)")
    queries = page.eval_on_selector_all("#heatmap th.query", "ths => ths.map(t => t.textContent)")
    assert keys == TOKENS
    assert queries == TOKENS
    assert page.locator("b").count() == 0  # "<b>&" did not become markup
    browser.assert_no_errors()


@pytest.mark.parametrize(("layer", "head"), [(0, 0), (0, 2), (1, 1)])
def test_heatmap_shows_the_selected_head(browser: Browser, layer: int, head: int) -> None:
    browser.show(layer, head)
    weights, _ = browser.cells()
    np.testing.assert_allclose(weights, ATT[layer, head], rtol=0, atol=1e-5)
    browser.assert_no_errors()


def test_switching_head_redraws(browser: Browser) -> None:
    browser.show(1, 0)
    before, colours_before = browser.cells()
    browser.show(1, 1)
    after, colours_after = browser.cells()
    assert not np.allclose(before, after)
    changed = sum(a != b for a, b in zip(colours_before, colours_after, strict=True))
    assert changed > T * T // 2, f"only {changed} of {T * T} cells changed colour"
    browser.assert_no_errors()


@pytest.mark.parametrize("layer", [0, 1])
def test_head_average(browser: Browser, layer: int) -> None:
    browser.show(layer, "avg")
    weights, _ = browser.cells()
    np.testing.assert_allclose(weights, ATT[layer].mean(axis=0), rtol=0, atol=2e-5)
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, atol=1e-4)
    browser.assert_no_errors()


def test_hover_reads_out_tokens_and_weight(browser: Browser) -> None:
    browser.show(1, 2)
    q, k = 4, 2  # query '"sat"', key "<b>&"
    browser.page.hover(f'#heatmap td.cell[data-q="{q}"][data-k="{k}"]')
    text = browser.page.inner_text("#readout")
    assert f'query {q} "\\"sat\\""' in text, text
    assert f'key {k} "<b>&"' in text, text
    match = re.search(r"weight ([0-9.e+-]+)", text)
    assert match is not None, text
    assert float(match.group(1)) == pytest.approx(float(ATT[1, 2, q, k]), abs=1e-4)
    assert "layer 1, head 2" in text
    highlighted = browser.page.eval_on_selector_all(
        "#heatmap th.hl", "ths => ths.map(t => t.textContent)"
    )
    assert sorted(highlighted) == sorted([TOKENS[q], TOKENS[k]])
    browser.assert_no_errors()


def test_thumbnail_click_selects_its_map(browser: Browser) -> None:
    browser.show(0, 0)
    browser.page.click('#overview canvas.thumb[data-layer="1"][data-head="2"]')
    assert browser.page.input_value("#layer") == "1"
    assert browser.page.input_value("#head") == "2"
    weights, _ = browser.cells()
    np.testing.assert_allclose(weights, ATT[1, 2], rtol=0, atol=1e-5)
    selected = browser.page.locator("#overview canvas.thumb.selected")
    assert selected.count() == 1
    assert selected.get_attribute("data-layer") == "1"
    browser.page.click('#overview canvas.thumb[data-layer="0"][data-head="avg"]')
    assert browser.page.input_value("#head") == "avg"
    browser.assert_no_errors()


def test_screenshot(browser: Browser) -> None:
    browser.show(0, 1)
    browser.page.hover('#heatmap td.cell[data-q="2"][data-k="2"]')
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "attention-html.png"
    browser.page.screenshot(path=shot, full_page=True)
    assert shot.exists()
    assert shot.stat().st_size > 1000
    browser.assert_no_errors()
