"""The typed messages between the front end and the engine core, in both directions.

The core never sees text: a request crosses as token ids and sampling parameters; an output
carries only the tokens the front end has not seen yet, their timestamps (``time.monotonic``,
one clock for every process) and how the request stands. The same ``msgspec`` Structs go through
a queue (thread mode) or as msgpack over ZeroMQ (process mode): a rename is one edit.

    front end -> core:  AddRequest | AbortRequests | Shutdown (| ClientGone, from the supervisor)
                        | UtilityCall (a call between steps: ``collective_rpc``, ``utilities.py``)
    core -> front end:  EngineCoreOutputs (per step), after EngineCoreReady | EngineCoreStartupError;
                        UtilityOutput
    data parallelism:   ClientHello -> ClientWelcome; EngineStats -> coordinator -> EngineStatsUpdate

vLLM: ``vllm/v1/engine/__init__.py`` (``EngineCoreRequest``, ``EngineCoreOutput(s)``, ``UtilityOutput``) and
``vllm/v1/serial_utils.py`` (``MsgpackEncoder`` / ``MsgpackDecoder``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from shared.output_processor import OutputDelta
from shared.sampling_params import SamplingParams
from stage5_server.core.request import Request
from stage5_server.core.stats import SchedulerStats
from stage5_server.lora.request import LoRARequest
from stage5_server.multimodal.inputs import MultiModalFeature

# ---- front end -> engine core --------------------------------------------------------------------


class EngineCoreRequest(msgspec.Struct, kw_only=True):
    """What the core needs of a request: token ids, never text."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    bad_words_token_ids: list[list[int]] = []  # the front end tokenizes ``sampling_params.bad_words``
    mm_features: list[MultiModalFeature] = []  # the prompt's images, prepared by the front end
    lora_request: LoRARequest | None = None  # the adapter it runs under (lora/)
    kv_transfer_params: dict[str, str] | None = None  # its blocks' transfer between instances (kv_transfer/)

    def to_request(self) -> Request:
        return Request(self.request_id, self.prompt_token_ids, self.sampling_params, arrival_time=self.arrival_time,
                       priority=self.priority, cache_salt=self.cache_salt, eos_token_ids=self.eos_token_ids,
                       bad_words_token_ids=self.bad_words_token_ids, mm_features=self.mm_features,
                       lora_request=self.lora_request, kv_transfer_params=self.kv_transfer_params)


class AddRequest(msgspec.Struct, tag="add"):
    request: EngineCoreRequest
    client_id: str | None = None  # the API server to send its outputs to (None: the only one)


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class UtilityCall(msgspec.Struct, tag="utility"):
    """Run one of the core's utilities between two steps (``utilities.py``): ``collective_rpc``, or one a system
    registered (weight updates and sleep, ``weight_sync/``). ``payload``: the pickled ``(args, kwargs)`` (tensors,
    a function); only an API server sends it."""

    call_id: int
    method: str
    payload: bytes
    client_id: str | None = None


class ClientGone(msgspec.Struct, tag="client_gone"):
    """An API server died (its supervisor saw it): abort its requests and give their KV back."""

    client_id: str


EngineCoreInput = AddRequest | AbortRequests | Shutdown | ClientGone | UtilityCall


class ClientHello(msgspec.Struct, tag="hello"):
    """An API server's first message to a core: from then on the core can route outputs to ``client_id``."""

    client_id: str


# ---- engine core -> front end --------------------------------------------------------------------


@dataclass
class EngineCoreOutput(OutputDelta):
    """One request after a step: its new tokens and how it stands now (stage 4's ``OutputDelta``), and a
    pooling request's vector with its final output. The scheduler makes them (``update_from_output``);
    the front end's ``OutputProcessor`` takes them as they come off the wire."""

    pooled: list[float] | None = None

    @classmethod
    def from_request(cls, request: Request, num_sent: int) -> EngineCoreOutput:
        delta = OutputDelta.from_request(request, num_sent)
        return cls(**vars(delta), pooled=request.pooled_output)


class UtilityOutput(msgspec.Struct, tag="utility_output"):
    """A ``UtilityCall``'s answer: the pickled result, or the error (``error_type``: its class's name)."""

    call_id: int
    result: bytes = b""
    error: str | None = None
    error_type: str = ""
    engine_index: int = 0


class FailedRequests(msgspec.Struct):
    """Requests the core could not run: a failed step (HTTP 500), or ``engine_dead`` (HTTP 503)."""

    request_ids: list[str]
    error: str
    engine_dead: bool = False


class EngineCoreOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats
    failed: FailedRequests | None = None
    engine_index: int = 0  # the data-parallel rank that sent it
    stats_seq: int = 0  # counts the rank's published stats: the larger, the newer


class ClientWelcome(msgspec.Struct, tag="welcome"):
    """An engine core's answer to ``ClientHello``: its rank, and its stats as of now."""

    engine_index: int
    scheduler_stats: SchedulerStats
    stats_seq: int


class EngineStats(msgspec.Struct, array_like=True):
    """One rank's load, engine core -> coordinator, and inside ``EngineStatsUpdate``."""

    engine_index: int
    stats_seq: int
    scheduler_stats: SchedulerStats


class EngineStatsUpdate(msgspec.Struct, tag="stats_update"):
    """Coordinator -> every API server: the newest stats of every rank that has reported."""

    engines: list[EngineStats]


class EngineCoreReady(msgspec.Struct, tag="ready"):
    """The engine-core process is up; the configuration it resolved."""

    pid: int
    model_path: str
    stage: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    tokenizer: str
    engine_args: dict[str, Any]
    cache_config: dict[str, str]  # the resolved KV-cache configuration (``stats.cache_config_info``)
    engine_index: int = 0


class EngineCoreStartupError(msgspec.Struct, tag="startup_error"):
    error_type: str
    message: str
    traceback: str
    engine_index: int = 0


EngineCoreMessage = EngineCoreOutputs | EngineCoreReady | EngineCoreStartupError | ClientWelcome | UtilityOutput

# ---- bytes on the wire (the engine-core process) ---------------------------------------------------

encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(EngineCoreInput)
output_decoder = msgspec.msgpack.Decoder(EngineCoreMessage)
hello_decoder = msgspec.msgpack.Decoder(ClientHello)
stats_decoder = msgspec.msgpack.Decoder(EngineStats)
stats_update_decoder = msgspec.msgpack.Decoder(EngineStatsUpdate)


def plain(value: Any) -> Any:
    """An engine argument as a value every reader can print (a dtype becomes its name)."""
    return value if isinstance(value, (bool, int, float, str, type(None))) else str(value)


def open_socket(context: Any, kind: int, *, bind: str | None = None, connect: str | None = None,
                **options: int | bytes) -> Any:
    """A ZeroMQ socket of ``kind`` with ``options`` set (``LINGER=0``, ...), bound or connected."""
    import zmq  # only the processes that talk over sockets need pyzmq

    sock = context.socket(kind)
    for name, value in options.items():
        sock.setsockopt(getattr(zmq, name), value)
    if bind is not None:
        sock.bind(bind)
    if connect is not None:
        sock.connect(connect)
    return sock


def drain(sock: Any, decoder: Any) -> list[Any]:
    """Every message already queued on ``sock``, decoded, without waiting for more: every reader of a
    socket here (engine core, API server, coordinator) takes what is there at once."""
    import zmq

    messages = []
    while True:
        try:
            messages.append(decoder.decode(sock.recv(zmq.NOBLOCK)))
        except zmq.Again:
            return messages
