"""What ``tokentrace load`` sends, and when: deterministic from a seed.

The workload model is pure Python; the only I/O is reading a JSONL dataset and, with
``--tokenizer``, loading a local tokenizer. Nothing heavy is imported at module import time.

- ``LengthDistribution`` / ``parse_length``: token counts per request (``128``, ``fixed:128``,
  ``uniform:64:256``, ``normal:128:32``).
- ``LoadConfig``: everything that describes one load run; ``validate`` names the CLI option of
  each bad value (``OPTION_FOR_FIELD``), ``to_dict``/``from_dict`` for run records,
  ``load_identity`` for "are these two runs the same load?".
- ``WordPromptBuilder`` / ``TokenizerPromptBuilder``: prompt texts of a given token length.
- ``read_dataset``: JSONL prompts (``{"prompt": ...}`` or ``{"messages": [...]}``).
- ``RequestPlanner``: ``plan(i)`` is the i-th measured request, the same whatever the order of
  calls, because every request draws from its own random generator seeded by ``(seed, i)``.
- ``arrival_offsets_s``: Poisson arrival times for an open-loop run.

Two runs with the same seed send the same texts. A server's prefix cache may still hold them from
the first run, so between a before and an after run restart the server or reset its prefix cache
(vLLM: ``POST /reset_prefix_cache``), or accept that the second run's prompts may hit the cache.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Final, Protocol, runtime_checkable
from urllib.parse import urlsplit

from tokentrace.agent import semconv


class WorkloadError(ValueError):
    """A bad load option or dataset line; the message names the option (``--rate: ...``) or the
    place in the dataset (``dataset FILE:LINE: ...``)."""


# --- length distributions ---------------------------------------------------------------------

KIND_FIXED: Final = "fixed"
KIND_UNIFORM: Final = "uniform"
KIND_NORMAL: Final = "normal"
_KINDS: Final = (KIND_FIXED, KIND_UNIFORM, KIND_NORMAL)

MAX_LENGTH_TOKENS: Final = 1_048_576
"""Largest token count one prompt or output may ask for (and where normal samples are clipped):
beyond any context window in use, and it bounds one prompt's text to a few MB."""

_SPEC_HELP: Final = "expected N, fixed:N, uniform:MIN:MAX or normal:MEAN:STDDEV"


def _format_number(value: float) -> str:
    """``128`` for whole numbers, the exact shortest repr otherwise (so specs round-trip)."""
    number = float(value)
    return str(int(number)) if number.is_integer() else repr(number)


def _whole_tokens(value: float) -> bool:
    return math.isfinite(value) and float(value).is_integer()


