"""report.html and `loadlab compare` with SLO classes: a virtual-time run of three classes rendered in headless
Chromium (a CDF line per class in its colour, in each of the TTFT, TPOT and E2E panels), the page's per-class
table against summary.json value by value, and a report without classes left as it was."""

from __future__ import annotations

import json
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import REPO
from test_analysis import PLOT_BLUE, colour_pixels, needs_chromium, rec, render_or_skip, summarize

from loadlab.analysis.html import CLASS_COLOURS

LOADLAB = [sys.executable, "-m", "loadlab.cli"]

# Three classes, three workloads; gold and bronze with their own SLOs, silver on the profile's (E2E).
THREE = {
    "name": "three-classes", "seed": 2,
    "workload": {"kind": "random_prefix", "input_len": 256, "output_len": 32},
    "load": {"model": "closed", "concurrency": 8}, "requests": {"warmup": 4, "measured": 90},
    "slo": {"e2e_p95_ms": 3000},
    "classes": [
        {"name": "gold", "share": 0.5, "slo": {"ttft_p95_ms": 60, "tpot_p95_ms": 25}},
        {"name": "silver", "share": 0.3, "workload": {"kind": "random_prefix", "input_len": 1024, "output_len": 64}},
        {"name": "bronze", "share": 0.2, "workload": {"kind": "random_prefix", "input_len": 2048, "output_len": 16},
         "slo": {"ttft_p95_ms": 400}},
    ],
}  # fmt: skip


