"""The Locust user: closed loop, exactly one streaming request in flight per user; a conversation's user
holds a whole session (its turns in order, each after the previous reply and the think time)."""

from __future__ import annotations

import itertools
import logging
import time

from gevent import GreenletExit, idle
from gevent import sleep as gevent_sleep
from gevent.lock import Semaphore
from locust import User, constant, task
from locust.exception import StopUser

from loadlab.client.request import new_exchange, send, to_record
from loadlab.client.stream import StreamingClient
from loadlab.profile import auth_headers
from loadlab.records import CANCELLED, CLIENT_ERROR, OK, WARMUP, RequestRecord
from loadlab.workload import Dialogue

CONNECT_TIMEOUT_S = 10.0
log = logging.getLogger("loadlab")
_user_ids = itertools.count()

# The CPU work around a request (making the next spec, decoding a finished stream, writing its record,
# live stats: ~0.4 ms at 24 tokens, more for long native streams) runs one greenlet at a time and only
# when the hub has no I/O pending, so lines that have arrived are timestamped first. Inline, users that
# finish together hold each other's last events back: up to 20-70 ms at 64 users.
_cpu_lane = Semaphore(1)


def off_the_clock(fn, *args):
    """Runs CPU work that belongs to no request (the live figures' refresh for the web UI and /metrics) in
    the same lane, once the hub is idle, as a request's bookkeeping does: lines that have arrived are
    timestamped first."""
    with _cpu_lane:
        idle()
        return fn(*args)


