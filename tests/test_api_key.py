"""Secured targets: the target's API key from the environment or a file (never a profile value or a flag),
sent as `Authorization: Bearer`; the twin, `loadlab cluster` and omni require a key as SGLang's `--api-key`
does (401 `{"error": "Unauthorized"}`, /health, /ready and /metrics open); and the key is written nowhere:
every file a run leaves and everything it prints is searched for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest

from loadlab.cluster import READY_PREFIX as CLUSTER_READY_PREFIX
from loadlab.procs import free_port
from loadlab.profile import (
    API_KEY_ENV,
    REDACTED,
    ProfileError,
    auth_headers,
    load_profile,
    read_api_key,
    redact,
)
from loadlab.records import read_jsonl_records
from loadlab.sim.auth import API_KEY_ENV as SERVER_API_KEY_ENV
from loadlab.sim.auth import authorized
from loadlab.target.cluster import EmbeddedCluster
from loadlab.target.launch import LaunchedServer
from loadlab.testing.servers import ServerProcess

REPO = Path(__file__).resolve().parents[1]
LOADLAB = [sys.executable, "-m", "loadlab"]
PROFILE = """\
name: secured
target:
  url: {url}
  api: generate
  timeout_s: 30
  idle_timeout_s: 10
{extra}load:
  concurrency: 4
requests:
  warmup: 2
  measured: 12
workload:
  kind: random_prefix
  input_len: 32
  output_len: 8
