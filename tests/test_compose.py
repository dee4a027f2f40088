"""docker-compose.yml runs a real distributed test, checked without Docker.

There is no container engine here, so the test plays compose itself: it reads docker-compose.yml, takes the
default-enabled services (sim, master, worker x replicas) with their argv-style commands and environments,
interpolates `${VAR:-default}` from the test's own variables (LOCUST_HEADLESS=true for a headless run), and
runs each as a local process on 127.0.0.1:

- compose host names (service names, and 0.0.0.0 / localhost / 127.0.0.1 inside a container) become
  127.0.0.1, and every port a service exposes or publishes becomes a free local port, in argv, environment
  and healthcheck alike (`http://sim:30000` -> `http://127.0.0.1:<free>`, `--master-port 5557` -> `<free>`);
- the container's working directory (the Dockerfile's WORKDIR) is the repo root; a read-only bind mount is
  the repo path it mounts; a writable one (./reports) is a temporary directory;
- `locust`, `loadlab` and `python` are this interpreter's (`python -m locust`, `python -m loadlab`);
- depends_on is honoured in order: `service_healthy` runs the service's healthcheck command until it passes.

Then the run must be complete: the master exits 0, the run directory holds one ok record per request the
profile asks for (its warm-up, and the LOADLAB_NUM_REQUESTS=16 measured requests the test's shell sets: a
short run, and the variable's way through compose to the master checked), both workers sent some, and the
report is written.

The same with compose profile `cluster` on (`LOCUST_HOST=http://cluster:30000 docker compose --profile cluster
up`): the `cluster` service (`loadlab cluster`: twins on loopback behind sglang-router or omni) is started
too, the master waits for its healthcheck, and every record must name one of the cluster's workers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from loadlab.cluster import READY_PREFIX as CLUSTER_READY_PREFIX
from loadlab.cluster.config import load_cluster
from loadlab.procs import free_port
from loadlab.records import read_jsonl_records

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"

# What `docker compose up` would read from the shell: a headless run with a fixed run directory name, and
# 16 measured requests (the profile's 48 take seconds more and show nothing more).
TEST_VARS = {"LOCUST_HEADLESS": "true", "LOADLAB_RUN_NAME": "run", "LOADLAB_NUM_REQUESTS": "16"}
# ... and with the cluster profile on: the master aims at the cluster's front.
CLUSTER_VARS = {**TEST_VARS, "LOCUST_HOST": "http://cluster:30000"}
# Local processes bind the master's port on loopback only (in a container it listens on all interfaces).
TEST_ENV = {"master": {"LOCUST_MASTER_BIND_HOST": "127.0.0.1"}}
EXECUTABLES = {
    "locust": [sys.executable, "-m", "locust"],
    "loadlab": [sys.executable, "-m", "loadlab"],
    "python": [sys.executable],
    "python3": [sys.executable],
}
LOOPBACK_NAMES = {"0.0.0.0", "127.0.0.1", "localhost"}

_VAR = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?)([-?])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value, variables: dict[str, str]):
    """Compose's variable interpolation on every string of a loaded compose file ($$ is a literal $)."""
    if isinstance(value, dict):
        return {k: interpolate(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, variables) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(6)
        colon, op, arg = m.group(3), m.group(4), m.group(5)
        current = variables.get(name)
        missing = current is None or (colon == ":" and current == "")
        if op == "-":
            return arg if missing else current
        if op == "?":
            if missing:
                raise AssertionError(f"compose variable {name} is required: {arg}")
            return current
        return current or ""

    return _VAR.sub(sub, value)


def container_port(spec) -> str:
    """ "8089:8089", "127.0.0.1:8089:8089/tcp", "5557", 5557 -> the container side, "8089" / "5557"."""
    return str(spec).rsplit(":", 1)[-1].split("/")[0]


def load_compose(variables: dict[str, str] = TEST_VARS) -> dict:
    return interpolate(yaml.safe_load(COMPOSE.read_text()), variables)


def duration_s(value, default: float) -> float:
    """A compose duration ("30s", "1m30s", "2m") in seconds; ``default`` when unset."""
    if value is None:
        return default
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", str(value))
    assert parts, f"not a compose duration: {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


def container_workdir() -> str:
    workdirs = re.findall(r"^\s*WORKDIR\s+(\S+)", DOCKERFILE.read_text(), re.MULTILINE)
    assert workdirs, "Dockerfile has no WORKDIR"
    return workdirs[-1]


class LocalCompose:
    """The enabled services of a compose file as local processes (see the module docstring): those in no
    compose profile, and those of the `profiles` given (`docker compose --profile P up`). `variables` are
    the shell's, as the compose file was interpolated with."""

    def __init__(
        self, compose: dict, tmp_path: Path, profiles: tuple[str, ...] = (), variables: dict = TEST_VARS
    ):
        self.tmp_path = tmp_path
        self.variables = variables
        self.services = {
            name: s
            for name, s in compose["services"].items()
            if not s.get("profiles") or set(s["profiles"]) & set(profiles)
        }
        self.ports = {  # service -> {container port: a free local port}
            name: {container_port(p): str(free_port()) for p in [*s.get("expose", []), *s.get("ports", [])]}
            for name, s in self.services.items()
        }
        self.paths: dict[str, dict[str, Path]] = {name: self._paths(s) for name, s in self.services.items()}
        self.procs: dict[str, list[subprocess.Popen]] = {}
        self.log_files: list = []

    # -- the mapping ----------------------------------------------------------------------------------
    def _paths(self, service: dict) -> dict[str, Path]:
        """Container path -> local path, longest first: volumes, then the working directory."""
        out = {}
        for spec in service.get("volumes", []):
            source, target, *mode = spec.split(":")
            if mode == ["ro"] and source.startswith((".", "/")):
                out[target] = (COMPOSE.parent / source).resolve()
            else:  # writable (or a named volume): a fresh directory, never the repo's own
                out[target] = self.tmp_path / "volumes" / Path(target).name
                out[target].mkdir(parents=True, exist_ok=True)
        out[service.get("working_dir", container_workdir())] = REPO
        return dict(sorted(out.items(), key=lambda kv: -len(kv[0])))

    def mapped_port(self, service: str, port: str) -> str | None:
        if port in self.ports[service]:
            return self.ports[service][port]
        owners = [name for name, ports in self.ports.items() if port in ports]
        return self.ports[owners[0]][port] if len(owners) == 1 else None

    def rewrite(self, value: str, service: str, is_host: bool = True) -> str:
        """One argv item or environment value of `service`, from the compose network to this machine. A bare
        service name is a host name only where a host is expected (`is_host`): `loadlab sim` stays."""
        if value in LOOPBACK_NAMES or (is_host and value in self.services):
            return "127.0.0.1"
        if value.isdigit():
            return self.mapped_port(service, value) or value

        def host_port(m: re.Match) -> str:
            host, port = m.group(1), m.group(2)
            if host in self.services:
                return f"127.0.0.1:{self.ports[host].get(port, port)}"
            if host in LOOPBACK_NAMES:
                return f"127.0.0.1:{self.mapped_port(service, port) or port}"
            return m.group(0)

        value = re.sub(r"(?<![\w.-])([A-Za-z0-9_.-]+):(\d+)\b", host_port, value)
        for inside, local in self.paths[service].items():
            value = re.sub(
                rf"(^|=){re.escape(inside)}(?=/|$)", lambda m, local=local: m.group(1) + str(local), value
            )
        return value

    def argv(self, service: str, argv: list) -> list[str]:
        assert isinstance(argv, list) and argv, f"{service}: use an argv-style list, not a shell string"
        argv = [str(a) for a in argv]
        # A bare service name is a host name after a host flag (`--master-host master`).
        after_host_flag = [False] + [a.startswith("-") and a.endswith("host") for a in argv[:-1]]
        first, *rest = (
            self.rewrite(a, service, is_host) for a, is_host in zip(argv, after_host_flag, strict=True)
        )
        return [*EXECUTABLES.get(first, [first]), *rest]

    def env(self, service: str) -> dict[str, str]:
        environment = self.services[service].get("environment") or {}
        if isinstance(environment, list):
            environment = dict(item.split("=", 1) if "=" in item else (item, None) for item in environment)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCUST_", "LOADLAB_"))}
        env["PYTHONUNBUFFERED"] = "1"
        for key, value in environment.items():
            if value is None:  # passed through from the shell, unset when the shell has none
                value = self.variables.get(key)
                if value is None:
                    continue
            env[key] = self.rewrite(str(value), service)
        env.update(TEST_ENV.get(service, {}))
        return env

    # -- running --------------------------------------------------------------------------------------
    def order(self) -> list[str]:
        done: list[str] = []

        def visit(name: str) -> None:
            if name in done:
                return
            for dep in self.services[name].get("depends_on", {}):
                if dep in self.services:
                    visit(dep)
            done.append(name)

        for name in self.services:
            visit(name)
        return done

    def up(self) -> None:
        for name in self.order():
            service = self.services[name]
            depends = service.get("depends_on", {})
            for dep, cond in depends.items() if isinstance(depends, dict) else ((d, {}) for d in depends):
                if dep not in self.services:  # an opt-in service that is not enabled
                    assert cond.get("required") is False, f"{name} needs {dep}, which is not enabled"
                elif cond.get("condition") == "service_healthy":
                    self.wait_healthy(dep)
            replicas = int(service.get("deploy", {}).get("replicas", 1))
            for n in range(replicas):
                log = open(self.tmp_path / f"{name}-{n + 1}.log", "wb")  # noqa: SIM115 - closed in down()
                self.log_files.append(log)
                cmd = self.argv(name, [*(service.get("entrypoint") or []), *service["command"]])
                proc = subprocess.Popen(
                    cmd, cwd=REPO, env=self.env(name), stdout=log, stderr=subprocess.STDOUT
                )
                self.procs.setdefault(name, []).append(proc)

    def wait_healthy(self, name: str) -> None:
        healthcheck = self.services[name]["healthcheck"]
        test = healthcheck["test"]
        timeout = max(30.0, duration_s(healthcheck.get("start_period"), 0))  # the service's own grace
        assert test[0] == "CMD", f"{name}: healthcheck as an argv list (CMD), not a shell string"
        cmd = self.argv(name, test[1:])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            (proc,) = self.procs[name]
            assert proc.poll() is None, f"{name} exited with {proc.returncode}\n{self.logs()}"
            if subprocess.run(cmd, env=self.env(name), capture_output=True, timeout=10).returncode == 0:
                return
            time.sleep(0.2)
        raise AssertionError(f"{name} not healthy after {timeout} s\n{self.logs()}")

    def down(self) -> None:
        for procs in self.procs.values():
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
        for procs in self.procs.values():
            for proc in procs:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for log in self.log_files:
            log.close()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp_path.glob("*.log"))
        )


