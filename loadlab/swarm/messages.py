"""The protocol between loadlab's Locust master and its workers: every message's name and typed payload.

The master owns the run: the run directory, the one ``Tickets`` dispenser and the records. Workers run the
users. Messages (Locust's custom messages over its ZMQ connection, ordered per worker):

    master -> worker   loadlab_run      RunInfo: the run: id, resolved profile, target URL, model, manifest
    worker -> master   loadlab_want     WantTicket: a user needs a ticket (request id)
    master -> worker   loadlab_ticket   TicketReply: (index, phase, due) for that request id, or none left
    worker -> master   loadlab_records  RecordBatch: a batch of records with the worker's next sequence number
    master -> worker   loadlab_drain    Drain: stop users, send every record, then answer loadlab_drained
    worker -> master   loadlab_drained  Drained: the last sequence number sent
    worker <-> master  loadlab_ping / loadlab_pong / loadlab_clock   Ping, Pong, ClockReport: clock offset
                                                                      estimate at connect
    worker -> master   loadlab_failed   Failed: the worker cannot run (e.g. cannot reach the target)

A ticket is leased to a worker only when one of its users is waiting for it, so the tickets a worker holds
are exactly its requests in flight (or one just handed over): when a worker goes missing, the master counts
those as lost in flight and the run goes on. In open loop a ticket is handed over LEASE_AHEAD_S
(``loadlab.swarm.master``) before it is due, not earlier, so a worker that dies loses its requests in flight
and at most that much of the arrivals still to come (its users would otherwise hold tickets due minutes
later). Every record is also written to the worker's spill file as it completes; the master merges spill
files it can reach when it finalizes, and ``loadlab report`` merges them into a run directory whose master
died.

The master's side is ``loadlab.swarm.master.Coordinator``, the worker's ``loadlab.swarm.worker.WorkerAgent``.
Each payload class names its message (``NAME``); ``send`` puts one on the wire and ``listen`` registers
handlers that get the sender's node id and the payload already parsed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import orjson

from loadlab.load import Ticket
from loadlab.records import RequestRecord


@dataclass(frozen=True, slots=True)
class Message:
    """A message's payload. Travels as a plain dict (Locust's msgpack): ``to_dict`` / ``from_dict``."""

    NAME: ClassVar[str]  # the Locust message type this payload travels as

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        return cls(**data)

    def send(self, runner, client_id: str | None = None) -> None:
        """Sends this message: from a worker to the master, or from the master to one worker (``client_id``)
        or to every worker (None)."""
        runner.send_message(self.NAME, self.to_dict(), client_id=client_id)


def listen(runner, handlers: dict[type[Message], Callable[[str, Any], None]]) -> None:
    """Registers ``handler(sender node id, payload)`` for each message class with Locust's runner."""
    for kind, handler in handlers.items():
        runner.register_message(kind.NAME, _parsing(kind, handler))


def _parsing(kind: type[Message], handler: Callable[[str, Any], None]):
    def listener(environment, msg, **_kw) -> None:
        handler(msg.node_id, kind.from_dict(msg.data))

    return listener


# -- the run ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RunInfo(Message):
    """master -> worker: a run starts (to every worker, or to one that joins while it runs)."""

    NAME = "loadlab_run"
    run_id: str  # the run directory's name, also under the worker's --out (its spill file)
    rid_prefix: str  # the SGLang rid prefix: request index i is sent as f"{rid_prefix}-{i}"
    profile: dict[str, Any]  # the resolved profile (Profile.model_dump(mode="json")), validated again
    profile_path: str  # where the master read the profile (for error messages)
    target_url: str  # the target the master probed: the worker's users send there
    model: str | None  # the model name the OpenAI APIs send
    manifest: dict[str, Any]  # the run's manifest, written beside a spill file on another host


@dataclass(frozen=True, slots=True)
class Failed(Message):
    """worker -> master: the worker cannot run (the master ends the run with exit status 3)."""

    NAME = "loadlab_failed"
    error: str  # why, one line (e.g. cannot reach the target)


# -- tickets ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WantTicket(Message):
    """worker -> master: one of the worker's users needs a ticket."""

    NAME = "loadlab_want"
    id: int  # the worker's request id, answered by a TicketReply with the same id


@dataclass(frozen=True, slots=True)
class TicketReply(Message):
    """master -> worker: the ticket leased for a WantTicket, or none (every ticket is out, or the run is
    draining)."""

    NAME = "loadlab_ticket"
    id: int  # the WantTicket's request id
    index: int | None  # the request index leased; None: no ticket
    phase: str | None  # WARMUP or MEASURE (loadlab.records); None with no ticket
    due: float | None  # open loop: when to send it, epoch s on the master's clock; closed loop: None
    turns: int = 1  # the indices leased: index, index + 1, ... (a conversation's session)

    @classmethod
    def of(cls, request_id: int, ticket: Ticket | None) -> TicketReply:
        if ticket is None:
            return cls(request_id, None, None, None)
        return cls(request_id, ticket.index, ticket.phase, ticket.due, ticket.turns)

    def ticket(self, clock_offset_s: float) -> Ticket | None:
        """The leased ticket, its due time moved to the worker's clock (offset: the master's minus the
        worker's), or None."""
        if self.index is None:
            return None
        due = None if self.due is None else self.due - clock_offset_s
        return Ticket(self.index, self.phase, due, self.turns)


# -- records ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RecordBatch(Message):
    """worker -> master: records that completed (each already in the worker's spill file)."""

    NAME = "loadlab_records"
    seq: int  # the worker's batch sequence number, 0, 1, 2...: the master logs and counts gaps
    records: bytes  # the RequestRecords, one orjson-encoded list (orjson serialises dataclasses natively)

    @classmethod
    def of(cls, seq: int, records: list[RequestRecord]) -> RecordBatch:
        return cls(seq, orjson.dumps(records))

    def decoded(self) -> Iterator[RequestRecord]:
        for row in orjson.loads(self.records):
            yield RequestRecord(**row)


@dataclass(frozen=True, slots=True)
class Drain(Message):
    """master -> every worker: the run is over: stop the users, send every record, answer with Drained."""

    NAME = "loadlab_drain"


@dataclass(frozen=True, slots=True)
class Drained(Message):
    """worker -> master: every record of the run has been sent."""

    NAME = "loadlab_drained"
    last_seq: int  # the sequence number of the last RecordBatch sent; -1: none (the worker had no run)
    calibration: dict[str, Any] | None = None  # the worker's ClientMonitor summary; None without a run


# -- clocks ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ping(Message):
    """worker -> master, a few times at connect: the master answers with Pong at once."""

    NAME = "loadlab_ping"
    t0: float  # the worker's time.time() when it sent the ping


@dataclass(frozen=True, slots=True)
class Pong(Message):
    """master -> worker: the answer to a Ping."""

    NAME = "loadlab_pong"
    t0: float  # the Ping's t0, handed back
    t_master: float  # the master's time.time() when it answered


@dataclass(frozen=True, slots=True)
class ClockReport(Message):
    """worker -> master: the worker's clock estimate (the master keeps it for the manifest's
    ``load_generators``)."""

    NAME = "loadlab_clock"
    clock_offset_s: float  # the master's clock minus the worker's, at the fastest round trip's midpoint
    rtt_s: float  # that round trip, in seconds
    host: str  # the worker's host name
    pid: int  # the worker's process id
