"""What the fuzz test throws at a live peer: well-formed packets, mutated streams, hostile messages.

Kept apart from ``tests/test_fuzz.py`` (which runs the peer and judges what it does) so each stays short.
"""

from __future__ import annotations

import collections
import random

import numpy as np
import torch
from hypothesis import strategies as st

from swarm.config import MODEL_PRESETS, PROTOCOL_VERSION
from swarm.pb import wire_pb2 as pb
from swarm.wire.packets import Reassembler, WireError, split_packet, tensor_to_pb
from swarm.wire.transport import hello_packet

CFG = MODEL_PRESETS["gpt-tiny"]
B, T = 2, 16
HELLO = hello_packet("upstream", 0, "run", PROTOCOL_VERSION)
HELLO_FRAMES = list(split_packet(HELLO, 0))

FILTERED: collections.Counter = collections.Counter()  # inputs skipped because of finding 1


def activation_packet(hidden: torch.Tensor, targets: torch.Tensor, mb_id: int) -> pb.Packet:
    return pb.Packet(
        activations=pb.Activations(
            mb=pb.MicroBatch(id=mb_id),
            hidden=tensor_to_pb(hidden, "fp32", allow_nonfinite=True),
            targets=tensor_to_pb(targets.to(torch.int16), "raw"),
        )
    )


def good_packet(rng: random.Random, mb_id: int) -> pb.Packet:
    g = torch.Generator().manual_seed(rng.getrandbits(32))
    hidden = torch.randn(B, T, CFG.d_model, generator=g)
    return activation_packet(hidden, torch.randint(0, CFG.vocab_size, (B, T), generator=g), mb_id)


def poisons(packet: pb.Packet) -> bool:
    """Inputs once filtered because they poisoned the weights (finding 1, fixed): nothing is filtered now."""
    return False


def frames_poison(frames: list[pb.Frame]) -> bool:
    """Would any packet these (possibly mutated) frames reassemble into poison the weights?"""
    reasm = Reassembler()
    for f in frames:
        try:
            p = reasm.push(f)
        except WireError:
            return False
        if p is not None and poisons(p):
            return True
    return False


# ---- generated messages ---------------------------------------------------------------------------


def random_frames(rng: random.Random) -> list[pb.Frame]:
    out = list(HELLO_FRAMES) if rng.random() < 0.8 else []
    for _ in range(rng.randint(5, 25)):
        out.append(
            pb.Frame(
                packet_id=rng.choice([0, 1, 2, rng.getrandbits(64)]),
                data=rng.randbytes(rng.choice([0, 1, 7, 64, 300])),
                last=rng.random() < 0.5,
                total_size=rng.choice([0, 1, 64, 300, 1 << 20, (1 << 29) + 1, rng.getrandbits(64)]),
            )
        )
    return out


def raw_messages(rng: random.Random) -> list[bytes]:
    out = [HELLO_FRAMES[0].SerializeToString()] if rng.random() < 0.7 else []
    for _ in range(rng.randint(5, 25)):
        if rng.random() < 0.3:  # a valid frame header around random data
            out.append(pb.Frame(packet_id=1, data=rng.randbytes(50), last=False, total_size=1000).SerializeToString())
        else:
            out.append(rng.randbytes(rng.choice([0, 1, 2, 5, 17, 100, 1000])))
    return out


def mutate(frames: list[pb.Frame], rng: random.Random) -> list[pb.Frame]:
    """One to three random mutations of a packet's frames (never of the hello in front)."""
    frames = [pb.Frame(packet_id=f.packet_id, data=f.data, last=f.last, total_size=f.total_size) for f in frames]
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(frames))
        f = frames[i]
        kind = rng.randrange(11)
        if kind <= 2 and f.data:  # bit flips: the commonest corruption
            data = bytearray(f.data)
            for _ in range(rng.randint(1, 4)):
                k = rng.randrange(len(data))
                data[k] ^= 1 << rng.randrange(8)
            f.data = bytes(data)
        elif kind == 3:
            f.data = f.data[: rng.randrange(len(f.data) + 1)]
        elif kind == 4 and len(frames) > 1:
            del frames[i]
        elif kind == 5:
            frames.insert(i, pb.Frame(packet_id=f.packet_id, data=f.data, last=f.last, total_size=f.total_size))
        elif kind == 6 and len(frames) > 1:
            j = rng.randrange(len(frames))
            frames[i], frames[j] = frames[j], frames[i]
        elif kind == 7:
            f.packet_id = rng.choice([f.packet_id + 1, 0, rng.getrandbits(64)])
        elif kind == 8:
            frames[0].total_size = rng.choice([(1 << 64) - 1, 1 << 40, (1 << 29) + 1, 600 << 20])
        elif kind == 9:
            f.last = not f.last
        else:
            frames[0].total_size = min(max(0, frames[0].total_size + rng.choice([-1, 1, -100, 7])), (1 << 64) - 1)
    return frames


def mutated_stream(rng: random.Random, mb_id: int) -> list[pb.Frame]:
    """Hello, then one to three valid packets cut into small frames, one of them mutated."""
    packets = [good_packet(rng, mb_id + k) for k in range(rng.randint(1, 3))]
    victim = rng.randrange(len(packets))
    out = list(HELLO_FRAMES)
    for k, p in enumerate(packets):
        frames = list(split_packet(p, k + 1, rng.choice([64, 128, 256, 1024])))
        if k == victim:
            for _ in range(20):
                mutated = mutate(frames, rng)
                if frames_poison(mutated):
                    FILTERED["mutated"] += 1
                else:
                    frames = mutated
                    break
        out.extend(frames)
    return out


