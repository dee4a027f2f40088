"""Profile validation: every user mistake gives one line naming the file, line, key and problem."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from loadlab.experiment.spec import load_sweep
from loadlab.profile import ProfileError, load_profile

REPO = Path(__file__).resolve().parents[1]
PROFILES = sorted((REPO / "profiles").glob("*.yaml"))

GOOD = """\
name: t
seed: 1
target:
  url: embedded
  api: generate
load:
  concurrency: 4
requests:
  warmup: 2
  measured: 10
workload:
  kind: random_prefix
  input_len: 64
  output_len: 8
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", PROFILES, ids=[p.name for p in PROFILES])
def test_shipped_profiles_are_valid(path):
    if "axes" in yaml.safe_load(path.read_text()):  # a sweep file: its base profile must load too
        spec = load_sweep(path)
        # A launched twin, or (a cluster sweep) the profile's own cluster started by each run.
        assert spec.repeats >= 1 and (spec.launch[0] == "loadlab" if spec.launch else spec.fresh_target)
        return
    profile = load_profile(path)
    assert profile.requests.measured > 0


def test_the_seed_sweep_is_the_seed_experiment():
    spec = load_sweep(REPO / "profiles" / "seed-batch-sweep.yaml")
    assert spec.axes == {"max_running_requests": (32, 64, 128, 256, 512)} and spec.repeats == 3
    assert spec.slo == {"ttft_p95_ms": 3000, "tpot_p95_ms": 100} and spec.warmup == 200
    assert load_sweep(REPO / "profiles" / "seed-batch-sweep-open.yaml").overrides[:2] == (
        "load.model=open",
        "load.rate=32",
    )


def test_rag_profile_is_the_seed_experiment():
    p = load_profile(REPO / "profiles" / "rag.yaml")
    assert (p.workload.kind, p.workload.input_len, p.workload.output_len) == ("rag", 1024, 256)
    assert (p.load.concurrency, p.requests.warmup, p.requests.measured) == (32, 200, 1000)
    assert (p.slo.ttft_p95_ms, p.slo.tpot_p95_ms) == (3000, 100)


def test_overrides_apply(tmp_path):
    p = load_profile(
        write(tmp_path, GOOD),
        {"load.concurrency": 9, "workload.input_len": 100, "target.api": "chat", "seed": 7},
    )
    assert (p.load.concurrency, p.workload.input_len, p.target.api, p.seed) == (9, 100, "chat", 7)


def test_fixed_length_override_replaces_a_range(tmp_path):
    text = GOOD.replace("  input_len: 64\n", "  input_len_range: [10, 20]\n")
    p = load_profile(write(tmp_path, text), {"workload.input_len": 33})
    assert p.workload.input_len == 33 and p.workload.input_len_range is None


