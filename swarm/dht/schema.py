"""Schemas of the records Ravn keeps in the DHT, and the keys they live under.

Everything read from the DHT was written by somebody we do not know, so every record is parsed with a
strict pydantic model: no type coercion (``"3"`` is not ``3``), no unknown fields, every string and number
bounded. A record that fails is skipped by the reader, never "fixed up".

Keys are namespaced by swarm (``ravn/<swarm>/peers``, ``ravn/<swarm>/plan``) so several swarms can share
one DHT (for instance a public bootstrap DHT) without seeing each other's peers or plans.

hivemind's own ``SchemaValidator`` is not used: in hivemind 1.1.12 it is written against ``pydantic.v1``
(it reads ``FieldInfo.required``, which pydantic 2 models lack) and it binds fixed key names, while ours
contain the swarm name. See docs/discovery.md.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from swarm.dht.multiaddrs import MAX_MULTIADDR_LEN, canonical_endpoint

KEY_PREFIX = "ravn"
SWARM_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")

MAX_LAYERS = 65536
MAX_STAGES = 128
MAX_PEERS_PER_STAGE = 32
MAX_UINT32 = 2**32 - 1

PeerId = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
Multiaddress = Annotated[str, Field(min_length=1, max_length=MAX_MULTIADDR_LEN)]
PrintableText = Annotated[str, Field(pattern=r"^[\x20-\x7e]{1,128}$")]
VersionText = Annotated[str, Field(pattern=r"^[0-9A-Za-z][0-9A-Za-z.+_-]{0,31}$")]
NonNegativeFloat = Annotated[float, Field(ge=0.0, le=1e12, allow_inf_nan=False)]
Timestamp = Annotated[float, Field(ge=0.0, le=1e11, allow_inf_nan=False)]  # unix seconds, DHT clock
LayerIndex = Annotated[int, Field(ge=0, le=MAX_LAYERS)]
PublicKey = Annotated[str, Field(pattern=r"^([A-Za-z0-9+/]{43}=)?$")]  # Ed25519, base64; "" unsigned
TlsFingerprint = Annotated[str, Field(pattern=r"^(sha256:[0-9a-f]{64})?$")]  # "" when the peer serves in clear

PeerState = Literal["joining", "online", "leaving"]
# what a link may send floats with
WireCodec = Literal["fp32", "fp16", "bf16", "int8", "int4", "int4_rot", "int3_rot", "lowrank", "ecsq"]
MAX_LINKS = 1024


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


def validate_swarm_name(swarm: str) -> str:
    """Return ``swarm`` if it is a valid swarm name (1-32 chars of ``[a-z0-9_-]``), else raise ValueError.

    Names are kept short and plain because they end up in DHT keys, log lines and join commands.
    """
    if not isinstance(swarm, str) or not SWARM_NAME_RE.fullmatch(swarm):
        raise ValueError(
            f"invalid swarm name {swarm!r}: use 1-32 characters of a-z, 0-9, '-' and '_', "
            "starting with a letter or digit"
        )
    return swarm


def peers_key(swarm: str) -> str:
    """DHT key of the swarm's peer directory (a dictionary: subkey = peer id, value = PeerRecord)."""
    return f"{KEY_PREFIX}/{validate_swarm_name(swarm)}/peers"


def plan_key(swarm: str) -> str:
    """DHT key of the swarm's plan (a dictionary: subkey = ``[owner:<coordinator key>]``, value = plan)."""
    return f"{KEY_PREFIX}/{validate_swarm_name(swarm)}/plan"


def _check_layer_range(start: int, end: int) -> None:
    if start >= end:
        raise ValueError(f"empty layer range: layer_start={start} must be < layer_end={end} (half-open)")


class LayerBlock(_Strict):
    """The contiguous block of layers a peer serves: ``[layer_start, layer_end)``."""

    layer_start: LayerIndex
    layer_end: LayerIndex

    @model_validator(mode="after")
    def _non_empty(self) -> LayerBlock:
        _check_layer_range(self.layer_start, self.layer_end)
        return self


