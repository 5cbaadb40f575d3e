"""Open a `bt report` page in a real headless browser, take a screenshot, and check it rendered.

    python scripts/report_in_browser.py report.html --screenshot docs/report.png

Checks, each a line of output and a non-zero exit if it fails: no error on the browser console and
no uncaught page error; every chart is an inline SVG with a visible size and drawn lines; nothing
is clipped (no text of a chart, such as a legend entry or a bar label, reaches past the chart's
edge, and nothing makes the page wider than the window: a wide table scrolls inside its own box);
the page made no network request (it is self-contained). Needs Chromium (Debian: apt-get install chromium)
and the playwright package (pip install playwright), neither of which bt itself needs; CI has no
browser, so this runs as a script and tests/test_report.py runs it only where Chromium exists.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return next((path for name in CHROMIUM if (path := shutil.which(name))), None)


def check(page_path: Path, screenshot: Path | None, width: int = 1100) -> list[str]:
    """Problems found while rendering `page_path` (empty: it rendered cleanly)."""
    from playwright.sync_api import sync_playwright

    executable = find_chromium()
    if executable is None:
        return ["no Chromium found (apt-get install chromium)"]
    problems: list[str] = []
    requests: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": width, "height": 900})
        page.on(
            "console",
            lambda m: (
                problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning") else None
            ),
        )
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("request", lambda r: requests.append(r.url))
        page.goto(page_path.resolve().as_uri(), wait_until="load")
        charts = page.evaluate(
            """() => [...document.querySelectorAll('figure svg')].map(svg => {
                const box = svg.getBoundingClientRect();
                return {width: box.width, height: box.height, lines: svg.querySelectorAll('path').length};
            })"""
        )
        if len(charts) < 3:
            problems.append(f"expected 3 charts, found {len(charts)}")
        for index, chart in enumerate(charts):
            if chart["width"] < 100 or chart["height"] < 50 or chart["lines"] < 3:
                problems.append(f"chart {index} did not render: {chart}")
        problems += clipped(page, width)
        remote = [url for url in requests if not url.startswith(("file:", "data:"))]
        if remote:
            problems.append(f"the page fetched {remote[:3]}: it must be self-contained")
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(
                path=str(screenshot), full_page=False, clip={"x": 0, "y": 0, "width": width, "height": 900}
            )
        browser.close()
    return problems


# A chart's text may touch its edge by this much (anti-aliasing, font metrics), in CSS pixels.
TOLERANCE = 1.0


def clipped(page: Any, width: int) -> list[str]:
    """Content cut off: chart text past its chart's box, or a page wider than the window."""
    found = page.evaluate(
        """(tolerance) => {
            const out = [];
            document.querySelectorAll('figure svg').forEach((svg, index) => {
                const box = svg.getBoundingClientRect();
                svg.querySelectorAll('text').forEach(text => {
                    const r = text.getBoundingClientRect();
                    if (r.width === 0) return;
                    if (r.left < box.left - tolerance || r.right > box.right + tolerance ||
                        r.top < box.top - tolerance || r.bottom > box.bottom + tolerance) {
                        out.push(`chart ${index}: text '${text.textContent.trim().slice(0, 40)}' is cut off ` +
                                 `at the chart's edge`);
                    }
                });
            });
            const page = document.documentElement.scrollWidth;
            if (page > window.innerWidth + tolerance) {
                const wide = [...document.body.querySelectorAll('*')].filter(
                    e => e.getBoundingClientRect().right > window.innerWidth + tolerance &&
                         !e.closest('div.scroll'));
                const what = wide.length ? wide[0].tagName.toLowerCase() : 'something';
                out.push(`the page is ${page} px wide in a ${window.innerWidth} px window: a ${what} ` +
                         `runs off the page`);
            }
            return out;
        }""",
        TOLERANCE,
    )
    return [f"clipped: {line}" for line in found]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("page", type=Path, help="the report.html that bt report wrote")
    parser.add_argument("--screenshot", type=Path, help="save a PNG of the top of the page here")
    args = parser.parse_args()
    problems = check(args.page, args.screenshot)
    for problem in problems:
        print(f"FAIL {problem}")
    if not problems:
        print(
            f"ok: {args.page} rendered its charts with nothing clipped, no console errors and no network requests"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