# (profile text or a transformation of GOOD, expected line number or None, fragments that must appear)
BAD = {
    "unknown top-level key": (GOOD + "extra: 1\n", 15, ["extra", "unknown key"]),
    "unknown nested key": (
        GOOD.replace("  api: generate", "  apii: generate"),
        5,
        ["target.apii", "unknown key"],
    ),
    "concurrency not a number": (
        GOOD.replace("concurrency: 4", "concurrency: many"),
        7,
        ["load.concurrency", "'many'"],
    ),
    "zero concurrency": (
        GOOD.replace("concurrency: 4", "concurrency: 0"),
        7,
        ["load.concurrency", "greater than 0"],
    ),
    "negative measured": (GOOD.replace("measured: 10", "measured: -5"), 10, ["requests.measured", "-5"]),
    "negative warmup": (GOOD.replace("warmup: 2", "warmup: -1"), 9, ["requests.warmup"]),
    "bad api": (GOOD.replace("api: generate", "api: grpc"), 5, ["target.api", "grpc"]),
    "bad url": (GOOD.replace("url: embedded", "url: gpu-box:30000"), 3, ["target", "http://"]),
    "unknown workload kind": (
        GOOD.replace("kind: random_prefix", "kind: zipfian"),
        12,
        ["workload", "kind must be one of"],
    ),
    "missing workload": (GOOD.split("workload:")[0], None, ["workload", "required key is missing"]),
    "workload key of another kind": (GOOD + "  num_groups: 4\n", 15, ["workload.num_groups", "unknown key"]),
    "reversed range": (
        GOOD.replace("  input_len: 64\n", "  input_len_range: [50, 10]\n"),
        11,
        ["workload", "low <= high"],
    ),
    "rag too short": (
        "workload:\n  kind: rag\n  input_len: 20\n  instruction_len: 16\n  question_len: 8\n",
        1,
        ["workload", "too short"],
    ),
    "negative slo": (GOOD + "slo:\n  ttft_p95_ms: -3\n", 16, ["slo.ttft_p95_ms", "greater than 0"]),
    "zero timeout": (
        GOOD.replace("  api: generate", "  api: generate\n  timeout_s: 0"),
        6,
        ["target.timeout_s"],
    ),
    "seed not an int": (GOOD.replace("seed: 1", "seed: abc"), 2, ["seed", "'abc'"]),
    "duplicate key": (
        GOOD.replace("  concurrency: 4", "  concurrency: 4\n  concurrency: 8"),
        8,
        ["load.concurrency", "duplicate key", "line 7"],
    ),
    "boolean for a count": (
        GOOD.replace("measured: 10", "measured: true"),
        10,
        ["requests.measured", "integer"],
    ),
    "fraction for a count": (
        GOOD.replace("measured: 10", "measured: 2.5"),
        10,
        ["requests.measured", "integer"],
    ),
    "url port not a number": (
        GOOD.replace("url: embedded", "url: http://localhost:notaport"),
        3,
        ["target", "Port"],
    ),
    "url port out of range": (
        GOOD.replace("url: embedded", "url: http://h:99999"),
        3,
        ["target", "out of range"],
    ),
    "url with a query": (GOOD.replace("url: embedded", "url: http://h:1/?x=1"), 3, ["target", "query"]),
    "metrics url not http": (
        GOOD.replace("  url: embedded\n", "  url: embedded\n  metrics_urls: [http://a:1, a:2]\n"),
        3,
        ["target", "metrics_urls[1]"],
    ),
    "open loop without rate": (GOOD.replace("  concurrency: 4", "  model: open"), 6, ["load", "needs rate"]),
    "closed loop with rate": (
        GOOD.replace("  concurrency: 4", "  concurrency: 4\n  rate: 3"),
        6,
        ["load", "rate applies"],
    ),
    "invalid yaml": ("name: [unclosed\nseed: 1\n", 2, ["not valid YAML"]),
    "tab indentation yaml": ("name: t\n\tseed: 1\n", 2, ["not valid YAML"]),
    "empty file": ("", None, ["profile is empty"]),
    "top level is a list": ("- a\n- b\n", 1, ["must be a mapping"]),
    "embedded unknown setting": (
        GOOD.replace("  url: embedded\n", "  url: embedded\n  embedded:\n    max_batch_size: 64\n"),
        6,
        ["target.embedded.max_batch_size", "unknown setting"],
    ),
    "embedded bad value": (
        GOOD.replace("  url: embedded\n", "  url: embedded\n  embedded:\n    max_running_requests: lots\n"),
        6,
        ["target.embedded.max_running_requests", "expected an integer", "'lots'"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_profile_gives_one_line(tmp_path, case):
    text, line, fragments = BAD[case]
    path = write(tmp_path, text)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path) + (f":{line}:" if line else ":")), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_missing_file():
    with pytest.raises(ProfileError, match="no-such.yaml: profile file not found"):
        load_profile("no-such.yaml")


def test_input_len_on_shared_prefix_names_the_right_keys(tmp_path):
    text = "workload:\n  kind: shared_prefix\n"
    with pytest.raises(ProfileError, match="system_prompt_len"):
        load_profile(write(tmp_path, text), {"workload.input_len": 10})


def test_bad_override_value_names_the_key(tmp_path):
    with pytest.raises(ProfileError, match=r"load\.concurrency"):
        load_profile(write(tmp_path, GOOD), {"load.concurrency": "x"})


def _run(args, cwd=REPO):
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=60)


def _assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr
    error_lines = [line for line in lines if any(f in line for f in fragments)]
    assert error_lines, proc.stderr
    for fragment in fragments:
        assert fragment in error_lines[-1], (fragment, proc.stderr)


LOADLAB = [sys.executable, "-m", "loadlab.cli"]
LOCUST = [sys.executable, "-m", "locust", "-f", str(REPO / "locustfile.py"), "--headless"]


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["run", "profiles/missing.yaml"], ["profiles/missing.yaml", "not found"]),
        (["run", "profiles/default.yaml", "--concurrency", "abc"], ["--concurrency", "'abc'"]),
        (["run", "profiles/default.yaml", "--api", "soap"], ["--api", "soap"]),
        (["run", "profiles/default.yaml", "--set", "nokey"], ["--set", "KEY=VALUE"]),
        (["run", "profiles/default.yaml", "--set", "load.concurrency=-3"], ["load.concurrency"]),
        (["run", "profiles/default.yaml", "--host", "gpu-box"], ["target", "http://"]),
        (
            ["run", "profiles/default.yaml", "--tokenizer", "/nonexistent/tokenizer.json"],
            ["target.tokenizer"],
        ),
        (["validate", "profiles/rag.yaml", "tests/does-not-exist.yaml"], ["does-not-exist.yaml"]),
        (["run", "profiles/default.yaml", "--host", "http://[::1"], ["target", "http"]),
    ],
)
def test_loadlab_cli_bad_input_exits_2_with_one_line(args, fragments):
    _assert_one_line_error(_run(LOADLAB + args), *fragments)


def test_locust_entry_bad_profile_exits_2_before_load(tmp_path):
    bad = write(tmp_path, GOOD.replace("concurrency: 4", "concurrency: 0"))
    proc = _run(LOCUST + ["--profile-file", str(bad)])
    _assert_one_line_error(proc, str(bad), "load.concurrency")


def test_locust_zero_users_exits_2():
    _assert_one_line_error(_run(LOCUST + ["-u", "0"]), "-u/--users", "at least 1")


def test_unwritable_out_dir_exits_2():
    _assert_one_line_error(_run(LOCUST + ["--out", "/proc/loadlab-cannot-write"]), "--out", "cannot create")


def test_unreachable_target_fails_loudly():
    # Port 9 (discard) on loopback: nothing listens there.
    proc = _run(LOADLAB + ["run", "profiles/default.yaml", "--host", "http://127.0.0.1:9"])
    assert proc.returncode == 3, proc.stderr
    assert "cannot reach target http://127.0.0.1:9" in proc.stderr
    assert "Traceback" not in proc.stderr