class PeerRecord(_Strict):
    """What a peer announces about itself under ``ravn/<swarm>/peers`` (subkey = ``peer_id``).

    Measurements are the peer's own claims: the coordinator uses them to plan, never to trust.
    """

    peer_id: PeerId
    endpoint: Multiaddress  # the Stage gRPC service, e.g. /ip4/203.0.113.7/tcp/31337
    device: PrintableText  # e.g. "cuda:0 NVIDIA GeForce RTX 3090" or "cpu"
    free_memory_bytes: Annotated[int, Field(ge=0, le=2**50)]
    throughput_layers_per_s: NonNegativeFloat  # forward+backward of one layer at the model's width
    bandwidth_up_bytes_per_s: NonNegativeFloat
    bandwidth_down_bytes_per_s: NonNegativeFloat
    block: LayerBlock | None = None  # None while the peer serves nothing
    state: PeerState
    software_version: VersionText
    protocol_version: Annotated[int, Field(ge=0, le=MAX_UINT32)]
    reachable: bool | None = None  # None: not (yet) checked from outside
    timestamp: Timestamp  # when the record was announced (set by announce_peer)
    tls_fingerprint: TlsFingerprint = ""  # of the certificate its Stage service presents (swarm/security/tls.py)
    public_key: PublicKey = ""  # Ed25519, base64
    signature: Annotated[str, Field(pattern=r"^([A-Za-z0-9+/]{86}==)?$")] = ""  # swarm/dht/signing.py

    @field_validator("endpoint")
    @classmethod
    def _endpoint_is_dialable(cls, value: str) -> str:
        return canonical_endpoint(value)

    def to_dht_value(self) -> dict:
        """A msgpack-able dict (hivemind msgpacks DHT values; we never pickle)."""
        return self.model_dump(mode="python")


class PlanPeer(_Strict):
    peer_id: PeerId
    endpoint: Multiaddress
    reachable: bool = True  # False: behind NAT; its neighbours wait for it to dial them
    tls_fingerprint: TlsFingerprint = ""  # set: its Stage service speaks TLS with exactly this certificate
    public_key: PublicKey = ""  # of its signed record: only its holder may call in this peer's name

    @field_validator("endpoint")
    @classmethod
    def _endpoint_is_dialable(cls, value: str) -> str:
        return canonical_endpoint(value)


class PlanStage(_Strict):
    """One pipeline stage: layers ``[layer_start, layer_end)`` and the peers that serve them."""

    layer_start: LayerIndex
    layer_end: LayerIndex
    peers: Annotated[list[PlanPeer], Field(max_length=MAX_PEERS_PER_STAGE)]

    @model_validator(mode="after")
    def _consistent(self) -> PlanStage:
        _check_layer_range(self.layer_start, self.layer_end)
        ids = [p.peer_id for p in self.peers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"stage [{self.layer_start}, {self.layer_end}) lists a peer twice: {ids}")
        return self


class PlannedLayer(_Strict):
    """One layer of the run's model as a peer benchmarks it before it joins (``swarm.train.measure``).

    Placement sizes blocks from each peer's measured layer throughput, so the peer must measure the
    model actually planned, at the run's micro-batch; it learns it here because it measures before it
    has an assignment. ``hf_path`` is the coordinator's checkpoint directory ("" for the built-in GPT):
    the peer builds one layer of that architecture from its ``config.json`` with random weights.
    """

    d_model: Annotated[int, Field(ge=1, le=MAX_LAYERS)]
    n_heads: Annotated[int, Field(ge=1, le=MAX_LAYERS)]
    context: Annotated[int, Field(ge=1, le=2**20)]
    micro_batch_size: Annotated[int, Field(ge=1, le=MAX_LAYERS)]
    hf_path: Annotated[str, Field(max_length=4096)] = ""
    hf_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    hf_quant: Literal["none", "int8", "nf4"] = "none"
    activation_checkpointing: bool = False
    lora_rank: Annotated[int, Field(ge=0, le=MAX_LAYERS)] = 0


