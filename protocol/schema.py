"""Field kinds: how one field of a message is written to msgpack and validated when read.

A struct (message or nested record) declares ``FIELDS``: a tuple of ``(name, kind)``. On the wire
a struct is a msgpack array of its field values in that order (``Struct`` below; the frame layout
is in ``protocol.codec``). Each kind is an object with ``pack(value)`` (Python value -> msgpack-able
value) and ``unpack(value, where)`` (msgpack value -> validated Python value, raising
:class:`ProtocolError` that names ``where``).

Arrays travel as msgpack bin: the raw little-endian bytes of a 1-D array, never a list of
numbers, never pickled. The dtype is fixed per field by the schema (``Array("int32")`` is
``<i4``), the length is ``len(data) // itemsize``, so any msgpack reader gets the values back with
``np.frombuffer(unpackb(body)[1][0][5], "<i4")`` (the ``completion_token_ids`` of the first sample
of a ``RolloutResult``). Decoded arrays are zero-copy, read-only views of the received buffer.

This generic path is the reference: it is complete and names the offending field in every error.
The hot messages (``Sample``, ``RolloutResult``) also have a hand-written fast path in
``protocol.messages``; it never accepts what this path refuses, and hands everything it does not
accept (bad input, but also lenient input such as an int reward or a field an older sender left
out) to this path, which decides and writes the error. ``tests/protocol`` checks that they agree.
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
MAX_DEPTH = 8                    # nesting of plain maps and lists (metadata, control args)
MAX_DIMS = 64                    # dimensions of a tensor shape in a weights manifest

_ndarray = np.ndarray


class Kind:
    """A field kind: ``pack`` for the wire, ``unpack`` with validation."""

    name = "any"

    def pack(self, value: Any) -> Any:
        return value

    def unpack(self, value: Any, where: str) -> Any:  # pragma: no cover - overridden
        return value


def _type_error(where: str, expected: str, value: Any) -> ProtocolError:
    return ProtocolError(f"{where}: expected {expected}, got {type(value).__name__}")


def check_str(value: Any, where: str) -> str:
    if type(value) is not str:
        raise _type_error(where, "a string", value)
    if len(value) > MAX_STR_CHARS:
        raise ProtocolError(f"{where}: string of {len(value)} characters exceeds {MAX_STR_CHARS}")
    return value


class Str(Kind):
    name = "str"

    def unpack(self, value: Any, where: str) -> str:
        return check_str(value, where)


class Int(Kind):
    name = "int"

    def __init__(self, min_value: int | None = None, max_value: int | None = None):
        self.min_value = min_value
        self.max_value = max_value

    def unpack(self, value: Any, where: str) -> int:
        if type(value) is not int:
            raise _type_error(where, "an integer", value)
        if self.min_value is not None and value < self.min_value:
            raise ProtocolError(f"{where}: {value} is below the minimum {self.min_value}")
        if self.max_value is not None and value > self.max_value:
            raise ProtocolError(f"{where}: {value} is above the maximum {self.max_value}")
        return value


class Float(Kind):
    name = "float"

    def __init__(self, finite: bool = True, min_value: float | None = None,
                 max_value: float | None = None):
        self.finite = finite
        self.min_value = min_value
        self.max_value = max_value

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
        if self.min_value is not None and not value >= self.min_value:
            raise ProtocolError(f"{where}: {value} is below the minimum {self.min_value}")
        if self.max_value is not None and not value <= self.max_value:
            raise ProtocolError(f"{where}: {value} is above the maximum {self.max_value}")
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
    """A list of strings: at most ``max_items``, each at most ``max_chars`` characters (and not
    empty with ``non_empty``)."""

    name = "list of strings"

    def __init__(self, max_items: int = MAX_LIST_ITEMS, max_chars: int = MAX_STR_CHARS,
                 non_empty: bool = False):
        self.max_items, self.max_chars, self.non_empty = max_items, max_chars, non_empty

    def pack(self, value: Any) -> list:
        return list(value)

    def unpack(self, value: Any, where: str) -> list[str]:
        if type(value) is not list:
            raise _type_error(where, "a list of strings", value)
        if len(value) > self.max_items:
            raise ProtocolError(f"{where}: {len(value)} items exceed {self.max_items}")
        for i, item in enumerate(value):
            if type(item) is not str:
                raise _type_error(f"{where}[{i}]", "a string", item)
            if len(item) > self.max_chars:
                raise ProtocolError(f"{where}[{i}]: string of {len(item)} characters exceeds "
                                    f"{self.max_chars}")
            if self.non_empty and not item:
                raise ProtocolError(f"{where}[{i}]: an empty string")
        return value


class IntList(Kind):
    """A short list of non-negative integers (a tensor shape; token ids): at most ``max_items``,
    each at most ``max_value``."""

    name = "list of integers"

    def __init__(self, max_items: int = MAX_DIMS, max_value: int | None = None):
        self.max_items, self.max_value = max_items, max_value

    def pack(self, value: Any) -> list:
        return [int(v) for v in value]

    def unpack(self, value: Any, where: str) -> list[int]:
        if type(value) is not list:
            raise _type_error(where, "a list of integers", value)
        if len(value) > self.max_items:
            raise ProtocolError(f"{where}: {len(value)} items exceed {self.max_items}")
        top = self.max_value
        for i, item in enumerate(value):
            if type(item) is not int or item < 0 or (top is not None and item > top):
                bound = "" if top is None else f" <= {top}"
                raise ProtocolError(f"{where}[{i}]: expected a non-negative integer{bound}, got {item!r}")
        return value


def is_float_map(value: Any) -> bool:
    """True if ``value`` is already a valid float map (str keys, finite float values)."""
    if type(value) is not dict or len(value) > MAX_MAP_ITEMS:
        return False
    for k, v in value.items():
        # ``v - v`` is 0.0 for finite floats and NaN for NaN and +-inf.
        if type(k) is not str or type(v) is not float or v - v != 0.0:
            return False
    return True


class FloatMap(Kind):
    """``dict[str, float]`` with finite values (reward parts, timings); ints become floats."""

    name = "map of string to float"

    def pack(self, value: Any) -> dict:
        return {k: float(v) for k, v in value.items()}

    def unpack(self, value: Any, where: str) -> dict[str, float]:
        if is_float_map(value):
            return value
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


PLAIN_TYPES = frozenset((str, int, float, bool, type(None), bytes))
_PLAIN = PLAIN_TYPES


def _plain_values(values, depth: int) -> bool:
    for v in values:
        t = type(v)
        if t is str:
            if len(v) > MAX_STR_CHARS:
                return False
        elif t not in _PLAIN and not is_plain(v, depth + 1):
            return False
    return True


def is_plain(value: Any, depth: int = 0) -> bool:
    """True if ``value`` is a plain msgpack value within the limits (the fast check; its
    error-naming twin is :func:`check_plain`)."""
    t = type(value)
    if t in _PLAIN:
        return t is not str or len(value) <= MAX_STR_CHARS
    if depth >= MAX_DEPTH:
        return False
    if t is dict:
        if len(value) > MAX_MAP_ITEMS:
            return False
        for k in value:
            if type(k) is not str:
                return False
        return _plain_values(value.values(), depth)
    if t is list:
        return len(value) <= MAX_LIST_ITEMS and _plain_values(value, depth)
    return False


def check_plain(value: Any, where: str, depth: int = 0) -> None:
    """Raise :class:`ProtocolError` naming the first non-plain part of ``value``."""
    t = type(value)
    if t in _PLAIN:
        if t is str and len(value) > MAX_STR_CHARS:
            raise ProtocolError(f"{where}: string of {len(value)} characters exceeds {MAX_STR_CHARS}")
        return
    if depth >= MAX_DEPTH:
        raise ProtocolError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    if t is list:
        if len(value) > MAX_LIST_ITEMS:
            raise ProtocolError(f"{where}: {len(value)} items exceed {MAX_LIST_ITEMS}")
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]", depth + 1)
        return
    if t is dict:
        if len(value) > MAX_MAP_ITEMS:
            raise ProtocolError(f"{where}: {len(value)} entries exceed {MAX_MAP_ITEMS}")
        for k, v in value.items():
            if type(k) is not str:
                raise _type_error(f"{where} key", "a string", k)
            check_plain(v, f"{where}[{k!r}]", depth + 1)
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
        if not is_plain(value):
            check_plain(value, where)
        return value


# ---------------------------------------------------------------------------------------------
# Arrays


def pack_array(value: Any, dtype: np.dtype) -> bytes:
    """The raw little-endian bytes of a 1-D array of ``dtype``.

    Lists and arrays of another dtype are converted; an integer conversion that would change a
    value (int64 -> int32 overflow) or an array that is not 1-D raises :class:`ProtocolError`.
    """
    if type(value) is not _ndarray or value.dtype is not dtype or value.ndim != 1:
        try:
            src = np.asarray(value)
            arr = np.ascontiguousarray(src, dtype=dtype)
        except (TypeError, ValueError, OverflowError) as e:
            raise ProtocolError(f"cannot convert to an array of {dtype.name} ({e})") from None
        if src.ndim != 1:
            raise ProtocolError(f"expected a 1-D array, got shape {src.shape}")
        if dtype.kind in "iu" and src.dtype != dtype and not np.array_equal(arr, src):
            raise ProtocolError(f"values not representable as {dtype.name}")
        value = arr
    return value.tobytes()


def unpack_array(value: Any, dtype: np.dtype, where: str) -> np.ndarray:
    """Validate raw bytes of a 1-D ``dtype`` array and return a read-only view of them."""
    if type(value) is not bytes:
        raise _type_error(where, f"binary data (raw little-endian {dtype.name} values)", value)
    n, rest = divmod(len(value), dtype.itemsize)
    if rest:
        raise ProtocolError(f"{where}: {len(value)} bytes are not a whole number of "
                            f"{dtype.itemsize}-byte {dtype.name} values")
    if n > MAX_ARRAY_ITEMS:
        raise ProtocolError(f"{where}: {n} elements exceed {MAX_ARRAY_ITEMS}")
    return np.frombuffer(value, dtype)


def all_finite(arr: np.ndarray) -> bool:
    """True if a float array has no NaN or infinity (the exact check of the reference path)."""
    return bool(np.isfinite(arr).all())


def all_non_negative(arr: np.ndarray) -> bool:
    """True if an integer array has no negative value (``argmin`` is cheaper than ``min``)."""
    return not arr.shape[0] or arr.item(arr.argmin()) >= 0


class Array(Kind):
    """A 1-D numpy array of a fixed dtype, sent as its raw little-endian bytes (msgpack bin).

    The dtype is part of the schema (this kind), so it is not repeated on the wire; the length
    is ``len(data) // itemsize``.
    """

    def __init__(self, dtype: str, finite: bool = False, non_negative: bool = False):
        # np.dtype("<i4") is the same object as np.dtype(np.int32) on little-endian hosts, which
        # lets the hot path compare dtypes with ``is``.
        self.dtype = np.dtype(np.dtype(dtype).newbyteorder("<").str)
        self.finite = finite
        self.non_negative = non_negative
        self.name = f"array of {self.dtype.name}"

    def pack(self, value: Any) -> bytes:
        return pack_array(value, self.dtype)

    def unpack(self, value: Any, where: str) -> np.ndarray:
        arr = unpack_array(value, self.dtype, where)
        if self.finite and not all_finite(arr):
            raise ProtocolError(f"{where}: contains NaN or infinite values")
        if self.non_negative and not all_non_negative(arr):
            raise ProtocolError(f"{where}: contains negative values (min {int(arr.min())})")
        return arr


class Frame(Kind):
    """Raw bytes sent as their own ZeroMQ frame after the body (weight chunks): zero-copy."""

    name = "raw frame"


class Nested(Kind):
    """One nested record (a struct) as its own field array."""

    def __init__(self, struct: type):
        self.struct = struct
        self.name = struct.__name__

    def pack(self, value: Any, where: str | None = None) -> list:
        if not isinstance(value, self.struct):
            raise _type_error(where or self.name, f"a {self.name}", value)
        return value.to_wire_checked(where)

    def unpack(self, value: Any, where: str):
        return self.struct.from_wire(value, where)


class StructList(Kind):
    def __init__(self, struct: type):
        self.struct = struct
        self.name = f"list of {struct.__name__}"

    def pack(self, value: Any, where: str | None = None) -> list:
        where = where or self.name
        if not isinstance(value, (list, tuple)):
            raise _type_error(where, self.name, value)
        out = []
        for i, item in enumerate(value):
            if not isinstance(item, self.struct):
                raise _type_error(f"{where}[{i}]", f"a {self.struct.__name__}", item)
            out.append(item.to_wire_checked(f"{where}[{i}]"))
        return out

    def unpack(self, value: Any, where: str) -> list:
        if type(value) is not list:
            raise _type_error(where, self.name, value)
        if len(value) > MAX_LIST_ITEMS:
            raise ProtocolError(f"{where}: {len(value)} items exceed {MAX_LIST_ITEMS}")
        from_wire = self.struct.from_wire
        return [from_wire(item, f"{where}[{i}]") for i, item in enumerate(value)]


# ---------------------------------------------------------------------------------------------
# Structs


def wire(kind: Kind, **field_args: Any) -> Any:
    """A struct field with its wire kind: ``version: int = wire(Int(0))``; ``default=`` or
    ``default_factory=`` as for ``dataclasses.field``."""
    return dataclasses.field(metadata={"kind": kind}, **field_args)


def record(cls: type) -> type:
    """Declare a struct once: a slotted dataclass whose ``FIELDS`` (wire order, kinds) are read
    from its field declarations, so names are never written twice."""
    cls = dataclasses.dataclass(slots=True)(cls)
    cls.FIELDS = tuple((f.name, f.metadata["kind"]) for f in dataclasses.fields(cls))
    return cls


class Struct:
    """Base of messages and nested records. Subclasses are dataclasses that declare ``FIELDS``.

    On the wire a struct is a msgpack array of its field values in ``FIELDS`` order (raw-frame
    fields left out: they travel as frames after the body). A reader ignores values beyond the
    fields it knows (a newer minor version appended them) and gives fields missing at the end
    their defaults (an older minor version did not have them); a missing field without a default
    is an error. ``cross_check(where)`` is the hook for checks across fields (lengths that must
    agree); it runs after every field passed its own kind's check.
    """

    FIELDS: tuple[tuple[str, Kind], ...] = ()

    def to_wire(self) -> list:
        """The msgpack body: a plain list of the field values in ``FIELDS`` order."""
        return self.to_wire_checked()

    def to_wire_checked(self, where: str | None = None) -> list:
        """The reference encoder: every value through its kind's ``pack``; an error names the
        field (``"RolloutResult.samples[2].reward: ..."``)."""
        where = where or type(self).__name__
        out = []
        for name, kind in _wire_fields(type(self)):
            value = getattr(self, name)
            if type(kind) is StructList or type(kind) is Nested:
                out.append(kind.pack(value, f"{where}.{name}"))
                continue
            try:
                out.append(kind.pack(value))
            except Exception as e:
                raise ProtocolError(f"{where}.{name}: {e}") from None
        return out

    @classmethod
    def from_wire(cls, body: Any, where: str | None = None):
        return cls.from_wire_checked(body, where)

    @classmethod
    def from_wire_checked(cls, body: Any, where: str | None = None):
        """The reference decoder: validates field by field and names the first bad one."""
        where = where or cls.__name__
        if type(body) is not list:
            raise _type_error(where, "an array of fields", body)
        fields = _wire_fields(cls)
        values = {}
        # Values beyond the known fields are ignored: a newer minor version appended them.
        for (name, kind), raw in zip(fields, body):
            values[name] = kind.unpack(raw, f"{where}.{name}")
        if len(body) < len(fields):
            # An older minor version had fewer fields: the missing ones take their defaults.
            defaulted = _defaulted(cls)
            for name, _ in fields[len(body):]:
                if name not in defaulted:
                    raise ProtocolError(f"{where}.{name}: missing")
        msg = cls(**values)
        msg.cross_check(where)
        return msg

    def cross_check(self, where: str) -> None:
        """Cross-field checks; raise :class:`ProtocolError` naming the field."""


_WIRE_FIELDS: dict[type, tuple[tuple[str, Kind], ...]] = {}
_DEFAULTED: dict[type, frozenset[str]] = {}


def _wire_fields(cls: type) -> tuple[tuple[str, Kind], ...]:
    """``FIELDS`` without the raw-frame fields (those travel after the body)."""
    fields = _WIRE_FIELDS.get(cls)
    if fields is None:
        fields = _WIRE_FIELDS[cls] = tuple((n, k) for n, k in cls.FIELDS if not isinstance(k, Frame))
    return fields


def _defaulted(cls: type) -> frozenset[str]:
    names = _DEFAULTED.get(cls)
    if names is None:
        names = _DEFAULTED[cls] = frozenset(
            f.name for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
    return names


def wire_field_names(cls: type) -> tuple[str, ...]:
    """Names of the body's values, in wire order: ``body[i]`` is field ``wire_field_names(cls)[i]``."""
    return tuple(name for name, _ in _wire_fields(cls))


def frame_fields(cls: type) -> tuple[str, ...]:
    """Names of the fields that travel as raw frames after the body, in declaration order."""
    return tuple(name for name, kind in cls.FIELDS if isinstance(kind, Frame))
