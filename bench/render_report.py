"""Doc script: renders a run's report.html (or a sweep.html) in headless Chromium and saves a screenshot, to
check the page renders with its plots (not a test: Chromium is not a dependency; `apt-get install
chromium` on Debian).

    python bench/render_report.py RUN_DIR/report.html docs/img/report.png
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    page, png = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("render_report: no chromium on PATH (Debian: apt-get install chromium)", file=sys.stderr)
        return 1
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--window-size=1280,2400", f"--screenshot={png}", page.as_uri()]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or not png.exists():
        print(f"render_report: chromium failed: {done.stderr[-500:]}", file=sys.stderr)
        return 1
    print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
