"""The Locust user: closed loop, exactly one streaming request in flight per user."""

from __future__ import annotations

import itertools

from gevent import GreenletExit
from locust import User, constant, task
from locust.exception import StopUser

from loadlab.client.request import new_exchange, send, to_record
from loadlab.client.stream import StreamingClient
from loadlab.records import OK, WARMUP

CONNECT_TIMEOUT_S = 10.0
_user_ids = itertools.count()


class SGLangUser(User):
    """Takes a request ticket, streams the request, records it, repeats; stops when tickets run out."""

    wait_time = constant(0)

    def on_start(self) -> None:
        self.run = self.environment.loadlab_run
        target = self.run.profile.target
        self.user_id = next(_user_ids)
        self.client = StreamingClient(
            self.environment.host, CONNECT_TIMEOUT_S, target.idle_timeout_s, target.timeout_s
        )

    def on_stop(self) -> None:
        self.client.close()

    @task
    def one_request(self) -> None:
        run = self.run
        ticket = run.tickets.take()
        if ticket is None:
            raise StopUser()
        index, phase = ticket
        spec = run.workload.spec(index)
        ex = new_exchange()
        try:
            send(self.client, run.api, spec, run.renderer, run.model, f"{run.run_id}-{index}", ex)
        except GreenletExit:
            # The run is stopping (-t ran out, or the user pressed stop): keep what was received.
            run.record(to_record(ex, run.api, spec, phase, run.worker_id, self.user_id, cancelled=True))
            raise
        rec = to_record(ex, run.api, spec, phase, run.worker_id, self.user_id)
        run.record(rec)
        self._feed_live_stats(rec)

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
