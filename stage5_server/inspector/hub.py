"""The API server's side: step records in from the engine cores, out to each page as that page may see them.

    engine core(s) --StepRecords (with the outputs)--> front end --take(rank, records)--> InspectorHub
        -> RecordBuffer (bounded, drop-oldest) -> each page's stream reads from its own position

``take`` runs on the thread that receives the cores' outputs; it appends and wakes the pages, nothing
more, so a slow page never holds up the engine (it misses the oldest records instead, and is told how
many). The hub also keeps a ``PoolView`` per rank, so a page that opens mid-run starts from the pool as
it is rather than from an empty one.

Who sees what: the server tells the hub which trust group sent each request and its prompt text
(``track``); the front end tells it each request's output when it finishes (``record_finished``, a stat
logger's call). A page of group G gets every record with the ids of G's requests kept and every other
request's id replaced by an alias (``~`` and eight hex digits of an HMAC of G and the id under a secret of
this hub): the same bars and blocks, the same alias for a request whenever G looks, nobody's id. Text
reaches a page only in ``request`` events, only for its own group's requests; the records themselves
never hold text. A request the hub was not told of (another API server's, say) is
anonymous to everyone.

vLLM: none (its API server exports counters to Prometheus, ``vllm/v1/metrics/loggers.py``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import secrets
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import msgspec

from stage5_server.inspector.buffer import RecordBuffer
from stage5_server.inspector.records import CACHED, FREE, RESERVED, USED, FreedBlocks, StepRecord, StepRecords

logger = logging.getLogger("stagedserve")

MAX_RECORDS_PER_EVENT = 256  # a page that fell behind catches up over several events
_CHILD_ID = re.compile(r"^\d+_(.+)$")  # an n > 1 request's child ``{i}_{parent}`` (shared/parallel_sampling.py)


def prompt_text(prompt: Any) -> str:
    """What the page shows as a request's prompt: the text, a chat's messages, or how many token ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "messages" in prompt:
        lines = []
        for message in prompt["messages"]:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                content = " ".join(part.get("text", f"[{part.get('type', 'part')}]") if isinstance(part, dict)
                                   else str(part) for part in content)
            lines.append(f"{message.get('role', '?') if isinstance(message, dict) else '?'}: {content or ''}")
        return "\n".join(lines)
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        prompt = prompt["prompt_token_ids"]
    return f"[{len(prompt)} token ids]" if isinstance(prompt, list) else "[prompt]"


class PoolView:
    """A pool as the records describe it: each block's state, its holders and the request it is drawn as.
    The page keeps the same view in JavaScript (``static/inspector.js``, ``PoolModel``)."""

    def __init__(self, num_blocks: int, block_size: int, budget: int | None):
        self.num_blocks, self.block_size, self.budget = num_blocks, block_size, budget
        self.state = bytearray(num_blocks)
        self.refs = [0] * num_blocks
        self.owner: list[str | None] = [None] * num_blocks
        self.running: list[str] = []
        self.waiting: list[str] = []
        self.num_waiting = 0

    def apply(self, record: StepRecord) -> None:
        """In the order the engine did it: blocks given back as the step was scheduled, the blocks it handed
        out, the blocks of the requests it finished."""
        self.release([f for f in record.freed if f.scheduling])
        for step in record.requests:
            for block in step.reserved:
                self.refs[block] += 1
                self.state[block], self.owner[block] = RESERVED, step.id
            for block in (*step.hit, *step.new):
                if self.state[block] == RESERVED and self.owner[block] == step.id:
                    self.state[block] = USED  # stage 1: a reserved cell written
                    continue
                self.refs[block] += 1
                if self.refs[block] == 1:
                    self.state[block], self.owner[block] = USED, step.id
        self.release([f for f in record.freed if not f.scheduling])
        self.running, self.waiting, self.num_waiting = record.running, record.waiting, record.num_waiting

    def release(self, freed: list[FreedBlocks]) -> None:
        for gone in freed:
            for block in gone.blocks:
                self.refs[block] = max(0, self.refs[block] - 1)
                if not self.refs[block]:
                    self.state[block], self.owner[block] = FREE, None
            for block in gone.cached:
                self.state[block], self.owner[block] = CACHED, gone.id

    def snapshot(self) -> list[tuple[int, str | None, int, int]]:
        """``(block, owner, state, holders)`` of every block that is not plain free."""
        return [(b, self.owner[b], self.state[b], self.refs[b]) for b in range(self.num_blocks) if self.state[b]]