def _distribution_problem(kind: str, a: float, b: float) -> str | None:
    """What is wrong with these parameters, or None."""
    if kind not in _KINDS:
        return f"unknown kind {kind!r}; {_SPEC_HELP}"
    if not (math.isfinite(a) and math.isfinite(b)):
        return "values must be finite numbers"
    if kind == KIND_NORMAL:
        if a <= 0:
            return f"the mean must be positive, got {_format_number(a)}"
        if a > MAX_LENGTH_TOKENS:
            return f"the mean must be at most {MAX_LENGTH_TOKENS}, got {_format_number(a)}"
        if b < 0:
            return f"the standard deviation must not be negative, got {_format_number(b)}"
        return None
    bounds = (a,) if kind == KIND_FIXED else (a, b)
    for bound in bounds:
        if not _whole_tokens(bound):
            return f"token counts must be whole numbers, got {_format_number(bound)}"
        if bound < 1:
            return f"token counts must be at least 1, got {_format_number(bound)}"
        if bound > MAX_LENGTH_TOKENS:
            return f"token counts must be at most {MAX_LENGTH_TOKENS}, got {_format_number(bound)}"
    if kind == KIND_UNIFORM and a > b:
        return f"the minimum {_format_number(a)} is above the maximum {_format_number(b)}"
    return None


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """A distribution of token counts; every sample is a whole number in
    ``[1, MAX_LENGTH_TOKENS]``.

    - ``fixed``: always ``a``.
    - ``uniform``: a whole number in ``[a, b]``, both ends included.
    - ``normal``: mean ``a``, standard deviation ``b``, rounded and clipped to the range above.
    """

    kind: str
    a: float
    b: float = 0.0

    def __post_init__(self) -> None:
        problem = _distribution_problem(self.kind, self.a, self.b)
        if problem is not None:
            raise WorkloadError(f"length distribution: {problem}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == KIND_FIXED:
            return int(self.a)
        if self.kind == KIND_UNIFORM:
            return rng.randint(int(self.a), int(self.b))
        return min(MAX_LENGTH_TOKENS, max(1, round(rng.gauss(self.a, self.b))))

    def describe(self) -> str:
        """For people: ``fixed 128``, ``uniform 64-256``, ``normal 128±32``."""
        a, b = _format_number(self.a), _format_number(self.b)
        if self.kind == KIND_FIXED:
            return f"fixed {a}"
        if self.kind == KIND_UNIFORM:
            return f"uniform {a}-{b}"
        return f"normal {a}±{b}"

    def to_spec(self) -> str:
        """The text ``parse_length`` reads back into an equal distribution."""
        a, b = _format_number(self.a), _format_number(self.b)
        if self.kind == KIND_FIXED:
            return f"fixed:{a}"
        return f"{self.kind}:{a}:{b}"


def _parse_number(text: str, *, option: str, spec: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise WorkloadError(f"{option}: {text!r} is not a number in {spec!r}") from None


def parse_length(text: str, *, option: str) -> LengthDistribution:
    """``128`` | ``fixed:128`` | ``uniform:64:256`` | ``normal:128:32``; every problem is a
    ``WorkloadError`` that names ``option``."""
    spec = text.strip()
    parts = [part.strip() for part in spec.split(":")]
    kind = parts[0].lower()
    if len(parts) == 1:
        kind, values = KIND_FIXED, parts
    else:
        values = parts[1:]
    expected_values = {KIND_FIXED: 1, KIND_UNIFORM: 2, KIND_NORMAL: 2}.get(kind)
    if expected_values is None or len(values) != expected_values or not all(values):
        raise WorkloadError(f"{option}: {_SPEC_HELP}, got {text!r}")
    numbers = [_parse_number(value, option=option, spec=text) for value in values]
    a = numbers[0]
    b = numbers[1] if len(numbers) > 1 else 0.0
    problem = _distribution_problem(kind, a, b)
    if problem is not None:
        raise WorkloadError(f"{option}: {problem} in {text!r}")
    return LengthDistribution(kind, a, b)


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

_UNBOUNDED_LENGTH: Final = 1 << 62
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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


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
            if value is not None and (not _is_int(value) or value < 1):
                raise fail(name, f"must be a whole number of at least 1, got {value!r}")
        for name in ("rate", "duration_s", "timeout_s"):
            value = getattr(self, name)
            if value is None and name != "timeout_s":
                continue
            if not _is_number(value) or not math.isfinite(value) or value <= 0:
                raise fail(name, f"must be a positive number, got {value!r}")
        for name in ("prompt_tokens", "output_tokens"):
            if not isinstance(getattr(self, name), LengthDistribution):
                raise fail(name, f"must be a length distribution, got {getattr(self, name)!r}")
        fraction = self.shared_prefix_fraction
        if not _is_number(fraction) or not 0.0 <= fraction <= 1.0:
            raise fail("shared_prefix_fraction", f"must be between 0 and 1, got {fraction!r}")
        prefix_tokens = self.shared_prefix_tokens
        if not _is_int(prefix_tokens) or not 1 <= prefix_tokens <= MAX_LENGTH_TOKENS:
            raise fail(
                "shared_prefix_tokens",
                f"must be a whole number from 1 to {MAX_LENGTH_TOKENS}, got {prefix_tokens!r}",
            )
        if not _is_int(self.warmup_requests) or self.warmup_requests < 0:
            raise fail(
                "warmup_requests",
                f"must be a whole number, 0 or more, got {self.warmup_requests!r}",
            )
        if not _is_int(self.seed):
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
        if not _is_int(value):
            raise wrong("a whole number")
        return value
    if base_type == "float":
        if not _is_number(value):
            raise wrong("a number")
        return float(value)  # type: ignore[arg-type]  # _is_number checked it
    if base_type == "LengthDistribution":
        if not isinstance(value, str):
            raise wrong("a length spec such as 'uniform:64:256'")
        return parse_length(value, option=f"load config field {name}")
    raise WorkloadError(f"load config field {name}: unsupported type {declared_type}")


# --- prompt text ------------------------------------------------------------------------------


class PromptBuilder(Protocol):
    def text(self, tokens: int, rng: random.Random) -> str:
        """A text of about ``tokens`` tokens, drawn from ``rng``."""
        ...


@runtime_checkable
class TokenCounter(Protocol):
    """A prompt builder that can also count the tokens of any text exactly."""

    def count_tokens(self, text: str) -> int: ...


# Common lowercase English words that typical BPE vocabularies (GPT-2, cl100k, Llama, Qwen)
# hold as one token, with or without a leading space.
_PROMPT_WORDS_TEXT: Final = """
    the of and to in is it you that he was for on are with as his they be at one have this
    from or had by but some what there we can out other were all your when up use word how said
    an each she which do their time if will way about many then them would write like so these
    her long make thing see him two has look more day could go come did my sound no most number
    who over know water than call first people may down side been now find any new work part
    take get place made live where after back little only round man year came show every good
    me give our under name very through just form much great think say help low line before
    turn cause same mean move right boy old too does tell set three want air well also play
    small end put home read hand large add even land here must big high such follow act why ask
    men change went light kind off need house try us again point mother world near build self
    earth father head stand own page should country found answer school grow study still learn
    plant cover food sun four thought let keep eye never last door between city tree cross since
    hard start might story saw far sea draw left late run while press close night real life few
    stop open seem together next white children begin got walk example paper often always music
    those both mark book letter until car feet care second group carry took rain eat room friend
    began idea fish north once base hear horse cut sure watch color face wood main enough plain
    girl young ready above ever red list though feel talk bird soon body dog family direct leave
    song state black short class wind question happen complete ship area half rock order fire
    south problem piece told knew pass farm top whole king size heard best hour better true
    during hundred remember step early hold west ground interest reach fast five sing six table
    travel less morning ten simple several toward war lay against pattern slow center love
    person money serve road map science rule pull cold voice fall power town fine certain fly
    unit lead dark note wait plan figure star box field rest able done drive stood front teach
    week final gave green quick sleep warm free minute strong special mind behind clear fact
    street lot nothing course stay full force blue deep moon foot yet test record boat common
    gold plane age dry ran check game shape yes hot miss brought heat snow bed bring sit fill
    east weight among
"""
PROMPT_WORDS: Final[tuple[str, ...]] = tuple(_PROMPT_WORDS_TEXT.split())
"""The words of ``WordPromptBuilder``: each about one token, so N words are about N tokens."""


def estimate_tokens(text: str) -> int:
    """Tokens of an English text without a tokenizer: about 4 characters per token."""
    return max(1, round(len(text) / 4))


class WordPromptBuilder:
    """Prompt texts without a tokenizer: ``tokens`` random words from ``PROMPT_WORDS`` joined by
    spaces. The length is approximate (a chat template adds its own tokens; a tokenizer may split
    a word); the run record keeps the server's usage counts, which are exact."""

    def text(self, tokens: int, rng: random.Random) -> str:
        return " ".join(rng.choices(PROMPT_WORDS, k=tokens))

    def count_tokens(self, text: str) -> int:
        """An estimate for texts not built here (``estimate_tokens``)."""
        return estimate_tokens(text)


class _TokenCodec(Protocol):
    """The part of a tokenizer that ``TokenizerPromptBuilder`` uses."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def decode_each(self, ids: Sequence[int]) -> list[str]:
        """Each id decoded on its own."""
        ...


class _TransformersCodec:
    def __init__(self, tokenizer: object) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids)))  # type: ignore[attr-defined]

    def decode_each(self, ids: Sequence[int]) -> list[str]:
        # A fast tokenizer's Rust backend decodes the whole vocabulary in milliseconds.
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return list(backend.decode_batch([[token] for token in ids]))
        return [self.decode([token]) for token in ids]


class _TokenizersCodec:
    def __init__(self, tokenizer: object) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)  # type: ignore[attr-defined]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids)))  # type: ignore[attr-defined]

    def decode_each(self, ids: Sequence[int]) -> list[str]:
        return list(self._tokenizer.decode_batch([[token] for token in ids]))  # type: ignore[attr-defined]


_TOKENIZER_ADJUST_ROUNDS: Final = 10
"""Decode/re-encode rounds to make a text's length exact before accepting it as it is."""


def _optional_import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _load_codec(name_or_path: str) -> tuple[_TokenCodec, int, set[int]]:
    """(codec, vocabulary size, special token ids) of a local tokenizer: transformers'
    ``AutoTokenizer`` when installed, else a ``tokenizer.json`` read by the ``tokenizers``
    package (what a fast HF tokenizer is made of)."""
    transformers = _optional_import("transformers")
    if transformers is not None:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                name_or_path, local_files_only=True
            )
            # Prompts are measured here, never fed to a model: no "longer than the maximum
            # sequence length" warnings for long ones (the server checks its own limit).
            tokenizer.model_max_length = _UNBOUNDED_LENGTH
        except Exception as exc:  # any loader failure is a bad option, said once, not a crash
            raise WorkloadError(
                f"--tokenizer: cannot load {name_or_path!r} from local files: {exc}"
            ) from exc
        return _TransformersCodec(tokenizer), len(tokenizer), set(tokenizer.all_special_ids)
    json_path = name_or_path
    if os.path.isdir(json_path):
        json_path = os.path.join(json_path, "tokenizer.json")
    tokenizers = _optional_import("tokenizers")
    if tokenizers is None or not os.path.isfile(json_path):
        raise WorkloadError(
            "--tokenizer: needs the 'transformers' package (pip install transformers), or a "
            "local tokenizer.json and the 'tokenizers' package"
        )
    try:
        fast = tokenizers.Tokenizer.from_file(json_path)
    except Exception as exc:  # the Rust loader raises its own exception types
        raise WorkloadError(f"--tokenizer: cannot load {json_path!r}: {exc}") from exc
    special = {
        token_id
        for token_id, token in fast.get_added_tokens_decoder().items()
        if getattr(token, "special", False)
    }
    return _TokenizersCodec(fast), fast.get_vocab_size(with_added_tokens=True), special


class TokenizerPromptBuilder:
    """Prompt texts of exact token lengths for one tokenizer, as ``vllm bench``'s random dataset
    makes them: random token ids (ordinary text tokens only) decoded to text, re-encoded, and cut or
    extended until the re-encoded length is right; after a few rounds the text is taken as it
    is. Loads only local files (no download at run time)."""

    def __init__(self, name_or_path: str) -> None:
        self._codec, vocab_size, special = _load_codec(name_or_path)
        ordinary = [token for token in range(vocab_size) if token not in special]
        # Only tokens that are text on their own: a byte-fallback or partial UTF-8 token decodes
        # to U+FFFD, which re-encodes as several tokens, and the length would never settle.
        self._candidate_ids = [
            token
            for token, text in zip(ordinary, self._codec.decode_each(ordinary), strict=True)
            if text.strip() and "\ufffd" not in text
        ]
        if not self._candidate_ids:
            raise WorkloadError(f"--tokenizer: {name_or_path!r} has no ordinary tokens")

    def text(self, tokens: int, rng: random.Random) -> str:
        text = self._codec.decode(rng.choices(self._candidate_ids, k=tokens))
        for _ in range(_TOKENIZER_ADJUST_ROUNDS):
            ids = self._codec.encode(text)
            if len(ids) == tokens:
                break
            if len(ids) > tokens:
                ids = ids[:tokens]
            else:
                ids.extend(rng.choices(self._candidate_ids, k=tokens - len(ids)))
            text = self._codec.decode(ids)
        return text

    def count_tokens(self, text: str) -> int:
        return len(self._codec.encode(text))


def prompt_builder(config: LoadConfig) -> PromptBuilder:
    """The builder ``config`` asks for: a tokenizer's when ``tokenizer`` is set, else words."""
    if config.tokenizer:
        return TokenizerPromptBuilder(config.tokenizer)
    return WordPromptBuilder()


# --- dataset ----------------------------------------------------------------------------------

MAX_DATASET_ENTRIES: Final = 1_000_000
"""Entries ``read_dataset`` keeps; a longer file is an error, not silently cut."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class DatasetEntry:
    """One JSONL line: exactly one of ``prompt`` and ``messages``."""

    line: int
    """1-based line number in the file, for messages."""
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    output_tokens: int | None = None


def _is_utf8_text(text: str) -> bool:
    """False for a string with lone surrogates (JSON's ``"\\ud800"``), which no body can carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _dataset_entry(value: object, *, where: str, line: int) -> DatasetEntry:
    if not isinstance(value, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(value).__name__}")
    output_tokens = value.get("output_tokens")
    if output_tokens is not None and (
        not _is_int(output_tokens) or not 1 <= output_tokens <= MAX_LENGTH_TOKENS
    ):
        raise WorkloadError(
            f"{where}: output_tokens must be a whole number from 1 to {MAX_LENGTH_TOKENS}, "
            f"got {output_tokens!r}"
        )
    has_prompt, has_messages = "prompt" in value, "messages" in value
    if has_prompt == has_messages:
        raise WorkloadError(f"{where}: expected exactly one of 'prompt' and 'messages'")
    if has_prompt:
        prompt = value["prompt"]
        if not isinstance(prompt, str) or not prompt or not _is_utf8_text(prompt):
            raise WorkloadError(f"{where}: 'prompt' must be a non-empty string of valid text")
        return DatasetEntry(line=line, prompt=prompt, output_tokens=output_tokens)
    raw_messages = value["messages"]
    if not isinstance(raw_messages, list) or not raw_messages:
        raise WorkloadError(f"{where}: 'messages' must be a non-empty list")
    messages = []
    for position, message in enumerate(raw_messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if (
            not isinstance(role, str)
            or not role
            or not isinstance(content, str)
            or not _is_utf8_text(role + content)
        ):
            raise WorkloadError(
                f"{where}: messages[{position}] must be an object with a 'role' and a string "
                "'content' of valid text"
            )
        messages.append(ChatMessage(role, content))
    return DatasetEntry(line=line, messages=tuple(messages), output_tokens=output_tokens)


def read_dataset(path: str) -> list[DatasetEntry]:
    """A JSONL file: one object per line, ``{"prompt": "..."}`` or ``{"messages": [{"role":
    ..., "content": ...}, ...]}``, optionally ``"output_tokens": N`` (N >= 1); other keys are
    ignored, blank lines skipped. Errors name ``FILE:LINE``. At most ``MAX_DATASET_ENTRIES``."""
    entries: list[DatasetEntry] = []
    try:
        with open(path, "rb") as lines:
            for line_number, raw in enumerate(lines, start=1):
                where = f"dataset {path}:{line_number}"
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise WorkloadError(f"{where}: not UTF-8 ({exc.reason})") from None
                if not text.strip():
                    continue
                if len(entries) >= MAX_DATASET_ENTRIES:
                    raise WorkloadError(
                        f"{where}: more than {MAX_DATASET_ENTRIES} entries; sample the file"
                    )
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise WorkloadError(f"{where}: not valid JSON ({exc.msg})") from None
                entries.append(_dataset_entry(value, where=where, line=line_number))
    except OSError as exc:
        raise WorkloadError(f"--dataset: cannot read {path}: {exc.strerror or exc}") from None
    if not entries:
        raise WorkloadError(f"--dataset: {path} has no entries")
    return entries


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
        if not isinstance(model, str) or not model.strip() or not _is_utf8_text(model):
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
    if not _is_number(rate) or not math.isfinite(rate) or rate <= 0:
        raise WorkloadError(f"--rate: must be a positive number, got {rate!r}")
    return _poisson_offsets(float(rate), random.Random(f"{seed}:arrivals"))


def _poisson_offsets(rate: float, rng: random.Random) -> Iterator[float]:
    offset_s = 0.0
    while True:
        offset_s += rng.expovariate(rate)
        yield offset_s
