"""SLO classes: in profiles (exact, pure class assignment; one-line errors), on every record, per class in
the summary, carried to the server (priority, an x-request-id- header), through virtual time and a real run."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import REPO, run_loadlab
from test_analysis import T0, decoding, make_manifest, summarize

from loadlab import exits
from loadlab.analysis import Summary
from loadlab.analysis.compare import compare_classes, render
from loadlab.profile import ProfileError, load_profile, validate_profile
from loadlab.records import RequestRecord
from loadlab.testing.servers import start_twin
from loadlab.workload import build_workload
from loadlab.workload.generators import quotas

LOADLAB = [sys.executable, "-m", "loadlab.cli"]

THREE = [
    {"name": "gold", "share": 0.5, "carry": {"priority": 10, "header": "x-request-id-class"}},
    {"name": "silver", "share": 0.3, "workload": {"kind": "random_prefix", "input_len": 8, "output_len": 5}},
    {"name": "bronze", "share": 0.2, "slo": {"ttft_p95_ms": 50}},
]


def _profile(classes=THREE, warmup=7, measured=101, **extra):
    return validate_profile({
        "seed": 5, "requests": {"warmup": warmup, "measured": measured}, "classes": classes,
        "workload": {"kind": "random_prefix", "input_len": 16, "output_len": 4}, **extra,
    })  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Assignment: exact per-phase counts, a pure function of (profile, seed, i)


def test_quotas_are_largest_remainder():
    assert quotas([0.5, 0.3, 0.2], 101) == [51, 30, 20]  # 50.5, 30.3, 20.2: the one left goes to .5
    assert quotas([0.5, 0.3, 0.2], 7) == [4, 2, 1]  # 3.5, 2.1, 1.4
    assert quotas([0.29, 0.71], 100) == [29, 71]  # 0.29 * 100 is 28.999999999999996 in floats
    assert quotas([1 / 3] * 3, 10) == [4, 3, 3] and quotas([0.5, 0.5], 0) == [0, 0]
    for n in range(0, 300, 7):
        assert sum(quotas([0.1, 0.2, 0.3, 0.4], n)) == n


def test_per_class_counts_are_exact_and_the_same_in_any_split():
    profile = _profile()
    w = build_workload(profile)
    classes = [w.class_of(i) for i in range(profile.total_requests)]
    assert Counter(classes[:7]) == {"gold": 4, "silver": 2, "bronze": 1}
    assert Counter(classes[7:]) == {"gold": 51, "silver": 30, "bronze": 20}
    # Pure in i: a fresh generator per "worker", each asking for its own indices in its own order (as
    # Locust workers leasing tickets would), gives every index the same class and spec.
    for workers in (2, 3, 5):
        for k in range(workers):
            fresh = build_workload(_profile())
            for i in reversed(range(k, profile.total_requests, workers)):
                spec = fresh.spec(i)
                assert spec.request_class == classes[i]
                assert spec == w.spec(i)
    # Not every index in one class's stretch: the permutation spreads them.
    assert len({classes[i] for i in range(7, 17)}) > 1
    # Another seed, another assignment; the same counts.
    other = build_workload(validate_profile({**profile.model_dump(), "seed": 6}))
    other_classes = [other.class_of(i) for i in range(profile.total_requests)]
    assert other_classes != classes and Counter(other_classes[7:]) == Counter(classes[7:])


def test_class_specs_carry_the_class_and_use_its_workload():
    profile = _profile()
    w = build_workload(profile)
    plain = build_workload(
        validate_profile({k: v for k, v in profile.model_dump().items() if k != "classes"})
    )
    for i in range(profile.total_requests):
        spec = w.spec(i)
        if spec.request_class == "gold":  # the profile's workload: the very request the profile alone sends
            assert (spec.priority, spec.class_header, spec.model) == (10, "x-request-id-class", None)
            assert spec.input_ids == plain.spec(i).input_ids and spec.max_new_tokens == 4
        elif spec.request_class == "silver":  # its own workload
            assert spec.input_len == 8 and spec.max_new_tokens == 5 and spec.priority is None
        else:
            assert spec.input_ids == plain.spec(i).input_ids and spec.class_header is None
    assert plain.spec(3).request_class is None  # no classes: as before


# ---------------------------------------------------------------------------------------------------
# Bad classes: one line, file:line: key: problem


BASE = """name: c
workload:
  kind: random_prefix
