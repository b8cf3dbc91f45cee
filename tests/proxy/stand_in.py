"""A stand-in engine for ``tokentrace proxy``'s tests: no real engine runs here.

It replays RECORDED PAYLOADS of the shapes the engines document (../shared/notes/other-engines.md
and each engine's API reference), with real delays between the chunks:

- ``llama-server`` (llama.cpp): OpenAI-compatible SSE (``/v1/chat/completions``,
  ``/v1/completions``) whose final event carries ``timings`` {prompt_n, prompt_ms, predicted_n,
  predicted_ms, cache_n}, then ``data: [DONE]``; its own ``/completion`` as one JSON body with
  ``timings``.
- ``tgi`` (text-generation-inference): ``/generate`` as one JSON body with the response headers
  ``x-validation-time``, ``x-queue-time``, ``x-inference-time``, ``x-time-per-token`` (ms),
  ``x-prompt-tokens``, ``x-generated-tokens``; ``/generate_stream`` as SSE events
  ``{"token": {...}, "generated_text": ..., "details": ...}`` (no timing headers, as TGI).
- ``ollama``: ``/api/chat`` and ``/api/generate`` as NDJSON (``application/x-ndjson``) whose
  final object (``"done": true``) carries ``total_duration``, ``load_duration``,
  ``prompt_eval_count``, ``prompt_eval_duration``, ``eval_count``, ``eval_duration`` (ns); with
  ``"stream": false`` one JSON body.
- ``openai``: any OpenAI-compatible server: SSE chunks and a final ``usage`` event, no timings.

The simulated request waits ``queue_s``, then ``load_s`` (Ollama's model load) and
``prefill_s`` before its first token, then ``gap_s`` between tokens; the report states exactly
those durations, so a test can check where the proxy put them. Streams use chunked transfer
encoding (as llama-server, TGI and Ollama do); single bodies a content-length.

Knobs: ``gate`` (a semaphore acquired before every chunk after the first: a test proves the
proxy forwards chunk k before the engine sends k+1), ``requests`` (each request's path, headers
and body as received), ``connections`` (accepted), ``broken_streams`` (streams whose client, the
proxy, went away).
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

_MS = 1_000_000


@dataclass(slots=True)
class ReceivedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class StandInEngine:
    engine: str = "llama-server"
    queue_s: float = 0.010
    load_s: float = 0.0
    prefill_s: float = 0.020
    gap_s: float = 0.005
    tokens: int = 8
    """Output tokens when the request names no max_tokens."""
    prompt_tokens: int = 12
    cached_tokens: int = 4
    gate: threading.Semaphore | None = None
    close_after_each: bool = False
    """Close the connection after each response without saying so (an idle keep-alive timeout)."""
    requests: list[ReceivedRequest] = field(default_factory=list)
    connections: int = 0
    broken_streams: int = 0
    _server: socketserver.ThreadingTCPServer | None = None
    _thread: threading.Thread | None = None

    # --- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> StandInEngine:
        engine = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                engine._serve_connection(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # --- HTTP -------------------------------------------------------------------------------
    def _serve_connection(self, sock: socket.socket) -> None:
        self.connections += 1
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                data = sock.recv(65536)
                if not data:
                    return
                buf += data
            head, buf = buf.split(b"\r\n\r\n", 1)
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            if "chunked" in headers.get("transfer-encoding", ""):
                body = b""
                while True:
                    while b"\r\n" not in buf:
                        buf += sock.recv(65536)
                    size_line, buf = buf.split(b"\r\n", 1)
                    size = int(size_line, 16)
                    while len(buf) < size + 2:
                        buf += sock.recv(65536)
                    body, buf = body + buf[:size], buf[size + 2 :]
                    if not size:
                        break
            else:
                length = int(headers.get("content-length", "0"))
                while len(buf) < length:
                    buf += sock.recv(65536)
                body, buf = buf[:length], buf[length:]
            self.requests.append(ReceivedRequest(method, target, headers, body))
            try:
                self._respond(sock, method, target.split("?")[0], body)
            except (BrokenPipeError, ConnectionResetError):
                self.broken_streams += 1
                return
            if headers.get("connection", "").lower() == "close" or self.close_after_each:
                return

    def _respond(self, sock: socket.socket, method: str, path: str, body: bytes) -> None:
        if method == "GET":
            payload = json.dumps({"status": "ok"}).encode()
            sock.sendall(_head(200, "application/json", len(payload)) + payload)
            return
        request = json.loads(body or b"{}")
        if "bad" in request:  # an engine's validation error (OpenAI's error shape)
            payload = json.dumps(
                {"error": {"code": 400, "message": "bad request", "type": "invalid_request_error"}}
            ).encode()
            sock.sendall(_head(400, "application/json", len(payload)) + payload)
            return
        max_tokens = int(
            request.get("max_tokens")
            or request.get("parameters", {}).get("max_new_tokens")
            or request.get("options", {}).get("num_predict")
            or self.tokens
        )
        default_stream = self.engine == "ollama" or path == "/generate_stream"
        stream = bool(request.get("stream", default_stream))
        start = time.monotonic_ns()
        time.sleep(self.queue_s)
        scheduled = time.monotonic_ns()
        time.sleep(self.load_s + self.prefill_s)
        texts = [f" tok{i}" for i in range(max_tokens)]
        if stream:
            self._stream(sock, path, texts, start, scheduled, request)
        else:
            time.sleep(self.gap_s * (max_tokens - 1))
            self._whole(sock, path, texts, start, scheduled, request)

    def _durations(self, start: int, scheduled: int, tokens: int) -> dict[str, float]:
        decode_s = self.gap_s * (tokens - 1)
        return {
            "queue_ms": self.queue_s * 1e3,
            "load_ms": self.load_s * 1e3,
            "prefill_ms": self.prefill_s * 1e3,
            "decode_ms": decode_s * 1e3,
            "total_ns": time.monotonic_ns() - start,
        }

    def _final(self, path: str, texts: list[str], start: int, scheduled: int) -> dict[str, Any]:
        """The engine's report, in its shape."""
        d = self._durations(start, scheduled, len(texts))
        if self.engine == "llama-server":
            return {
                "timings": {
                    "cache_n": self.cached_tokens,
                    "prompt_n": self.prompt_tokens - self.cached_tokens,
                    "prompt_ms": d["prefill_ms"],
                    "prompt_per_token_ms": d["prefill_ms"] / self.prompt_tokens,
                    "prompt_per_second": 1e3 * self.prompt_tokens / max(d["prefill_ms"], 1e-3),
                    "predicted_n": len(texts),
                    "predicted_ms": d["decode_ms"],
                    "predicted_per_token_ms": d["decode_ms"] / len(texts),
                    "predicted_per_second": 1e3 * len(texts) / max(d["decode_ms"], 1e-3),
                }
            }
        if self.engine == "ollama":
            return {
                "done": True,
                "done_reason": "length",
                "total_duration": d["total_ns"],
                "load_duration": int(d["load_ms"] * _MS),
                "prompt_eval_count": self.prompt_tokens,
                "prompt_eval_duration": int(d["prefill_ms"] * _MS),
                "eval_count": len(texts),
                "eval_duration": int(d["decode_ms"] * _MS),
            }
        return {}

    def _openai_chunk(self, path: str, text: str | None, finish: str | None) -> dict[str, Any]:
        chat = "chat" in path
        if chat:
            delta = {} if text is None else {"content": text}
            choice: dict[str, Any] = {"finish_reason": finish, "index": 0, "delta": delta}
        else:
            choice = {"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish}
        return {
            "choices": [choice],
            "created": 1764268800,
            "id": "chatcmpl-standin" if chat else "cmpl-standin",
            "model": "tiny-standin",
            "system_fingerprint": "b7100-standin",
            "object": "chat.completion.chunk" if chat else "text_completion",
        }

    def _usage(self, tokens: int) -> dict[str, Any]:
        return {
            "completion_tokens": tokens,
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": tokens + self.prompt_tokens,
        }

    def _stream(
        self,
        sock: socket.socket,
        path: str,
        texts: list[str],
        start: int,
        scheduled: int,
        request: dict[str, Any],
    ) -> None:
        ndjson = self.engine == "ollama"
        sock.sendall(
            b"HTTP/1.1 200 OK\r\n"
            + (b"Content-Type: application/x-ndjson\r\n" if ndjson else
               b"Content-Type: text/event-stream\r\nCache-Control: no-cache\r\n")
            + b"Transfer-Encoding: chunked\r\n\r\n"
        )  # fmt: skip

        def send(obj: dict[str, Any] | str) -> None:
            text = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
            event = (text + "\n").encode() if ndjson else f"data: {text}\n\n".encode()
            sock.sendall(b"%x\r\n%s\r\n" % (len(event), event))

        for index, text in enumerate(texts):
            if index:
                if self.gate is not None:
                    assert self.gate.acquire(timeout=10), "the test never released the gate"
                time.sleep(self.gap_s)
            if self.engine == "ollama":
                key = "message" if "chat" in path else "response"
                value: Any = {"role": "assistant", "content": text} if key == "message" else text
                send({"model": "tiny", "created_at": "2026-11-27T18:00:00Z", key: value,
                      "done": False})  # fmt: skip
            elif self.engine == "tgi" and path == "/generate_stream":
                last = index == len(texts) - 1  # TGI's last event carries text and details
                send({"index": index + 1, "token": {"id": 100 + index, "text": text,
                      "logprob": -0.5, "special": False},
                      "generated_text": "".join(texts) if last else None,
                      "details": {"finish_reason": "length", "generated_tokens": len(texts),
                                  "seed": None, "input_length": self.prompt_tokens}
                      if last else None})  # fmt: skip
            else:
                send(self._openai_chunk(path, text, None))
        final = self._final(path, texts, start, scheduled)
        if self.engine == "ollama":
            key = "message" if "chat" in path else "response"
            value = {"role": "assistant", "content": ""} if key == "message" else ""
            send({"model": "tiny", "created_at": "2026-11-27T18:00:01Z", key: value, **final})
        elif self.engine == "tgi" and path == "/generate_stream":
            pass  # sent with the last token
        else:
            last = self._openai_chunk(path, None, "length")
            if self.engine == "llama-server" or request.get("stream_options"):
                last["usage"] = self._usage(len(texts))
            send({**last, **final})
            send("[DONE]")
        sock.sendall(b"0\r\n\r\n")

    def _whole(
        self,
        sock: socket.socket,
        path: str,
        texts: list[str],
        start: int,
        scheduled: int,
        request: dict[str, Any],
    ) -> None:
        final = self._final(path, texts, start, scheduled)
        extra: list[tuple[str, str]] = []
        if self.engine == "ollama":
            body: dict[str, Any] = {"model": "tiny", "created_at": "2026-11-27T18:00:01Z"}
            if "chat" in path:
                body["message"] = {"role": "assistant", "content": "".join(texts)}
            else:
                body["response"] = "".join(texts)
            body.update(final)
        elif self.engine == "tgi":
            d = self._durations(start, scheduled, len(texts))
            inference_ms = d["prefill_ms"] + d["decode_ms"]
            body = {"generated_text": "".join(texts)}
            extra = [
                ("x-compute-type", "gpu+optimized"),
                ("x-compute-time", f"{(time.monotonic_ns() - start) / 1e9:.3f}"),
                ("x-compute-characters", "42"),
                ("x-total-time", str(round((time.monotonic_ns() - start) / _MS))),
                ("x-validation-time", "0"),
                ("x-queue-time", str(round(d["queue_ms"]))),
                ("x-inference-time", str(round(inference_ms))),
                ("x-time-per-token", str(round(inference_ms / len(texts)))),
                ("x-prompt-tokens", str(self.prompt_tokens)),
                ("x-generated-tokens", str(len(texts))),
            ]
        elif path == "/completion":  # llama-server's own
            body = {
                "content": "".join(texts),
                "id_slot": 0,
                "stop": True,
                "model": "tiny",
                "tokens_predicted": len(texts),
                "tokens_evaluated": self.prompt_tokens,
                "stop_type": "limit",
                "stopping_word": "",
                "tokens_cached": self.prompt_tokens + len(texts),
                **final,
            }
        else:
            message: dict[str, Any] = (
                {"message": {"role": "assistant", "content": "".join(texts)}}
                if "chat" in path
                else {"text": "".join(texts)}
            )
            body = {
                "choices": [{"index": 0, "finish_reason": "length", **message}],
                "id": "cmpl-standin",
                "model": "tiny-standin",
                "usage": self._usage(len(texts)),
                **final,
            }
        payload = json.dumps(body).encode()
        sock.sendall(_head(200, "application/json", len(payload), extra) + payload)


def _head(
    status: int, content_type: str, length: int, extra: list[tuple[str, str]] | None = None
) -> bytes:
    reason = "OK" if status == 200 else "Bad Request"
    lines = [
        f"HTTP/1.1 {status} {reason}",
        f"Content-Type: {content_type}",
        f"Content-Length: {length}",
    ]
    lines += [f"{name}: {value}" for name, value in extra or ()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()
