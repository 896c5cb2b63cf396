"""The HTML report in a real browser: headless Chromium loads `autopar show --html`'s page without a console
message, its DOM holds the report's tables and the chart, and its screenshot shows them (the chart's line, the
peak's dot and the layer rows' colours are painted).

Skipped only where no Chromium is installed (Debian: `apt-get install chromium`; CI installs it in .ci/run).
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.report.html import KIND_COLOUR, LINE_COLOUR, PEAK_COLOUR

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
NO_CHROMIUM = "Chromium is not installed (apt-get install chromium): the HTML report is not checked in a browser"
pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM),
              pytest.mark.xdist_group("report")]  # one worker: the session's plans (conftest) are made once


def _load(page: Path, profile_dir: Path) -> tuple[str, str, Path]:
    """(the DOM after loading, Chromium's log with the page's console messages, the screenshot)."""
    shot = page.with_suffix(".png")
    run = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile_dir}",
         "--enable-logging=stderr", "--v=0", "--window-size=1100,2600", f"--screenshot={shot}", "--dump-dom",
         page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout, run.stderr, shot


def _colours(png: Path) -> dict[tuple[int, int, int], int]:
    from PIL import Image  # the dev extra's

    with Image.open(png) as im:
        return {colour: count for count, colour in im.convert("RGB").getcolors(maxcolors=1 << 24)}


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    return tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]


def test_a_console_error_is_seen(tmp_path):
    """The check below can fail: a page that logs an error shows in Chromium's log."""
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><body><p>x</p><script>console.error('seen'); notDefined();</script></body></html>")
    _, log, _ = _load(page, tmp_path / "profile")
    assert "CONSOLE" in log and "notDefined is not defined" in log


def test_the_report_loads_and_shows_its_tables_and_chart(plans, tmp_path, capsys):
    page = tmp_path / "plan.html"
    assert main(["show", str(plans / "hf_gpt2-tp.json"), "--html", str(page)]) == 0
    capsys.readouterr()
    dom, log, shot = _load(page, tmp_path / "profile")
    assert "CONSOLE" not in log, [line for line in log.splitlines() if "CONSOLE" in line]
    assert dom.count("<table>") == 5 and "<polyline" in dom and "column-parallel over tp" in dom
    colours = _colours(shot)
    assert colours.get(_rgb(LINE_COLOUR), 0) > 300  # the timeline's line and points
    assert colours.get(_rgb(PEAK_COLOUR), 0) > 20  # the peak's dot and label
    for kind in ("tensor", "data"):  # the layer table's rows, coloured by how they are split (more than a legend chip)
        assert colours.get(_rgb(KIND_COLOUR[kind]), 0) > 10_000, kind
