"""``FrmpsAsyncMPClient``: vLLM's asyncio engine-core client, re-pointable.

vLLM's API server talks to its EngineCore through ``AsyncMPClient``: requests go
out on a ROUTER socket to the engine's identity, outputs come in on a PULL socket
(``v1/engine/core_client.py``; ``OPENAI.md`` cites the lines per version). This
subclass keeps vLLM's code path and adds what a failover needs:

- every request passes through the ``ResumeLedger`` on its way out (ring key,
  engine id, seed) and every output on its way in (tokens received, ids renamed
  back), so the frontend's resume point of each request is known exactly;
- ``engine_lost()`` makes the client hold what it would send (a ROUTER drops
  messages for an identity with no peer), and ``wait_engine_back()`` waits for
  the promoted engine's ready message under the same identity, then sends what
  was held, in order;
- the ROUTER hands an identity over to a new peer (``ZMQ_ROUTER_HANDOVER``,
  which vLLM sets only for elastic EP), so the standby can take the dead
  engine's place even before the old connection is seen closed.

It needs engines managed outside the API server (``client_addresses``): frmps's
supervisor launches them. The resume set (``resume_entries``) is read by the
supervisor; the standby adopts it and then connects. Thin on purpose: the logic
is in ``ledger``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import zmq
from vllm.v1.engine.core_client import AsyncMPClient
from zmq.utils.monitor import parse_monitor_message

from . import HANDOVER_FENCE_CALL_ID
from .ledger import Entry, ResumeLedger


class EngineReplaced(RuntimeError):
    """A utility call was in flight on an engine that died."""


class Connections:
    """A socket's open connections, by fd, from its monitor's ACCEPTED (or
    CONNECTED) and DISCONNECTED events. By fd, not by count: a connection that
    closes late (the engine that handed over, or a wedged one) leaves the new
    engine's open, whether or not its opening was seen.

    libzmq does not always report a connection's opening first. Its listener hands
    the new connection to an I/O thread and only then reports ACCEPTED; with more
    than one I/O thread (vLLM's client has two) a connection that closes at once,
    or while the listener's thread waits for a CPU, can be reported DISCONNECTED
    before ACCEPTED. Such an ACCEPTED is the closed connection's own, not a new
    one's: the fd stays taken until its DISCONNECTED is reported, and the listener
    reports the ACCEPTEDs in the order it accepted, so one closed connection's late
    ACCEPTED comes before a later connection on the same fd is reported. A
    DISCONNECTED of an fd not seen open is therefore kept until the ACCEPTED it
    pairs with. One accepted before the monitor started is only seen closing and
    its ACCEPTED never comes: a later connection on the same fd is then taken for
    it (seen neither open nor closing; its own DISCONNECTED is again kept), which
    can only end a drain early if another connection closes while that one is the
    engine's."""

    def __init__(self) -> None:
        self.open: set[int] = set()
        self._closed_unseen: set[int] = set()  # DISCONNECTED before (or without) its ACCEPTED

    def opened(self, fd: int) -> None:
        if fd in self._closed_unseen:
            self._closed_unseen.discard(fd)  # the closed connection's late ACCEPTED
        else:
            self.open.add(fd)

    def closed(self, fd: int) -> None:
        if fd in self.open:
            self.open.discard(fd)
        else:
            self._closed_unseen.add(fd)


class FrmpsAsyncMPClient(AsyncMPClient):
    # Done when the connected engine's handover fence arrived (HANDOVER_FENCE_CALL_ID):
    # registered among vLLM's utility results, which must know every call id that
    # comes back (an unknown one is fatal to the client), re-armed for each engine.
    # A class default: vLLM's __init__ starts the output task, which arms it.
    _fence: asyncio.Future | None = None

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.resources.engine_manager is not None:
            self.shutdown()
            raise ValueError("FrmpsAsyncMPClient needs engines managed by frmps (client_addresses), "
                             "not engines launched by vLLM's client")
        self.ledger = ResumeLedger()
        self.input_socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # Messages held while no engine is connected: (args to _send_input_message, ledger entry or None).
        self._held: list[tuple[tuple, Entry | None]] | None = None
        self._admitting: Entry | None = None
        # EngineCoreOutputs with request outputs the ledger has recorded (drain_outputs).
        self.outputs_seen = 0
        self._arm_fence()
        # The output socket's connections, from its monitor's events, and whether one
        # closed since the last engine connected with none left open.
        self._conns = Connections()
        self._closed_since_connect = False
        self._monitor = self._monitor_outputs()

    def _monitor_outputs(self) -> zmq.Socket | None:
        """A monitor of the output socket's connections: a dead engine's connection
        is seen closed once the socket's I/O thread has read everything it sent, so
        the drain after a failover can end then instead of after a quiet period.
        The PAIR end is a socket of vLLM's own context (vLLM's context is destroyed
        with its sockets; one of another context left open would hang its term).
        None (the quiet period only) where the socket cannot be monitored."""
        sock = self.resources.output_socket
        try:
            addr = f"inproc://frmps-output-monitor-{id(self):x}"
            sock.monitor(addr, zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            mon = self.resources.ctx.socket(zmq.PAIR)
            mon.setsockopt(zmq.LINGER, 0)
            mon.connect(addr)
            return mon
        except (zmq.ZMQError, AttributeError):
            return None

    def _read_monitor(self) -> bool:
        """Applies the connections opened and closed since the last call; True once
        a connection closed since the last engine connected and none is open."""
        if self._monitor is None:
            return False
        closed = False
        while True:
            try:
                m = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            if m["event"] in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
                self._conns.opened(m["value"])
            elif m["event"] == zmq.EVENT_DISCONNECTED:
                self._conns.closed(m["value"])
                closed = True
        self._closed_since_connect = (self._closed_since_connect or closed) and not self._conns.open
        return self._closed_since_connect

    def shutdown(self, *args: Any, **kwargs: Any) -> None:
        mon, self._monitor = getattr(self, "_monitor", None), None
        if mon is not None:
            sock = self.resources.output_socket
            if sock is not None and not sock.closed:
                try:
                    sock.disable_monitor()
                except zmq.ZMQError:
                    pass
            mon.close(0)
        super().shutdown(*args, **kwargs)

    def _arm_fence(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # built outside a loop: armed when the output task starts
            return
        if self._fence is None or self._fence.done():
            self._fence = loop.create_future()
            self.utility_results[HANDOVER_FENCE_CALL_ID] = self._fence

    # ------------------------------------------------------------ requests out

    def _ensure_output_queue_task(self) -> None:
        # Before vLLM's output task can see any output (a fence included): armed here
        # when the client was built outside an event loop.
        if self._fence is None:
            self._arm_fence()
        super()._ensure_output_queue_task()

    async def add_request_async(self, request: Any) -> None:
        entry = self.ledger.admit(request)
        entry.held = self._held is not None
        self._admitting = entry
        try:
            await super().add_request_async(request)
        finally:
            self._admitting = None

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        await super().abort_requests_async(self.ledger.abort(request_ids))

    def _send_input_message(self, message: Any, engine: Any, *rest: Any):
        # 0.33: (message, engine); 0.26: (message, engine, objects).
        if self._held is not None:
            self._held.append(((message, engine, *rest), self._admitting))
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        return super()._send_input_message(message, engine, *rest)

    # ------------------------------------------------------------ outputs in

    async def process_engine_outputs(self, outputs: Any) -> None:
        # Called by vLLM's output task for every EngineCoreOutputs before it is
        # queued for the output processor (core_client.py, process_outputs_socket).
        if outputs.outputs:
            self.ledger.record(outputs.outputs)
            self.outputs_seen += 1

    # ------------------------------------------------------------ failover

    def engine_lost(self) -> None:
        """The engine died: hold what would be sent until the next one is
        connected, and fail utility calls that were waiting on the dead one."""
        if self._held is None:
            self._held = []
        for call_id, fut in list(self.utility_results.items()):
            if call_id == HANDOVER_FENCE_CALL_ID:
                continue  # kept: a handover's fence may still be on its way
            if not fut.done():
                fut.set_exception(EngineReplaced(f"engine died during utility call {call_id}"))
            self.utility_results.pop(call_id, None)

    async def drain_outputs(self, timeout: float, settle: float = 0.02) -> bool:
        """Consume what the dead engine had already pushed before the resume
        set is read (an output still queued on the PULL socket would otherwise
        be adopted as undelivered and emitted twice). Returns True once the
        output socket has nothing pending (pyzmq's ``get(EVENTS)``, which
        also re-arms the socket's asyncio reader) and vLLM's output task has
        recorded nothing new for ``settle`` seconds; False if outputs kept
        coming for ``timeout`` seconds (the engine is not silent). An engine that
        handed over sent its fence last: True as soon as the fence came through.
        A dead engine's connection seen closed by the socket's monitor (its I/O
        thread has read all the engine sent) ends the wait as soon as the socket
        is empty and the output task has recorded what it took, instead of after
        ``settle`` (a wedged engine keeps its connection: the quiet period then).
        Runs on the client's event loop."""
        self._ensure_output_queue_task()
        sock = self.resources.output_socket
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        seen, quiet_since, quiet_polls = self.outputs_seen, loop.time(), 0
        fence = self._fence  # armed: _ensure_output_queue_task above, on this loop
        while True:
            if fence.done() and not fence.cancelled() and fence.exception() is None:
                # The engine handed over: its fence came after everything it sent,
                # in order on the one connection, through the same output task.
                return True
            await asyncio.wait((fence,), timeout=0.002)  # the output task runs in between
            now = loop.time()
            gone = self._read_monitor()  # before the socket's state: what it read came first
            if sock.get(zmq.EVENTS) & zmq.POLLIN or self.outputs_seen != seen:
                seen, quiet_since, quiet_polls = self.outputs_seen, now, 0
            else:
                quiet_polls += 1
                # The dead engine's connection is closed (all it sent was read), the
                # socket holds nothing, and the output task, which has run since the
                # last message left the socket, recorded nothing new: nothing can come.
                if (gone and quiet_polls >= 2) or now - quiet_since >= settle:
                    return True
            if now >= deadline:
                return False

    def held_requests(self) -> int:
        """Requests admitted while no engine was connected (sent afresh later)."""
        return sum(1 for e in self.ledger.open_entries() if e.held)

    @property
    def engine_connected(self) -> bool:
        return self._held is None

    def resume_entries(self) -> list[Entry]:
        """What the promoted engine must adopt: every request sent to an engine
        and still open, with the tokens the frontend received. Requests held
        since the failover began are left out: they are sent afresh."""
        return [e for e in self.ledger.open_entries() if not e.held]

    async def wait_engine_back(self, timeout: float) -> None:
        """Wait for the promoted engine's ready message (its identity on the
        ROUTER), then send everything held. Raises TimeoutError."""
        if self._held is None:
            raise RuntimeError("wait_engine_back without engine_lost")

        async def ready() -> None:
            while True:
                identity, *_ = await self.input_socket.recv_multipart()
                if bytes(identity) == bytes(self.core_engine):
                    return

        await asyncio.wait_for(ready(), timeout)
        self._read_monitor()  # the events so far (the monitor's queue stays short)
        self._closed_since_connect = False
        self._arm_fence()  # for this engine's own handover, later
        held, self._held = self._held, None
        for args, entry in held:
            await super()._send_input_message(*args)
            if entry is not None:
                entry.held = False
