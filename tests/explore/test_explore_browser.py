"""End to end in a real headless Chromium: load the page, enter a prompt, switch layer and
head, step generation once, and check what is drawn. Saves screenshots as artifacts.

Needs Debian's ``chromium`` and ``chromium-driver`` (``.ci/run`` installs them) and the
``selenium`` package; skips with the reason when any is missing.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from handformer.explore.explorer import Explorer
from handformer.explore.run import load_explore_run
from handformer.explore.server import ExploreServer
from tests.explore.test_explore_api import make_lm_run

CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1400,2000", "--force-device-scale-factor=1",
)
MAX_LEN = 24
PROMPT = "the lazy dog"

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                "(pip install -r requirements-dev.txt)")
if CHROMIUM is None or not CHROMEDRIVER.exists():
    pytest.skip("Chromium or chromedriver is missing: apt-get install -y chromium "
                "chromium-driver (.ci/run does this)", allow_module_level=True)

from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[ExploreServer]:
    run_dir = make_lm_run(tmp_path / "run", train_steps=60, max_len=MAX_LEN)
    srv = ExploreServer(Explorer(load_explore_run(run_dir)), "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)


@pytest.fixture()
def browser(tmp_path: Path) -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path=str(CHROMEDRIVER))
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver: Any, condition: Any, what: str, timeout: float = 20) -> Any:
    # The page redraws its canvases on every answer: an element found a moment ago may be
    # gone by the time its attribute is read (seen once on a loaded machine). Poll again.
    return WebDriverWait(driver, timeout, ignored_exceptions=(
        StaleElementReferenceException,)).until(condition, message=f"waiting for {what}")


def _attr(driver: Any, css: str, name: str) -> str | None:
    found = driver.find_elements(By.CSS_SELECTOR, css)
    return found[0].get_attribute(name) if found else None


def _pixel(driver: Any, canvas: Any, row: int, col: int) -> list[int]:
    """RGB of the centre of cell (row, col) of a heatmap canvas, read back from the canvas."""
    return driver.execute_script("""
        const c = arguments[0], row = arguments[1], col = arguments[2];
        const cell = Number(c.dataset.cell), margin = Number(c.dataset.margin);
        const ratio = c.width / parseFloat(c.style.width);
        const x = Math.floor((margin + (col + 0.5) * cell) * ratio);
        const y = Math.floor((margin + (row + 0.5) * cell) * ratio);
        return Array.from(c.getContext("2d").getImageData(x, y, 1, 1).data.slice(0, 3));
    """, canvas, row, col)


def _hover_cell(driver: Any, canvas: Any, row: int, col: int) -> str:
    cell = int(canvas.get_attribute("data-cell"))
    margin = int(canvas.get_attribute("data-margin"))
    size = canvas.size
    dx = margin + (col + 0.5) * cell - size["width"] / 2  # offsets are from the centre
    dy = margin + (row + 0.5) * cell - size["height"] / 2
    ActionChains(driver).move_to_element_with_offset(canvas, int(dx), int(dy)).perform()
    return driver.find_element(By.ID, "hover-readout").text


def test_the_page_end_to_end(server: ExploreServer, browser: Any, tmp_path: Path) -> None:
    d = browser
    d.get(server.url)
    _wait(d, lambda d: _attr(d, "body", "data-ready") == "true", "the run info")
    assert "language model run" in d.find_element(By.ID, "run-info").text
    assert d.find_elements(By.CSS_SELECTOR, "#loss-curve svg polyline.train")
    assert d.find_elements(By.CSS_SELECTOR, "#loss-curve svg circle.val")
    assert '"max_len": 24' in d.find_element(By.ID, "config").get_attribute("textContent")

    # Type a prompt: its tokens and a (T, T) heatmap for layer 0, head 0 appear.
    prompt = d.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys(PROMPT)
    d.find_element(By.ID, "show-btn").click()
    _wait(d, lambda d: _attr(d, "#attn-tokens", "data-count") == str(len(PROMPT)), "tokens")
    tokens = [e.text for e in d.find_elements(By.CSS_SELECTOR, "#attn-tokens .tok")]
    assert tokens == [c if c != " " else "␣" for c in PROMPT]
    canvas = d.find_element(By.CSS_SELECTOR, "#attn-maps canvas.heatmap")
    t = str(len(PROMPT))
    assert (canvas.get_attribute("data-rows"), canvas.get_attribute("data-cols")) == (t, t)
    assert (canvas.get_attribute("data-layer"), canvas.get_attribute("data-head")) == ("0", "0")
    # Drawn: row 0 may only see key 0 (weight exactly 1: darkest blue); keys after the
    # query are masked (grey overlay).
    assert _pixel(d, canvas, 0, 0) == [8, 48, 107]
    assert _pixel(d, canvas, 0, len(PROMPT) - 1) == [200, 200, 200]
    assert _pixel(d, canvas, 5, 9) == [200, 200, 200]
    assert _pixel(d, canvas, 9, 5) != [200, 200, 200]

    readout = _hover_cell(d, canvas, 4, 1)
    assert "query 4 'l' → key 1 'h': weight 0." in readout and "masked" not in readout
    assert "(masked" in _hover_cell(d, canvas, 1, 4)

    # Switch layer and head; then all heads as small multiples, with the mask side by side.
    Select(d.find_element(By.ID, "layer")).select_by_value("1")
    _wait(d, lambda d: _attr(d, "#attn-maps", "data-layer") == "1", "layer 1")
    Select(d.find_element(By.ID, "head")).select_by_value("3")
    _wait(d, lambda d: _attr(d, "#attn-maps canvas", "data-head") == "3", "head 3")
    Select(d.find_element(By.ID, "head")).select_by_value("all")
    _wait(d, lambda d: _attr(d, "#attn-maps", "data-heads") == "0,1,2,3", "all heads")
    Select(d.find_element(By.ID, "mask-mode")).select_by_value("side")
    maps = d.find_elements(By.CSS_SELECTOR, "#attn-maps canvas.heatmap")
    assert [m.get_attribute("data-kind") for m in maps] == ["weights", "mask"] * 4
    mask_canvas = maps[1]
    assert _pixel(d, mask_canvas, 3, 2) == [40, 40, 40]  # may attend: dark
    assert _pixel(d, mask_canvas, 2, 3) == [255, 255, 255]  # masked: white
    Select(d.find_element(By.ID, "mask-mode")).select_by_value("overlay")
    Select(d.find_element(By.ID, "head")).select_by_value("2")
    _wait(d, lambda d: _attr(d, "#attn-maps", "data-heads") == "2", "head 2")

    # Generation: Start fills the cache with the prompt; one Step adds one cached key.
    d.find_element(By.ID, "gen-start").click()
    _wait(d, lambda d: d.find_element(By.ID, "gen-step").is_enabled(), "the Step button")
    assert _attr(d, "#gen-attn", "data-keys") == t
    assert _attr(d, "#gen-next", "data-count") == "10"
    d.find_element(By.ID, "gen-step").click()
    _wait(d, lambda d: _attr(d, "#gen-attn", "data-keys") == str(len(PROMPT) + 1), "one step")
    status = d.find_element(By.ID, "gen-status").text
    assert "1 step(s)" in status and f"KV cache {len(PROMPT) + 1} / {MAX_LEN}" in status
    assert len(d.find_elements(By.CSS_SELECTOR, "#gen-drawn .bar-row")) == 10
    assert len(d.find_elements(By.CSS_SELECTOR, "#gen-drawn .bar-row.chosen")) == 1
    cells = d.find_elements(By.CSS_SELECTOR, "#gen-attn .gen-row[data-head='2'] .tok")
    assert len(cells) == len(PROMPT) + 1
    assert abs(sum(float(c.get_attribute("data-weight")) for c in cells) - 1.0) < 1e-3
    assert len(d.find_elements(By.CSS_SELECTOR, "#gen-attn .tok.generated")) == 1

    # A padded batch: every padded key gets zero weight.
    d.find_element(By.ID, "batch-btn").click()
    _wait(d, lambda d: "exactly zero" in d.find_element(By.ID, "batch-check").text, "batch")
    assert len(d.find_elements(By.CSS_SELECTOR, "#batch-rows .batch-row")) == 3
    assert d.find_elements(By.CSS_SELECTOR, "#batch-rows .tok.pad")

    shot = tmp_path / "explore-page.png"
    d.save_screenshot(str(shot))
    print(f"\nscreenshot: {shot}")

    # Bad input: an empty prompt gives a visible message, and the drawings stay.
    prompt.clear()
    d.find_element(By.ID, "show-btn").click()
    _wait(d, lambda d: d.find_element(By.ID, "message").is_displayed(), "the error message")
    assert "empty" in d.find_element(By.ID, "message").text
    assert d.find_elements(By.CSS_SELECTOR, "#attn-maps canvas.heatmap")
    error_shot = tmp_path / "explore-error.png"
    d.save_screenshot(str(error_shot))
    print(f"screenshot: {error_shot}")

    severe = [e for e in d.get_log("browser") if e["level"] == "SEVERE"
              and "/api/attention" not in e["message"]]  # the 400 above is expected
    assert not severe, severe
