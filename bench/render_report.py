"""Doc script: renders a run's report.html (or a sweep.html) in headless Chromium and saves a screenshot
(the images in docs/img). Chromium is not a dependency: `apt-get install chromium` on Debian. The test suite
does the same check when Chromium is there (tests/test_analysis.py).

    python bench/render_report.py RUN_DIR/report.html docs/img/report.png
"""

from __future__ import annotations

import sys
from pathlib import Path

from loadlab.analysis.html import RenderError, screenshot


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    try:
        print(screenshot(Path(sys.argv[1]), Path(sys.argv[2])))
    except RenderError as e:
        print(f"render_report: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
