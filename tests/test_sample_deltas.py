"""Activation deltas between the two sides of one link: both keep the same rows, whatever reaches them.

The sender is the real ``WirePolicy`` with its codecs; the receiver decodes what it sends, as a Stage does.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.pb import wire_pb2 as pb
from swarm.wire.codec_policy import WirePolicy
from swarm.wire.packets import WireError, tensor_from_pb
from swarm.wire.sample_deltas import DeltaReceiver, DeltaSender, NotCached
from swarm.wire.sample_store import SampleStore

B, T, D = 2, 8, 64
ROW_BYTES = T * D * 2


def link(capacity: int = 16) -> tuple[WirePolicy, DeltaSender, DeltaReceiver]:
    policy = WirePolicy(forward="int4_rot", zstd=True)
    return policy, DeltaSender(SampleStore(capacity * ROW_BYTES)), DeltaReceiver(SampleStore(capacity * ROW_BYTES))


def send(policy, sender, samples, hidden, mb_id=1) -> pb.Activations:
    mb = pb.MicroBatch(id=mb_id, samples=samples)
    return policy.activations(mb, hidden, None, sender, "int3_rot").activations


def receive(receiver, act: pb.Activations) -> torch.Tensor:
    x = receiver.rebuild(act, tensor_from_pb(act.hidden))
    receiver.commit(act, x)
    return x


def activation(samples, epoch: int) -> torch.Tensor:
    """What a boundary sends for ``samples``: fixed per sample, drifting a little each epoch."""
    out = []
    for s in samples:
        g = torch.Generator().manual_seed(s)
        base, drift = torch.randn(T, D, generator=g) * 3, torch.randn(T, D, generator=g)
        out.append(base + 0.02 * epoch * drift)
    return torch.stack(out)


def test_a_returning_sample_travels_as_a_delta_with_far_less_error() -> None:
    policy, sender, receiver = link()
    errors = {}
    for epoch in range(4):
        for mb, samples in enumerate(([0, 1], [2, 3])):
            x = activation(samples, epoch)
            act = send(policy, sender, samples, x, mb_id=10 * epoch + mb)
            assert act.cache == (pb.CACHE_STORE if epoch == 0 else pb.CACHE_DELTA)
            got = receive(receiver, act)
            assert torch.equal(sender.store.get(samples), receiver.store.get(samples))  # the same rows
            errors[epoch] = float((got - x).norm() / x.norm())
    assert errors[0] > 0.05  # int4_rot on the activation itself
    # each visit's delta also carries what the last one lost: the rows converge on the activation
    assert errors[0] > errors[1] > errors[2] > errors[3] and errors[2] < errors[0] / 10, errors
    assert policy.sent == {"forward:int4_rot": 2, "forward:delta:int3_rot": 6}
    assert len(send(policy, sender, [0, 1], activation([0, 1], 4)).hidden.payload) < len(
        policy.activations(pb.MicroBatch(id=99), activation([0, 1], 4), None).activations.hidden.payload
    )


def test_a_micro_batch_the_receiver_dropped_goes_whole_next_time() -> None:
    policy, sender, receiver = link()
    receive(receiver, send(policy, sender, [0, 1], activation([0, 1], 0)))
    lost = send(policy, sender, [0, 1], activation([0, 1], 1))  # the receiver found it implausible: not kept
    assert lost.cache == pb.CACHE_DELTA
    sender.dropped([0, 1])  # the dropped gradient came back
    again = send(policy, sender, [0, 1], activation([0, 1], 2))
    assert again.cache == pb.CACHE_STORE
    receive(receiver, again)
    assert torch.equal(sender.store.get([0, 1]), receiver.store.get([0, 1]))
    assert send(policy, sender, [0, 1], activation([0, 1], 3)).cache == pb.CACHE_DELTA


def test_a_full_store_sends_new_samples_whole_and_keeps_the_rest() -> None:
    policy, sender, receiver = link(capacity=3)
    assert receive(receiver, send(policy, sender, [0, 1], activation([0, 1], 0))) is not None
    act = send(policy, sender, [2, 3], activation([2, 3], 0))
    assert act.cache == pb.CACHE_NONE and 2 not in sender.store
    receive(receiver, act)
    assert send(policy, sender, [1, 0], activation([1, 0], 1)).cache == pb.CACHE_DELTA


def test_an_output_that_cannot_be_encoded_leaves_the_rows_as_they_were() -> None:
    policy, sender, _ = link()
    policy.activations(pb.MicroBatch(id=1, samples=[0, 1]), activation([0, 1], 0), None, sender, "ecsq")
    kept = sender.store.get([0, 1])
    bad = activation([0, 1], 1)
    bad[1, 3, 5] = float("nan")
    with pytest.raises(WireError, match="NaN"):
        policy.activations(pb.MicroBatch(id=2, samples=[0, 1]), bad, None, sender, "ecsq")
    assert torch.equal(sender.store.get([0, 1]), kept)
    assert send(policy, sender, [0, 1], activation([0, 1], 2)).cache == pb.CACHE_DELTA


def test_eval_and_unnumbered_micro_batches_are_never_cached() -> None:
    policy, sender, _ = link()
    ev = policy.activations(
        pb.MicroBatch(id=1, samples=[0, 1], eval=True), activation([0, 1], 0), None, sender, "int3_rot"
    )
    plain = policy.activations(pb.MicroBatch(id=2), activation([0, 1], 0), None, sender, "int3_rot")
    assert ev.activations.cache == plain.activations.cache == pb.CACHE_NONE and len(sender.store) == 0


def test_what_a_receiver_cannot_accept() -> None:
    policy, sender, receiver = link(capacity=2)
    first = send(policy, sender, [0, 1], activation([0, 1], 0))
    x = tensor_from_pb(first.hidden)
    delta = pb.Activations(mb=pb.MicroBatch(id=2, samples=[0, 1]), cache=pb.CACHE_DELTA)
    with pytest.raises(NotCached):  # this side never got the rows (a new link): dropped, not refused
        receiver.rebuild(delta, x)
    receive(receiver, first)
    for samples, cache, text in (
        ([0], pb.CACHE_DELTA, "1 sample indices for a micro-batch of 2 rows"),
        ([0, 0], pb.CACHE_DELTA, "repeats"),
        ([2, 3], pb.CACHE_STORE, "beyond the agreed room of 2"),
        ([0, 1], 7, "unknown cache mode 7"),
    ):
        with pytest.raises(WireError, match=text):
            receiver.rebuild(pb.Activations(mb=pb.MicroBatch(id=3, samples=samples), cache=cache), x)
    with pytest.raises(NotCached):  # rows of another shape are no delta base
        receiver.rebuild(delta, x[:, :4])


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True), st.booleans()),
        min_size=1,
        max_size=25,
    ),
    st.integers(1, 8),
)
def test_whatever_arrives_or_is_dropped_both_sides_agree_on_every_row_they_use(steps, capacity) -> None:
    policy, sender, receiver = link(capacity)
    for epoch, (samples, delivered) in enumerate(steps):
        x = activation(samples, epoch)
        act = send(policy, sender, samples, x, mb_id=epoch)
        try:
            got = receiver.rebuild(act, tensor_from_pb(act.hidden))
        except NotCached:
            delivered = False
        if delivered:
            receiver.commit(act, got)
            if act.cache != pb.CACHE_NONE:
                assert torch.equal(receiver.store.get(samples), sender.store.get(samples))
            assert float((got - x).norm() / x.norm()) < 0.2
        else:
            sender.dropped(samples)
        assert len(receiver.store) <= len(sender.store) <= capacity


def test_bf16_activations_of_a_checkpoint_come_back_in_bf16() -> None:
    policy, sender, receiver = link()
    for epoch in range(2):
        x = activation([0, 1], epoch).bfloat16()
        got = receive(receiver, send(policy, sender, [0, 1], x))
        assert got.dtype == torch.bfloat16 and float((got.float() - x.float()).norm() / x.float().norm()) < 0.15
    assert torch.equal(sender.store.get([0, 1]), receiver.store.get([0, 1]))


def test_ecsq_deltas_cost_fewer_bytes_the_less_a_sample_moved_at_a_bounded_error() -> None:
    """ecsq quantises a change at a step set by the activation's rms: int4_rot's precision, whatever its size."""
    sizes, errors = {}, {}
    for drift in (0.3, 0.03):
        policy = WirePolicy(forward="fp32", zstd=True)  # the rows kept are the activation: the change is the drift
        sender, receiver = DeltaSender(SampleStore(1 << 20)), DeltaReceiver(SampleStore(1 << 20))
        x = activation([0, 1], 0)
        receive(receiver, policy.activations(pb.MicroBatch(id=1, samples=[0, 1]), x, None, sender, "ecsq").activations)
        moved = x + drift * torch.randn(x.shape, generator=torch.Generator().manual_seed(7)) * x.std()
        act = policy.activations(pb.MicroBatch(id=2, samples=[0, 1]), moved, None, sender, "ecsq").activations
        assert act.cache == pb.CACHE_DELTA and act.hidden.compression == pb.ROWS
        got = receive(receiver, act)
        sizes[drift], errors[drift] = len(act.hidden.payload), float((got - moved).abs().max() / moved.std())
        assert torch.equal(sender.store.get([0, 1]), receiver.store.get([0, 1]))
    assert sizes[0.03] < sizes[0.3] / 3, sizes
    assert max(errors.values()) <= 0.17 + 0.01, errors  # half the step, plus bf16 rows
