"""What ``tokentrace load`` sends, and when: deterministic from a seed.

- ``LoadConfig``: everything that describes one load run; ``validate`` names the CLI option of
  each bad value (``OPTION_FOR_FIELD``), ``to_dict``/``from_dict`` for run records,
  ``load_identity`` for "are these two runs the same load?".
- ``RequestPlanner``: ``plan(i)`` is the i-th measured request, the same whatever the order of
  calls, because every request draws from its own random generator seeded by ``(seed, i)``.
- ``arrival_offsets_s``: Poisson arrival times for an open-loop run.

The token-length distributions are ``lengths``'s and the prompt texts ``prompts``'s. Pure Python;
the only I/O is through ``prompts`` (a JSONL dataset and, with ``--tokenizer``, a local
tokenizer). Nothing heavy is imported at module import time.

Two runs with the same seed send the same texts. A server's prefix cache may still hold them from
the first run, so between a before and an after run restart the server or reset its prefix cache
(vLLM: ``POST /reset_prefix_cache``), or accept that the second run's prompts may hit the cache.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

from tokentrace.agent import semconv
from tokentrace.loadgen.lengths import (
    KIND_FIXED,
    MAX_LENGTH_TOKENS,
    LengthDistribution,
    WorkloadError,
    is_int,
    is_number,
    parse_length,
)
from tokentrace.loadgen.prompts import (
    DatasetEntry,
    PromptBuilder,
    TokenCounter,
    TokenizerPromptBuilder,
    WordPromptBuilder,
    estimate_tokens,
    is_utf8_text,
    read_dataset,
)

# --- configuration ----------------------------------------------------------------------------

API_CHAT: Final = "chat"
API_COMPLETIONS: Final = "completions"
_APIS: Final = (API_CHAT, API_COMPLETIONS)

PATH_CHAT: Final = "/v1/chat/completions"
PATH_COMPLETIONS: Final = "/v1/completions"
_PATH_FOR_API: Final[Mapping[str, str]] = {API_CHAT: PATH_CHAT, API_COMPLETIONS: PATH_COMPLETIONS}
_OPERATION_FOR_API: Final[Mapping[str, str]] = {
    API_CHAT: semconv.OPERATION_CHAT,
    API_COMPLETIONS: semconv.OPERATION_TEXT_COMPLETION,
}

_DEFAULT_PROMPT_TOKENS: Final = LengthDistribution(KIND_FIXED, 128)
_DEFAULT_OUTPUT_TOKENS: Final = LengthDistribution(KIND_FIXED, 64)
_DEFAULT_REQUESTS: Final = 100
"""Measured requests when neither a count nor a duration is given."""
_DEFAULT_CONCURRENCY: Final = 1
"""In-flight requests when neither a concurrency nor a rate is given."""
_DEFAULT_SHARED_PREFIX_TOKENS: Final = 512
_DEFAULT_TIMEOUT_S: Final = 600.0

OPTION_FOR_FIELD: Final[Mapping[str, str]] = {
    "base_url": "URL",
    "model": "--model",
    "api": "--api",
    "stream": "--no-stream",
    "concurrency": "--concurrency",
    "rate": "--rate",
    "requests": "--requests",
    "duration_s": "--duration",
    "prompt_tokens": "--prompt-tokens",
    "output_tokens": "--output-tokens",
    "dataset": "--dataset",
    "shared_prefix_fraction": "--shared-prefix-fraction",
    "shared_prefix_tokens": "--shared-prefix-tokens",
    "warmup_requests": "--warmup",
    "seed": "--seed",
    "reuse_connections": "--no-reuse-connections",
    "ignore_eos": "--no-ignore-eos",
    "timeout_s": "--timeout",
    "tokenizer": "--tokenizer",
}
"""The command-line option of each ``LoadConfig`` field, as error messages name it."""


@dataclass(frozen=True, kw_only=True)
class LoadConfig:
    """One load run. Construct, then ``validate()`` (``RequestPlanner`` validates too).

    Closed loop (``concurrency``): that many requests in flight, each followed at once by the
    next. Open loop (``rate``): Poisson arrivals at ``rate`` requests per second, whatever is in
    flight; with ``concurrency`` also set, at most that many in flight (arrivals wait). Neither:
    one in flight. The run stops after ``requests`` measured requests or ``duration_s`` seconds,
    whichever comes first; neither: 100 requests. ``warmup_requests`` are sent first, at the same
    concurrency, and not measured.
    """

    base_url: str
    model: str | None = None
    """None: the runner takes the first model of ``GET /v1/models``."""
    api: str = API_CHAT
    """``chat``: ``POST /v1/chat/completions``; ``completions``: ``POST /v1/completions``."""
    stream: bool = True
    concurrency: int | None = None
    rate: float | None = None
    requests: int | None = None
    duration_s: float | None = None
    prompt_tokens: LengthDistribution = _DEFAULT_PROMPT_TOKENS
    output_tokens: LengthDistribution = _DEFAULT_OUTPUT_TOKENS
    dataset: str | None = None
    """A JSONL file (``read_dataset``): prompts come from it, and output lengths where an entry
    gives them; ``output_tokens`` for the others."""
    shared_prefix_fraction: float = 0.0
    """Share of requests whose prompt starts with the one shared prefix (not with a dataset)."""
    shared_prefix_tokens: int = _DEFAULT_SHARED_PREFIX_TOKENS
    warmup_requests: int = 0
    seed: int = 0
    reuse_connections: bool = True
    ignore_eos: bool = True
    """vLLM's extension: generate exactly ``max_tokens``, whatever the model would stop at."""
    timeout_s: float = _DEFAULT_TIMEOUT_S
    tokenizer: str | None = None
    """A local tokenizer (directory or hub name already in the local cache) for exact prompt
    lengths; without it prompt lengths are approximate (``WordPromptBuilder``)."""

    @property
    def effective_concurrency(self) -> int | None:
        """The cap on requests in flight: ``concurrency``, else 1 without a rate, else None
        (open loop, no cap)."""
        if self.concurrency is not None:
            return self.concurrency
        return _DEFAULT_CONCURRENCY if self.rate is None else None

    @property
    def effective_requests(self) -> int | None:
        """Measured requests to send: ``requests``, else 100 without a duration, else None (until
        the duration ends)."""
        if self.requests is not None:
            return self.requests
        return _DEFAULT_REQUESTS if self.duration_s is None else None

    @property
    def path(self) -> str:
        """The endpoint path of ``api``."""
        return _PATH_FOR_API.get(self.api, PATH_CHAT)

    @property
    def server_url(self) -> str:
        """``base_url`` without a trailing ``/`` or ``/v1`` (as OpenAI clients write it): the
        API paths (``/v1/models``, ``/v1/chat/completions``) go after it, never doubled."""
        return self.base_url.rstrip("/").removesuffix("/v1")

    def validate(self) -> None:
        """Raise ``WorkloadError`` naming the option of the first bad value."""

        def fail(name: str, problem: str) -> WorkloadError:
            return WorkloadError(f"{OPTION_FOR_FIELD[name]}: {problem}")

        if not isinstance(self.base_url, str):
            raise fail("base_url", "must be a URL such as http://127.0.0.1:8000")
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise fail(
                "base_url",
                f"must be an http(s) URL such as http://127.0.0.1:8000, got {self.base_url!r}",
            )
        for name in ("model", "dataset", "tokenizer"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise fail(name, f"must be a non-empty string, got {value!r}")
        if self.api not in _APIS:
            raise fail("api", f"must be one of {', '.join(_APIS)}, got {self.api!r}")
        for name in ("stream", "reuse_connections", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise fail(name, f"must be true or false, got {getattr(self, name)!r}")
        for name in ("concurrency", "requests"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise fail(name, f"must be a whole number of at least 1, got {value!r}")
        for name in ("rate", "duration_s", "timeout_s"):
            value = getattr(self, name)
            if value is None and name != "timeout_s":
                continue
            if not is_number(value) or not math.isfinite(value) or value <= 0:
                raise fail(name, f"must be a positive number, got {value!r}")
        for name in ("prompt_tokens", "output_tokens"):
            if not isinstance(getattr(self, name), LengthDistribution):
                raise fail(name, f"must be a length distribution, got {getattr(self, name)!r}")
        fraction = self.shared_prefix_fraction
        if not is_number(fraction) or not 0.0 <= fraction <= 1.0:
            raise fail("shared_prefix_fraction", f"must be between 0 and 1, got {fraction!r}")
        prefix_tokens = self.shared_prefix_tokens
        if not is_int(prefix_tokens) or not 1 <= prefix_tokens <= MAX_LENGTH_TOKENS:
            raise fail(
                "shared_prefix_tokens",
                f"must be a whole number from 1 to {MAX_LENGTH_TOKENS}, got {prefix_tokens!r}",
            )
        if not is_int(self.warmup_requests) or self.warmup_requests < 0:
            raise fail(
                "warmup_requests",
                f"must be a whole number, 0 or more, got {self.warmup_requests!r}",
            )
        if not is_int(self.seed):
            raise fail("seed", f"must be a whole number, got {self.seed!r}")
        if self.dataset is not None and fraction > 0:
            raise fail(
                "shared_prefix_fraction",
                "cannot be combined with --dataset: a dataset's prompts carry their own prefixes",
            )

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: every field, distributions as their spec strings."""
        result: dict[str, object] = {}
        for spec_field in dataclasses.fields(self):
            value = getattr(self, spec_field.name)
            result[spec_field.name] = (
                value.to_spec() if isinstance(value, LengthDistribution) else value
            )
        return result

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> LoadConfig:
        """The inverse of ``to_dict``; missing fields take their defaults, unknown fields and
        values of the wrong type are a ``WorkloadError``; the result is validated."""
        if not isinstance(data, Mapping):
            raise WorkloadError(f"load config: expected an object, got {type(data).__name__}")
        known = {spec_field.name: spec_field for spec_field in dataclasses.fields(cls)}
        unknown = sorted(str(key) for key in data if key not in known)
        if unknown:
            raise WorkloadError(f"load config: unknown field(s) {', '.join(unknown)}")
        if "base_url" not in data:
            raise WorkloadError("load config: missing field base_url")
        values: dict[str, object] = {}
        for name, value in data.items():
            values[name] = _field_from_json(name, str(known[name].type), value)
        config = cls(**values)  # type: ignore[arg-type]  # each value was checked above
        config.validate()
        return config

    def load_identity(self) -> dict[str, object]:
        """The fields that make two runs the same load: everything that changes what is sent and
        when (api, stream, concurrency, rate, request count, duration, length distributions,
        dataset path, shared-prefix settings, warm-up, seed, ignore_eos, model), normalised so
        that equivalent settings compare equal (no concurrency and no rate is concurrency 1;
        no count and no duration is 100 requests; prompt lengths are moot with a dataset, and
        prefix length with no shared prefix).

        Left out: what a user may change between a before and an after run to fix latency
        without changing the load (``base_url``: the server moved; ``reuse_connections``: a
        client fix, like turning on prefix caching is a server fix), ``timeout_s`` (when to give
        up, not what is sent) and ``tokenizer`` (it makes prompt lengths exact, the lengths asked
        for stay the same). ``model`` is as configured: a runner that resolved it from
        ``/v1/models`` should record the resolved name (``dataclasses.replace``).
        """
        return {
            "api": self.api,
            "stream": self.stream,
            "concurrency": self.effective_concurrency,
            "rate": self.rate,
            "requests": self.effective_requests,
            "duration_s": self.duration_s,
            "prompt_tokens": None if self.dataset is not None else self.prompt_tokens.to_spec(),
            "output_tokens": self.output_tokens.to_spec(),
            "dataset": self.dataset,
            "shared_prefix_fraction": self.shared_prefix_fraction,
            "shared_prefix_tokens": (
                self.shared_prefix_tokens if self.shared_prefix_fraction > 0 else None
            ),
            "warmup_requests": self.warmup_requests,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "model": self.model,
        }


def _field_from_json(name: str, declared_type: str, value: object) -> object:
    """One ``to_dict`` value back into its field's type (declared as a string annotation)."""

    def wrong(expected: str) -> WorkloadError:
        return WorkloadError(f"load config field {name}: expected {expected}, got {value!r}")

    optional = declared_type.endswith(" | None")
    base_type = declared_type.removesuffix(" | None")
    if value is None:
        if optional:
            return None
        raise wrong(f"a {base_type}, not null")
    if base_type == "str":
        if not isinstance(value, str):
            raise wrong("a string")
        return value
    if base_type == "bool":
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if base_type == "int":
        if not is_int(value):
            raise wrong("a whole number")
        return value
    if base_type == "float":
        if not is_number(value):
            raise wrong("a number")
        return float(value)  # type: ignore[arg-type]  # is_number checked it
    if base_type == "LengthDistribution":
        if not isinstance(value, str):
            raise wrong("a length spec such as 'uniform:64:256'")
        return parse_length(value, option=f"load config field {name}")
    raise WorkloadError(f"load config field {name}: unsupported type {declared_type}")


def prompt_builder(config: LoadConfig) -> PromptBuilder:
    """The builder ``config`` asks for: a tokenizer's when ``tokenizer`` is set, else words."""
    if config.tokenizer:
        return TokenizerPromptBuilder(config.tokenizer)
    return WordPromptBuilder()


# --- request plans ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """One request, ready to send."""

    index: int
    """0-based among measured requests; warm-up requests are -1, -2, ..."""
    path: str
    """``/v1/chat/completions`` or ``/v1/completions``."""
    operation: str
    """The GenAI operation name (``semconv.OPERATION_*``)."""
    body: bytes
    """The JSON request body (UTF-8, compact, keys in a fixed order)."""
    prompt_tokens_planned: int
    """The prompt length asked for: exact with a tokenizer, approximate otherwise (and for a
    dataset without a tokenizer, about 4 characters per token)."""
    max_tokens: int
    shared_prefix: bool


def _json_body(body: Mapping[str, object]) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


class RequestPlanner:
    """Turns a ``LoadConfig`` into request plans. ``plan(i)`` depends only on the configuration,
    the seed, the model and ``i``: each request draws from its own generators, seeded by
    ``(seed, i)``, one for the shared-prefix choice, one for lengths, one for text, so that
    changing the shared-prefix fraction leaves every request's lengths and own text unchanged.

    With a dataset, request ``i`` takes entry ``order[i % len(dataset)]``, where ``order`` is a
    permutation of the entries shuffled once from the seed: each pass sends every entry once, and
    warm-up requests (negative indices) take entries from the end of the order. A ``messages``
    entry cannot be sent to ``/v1/completions``: the planner refuses such a dataset up front.
    """

    def __init__(
        self, config: LoadConfig, *, model: str, builder: PromptBuilder | None = None
    ) -> None:
        config.validate()
        if not isinstance(model, str) or not model.strip() or not is_utf8_text(model):
            raise WorkloadError(f"--model: must be a non-empty string, got {model!r}")
        self._config = config
        self._model = model
        self._builder = builder if builder is not None else prompt_builder(config)
        self._path = _PATH_FOR_API[config.api]
        self._operation = _OPERATION_FOR_API[config.api]
        self._entries: list[DatasetEntry] = []
        self._order: list[int] = []
        if config.dataset is not None:
            self._entries = read_dataset(config.dataset)
            if config.api == API_COMPLETIONS:
                for entry in self._entries:
                    if entry.messages is not None:
                        raise WorkloadError(
                            f"dataset {config.dataset}:{entry.line}: a 'messages' entry cannot be "
                            f"sent to {PATH_COMPLETIONS}; use --api {API_CHAT} or give 'prompt'"
                        )
            self._order = list(range(len(self._entries)))
            random.Random(f"{config.seed}:dataset-order").shuffle(self._order)
        self._shared_prefix = ""
        if config.shared_prefix_fraction > 0:
            self._shared_prefix = self._builder.text(
                config.shared_prefix_tokens, random.Random(f"{config.seed}:shared-prefix")
            )

    @property
    def shared_prefix(self) -> str:
        """The text shared requests start with ("" when none do)."""
        return self._shared_prefix

    @property
    def dataset_size(self) -> int:
        return len(self._entries)

    def warmup(self) -> list[RequestPlan]:
        """The warm-up requests, indices -1, -2, ..., in the order to send them."""
        return [self.plan(-number) for number in range(1, self._config.warmup_requests + 1)]

    def plan(self, index: int) -> RequestPlan:
        config = self._config
        seed = config.seed
        lengths_rng = random.Random(f"{seed}:{index}:lengths")
        text_rng = random.Random(f"{seed}:{index}:text")
        if self._entries:
            entry = self._entries[self._order[index % len(self._entries)]]
            max_tokens = entry.output_tokens or config.output_tokens.sample(lengths_rng)
            return self._dataset_plan(index, entry, max_tokens)
        max_tokens = config.output_tokens.sample(lengths_rng)
        prompt_tokens = config.prompt_tokens.sample(lengths_rng)
        shared = (
            config.shared_prefix_fraction > 0
            and random.Random(f"{seed}:{index}:shared").random() < config.shared_prefix_fraction
        )
        own_text = self._builder.text(prompt_tokens, text_rng)
        planned = prompt_tokens + (config.shared_prefix_tokens if shared else 0)
        if config.api == API_CHAT:
            messages = [{"role": "user", "content": own_text}]
            if shared:
                messages.insert(0, {"role": "system", "content": self._shared_prefix})
            body = self._body("messages", messages, max_tokens)
        else:
            prompt = f"{self._shared_prefix} {own_text}" if shared else own_text
            body = self._body("prompt", prompt, max_tokens)
        return RequestPlan(
            index=index,
            path=self._path,
            operation=self._operation,
            body=body,
            prompt_tokens_planned=planned,
            max_tokens=max_tokens,
            shared_prefix=shared,
        )

    def _dataset_plan(self, index: int, entry: DatasetEntry, max_tokens: int) -> RequestPlan:
        if entry.messages is not None:
            texts = [message.content for message in entry.messages]
            body = self._body(
                "messages",
                [{"role": message.role, "content": message.content} for message in entry.messages],
                max_tokens,
            )
        else:
            prompt = entry.prompt or ""
            texts = [prompt]
            if self._config.api == API_CHAT:
                body = self._body("messages", [{"role": "user", "content": prompt}], max_tokens)
            else:
                body = self._body("prompt", prompt, max_tokens)
        return RequestPlan(
            index=index,
            path=self._path,
            operation=self._operation,
            body=body,
            prompt_tokens_planned=sum(self._count_tokens(text) for text in texts),
            max_tokens=max_tokens,
            shared_prefix=False,
        )

    def _count_tokens(self, text: str) -> int:
        if isinstance(self._builder, TokenCounter):
            return self._builder.count_tokens(text)
        return estimate_tokens(text)

    def _body(self, prompt_key: str, prompt: object, max_tokens: int) -> bytes:
        body: dict[str, object] = {
            "model": self._model,
            prompt_key: prompt,
            "max_tokens": max_tokens,
            "stream": self._config.stream,
        }
        if self._config.stream:
            # Without it an OpenAI-compatible server sends no token counts in a stream.
            body["stream_options"] = {"include_usage": True}
        if self._config.ignore_eos:
            body["ignore_eos"] = True
        return _json_body(body)


# --- arrivals ---------------------------------------------------------------------------------


def arrival_offsets_s(rate: float, *, seed: int) -> Iterator[float]:
    """Arrival times of a Poisson process at ``rate`` requests per second, in seconds from the
    start of the run, without end. The first offset is the first exponential gap, not 0, so that
    every gap (including the one before the first request) is an independent exponential draw
    with mean ``1 / rate``. Deterministic from ``seed``; a bad rate fails here, not at the first
    ``next()``."""
    if not is_number(rate) or not math.isfinite(rate) or rate <= 0:
        raise WorkloadError(f"--rate: must be a positive number, got {rate!r}")
    return _poisson_offsets(float(rate), random.Random(f"{seed}:arrivals"))


def _poisson_offsets(rate: float, rng: random.Random) -> Iterator[float]:
    offset_s = 0.0
    while True:
        offset_s += rng.expovariate(rate)
        yield offset_s
