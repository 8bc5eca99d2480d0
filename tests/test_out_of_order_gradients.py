"""Gradients that come back out of step order (replicas of a later stage return them as they finish).

Each step must apply exactly its own micro-batches, and the data source must count whole steps: before,
the first stage stepped after any K gradients, so a gradient of step t + 1 that overtook step t's last made
that last one two versions late, and S = 1 dropped it (1-5% of the first stage's micro-batches with a
replicated stage, docs/replicas.md)."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.config import ModelConfig, TrainConfig
from swarm.train.admission import Admission
from swarm.train.stage_runner import StageRunner

CFG = ModelConfig(n_layers=2, d_model=16, n_heads=2, context=8, seed=1)
K = 2


def first_stage(s: int) -> StageRunner:
    tc = TrainConfig(micro_batches=K, micro_batch_size=2, schedule="async", max_staleness=s, warmup_steps=0, lr=1e-2)
    return StageRunner(CFG, tc, 0, 1, "cpu")


def inputs(n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 256, (2, 8), generator=gen) for _ in range(n)]
    gs = [torch.randn(2, 8, 16, generator=gen) for _ in range(n)]
    return xs, gs


def test_a_gradient_that_overtakes_its_steps_last_waits_for_its_own_step() -> None:
    """Steps 0 and 1 forwarded, their gradients back as 0, 2, 1, 3: the same two updates as in order."""
    xs, gs = inputs(4)
    runs = {}
    for order in ((0, 1, 2, 3), (0, 2, 1, 3)):
        r = first_stage(s=1)
        for mb in range(4):
            r.forward(mb, xs[mb], step=mb // K)
        results = [r.backward(mb, gs[mb]) for mb in order]
        assert not any(res.dropped for res in results) and r.version == 2
        assert r.metrics.staleness_counts() == [2, 2]  # step 1's two were one version late, wherever they came
        runs[order] = {k: p.detach().clone() for k, p in r.model.named_parameters()}
    in_order, overtaken = runs.values()
    for k in in_order:
        assert torch.equal(in_order[k], overtaken[k]), k


def test_an_overtaking_gradient_does_not_step_the_stage_early() -> None:
    xs, gs = inputs(4)
    r = first_stage(s=1)
    for mb in range(4):
        r.forward(mb, xs[mb], step=mb // K)
    assert not r.backward(0, gs[0]).stepped and r.metrics.held_gradient_bytes_peak == 0
    assert not r.backward(2, gs[2]).stepped and r.version == 0  # step 1's: held, step 0 is not complete
    trainable = sum(p.numel() * p.element_size() for p in r.trainable if p.grad is not None)
    assert r.metrics.held_gradient_bytes_peak == trainable  # one set of gradients held, counted for the summary
    assert r.backward(1, gs[1]).stepped and r.version == 1
    assert r.held.held_bytes() == 0  # handed to step 1's update
    assert r.backward(3, gs[3]).stepped and r.version == 2
    assert r.metrics.held_gradient_bytes_peak == trainable


def test_a_dropped_micro_batch_that_overtakes_counts_for_its_own_step() -> None:
    xs, gs = inputs(4)
    r = first_stage(s=1)
    for mb in range(4):
        r.forward(mb, xs[mb], step=mb // K)
    r.backward(0, gs[0])
    assert r.backward(2, None).dropped and r.version == 0  # a later stage dropped it: step 1 is one short
    assert r.backward(1, gs[1]).stepped and r.version == 1
    assert r.backward(3, gs[3]).stepped and r.version == 2


def test_the_first_stage_drops_nothing_when_a_replicated_stage_returns_gradients_out_of_order() -> None:
    """The data source's admission and the first stage, with gradients back in a shuffled order (as two
    replicas of the next stage return them): under S = 1 none is dropped and none is more than S late."""
    rng = random.Random(0)
    steps = 12
    xs, gs = inputs(steps * K)
    r, adm = first_stage(s=1), Admission(K, 1, 4 * K)
    in_flight: list[int] = []
    while adm.admitted < steps * K or in_flight:
        while adm.admitted < steps * K and adm.can_admit():
            seq = adm.admit()
            r.forward(seq, xs[seq], step=seq // K)
            in_flight.append(seq)
        back = in_flight.pop(rng.randrange(min(2, len(in_flight))))  # the older or the one after it
        result = r.backward(back, gs[back])
        assert not result.dropped and result.staleness <= 1, (back, result)
        adm.complete(back)
    assert r.version == steps and r.metrics.dropped == 0


@settings(max_examples=200, deadline=None)
@given(
    k=st.integers(1, 6), s=st.integers(0, 4), cap=st.integers(1, 40), moves=st.lists(st.integers(0, 7), max_size=300)
)
def test_admission_counts_whole_steps_whatever_the_order_gradients_come_back_in(
    k: int, s: int, cap: int, moves: list[int]
) -> None:
    """Admit greedily, complete any in-flight micro-batch: a stage that steps when a whole step is back
    sees every gradient at most S versions after its forward."""
    a = Admission(micro_batches=k, max_staleness=s, max_in_flight=cap)
    version_at_forward: dict[int, int] = {}
    in_flight: list[int] = []
    for move in moves:
        if move and a.can_admit():
            version_at_forward[a.admitted] = a.steps_done
            in_flight.append(a.admit())
        elif in_flight:
            seq = in_flight.pop(move % len(in_flight))
            assert a.steps_done - version_at_forward[seq] <= s
            a.complete(seq)
        assert a.in_flight <= cap
    assert a.steps_done <= a.processed // k
