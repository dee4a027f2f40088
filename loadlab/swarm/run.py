"""One load-test run inside a Locust process (one-process runs and a distributed run's master): the run
directory, records, manifest, lost requests, and the end of the run."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gevent
import locust

from loadlab.client.stream import receipt_info
from loadlab.load import describe_load, tickets_for
from loadlab.manifest import (
    ClientVerdict,
    Counts,
    LostRequest,
    Manifest,
    TargetInfo,
    software_versions,
    write_manifest,
)
from loadlab.profile import API_PATHS, Profile, api_key_source, redact
from loadlab.records import (
    OK,
    RECORD_FIELDS,
    SPILL_DIR,
    IndexSet,
    RecordWriter,
    RequestRecord,
    TableWriter,
    default_run_name,
    merge_spills,
    read_jsonl_records,
    unique_run_name,
    worker_id,
    write_parquet,
)
from loadlab.swarm.calibration import verdict
from loadlab.swarm.options import DEFAULT_LIMIT_CPU, DEFAULT_LIMIT_MS
from loadlab.target.probe import REFUSED, refusal
from loadlab.workload import workload_source

if TYPE_CHECKING:
    from loadlab.analysis.summary import Summary

log = logging.getLogger("loadlab")


class Run:
    """A run directory being filled by this process's users."""

    def __init__(
        self,
        profile: Profile,
        profile_path: str,
        workload,
        renderer,
        out_root: str,
        run_name: str | None,
        target: TargetInfo,
        model: str | None,
        users: int,
        argv: list[str],
        api_key: str | None = None,
    ):
        self.profile = profile
        self.api_key = api_key  # sent by this process's users; never written anywhere (redact)
        self.api = profile.target.api
        self.model = model
        self.workload = workload
        self.renderer = renderer
        self.tickets = tickets_for(profile, workload)
        self.dir = Path(out_root) / unique_run_name(out_root, run_name or default_run_name(profile.name))
        self.dir.mkdir(parents=True)
        self.run_id = self.dir.name
        # SGLang keys requests by rid: a random part keeps two load generators started alike apart.
        self.rid_prefix = f"{self.run_id}-{uuid.uuid4().hex[:8]}"
        self.writer = RecordWriter(self.dir)
        # records.parquet and records.csv as the records come, a row group at a time, written in a native
        # thread: the run holds no more than two groups of records, and its end writes only the last one.
        self._last_group = None
        self.table = TableWriter(self.dir, offload=self._write_group)
        self.worker_id = worker_id()
        self.outcomes: dict[str, int] = {}
        self.indices = IndexSet()  # recorded: a byte per index, not a set of a million ints
        self.lost: dict[int, dict[str, Any]] = {}  # index -> phase and worker, for requests lost in flight
        self.coordinator = None  # the master's, in a distributed run
        self.monitor = None  # this process's ClientMonitor, when it runs users
        self.calibration: dict[str, Any] | None = None
        self.scraper = None  # the target's /metrics scraper process (loadlab.target.scraper)
        self.client_limits = (DEFAULT_LIMIT_MS, DEFAULT_LIMIT_CPU)
        self.live = None  # loadlab.swarm.live.LiveFigures, when the web UI or --metrics-port shows them
        self.finalized = False
        # A request the target refused for want of credentials (a gateway that lets the probe through):
        # every other request would be refused too, so the run stops (on_refused) with this line.
        self.refused: str | None = None
        self.on_refused = None
        # The report's summary once summary.md, report.html and records.parquet are written (the console
        # block prints it; the web UI's Download Data serves the files).
        self.summary: Summary | None = None
        self.manifest = Manifest(
            run_id=self.run_id,
            profile_path=profile_path,
            profile=profile.model_dump(mode="json"),
            target=target,
            model=model,
            load=describe_load(profile, users),
            workload_source=workload_source(workload),
            started_wall=time.time(),
            counts=Counts(
                warmup_expected=profile.requests.warmup, measured_expected=profile.requests.measured
            ),
            versions=software_versions(locust=locust.__version__, gevent=gevent.__version__),
            command=redact(list(argv), api_key),  # a key given on a command line stays out of it
            receipt=receipt_info(profile.target, target.url),
        )
        write_manifest(self.dir, self.manifest)

    def record(self, rec) -> None:
        if self.finalized:  # cannot happen when the run is stopped before it is finalized; say so if it does
            log.error("loadlab: request %d ended after the run was finalized; not in the records", rec.index)
            return
        if rec.index in self.indices:
            log.error("loadlab: request %d recorded twice; the second record is dropped", rec.index)
            return
        self.writer.write(rec)
        self.table.add(rec)
        if rec.http_status in REFUSED and self.refused is None:
            target = self.profile.target
            self.refused = refusal(self.manifest.target.url, f"POST {API_PATHS[rec.api]}", rec.http_status,
                                   self.api_key, api_key_source(target)) + "; the run stops"  # fmt: skip
            if self.on_refused is not None:
                self.on_refused(self.refused)
        self.indices.add(rec.index)
        if self.live is not None:
            self.live.add(rec)
        self.outcomes[rec.outcome] = self.outcomes.get(rec.outcome, 0) + 1
        if self.lost.pop(rec.index, None) is None:  # a request given up as lost is already counted
            self.tickets.finished(rec.phase)

    def lose(self, index: int, phase: str, worker: str) -> None:
        """A request handed to a worker that went away before recording it (distributed runs)."""
        if index in self.indices or index in self.lost:
            return
        self.lost[index] = {"phase": phase, "worker": worker}
        self.tickets.finished(phase)

    def progress(self) -> str:
        """One line: where the run is, what failed, and when it should end."""
        t = self.tickets
        now = time.time()
        elapsed = now - self.manifest.started_wall
        failed = self.writer.count - self.outcomes.get(OK, 0)
        if not t.warmup_done.is_set():
            return f"warm-up {t.warmup_finished}/{t.warmup} done, {failed} failed, {elapsed:.0f} s elapsed"
        measured = t.total - t.warmup
        line = f"measured {t.measured_finished}/{measured} done, {failed} failed, {elapsed:.0f} s elapsed"
        if t.measured_finished and t.measure_started_wall is not None:
            rate = t.measured_finished / max(now - t.measure_started_wall, 1e-9)
            line += f", about {(measured - t.measured_finished) / rate:.0f} s to go"
        return line

    @property
    def complete(self) -> bool:
        return self.tickets.all_done.is_set()

    def finalize(self) -> Summary | None:
        """Closes the records, writes Parquet, the manifest and the report. Safe to call twice."""
        if self.finalized:
            return None
        self.finalized = True
        calibration = self.stop_calibration()  # before the heavy work below
        if self.scraper is not None:
            self.scraper.stop()
        self.writer.close()
        recovered = self._merge_spills()
        self._close_table()
        t = self.tickets
        m = self.manifest
        m.ended_wall = time.time()
        m.complete = self.complete
        m.counts = m.counts.model_copy(
            update=dict(warmup_finished=t.warmup_finished, measured_finished=t.measured_finished,
                        records=self.writer.count + recovered, outcomes=self.outcomes,
                        lost_in_flight=len(self.lost), recovered_from_spills=recovered)
        )  # fmt: skip
        m.lost_in_flight = [LostRequest(index=i, **v) for i, v in sorted(self.lost.items())]
        generators = []
        if calibration is not None:
            generators.append({"worker_id": self.worker_id, **calibration})
        if self.coordinator is not None:
            m.load_generators = self.coordinator.load_generators()
            m.tickets = self.coordinator.ticket_leases()
            generators += self.coordinator.calibrations()
            m.failure = redact(self.coordinator.failure, self.api_key)
        if self.refused is not None:
            m.failure = m.failure or self.refused
        if generators:
            m.client = ClientVerdict.model_validate(verdict(generators, *self.client_limits))
        write_manifest(self.dir, self.manifest)
        # Lazily: the report needs pandas and pyarrow, which every Locust process (workers too) would
        # otherwise import at start-up and keep on its heap, only for the one process that finalizes.
        from loadlab.analysis.report import write_report

        summary = self.summary = write_report(self.dir)
        client = self.manifest.client
        if client is not None and client.client_bound:
            log.warning(
                "loadlab: CLIENT-BOUND: %s. The latencies include the load generator's own delay: add workers "
                "(loadlab run --workers N) or lower the load per process.",
                "; ".join(client.reasons),
            )
        state = "complete" if self.complete else "PARTIAL (stopped before every request finished)"
        ok = self.outcomes.get(OK, 0)
        lost = f", {len(self.lost)} lost in flight" if self.lost else ""
        print(
            f"loadlab: run {state}: {ok} ok / {self.writer.count + recovered} requests{lost}; "
            f"report {self.dir / 'summary.md'}",
            file=sys.stderr,
            flush=True,
        )
        return summary

    def _write_group(self, write):
        """Runs a row group's writing (``TableWriter``'s offload) in a native thread of gevent's pool, after
        the groups before it, in a greenlet of its own: recording a request never waits for it. Arrow's
        encoding releases the GIL; the Python part takes turns with the event loop."""
        previous = self._last_group

        def in_turn():
            if previous is not None:
                previous.join()
                if not previous.successful():  # a group missing from the file: the next would hide it
                    raise RuntimeError("an earlier row group of records.parquet failed")
            return gevent.get_hub().threadpool.apply(write)

        self._last_group = gevent.spawn(in_turn)
        return self._last_group

    def _close_table(self) -> None:
        """records.parquet and records.csv: the last row group written and the files named; if writing them
        along the way failed, converted from records.jsonl (the crash-safe copy) instead."""
        try:
            self.table.close()
        except Exception as e:  # a full disk, a bug: the JSONL has every record
            log.warning("loadlab: records.parquet could not be written as the run went (%s); converting "
                        "records.jsonl", e)  # fmt: skip
            self.table.discard()
            write_parquet(self.dir)

    def stop_calibration(self) -> dict[str, Any] | None:
        """Ends this process's self-calibration (once the last measured request has ended; idempotent)."""
        if self.monitor is not None and self.calibration is None:
            self.calibration = self.monitor.stop()
        return self.calibration

    def _merge_spills(self) -> int:
        """Records that only workers' spill files hold (a worker that died before shipping them, on this
        host) join the run; spill files whose records are all in the run are then removed."""
        added = merge_spills(self.dir, self.indices)
        for row in added:
            if self.lost.pop(row["index"], None) is not None:
                log.warning(
                    "loadlab: request %d, given up as lost, was recovered from a spill file", row["index"]
                )
            else:
                self.tickets.finished(row["phase"])
            self.table.add(row)
            self.outcomes[row["outcome"]] = self.outcomes.get(row["outcome"], 0) + 1
            if self.live is not None:  # so the live figures end equal to the report's
                self.live.add(RequestRecord(**{k: v for k, v in row.items() if k in RECORD_FIELDS}))
        spill = self.dir / SPILL_DIR
        if spill.is_dir():
            for path in spill.glob("*.jsonl"):
                if self.indices.issuperset(row["index"] for row in read_jsonl_records(path)):
                    path.unlink()
            with contextlib.suppress(OSError):
                spill.rmdir()
        return len(added)
