"""Weight prediction with the gradients of the step in progress (swarm/train/weight_prediction.py).

A late micro-batch's forward runs on the weights predicted for when its gradient lands. The gradients of the
step in progress that are already in are part of the update it lands after, so they go into the prediction.
"""

from __future__ import annotations

import torch

from swarm.config import ModelConfig, TrainConfig
from swarm.train.stage_runner import StageRunner
from swarm.train.weight_prediction import predict_adamw

CFG = ModelConfig(n_layers=2, d_model=16, n_heads=2, context=8, seed=1)
K = 4


def first_stage() -> StageRunner:
    tc = TrainConfig(
        micro_batches=K, micro_batch_size=2, schedule="async", max_staleness=1, warmup_steps=0, lr=1e-2, grad_clip=1.0
    )
    return StageRunner(CFG, tc, 0, 1, "cpu")


def noisy_gradient() -> torch.Tensor:
    """Mostly noise, as a micro-batch's gradient is: a new one cannot be told from the moments. Small enough
    that the step's norm stays under the clip, as in the measured runs."""
    return 1e-3 * (0.05 * torch.ones(2, 8, 16) + torch.randn(2, 8, 16))


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float((a[k] - b[k]).norm() ** 2) for k in a) ** 0.5


def test_the_gradients_already_in_bring_the_prediction_nearer_the_update() -> None:
    torch.manual_seed(0)
    r = first_stage()
    x = torch.randint(0, 256, (2, 8))
    mb = 0
    for _ in range(30):  # fresh steps: Adam's moments exist and their bias correction is small
        for _ in range(K):
            r.forward(mb, x)
            r.backward(mb, noisy_gradient())
            mb += 1
    misses: dict[int, list[tuple[float, float]]] = {known: [] for known in range(K)}
    for _round in range(6):  # single updates vary with their noise: compare means
        for known in range(K):  # a late forward with `known` gradients of the step in, then the step's update
            for i in range(K):
                r.forward(mb + i, x)
            for i in range(known):
                r.backward(mb + i, noisy_gradient())
            late = mb + K + known
            r.lr_scale = 1.0  # the update it lands after is fresh: predict at its rate, so only the moments differ
            r.forward(late, x)
            key = r._pending[late].weights
            assert key[1:] == (1, known)  # one update ahead, made with `known` gradients in
            with_known = {n: t.clone() for n, t in r.kept._kept[key].items()}
            lr = r.train_cfg.lr_at(r.version) * r.lr_scale
            moments_only = predict_adamw(r.optimizer, r._named_trainable(), lr, 0, K, K, r.train_cfg.grad_clip)
            before = {n: p.detach().clone() for n, p in r._named_trainable()}
            for i in range(known, K):
                r.backward(mb + i, noisy_gradient())
            after = {n: p.detach().clone() for n, p in r._named_trainable()}
            update = distance(after, before)
            misses[known].append((distance(with_known, after) / update, distance(moments_only, after) / update))
            assert r.backward(late, noisy_gradient()).staleness == 1
            mb = late + 1
            for i in range(K - 1):  # the rest of the step the late gradient opened: the next round starts clean
                r.forward(mb + i, x)
                r.backward(mb + i, noisy_gradient())
            mb += K - 1
    mean = {known: [sum(pair[j] for pair in got) / len(got) for j in (0, 1)] for known, got in misses.items()}
    assert mean[0][0] == mean[0][1]  # none in: the moments alone, as before
    for known in range(1, K):
        assert mean[known][0] < mean[known][1], mean
    assert mean[K - 1][0] < 0.75 * mean[K - 1][1], mean  # 3 of 4 in: a quarter or more of the miss is gone


def test_predictions_are_kept_per_gradients_in_and_let_go_with_their_graphs() -> None:
    torch.manual_seed(0)
    r = first_stage()
    x = torch.randint(0, 256, (2, 8))
    for mb in range(K):
        r.forward(mb, x)
        r.backward(mb, noisy_gradient())
    for mb in range(K, 2 * K):
        r.forward(mb, x)
    r.backward(K, noisy_gradient())
    r.forward(2 * K, x)  # one gradient in: one prediction
    r.forward(2 * K + 1, x)  # shares it
    r.backward(K + 1, noisy_gradient())
    r.forward(2 * K + 2, x)  # two in: another
    keys = {r._pending[m].weights for m in (2 * K, 2 * K + 1, 2 * K + 2)}
    assert keys == {(1, 1, 1), (1, 1, 2)}
    one = sum(p.numel() * p.element_size() for p in r.trainable)
    assert r.kept.held_bytes == 2 * one
    for mb in (K + 2, K + 3):
        r.backward(mb, noisy_gradient())  # the update: the two predictions stay for their graphs
    for mb in (2 * K, 2 * K + 1, 2 * K + 2):
        assert r.backward(mb, noisy_gradient()).staleness == 1
    assert r.kept.held_bytes == 0


def middle_replica() -> StageRunner:
    """A replica of a middle block: it sees only its share of each step, counted from step markers."""
    tc = TrainConfig(
        micro_batches=K, micro_batch_size=2, schedule="async", max_staleness=1, warmup_steps=0, lr=1e-2, grad_clip=1.0
    )
    r = StageRunner(ModelConfig(n_layers=3, d_model=16, n_heads=2, context=8, seed=1), tc, 1, 2, "cpu")
    r.use_quotas()
    return r


