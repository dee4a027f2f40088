"""The run directory's contracts: records and manifest are defined once, and documented field by field."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadlab.manifest import Manifest, ManifestError, read_manifest, write_manifest
from loadlab.records import RECORD_FIELDS, arrow_types
from loadlab.testing.contracts import documented_paths, field_paths

DOCS = Path(__file__).resolve().parents[1] / "docs" / "records.md"


def test_every_manifest_field_is_documented_and_nothing_else():
    model = set(field_paths(Manifest))
    documented = documented_paths(DOCS.read_text(), "## Manifest (`manifest.json`)")
    assert model - documented == set(), "fields of Manifest missing from docs/records.md"
    assert documented - model == set(), "docs/records.md documents manifest fields that do not exist"


def test_every_record_field_is_documented_and_has_a_parquet_type():
    documented = documented_paths(DOCS.read_text(), "## Columns (stable; scripts may rely on them)")
    assert set(RECORD_FIELDS) == documented
    assert set(arrow_types()) == set(RECORD_FIELDS)


def test_the_doc_check_catches_a_missing_field():
    text = DOCS.read_text().replace("| `counts.records` |", "| counts.records |")
    assert "counts.records" not in documented_paths(text, "## Manifest (`manifest.json`)")


def _manifest(**changes) -> Manifest:
    base = dict(run_id="r", profile={}, target={"url": "http://127.0.0.1:1"}, started_wall=1.0,
                load={"model": "closed", "concurrency": 2, "description": "closed loop, 2 in flight"},
                counts={"warmup_expected": 1, "measured_expected": 2}, versions={"loadlab": "0", "python": "3",
                "platform": "x"}, command=["loadlab"])  # fmt: skip
    return Manifest.model_validate({**base, **changes})


def test_manifest_round_trip_and_one_line_errors(tmp_path):
    assert read_manifest(tmp_path) is None  # no manifest: None, not an error
    m = _manifest()
    write_manifest(tmp_path, m)
    assert read_manifest(tmp_path) == m
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match=r"manifest.json: not readable JSON"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"version": 99}')
    with pytest.raises(ManifestError, match=r"version 99 is newer"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"version": 1, "run_id": 3}')
    with pytest.raises(ManifestError, match=r"does not fit the manifest schema") as e:
        read_manifest(tmp_path)
    assert "\n" not in str(e.value)


def test_report_on_a_broken_manifest_is_one_line(tmp_path):
    import subprocess
    import sys

    (tmp_path / "records.jsonl").write_text("")
    (tmp_path / "manifest.json").write_text("{broken")
    done = subprocess.run([sys.executable, "-m", "loadlab", "report", str(tmp_path)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "manifest.json: not readable JSON" in done.stderr


def test_every_outcome_is_documented():
    from loadlab.records import OUTCOMES

    assert documented_paths(DOCS.read_text(), "## Outcomes") == set(OUTCOMES)


def test_attribution_fields_come_last_and_round_trip_through_parquet(tmp_path):
    from loadlab.records import (
        STATUS_FRONT,
        STATUS_SOURCES,
        STATUS_WORKER,
        RecordWriter,
        RequestRecord,
        load_records,
        write_parquet,
    )

    # New columns go at the end.
    assert RECORD_FIELDS[-8:-3] == ("served_by", "status_source", "request_class", "session", "turn")
    assert RECORD_FIELDS[-3:] == ("arrival_tokens_from", "receipt_clock", "coalesced_reads")
    assert STATUS_SOURCES == ("worker", "front")
    base = dict(phase="measure", api="generate", worker_id="h:1", user_id=0, t_send_wall=1.0)
    writer = RecordWriter(tmp_path)
    writer.write(RequestRecord(index=0, served_by="http://127.0.0.1:1", status_source=STATUS_WORKER, **base))
    writer.write(
        RequestRecord(index=1, status_source=STATUS_FRONT, outcome="http_error", http_status=429, **base)
    )
    writer.write(RequestRecord(index=2, **base))
    writer.close()
    # A line written before the columns existed reads with both null.
    with open(tmp_path / "records.jsonl", "ab") as f:
        f.write(b'{"index": 3, "phase": "measure", "api": "generate", "worker_id": "h:1", "user_id": 0, '
                b'"t_send_wall": 1.0}\n')  # fmt: skip
    write_parquet(tmp_path)
    df = load_records(tmp_path)
    import pyarrow.parquet as pq

    schema = pq.read_schema(tmp_path / "records.parquet")
    assert (
        str(schema.field("served_by").type) == "string"
        and str(schema.field("status_source").type) == "string"
    )

    def strings(column):  # nulls come back as None or NaN, depending on pandas
        return [v if isinstance(v, str) else None for v in column]

    assert strings(df.served_by) == ["http://127.0.0.1:1", None, None, None]
    assert strings(df.status_source) == ["worker", "front", None, None]
    assert str(schema.field("arrival_tokens_from").type) == "string"
    assert strings(df.arrival_tokens_from) == ["server", "server", "server", None]


def test_records_csv_has_the_documented_columns_and_the_parquet_values(tmp_path):
    """records.csv (for spreadsheets) beside records.parquet: the documented columns in order, every value
    the Parquet file's, the per-event lists as JSON arrays."""
    import json
    import subprocess
    import sys

    import numpy as np
    import pandas as pd
    from conftest import REPO

    from loadlab.records import load_records

    proc = subprocess.run([sys.executable, "-m", "loadlab.cli", "sim", "--virtual", "profiles/two-classes.yaml",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = Path(proc.stdout.strip().splitlines()[-1])
    csv = pd.read_csv(run_dir / "records.csv")
    parquet = load_records(run_dir)
    assert tuple(csv.columns) == RECORD_FIELDS and len(csv) == len(parquet) == 416
    for name in ("index", "ttft_ms", "e2e_ms", "output_tokens", "request_class", "outcome", "phase"):
        a, b = csv[name].to_numpy(), parquet[name].to_numpy()
        if a.dtype.kind == "f":
            np.testing.assert_allclose(a, b.astype(float), rtol=1e-12, err_msg=name)
        else:
            assert list(a) == list(b), name
    for name in ("arrival_ms", "arrival_tokens"):
        decoded = [json.loads(cell) for cell in csv[name]]
        assert decoded == [list(v) for v in parquet[name]], name
    assert sum(map(len, csv["arrival_tokens"].map(json.loads))) > 400 * 100  # real token lists, not empty
