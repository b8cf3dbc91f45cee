"""Plain data in ``marshal`` format version 0, read safely.

``marshal.dumps(value, 0)`` is the cheapest way CPython has to serialise plain data (about a third
of ``json.dumps``' time for the agent's finished requests, with no conversion of bytes or int
arrays first), but ``marshal.loads`` is documented as unsafe against malformed or malicious
input. The node agent reads what agents send over its local socket with ``loads`` below instead:
a reader of our own for the subset version 0 writes for plain values - None, booleans, integers,
floats, bytes, strings, tuples, lists and dicts - that refuses everything else (code objects,
sets, references), bounds nesting and checks every length against the bytes that remain.

Version 0 has no object references and no string interning (versions 1 and 3 added those), and
writes floats as their ``repr``; CPython writes it unchanged in every version that runs the agent.
"""

from __future__ import annotations

import marshal
import struct
from typing import Any, Final, NoReturn

VERSION: Final = 0
MAX_DEPTH: Final = 16
"""Containers nested deeper are refused (the agent's rows nest 5 levels)."""

_INT32: Final = struct.Struct("<i")
_LONG_DIGIT_BITS: Final = 15
_LONG_DIGIT_LIMIT: Final = 1 << _LONG_DIGIT_BITS


def dumps(value: Any) -> bytes:
    """``value`` in version 0. Raises ValueError for a value outside plain data (marshal's own
    check: an object of another type)."""
    return marshal.dumps(value, VERSION)


def loads(data: bytes) -> Any:
    """The one value ``data`` holds. Raises ValueError for anything but the plain-data subset of
    version 0 written whole (trailing bytes included)."""
    reader = _Reader(data)
    value = reader.value(0)
    if reader.position != len(data):
        raise ValueError(f"{len(data) - reader.position} bytes after the value")
    return value


_TAKE_INT32: Final = _INT32.unpack_from
_NONE, _FALSE, _TRUE, _INT, _LONG, _FLOAT, _BYTES, _STR = b"NFTilfsu"
_TUPLE, _LIST, _DICT, _DICT_END = b"([{0"


class _Reader:
    """A cursor over the data; each read checks what remains (``_end`` raises)."""

    __slots__ = ("data", "position")

    def __init__(self, data: bytes) -> None:
        self.data = bytes(data)
        self.position = 0

    def int32(self) -> int:
        position = self.position
        if position + 4 > len(self.data):
            _end()
        self.position = position + 4
        (value,) = _TAKE_INT32(self.data, position)
        return int(value)

    def length(self) -> int:
        """A size that the remaining bytes can hold (each element takes at least one)."""
        count = self.int32()
        left = len(self.data) - self.position
        if count < 0 or count > left:
            raise ValueError(f"a length of {count} with {left} bytes left")
        return count

    def take(self, count: int) -> bytes:
        """The next ``count`` bytes; callers bound ``count`` first (``length``, or a check of
        what came back), as slicing does not."""
        start = self.position
        self.position = start + count
        return self.data[start : start + count]

    def value(self, depth: int) -> Any:
        data = self.data
        position = self.position
        if position >= len(data):
            _end()
        code = data[position]
        self.position = position + 1
        if code == _INT:
            return self.int32()
        if code == _LONG:
            return self.long()
        if code == _STR:
            try:
                return str(self.take(self.length()), "utf-8")
            except UnicodeDecodeError:
                raise ValueError("a string that is not UTF-8") from None
        if code == _NONE:
            return None
        if code == _BYTES:
            return self.take(self.length())
        if code in (_TUPLE, _LIST, _DICT):
            if depth >= MAX_DEPTH:
                raise ValueError(f"containers nested deeper than {MAX_DEPTH}")
            if code == _DICT:
                return self.dict(depth + 1)
            items = [self.value(depth + 1) for _ in range(self.length())]
            return tuple(items) if code == _TUPLE else items
        if code == _TRUE:
            return True
        if code == _FALSE:
            return False
        if code == _FLOAT:
            size = self.byte()  # a float's repr, after a one-byte length
            text = self.take(size)
            if len(text) != size:
                _end()
            try:
                return float(str(text, "ascii"))
            except (UnicodeDecodeError, ValueError):
                raise ValueError("a malformed float") from None
        raise ValueError(f"type code {bytes((code,))!r} is not plain data")

    def byte(self) -> int:
        position = self.position
        if position >= len(self.data):
            _end()
        self.position = position + 1
        return self.data[position]

    def long(self) -> int:
        size = self.int32()
        count = abs(size)
        if 2 * count > len(self.data) - self.position:
            _end()
        digits = struct.unpack_from(f"<{count}H", self.data, self.position) if count else ()
        self.position += 2 * count
        value = 0
        for index, digit in enumerate(digits):
            if digit >= _LONG_DIGIT_LIMIT:
                raise ValueError("a malformed integer")
            value |= digit << (_LONG_DIGIT_BITS * index)
        if digits and digits[-1] == 0:
            raise ValueError("a malformed integer")  # marshal never writes a leading zero digit
        return -value if size < 0 else value

    def dict(self, depth: int) -> dict[Any, Any]:
        result: dict[Any, Any] = {}
        data = self.data
        while True:
            position = self.position
            if position < len(data) and data[position] == _DICT_END:
                self.position = position + 1
                return result
            key = self.value(depth)
            if isinstance(key, list | dict):
                raise ValueError("a dict key that is not hashable")
            try:
                result[key] = self.value(depth)
            except TypeError:  # a tuple key holding a list
                raise ValueError("a dict key that is not hashable") from None


def _end() -> NoReturn:
    raise ValueError("the data ends inside a value")
