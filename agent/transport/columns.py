"""One record column (a list of Python values) to an Arrow array, without ``pyarrow.array`` where it can.

Why: the first ``pyarrow.array`` call of a process imports pandas (pyarrow's pandas shim asks whether the
values are a pandas object; pyarrow 26): 180 ms and +47 MB of resident memory (``python
bench/spool_encode.py``, dev VM), in every rank of a user's job, on the spool writer's thread, which holds
the GIL through most of an import. The training process has no other use for pandas. The record schemas'
columns are of five types, whose Arrow layout is a validity bitmap and one or two plain buffers, built
here from ``array.array`` and bytes. The price, on the writer's thread: 1.5-2.1 µs per row for a batch
of 200, against 1.0-1.35 with ``pyarrow.array`` (``Array.from_buffers`` alone costs ~5 µs per column).

Only values of the column's own Python type (or a subclass: numpy's float64, torch's version string) take
that path: ``float`` or an exactly representable ``int`` for a double, ``int`` for an integer, ``bool``,
``str``, ``None`` as null; for those the array equals ``pyarrow.array``'s. Anything else (numpy's integer
or float32 scalars, a wrong type, an out-of-range integer) goes to ``pyarrow.array``, which decides as
before what it accepts and what it rejects.
"""

from __future__ import annotations

import array
import itertools

import pyarrow as pa

_FLOAT_EXACT = 2 ** 53  # pyarrow refuses an int a double cannot hold exactly
_FLOAT64, _INT64, _INT32, _BOOL, _STRING = pa.float64(), pa.int64(), pa.int32(), pa.bool_(), pa.string()
_INT_CODES = {_INT64.id: "q", _INT32.id: "i"}


def column(values: list | tuple, arrow_type: pa.DataType) -> pa.Array:
    """``pyarrow.array(values, type=arrow_type)``, built from buffers where the values allow it."""
    try:
        built = _from_buffers(values, arrow_type)
    except Exception:  # an odd value: pyarrow.array below decides, as before
        built = None
    return built if built is not None else pa.array(values, type=arrow_type)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and type(v) is not bool  # pyarrow refuses a bool in an integer column


def _all(data: list | tuple, exact: set, test) -> bool:
    """Every value of ``data`` is of a type in ``exact`` (one C-level pass), or passes ``test`` (subclasses)."""
    kinds = set(map(type, data))
    return kinds <= exact or all(test(v) for v in data)


def _double(v: object) -> bool:
    return isinstance(v, float) or (_is_int(v) and -_FLOAT_EXACT <= v <= _FLOAT_EXACT)


def _bitmap(flags: list | tuple) -> pa.Buffer:
    bits = bytearray((len(flags) + 7) // 8)
    for i, flag in enumerate(flags):
        if flag:
            bits[i >> 3] |= 1 << (i & 7)
    return pa.py_buffer(bits)


def _from_buffers(values: list | tuple, arrow_type: pa.DataType) -> pa.Array | None:
    n = len(values)
    nulls = values.count(None)
    validity = _bitmap([v is not None for v in values]) if nulls else None
    tid = arrow_type.id  # (an int: a DataType's == is a call into Arrow)
    if tid == _FLOAT64.id:
        data = [0.0 if v is None else v for v in values] if nulls else values
        if not _all(data, {float}, _double):
            return None
        return pa.Array.from_buffers(arrow_type, n, [validity, pa.py_buffer(array.array("d", data))], null_count=nulls)
    code = _INT_CODES.get(tid)
    if code is not None:
        data = [0 if v is None else v for v in values] if nulls else values
        if not _all(data, {int}, _is_int):
            return None
        return pa.Array.from_buffers(arrow_type, n, [validity, pa.py_buffer(array.array(code, data))], null_count=nulls)
    if tid == _BOOL.id:
        data = [False if v is None else v for v in values] if nulls else values
        if not _all(data, {bool}, lambda v: type(v) is bool):
            return None
        return pa.Array.from_buffers(arrow_type, n, [validity, _bitmap(data)], null_count=nulls)
    if tid == _STRING.id:
        texts = [v if v is not None else "" for v in values] if nulls else values
        if not _all(texts, {str}, lambda v: isinstance(v, str)):
            return None
        joined = "".join(texts)
        data = joined.encode("utf-8")
        if len(data) == len(joined):  # ASCII: a value's bytes are its characters
            lengths = map(len, texts)
        else:
            encoded = [v.encode("utf-8") for v in texts]
            lengths, data = map(len, encoded), b"".join(encoded)
        # int32 offsets: a column past 2 GiB overflows here and goes to pyarrow.array
        offsets = array.array("i", itertools.accumulate(lengths, initial=0))
        return pa.Array.from_buffers(arrow_type, n, [validity, pa.py_buffer(offsets), pa.py_buffer(data)],
                                     null_count=nulls)
    return None