"""


def new_key() -> str:
    return f"lk-{uuid.uuid4().hex}"  # unique: any occurrence found later can only be a leak


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any key a developer's shell may hold, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, SERVER_API_KEY_ENV)}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def assert_nowhere(key: str, roots: list[Path], *texts: str) -> None:
    """Neither any file under ``roots`` (recursively, every byte) nor any of ``texts`` holds ``key``."""
    files = [p for root in roots for p in ([root] if root.is_file() else root.rglob("*")) if p.is_file()]
    assert files, roots
    leaked = [str(p) for p in files if key.encode() in p.read_bytes()]
    assert not leaked, leaked
    assert not [t for t in texts if key in t]


def get(url: str, headers: dict[str, str] | None = None, body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, body, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:  # not listening (yet)
        return 0, b""


GENERATE = json.dumps({"text": "hello there", "sampling_params": {"max_new_tokens": 3}}).encode()


# -- where the key comes from ----------------------------------------------------------------------------
def test_the_key_comes_from_the_environment_or_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    profile = write(tmp_path / "p.yaml", PROFILE.format(url="http://127.0.0.1:1", extra=""))
    target = load_profile(profile).target
    assert read_api_key(target) is None  # nothing named, nothing set: an open target
    monkeypatch.setenv(API_KEY_ENV, " k-default\n")
    assert read_api_key(target) == "k-default"  # the default variable, trimmed
    assert auth_headers("k-default") == {"Authorization": "Bearer k-default"} and auth_headers(None) == {}

    # A variable the profile names: required.
    named = load_profile(profile, {"target.api_key_env": "MY_SGLANG_KEY"}).target
    monkeypatch.delenv("MY_SGLANG_KEY", raising=False)
    with pytest.raises(ProfileError) as e:
        read_api_key(named, str(profile))
    assert str(e.value) == (
        f"{profile}: target.api_key_env: MY_SGLANG_KEY: the environment variable is not set or empty (it "
        "must hold the API key)"
    )
    monkeypatch.setenv("MY_SGLANG_KEY", "k-named")
    assert read_api_key(named) == "k-named"

    # A file the profile names, relative to the profile: required, trimmed (a mounted Secret, echo > file).
    (tmp_path / "keys").mkdir()
    write(tmp_path / "keys" / "sglang", "k-file\n")
    in_file = write(
        tmp_path / "f.yaml", PROFILE.format(url="http://127.0.0.1:1", extra="  api_key_file: keys/sglang\n")
    )
    target = load_profile(in_file).target
    assert target.api_key_file == str(tmp_path / "keys" / "sglang")
    assert read_api_key(target) == "k-file"
    write(tmp_path / "keys" / "sglang", "\n")
    with pytest.raises(ProfileError, match=r"target.api_key_file: .*keys/sglang: the file is empty"):
        read_api_key(target, str(in_file))
    (tmp_path / "keys" / "sglang").unlink()
    with pytest.raises(ProfileError) as e:
        read_api_key(target, str(in_file))
    assert str(e.value) == (
        f"{in_file}: target.api_key_file: {tmp_path / 'keys' / 'sglang'}: cannot read the API key (No such file "
        "or directory)"
    )
    write(tmp_path / "keys" / "sglang", "two words")
    with pytest.raises(ProfileError, match="spaces or control characters") as e:
        read_api_key(target)
    assert "two words" not in str(e.value)


@pytest.mark.parametrize(
    "extra, line, message",
    [
        ("  api_key: lk-in-the-profile\n", 7, "target.api_key: a key is never a profile value"),
        ("  api_key_env: not a name\n", 7, "target.api_key_env: the name of an environment variable"),
        (
            "  api_key_env: K\n  api_key_file: k.txt\n",
            8,
            "target.api_key_file: give api_key_env or api_key_file",
        ),
    ],
)
def test_a_key_is_never_a_profile_value(tmp_path, extra, line, message):
    profile = write(tmp_path / "p.yaml", PROFILE.format(url="http://127.0.0.1:1", extra=extra))
    with pytest.raises(ProfileError) as e:
        load_profile(profile)
    assert str(e.value).startswith(f"{profile}:{line}: {message}"), str(e.value)
    assert "lk-in-the-profile" not in str(e.value)  # the error never quotes it


def test_redact():
    info = {"api_key": "k1", "admin_api_key": None, "model_path": "m", "args": ["--api-key", "k1"]}
    assert redact(info, "k1", hide_named=True) == {
        "api_key": REDACTED, "admin_api_key": None, "model_path": "m", "args": ["--api-key", REDACTED],
    }  # fmt: skip
    # Without hide_named a profile's api_key_env (a variable's name) stays what it is.
    assert redact({"api_key_env": "K"}, "k1") == {"api_key_env": "K"}
    assert redact(["--x", "a=k1"], None) == ["--x", "a=k1"]


def test_sglangs_check():
    # python/sglang/srt/utils/auth.py: the Bearer scheme in any case, or x-api-key; nothing else.
    assert authorized("Bearer k", None, "k") and authorized("bearer k", None, "k")
    assert authorized(None, "k", "k") and authorized("Basic x", "k", "k")
    assert not authorized("Bearer k2", None, "k") and not authorized("k", None, "k")
    assert not authorized(None, None, "k") and not authorized("Bearer", None, "k")
    assert not authorized("Bearer ké", None, "k")  # non-ASCII from a client is refused, not a crash


# -- the twin answers as SGLang ---------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["env", "flag"])
def test_the_twin_requires_the_key_as_sglang_does(how):
    key = new_key()
    argv = [*LOADLAB, "sim", "--port", "0", "--enable-metrics"]
    env = {SERVER_API_KEY_ENV: key} if how == "env" else None
    twin = ServerProcess(argv + (["--api-key", key] if how == "flag" else []))
    twin.env = env or {}
    url = twin.start()
    try:
        for path in ("/server_info", "/get_server_info", "/v1/models", "/get_load", "/model_info"):
            assert get(url + path) == (401, b'{"error":"Unauthorized"}'), path
            assert get(url + path, {"Authorization": "Bearer wrong"})[0] == 401
            assert get(url + path, {"Authorization": f"Bearer {key}"})[0] == 200, path
        assert get(url + "/generate", body=GENERATE)[0] == 401
        assert get(url + "/generate", {"x-api-key": key}, GENERATE)[0] == 200
        assert get(url + "/flush_cache", body=b"")[0] == 401
        for path in ("/health", "/health_generate", "/ready", "/metrics"):  # probes and Prometheus
            assert get(url + path)[0] == 200, path
        status, body = get(url + "/server_info", auth_headers(key))
        assert key.encode() not in body  # not a setting: /server_info never shows it
    finally:
        twin.stop()
    assert key not in "".join(twin.stderr_lines)


def test_the_twins_key_must_fit_in_a_header():
    proc = subprocess.run([*LOADLAB, "sim", "--port", "0"], env=clean_env(**{SERVER_API_KEY_ENV: "a b"}),
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"loadlab sim: error: {SERVER_API_KEY_ENV}: the API key must be printable ASCII without spaces"
    )


# -- runs -------------------------------------------------------------------------------------------------
def loadlab(*argv: str, env: dict[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*LOADLAB, *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip


def run_dir_of(proc: subprocess.CompletedProcess) -> Path:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return Path(proc.stdout.strip().splitlines()[-1])


def test_a_run_against_a_secured_twin(tmp_path):
    """Without the key the run stops at the probe with one line naming the 401 and the endpoint; with it
    (a variable the profile names, read by the master and by each worker) it completes; and the key is in
    no file of the run, nor in anything the run or the twin printed."""
    key = new_key()
    twin = ServerProcess([*LOADLAB, "sim", "--port", "0", "--enable-metrics"])
    twin.env = {SERVER_API_KEY_ENV: key}
    url = twin.start()
    try:
        profile = write(tmp_path / "p.yaml", PROFILE.format(url=url, extra=""))
        out = tmp_path / "out"
        refused = loadlab("run", str(profile), "--out", str(out), env=clean_env())
        assert refused.returncode == 3, refused.stderr[-3000:]
        errors = [line for line in refused.stderr.splitlines() if line.startswith("loadlab: ")]
        assert errors[0] == (
            f"loadlab: target {url}: GET /server_info: HTTP 401 Unauthorized: the target wants an API key and "
            "none was sent (set LOADLAB_API_KEY, or name the variable or file holding it in the profile: "
            "target.api_key_env, target.api_key_file)"
        )
        wrong = loadlab("run", str(profile), "--out", str(out), env=clean_env(**{API_KEY_ENV: "lk-wrong"}))
        assert wrong.returncode == 3
        assert (
            f"GET /server_info: HTTP 401 Unauthorized: the target refused the API key from ${API_KEY_ENV}"
            in (wrong.stderr)
        )
        # Distributed: the master and two workers, each reading the key itself.
        ok = loadlab("run", str(profile), "--out", str(out), "--workers", "2", "--set",
                     "target.api_key_env=SECURED_TARGET_KEY", env=clean_env(SECURED_TARGET_KEY=key))  # fmt: skip
        run_dir = run_dir_of(ok)
    finally:
        twin.stop()
    rows = read_jsonl_records(run_dir / "records.jsonl")
    assert len(rows) == 14 and all(r["outcome"] == "ok" for r in rows), rows[:2]
    assert len({r["worker_id"] for r in rows}) == 2
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["profile"]["target"]["api_key_env"] == "SECURED_TARGET_KEY"  # where, never what
    assert manifest["target"]["server_info"]["max_running_requests"]  # probed with the key
    scrapes = [json.loads(line) for line in (run_dir / "server_metrics.jsonl").read_text().splitlines()]
    assert scrapes and all("m" in s for s in scrapes)  # the scraper sent it too (SGLang leaves /metrics open)
    assert_nowhere(
        key, [out], ok.stdout, ok.stderr, refused.stdout, refused.stderr, "".join(twin.stderr_lines)
    )


class SecuredCluster:
    """`loadlab cluster FILE --port 0` with LOADLAB_SERVER_API_KEY set; ``ready`` is its ready line's JSON."""

    def __init__(self, path: Path, key: str):
        env = clean_env(**{SERVER_API_KEY_ENV: key})
        self.proc = subprocess.Popen([*LOADLAB, "cluster", str(path), "--port", "0"], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        line = self.proc.stdout.readline()
        assert line.startswith(CLUSTER_READY_PREFIX), (line, "".join(self.stderr)[-3000:])
        self.ready = json.loads(line[len(CLUSTER_READY_PREFIX) :])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


CLUSTER = """\
name: secured
districts:
  - name: main
    workers: 2
front:
  kind: {kind}
  policy: round_robin
"""


@pytest.mark.parametrize("kind", ["omni", "router"])
def test_a_secured_cluster(tmp_path, kind):
    """`loadlab cluster` with a key: every worker and the front answer 401 without it (omni checks it as
    SGLang does; the router passes the worker's 401 through), the front's workers are polled and proxied
    with it; a run without the key fails at the probe, one with it is served by the cluster's workers."""
    if kind == "router":
        pytest.importorskip("sglang_router", reason="front kind router needs sglang-router")
    key = new_key()
    cluster = SecuredCluster(write(tmp_path / "c.yaml", CLUSTER.format(kind=kind)), key)
    try:
        front, workers = cluster.ready["front"], [w["url"] for w in cluster.ready["workers"]]
        for url in [front, *workers]:
            status, body = get(url + "/generate", body=GENERATE)
            assert status == 401, url
            if url in workers or kind == "omni":  # sglang-router answers the worker's 401 with no body
                assert body == b'{"error":"Unauthorized"}', url
            assert get(url + "/generate", auth_headers(key), GENERATE)[0] == 200, url
            assert get(url + "/health")[0] == 200, url
        profile = write(tmp_path / "p.yaml", PROFILE.format(url=front, extra=""))
        out = tmp_path / "out"
        refused = loadlab("run", str(profile), "--out", str(out), env=clean_env())
        assert refused.returncode == 3, refused.stderr[-3000:]
        # Behind omni the probe's /server_info comes back 401 from omni; sglang-router answers /server_info
        # itself, so the first request's 401 is where the run learns it: it stops there, with one line.
        said = "GET /server_info" if kind == "omni" else "POST /generate"
        assert f"loadlab: target {front}: {said}: HTTP 401 Unauthorized: the target wants an API key" in (
            refused.stderr
        )
        ok = loadlab("run", str(profile), "--out", str(out), env=clean_env(**{API_KEY_ENV: key}))
        run_dir = run_dir_of(ok)
    finally:
        cluster.stop()
    rows = read_jsonl_records(run_dir / "records.jsonl")
    assert all(r["outcome"] == "ok" for r in rows) and {r["served_by"] for r in rows} <= set(workers)
    # The launcher's log holds the twins', omni's and the router's (at --log-level warn it prints no flag).
    assert_nowhere(key, [out], ok.stdout, ok.stderr, refused.stdout, refused.stderr, "".join(cluster.stderr))


def test_a_run_on_an_embedded_cluster_secures_it_with_the_runs_key(tmp_path):
    """A profile's target.cluster started by the run gets the run's key (in its environment): the workers
    and omni require it, and the run, sending it, completes without writing it anywhere."""
    key = new_key()
    (tmp_path / "clusters").mkdir()
    write(tmp_path / "clusters" / "two.yaml", CLUSTER.format(kind="omni"))
    profile = write(
        tmp_path / "p.yaml", PROFILE.format(url="embedded", extra="  cluster: clusters/two.yaml\n")
    )
    assert EmbeddedCluster(tmp_path / "clusters" / "two.yaml", api_key=key).env == {SERVER_API_KEY_ENV: key}
    write(tmp_path / "key", key + "\n")
    out = tmp_path / "out"
    ok = loadlab("run", str(profile), "--out", str(out), "--set", f"target.api_key_file={tmp_path / 'key'}",
                 env=clean_env())  # fmt: skip
    run_dir = run_dir_of(ok)
    rows = read_jsonl_records(run_dir / "records.jsonl")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    workers = {w["url"] for w in manifest["target"]["cluster"]["workers"]}
    assert all(r["outcome"] == "ok" for r in rows) and {r["served_by"] for r in rows} <= workers
    assert_nowhere(key, [out], ok.stdout, ok.stderr)


def test_a_sweeps_secured_server_is_ready_when_it_answers(tmp_path, monkeypatch):
    """A sweep's launched server that wants a key is up once it answers (401 and all): each run's own
    probe then sends the key; waiting for a 200 would only run out the ready timeout."""
    monkeypatch.setenv(SERVER_API_KEY_ENV, new_key())  # the launched twin inherits it
    port = free_port()
    server = LaunchedServer(["loadlab", "sim", "--port", str(port)], f"http://127.0.0.1:{port}", 20.0,
                            tmp_path / "server.log")  # fmt: skip
    try:
        server.start()
        assert get(f"http://127.0.0.1:{port}/server_info")[0] == 401
    finally:
        server.stop()


def test_the_web_ui_never_shows_the_key(tmp_path):
    """Locust's web UI with the run's key in the environment and the default profile's embedded twin, which
    then requires that key: a run from the form completes, and neither the UI's page (its options), its
    statistics, the LLM tab, /metrics nor the run's files offered there hold the key."""
    key = new_key()
    port = free_port()
    proc = subprocess.Popen(
        [*[sys.executable, "-m", "locust"], "-f", "locustfile.py", "--web-host", "127.0.0.1", "--web-port",
         str(port), "--out", str(tmp_path / "out"), "--num-requests", "8", "--warmup-requests", "0",
         "--output-len", "8"],
        cwd=REPO, env=clean_env(**{API_KEY_ENV: key}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    pages: list[bytes] = []
    try:
        deadline = time.monotonic() + 30
        while get(base + "/stats/requests")[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "the web UI did not come up"
            time.sleep(0.3)
        form = urllib.parse.urlencode({"user_count": 4, "spawn_rate": 4}).encode()
        with urllib.request.urlopen(base + "/swarm", data=form, timeout=5) as resp:
            assert json.loads(resp.read())["success"] is True
        deadline = time.monotonic() + 60
        while get(base + "/loadlab/files/summary.md")[0] != 200:  # written when the run ends
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not end"
            time.sleep(0.3)
        # The key was sent: every request got its first token (Locust's statistics can lag the run's end by a
        # moment on a busy machine, so they are asked again for a while).
        deadline, ttft = time.monotonic() + 15, []
        while not any(n == 8 for n in ttft) and time.monotonic() < deadline:
            stats = json.loads(get(base + "/stats/requests")[1])["stats"]
            ttft = [s["num_requests"] for s in stats if s["name"] == "TTFT"]
            time.sleep(0.2)
        summary_md = get(base + "/loadlab/files/summary.md")[1].decode(errors="replace")[:3000]
        assert 8 in ttft, ([(s["name"], s["num_requests"], s["num_failures"]) for s in stats], summary_md)
        for path in ("/", "/stats/requests", "/metrics", "/loadlab/files/summary.md", "/stats/requests/csv",
                     "/exceptions", "/stats/failures/csv"):  # fmt: skip
            status, body = get(base + path)
            assert status == 200, path
            pages.append(body)
    finally:
        proc.terminate()
        stdout, stderr = proc.communicate(timeout=30)
    assert not [p for p in pages if key.encode() in p]
    assert_nowhere(key, [tmp_path / "out"], stdout, stderr)
