"""The write-ahead spool: an export is acknowledged only once its bytes are on disk.

``Pipeline.consume_traces`` (on the receivers' threads) appends each accepted export request,
serialised, to the spool and waits until it is durable before the receiver answers OK. Appends
take one short lock (a sequence number, one ``write``); the fsync runs outside it, by whichever
waiting caller finds none running (group commit): one fsync covers every append made before it
started, so an acknowledgement waits for at most the fsync in progress plus its own group's.

Records live in segment files (``segment-<first seq>.spool`` in the spool's directory), each
opening with ``_MAGIC``; a segment is rotated at ``segment_bytes`` or ``segment_age_s``. Every
record is ``length (u32) | crc32 (u32) | seq (u64) | payload``, the CRC over seq and payload:
a record cut short by a crash, or whose CRC fails, ends its segment's replay with one log line
(``torn_records``). Sequence numbers increase by one per append, across segments.

A segment is deleted once every record in it was processed: the pipeline tells ``release(low)``
the lowest sequence number still needed (its assembler's pending traces, the appends not yet
handed to it, see ``lowest_unfinished``), and each segment whose last record is below it goes.
At start ``replay()`` yields the records of the surviving segments (after a crash) in order;
they stay where they are (never spooled twice) and go the same way once processed.

``max_bytes`` caps the segment files: an append that would pass it raises ``Overloaded``, so
receivers answer RESOURCE_EXHAUSTED / 429 with a retry hint instead of the spool growing without
bound.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from tokentrace.agent import semconv
from tokentrace.collector.consumer import Overloaded
from tokentrace.collector.self_telemetry import ComponentTelemetry

_log = logging.getLogger(__name__)

_MAGIC: Final = b"TTSPOOL1"
_HEADER: Final = struct.Struct("<IIQ")
"""Payload length, CRC-32 of (seq, payload), seq."""
_SEQ: Final = struct.Struct("<Q")
_PREFIX: Final = "segment-"
_SUFFIX: Final = ".spool"
_LOCK_FILE: Final = "lock"
"""Held (``lockf``) by the collector process using the spool."""
_MAX_RECORD_BYTES: Final = 1 << 31
_FSYNC_BOUNDS_S: Final = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_RETRY_AFTER_S: Final = 1.0


class SpoolError(OSError):
    """The spool cannot make appends durable (an fsync failed): nothing more is acknowledged."""


@dataclass(slots=True)
class _Segment:
    path: Path
    first_seq: int
    last_seq: int
    """-1 while it holds no record known to be whole."""
    size: int
    created: float
    fd: int | None = None


def _segment_name(first_seq: int) -> str:
    return f"{_PREFIX}{first_seq:020d}{_SUFFIX}"


def _encode(seq: int, payload: bytes) -> bytes:
    seq_bytes = _SEQ.pack(seq)
    crc = zlib.crc32(payload, zlib.crc32(seq_bytes))
    return _HEADER.pack(len(payload), crc, seq) + payload


class Spool:
    """One collector's write-ahead spool of export requests (module docstring)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_bytes: int,
        segment_bytes: int,
        segment_age_s: float,
        clock: Callable[[], float] = time.monotonic,
        telemetry: ComponentTelemetry | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._max_bytes = max_bytes
        self._segment_bytes = segment_bytes
        self._segment_age_s = segment_age_s
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._closed: list[_Segment] = []
        """Segments no longer appended to, oldest first (the surviving ones after a crash)."""
        self._active: _Segment | None = None
        self._next_seq = 0
        self._inflight: set[int] = set()
        self._durable_seq = -1
        self._syncing = False
        self._broken: OSError | None = None
        self._unsynced_fds: list[int] = []
        """Rotated segments' descriptors: the next fsync covers them, then closes them."""
        self._dir_dirty = False
        self._bytes = 0
        self._replaying = False
        self._dir_fd = os.open(self.directory, os.O_RDONLY)
        # One collector process per spool: two would replay and delete each other's segments.
        # A POSIX record lock is the process's, so a spool re-opened in the same process (after
        # a simulated crash) is not refused, and the kernel drops it when the process dies.
        self._lock_fd = os.open(self.directory / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.lockf(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            _close(self._lock_fd)
            _close(self._dir_fd)
            raise SpoolError(
                f"spool directory {self.directory} is in use by another collector: give each "
                "collector a durability directory of its own"
            ) from None
        for path in sorted(self.directory.glob(f"{_PREFIX}*{_SUFFIX}")):
            try:
                first_seq = int(path.name[len(_PREFIX) : -len(_SUFFIX)])
                size = path.stat().st_size
            except (ValueError, OSError):
                _log.warning("spool: ignoring %s (not a segment of this spool)", path)
                continue
            self._closed.append(_Segment(path, first_seq, -1, size, clock()))
            self._bytes += size
        self._closed.sort(key=lambda segment: segment.first_seq)
        self._to_replay = list(self._closed)
        if self._closed:
            self._next_seq = self._closed[-1].first_seq + 1
        self.replayed_requests = 0
        self.torn_records = 0
        self.refused_requests = 0
        self.fsyncs = 0
        self._fsync_duration = None
        if telemetry is not None:
            self._fsync_duration = telemetry.histogram(
                semconv.SELF_METRIC_SPOOL_FSYNC_DURATION,
                _FSYNC_BOUNDS_S,
                description="one group commit's fsync",
                unit=semconv.METRIC_UNIT_SECONDS,
            )
            telemetry.observe_each(
                counters={
                    semconv.SELF_METRIC_SPOOL_REPLAYED_REQUESTS: (
                        "spooled requests replayed at start",
                        lambda: self.replayed_requests,
                    ),
                    semconv.SELF_METRIC_SPOOL_TORN_RECORDS: (
                        "spool records ignored at replay",
                        lambda: self.torn_records,
                    ),
                    semconv.SELF_METRIC_SPOOL_REFUSED_REQUESTS: (
                        "exports refused: spool full",
                        lambda: self.refused_requests,
                    ),
                },
                gauges={
                    semconv.SELF_METRIC_SPOOL_SEGMENTS: (
                        "spool segment files",
                        lambda: self.segments,
                    ),
                },
            )
            telemetry.gauge(
                semconv.SELF_METRIC_SPOOL_BYTES,
                lambda: self._bytes,
                description="bytes in the spool's segment files",
                unit=semconv.METRIC_UNIT_BYTES,
            )

    # --- state ---------------------------------------------------------------------------------
    @property
    def size_bytes(self) -> int:
        return self._bytes

    @property
    def segments(self) -> int:
        return len(self._closed) + (self._active is not None)

    @property
    def next_seq(self) -> int:
        return self._next_seq

    # --- replay --------------------------------------------------------------------------------
    def replay(self) -> Iterator[tuple[int, bytes]]:
        """The records of the segments that survived the last run, in order, as (seq, payload).

        Call once, before the first append; segments are kept (not deleted) until it is done."""
        self._replaying = True
        try:
            to_replay, self._to_replay = self._to_replay, []
            for segment in to_replay:
                for seq, payload in self._read_segment(segment):
                    segment.last_seq = seq
                    self._next_seq = max(self._next_seq, seq + 1)
                    self.replayed_requests += 1
                    yield seq, payload
        finally:
            self._replaying = False

    def _read_segment(self, segment: _Segment) -> Iterator[tuple[int, bytes]]:
        try:
            data = segment.path.read_bytes()
        except OSError as error:
            _log.warning("spool: cannot read %s (%s); skipping it", segment.path, error)
            return
        if not data.startswith(_MAGIC):
            if data:  # an empty file: a crash right after creating it
                self._torn(segment, 0, "no spool header")
            return
        offset = len(_MAGIC)
        expected_seq: int | None = None
        while offset < len(data):
            if offset + _HEADER.size > len(data):
                self._torn(segment, offset, "record header cut short")
                return
            length, crc, seq = _HEADER.unpack_from(data, offset)
            start = offset + _HEADER.size
            end = start + length
            if end > len(data):
                self._torn(segment, offset, "record cut short")
                return
            payload = data[start:end]
            if zlib.crc32(payload, zlib.crc32(_SEQ.pack(seq))) != crc or (
                expected_seq is not None and seq != expected_seq
            ):
                self._torn(segment, offset, "CRC mismatch")
                return
            expected_seq = seq + 1
            offset = end
            yield seq, payload

    def _torn(self, segment: _Segment, offset: int, why: str) -> None:
        self.torn_records += 1
        _log.warning(
            "spool: %s at byte %d of %s (a write cut short by a crash); the rest of that "
            "segment is ignored",
            why,
            offset,
            segment.path.name,
        )

    # --- appending -----------------------------------------------------------------------------
    def append(self, payload: bytes) -> int:
        """Write one record (not durable yet: ``wait_durable``); returns its sequence number,
        which stays unfinished until ``done``. Raises ``Overloaded`` at ``max_bytes``."""
        if len(payload) >= _MAX_RECORD_BYTES:
            raise ValueError(f"a spool record holds at most {_MAX_RECORD_BYTES} bytes")
        record_size = _HEADER.size + len(payload)
        with self._cond:
            if self._broken is not None:
                raise SpoolError(f"the spool cannot make writes durable: {self._broken}")
            if self._to_replay:
                raise RuntimeError("replay() the surviving segments before appending")
            if self._bytes + record_size > self._max_bytes:
                self.refused_requests += 1
                raise Overloaded(
                    f"the durability spool holds {self._bytes} bytes "
                    f"(max_size_mib={self._max_bytes / 1048576:g})",
                    retry_after_s=_RETRY_AFTER_S,
                )
            active = self._active
            now = self._clock()
            if active is not None and (
                active.size >= self._segment_bytes or now - active.created >= self._segment_age_s
            ):
                self._rotate()
                active = None
            seq = self._next_seq
            if active is None:
                active = self._open_segment(seq, now)
            assert active.fd is not None
            _write_all(active.fd, _encode(seq, payload))
            self._next_seq = seq + 1
            active.last_seq = seq
            active.size += record_size
            self._bytes += record_size
            self._inflight.add(seq)
            return seq

    def _open_segment(self, first_seq: int, now: float) -> _Segment:
        path = self.directory / _segment_name(first_seq)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        _write_all(fd, _MAGIC)
        segment = _Segment(path, first_seq, -1, len(_MAGIC), now, fd)
        self._active = segment
        self._bytes += len(_MAGIC)
        self._dir_dirty = True
        return segment

    def _rotate(self) -> None:
        """Under the lock: the active segment is closed for appends (its fd synced later)."""
        active = self._active
        if active is None:
            return
        self._active = None
        self._closed.append(active)
        if active.fd is not None:
            self._unsynced_fds.append(active.fd)
            active.fd = None

    def wait_durable(self, seq: int) -> None:
        """Return once record ``seq`` is on disk: run the group's fsync, or wait for the one in
        progress (and then perhaps run the next). Raises ``SpoolError`` when an fsync failed."""
        with self._cond:
            while self._durable_seq < seq:
                if self._broken is not None:
                    raise SpoolError(f"the spool cannot make writes durable: {self._broken}")
                if self._syncing:
                    self._cond.wait()
                    continue
                self._syncing = True
                target = self._next_seq - 1
                fds = list(self._unsynced_fds)
                self._unsynced_fds.clear()
                active_fd = self._active.fd if self._active is not None else None
                sync_dir, self._dir_dirty = self._dir_dirty, False
                self._cond.release()
                error: OSError | None = None
                started = time.perf_counter()
                try:
                    for fd in fds:
                        os.fsync(fd)
                    if active_fd is not None:
                        os.fsync(active_fd)
                    if sync_dir:
                        os.fsync(self._dir_fd)
                except OSError as failed:
                    error = failed
                finally:
                    for fd in fds:
                        _close(fd)
                    elapsed = time.perf_counter() - started
                    self._cond.acquire()
                self.fsyncs += 1
                if self._fsync_duration is not None:
                    self._fsync_duration.record(elapsed)
                self._syncing = False
                if error is not None:
                    self._broken = error
                    _log.error("spool: fsync failed, no further export is acknowledged: %s", error)
                else:
                    self._durable_seq = max(self._durable_seq, target)
                self._cond.notify_all()

    def done(self, seq: int) -> None:
        """Record ``seq`` was handed on (or refused): ``lowest_unfinished`` no longer holds it."""
        with self._cond:
            self._inflight.discard(seq)

    def lowest_unfinished(self) -> int:
        """The lowest sequence number appended but not ``done``, else the next one to come."""
        with self._cond:
            return min(self._inflight) if self._inflight else self._next_seq

    # --- deleting ------------------------------------------------------------------------------
    def release(self, low: int, *, active_too: bool = False) -> int:
        """Delete every segment whose records are all below ``low`` (each processed and handed
        to the exporters); the active one only once it is older than ``segment_age_s`` (or
        ``active_too``, at shutdown). Returns how many were deleted."""
        victims: list[_Segment] = []
        with self._cond:
            if self._replaying or self._to_replay:
                return 0
            active = self._active
            if (
                active is not None
                and active.last_seq < low
                and (active_too or self._clock() - active.created >= self._segment_age_s)
            ):
                self._rotate()
            keep = []
            for segment in self._closed:
                if segment.last_seq < low:
                    victims.append(segment)
                    self._bytes -= segment.size
                else:
                    keep.append(segment)
            self._closed = keep
        for segment in victims:
            try:
                segment.path.unlink()
            except FileNotFoundError:
                pass
            except OSError as error:
                _log.warning("spool: cannot delete %s: %s", segment.path, error)
        return len(victims)

    def close(self) -> None:
        """Close the files (what is still spooled stays, for the next start to replay)."""
        with self._cond:
            while self._syncing:
                self._cond.wait()
            self._rotate()
            fds, self._unsynced_fds = self._unsynced_fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.fsync(fd)
            _close(fd)
        _close(self._dir_fd)
        _close(self._lock_fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
