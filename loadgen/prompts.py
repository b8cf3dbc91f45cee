"""Prompt texts for ``tokentrace load``: synthesised to a token length, or read from a dataset.

- ``WordPromptBuilder`` / ``TokenizerPromptBuilder``: prompt texts of a given token length,
  approximate from common words or exact with a local tokenizer.
- ``read_dataset``: JSONL prompts (``{"prompt": ...}`` or ``{"messages": [...]}``).

Separate from the planner (``workload``), which decides which text each request gets, because
this is where the I/O and the optional heavy imports are: reading a dataset and, with
``--tokenizer``, loading a local tokenizer (``transformers`` or ``tokenizers``, imported only
then, never at module import).
"""

from __future__ import annotations

import importlib
import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Final, Protocol, runtime_checkable

from tokentrace.loadgen.lengths import MAX_LENGTH_TOKENS, WorkloadError, is_int

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


_UNBOUNDED_LENGTH: Final = 1 << 62
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


def is_utf8_text(text: str) -> bool:
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
        not is_int(output_tokens) or not 1 <= output_tokens <= MAX_LENGTH_TOKENS
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
        if not isinstance(prompt, str) or not prompt or not is_utf8_text(prompt):
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
            or not is_utf8_text(role + content)
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