def _payload(draw, nbytes: int) -> bytes:
    kind = draw(st.sampled_from(["random", "zeros", "ones", "nan", "huge", "small"]))
    if kind == "random":
        return np.random.default_rng(draw(st.integers(0, 2**32 - 1))).bytes(nbytes)
    if kind == "zeros":
        return bytes(nbytes)
    if kind == "ones":
        return b"\xff" * nbytes
    if kind == "nan":
        return (b"\x00\x00\xc0\x7f" * (nbytes // 4 + 1))[:nbytes]
    if kind == "huge":
        return (b"\xff\xff\x7f\x7f" * (nbytes // 4 + 1))[:nbytes]
    return (b"\x01\x00\x00\x00" * (nbytes // 4 + 1))[:nbytes]


U64 = st.one_of(st.sampled_from([0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1]), st.integers(0, 2**64 - 1))
U32 = st.one_of(
    st.sampled_from([0, 1, 2, 3, 63, 64, 65, 4096, 65536, 65537, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1)
)
DIM = st.one_of(
    st.sampled_from([0, 1, 2, 16, 64, 65, 1 << 20, 1 << 31, 2**63 - 1, -1, -(2**63)]), st.integers(-(2**63), 2**63 - 1)
)
ENUM = st.one_of(st.integers(0, 9), st.integers(-(2**31), 2**31 - 1))
CODECS = {
    "fp32": (pb.FP32, 4),
    "fp16": (pb.FP16, 2),
    "bf16": (pb.BF16, 2),
    "raw": (pb.RAW, None),
    "int8": (pb.INT8, 1),
    "int4": (pb.INT4, 0.5),
    "int4_rot": (pb.INT4_ROT, 0.5),
    "int3_rot": (pb.INT3_ROT, 0.5),
}
RAW_ITEMSIZE = {pb.INT64: 8, pb.INT32: 4, pb.INT16: 2, pb.UINT8: 1, pb.FLOAT32: 4}


@st.composite
def wild_tensor(draw) -> pb.Tensor:
    """Any header at all: extreme shapes, unknown enums, sizes that match nothing."""
    return pb.Tensor(
        shape=draw(st.lists(DIM, max_size=10)),
        dtype=draw(ENUM),
        codec=draw(ENUM),
        payload=draw(st.binary(max_size=300)),
        scales=draw(st.binary(max_size=40)),
        block_size=draw(U32),
        seed=draw(U64),
    )


@st.composite
def consistent_tensor(draw) -> pb.Tensor:
    """Payload and scales of exactly the size the header implies, so decoding gets past the size checks."""
    name = draw(st.sampled_from(sorted(CODECS)))
    codec, width = CODECS[name]
    if draw(st.booleans()):
        shape = [B, T, CFG.d_model] if name != "raw" else [B, T]
    else:
        shape = draw(st.lists(st.integers(0, 40), max_size=4).filter(lambda s: np.prod(s, dtype=np.int64) <= 4096))
    n = int(np.prod(shape, dtype=np.int64))
    if name == "raw":
        dtype = draw(st.sampled_from(sorted(RAW_ITEMSIZE)))
        nbytes = n * RAW_ITEMSIZE[dtype]
    else:
        dtype = draw(st.sampled_from([pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16]))
        nbytes = int(n * width) if width >= 1 else (n + 1) // 2
    block = draw(st.sampled_from([1, 2, 4, 16, 64, 128, 65536, 3, 0])) if name.startswith("int") else 0
    scales = b""
    if block:
        blocks = -(-n // block)
        scales = draw(
            st.sampled_from(
                [
                    np.full(blocks, 0.01, np.float16).tobytes(),
                    np.random.default_rng(draw(st.integers(0, 2**32 - 1))).bytes(2 * blocks),
                    np.full(blocks, -1.0, np.float16).tobytes(),
                    np.full(blocks, np.inf, np.float16).tobytes(),
                    np.full(blocks, 65504.0, np.float16).tobytes(),
                ]
            )
        )
    return pb.Tensor(
        shape=shape,
        dtype=dtype,
        codec=codec,
        payload=_payload(draw, nbytes),
        scales=scales,
        block_size=block,
        seed=draw(U64) if name in ("int4_rot", "int3_rot") else 0,
    )


TENSOR = st.one_of(wild_tensor(), consistent_tensor())
MICRO_BATCH = st.builds(pb.MicroBatch, id=U64, step=U64, index=U32, weight_version=U64, eval=st.booleans())


@st.composite
def hostile_packet(draw) -> pb.Packet:
    kind = draw(st.sampled_from(["activations"] * 5 + ["gradients", "hello", "refusal", "empty"]))
    if kind == "activations":
        act = pb.Activations(mb=draw(MICRO_BATCH), hidden=draw(TENSOR))
        if draw(st.integers(0, 3)):
            act.targets.CopyFrom(draw(TENSOR))
        return pb.Packet(activations=act)
    if kind == "gradients":
        return pb.Packet(
            gradients=pb.Gradients(
                mb=draw(MICRO_BATCH), grad=draw(TENSOR), loss_sum=draw(st.floats()), tokens=draw(U64)
            )
        )
    if kind == "hello":
        return pb.Packet(
            hello=pb.Hello(
                peer_id=draw(st.text(max_size=20)),
                protocol_version=draw(U32),
                stage=draw(U32),
                run_id=draw(st.text(max_size=20)),
            )
        )
    if kind == "refusal":
        return pb.Packet(refusal=pb.Refusal(mb_id=draw(U64), reason=draw(st.text(max_size=50))))
    return pb.Packet()
