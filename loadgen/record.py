"""The run record: everything ``tokentrace load`` knew about one run, saved as one JSON file.

It holds the load's configuration (and the part of it that defines "the same load"), the model,
the measured window, the client-side summary, every request's timings and trace id, and what
the span export dropped. ``tokentrace diagnose --run`` selects the run's requests in the
collector's store by their trace ids; ``tokentrace compare`` compares two records.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Final

from tokentrace.loadgen.results import RequestResult

RECORD_KIND: Final = "tokentrace.load.run"
RECORD_VERSION: Final = 1
_MAX_RECORD_BYTES: Final = 1 << 30
"""A larger file is not a run record we wrote (a million requests take about 400 MB)."""


class RunRecordError(ValueError):
    """A run record cannot be read or written; the message names the file and the problem."""


@dataclass(slots=True, kw_only=True)
class RunRecord:
    config: dict[str, Any]
    """``LoadConfig.to_dict()``."""
    identity: dict[str, Any]
    """``LoadConfig.load_identity()``: two runs with equal identities sent the same load."""
    model: str
    window_start_ns: int
    window_end_ns: int
    summary: dict[str, Any]
    results: list[RequestResult]
    slo: list[dict[str, Any]] = field(default_factory=list)
    """Client-side status of each SLO target (``report.client_slo``)."""
    warmup_failed: int = 0
    export: dict[str, int] = field(default_factory=dict)
    """The client-span exporter's counters (sent, dropped, ...); empty when none was set."""
    http: dict[str, int] = field(default_factory=dict)
    """Connections opened and reused."""

    @property
    def trace_ids(self) -> list[str]:
        return [result.trace_id for result in self.results]

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": RECORD_KIND,
            "version": RECORD_VERSION,
            "started": _iso(self.window_start_ns),
            "config": self.config,
            "identity": self.identity,
            "model": self.model,
            "window": {"start_ns": self.window_start_ns, "end_ns": self.window_end_ns},
            "summary": self.summary,
            "slo": self.slo,
            "warmup_failed": self.warmup_failed,
            "export": self.export,
            "http": self.http,
            "requests": [result.to_dict() for result in self.results],
        }


def save(record: RunRecord, path: str | os.PathLike[str]) -> Path:
    """Write ``record`` atomically (a temporary file renamed into place); the path written."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(
            prefix=f".{target.name}.", suffix=".tmp", dir=target.parent
        )
        try:
            with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
                json.dump(record.to_dict(), handle, separators=(",", ":"))
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
    except OSError as error:
        raise RunRecordError(
            f"cannot write run record {target}: {error.strerror or error}"
        ) from None
    return target


def load(path: str | os.PathLike[str]) -> RunRecord:
    source = Path(path)
    try:
        size = source.stat().st_size
        if size > _MAX_RECORD_BYTES:
            raise RunRecordError(f"{source}: {size:,} bytes is too large for a run record")
        data = json.loads(source.read_text(encoding="utf-8"))
    except OSError as error:
        raise RunRecordError(
            f"cannot read run record {source}: {error.strerror or error}"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RunRecordError(f"{source}: not a run record (not JSON: {error})") from None
    return from_dict(data, where=str(source))


def from_dict(data: object, *, where: str) -> RunRecord:
    if not isinstance(data, Mapping) or data.get("kind") != RECORD_KIND:
        raise RunRecordError(f"{where}: not a tokentrace load run record")
    version = data.get("version")
    if version != RECORD_VERSION:
        raise RunRecordError(
            f"{where}: run record version {version!r}; this tokentrace reads version "
            f"{RECORD_VERSION}"
        )
    try:
        window = data["window"]
        results = [_result(entry, index) for index, entry in enumerate(data["requests"])]
        record = RunRecord(
            config=dict(data["config"]),
            identity=dict(data["identity"]),
            model=str(data["model"]),
            window_start_ns=int(window["start_ns"]),
            window_end_ns=int(window["end_ns"]),
            summary=dict(data["summary"]),
            results=results,
            slo=list(data.get("slo", [])),
            warmup_failed=int(data.get("warmup_failed", 0)),
            export=dict(data.get("export", {})),
            http=dict(data.get("http", {})),
        )
    except RunRecordError as error:
        raise RunRecordError(f"{where}: {error}") from None
    except (KeyError, TypeError, ValueError) as error:
        raise RunRecordError(f"{where}: malformed run record ({_describe(error)})") from None
    return record


def _result(entry: object, index: int) -> RequestResult:
    if not isinstance(entry, dict):
        raise RunRecordError(f"requests[{index}]: expected an object")
    try:
        return RequestResult.from_dict(entry)
    except (KeyError, TypeError, ValueError) as error:
        raise RunRecordError(f"requests[{index}]: {_describe(error)}") from None


def _describe(error: Exception) -> str:
    if isinstance(error, KeyError):
        return f"missing {error.args[0]!r}"
    return str(error)


def _iso(unix_ns: int) -> str:
    moment = datetime.fromtimestamp(unix_ns / 1e9, tz=timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