class SGLangUser(User):
    """Takes a request ticket, streams the request (or a session's turns, one after the other), records it,
    repeats; stops when tickets run out."""

    wait_time = constant(0)

    def on_start(self) -> None:
        self.run = self.environment.loadlab.run
        if self.run is None:  # the run could not start (the reason is logged): nothing to send
            raise StopUser()
        target = self.run.profile.target
        self.user_id = next(_user_ids)
        self.client = StreamingClient(
            self.environment.host,
            CONNECT_TIMEOUT_S,
            target.idle_timeout_s,
            target.timeout_s,
            headers=auth_headers(self.run.api_key),
            reader=target.reader,
            clock=target.receipt_clock,
        )

    def on_stop(self) -> None:
        client = getattr(self, "client", None)  # none if on_start stopped the user
        if client is not None:
            client.close()

    @task
    def one_ticket(self) -> None:
        run = self.run
        ticket = run.tickets.take()
        if ticket is None:
            raise StopUser()
        index, phase, due, turns = ticket
        if due is not None:  # open loop: send at the due time; a late send is client queueing, recorded
            wait = due - time.time()
            if wait > 0:
                try:
                    gevent_sleep(wait)
                except GreenletExit:  # stopped before its due time: every index still gets its one record
                    for rest in range(index, index + turns):
                        run.record(self._unsent_record(rest, phase, None))
                    raise
        dialogue = Dialogue(run.api, run.renderer) if run.profile.conversation else None
        for turn in range(turns):
            try:
                self.one_request(index + turn, phase, due if turn == 0 else None, dialogue)
            except GreenletExit:
                for rest in range(index + turn + 1, index + turns):  # the session's turns never sent
                    run.record(self._unsent_record(rest, phase, None))
                raise

    def one_request(self, index: int, phase: str, due: float | None, dialogue: Dialogue | None) -> None:
        """Request ``index``: a conversation's turn (``dialogue``: its session so far) waits its think time
        after the previous reply, and is sent with the session's history."""
        run = self.run
        spec = ex = rec = None
        try:
            with _cpu_lane:
                idle()
                spec = run.workload.spec(index)
            if spec.think_time_s > 0:
                gevent_sleep(spec.think_time_s)
            prompt = None
            if dialogue is not None:
                with _cpu_lane:
                    idle()
                    prompt = dialogue.prompt(spec)
            run.tickets.before_send(index)
            ex = new_exchange()
            try:
                send(self.client, run.api, spec, run.renderer, run.model, f"{run.rid_prefix}-{index}", ex,
                     prompt)  # fmt: skip
            except GreenletExit:
                # The run is stopping (-t ran out, Ctrl-C, Stop in the UI): keep what was received.
                rec = self._to_record(ex, spec, phase, cancelled=True)
                raise
            with _cpu_lane:
                idle()
                rec = self._to_record(ex, spec, phase, dialogue=dialogue)
                rec.t_scheduled_wall = due
                self._feed_live_stats(rec)
        except GreenletExit:
            if ex is not None and rec is None:  # the stream had ended; only its bookkeeping was pending
                rec = self._to_record(ex, spec, phase)
            raise
        except Exception as e:  # a loadlab bug must cost one request, visibly, never the run
            log.exception("loadlab: request %d failed inside loadlab", index)
            rec = rec or self._error_record(index, phase, spec, ex, e)
        finally:
            # Every ticket ends with exactly one record, so the run cannot hang and a master can account for
            # every index it handed out.
            run.record(rec if rec is not None else self._unsent_record(index, phase, spec))

    def _to_record(self, ex, spec, phase: str, cancelled: bool = False, dialogue: Dialogue | None = None):
        run = self.run
        try:
            return to_record(ex, run.api, spec, phase, run.worker_id, self.user_id, cancelled=cancelled,
                             dialogue=dialogue, tokenizer=run.renderer.tokenizer)  # fmt: skip
        except Exception as e:
            log.exception("loadlab: could not decode the reply to request %d", spec.index)
            return self._error_record(spec.index, phase, spec, ex, e)

    def _error_record(self, index: int, phase: str, spec, ex, error: Exception):
        run = self.run
        return RequestRecord(
            index=index, phase=phase, api=run.api, worker_id=run.worker_id, user_id=self.user_id,
            t_send_wall=ex.t_send_wall if ex is not None else time.time(),
            input_len=spec.input_len if spec is not None else 0,
            max_new_tokens=spec.max_new_tokens if spec is not None else 0,
            outcome=CLIENT_ERROR, error=f"loadlab failed on this request: {error!r}",
            served_by=ex.served_by if ex is not None else None,
            status_source=ex.status_source if ex is not None else None,
            session=spec.session if spec is not None else None, turn=spec.turn if spec is not None else None,
        )  # fmt: skip

    def _unsent_record(self, index: int, phase: str, spec) -> RequestRecord:
        run = self.run
        return RequestRecord(
            index=index, phase=phase, api=run.api, worker_id=run.worker_id, user_id=self.user_id,
            t_send_wall=time.time(), input_len=spec.input_len if spec is not None else 0,
            max_new_tokens=spec.max_new_tokens if spec is not None else 0,
            outcome=CANCELLED, error="the run stopped before the request was sent",
            session=spec.session if spec is not None else None, turn=spec.turn if spec is not None else None,
        )  # fmt: skip

    def _feed_live_stats(self, rec) -> None:
        """Locust's statistics are a live view only; reports come from the records."""
        fire = self.environment.events.request.fire
        kind = "warm-up" if rec.phase == WARMUP else rec.api
        if rec.outcome != OK:
            fire(
                request_type=kind,
                name="E2E",
                response_time=rec.e2e_ms or 0.0,
                response_length=0,
                exception=RequestFailed(f"{rec.outcome}: {rec.error}"),
                context={},
            )
            return
        fire(
            request_type=kind,
            name="TTFT",
            response_time=rec.ttft_ms,
            response_length=0,
            exception=None,
            context={},
        )
        if rec.output_tokens and rec.output_tokens > 1:
            tpot = (rec.e2e_ms - rec.ttft_ms) / (rec.output_tokens - 1)
            fire(
                request_type=kind,
                name="TPOT",
                response_time=tpot,
                response_length=0,
                exception=None,
                context={},
            )
        fire(
            request_type=kind,
            name="E2E",
            response_time=rec.e2e_ms,
            response_length=rec.output_tokens or 0,
            exception=None,
            context={},
        )


class RequestFailed(Exception):
    """Shown in Locust's failures table."""
