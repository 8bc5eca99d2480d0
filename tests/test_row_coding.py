"""Range coding of ecsq's codes by classes of rows (swarm/wire/row_coding.py): lossless, smaller than zstd where
rows differ in magnitude, and a malformed payload refused with a reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.pb import wire_pb2 as pb
from swarm.wire import ecsq, packets, row_coding
from tests.test_ecsq import token_gradients


def ecsq_codes(x: torch.Tensor) -> np.ndarray:
    flat = x.reshape(-1).float()
    return ecsq.encode(flat, ecsq.step_of(flat, float(flat.abs().max())), None).numpy()


def _mixed_rows(rows: int, row: int, spread: float, seed: int) -> np.ndarray:
    """Rows from all zeros to ±127 (every class, widths from 1 to 255), in every mixture, and a -128 now and then."""
    rng = np.random.default_rng(seed)
    scale = 2.0 ** rng.uniform(-spread, 7, size=(rows, 1))
    codes = np.clip(np.round(rng.laplace(size=(rows, row)) * scale), -128, 127).astype(np.int8)
    codes[rng.random(rows) < 0.2] = 0
    return codes


mixed_rows = st.builds(
    _mixed_rows,
    rows=st.integers(1, 40),
    row=st.integers(1, 70),
    spread=st.floats(0.0, 12.0),
    seed=st.integers(0, 2**31 - 1),
)


@settings(max_examples=300, deadline=None)
@given(codes=mixed_rows)
def test_any_codes_come_back_exactly(codes: np.ndarray) -> None:
    row = codes.shape[1]
    data = row_coding.compress(codes.reshape(-1), row)
    assert row_coding.decompress(data, codes.size, row) == codes.tobytes()


def reference_compress(codes: np.ndarray, row: int) -> bytes:
    """The layout as first written (one boolean mask per class): what peers of the first protocol 12 sent."""
    if not codes.size:
        return b""
    q = codes.reshape(-1, row).astype(np.int32)
    keys = reference_class_keys(q)
    classes, of_row = np.unique(keys, return_inverse=True)
    head = [np.array(q.shape, dtype="<u4").tobytes(), np.uint8(len(classes)).tobytes()]
    parts = []
    for c in range(len(classes)):
        sym = q[of_row == c].reshape(-1)
        lo = int(sym.min())
        weights = row_coding._scaled(np.bincount(sym - lo))
        head += [np.int8(lo).tobytes(), np.uint8(len(weights) - 1).tobytes(), weights.tobytes()]
        parts.append((sym - lo, weights))
    row_weights = np.bincount(of_row, minlength=len(classes))
    row_weights = np.maximum(row_weights * 65535 // row_weights.max(), row_weights > 0).astype("<u2")
    head.append(row_weights.tobytes())
    ans = row_coding.AnsCoder()
    for sym, weights in reversed(parts):
        if len(weights) > 1:
            ans.encode_reverse(sym, row_coding._model(weights))
    if len(classes) > 1:
        ans.encode_reverse(of_row.astype(np.int32), row_coding._model(row_weights))
    return b"".join(head) + ans.get_compressed().astype("<u4").tobytes()


def reference_class_keys(q: np.ndarray) -> np.ndarray:
    mean = np.abs(q.astype(np.int32)).mean(axis=1)
    with np.errstate(divide="ignore"):
        half_octaves = np.round(2.0 * np.log2(mean))
    return np.clip(np.nan_to_num(half_octaves, neginf=row_coding._QUIETEST), row_coding._QUIETEST, row_coding._LOUDEST)


@settings(max_examples=200, deadline=None)
@given(codes=mixed_rows)
def test_the_bytes_are_the_first_layouts(codes: np.ndarray) -> None:
    """The one-gather coder (2026-12-06) writes the bytes the one-mask-per-class coder wrote, and reads them:
    peers of either build understand each other."""
    row = codes.shape[1]
    assert np.array_equal(row_coding._class_keys(codes), reference_class_keys(codes))
    data = reference_compress(codes.reshape(-1), row)
    assert row_coding.compress(codes.reshape(-1), row) == data
    assert row_coding.decompress(data, codes.size, row) == codes.tobytes()


def test_the_extremes_come_back_exactly() -> None:
    for codes in (
        np.full(300, -128, np.int8),  # a code the encoder never writes, but any int8 round-trips
        np.arange(-128, 128, dtype=np.int8),
        np.zeros(1, np.int8),
        np.tile(np.array([127, -127], np.int8), 512),
    ):
        for row in (1, 2, codes.size):
            if codes.size % row == 0:
                assert row_coding.decompress(row_coding.compress(codes, row), codes.size, row) == codes.tobytes()
    assert row_coding.compress(np.zeros(0, np.int8), 5) == b"" and row_coding.decompress(b"", 0, 5) == b""


def test_it_is_smaller_than_zstd_where_rows_differ_in_magnitude() -> None:
    """What it is for: token gradients, quiet rows beside loud ones (zstd at the wire's level 1)."""
    codes = ecsq_codes(token_gradients(512, 256, seed=3))
    coded = row_coding.compress(codes, 256)
    zstd = zstandard.ZstdCompressor(level=1).compress(codes.tobytes())
    assert len(coded) < 0.85 * len(zstd)


def test_on_the_wire_ecsq_travels_row_coded_and_decodes_to_what_plain_codes_give() -> None:
    x = token_gradients(64, 256, seed=4).reshape(4, 16, 256)
    coded = pb.Tensor.FromString(packets.tensor_to_pb(x, "ecsq", zstd=True).SerializeToString())
    plain = packets.tensor_to_pb(x, "ecsq")
    assert coded.compression == pb.ROWS and plain.compression == pb.COMPRESSION_NONE
    assert torch.equal(packets.tensor_from_pb(coded), packets.tensor_from_pb(plain))
    for shape in ((), (7,), (0, 3)):  # one row, or none
        y = torch.randn(shape)
        assert torch.equal(
            packets.tensor_from_pb(packets.tensor_to_pb(y, "ecsq", zstd=True)),
            packets.tensor_from_pb(packets.tensor_to_pb(y, "ecsq")),
        )


def test_only_ecsq_travels_row_coded() -> None:
    msg = packets.tensor_to_pb(torch.randn(8, 64), "int8")
    msg.compression = pb.ROWS
    with pytest.raises(packets.WireError, match="codec int8 is never row-coded; only ecsq are"):
        packets.tensor_from_pb(msg)


def _header(rows: int, row: int, classes: list[tuple[int, list[int]]], row_weights: list[int]) -> bytes:
    out = np.array([rows, row], "<u4").tobytes() + bytes([len(classes)])
    for lo, weights in classes:
        out += np.int8(lo).tobytes() + bytes([len(weights) - 1]) + bytes(weights)
    return out + np.array(row_weights, "<u2").tobytes()


GOOD = row_coding.compress(np.array([0, 1, -1, 0, 5, -7, 3, 0] * 4, np.int8), 8)


@pytest.mark.parametrize(
    ("data", "n", "row", "match"),
    [
        (b"", 8, 8, "ends inside the shape"),
        (GOOD, 32, 16, "declares 4 rows of 8; the header implies 2 of 16"),
        (GOOD, 30, 8, "30 codes are not rows of 8"),
        (b"\x01", 0, 8, "payload of 1 bytes for an empty tensor"),
        (GOOD[:8], 32, 8, "ends inside the number of classes"),
        (_header(1, 4, [], [])[:8] + b"\x00", 4, 4, "has 0 classes"),
        (_header(1, 4, [], [])[:8] + b"\x21", 4, 4, "has 33 classes"),
        (_header(1, 4, [(120, [1] * 9)], [1]), 4, 4, "codes 120..128 leave int8's range"),
        (_header(1, 4, [(0, [0, 0])], [1]), 4, 4, "class 0 has no weight on any code"),
        (_header(1, 4, [(0, [1, 1])], [0]), 4, 4, "no class has any weight among the rows"),
        (_header(1, 4, [(0, [1, 1, 1])], [1])[:-3], 4, 4, "ends inside class 0's weights"),
        (_header(1, 4, [(0, [1, 1])], [1]) + b"\x00\x01", 4, 4, "are not whole u32 words"),
        (GOOD + b"\xff" * 64, 32, 8, "go on past the tensor's codes"),
    ],
)
def test_malformed_payloads_are_refused(data: bytes, n: int, row: int, match: str) -> None:
    with pytest.raises(row_coding.RowCodingError, match=match):
        row_coding.decompress(data, n, row)


@settings(max_examples=300, deadline=None)
@given(garbage=st.binary(max_size=200), n=st.sampled_from([0, 8, 32, 96]))
def test_arbitrary_bytes_decode_to_the_exact_size_or_are_refused(garbage: bytes, n: int) -> None:
    """A stranger's bytes never crash or hang the receiver: an error, or exactly n codes."""
    for data in (garbage, GOOD[:12] + garbage):
        try:
            out = row_coding.decompress(data, n, 8)
        except row_coding.RowCodingError:
            continue
        assert len(out) == n


def test_words_changed_in_flight_or_read_with_another_model_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flipped bit, or a coder of another version that turned the same weights into a slightly different model,
    would decode to other codes inside the header's ranges; the rANS decoder must end exactly in the state the
    encoder started from, and does not."""
    codes = ecsq_codes(token_gradients(64, 256, seed=9))
    data = row_coding.compress(codes, 256)
    inside = len(data) - 128  # a byte well inside the coder's words
    for bit in range(0, 32, 3):
        bad = bytearray(data)
        bad[inside + bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(row_coding.RowCodingError):
            row_coding.decompress(bytes(bad), codes.size, 256)
    exact = row_coding._model
    for i in range(20):
        monkeypatch.setattr(
            row_coding, "_model", lambda w, i=i: exact(w * (1 + 0.01 * (np.arange(len(w)) == i % len(w))))
        )
        with pytest.raises(row_coding.RowCodingError):
            row_coding.decompress(data, codes.size, 256)
