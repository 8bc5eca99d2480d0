"""The weights a stage's coming AdamW updates will make, for a forward whose gradient comes back after them.

Under the async schedule most of the first stage's gradients come back one update late. Its forward therefore
runs on the weights predicted for the moment its gradient lands (PipeMare's and SpecTrain's weight prediction),
so that the late gradient is nearly the one a synchronous schedule would have computed. The update is Adam's
own: the bias-corrected first moment over the root of the second, with decoupled weight decay.

What a prediction cannot know is the next update's new gradient, which enters the first moment with weight
1 - beta1. Predicted from the moments alone, the weights were about half an update off (docs/BENCHMARKS.md:
rho ~0.5). But part of that gradient is known when the forward runs: the gradients of the step in progress
that have already come back, ``known`` of its K. They enter the predicted moments, the rest of the step's
gradient taken as its expectation, (K - known) / K of the current first moment, and the sum clipped as the
step will clip it: AdamW's own next step on that gradient. (The second moment once kept its old value; where
no gradient had come before, as for a LoRA A while its B is still zero, that is zero, and the prediction was
1e4 off.) A replica applies only its share of each step, scaled to the step's size, and predicts the
same way over its share. Over 600 steps of gpt-medium in a swarm of 3 peers, the first stage's prediction missed by
0.49 of an update with none in, 0.40, 0.32 and 0.23 with 1, 2 and 3 of 4 in, and async's loss cost fell by 1.4
points (docs/BENCHMARKS.md, "Weight prediction with the gradients already in").
"""

from __future__ import annotations

import torch


def predict_adamw(
    optimizer: torch.optim.AdamW,
    named_params: list[tuple[str, torch.nn.Parameter]],
    lr: float,
    known: int,
    share: int,
    micro_batches: int,
    grad_clip: float,
) -> dict[str, torch.Tensor] | None:
    """The parameters after updates summing to ``lr``, the first including the ``known`` gradients in ``.grad``.

    ``lr`` is the sum of the coming updates' learning rates; every update after the first is taken along the
    same direction. The next update applies ``share`` of the step's ``micro_batches`` gradients here (fewer on a
    replica, which scales their sum by ``micro_batches / share`` at its step). None before the first update (no
    moments yet)."""
    states = [optimizer.state.get(p) for _, p in named_params]
    if not all(states):
        return None
    partial = 0 < known < share
    first_moments = [s["exp_avg"] for s in states]
    if partial:
        with torch.no_grad():
            rest, scale = (share - known) / share, micro_batches / share
            step_grads = [
                m * rest if p.grad is None else (m * rest).add_(p.grad, alpha=scale)
                for (_, p), m in zip(named_params, first_moments, strict=True)
            ]
            clip = 1.0
            if grad_clip > 0:  # the factor torch.nn.utils.clip_grad_norm_ will apply at the step
                clip = min(1.0, grad_clip / (float(torch.nn.utils.get_total_norm(step_grads)) + 1e-6))
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    predicted = {}
    with torch.no_grad():
        for i, ((name, p), state) in enumerate(zip(named_params, states, strict=True)):
            group = group_of[id(p)]
            beta1, beta2 = group["betas"]
            t = float(state["step"])
            if partial:  # AdamW's next step on that gradient: it enters both moments
                g = step_grads[i] * clip
                m_hat = (state["exp_avg"] * beta1).add_(g, alpha=1 - beta1) / (1 - beta1 ** (t + 1))
                v_next = (state["exp_avg_sq"] * beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v_next / (1 - beta2 ** (t + 1))).sqrt_().add_(group["eps"])
            else:
                m_hat = state["exp_avg"] / (1 - beta1**t)
                denom = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt_().add_(group["eps"])
            w = p.detach() * (1 - lr * group["weight_decay"])
            predicted[name] = w.addcdiv_(m_hat, denom, value=-lr)
    return predicted