@pytest.fixture(scope="module")
def three_classes_run(tmp_path_factory) -> Path:
    """`loadlab sim --virtual` on THREE, as a user runs it (about 2 s)."""
    tmp = tmp_path_factory.mktemp("three")
    path = tmp / "three.yaml"
    path.write_text(yaml.safe_dump(THREE))
    proc = subprocess.run([*LOADLAB, "sim", "--virtual", str(path), "--out", str(tmp / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return Path(proc.stdout.strip().splitlines()[-1])


class _Table(HTMLParser):
    """The per-class table's cells: {class: {data-key: (data-value, text)}}, and the overall verdict."""

    def __init__(self):
        super().__init__()
        self.rows: dict[str, dict[str, tuple[str, str]]] = {}
        self.swatches: list[str] = []
        self.overall: str | None = None
        self._row: str | None = None
        self._cell: tuple[str, str] | None = None
        self._text = ""
        self._in_overall = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr" and "data-class" in a:
            self._row = a["data-class"]
            self.rows[self._row] = {}
        elif tag == "td" and self._row is not None and "data-key" in a:
            self._cell, self._text = (a["data-key"], a.get("data-value", "")), ""
        elif tag == "span" and a.get("class") == "swatch":
            self.swatches.append(a["style"].removeprefix("background:"))
        elif tag == "p" and a.get("id") == "overall-slo":
            self._in_overall = True
        elif tag == "b" and self._in_overall:
            self.overall = a["data-value"]

    def handle_data(self, data):
        if self._cell is not None:
            self._text += data

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            key, value = self._cell
            self.rows[self._row][key] = (value, self._text.strip())
            self._cell = None
        elif tag == "tr":
            self._row = None
        elif tag == "p":
            self._in_overall = False


def test_the_per_class_table_holds_summary_jsons_values(three_classes_run):
    summary = json.loads((three_classes_run / "summary.json").read_text())
    table = _Table()
    table.feed((three_classes_run / "report.html").read_text())
    assert list(table.rows) == ["gold", "silver", "bronze"] == [c["name"] for c in summary["classes"]]
    assert table.swatches == list(CLASS_COLOURS[:3])  # each class in its colour, in the profile's order
    keys = ["share", "measured_requests", "completed", "failed", "output_throughput"]
    keys += [
        f"{stat}_{m}" for m in ("ttft_ms", "tpot_ms", "e2e_latency_ms") for stat in ("median", "p95", "p99")
    ]
    for c in summary["classes"]:
        row = table.rows[c["name"]]
        assert row["name"][1] == c["name"]
        for key in keys:
            value, text = row[key]
            assert json.loads(value) == c[key], (c["name"], key)  # exact: the JSON's own number
            shown = (
                f"{c[key]:g}"
                if key == "share"
                else str(c[key])
                if isinstance(c[key], int)
                else f"{c[key]:.2f}"
            )
            assert text == shown, (c["name"], key)
        assert json.loads(row["slo.pass"][0]) == c["slo"]["pass"]
        assert row["slo.pass"][1] == {True: "PASS", False: "FAIL", None: "n/a"}[c["slo"]["pass"]]
    assert json.loads(table.overall) == summary["slo"]["pass"]
    # The overall verdict is every class's and the run-wide objectives': it fails when one class does.
    verdicts = [c["slo"]["pass"] for c in summary["classes"]]
    assert summary["slo"]["pass"] == (all(verdicts) and summary["slo"]["objectives"][0]["pass"])
    assert False in verdicts  # gold's 60 ms TTFT limit is out of the twin's reach: a FAIL row is shown
    md = (three_classes_run / "summary.md").read_text()
    gold = summary["classes"][0]
    assert f"| {gold['p99_tpot_ms']:.2f} | " in md and f"| {gold['median_e2e_latency_ms']:.2f} | " in md


@needs_chromium
def test_report_html_draws_a_cdf_line_per_class_in_its_colour(three_classes_run, tmp_path):
    shot = render_or_skip(three_classes_run / "report.html", tmp_path / "report.png")
    blue = colour_pixels(shot, PLOT_BLUE)
    # The per-class section opens the page: everything above the run-wide CDFs (the first blue lines).
    top = int(np.nonzero(blue.any(axis=1))[0].min())
    width = blue.shape[1]
    for rgb_hex in CLASS_COLOURS[:3]:
        rgb = tuple(int(rgb_hex[i : i + 2], 16) for i in (1, 3, 5))
        mine = colour_pixels(shot, rgb)
        assert mine.sum() > 1000, rgb_hex
        above = mine[:top]
        assert above.sum() > 0.95 * mine.sum(), rgb_hex  # the class colours belong to the class section
        # A line in each of the three panels (TTFT, TPOT, E2E: the image's thirds of the page's width).
        for k in range(3):
            panel = above[:, k * width // 3 : (k + 1) * width // 3]
            assert panel.sum() > 150, (rgb_hex, k, panel.sum())
    # Three classes, three colours: the fourth is nowhere.
    fourth = tuple(int(CLASS_COLOURS[3][i : i + 2], 16) for i in (1, 3, 5))
    assert colour_pixels(shot, fourth).sum() < 50


def test_a_report_without_classes_is_unchanged(tmp_path):
    summarize(tmp_path, [rec(i, t=i * 0.5) for i in range(5)], html=True)
    page = (tmp_path / "report.html").read_text()
    assert "Per class" not in page and "swatch" not in page and "data-class" not in page
    assert page.count("data:image/png;base64,") == 2  # the CDFs and the timeline, as before


def test_compare_shows_each_class_side_by_side(three_classes_run, tmp_path):
    # The same profile at another load: each class's figures in A and B, its verdicts, and what changed.
    path = tmp_path / "three.yaml"
    path.write_text(yaml.safe_dump({**THREE, "load": {"model": "closed", "concurrency": 2}}))
    proc = subprocess.run([*LOADLAB, "sim", "--virtual", str(path), "--out", str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    other = Path(proc.stdout.strip().splitlines()[-1])
    proc = subprocess.run([*LOADLAB, "compare", str(three_classes_run), str(other)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    a, b = (json.loads((d / "summary.json").read_text()) for d in (three_classes_run, other))
    for name in ("gold", "silver", "bronze"):
        assert f"class {name} (" in text
    lines = text.splitlines()
    gold = lines.index(next(line for line in lines if line.startswith("class gold")))
    block = lines[gold : gold + 12]
    ca, cb = a["classes"][0], b["classes"][0]
    for label, key in (("TTFT P95 (ms)", "p95_ttft_ms"), ("TPOT P99 (ms)", "p99_tpot_ms"),
                       ("E2E P50 (ms)", "median_e2e_latency_ms"), ("output throughput (tok/s)", "output_throughput")):  # fmt: skip
        row = next(line for line in block if line.strip().startswith(label))
        assert f"{ca[key]:.2f}" in row and f"{cb[key]:.2f}" in row, row
    verdict = next(line for line in lines[gold:] if line.strip().startswith("SLO"))
    word = {True: "PASS", False: "FAIL", None: "n/a"}
    assert verdict.split()[1:] == [word[ca["slo"]["pass"]], word[cb["slo"]["pass"]]]
    assert any(line.startswith("SLO (every class)") for line in lines)