target:
  api: {api}
classes:
  - name: gold
    share: 0.6
    carry: {carry}
  - name: {second}
    share: {share}
"""


@pytest.mark.parametrize(
    "fields, line, expected",
    [
        ({"share": 0.3}, 6, "classes: the shares sum to 0.9, not 1 (gold 0.6, bronze 0.3)"),
        ({"second": "gold"}, 10, "classes.1.name: 'gold' is also the name of classes[0]"),
        ({"api": "chat", "carry": "{priority: 3}"}, 9, "classes.0.carry.priority: not with api: chat"),
        ({"carry": "{header: x-class}"}, 9, "classes.0.carry.header: must start with x-request-id-"),
        ({"carry": "{model: m}"}, 9, "classes.0.carry.model: the native /generate has no model field"),
        ({"carry": "{priority: high}"}, 9, "classes.0.carry.priority: Input should be a valid integer"),
        ({"carry": "{colour: red}"}, 9, "classes.0.carry.colour: unknown key"),
        ({"share": 0}, 11, "classes.1.share: Input should be greater than 0"),
        ({"second": "'a b'"}, 10, "classes.1.name: letters, digits"),
    ],
)
def test_bad_classes_are_one_line_errors(tmp_path, fields, line, expected):
    values = {"api": "generate", "carry": "{}", "second": "bronze", "share": 0.4, **fields}
    path = tmp_path / "p.yaml"
    path.write_text(BASE.format(**values))
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path}:{line}: {expected}"), message


def test_good_carries_validate(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(BASE.format(api="completions", carry="{priority: 3, model: m, header: X-Request-Id-Tier}",
                                second="bronze", share=0.4))  # fmt: skip
    profile = load_profile(path)
    assert [c.name for c in profile.classes] == ["gold", "bronze"] and profile.classes[0].carry.model == "m"
    assert load_profile(path, {"classes": None}).classes is None


# ---------------------------------------------------------------------------------------------------
# Per-class figures against values computed by hand from hand-written records


def _rec(index, cls, t, ttft, step, n, outcome="ok"):
    events = decoding(n, ttft, step) if outcome == "ok" else []
    e2e = events[-1][0] if events else 5.0
    return RequestRecord(
        index=index, phase="measure", api="generate", worker_id="w0", user_id=0, t_send_wall=T0 + t,
        outcome=outcome, ttft_ms=ttft if events else None, e2e_ms=e2e,
        arrival_ms=[float(ms) for ms, _ in events], arrival_tokens=[1] * len(events),
        input_len=10, max_new_tokens=n, prompt_tokens=10 if events else None,
        output_tokens=len(events) if events else None, request_class=cls,
    )  # fmt: skip


def test_per_class_figures_match_hand_computed_values(tmp_path):
    # gold: TTFT 10, 20, ..., 50 ms, 5 tokens 2 ms apart; bronze: TTFT 100, 300 ms, 3 tokens 10 ms apart, one
    # failure. Sends at 0..6 s, the last ending at 6 s + 320 ms.
    gold = [_rec(i, "gold", t=i, ttft=10.0 * (i + 1), step=2.0, n=5) for i in range(5)]
    bronze = [_rec(5, "bronze", t=5, ttft=100.0, step=10.0, n=3), _rec(6, "bronze", t=6, ttft=300.0, step=10.0, n=3),
              _rec(7, "bronze", t=2.5, ttft=0, step=0, n=0, outcome="http_error")]  # fmt: skip
    profile = {"slo": {"ttft_p95_ms": 60}, "classes": [
        {"name": "gold", "share": 0.6, "slo": None}, {"name": "bronze", "share": 0.4, "slo": {"ttft_p95_ms": 250}},
    ]}  # fmt: skip
    s = summarize(tmp_path, gold + bronze, make_manifest(profile))
    duration = 6.0 + 0.320
    assert s.duration == pytest.approx(duration)
    g, b = s.classes
    assert (g.name, g.share, g.measured_requests, g.completed, g.failed) == ("gold", 0.6, 5, 5, 0)
    assert (b.name, b.share, b.measured_requests, b.completed, b.failed) == ("bronze", 0.4, 3, 2, 1)
    assert b.failures == {"http_error": 1} and g.failures == {}
    gold_ttft, bronze_ttft = [10.0, 20.0, 30.0, 40.0, 50.0], [100.0, 300.0]
    # Percentiles by hand (linear interpolation): P95 of 10..50 is 10 + 0.95 * 4 * 10 = 48; of 100, 300: 290.
    assert g.ttft_ms.p95 == pytest.approx(48.0) and b.ttft_ms.p95 == pytest.approx(290.0)
    assert g.ttft_ms.median == 30.0 and g.ttft_ms.mean == 30.0 and b.ttft_ms.mean == 200.0
    assert (g.ttft_ms.min, g.ttft_ms.max) == (10.0, 50.0) and b.ttft_ms.std == pytest.approx(100.0)
    assert g.ttft_ms.std == pytest.approx(float(np.std(gold_ttft))) and g.samples.ttft_ms == 5
    assert g.tpot_ms.p95 == pytest.approx(2.0) and b.tpot_ms.mean == pytest.approx(
        10.0
    )  # (e2e - ttft) / (n - 1)
    assert g.itl_ms.max == pytest.approx(2.0) and g.samples.itl_ms == 20 and b.samples.itl_ms == 4
    assert g.e2e_latency_ms.max == pytest.approx(58.0) and b.e2e_latency_ms.min == pytest.approx(120.0)
    assert g.total_output_tokens == 25 and b.total_output_tokens == 6
    assert g.request_throughput == pytest.approx(5 / duration) and b.output_throughput == pytest.approx(
        6 / duration
    )
    # Verdicts: gold on the profile's SLO (48 <= 60: pass), bronze on its own (290 > 250: fail).
    assert g.slo.passed is True and g.slo.objectives[0].threshold_ms == 60 and g.slo.failed_requests == 0
    assert (
        b.slo.passed is False
        and b.slo.objectives[0].value_ms == pytest.approx(290.0)
        and b.slo.failed_requests == 1
    )
    # The run-wide objective alone: P95 of all seven TTFTs, 10..50, 100, 300 -> 240 > 60 fails anyway; overall
    # fails. With bronze's limit loosened and the run-wide one dropped, the overall verdict follows the classes.
    assert (
        s.ttft_ms.p95 == pytest.approx(float(np.percentile(gold_ttft + bronze_ttft, 95)))
        and s.slo.passed is False
    )
    loose = {"slo": {}, "classes": [{"name": "gold", "share": 0.6, "slo": {"ttft_p95_ms": 60}},
                                    {"name": "bronze", "share": 0.4, "slo": {"ttft_p95_ms": 295}}]}  # fmt: skip
    (tmp_path / "b").mkdir()
    s2 = summarize(tmp_path / "b", gold + bronze, make_manifest(loose))
    assert (
        s2.slo.objectives == []
        and s2.slo.passed is True
        and [c.slo.passed for c in s2.classes] == [True, True]
    )
    strict = {"slo": {}, "classes": [{"name": "gold", "share": 0.6, "slo": {"ttft_p95_ms": 40}},
                                     {"name": "bronze", "share": 0.4, "slo": {"ttft_p95_ms": 295}}]}  # fmt: skip
    (tmp_path / "c").mkdir()
    s3 = summarize(tmp_path / "c", gold + bronze, make_manifest(strict))
    assert s3.slo.passed is False and [c.slo.passed for c in s3.classes] == [False, True]
    # On disk: flat latency keys per class, read back the same; summary.md has the table; compare shows both.
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["classes"][0]["p95_ttft_ms"] == pytest.approx(48.0) and Summary.read(tmp_path) == s
    md = (tmp_path / "summary.md").read_text()
    assert "## Per class" in md and "| gold | 0.6 | 5 | 5 | 0 |" in md and "class bronze" in md
    rows = compare_classes(s, s3)
    assert [(r["class"], r["a_pass"], r["b_pass"]) for r in rows] == [
        ("gold", True, False),
        ("bronze", False, True),
    ]
    text = render(tmp_path, tmp_path / "c", s, s3, [])
    assert "gold" in text and "48.00" in text and "FAIL" in text


def test_records_without_a_profile_class_and_without_classes(tmp_path):
    records = [_rec(0, "x", t=0, ttft=10.0, step=1.0, n=2), _rec(1, None, t=1, ttft=10.0, step=1.0, n=2)]
    s = summarize(tmp_path, records, make_manifest())
    assert [(c.name, c.share, c.measured_requests) for c in s.classes] == [("x", None, 1)]
    (tmp_path / "b").mkdir()
    s = summarize(tmp_path / "b", [_rec(0, None, t=0, ttft=10.0, step=1.0, n=2)], make_manifest())
    assert s.classes == [] and "Per class" not in (tmp_path / "b" / "summary.md").read_text()


# ---------------------------------------------------------------------------------------------------
# Through the drivers: virtual time, and loadlab run against the twin


TWO_CLASS = {
    "name": "two-class", "seed": 3,
    "workload": {"kind": "random_prefix", "input_len": 64, "output_len": 8},
    "load": {"model": "closed", "concurrency": 4}, "requests": {"warmup": 3, "measured": 25},
    "slo": {"ttft_p95_ms": 100000},
    "classes": [
        {"name": "interactive", "share": 0.6, "carry": {"priority": 5, "header": "x-request-id-class"},
         "slo": {"ttft_p95_ms": 100000}},
        {"name": "batch", "share": 0.4, "workload": {"kind": "random_prefix", "input_len": 32, "output_len": 4},
         "slo": {"ttft_p95_ms": 0.001}},
    ],
}  # fmt: skip


def _check_two_classes(run_dir: Path) -> None:
    s = Summary.read(run_dir)
    interactive, batch = s.classes
    assert (interactive.name, interactive.measured_requests, interactive.completed) == ("interactive", 15, 15)
    assert (batch.name, batch.measured_requests, batch.completed) == ("batch", 10, 10)
    assert interactive.slo.passed is True and batch.slo.passed is False and s.slo.passed is False
    assert batch.total_output_tokens == 40 and interactive.total_output_tokens == 120
    import pandas as pd

    df = pd.read_parquet(run_dir / "records.parquet")
    measured = df[df.phase == "measure"]
    assert measured.request_class.value_counts().to_dict() == {"interactive": 15, "batch": 10}
    assert df[df.phase == "warmup"].request_class.value_counts().to_dict() == {"interactive": 2, "batch": 1}
    assert set(measured[measured.request_class == "batch"].input_len) == {32}


def test_two_classes_in_virtual_time(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(TWO_CLASS))
    proc = subprocess.run([*LOADLAB, "sim", "--virtual", str(path), "--out", str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    _check_two_classes(Path(proc.stdout.strip().splitlines()[-1]))


def test_two_classes_through_loadlab_run_against_the_twin(tmp_path):
    # The twin accepts SGLang's priority field on /generate (and schedules first-come first-served: it has no
    # priority scheduling) and the class header, so every request completes.
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(TWO_CLASS))
    twin = start_twin()
    try:
        run = run_loadlab(path, twin.url, tmp_path / "out")
    finally:
        twin.stop()
    assert run.returncode == 0, run.explain()
    _check_two_classes(run.run_dir)


def test_priority_and_header_reach_the_server(tmp_path, scripted_server):
    profile = {**TWO_CLASS, "requests": {"warmup": 0, "measured": 10}, "load": {"concurrency": 2},
               "workload": {"kind": "random_prefix", "input_len": 16, "output_len": 3}}  # fmt: skip
    profile["classes"] = [{**TWO_CLASS["classes"][0], "share": 0.5},
                          {"name": "batch", "share": 0.5, "carry": {"priority": 1}}]  # fmt: skip
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(profile))
    run = run_loadlab(path, scripted_server.case_url("normal"), tmp_path / "out")
    assert run.returncode == 0, run.explain()
    log = scripted_server.log_entries()
    df = run.records()
    assert len(df) == 10 and set(df.outcome) == {"ok"}
    for row in df.itertuples():
        entry = log[row.server_id]
        if row.request_class == "interactive":
            assert entry["priority"] == 5 and entry["class_headers"] == {"x-request-id-class": "interactive"}
        else:
            assert entry["priority"] == 1 and entry["class_headers"] == {}


# ---------------------------------------------------------------------------------------------------
# classes_require_slo: a class without an objective (its own, or the profile's it inherits) is a mistake

REQUIRE = """name: r
classes_require_slo: true
workload: {{kind: random_prefix, input_len: 16, output_len: 4}}
slo: {profile_slo}
classes:
  - name: gold
    share: 0.5
    slo: {{ttft_p95_ms: 100}}
  - name: bronze
    share: 0.5
{bronze_slo}"""


@pytest.mark.parametrize(
    "profile_slo, bronze_slo, expected",
    [
        (
            "{}",
            "",
            "classes.1.slo: class 'bronze' has no SLO objective (it has no slo and the profile's slo has",
        ),
        (
            "{ttft_p95_ms: 900}",
            "    slo: {}\n",
            "classes.1.slo: class 'bronze' has no SLO objective (its slo sets",
        ),
        (
            "{}",
            "    slo: {ttft_p95_ms: null}\n",
            "classes.1.slo: class 'bronze' has no SLO objective (its slo sets",
        ),
    ],
)
def test_classes_require_slo_refuses_a_class_without_an_objective(
    tmp_path, profile_slo, bronze_slo, expected
):
    path = tmp_path / "p.yaml"
    path.write_text(REQUIRE.format(profile_slo=profile_slo, bronze_slo=bronze_slo))
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    message = str(e.value)
    line = 11 if bronze_slo else 9  # the class's slo key, else the class itself
    assert "\n" not in message and message.startswith(f"{path}:{line}: {expected}"), message
    assert "classes_require_slo is true" in message
    # The same profile without the key: the class is judged n/a, as before.
    path.write_text(REQUIRE.format(profile_slo=profile_slo, bronze_slo=bronze_slo).replace("true", "false"))
    assert load_profile(path).classes[1].name == "bronze"


def test_classes_require_slo_accepts_inherited_objectives(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(REQUIRE.format(profile_slo="{tpot_p95_ms: 80}", bronze_slo=""))  # bronze inherits it
    profile = load_profile(path)
    assert profile.classes_require_slo is True
    assert profile.class_slo(profile.classes[1]).tpot_p95_ms == 80
    assert validate_profile({"workload": {"kind": "rag"}, "classes_require_slo": True}).classes is None
    with pytest.raises(ProfileError, match="classes_require_slo: Input should be a valid boolean"):
        validate_profile({"workload": {"kind": "rag"}, "classes_require_slo": "yes"})


# ---------------------------------------------------------------------------------------------------
# A profile's classes against the districts of its cluster (loadlab.cluster.config.check_classes)

SPLIT = REPO / "clusters" / "omni-split.yaml"  # online serves online; offline serves offline
CLUSTER_PROFILE = """name: cp
target:
  cluster: {cluster}
