"""A web UI that is safe to expose: an exposed UI without a login is refused in one line; with --web-login
and credentials from the environment, a browser must log in before it sees the start form (a wrong password
is refused), and the credentials appear in no log or file the run writes."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from test_web_ui_browser import CHROMEDRIVER, CHROMIUM, _state, _wait, browser  # noqa: F401 - the fixture

from loadlab.procs import free_port
from loadlab.swarm.weblogin import exposed, read_credentials

REPO = Path(__file__).resolve().parents[1]
PASSWORD = "k7-ZebraMoon-55"  # searched for in everything the process wrote


def _locust(tmp_path, *args, env=None, timeout=None):
    argv = [sys.executable, "-m", "locust", "-f", "locustfile.py", "--out", str(tmp_path / "out"), *args]
    environ = {k: v for k, v in os.environ.items() if k != "LOADLAB_WEB_LOGIN"}
    environ.update(env or {})
    if timeout is not None:
        return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=environ)
    log = open(tmp_path / "locust.log", "wb")  # noqa: SIM115 - closed by the caller's process end
    return subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=environ)


def test_what_counts_as_exposed():
    assert exposed("*") and exposed("") and exposed("0.0.0.0") and exposed("::") and exposed("10.1.2.3")
    assert exposed("gpu-box")  # a name may resolve anywhere
    assert (
        not exposed("127.0.0.1") and not exposed("localhost") and not exposed("::1") and not exposed("[::1]")
    )


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--web-host", "0.0.0.0"], None, "the web UI would listen on 0.0.0.0 (--web-host 0.0.0.0) with no login"),
        (["--web-host", "127.0.0.1", "--web-login"], None, "--web-login: no credentials: set LOADLAB_WEB_LOGIN"),
        (["--web-host", "127.0.0.1", "--web-login"], {"LOADLAB_WEB_LOGIN": "no-colon"},
         "LOADLAB_WEB_LOGIN: expected user:password"),
        (["--web-host", "127.0.0.1"], {"LOADLAB_WEB_LOGIN": f"admin:{PASSWORD}"}, "but the login is off: add --web-login"),
        (["--web-host", "127.0.0.1", "--web-login", "--web-login-file", "/no/such/file"], None,
         "--web-login-file /no/such/file: cannot read it"),
    ],
)  # fmt: skip
def test_an_unsafe_web_ui_is_refused_in_one_line(tmp_path, args, env, message):
    proc = _locust(tmp_path, "--web-port", str(free_port()), *args, env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("loadlab: ")]
    assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and PASSWORD not in proc.stderr + proc.stdout


def test_locusts_default_all_interfaces_becomes_loopback_and_says_so(tmp_path):
    import psutil

    port = free_port()
    proc = _locust(tmp_path, "--web-port", str(port))  # Locust's default --web-host: every interface
    try:
        assert _wait(lambda: _state(f"http://127.0.0.1:{port}"), 30, "the web UI")
        listening = [c.laddr.ip for c in psutil.Process(proc.pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]  # fmt: skip
        assert listening == ["127.0.0.1"], listening
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "the web UI listens on 127.0.0.1 only" in (tmp_path / "locust.log").read_text()


def test_web_ui_open_accepts_the_risk(tmp_path):
    port = free_port()
    # Bound on every interface (the risk accepted); reached, as every test does, on loopback only.
    proc = _locust(tmp_path, "--web-host", "0.0.0.0", "--web-port", str(port), "--web-ui-open")
    try:
        assert _wait(lambda: _state(f"http://127.0.0.1:{port}"), 30, "the open web UI")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_read_credentials_from_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv("LOADLAB_WEB_LOGIN", raising=False)
    path = tmp_path / "login"
    path.write_text(f"admin:{PASSWORD}\n")
    assert read_credentials(str(path)) == ("admin", PASSWORD)
    assert read_credentials(None) is None
    monkeypatch.setenv("LOADLAB_WEB_LOGIN", "ops:a:b")  # the password may hold a colon
    assert read_credentials(None) == ("ops", "a:b")


@pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None, reason="no chromium or chromedriver")
def test_a_browser_must_log_in_with_the_credentials_from_the_environment(tmp_path, browser):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _locust(tmp_path, "--web-host", "127.0.0.1", "--web-port", str(port), "--web-login",
                   env={"LOADLAB_WEB_LOGIN": f"admin:{PASSWORD}"})  # fmt: skip
    try:
        _wait(lambda: _up(base), 30, "the web UI")
        # Without a session the API is closed too: Locust's /stats/requests redirects to the login page.
        with urllib.request.urlopen(base + "/stats/requests", timeout=5) as resp:
            assert resp.url.startswith(base + "/login")
        wait = WebDriverWait(browser, 20)

        def log_in(password: str) -> None:
            browser.get(base + "/")
            wait.until(ec.url_contains("/login"))
            wait.until(ec.element_to_be_clickable((By.NAME, "username"))).send_keys("admin")
            browser.find_element(By.NAME, "password").send_keys(password)
            browser.find_element(By.XPATH, "//button[@type='submit']").click()

        log_in("wrong-password")
        wait.until(ec.text_to_be_present_in_element((By.TAG_NAME, "body"), "Invalid username or password"))
        assert browser.find_elements(By.NAME, "userCount") == []  # still no start form
        log_in(PASSWORD)
        wait.until(ec.element_to_be_clickable((By.NAME, "userCount")))  # the start form: logged in
        assert "/login" not in browser.current_url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "downloads"]
    assert written and not any(PASSWORD.encode() in p.read_bytes() for p in written)


def _up(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/login", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False