@pytest.fixture
def compose() -> dict:
    return load_compose()


def test_compose_file_shape(compose):
    services = compose["services"]
    assert {"sim", "master", "worker", "sglang"} <= set(services)
    for name, service in services.items():
        assert isinstance(service["command"], list), f"{name}: argv-style command"
    # The workers scale: no fixed name, no published ports; they join the master by its service name.
    worker = services["worker"]
    assert "container_name" not in worker and "ports" not in worker
    assert worker["command"][worker["command"].index("--master-host") + 1] == "master"
    assert int(worker["deploy"]["replicas"]) == 2
    # The master publishes the web UI and is headless only when asked (web UI by default).
    master = services["master"]
    assert "8089" in [container_port(p) for p in master["ports"]]
    assert "--master" in master["command"] and "container_name" not in master
    assert load_compose({})["services"]["master"]["environment"]["LOCUST_HEADLESS"] == "false"
    # ... behind a login by default (its UI listens on every interface of the container), credentials
    # passed through from the shell, never set in the file.
    master_env = load_compose({})["services"]["master"]["environment"]
    assert master_env["LOCUST_WEB_LOGIN"] == "true" and master_env.get("LOADLAB_WEB_LOGIN") in (None, "")
    assert master["depends_on"]["sim"]["condition"] == "service_healthy"
    assert any(v.endswith(":/loadlab/reports") for v in master["volumes"])
    # Real SGLang is opt-in, on a GPU, with metrics.
    sglang = services["sglang"]
    assert sglang["profiles"] == ["sglang"]
    assert sglang["image"].startswith("lmsysorg/sglang")
    devices = sglang["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert "--enable-metrics" in sglang["command"] and "sglang.launch_server" in sglang["command"]
    assert "/health" in " ".join(sglang["healthcheck"]["test"])
    assert "HF_TOKEN" in sglang["environment"] and sglang.get("shm_size")
    assert master["depends_on"]["sglang"] == {"condition": "service_healthy", "required": False}
    # The simulated server is the default target, with SGLang's metrics and cache report.
    assert services["sim"]["command"][:2] == ["loadlab", "sim"]
    assert {"--enable-metrics", "--enable-cache-report"} <= set(services["sim"]["command"])
    assert master["environment"]["LOCUST_HOST"] == "http://sim:30000"
    profile = yaml.safe_load((REPO / master["environment"]["LOADLAB_PROFILE_FILE"]).read_text())
    assert profile["target"]["url"] == "http://sim:30000"
    # The image: FROM the Locust image at a 2.x tag, the package installed (not editable), with extras.
    dockerfile = DOCKERFILE.read_text()
    assert re.search(r"^FROM locustio/locust:2\.\d+\.\d+\s*$", dockerfile, re.MULTILINE)
    assert (
        re.search(r"^RUN pip install [^\n]*\s\"?\.(\[[\w,]+\])?\"?(\s|$)", dockerfile, re.MULTILINE)
        and "-e ." not in dockerfile
    )


def test_compose_cluster_profile_shape(compose):
    services = compose["services"]
    cluster = services["cluster"]
    # Opt-in, from the loadlab image: `loadlab cluster FILE`, the front on every interface at 30000.
    assert cluster["profiles"] == ["cluster"]
    assert cluster["image"] == services["sim"]["image"] and cluster["build"] == "."
    argv = cluster["command"]
    assert argv[:2] == ["loadlab", "cluster"]
    assert argv[argv.index("--host") + 1] == "0.0.0.0" and argv[argv.index("--port") + 1] == "30000"
    assert "30000" in [container_port(p) for p in cluster["expose"]] and "ports" not in cluster
    # The default cluster file ships in the image and has a front for the master to aim at.
    config = load_cluster(REPO / argv[2])
    assert config.front.kind in ("router", "omni")
    assert "./clusters:/loadlab/clusters:ro" in cluster["volumes"]
    healthcheck = cluster["healthcheck"]["test"]
    assert healthcheck[0] == "CMD" and "/readiness" in healthcheck[-1] and "/health" in healthcheck[-1]
    # The master waits for it when it is on, and aims at it when LOCUST_HOST says so.
    assert services["master"]["depends_on"]["cluster"] == {"condition": "service_healthy", "required": False}
    master_env = load_compose(CLUSTER_VARS)["services"]["master"]["environment"]
    assert master_env["LOCUST_HOST"] == "http://cluster:30000"
    # The image has what a cluster needs: sglang-router (the `router` extra) and the cluster files.
    dockerfile = DOCKERFILE.read_text()
    install = re.search(r"^RUN pip install ([^\n]*)", dockerfile, re.MULTILINE).group(1)
    assert re.search(r"\.\[([\w,]*,)?router(,[\w,]*)?\]", install), install
    assert re.search(r"^COPY clusters \./clusters\s*$", dockerfile, re.MULTILINE)
    assert "clusters" not in (REPO / ".dockerignore").read_text().split()


def run_headless(stack: LocalCompose) -> Path:
    """Brings the stack up, waits for the headless master and its workers to exit 0, brings it down; the run
    directory."""
    try:
        stack.up()
        (master,) = stack.procs["master"]
        try:
            rc = master.wait(90)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the master did not finish in 90 s\n{stack.logs()}") from None
        assert rc == 0, stack.logs()
        for worker in stack.procs["worker"]:  # the headless master's quit stops them
            assert worker.wait(30) == 0, stack.logs()
    finally:
        stack.down()
    reports = stack.paths["master"]["/loadlab/reports"]
    assert reports.is_relative_to(stack.tmp_path)
    return reports / "run"


def check_complete_run(stack: LocalCompose, run: Path, replicas: int, target_url: str) -> tuple[list, dict]:
    """The run is complete: exactly one ok record per request of the profile, from every worker, against
    `target_url`, with its report written. Returns the records and the summary."""
    env = stack.env("master")
    requests = yaml.safe_load((REPO / env["LOADLAB_PROFILE_FILE"]).read_text())["requests"]
    if env.get("LOADLAB_NUM_REQUESTS"):  # passed through from the shell: --num-requests
        requests["measured"] = int(env["LOADLAB_NUM_REQUESTS"])
    total = requests["warmup"] + requests["measured"]
    rows = read_jsonl_records(run / "records.jsonl")
    assert sorted(r["index"] for r in rows) == list(range(total)), stack.logs()  # exactly every request once
    assert all(r["outcome"] == "ok" for r in rows), [r for r in rows if r["outcome"] != "ok"][:3]
    assert len({r["worker_id"] for r in rows}) == replicas  # every worker sent requests
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["complete"] is True
    assert manifest["target"]["url"] == target_url
    assert len(manifest["load_generators"]) == replicas
    summary = json.loads((run / "summary.json").read_text())
    assert summary["measured_requests"] == requests["measured"] and not summary["partial"]
    assert (run / "summary.md").exists() and (run / "records.parquet").exists()
    return rows, summary


def test_compose_stack_runs_a_headless_distributed_test(compose, tmp_path):
    stack = LocalCompose(compose, tmp_path)
    replicas = int(compose["services"]["worker"]["deploy"]["replicas"])
    assert replicas >= 2
    run = run_headless(stack)
    sim_url = f"http://127.0.0.1:{stack.ports['sim']['30000']}"
    check_complete_run(stack, run, replicas, sim_url)  # against the sim service


def cluster_ready_line(stack: LocalCompose) -> dict:
    """The `cluster` service's ready line (`loadlab cluster` prints it on stdout, in the service's log)."""
    lines = (stack.tmp_path / "cluster-1.log").read_text(errors="replace").splitlines()
    ready = [line[len(CLUSTER_READY_PREFIX) :] for line in lines if line.startswith(CLUSTER_READY_PREFIX)]
    assert len(ready) == 1, stack.logs()
    return json.loads(ready[0])


@pytest.mark.parametrize("front", ["router", "omni"])
def test_compose_cluster_profile_runs_against_the_cluster_front(front, tmp_path):
    """`LOCUST_HOST=http://cluster:30000 docker compose --profile cluster up`, headless: the run goes through
    the cluster's front (sglang-router with the default cluster file; omni with a cluster file naming it) and
    every request is served, and attributed, by one of the cluster's workers."""
    variables = dict(CLUSTER_VARS)
    if front == "router":
        pytest.importorskip("sglang_router", reason="front kind router needs sglang-router")
    else:  # the default cluster file with omni as its front: LOADLAB_CLUSTER_FILE names another file
        default = load_compose(CLUSTER_VARS)["services"]["cluster"]["command"][2]
        data = yaml.safe_load((REPO / default).read_text())
        data["front"] = {"kind": "omni", "policy": "least_queue"}
        (tmp_path / "omni.yaml").write_text(yaml.safe_dump(data))
        variables["LOADLAB_CLUSTER_FILE"] = str(tmp_path / "omni.yaml")
    compose = load_compose(variables)
    stack = LocalCompose(compose, tmp_path, profiles=("cluster",), variables=variables)
    assert {"cluster", "sim", "master", "worker"} == set(stack.services)  # sglang stays off
    replicas = int(compose["services"]["worker"]["deploy"]["replicas"])
    run = run_headless(stack)

    ready = cluster_ready_line(stack)
    assert ready["kind"] == front
    front_url = f"http://127.0.0.1:{stack.ports['cluster']['30000']}"  # --host 0.0.0.0 --port 30000
    assert ready["front"] == front_url
    workers = {w["url"] for w in ready["workers"]}
    cluster_file = compose["services"]["cluster"]["command"][2]
    assert len(workers) == load_cluster(REPO / cluster_file).total_workers  # (an absolute path stays one)
    # The twins stay on (the container's) loopback; only the front listens on every interface.
    assert all(w.startswith("http://127.0.0.1:") for w in workers)
    rows, summary = check_complete_run(stack, run, replicas, front_url)
    # Every request was served by a cluster worker, named in its x-loadlab-worker header through the front.
    strangers = [r["served_by"] for r in rows if r["served_by"] not in workers]
    assert not strangers, strangers
    served = {r["served_by"] for r in rows}
    assert len(served) >= 2, served  # the front spread them
    assert summary["unattributed_requests"] == 0
    assert {w["served_by"] for w in summary["workers"]} <= workers
    assert sum(w["measured_requests"] for w in summary["workers"]) == summary["measured_requests"]