class PlanLink(_Strict):
    """The codecs of one link: ``upstream`` (a holder of stage ``boundary``) sends activations to
    ``downstream`` (a holder of stage ``boundary + 1``) with ``forward``, which sends gradients back with
    ``backward``; the measured Mbit/s and reason each was chosen from (``coordinator/wire_choice.py``)."""

    boundary: Annotated[int, Field(ge=0, le=MAX_STAGES)]
    upstream: PeerId
    downstream: PeerId
    forward: WireCodec
    backward: WireCodec
    forward_mbit_s: NonNegativeFloat = 0.0
    backward_mbit_s: NonNegativeFloat = 0.0
    forward_reason: PrintableText = "set by --wire-forward"
    backward_reason: PrintableText = "set by --wire-backward"


class Plan(_Strict):
    """The coordinator's plan: which peers serve which layers in run ``run_id``.

    ``version`` grows with every new plan of a run, so a peer can refuse to go back to an older one.
    ``swarm`` is inside the signed body so a plan cannot be replayed into another swarm, and so is
    ``coordinator_tls_fingerprint``: peers pin the coordinator's certificate from the coordinator's key.
    """

    swarm: Annotated[str, Field(pattern=SWARM_NAME_RE.pattern)]
    run_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
    version: Annotated[int, Field(ge=0, le=2**53)]
    model_name: PrintableText
    stages: Annotated[list[PlanStage], Field(min_length=1, max_length=MAX_STAGES)]
    issued_at: Timestamp
    coordinator: Multiaddress  # the coordinator's Control gRPC service, dialled by the peers
    protocol_version: Annotated[int, Field(ge=0, le=MAX_UINT32)]
    coordinator_tls_fingerprint: TlsFingerprint = ""  # set: Control speaks TLS with exactly this certificate
    layer: PlannedLayer | None = None  # what peers measure themselves on (None: a coordinator from before)
    links: Annotated[list[PlanLink], Field(max_length=MAX_LINKS)] = []  # empty: every link the run's codecs

    @field_validator("coordinator")
    @classmethod
    def _coordinator_is_dialable(cls, value: str) -> str:
        return canonical_endpoint(value)

    @model_validator(mode="after")
    def _contiguous_pipeline(self) -> Plan:
        expected_start = 0
        for i, stage in enumerate(self.stages):
            if stage.layer_start != expected_start:
                raise ValueError(
                    f"stage {i} starts at layer {stage.layer_start}, expected {expected_start}: "
                    "stages must cover the layers from 0 contiguously, in order"
                )
            expected_start = stage.layer_end
        if self.links:
            _check_links(self.stages, self.links)
        return self


def _check_links(stages: list[PlanStage], links: list[PlanLink]) -> None:
    """Links, when given, name each pair of neighbouring holders exactly once and nothing else, and a
    sender has one forward codec (it encodes activations before choosing which holder gets them)."""
    expected = {
        (i, u.peer_id, d.peer_id) for i in range(len(stages) - 1) for u in stages[i].peers for d in stages[i + 1].peers
    }
    named = [(x.boundary, x.upstream, x.downstream) for x in links]
    if len(set(named)) != len(named):
        raise ValueError("the plan names a link twice")
    unknown = sorted(set(named) - expected)
    if unknown:
        i, u, d = unknown[0]
        raise ValueError(f"the plan names a link {u} -> {d} across boundary {i} that is not between neighbours")
    missing = sorted(expected - set(named))
    if missing:
        i, u, d = missing[0]
        raise ValueError(f"the plan gives the link {u} -> {d} (stage {i} -> {i + 1}) no codec")
    forward: dict[str, str] = {}
    for x in links:
        if forward.setdefault(x.upstream, x.forward) != x.forward:
            raise ValueError(f"the plan gives {x.upstream} two forward codecs ({forward[x.upstream]}, {x.forward})")


class ProtocolMismatchError(RuntimeError):
    """A peer speaks a different wire/control protocol version than we do."""


def check_protocol(record: PeerRecord, ours: int) -> None:
    """Raise :class:`ProtocolMismatchError` unless ``record`` speaks protocol version ``ours``.

    Versions must match exactly: the protocol version is bumped only on incompatible changes.
    """
    if record.protocol_version != ours:
        raise ProtocolMismatchError(
            f"peer {record.peer_id} (software {record.software_version}) speaks protocol version "
            f"{record.protocol_version}, we speak protocol version {ours}; "
            f"run the same Ravn release on both sides"
        )