@dataclass
class TrackedRequest:
    group: str
    prompt: str
    output: str | None = None
    finish: str | None = None


@dataclass(eq=False)
class Subscriber:
    """One page's stream: its trust group, where it is in the buffer, the aliases it knows others by."""

    group: str
    loop: asyncio.AbstractEventLoop
    seq: int
    event: asyncio.Event = field(default_factory=asyncio.Event)
    pending: bool = False
    texts: deque = field(default_factory=lambda: deque(maxlen=256))  # its own requests' text, to send


class InspectorHub:
    def __init__(self, capacity: int = 2048, max_tracked: int = 4096):
        self.buffer: RecordBuffer[StepRecord] = RecordBuffer(capacity)
        self.views: dict[int, PoolView] = {}
        self.tracked: OrderedDict[str, TrackedRequest] = OrderedDict()  # request id -> its group and text
        self.max_tracked = max_tracked
        self.subscribers: set[Subscriber] = set()
        self.engine_dropped = 0  # records the engine cores' own buffers dropped
        self._secret = secrets.token_bytes(32)  # the aliases' key: nobody can tell an alias's request
        self._lock = threading.Lock()

    # ---- in: the engine's records (the output thread) ------------------------------------------
    def take(self, rank: int, batch: StepRecords) -> None:
        try:
            with self._lock:
                self.engine_dropped += batch.dropped
                for record in batch.records:
                    record.rank = rank
                    view = self.views.get(rank)
                    if view is None or view.num_blocks != record.num_blocks:
                        view = self.views[rank] = PoolView(record.num_blocks, record.block_size, record.budget)
                    view.apply(record)
                    self.buffer.append(record)
                subscribers = list(self.subscribers)
            for subscriber in subscribers:
                self._wake(subscriber)
        except Exception:  # the inspector must never take the engine's outputs down with it
            logger.exception("the inspector could not take the engine's step records")

    # ---- in: who sent what (the server), and how it ended (the front end's stat-logger calls) -------
    def track(self, request_id: str, group: str, prompt: Any) -> None:
        """Request ``request_id`` was sent by ``group``; ``prompt``: what the engine is given (``prompt_text``)."""
        with self._lock:
            self.tracked[request_id] = TrackedRequest(group, prompt_text(prompt))
            while len(self.tracked) > self.max_tracked:
                self.tracked.popitem(last=False)
        self._tell(request_id)

    def record_finished(self, output: Any, params: Any = None) -> None:
        request_id = self.own_id(output.request_id)
        with self._lock:
            tracked = self.tracked.get(request_id)
            if tracked is None:
                return
            text = "".join(c.text for c in output.outputs)
            tracked.output = text if tracked.output is None or output.request_id == request_id \
                else tracked.output + "\n" + text
            tracked.finish = output.outputs[0].finish_reason if output.outputs else None
        self._tell(request_id)

    def record_aborted(self, reason: str) -> None:
        pass

    def own_id(self, request_id: str) -> str:
        """The id the server tracked: an ``n > 1`` child's parent's."""
        if request_id in self.tracked:
            return request_id
        match = _CHILD_ID.match(request_id)
        return match.group(1) if match else request_id

    def _tell(self, request_id: str) -> None:
        """Queue a request's text for the pages of its own group."""
        with self._lock:
            tracked = self.tracked.get(request_id)
            if tracked is None:
                return
            event = {"id": request_id, "prompt": tracked.prompt, "output": tracked.output, "finish": tracked.finish}
            mine = [s for s in self.subscribers if s.group == tracked.group]
            for subscriber in mine:
                subscriber.texts.append(event)
        for subscriber in mine:
            self._wake(subscriber)

    # ---- out: each page's stream ---------------------------------------------------------------
    def subscribe(self, group: str, loop: asyncio.AbstractEventLoop) -> Subscriber:
        with self._lock:
            subscriber = Subscriber(group, loop, self.buffer.next_seq)
            self.subscribers.add(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        with self._lock:
            self.subscribers.discard(subscriber)

    def hello(self, subscriber: Subscriber, since: int | None = None) -> dict[str, Any]:
        """The first event of a stream: each rank's pool as it is now, and the group's requests with their text;
        for a page that comes back (``since``: the position its last stream reached), the records it has not
        seen, for its timeline only (the pools already include them). The stream goes on from here."""
        with self._lock:
            missed = self.buffer.read(since)[0][-MAX_RECORDS_PER_EVENT:] if since is not None else []
            subscriber.seq = self.buffer.next_seq
            ranks = {rank: {"num_blocks": v.num_blocks, "block_size": v.block_size, "budget": v.budget,
                            "blocks": [[b, self._name(subscriber, o), s, r] for b, o, s, r in v.snapshot()],
                            "running": [self._name(subscriber, rid) for rid in v.running],
                            "waiting": [self._name(subscriber, rid) for rid in v.waiting],
                            "num_waiting": v.num_waiting}
                     for rank, v in sorted(self.views.items())}
            texts = [{"id": rid, "prompt": t.prompt, "output": t.output, "finish": t.finish}
                     for rid, t in self.tracked.items() if t.group == subscriber.group]
            records = [self.redact(subscriber, record) for record in missed]
        return {"group": subscriber.group, "ranks": ranks, "requests": texts[-64:], "records": records}

    def poll(self, subscriber: Subscriber) -> list[tuple[str, Any]]:
        """The events a page has not had yet: its records (redacted for its group) and its requests' text."""
        subscriber.pending = False
        subscriber.event.clear()
        records, next_seq, missed = self.buffer.read(subscriber.seq)
        if len(records) > MAX_RECORDS_PER_EVENT:
            records, next_seq = records[:MAX_RECORDS_PER_EVENT], subscriber.seq + missed + MAX_RECORDS_PER_EVENT
            self._wake(subscriber)
        subscriber.seq = next_seq
        events: list[tuple[str, Any]] = []
        if records or missed:
            with self._lock:
                redacted = [self.redact(subscriber, record) for record in records]
            events.append(("steps", {"records": redacted, "dropped": missed, "engine_dropped": self.engine_dropped}))
        while subscriber.texts:
            events.append(("request", subscriber.texts.popleft()))
        return events

    def redact(self, subscriber: Subscriber, record: StepRecord) -> dict[str, Any]:
        """``record`` as ``subscriber`` may see it: other groups' request ids replaced by its aliases."""
        data = msgspec.to_builtins(record)
        name = self._name
        for entry in data.get("requests", ()):
            entry["id"] = name(subscriber, entry["id"])
        for entry in data.get("freed", ()):
            entry["id"] = name(subscriber, entry["id"])
        for key in ("preempted", "running", "waiting"):
            if key in data:
                data[key] = [name(subscriber, rid) for rid in data[key]]
        return data

    def _name(self, subscriber: Subscriber, request_id: str | None) -> str | None:
        """A request id as ``subscriber`` sees it (caller holds the lock)."""
        if request_id is None:
            return None
        tracked = self.tracked.get(self.own_id(request_id))
        if tracked is not None and tracked.group == subscriber.group:
            return request_id
        message = subscriber.group.encode() + b"\0" + request_id.encode()
        return "~" + hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:8]

    def _wake(self, subscriber: Subscriber) -> None:
        if subscriber.pending:
            return
        subscriber.pending = True
        try:
            subscriber.loop.call_soon_threadsafe(subscriber.event.set)
        except RuntimeError:  # its event loop is closed
            self.unsubscribe(subscriber)
