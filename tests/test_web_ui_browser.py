"""The LLM tab in a real browser: headless Chromium (Debian's chromium and chromium-driver, driven by
selenium) opens Locust's web UI, fills and submits the start form as a user would, waits for the run to
end, opens the LLM tab and reads its cells against the finished run's summary.json, then clicks the run's
files in "Download Data". Skipped only where Chromium or its driver cannot be found (.ci/run installs both).

LOADLAB_DOCS_SCREENSHOT=1 also saves the tab as docs/img/llm-tab.png (docs/web-ui.md shows it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

from loadlab.procs import free_port

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver") or next(
    (p for p in ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver") if os.access(p, os.X_OK)), None
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason=f"no {'chromium' if CHROMIUM is None else 'chromedriver'} on PATH (.ci/run installs both: "
    "apt-get install chromium chromium-driver)",
)

PROFILE = """\
name: ui
seed: 2
target: {url: embedded, embedded: {enable_metrics: true}}
load: {model: closed, concurrency: 16}
requests: {warmup: 4, measured: 48}
workload: {kind: random_prefix, input_len: 128, output_len: 16}
slo: {ttft_p95_ms: 3000, tpot_p95_ms: 100}
classes:
  - {name: interactive, share: 0.5, slo: {ttft_p95_ms: 1000}}
  - {name: batch, share: 0.5, workload: {kind: random_prefix, input_len: 512, output_len: 24}}