workload: {{kind: random_prefix, input_len: 16, output_len: 4}}
requests: {{warmup: 0, measured: 20}}
classes:
  - name: online
    share: 0.5
    carry: {{header: x-request-id-class}}
  - name: {second}
    share: 0.5
    carry: {carry}
"""
NO_DISTRICT = "classes.1.name: 'batch' is served by no district of {cluster} (online serves online; offline serves offline)"


def _cluster_profile(tmp_path, cluster=SPLIT, second="offline", carry="{header: x-request-id-class}"):
    path = tmp_path / "p.yaml"
    path.write_text(CLUSTER_PROFILE.format(cluster=cluster, second=second, carry=carry))
    return path


def _check(path):
    from loadlab.cluster.config import check_classes, load_cluster

    profile = load_profile(path)
    return check_classes(profile, path, load_cluster(profile.target.cluster), profile.target.cluster)


def test_every_class_must_be_served_by_a_district(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # messages show the cluster file relative to the working directory
    assert _check(_cluster_profile(tmp_path)) == []  # omni-split.yaml's own classes
    path = _cluster_profile(tmp_path, second="batch")
    with pytest.raises(ProfileError) as e:
        _check(path)
    assert str(e.value) == f"{path}:10: " + NO_DISTRICT.format(cluster="clusters/omni-split.yaml")
    # A district without serves takes any class (omni's default): then batch is served, and a district
    # naming a class the profile lacks is only a warning (a cluster file serves many profiles).
    shared = tmp_path / "shared.yaml"
    shared.write_text(
        SPLIT.read_text().replace("    serves: [offline]\n", "").replace("[online]", "[online, gold]")
    )
    warnings = _check(_cluster_profile(tmp_path, cluster=shared, second="batch"))
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert (
        f"{shared}:" in warnings[0]
        and "districts.0.serves: district online serves 'gold', which is not a class" in warnings[0]
    )


@pytest.mark.parametrize(
    "carry, sent",
    [("{}", "no class header"), ("{header: x-request-id-tier}", "its class in x-request-id-tier")],
)
def test_a_class_routed_by_a_district_needs_omnis_header(tmp_path, carry, sent):
    path = _cluster_profile(tmp_path, carry=carry)
    with pytest.raises(ProfileError) as e:
        _check(path)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path}:12: classes.1.carry.header: class 'offline'")
    assert "is routed to district offline of " in message and message.endswith(
        f"by the x-request-id-class header, and its requests carry {sent}: set carry.header: x-request-id-class"
    )
    # Header names are case-insensitive on the wire.
    assert _check(_cluster_profile(tmp_path, carry="{header: X-Request-Id-Class}")) == []


def test_clusters_that_do_not_route_by_class_are_not_checked(tmp_path):
    # online-offline.yaml has districts but sglang-router in front and no serves: any class goes anywhere.
    plain = _cluster_profile(
        tmp_path, cluster=REPO / "clusters" / "online-offline.yaml", second="batch", carry="{}"
    )
    assert _check(plain) == []


def test_a_profile_without_classes_on_a_cluster_serving_named_classes_only(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(f"name: n\ntarget:\n  cluster: {SPLIT}\nworkload: {{kind: rag}}\n")
    with pytest.raises(ProfileError) as e:
        _check(path)
    assert str(e.value).startswith(
        f"{path}:3: target.cluster: every district of "
    ) and "profile has no classes" in str(e.value)


def _one_line_error(proc, expected: str, prefix: str = "loadlab: ") -> None:
    assert proc.returncode == exits.BAD_INPUT, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_cli_refuses_a_class_no_district_serves_in_one_line(tmp_path):
    # As a user runs it: loadlab run (before Locust), Locust's own entry point, virtual time, validate. No
    # load is sent: the check comes before the cluster starts.
    path = _cluster_profile(tmp_path, second="batch")
    expected = f"{path}:10: classes.1.name: 'batch' is served by no district of clusters/omni-split.yaml"
    commands = [
        ("loadlab: ", [*LOADLAB, "run", str(path), "--out", str(tmp_path / "out")]),
        ("loadlab sim: error: ", [*LOADLAB, "sim", "--virtual", str(path), "--out", str(tmp_path / "out")]),
        ("loadlab: ", [*LOADLAB, "validate", str(path)]),
    ]
    for prefix, argv in commands:
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
        _one_line_error(proc, expected, prefix)
        assert proc.stderr.strip().endswith("(online serves online; offline serves offline)")
    proc = subprocess.run([sys.executable, "-m", "locust", "-f", "locustfile.py", "--headless", "--profile-file",
                           str(path), "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    _one_line_error(proc, f"{path}:10: classes.1.name: 'batch' is served by no district of ")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            BASE.format(api="generate", carry="{}", second="bronze", share=0.3),
            ":6: classes: the shares sum to 0.9",
        ),
        (
            BASE.format(api="generate", carry="{}", second="gold", share=0.4),
            ":10: classes.1.name: 'gold' is also",
        ),
        (
            REQUIRE.format(profile_slo="{}", bronze_slo=""),
            ":9: classes.1.slo: class 'bronze' has no SLO objective",
        ),
    ],
)
def test_bad_class_definitions_exit_2_with_one_line_through_the_cli(tmp_path, text, expected):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    proc = subprocess.run(
        [*LOADLAB, "validate", str(path)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    _one_line_error(proc, f"{path}{expected}")
    assert proc.stderr.count("\n") == 1
