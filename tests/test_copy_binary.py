"""COPY's binary format as the bulk writer packs it (tracer/backends/mlflow_bulk_copy.py),
read back field by field here: each row's values, in order, whatever repeats between rows."""

from __future__ import annotations

import struct

from tracer.backends.mlflow_bulk_copy import _PACKERS, copy_binary


def _read(data: bytes, kinds: list[str], codec: str) -> list[list[object]]:
    """The rows of ``data`` (COPY binary): per field its length (-1: NULL), then its bytes."""
    assert data.startswith(b"PGCOPY\n\xff\r\n\x00")
    pos = 11 + 8  # signature, flags, header extension length
    rows = []
    while True:
        (count,) = struct.unpack_from("!h", data, pos)
        pos += 2
        if count == -1:
            assert pos == len(data)
            return rows
        assert count == len(kinds)
        row: list[object] = []
        for kind in kinds:
            (length,) = struct.unpack_from("!i", data, pos)
            pos += 4
            if length == -1:
                row.append(None)
                continue
            raw = data[pos : pos + length]
            pos += length
            if kind == "text":
                row.append(raw.decode(codec))
            else:
                (value,) = struct.unpack("!" + kind, raw)
                row.append(value)
        rows.append(row)


def test_every_value_is_read_back_in_its_row_however_often_it_repeats() -> None:
    columns = ["trace_id", "name", "start", "cost", "content"]
    packers = [_PACKERS[1043], _PACKERS[25], _PACKERS[20], _PACKERS[701], _PACKERS[25]]
    long = "x" * 65 + "é"
    rows = [
        {"trace_id": f"tr-{i // 3}", "name": ("generate", "tool", "généré")[i % 3],
         "start": i * 10**12, "cost": None if i % 2 else i / 3,
         "content": long if i % 2 else ("", "a", long + str(i))[i % 3]}
        for i in range(12)
    ]  # fmt: skip
    kinds = ["text", "text", "q", "d", "text"]
    for codec in ("utf-8", "latin-1"):
        data = copy_binary(rows, columns, packers, codec)
        assert _read(data, kinds, codec) == [[r[c] for c in columns] for r in rows]
