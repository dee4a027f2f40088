"""The protocol between loadlab's Locust master and its workers: every message's name and typed payload.

The master owns the run: the run directory, the one ``Tickets`` dispenser and the records. Workers run the
users. Messages (Locust's custom messages over its ZMQ connection, ordered per worker):

    master -> worker   loadlab_run      RunInfo: the run: id, resolved profile, target URL, model, manifest
    worker -> master   loadlab_want     WantTickets: the worker's stock is low: up to n more tickets
    master -> worker   loadlab_tickets  TicketBlock: a block of tickets for that ask (or none: every ticket is
                                        out and none can come back, or the run is draining)
    worker -> master   loadlab_return   ReturnTickets: tickets of the worker's stock it will never start
    worker -> master   loadlab_records  RecordBatch: records, and the tickets handed to users since the last
                                        batch, with the worker's next sequence number
    master -> worker   loadlab_drain    Drain: stop users, return the stock, send every record, then answer
    worker -> master   loadlab_drained  Drained: the last sequence number sent
    worker <-> master  loadlab_ping / loadlab_pong / loadlab_clock   Ping, Pong, ClockReport: clock offset
                                                                      estimate at connect
    worker -> master   loadlab_failed   Failed: the worker cannot run (e.g. cannot reach the target)

Tickets are leased in blocks: a worker keeps a small stock (its users take from it without a round trip)
and asks for more, one ask at a time, before it runs out (``loadlab.swarm.worker.RemoteTickets``). The master
knows, per worker, which leased tickets are still unstarted: a worker reports every ticket it hands to a
user in its next RecordBatch, and the user sends nothing before that batch is on the wire. When a worker
goes missing its started tickets without a record are lost in flight; its unstarted ones go back to the
master and are leased again to the others once the block's lease has expired (``TicketBlock.valid_until``:
a worker never starts a ticket after it, so one that only stalled cannot start them too). In open loop a
ticket is handed over at most LEASE_AHEAD_S (``loadlab.swarm.master``) before it is due, so a worker's stock
is only tickets due within that window. Every record is also written to the worker's spill file as it
completes; the master merges spill files it can reach when it finalizes, and ``loadlab report`` merges them
into a run directory whose master died.

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

# A block's lease (TicketBlock.valid_until) as each side reads it, apart by this much for the clocks' offset
# estimate: a worker starts no ticket later than valid_until - LEASE_GUARD_S (its clock moved by the offset),
# and the master leases a missing worker's unstarted tickets again no earlier than valid_until + LEASE_GUARD_S.
LEASE_GUARD_S = 0.5


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
class WantTickets(Message):
    """worker -> master: the worker's stock of tickets is low (or empty with users waiting): lease up to
    ``n`` more. A worker has at most one ask outstanding; the master answers each with one TicketBlock."""

    NAME = "loadlab_want"
    id: int  # the worker's ask id, answered by the TicketBlock with the same id
    n: int  # how many tickets the worker can use (its waiting users plus a refill of its stock)


@dataclass(frozen=True, slots=True)
class TicketBlock(Message):
    """master -> worker: the tickets leased for a WantTickets: between 1 and ``n`` of them, in index order
    and of one phase; or none with ``done`` (no ticket is left and none can come back, or the run is
    draining). The master holds an ask it cannot serve yet (the warm-up barrier; in open loop, the next
    ticket not due within LEASE_AHEAD_S; tickets that another worker may still return)."""

    NAME = "loadlab_tickets"
    id: int  # the WantTickets' ask id
    tickets: list[list[Any]]  # [index, phase, due, turns] per ticket; due: open loop, epoch s on the master's
    # clock (closed loop: None); turns: the indices leased, index, index + 1, ... (a conversation's session)
    valid_until: float  # epoch s on the master's clock: the worker starts none of these after it (it returns
    # what is left), so the master may lease a missing worker's unstarted tickets again once it has passed
    done: bool = False  # no ticket now and none to come: the worker's users stop once their stock is used

    @classmethod
    def of(cls, ask_id: int, tickets: list[Ticket], valid_until: float, done: bool = False) -> TicketBlock:
        return cls(ask_id, [list(t) for t in tickets], valid_until, done)

    def decoded(self, clock_offset_s: float) -> list[Ticket]:
        """The tickets, their due times moved to the worker's clock (offset: the master's minus the
        worker's)."""
        return [
            Ticket(index, phase, None if due is None else due - clock_offset_s, turns)
            for index, phase, due, turns in self.tickets
        ]


@dataclass(frozen=True, slots=True)
class ReturnTickets(Message):
    """worker -> master: tickets of the worker's stock that it will never start (the run is draining, its
    users were stopped, or the block's lease expired first): the master leases them again."""

    NAME = "loadlab_return"
    indices: list[int]  # each returned ticket's first index


# -- records ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RecordBatch(Message):
    """worker -> master: records that completed (each already in the worker's spill file)."""

    NAME = "loadlab_records"
    seq: int  # the worker's batch sequence number, 0, 1, 2...: the master logs and counts gaps
    records: bytes  # the RequestRecords, one orjson-encoded list (orjson serialises dataclasses natively)
    # The first index of every ticket handed to a user since the previous batch (a batch may carry only
    # these): the user sends nothing before this batch is handed to the wire, so the master knows which of
    # a worker's tickets may have reached the server and which it can lease again if the worker dies.
    started: list[int] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, seq: int, records: list[RequestRecord], started: list[int] | None = None) -> RecordBatch:
        return cls(seq, orjson.dumps(records), started or [])

    def decoded(self) -> Iterator[RequestRecord]:
        for row in orjson.loads(self.records):
            yield RequestRecord(**row)


@dataclass(frozen=True, slots=True)
class Drain(Message):
    """master -> every worker: the run is over: stop the users, return the unused stock (ReturnTickets),
    send every record, answer with Drained."""

    NAME = "loadlab_drain"


@dataclass(frozen=True, slots=True)
class Drained(Message):
    """worker -> master: every record of the run has been sent."""

    NAME = "loadlab_drained"
    last_seq: int  # the sequence number of the last RecordBatch sent; -1: none (the worker had no run)
    calibration: dict[str, Any] | None = None  # the worker's ClientMonitor summary; None without a run
    takes: int = (
        0  # measured tickets its users took (those a user began waiting for before the barrier opened
    )
    # excepted: that wait is the barrier's, not the master's)
    ticket_wait_s: float = 0.0  # the time those users spent waiting for them, in all (for the stock to be
    # refilled when it was empty, then for the batch reporting the start to be on the wire)
    empty_takes: int = 0  # of those takes, the ones that found the stock empty
    asks: int = 0  # the WantTickets it sent, the whole run


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
