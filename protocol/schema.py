"""Field kinds: how one field of a message is written to msgpack and validated when read.

A struct (message or nested record) declares ``FIELDS``: a tuple of ``(name, kind)``. Each kind is
an object with ``pack(value)`` (Python value -> msgpack-able value) and ``unpack(value, where)``
(msgpack value -> validated Python value, raising :class:`ProtocolError` that names ``where``).

Arrays travel as a msgpack map ``{"dtype": "<i4", "shape": [n], "data": <bin>}``: raw little-endian
bytes, never a list of numbers, never pickled. Decoded arrays are zero-copy, read-only views of the
received buffer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from protocol.errors import ProtocolError

# Size limits (per field). A message over them is refused before any large allocation.
MAX_STR_CHARS = 1 << 20          # 1 Mi characters for any one string (prompts, texts)
MAX_ARRAY_ITEMS = 1 << 22        # 4 Mi elements in one array (tokens per sample)
MAX_LIST_ITEMS = 1 << 16         # samples per result, tensors per manifest, ids per ack
MAX_MAP_ITEMS = 1 << 10          # entries in a metadata / reward-parts / timing map


class Kind:
    """A field kind: ``pack`` for the wire, ``unpack`` with validation."""

    name = "any"

    def pack(self, value: Any) -> Any:
        return value

    def unpack(self, value: Any, where: str) -> Any:  # pragma: no cover - overridden
        return value


def _type_error(where: str, expected: str, value: Any) -> ProtocolError:
    return ProtocolError(f"{where}: expected {expected}, got {type(value).__name__}")


class Str(Kind):
    name = "str"

    def unpack(self, value: Any, where: str) -> str:
        if type(value) is not str:
            raise _type_error(where, "a string", value)
        if len(value) > MAX_STR_CHARS:
            raise ProtocolError(f"{where}: string of {len(value)} characters exceeds {MAX_STR_CHARS}")
        return value


class Int(Kind):
    name = "int"

    def __init__(self, min_value: int | None = None):
        self.min_value = min_value

    def unpack(self, value: Any, where: str) -> int:
        if type(value) is not int:
            raise _type_error(where, "an integer", value)
        if self.min_value is not None and value < self.min_value:
            raise ProtocolError(f"{where}: {value} is below the minimum {self.min_value}")
        return value


class Float(Kind):
    name = "float"

    def __init__(self, finite: bool = True):
        self.finite = finite

    def pack(self, value: Any) -> float:
        return float(value)

    def unpack(self, value: Any, where: str) -> float:
        if type(value) is not float:
            if type(value) is int:
                value = float(value)
            else:
                raise _type_error(where, "a float", value)
        if self.finite and not math.isfinite(value):
            raise ProtocolError(f"{where}: must be finite, got {value}")
        return value


class Bool(Kind):
    name = "bool"

    def unpack(self, value: Any, where: str) -> bool:
        if type(value) is not bool:
            raise _type_error(where, "a boolean", value)
        return value


class Optional(Kind):
    def __init__(self, inner: Kind):
        self.inner = inner
        self.name = f"optional {inner.name}"

    def pack(self, value: Any) -> Any:
        return None if value is None else self.inner.pack(value)

    def unpack(self, value: Any, where: str) -> Any:
        return None if value is None else self.inner.unpack(value, where)


class StrList(Kind):
    name = "list of strings"

    def unpack(self, value: Any, where: str) -> list[str]:
        if type(value) is not list:
            raise _type_error(where, "a list of strings", value)
        if len(value) > MAX_LIST_ITEMS:
            raise ProtocolError(f"{where}: {len(value)} items exceed {MAX_LIST_ITEMS}")
        for i, item in enumerate(value):
            if type(item) is not str:
                raise _type_error(f"{where}[{i}]", "a string", item)
        return value


class IntList(Kind):
    name = "list of integers"

    def unpack(self, value: Any, where: str) -> list[int]:
        if type(value) is not list:
            raise _type_error(where, "a list of integers", value)
        if len(value) > 64:
            raise ProtocolError(f"{where}: {len(value)} items exceed 64")
        for i, item in enumerate(value):
            if type(item) is not int or item < 0:
                raise ProtocolError(f"{where}[{i}]: expected a non-negative integer, got {item!r}")
        return value


class FloatMap(Kind):
    """``dict[str, float]`` with finite values (reward parts, timings)."""

    name = "map of string to float"

    def pack(self, value: Any) -> dict:
        return {k: float(v) for k, v in value.items()}

    def unpack(self, value: Any, where: str) -> dict[str, float]:
        if type(value) is not dict:
            raise _type_error(where, "a map of string to float", value)
        if len(value) > MAX_MAP_ITEMS:
            raise ProtocolError(f"{where}: {len(value)} entries exceed {MAX_MAP_ITEMS}")
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                raise _type_error(f"{where} key", "a string", k)
            if type(v) is int:
                v = float(v)
            if type(v) is not float:
                raise _type_error(f"{where}[{k!r}]", "a float", v)
            if not math.isfinite(v):
                raise ProtocolError(f"{where}[{k!r}]: must be finite, got {v}")
            out[k] = v
        return out


_PLAIN = (str, int, float, bool, type(None), bytes)


def _check_plain(value: Any, where: str, depth: int) -> None:
    if depth > 8:
        raise ProtocolError(f"{where}: nested deeper than 8 levels")
    t = type(value)
    if t in _PLAIN:
        return
    if t is list:
        if len(value) > MAX_LIST_ITEMS:
            raise ProtocolError(f"{where}: {len(value)} items exceed {MAX_LIST_ITEMS}")
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]", depth + 1)
        return
    if t is dict:
        if len(value) > MAX_MAP_ITEMS:
            raise ProtocolError(f"{where}: {len(value)} entries exceed {MAX_MAP_ITEMS}")
        for k, v in value.items():
            if type(k) is not str:
                raise _type_error(f"{where} key", "a string", k)
            _check_plain(v, f"{where}[{k!r}]", depth + 1)
        return
    raise _type_error(where, "a plain value (str, int, float, bool, None, bytes, list, map)", value)


class PlainMap(Kind):
    """A map of string keys to plain msgpack values (metadata, sampling params, control args)."""

    name = "map"

    def pack(self, value: Any) -> dict:
        return dict(value)

    def unpack(self, value: Any, where: str) -> dict[str, Any]:
        if type(value) is not dict:
            raise _type_error(where, "a map", value)
        _check_plain(value, where, 0)
        return value


class Array(Kind):
    """A 1-D numpy array of a fixed dtype, sent as raw little-endian bytes."""

    def __init__(self, dtype: str, finite: bool = False):
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.wire_dtype = self.dtype.str
        self.finite = finite
        self.name = f"array of {self.dtype.name}"

    def pack(self, value: Any) -> dict:
        arr = np.asarray(value)
        if arr.dtype != self.dtype or not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr, dtype=self.dtype)
        return {"dtype": self.wire_dtype, "shape": [arr.shape[0]] if arr.ndim else [1], "data": arr.data}

    def unpack(self, value: Any, where: str) -> np.ndarray:
        if type(value) is not dict:
            raise _type_error(where, f"an {self.name} map {{dtype, shape, data}}", value)
        try:
            dtype, shape, data = value["dtype"], value["shape"], value["data"]
        except KeyError as e:
            raise ProtocolError(f"{where}: array map lacks key {e.args[0]!r}") from None
        if dtype != self.wire_dtype:
            raise ProtocolError(f"{where}: dtype {dtype!r}, expected {self.wire_dtype!r}")
        if type(shape) is not list or len(shape) != 1 or type(shape[0]) is not int or shape[0] < 0:
            raise ProtocolError(f"{where}: shape must be [n] with n >= 0, got {shape!r}")
        n = shape[0]
        if n > MAX_ARRAY_ITEMS:
            raise ProtocolError(f"{where}: {n} elements exceed {MAX_ARRAY_ITEMS}")
        if type(data) is not bytes:
            raise _type_error(f"{where}.data", "binary data", data)
        if len(data) != n * self.dtype.itemsize:
            raise ProtocolError(
                f"{where}: {len(data)} bytes do not match shape [{n}] of {self.dtype.name}")
        arr = np.frombuffer(data, dtype=self.dtype)
        # One float64 reduction catches any NaN or inf (float32 values cannot overflow it).
        if self.finite and n and not math.isfinite(arr.sum(dtype=np.float64)):
            raise ProtocolError(f"{where}: contains NaN or infinite values")
        return arr


class Frame(Kind):
    """Raw bytes sent as their own ZeroMQ frame after the body (weight chunks): zero-copy."""

    name = "raw frame"


class StructList(Kind):
    def __init__(self, struct: type):
        self.struct = struct
        self.name = f"list of {struct.__name__}"

    def pack(self, value: Any) -> list:
        return [item.to_wire() for item in value]

    def unpack(self, value: Any, where: str) -> list:
        if type(value) is not list:
            raise _type_error(where, self.name, value)
        if len(value) > MAX_LIST_ITEMS:
            raise ProtocolError(f"{where}: {len(value)} items exceed {MAX_LIST_ITEMS}")
        from_wire = self.struct.from_wire
        return [from_wire(item, f"{where}[{i}]") for i, item in enumerate(value)]


class Struct:
    """Base of messages and nested records. Subclasses are dataclasses that declare ``FIELDS``."""

    FIELDS: tuple[tuple[str, Kind], ...] = ()

    def to_wire(self) -> dict:
        return {name: kind.pack(getattr(self, name)) for name, kind in self.FIELDS
                if not isinstance(kind, Frame)}

    @classmethod
    def from_wire(cls, body: Any, where: str | None = None):
        where = where or cls.__name__
        if type(body) is not dict:
            raise _type_error(where, "a map", body)
        values = {}
        for name, kind in cls.FIELDS:
            if isinstance(kind, Frame):
                continue
            try:
                raw = body[name]
            except KeyError:
                # A sender of an older minor version may omit a field that has a default.
                if name not in cls._defaulted():
                    raise ProtocolError(f"{where}.{name}: missing") from None
                continue
            values[name] = kind.unpack(raw, f"{where}.{name}")
        # Unknown keys are ignored: a newer minor version may add optional fields.
        return cls(**values)

    @classmethod
    def _defaulted(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls)
                         if f.default is not dataclasses.MISSING
                         or f.default_factory is not dataclasses.MISSING)