def test_a_replica_predicts_from_the_step_its_micro_batch_belongs_to() -> None:
    """A replica's late forward runs on the weights predicted for its gradient's update, as a whole stage's does
    (it used to run on the live weights: a replica cannot count the step from the micro-batches it sees)."""
    torch.manual_seed(0)
    r = middle_replica()
    share = 2  # of K: the other replica gets the rest
    x = torch.randn(2, 8, 16)
    mb = 0
    for step in range(20):  # fresh steps: moments exist
        for _ in range(share):
            r.forward(mb, x, step=step)
            r.backward(mb, noisy_gradient())
            mb += 1
        assert r.expect(share) and r.version == step + 1
    gains = []
    for step in range(20, 32, 2):
        r.forward(mb, x, step=step)
        r.forward(mb + 1, x, step=step)
        r.forward(mb + 2, x, step=step + 1)  # late: its gradient lands after this step's update
        r.backward(mb, noisy_gradient())
        r.forward(mb + 3, x, step=step + 1)  # the step's share not yet known: one gradient in, of the last share
        assert [r._pending[m].weights[1:] for m in (mb + 1, mb + 2, mb + 3)] == [(0, 0), (1, 0), (1, 1)]
        predicted = {n: t.clone() for n, t in r.kept._kept[r._pending[mb + 3].weights].items()}
        before = {n: p.detach().clone() for n, p in r._named_trainable()}
        r.backward(mb + 1, noisy_gradient())
        assert r.expect(share) and r.version == step + 1
        after = {n: p.detach().clone() for n, p in r._named_trainable()}
        gains.append(distance(predicted, after) / distance(before, after))
        for m in (mb + 2, mb + 3):
            assert r.backward(m, noisy_gradient()).staleness == 1
        assert r.expect(share) and r.version == step + 2
        mb += 4
    assert sum(gains) / len(gains) < 0.75, gains  # live weights would miss by a whole update (1.0)


def test_the_step_a_sender_claims_moves_the_prediction_at_most_within_the_bound() -> None:
    r = first_stage()
    x = torch.randint(0, 256, (2, 8))
    for mb in range(K):
        r.forward(mb, x, step=0)
        r.backward(mb, noisy_gradient())
    r.forward(K, x, step=1)
    r.forward(K + 1, x, step=10**9)  # a lie from far ahead: S updates at most
    r.forward(K + 2, x, step=0)  # from the past: the live weights
    assert [r._pending[m].weights[1] for m in (K, K + 1, K + 2)] == [0, 1, 0]
    r.forward(K + 3, x)  # no step given: counted from the micro-batches in flight, as the claim would be
    assert r._pending[K + 3].weights[1] == 0
    for m in range(K + 4, 2 * K + 1):
        r.forward(m, x)
    assert r._pending[2 * K].weights[1] == 1


def test_the_prediction_with_gradients_in_is_adamws_next_update_even_where_no_gradient_came_before() -> None:
    """With ``known`` of K gradients in and the rest taken as the first moment, the predicted weights are what
    AdamW's next step makes of that gradient: both moments take it in. A parameter whose gradients were all zero
    so far has no second moment, as a LoRA A has while its B is still zero (PEFT's initialisation), or an
    embedding row of a token not seen yet. The prediction used to divide the new first moment by the old second
    one, eps there: it put a LoRA A about 1e4 away, the next stage saw activations of 1e11 and quarantined the
    first (CI, 2026-12-07)."""
    torch.manual_seed(0)
    lr, clip, known = 1e-2, 1.0, 1
    seen = torch.nn.Parameter(torch.randn(6))
    unseen = torch.nn.Parameter(torch.randn(6))
    opt = torch.optim.AdamW([seen, unseen], lr=lr, weight_decay=0.01)
    for _ in range(3):  # updates in which `unseen` gets no gradient: its moments stay zero
        seen.grad, unseen.grad = 1e-3 * torch.randn(6), torch.zeros(6)
        opt.step()
    assert float(opt.state[unseen]["exp_avg_sq"].abs().max()) == 0.0
    seen.grad, unseen.grad = 1e-3 * torch.randn(6), 1e-3 * torch.randn(6)  # the first gradient in of this step
    predicted = predict_adamw(opt, [("seen", seen), ("unseen", unseen)], lr, known, K, K, clip)

    after = [torch.nn.Parameter(p.detach().clone()) for p in (seen, unseen)]
    twin = torch.optim.AdamW(after, lr=lr, weight_decay=0.01)
    twin.load_state_dict(opt.state_dict())
    rest = (K - known) / K
    for p, q in zip((seen, unseen), after, strict=True):
        q.grad = p.grad + rest * opt.state[p]["exp_avg"]  # the rest of the step: its expectation
    torch.nn.utils.clip_grad_norm_(after, clip)
    twin.step()
    for name, q in zip(("seen", "unseen"), after, strict=True):
        torch.testing.assert_close(predicted[name], q.detach(), rtol=1e-5, atol=1e-7)
    assert float((predicted["unseen"] - unseen.detach()).abs().max()) < 2 * lr  # a step of Adam, never 1e4