"""


def _state(base: str) -> str | None:
    try:
        with urllib.request.urlopen(base + "/stats/requests", timeout=5) as resp:
            return json.loads(resp.read())["state"]
    except OSError:
        return None


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def browser(tmp_path):
    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1500", "--disable-extensions", "--no-first-run"):  # fmt: skip
        options.add_argument(arg)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    options.add_experimental_option(
        "prefs", {"download.default_directory": str(downloads), "download.prompt_for_download": False}
    )
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)  # the driver named: no lookup
    driver.downloads = downloads
    try:
        yield driver
    finally:
        driver.quit()


def test_the_llm_tab_in_chromium_shows_the_runs_exact_figures(tmp_path, browser):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "locust.log"
    profile = tmp_path / "ui.yaml"
    profile.write_text(PROFILE)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "locust", "-f", "locustfile.py", "--web-host", "127.0.0.1",
             "--web-port", str(port), "--out", str(tmp_path / "out"), "--run-name", "ui",
             "--profile-file", str(profile)],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        _wait(lambda: _state(base), 30, "the web UI")
        browser.get(base + "/")
        wait = WebDriverWait(browser, 20)
        # The start form, as a user fills it: 6 users, 6 per second, Start.
        for name, value in (("userCount", "6"), ("spawnRate", "6")):
            field = wait.until(ec.element_to_be_clickable((By.NAME, name)))
            field.send_keys(Keys.CONTROL, "a")  # React's field keeps its value through clear()
            field.send_keys(value)
        browser.find_element(By.XPATH, "//button[@type='submit' and normalize-space()='Start']").click()
        _wait(lambda: _state(base) in ("running", "spawning", "stopped"), 20, "the run to start")
        _wait(lambda: _state(base) == "stopped", 60, "the run to end by itself")
        run_dir = tmp_path / "out" / "ui"
        summary = json.loads(_wait(lambda: _read(run_dir / "summary.json"), 30, "summary.json"))
        manifest = json.loads((run_dir / "manifest.json").read_text())
        assert manifest["load"]["concurrency"] == 6  # the form's user count, not the profile's 16

        wait.until(
            ec.element_to_be_clickable((By.XPATH, "//button[@role='tab' and normalize-space()='LLM']"))
        ).click()
        cells = _wait(lambda: _llm_cells(browser, summary), 15, "the LLM tab's final rows")
        run_ttft = cells[("run", "TTFT (ms)")]
        assert run_ttft["P95"] == f"{summary['p95_ttft_ms']:.2f}"  # the acceptance figure
        assert run_ttft["P50"] == f"{summary['median_ttft_ms']:.2f}"
        assert run_ttft["P99"] == f"{summary['p99_ttft_ms']:.2f}"
        for label, stem in (("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_latency_ms")):
            assert cells[("run", f"{label} (ms)")]["P95"] == f"{summary[f'p95_{stem}']:.2f}", label
            assert cells[("run", f"{label} (ms)")]["Value"] == f"{summary['samples'][stem]} samples", label
        assert cells[("run", "requests")]["Value"] == f"48 measured: {summary['completed']} ok, 0 failed"
        want = "PASS so far" if summary["slo"]["pass"] else "FAIL so far"
        assert cells[("run", "SLO verdict")]["Value"] == want
        for c in summary["classes"]:
            scope = f"class {c['name']}"
            assert cells[(scope, "TTFT (ms)")]["P95"] == f"{c['p95_ttft_ms']:.2f}", scope
            assert cells[(scope, "E2E (ms)")]["P99"] == f"{c['p99_e2e_latency_ms']:.2f}", scope
            want = "PASS so far" if c["slo"]["pass"] else "FAIL so far"
            assert cells[(scope, "SLO verdict")]["Value"] == want, scope
        shot = browser.get_screenshot_as_png()
        (tmp_path / "llm-tab.png").write_bytes(shot)
        if os.environ.get("LOADLAB_DOCS_SCREENSHOT"):
            (REPO / "docs" / "img" / "llm-tab.png").write_bytes(shot)

        # Download Data: the run's three files, each link clicked.
        wait.until(
            ec.element_to_be_clickable(
                (By.XPATH, "//button[@role='tab' and normalize-space()='Download Data']")
            )
        ).click()
        links = {}
        for name in ("summary.md", "report.html", "records.parquet"):
            link = wait.until(
                ec.presence_of_element_located((By.PARTIAL_LINK_TEXT, f"the last run's {name}"))
            )
            links[name] = link.get_attribute("href")
        assert links["summary.md"] == base + "/loadlab/files/summary.md"
        browser.find_element(By.PARTIAL_LINK_TEXT, "the last run's summary.md").click()
        wait.until(lambda d: d.current_url == links["summary.md"])
        text = browser.find_element(By.TAG_NAME, "body").text
        assert text.strip() == (run_dir / "summary.md").read_text().strip()
        browser.back()
        _click_download_link(browser, wait, "report.html")
        wait.until(lambda d: d.current_url == links["report.html"])
        assert "ui" in browser.title and browser.find_elements(By.TAG_NAME, "img")
        browser.back()
        _click_download_link(browser, wait, "records.parquet")  # served as an attachment: a download
        got = browser.downloads / "ui-records.parquet"
        _wait(got.exists, 15, "the records.parquet download")
        _wait(lambda: got.read_bytes() == (run_dir / "records.parquet").read_bytes(), 5, "the whole file")
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text()


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def _click_download_link(browser, wait, name: str) -> None:
    tab = "//button[@role='tab' and normalize-space()='Download Data']"
    wait.until(ec.element_to_be_clickable((By.XPATH, tab))).click()
    wait.until(ec.element_to_be_clickable((By.PARTIAL_LINK_TEXT, f"the last run's {name}"))).click()


def _llm_cells(browser, summary: dict) -> dict[tuple[str, str], dict[str, str]] | None:
    """The LLM table's cells by (scope, figure) and column title, once they show the finished run."""
    tables = browser.find_elements(By.TAG_NAME, "table")
    for table in tables:
        titles = [th.text for th in table.find_elements(By.CSS_SELECTOR, "thead th")]
        if titles[:2] != ["Scope", "Figure"]:
            continue
        cells = {}
        for tr in table.find_elements(By.CSS_SELECTOR, "tbody tr"):
            values = [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
            row = dict(zip(titles, values, strict=True))
            cells[(row["Scope"], row["Figure"])] = row
        done = cells.get(("run", "TTFT (ms)"), {}).get("Value") == f"{summary['samples']['ttft_ms']} samples"
        return cells if done else None
    return None
