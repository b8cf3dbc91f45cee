"""Stand-ins for the parts of llama-cpp-python 0.3.36 its instrumentation patches, shaped like the
real code (``llama_cpp/server/app.py``'s ``get_llama_proxy`` and event publisher,
``llama_cpp/llama.py``'s ``Llama.generate`` / ``eval`` / ``_create_completion``,
``llama_cpp/_internals.py``'s ``LlamaContext.decode``, ``llama_cpp/server/model.py``'s
``LlamaProxy``) but with no model: a "token" is the next integer, ``decode`` only counts.

`stand_in_modules` builds fresh modules for one test; `serve` plays the server's streaming path
(the double model lock, the chunks, ``interrupt_requests``) on the running asyncio loop.
"""

from __future__ import annotations

import types
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

EOS = 2
SUPPORTED = ("llama_cpp_python", "0.3.36")
WEIGHT_BYTES = 123_456
MODEL_ALIAS = "tiny-llama"
COMPLETION_ID = "cmpl-0123"


class LlamaBatch:
    def __init__(self) -> None:
        self.tokens: list[int] = []

    def set_batch(self, batch: Sequence[int], n_past: int, logits_all: bool) -> None:
        self.tokens = list(batch)

    def n_tokens(self) -> int:
        return len(self.tokens)


class LlamaContext:
    def __init__(self) -> None:
        self.decoded: list[int] = []
        """Tokens per ``decode`` call."""

    def decode(self, batch: LlamaBatch) -> None:
        self.decoded.append(batch.n_tokens())


class LlamaModel:
    vocab = object()

    def size(self) -> int:
        return WEIGHT_BYTES


class Llama:
    """Generates ``first_token, first_token + 1, ...``; ``EOS`` ends a generation."""

    def __init__(self, *, n_batch: int = 4, first_token: int = 100) -> None:
        self.n_batch = n_batch
        self.first_token = first_token
        self._ctx = LlamaContext()
        self._model = LlamaModel()
        self._batch = LlamaBatch()
        self.input_ids: list[int] = []

    def eval(self, tokens: Sequence[int]) -> None:
        for i in range(0, len(tokens), self.n_batch):
            batch = tokens[i : i + self.n_batch]
            self._batch.set_batch(batch, len(self.input_ids), False)
            self._ctx.decode(self._batch)
            self.input_ids.extend(batch)

    def generate(self, tokens: Sequence[int], **kwargs: Any) -> Generator[int, str | None, None]:
        tokens = list(tokens)
        # The longest prefix of the previous context is reused, less one token at the least.
        prefix = 0
        for a, b in zip(self.input_ids, tokens, strict=False):
            if a != b:
                break
            prefix += 1
        prefix = min(prefix, len(tokens) - 1)
        self.input_ids = self.input_ids[:prefix]
        tokens = tokens[prefix:]
        token = self.first_token
        while True:
            self.eval(tokens)
            sent = yield token
            tokens = [token]
            token = EOS if sent == "eos" else token + 1

    def _create_completion(
        self,
        prompt: Sequence[int],
        max_tokens: int = 16,
        stream: bool = False,
        temperature: float = 0.8,
        top_p: float = 0.95,
        model: str | None = None,
        eos_after: int | None = None,
    ) -> Iterator[dict[str, Any]]:
        completion: list[int] = []
        finish_reason = "length"
        generator = self.generate(prompt)
        token = next(generator)
        while True:
            if token == EOS:
                finish_reason = "stop"
                break
            completion.append(token)
            if stream:
                yield _chunk(str(token), None)
            if len(completion) >= max_tokens:
                break
            token = generator.send("eos" if len(completion) == eos_after else None)
        if stream:
            yield _chunk("", finish_reason)
            return
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(completion)}
        yield {**_chunk(" ".join(map(str, completion)), finish_reason), "usage": usage}


def _chunk(text: str, finish_reason: str | None) -> dict[str, Any]:
    return {
        "id": COMPLETION_ID,
        "choices": [{"text": text, "index": 0, "finish_reason": finish_reason}],
    }


class LlamaProxy:
    def __init__(self, models: Sequence[str]) -> None:
        self._current_model_alias = models[0]
        self._current_model = self.load_llama_from_model_settings(models[0])

    def __call__(self, model: str | None = None) -> Llama:
        return self._current_model

    @staticmethod
    def load_llama_from_model_settings(settings: str) -> Llama:
        return Llama()


@dataclass
class ServerSettings:
    interrupt_requests: bool = False


def llama_vocab_is_eog(vocab: object, token: int) -> bool:
    return token == EOS


def stand_in_modules() -> dict[str, types.ModuleType]:
    """Fresh ``llama_cpp`` modules (new locks and globals for each test)."""
    package = types.ModuleType("llama_cpp")
    package.__path__ = []
    package.llama_vocab_is_eog = llama_vocab_is_eog  # type: ignore[attr-defined]
    internals = types.ModuleType("llama_cpp._internals")
    internals.LlamaContext = LlamaContext  # type: ignore[attr-defined]
    llama = types.ModuleType("llama_cpp.llama")
    llama.Llama = Llama  # type: ignore[attr-defined]
    server = types.ModuleType("llama_cpp.server")
    server.__path__ = []
    model = types.ModuleType("llama_cpp.server.model")
    model.LlamaProxy = LlamaProxy  # type: ignore[attr-defined]
    app = types.ModuleType("llama_cpp.server.app")
    exec(_APP_SOURCE, app.__dict__)  # its own globals, as the real module's
    return {
        "llama_cpp": package,
        "llama_cpp._internals": internals,
        "llama_cpp.llama": llama,
        "llama_cpp.server": server,
        "llama_cpp.server.model": model,
        "llama_cpp.server.app": app,
    }


# The real module's lock and publisher, less FastAPI: ``get_llama_proxy`` verbatim, the event
# publisher's loop with the chunks computed inline instead of in a worker thread.
_APP_SOURCE = """
import contextlib
import anyio
from anyio import Lock

_server_settings = None
_llama_proxy = None
llama_outer_lock = Lock()
llama_inner_lock = Lock()


async def get_llama_proxy():
    await llama_outer_lock.acquire()
    release_outer_lock = True
    try:
        await llama_inner_lock.acquire()
        try:
            llama_outer_lock.release()
            release_outer_lock = False
            yield _llama_proxy
        finally:
            llama_inner_lock.release()
    finally:
        if release_outer_lock:
            llama_outer_lock.release()


async def publish(sent, kwargs, *, step=None):
    interrupt_requests = _server_settings.interrupt_requests if _server_settings else False
    async with contextlib.asynccontextmanager(get_llama_proxy)() as llama_proxy:
        llama = llama_proxy(kwargs.get("model"))
        for chunk in llama._create_completion(**kwargs):
            sent.append(chunk)
            if step is not None:
                await step()
            await anyio.sleep(0)
            if interrupt_requests and llama_outer_lock.locked():
                sent.append("[DONE]")
                raise anyio.get_cancelled_exc_class()()
        sent.append("[DONE]")
"""


@dataclass
class Served:
    chunks: list[Any] = field(default_factory=list)


async def serve(app: types.ModuleType, **kwargs: Any) -> Served:
    """One streamed completion through the stand-in server (``kwargs``: those of
    ``_create_completion``)."""
    served = Served()
    try:
        await app.publish(served.chunks, {"stream": True, **kwargs})
    except anyio.get_cancelled_exc_class():
        if served.chunks[-1:] != ["[DONE]"]:
            raise  # cancelled from outside (the client went away)
        # Interrupted: the real server's response task ends there; the client got [DONE].
    return served
