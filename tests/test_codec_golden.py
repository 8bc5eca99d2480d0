"""The wire format is pinned: encodings (and decodings) must stay byte for byte those of the reference.

The table below was produced by the codecs as of commit 4c7e17a, before the speed work of issue #19,
with :func:`golden_input` and the same digests as the test computes (the small-tensor rows later, when
tensors whose scales are all below 2**-10 moved to fp32 scales). Any
change in the bytes an encoder produces, or in the values a decoder returns, breaks peers running
the other version, so a speed-up must reproduce every digest here. Inputs are built from SplitMix64
integers rather than ``torch.randn``, so they do not depend on the torch build or the CPU's ISA.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from swarm.wire import codecs
from swarm.wire.hadamard import splitmix64


def golden_input(n: int, seed: int, dtype: torch.dtype, magnitude: float) -> torch.Tensor:
    z = splitmix64(seed, n)
    u = (z >> np.uint64(40)).astype(np.float64) / float(1 << 23) - 1.0  # [-1, 1)
    x = np.sign(u) * np.abs(u) ** 3 * magnitude  # heavy-ish tail
    x[::97] *= 50.0
    return torch.from_numpy(x.astype(np.float32)).to(dtype)


# (codec, dtype, numel, block size, seed, magnitude): (sha256[:16] of payload|scales, of the decoded bytes)
GOLDEN = {
    ("fp32", "float32", 1, 64, 0, 1.0): ("c39f481bac817a45", "6457cc3fa6fb0f1d"),
    ("fp32", "float32", 1000, 64, 7, 3.0): ("e383ae5b4473f19e", "ac0f00823c1a2044"),
    ("fp32", "float32", 4099, 32, 18446744073709551615, 0.01): ("fadf4a861c237073", "97ee2ff1b99f511c"),
    ("fp32", "float32", 70000, 256, 12345, 100.0): ("9e2e032e3b769f42", "08a9f74bfac71b6a"),
    ("fp32", "float32", 262274, 64, 99, 1.0): ("dfb733c5fccc72d6", "dce2c01a6cc5ed3d"),
    ("fp32", "bfloat16", 1, 64, 0, 1.0): ("31940baf429a6282", "4f5a0692b9110e2d"),
    ("fp32", "bfloat16", 1000, 64, 7, 3.0): ("1435d4f555de1c5f", "b26b8565d13f4df5"),
    ("fp32", "bfloat16", 4099, 32, 18446744073709551615, 0.01): ("58920ede696d3962", "3bf27e771f1853ea"),
    ("fp32", "bfloat16", 70000, 256, 12345, 100.0): ("537a366ca96b5c9c", "67c4d38fc7a768a6"),
    ("fp32", "bfloat16", 262274, 64, 99, 1.0): ("dd98a9d9c9c89fca", "ec85b25887f4837a"),
    ("fp32", "float16", 1, 64, 0, 1.0): ("f753abd1a8c5a0ef", "d56fb964a9a5b7d4"),
    ("fp32", "float16", 1000, 64, 7, 3.0): ("ec1df7aa887e347e", "db30e78665015bb1"),
    ("fp32", "float16", 4099, 32, 18446744073709551615, 0.01): ("815281204dcf76db", "c16dd5097ba110d9"),
    ("fp32", "float16", 70000, 256, 12345, 100.0): ("542c0eeb8f75bd9c", "8df785441802ffbc"),
    ("fp32", "float16", 262274, 64, 99, 1.0): ("62e7cfab013f377b", "0cc4ca5fa657bd8c"),
    ("fp16", "float32", 1, 64, 0, 1.0): ("d4d18eaf0cad81ac", "7c41e5e925a85781"),
    ("fp16", "float32", 1000, 64, 7, 3.0): ("cedae9991e53d129", "b35855ff8f493034"),
    ("fp16", "float32", 4099, 32, 18446744073709551615, 0.01): ("a3060d1b1180fac8", "3d32113dc0fe5c5a"),
    ("fp16", "float32", 70000, 256, 12345, 100.0): ("8107b895f1f6463e", "c195c0a666c68298"),
    ("fp16", "float32", 262274, 64, 99, 1.0): ("8cc00a02a53d39b9", "c3fa41f4b0d371d3"),
    ("fp16", "bfloat16", 1, 64, 0, 1.0): ("77cb3a843300f8c6", "4f5a0692b9110e2d"),
    ("fp16", "bfloat16", 1000, 64, 7, 3.0): ("58365bec1da55bbd", "4018a5eeaedbb25e"),
    ("fp16", "bfloat16", 4099, 32, 18446744073709551615, 0.01): ("f8b23f97ea2180ed", "547d68bc4d992758"),
    ("fp16", "bfloat16", 70000, 256, 12345, 100.0): ("635f5b4cafbc95ce", "7694a1c201517462"),
    ("fp16", "bfloat16", 262274, 64, 99, 1.0): ("e6e9ae53581a187f", "c7e9f7e4e2b697b1"),
    ("fp16", "float16", 1, 64, 0, 1.0): ("d4d18eaf0cad81ac", "d56fb964a9a5b7d4"),
    ("fp16", "float16", 1000, 64, 7, 3.0): ("cedae9991e53d129", "db30e78665015bb1"),
    ("fp16", "float16", 4099, 32, 18446744073709551615, 0.01): ("a3060d1b1180fac8", "c16dd5097ba110d9"),
    ("fp16", "float16", 70000, 256, 12345, 100.0): ("8107b895f1f6463e", "8df785441802ffbc"),
    ("fp16", "float16", 262274, 64, 99, 1.0): ("8cc00a02a53d39b9", "0cc4ca5fa657bd8c"),
    ("bf16", "float32", 1, 64, 0, 1.0): ("69b300f18fc863ce", "810ce03e74fa1058"),
    ("bf16", "float32", 1000, 64, 7, 3.0): ("1fe69f0c60e8f91d", "e9a8694f78ca2ca7"),
    ("bf16", "float32", 4099, 32, 18446744073709551615, 0.01): ("2298975917be8500", "c69d0d4ffadc740b"),
    ("bf16", "float32", 70000, 256, 12345, 100.0): ("47bf4b6694d7a1d3", "7c0dda206f143c6b"),
    ("bf16", "float32", 262274, 64, 99, 1.0): ("44f50a7426fdf299", "ee976073d80e1950"),
    ("bf16", "bfloat16", 1, 64, 0, 1.0): ("69b300f18fc863ce", "4f5a0692b9110e2d"),
    ("bf16", "bfloat16", 1000, 64, 7, 3.0): ("1fe69f0c60e8f91d", "b26b8565d13f4df5"),
    ("bf16", "bfloat16", 4099, 32, 18446744073709551615, 0.01): ("2298975917be8500", "3bf27e771f1853ea"),
    ("bf16", "bfloat16", 70000, 256, 12345, 100.0): ("47bf4b6694d7a1d3", "67c4d38fc7a768a6"),
    ("bf16", "bfloat16", 262274, 64, 99, 1.0): ("44f50a7426fdf299", "ec85b25887f4837a"),
    ("bf16", "float16", 1, 64, 0, 1.0): ("69b300f18fc863ce", "5cb19411bdaff3df"),
    ("bf16", "float16", 1000, 64, 7, 3.0): ("01dad40680f641ee", "e6622c9ae49aa928"),
    ("bf16", "float16", 4099, 32, 18446744073709551615, 0.01): ("0abd165d75ff72b8", "52ba36c6a2599938"),
    ("bf16", "float16", 70000, 256, 12345, 100.0): ("9047c0bf5d9b44b5", "0fa834cdd6588be5"),
    ("bf16", "float16", 262274, 64, 99, 1.0): ("c8af8da24e5dac4e", "248960527c9d6214"),
    ("int8", "float32", 1, 64, 0, 1.0): ("cf2dc27f15833e30", "090a9a34d48bfd7f"),
    ("int8", "float32", 1000, 64, 7, 3.0): ("c7b5aaa7fa0fb882", "d207c223541bf00e"),
    ("int8", "float32", 4099, 32, 18446744073709551615, 0.01): ("bffb4b5946be9440", "f8a3f03df48168e7"),
    ("int8", "float32", 70000, 256, 12345, 100.0): ("3f8c2c2a5eb9bcd8", "8d347e4fa286c3d5"),
    ("int8", "float32", 262274, 64, 99, 1.0): ("df58a4481c908ee3", "d490037461028759"),
    ("int8", "bfloat16", 1, 64, 0, 1.0): ("09f74d8cd6332920", "4f5a0692b9110e2d"),
    ("int8", "bfloat16", 1000, 64, 7, 3.0): ("ae2c5648e57cda4e", "68d90d35155bd102"),
    ("int8", "bfloat16", 4099, 32, 18446744073709551615, 0.01): ("b551d28f3e99d097", "9f4a7b6fb015ab64"),
    ("int8", "bfloat16", 70000, 256, 12345, 100.0): ("c83fdc537e9a6ce1", "1dabda27dd942ffd"),
    ("int8", "bfloat16", 262274, 64, 99, 1.0): ("624e8df152e762ea", "c6ee8e1055bdff15"),
    ("int8", "float16", 1, 64, 0, 1.0): ("cf2dc27f15833e30", "4b4d6f8e439c232a"),
    ("int8", "float16", 1000, 64, 7, 3.0): ("52fc088e1aadedbd", "0aabe0f53ea288a3"),
    ("int8", "float16", 4099, 32, 18446744073709551615, 0.01): ("0060d1ed1613aa61", "305f5a21e8c0cbbd"),
    ("int8", "float16", 70000, 256, 12345, 100.0): ("7fae01c29fa77254", "bc41ac1b7f35ff8b"),
    ("int8", "float16", 262274, 64, 99, 1.0): ("8090e646e4b5d8c4", "6663fa53a72384fa"),
    ("int4", "float32", 1, 64, 0, 1.0): ("7c1f65ae43975d53", "9e15a544f33059b8"),
    ("int4", "float32", 1000, 64, 7, 3.0): ("741869e5f952cb20", "864c2b5109c53f36"),
    ("int4", "float32", 4099, 32, 18446744073709551615, 0.01): ("3323af0d040d6743", "405cebb76d9384b1"),
    ("int4", "float32", 70000, 256, 12345, 100.0): ("a482696b2206bb3b", "b9be342be31b77fc"),
    ("int4", "float32", 262274, 64, 99, 1.0): ("7cf2ec141b1e8a0e", "0365c8ea43a59f0e"),
    ("int4", "bfloat16", 1, 64, 0, 1.0): ("8ebc66cf083c61fc", "4f5a0692b9110e2d"),
    ("int4", "bfloat16", 1000, 64, 7, 3.0): ("4d7c385c5bb4d6ca", "696197f833e04136"),
    ("int4", "bfloat16", 4099, 32, 18446744073709551615, 0.01): ("ebbc07935be787ca", "9c12038d65bb7493"),
    ("int4", "bfloat16", 70000, 256, 12345, 100.0): ("88baa9397c9bb5f8", "119da3392fc12e55"),
    ("int4", "bfloat16", 262274, 64, 99, 1.0): ("2c71d06d91cfc00d", "685b2f3fbee5c784"),
    ("int4", "float16", 1, 64, 0, 1.0): ("778f6bd53270d4cb", "4b4d6f8e439c232a"),
    ("int4", "float16", 1000, 64, 7, 3.0): ("fb9beb653e45941f", "fb80ddbac68f5e72"),
    ("int4", "float16", 4099, 32, 18446744073709551615, 0.01): ("c90365697bfcb996", "aefec0c929bfc157"),
    ("int4", "float16", 70000, 256, 12345, 100.0): ("568187075294250e", "3b685dfe37fa2ba2"),
    ("int4", "float16", 262274, 64, 99, 1.0): ("a667719b96daae14", "c991946cee349613"),
    ("int4_rot", "float32", 1, 64, 0, 1.0): ("7c1f65ae43975d53", "9e15a544f33059b8"),
    ("int4_rot", "float32", 1000, 64, 7, 3.0): ("7f17e96ab0b064a0", "c630b25f4bd610c3"),
    ("int4_rot", "float32", 4099, 32, 18446744073709551615, 0.01): ("d3aabe9181fc0684", "2ee529a2ef03df5c"),
    ("int4_rot", "float32", 70000, 256, 12345, 100.0): ("e7e2d8f5eee98952", "c3bd12d1523ee6ba"),
    ("int4_rot", "float32", 262274, 64, 99, 1.0): ("c86243471a58fe13", "a8daf88428489124"),
    ("int4_rot", "bfloat16", 1, 64, 0, 1.0): ("8ebc66cf083c61fc", "4f5a0692b9110e2d"),
    ("int4_rot", "bfloat16", 1000, 64, 7, 3.0): ("db790d366972d06b", "d3f587ce8cf8b758"),
    ("int4_rot", "bfloat16", 4099, 32, 18446744073709551615, 0.01): ("da065e959d2fb479", "ffce16718e78d8e2"),
    ("int4_rot", "bfloat16", 70000, 256, 12345, 100.0): ("fbbe6f7ad520562f", "29821e8d6b162a36"),
    ("int4_rot", "bfloat16", 262274, 64, 99, 1.0): ("aa3e6a51819fb251", "9861fffc56f93ca3"),
    ("int4_rot", "float16", 1, 64, 0, 1.0): ("778f6bd53270d4cb", "4b4d6f8e439c232a"),
    ("int4_rot", "float16", 1000, 64, 7, 3.0): ("9173f3ec19d09636", "d28abf64b9dd1796"),
    ("int4_rot", "float16", 4099, 32, 18446744073709551615, 0.01): ("a345a06703cad101", "ae767b18c0e9eb93"),
    ("int4_rot", "float16", 70000, 256, 12345, 100.0): ("b4527a4109f0192f", "a268debae836bd70"),
    ("int4_rot", "float16", 262274, 64, 99, 1.0): ("5fe382bcc7d401af", "0ffd64e46bd7bac3"),
    ("int4", "float32", 5000, 64, 0, 4000000.0): ("c79d603ec7b9accf", "35e65c19f97a1c3a"),
    ("int8", "float32", 5000, 64, 0, 400000000.0): ("2d38725df1c9c4b9", "15332a22ec1fb251"),
    ("int4_rot", "float32", 5000, 64, 3, 400000.0): ("c301c2b2d8696a62", "45fc8ead36693c9b"),
    # small tensors (gradients, ~1e-7) with fp32 scales, pinned when that rule came in (issue #20)
    ("int8", "float32", 4099, 64, 5, 1e-07): ("2eb5d009b216d465", "4dccb9e5aa18f549"),
    ("int8", "bfloat16", 4099, 64, 5, 1e-07): ("65320268f1b60c90", "17432a965ea3202f"),
    ("int4", "float32", 4099, 64, 5, 1e-07): ("0b0a5257f1b28941", "edd176688c9ebb00"),
    ("int4", "bfloat16", 4099, 64, 5, 1e-07): ("e82f470e9f5cfd1a", "ec0259ac4ae941a2"),
    ("int4_rot", "float32", 4099, 64, 5, 1e-07): ("006fb3c6828d4f0f", "a8d9a0e96243acd3"),
    ("int4_rot", "bfloat16", 4099, 64, 5, 1e-07): ("5fe038490c1bce13", "044008b7ecdad427"),
    # int3_rot, pinned when it came in (issue #19): int4_rot's inputs
    ("int3_rot", "float32", 1, 64, 0, 1.0): ("9119304df45483cb", "82c974f7369d428a"),
    ("int3_rot", "float32", 1000, 64, 7, 3.0): ("438b00be2668167d", "a167dcfc41b10ce8"),
    ("int3_rot", "float32", 4099, 32, 18446744073709551615, 0.01): ("6ab2f700bcad3d7a", "5d4099d3e05eb734"),
    ("int3_rot", "float32", 70000, 256, 12345, 100.0): ("8d5096ad30afe48a", "ee9eb987a6426491"),
    ("int3_rot", "float32", 262274, 64, 99, 1.0): ("0cb469653d2a3e39", "c64e042622e0ee6e"),
    ("int3_rot", "bfloat16", 1, 64, 0, 1.0): ("106596e52566d6bf", "4f5a0692b9110e2d"),
    ("int3_rot", "bfloat16", 1000, 64, 7, 3.0): ("3c190ce105ec8702", "c37a0eb4c8a834cb"),
    ("int3_rot", "bfloat16", 4099, 32, 18446744073709551615, 0.01): ("5bc46544a30a35a3", "117e044e284e8633"),
    ("int3_rot", "bfloat16", 70000, 256, 12345, 100.0): ("292455343784219f", "f6209c37b25e44b8"),
    ("int3_rot", "bfloat16", 262274, 64, 99, 1.0): ("0a9b79a6179e7509", "adbc2aca949c59a0"),
    ("int3_rot", "float16", 1, 64, 0, 1.0): ("99bf498c52e7c69f", "4b4d6f8e439c232a"),
    ("int3_rot", "float16", 1000, 64, 7, 3.0): ("3bf95d825eaa22af", "a19aa2d32df1dd32"),
    ("int3_rot", "float16", 4099, 32, 18446744073709551615, 0.01): ("a301d1fe3cd2fb1b", "12c4ddf793ab5736"),
    ("int3_rot", "float16", 70000, 256, 12345, 100.0): ("3bf68dcd2ed34174", "d9c994060e8d70dd"),
    ("int3_rot", "float16", 262274, 64, 99, 1.0): ("b0ae8d6eacfc90a9", "c5ce2cb705d36b91"),
    ("int3_rot", "float32", 5000, 64, 3, 400000.0): ("390bcc026539c179", "98a698754b3529eb"),
    ("int3_rot", "float32", 4099, 64, 5, 1e-07): ("9b967e1c9feda8cc", "6412956b08afa147"),
    ("int3_rot", "bfloat16", 4099, 64, 5, 1e-07): ("8bb7547ca3593bc4", "95725fbe6f3d420f"),
}


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


@pytest.mark.parametrize("case", sorted(GOLDEN, key=str), ids=str)
def test_encoding_and_decoding_are_byte_identical_to_the_reference(case):
    codec, dtype, n, block_size, seed, magnitude = case
    x = golden_input(n, seed, getattr(torch, dtype), magnitude)
    options = {} if codec.startswith("fp") else {"block_size": block_size, "seed": seed}
    enc = codecs.encode(x, codec, **options)
    y = codecs.decode(enc)
    got = (
        _digest(bytes(enc.payload) + b"|" + bytes(enc.scales)),
        _digest(y.reshape(-1).view(torch.uint8).numpy().tobytes()),
    )
    assert got == GOLDEN[case]
