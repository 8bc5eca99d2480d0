"""Read and write Ravn's discovery records in a hivemind DHT: the peer directory and the signed plan.

Peer records (``ravn/<swarm>/peers``, one subkey per peer id) are heartbeats: each announcement expires
after ``ttl`` seconds, so a peer that vanishes drops out by itself. hivemind has no delete: for each
(key, subkey) it keeps the value with the *latest* expiration, so a graceful leave stores a ``leaving``
tombstone that outlives the last heartbeat, and readers hide it at once.

The plan (``ravn/<swarm>/plan``) is stored under the subkey ``[owner:<coordinator public key>]``.
hivemind's ``RSASignatureValidator`` then makes the DHT sign it on store and reject, on every honest
node, any value under that subkey that the key did not sign. On top of that the plan body carries its
own signature, checked by :func:`fetch_plan` against the key the peer pinned at join time, so trust
never depends on how the reading node's DHT was configured. Values are msgpack-able dicts; never pickle.

Every node of a swarm's DHT must be created with ``record_validators=dht_record_validators(...)``:
without the validator a node cannot even decode signed values (the signature is appended to the
msgpack bytes) and its lookups of the plan key hang until the timeout. The coordinator's key pair
itself (making, saving, loading, printing it) is ``swarm.dht.keys``.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Hashable, Mapping
from typing import Any

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.timed_storage import get_dht_time
from pydantic import ValidationError

from swarm.dht.keys import load_public_key, plan_subkey, public_key_fingerprint
from swarm.dht.schema import PeerRecord, Plan, peers_key, plan_key, validate_swarm_name
from swarm.dht.signing import sign_record

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 10.0  # seconds for one DHT get/store round
MAX_TTL = 3600.0
PLAN_ENVELOPE_VERSION = 1
MAX_PLAN_BODY_CHARS = 256 * 1024
MAX_SIGNATURE_CHARS = 2048
_OWNER_RE = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)
# Domain separation: a plan signature can never be mistaken for a signature over anything else.
_PLAN_SIGNING_CONTEXT = b"ravn/plan-signature/v1\n"


class PlanVerificationError(ValueError):
    """A plan envelope that is malformed, not signed by the pinned key, or for another swarm."""


def dht_record_validators(private_key: RSAPrivateKey | None = None) -> list[RecordValidatorBase]:
    """The validators every Ravn DHT node must be created with: ``hivemind.DHT(record_validators=...)``.

    The coordinator passes its private key so its node signs the plan; peers pass nothing (hivemind
    then uses a process-wide key, which only matters for records they own). Validators cannot be
    swapped later: hivemind merges RSA validators and keeps the first one.
    """
    return [RSASignatureValidator(private_key)]


# ---------------------------------------------------------------------------------------------------
# DHT plumbing with timeouts, and log lines that do not repeat on every poll.

_warned: OrderedDict[Hashable, None] = OrderedDict()
_warned_lock = threading.Lock()
_WARNED_MAX = 1024


def _warn_once(token: Hashable, message: str, *args: object) -> None:
    """Warn the first time, then log at debug level: strangers must not be able to flood our logs."""
    with _warned_lock:
        seen = token in _warned
        _warned[token] = None
        _warned.move_to_end(token)
        while len(_warned) > _WARNED_MAX:
            _warned.popitem(last=False)
    logger.log(logging.DEBUG if seen else logging.WARNING, message, *args)


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _describe_errors(error: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '(record)'}: {e['msg']}" for e in error.errors()[:3])


def _check_ttl(ttl: float) -> None:
    if not isinstance(ttl, int | float) or not math.isfinite(ttl) or not 0 < ttl <= MAX_TTL:
        raise ValueError(f"ttl must be a number of seconds in (0, {MAX_TTL:g}], got {ttl!r}")


def _dht_get(dht: DHT, key: str, timeout: float) -> Any:
    future = dht.get(key, latest=True, return_future=True)
    try:
        return future.result(timeout=timeout)
    except TimeoutError:
        future.cancel()
        raise TimeoutError(
            f"DHT lookup of {key!r} took over {timeout:g}s (is this node created with "
            "record_validators=dht_record_validators()? without it, signed values cannot be decoded)"
        ) from None


def _dht_store(dht: DHT, key: str, subkey: str | bytes, value: dict, expiration_time: float, timeout: float) -> bool:
    future = dht.store(key, value, expiration_time, subkey=subkey, return_future=True)
    try:
        return bool(future.result(timeout=timeout))
    except TimeoutError:
        future.cancel()
        raise TimeoutError(f"DHT store under {key!r} took over {timeout:g}s") from None


# ---------------------------------------------------------------------------------------------------
# Peer directory.


def announce_peer(
    dht: DHT,
    swarm: str,
    record: PeerRecord,
    ttl: float,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    signing_key: Ed25519PrivateKey | None = None,
) -> bool:
    """Publish (or refresh) ``record`` under ``ravn/<swarm>/peers``, expiring ``ttl`` seconds from now.

    Call it every heartbeat with ttl = a few heartbeats, so one lost heartbeat does not drop the peer.
    The stored copy's ``timestamp`` is set to now. Returns False if no DHT node accepted the record
    (e.g. a tombstone with a later expiration is still in place: keep using the same ttl).
    ``signing_key``: sign the stamped record with the peer's key (swarm/dht/signing.py).
    """
    swarm = validate_swarm_name(swarm)
    _check_ttl(ttl)
    if record.state == "leaving":
        raise ValueError("announce_peer publishes joining/online peers; use withdraw_peer to leave")
    now = get_dht_time()
    stamped = PeerRecord.model_validate({**record.to_dht_value(), "timestamp": now})
    if signing_key is not None:
        stamped = sign_record(stamped, signing_key)
    ok = _dht_store(dht, peers_key(swarm), stamped.peer_id, stamped.to_dht_value(), now + ttl, timeout)
    if not ok:
        logger.warning("announcing peer %s in swarm %r was rejected by the DHT", record.peer_id, swarm)
    return ok


def withdraw_peer(
    dht: DHT,
    swarm: str,
    record: PeerRecord,
    ttl: float,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    signing_key: Ed25519PrivateKey | None = None,
) -> bool:
    """Leave gracefully: replace the peer's record with a ``leaving`` tombstone, hidden by list_peers.

    hivemind cannot delete, and keeps the value with the latest expiration per subkey, so the tombstone
    expires ``ttl`` seconds from now: pass the ttl used for announcements (or more) so it outlives the
    last heartbeat. A later announce_peer with the same ttl supersedes it, so rejoining works.
    """
    swarm = validate_swarm_name(swarm)
    _check_ttl(ttl)
    now = get_dht_time()
    tombstone = PeerRecord.model_validate({**record.to_dht_value(), "state": "leaving", "timestamp": now})
    if signing_key is not None:
        tombstone = sign_record(tombstone, signing_key)
    return _dht_store(dht, peers_key(swarm), tombstone.peer_id, tombstone.to_dht_value(), now + ttl, timeout)


def list_peers(
    dht: DHT, swarm: str, *, include_leaving: bool = False, timeout: float = DEFAULT_TIMEOUT
) -> list[PeerRecord]:
    """All valid, unexpired peer records of ``swarm``, sorted by peer id.

    Malformed records (wrong types, unknown fields, subkey != peer id, ...) are skipped and logged:
    one broken or hostile peer must not hide the others. ``leaving`` tombstones are hidden unless
    ``include_leaving`` (a coordinator may want to re-plan the moment a peer says goodbye).
    Raises TimeoutError if the DHT does not answer within ``timeout`` seconds.
    """
    swarm = validate_swarm_name(swarm)
    found = _dht_get(dht, peers_key(swarm), timeout)
    if found is None:
        return []
    if not isinstance(found.value, dict):
        _warn_once(("peers-not-dict", swarm), "swarm %r: peers key holds a plain value, not a directory", swarm)
        return []
    now = get_dht_time()
    peers = []
    for subkey, item in found.value.items():
        if item.expiration_time is None or item.expiration_time <= now:
            continue
        try:
            record = PeerRecord.model_validate(item.value)
        except ValidationError as e:
            reason = _describe_errors(e)
            _warn_once(
                ("peer", swarm, _short(subkey), reason),
                "swarm %r: skipping malformed peer record %s: %s",
                swarm,
                _short(subkey),
                reason,
            )
            continue
        if record.peer_id != subkey:
            _warn_once(
                ("peer-subkey", swarm, _short(subkey)),
                "swarm %r: skipping peer record for %s stored under another subkey %s",
                swarm,
                record.peer_id,
                _short(subkey),
            )
            continue
        if record.state == "leaving" and not include_leaving:
            continue
        peers.append(record)
    return sorted(peers, key=lambda r: r.peer_id)


# ---------------------------------------------------------------------------------------------------
# The signed plan.


def seal_plan(plan: Plan, private_key: RSAPrivateKey) -> dict[str, Any]:
    """The DHT value for ``plan``: ``{"v": 1, "body": <plan JSON>, "sig": <base64 RSA-PSS signature>}``.

    The signature covers the exact body bytes, so verification needs no canonical re-encoding.
    """
    body = plan.model_dump_json()
    signature = private_key.sign(_PLAN_SIGNING_CONTEXT + body.encode("utf-8")).decode("ascii")
    return {"v": PLAN_ENVELOPE_VERSION, "body": body, "sig": signature}


def verify_plan(envelope: object, swarm: str, trusted_public_key: RSAPublicKey) -> Plan:
    """Check a sealed plan against the pinned coordinator key; return the plan or raise PlanVerificationError."""
    if not isinstance(envelope, dict) or set(envelope) != {"v", "body", "sig"}:
        raise PlanVerificationError(f"not a plan envelope: {_short(envelope)}")
    version, body, signature = envelope["v"], envelope["body"], envelope["sig"]
    if version != PLAN_ENVELOPE_VERSION or isinstance(version, bool):
        raise PlanVerificationError(f"unsupported plan envelope version {_short(version)}")
    if not isinstance(body, str) or len(body) > MAX_PLAN_BODY_CHARS:
        raise PlanVerificationError(f"plan body is not a string of at most {MAX_PLAN_BODY_CHARS} characters")
    if not isinstance(signature, str) or not signature.isascii() or len(signature) > MAX_SIGNATURE_CHARS:
        raise PlanVerificationError("plan signature is not a short base64 string")
    if not trusted_public_key.verify(_PLAN_SIGNING_CONTEXT + body.encode("utf-8"), signature.encode("ascii")):
        raise PlanVerificationError(
            f"plan signature does not verify with the pinned coordinator key "
            f"{public_key_fingerprint(trusted_public_key)} (tampered or signed by another key)"
        )
    try:
        plan = Plan.model_validate_json(body)
    except ValidationError as e:
        raise PlanVerificationError(f"signed plan does not match the schema: {_describe_errors(e)}") from e
    if plan.swarm != swarm:
        raise PlanVerificationError(f"plan is for swarm {plan.swarm!r}, not {swarm!r}")
    return plan


def _as_plan(swarm: str, plan: Plan | Mapping[str, Any]) -> Plan:
    if isinstance(plan, Plan):
        model = plan
    else:
        data = {"swarm": swarm, "issued_at": get_dht_time(), **dict(plan)}
        # Lax on the way out (our own code may pass tuples); readers re-validate strictly.
        model = Plan.model_validate(data, strict=False)
    if model.swarm != swarm:
        raise ValueError(f"plan names swarm {model.swarm!r} but is being published to {swarm!r}")
    return model


def _require_signing_validator(dht: DHT, subkey: bytes) -> None:
    # Reads hivemind internals (the parent-side copy of the node's validators) only to turn a silent
    # "store rejected" into an actionable error; if those internals change, we skip the check.
    validators = getattr(getattr(dht, "_record_validator", None), "_validators", None)
    if validators is None:
        return
    if not any(isinstance(v, RSASignatureValidator) and v.local_public_key == subkey for v in validators):
        raise ValueError(
            "this DHT node cannot sign the plan with the given key: create it with "
            "hivemind.DHT(..., record_validators=dht_record_validators(private_key)) and the same key"
        )


def publish_plan(
    dht: DHT,
    swarm: str,
    plan: Plan | Mapping[str, Any],
    private_key: RSAPrivateKey,
    ttl: float,
    *,
    timeout: float = DEFAULT_TIMEOUT,
) -> bool:
    """Sign ``plan`` with the coordinator's key and store it under ``ravn/<swarm>/plan``.

    ``plan`` is a :class:`Plan` or a dict with its fields; ``swarm`` and ``issued_at`` (now) are filled
    in when missing. Republish before ``ttl`` runs out. ``dht`` must have been created with
    ``dht_record_validators(private_key)``. Returns False if the DHT rejected the store (e.g. an
    earlier publish with a later expiration: keep the ttl constant across restarts).
    """
    swarm = validate_swarm_name(swarm)
    _check_ttl(ttl)
    model = _as_plan(swarm, plan)
    subkey = plan_subkey(private_key)
    _require_signing_validator(dht, subkey)
    envelope = seal_plan(model, private_key)
    ok = _dht_store(dht, plan_key(swarm), subkey, envelope, get_dht_time() + ttl, timeout)
    if not ok:
        logger.warning("publishing plan v%d of swarm %r was rejected by the DHT", model.version, swarm)
    return ok


def _describe_owner(subkey: object) -> str:
    if isinstance(subkey, bytes):
        match = _OWNER_RE.fullmatch(subkey)
        if match:
            try:
                return "key " + public_key_fingerprint(RSAPublicKey.from_bytes(match.group(1)))
            except (ValueError, UnsupportedAlgorithm):
                pass
    return "unrecognised subkey " + _short(subkey, 40)


def fetch_plan(
    dht: DHT,
    swarm: str,
    trusted_public_key: RSAPublicKey | str,
    *,
    min_version: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
) -> dict[str, Any] | None:
    """The swarm's current plan as a dict (fields of :class:`Plan`), if the pinned coordinator signed it.

    Plans under any other key, unsigned or tampered plans, plans for another swarm and plans older
    than ``min_version`` (pass the last version you acted on: a stale replica cannot roll you back)
    are ignored and logged. Returns None if there is no acceptable plan.
    """
    swarm = validate_swarm_name(swarm)
    trusted = load_public_key(trusted_public_key) if isinstance(trusted_public_key, str) else trusted_public_key
    trusted_subkey = plan_subkey(trusted)
    fingerprint = public_key_fingerprint(trusted)
    found = _dht_get(dht, plan_key(swarm), timeout)
    if found is None:
        return None
    if not isinstance(found.value, dict):
        _warn_once(("plan-not-dict", swarm), "swarm %r: plan key holds a plain value; ignoring it", swarm)
        return None
    for subkey in found.value:
        if subkey != trusted_subkey:
            _warn_once(
                ("plan-owner", swarm, _short(subkey)),
                "swarm %r: ignoring a plan published by %s; only the pinned coordinator key %s is trusted",
                swarm,
                _describe_owner(subkey),
                fingerprint,
            )
    item = found.value.get(trusted_subkey)
    if item is None or item.expiration_time is None or item.expiration_time <= get_dht_time():
        return None
    try:
        plan = verify_plan(item.value, swarm, trusted)
    except PlanVerificationError as e:
        _warn_once(("plan-bad", swarm, str(e)), "swarm %r: ignoring plan: %s", swarm, e)
        return None
    if plan.version < min_version:
        _warn_once(
            ("plan-stale", swarm, plan.version, min_version),
            "swarm %r: ignoring plan version %d, older than version %d already seen",
            swarm,
            plan.version,
            min_version,
        )
        return None
    return plan.model_dump(mode="python")
