"""The compute of one pipeline stage: forward, backward and optimizer, with no network in sight.

A peer daemon feeds it micro-batches as they arrive and ships what it returns. Keeping this free of
gRPC means the exact same object runs in tests, in benchmarks and behind the wire, and the daemon
stays a thin shell. It is not thread-safe: the daemon calls it from one compute thread only.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from swarm.config import ModelConfig, TrainConfig
from swarm.train.agreed_parameters import AgreedParameters
from swarm.train.kept_weights import KeptWeights, Key
from swarm.train.model import StageModel
from swarm.train.step_gradients import StepGradients
from swarm.train.weight_prediction import predict_adamw

MAX_ABS_ACTIVATION = 1e6  # pre-norm hidden states of a sane model stay far below this
IGNORE_INDEX = -100  # targets that carry no loss (e.g. prompt tokens when fine-tuning on completions)


class StageInputError(ValueError):
    """A micro-batch that this stage cannot accept (wrong shape, unknown id, non-finite values)."""


@dataclass
class ForwardResult:
    output: torch.Tensor | None = None  # hidden states to send downstream (non-last stages)
    input_grad: torch.Tensor | None = None  # last stage: gradient to send upstream right away
    loss_sum: float = 0.0  # last stage: summed token loss of this micro-batch
    tokens: int = 0
    stepped: bool = False


@dataclass
class BackwardResult:
    input_grad: torch.Tensor | None = None  # to send upstream (None on the first stage or when dropped)
    stepped: bool = False
    dropped: bool = False
    staleness: int = 0


@dataclass
class _InFlight:
    """A micro-batch forwarded here whose gradient has not come back yet."""

    x_in: torch.Tensor
    out: torch.Tensor | None  # its graph, on the weight generation it was built with; None: let go, too stale
    version: int  # the optimizer steps its forward had seen
    weights: Key  # KeptWeights' key of the weights its forward ran on
    step: int | None  # the data step it belongs to (None: not told)


@dataclass
class StageMetrics:
    forward: int = 0
    backward: int = 0
    dropped: int = 0
    compute_seconds: float = 0.0
    staleness: dict[int, int] = field(default_factory=dict)
    kept_weights_bytes_peak: int = 0  # weights kept for stale backwards, at their peak
    held_gradient_bytes_peak: int = 0  # gradients of later steps held till their own step's update, at their peak
    in_flight_peak: int = 0
    skipped_steps: int = 0

    def staleness_counts(self) -> list[int]:
        return [self.staleness.get(i, 0) for i in range(max(self.staleness, default=-1) + 1)]


class StageRunner:
    """Holds one block's parameters and optimizer state; steps every ``micro_batches`` backwards."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        start: int,
        end: int,
        device: str = "cpu",
        model: torch.nn.Module | None = None,
    ) -> None:
        """``model``: a prebuilt block with StageModel's interface (e.g. a Hugging Face block with LoRA)."""
        self.model_cfg, self.train_cfg = model_cfg, train_cfg
        self.device = torch.device(device)
        self.model = (model if model is not None else StageModel(model_cfg, start, end)).to(self.device)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        if not self.trainable:
            raise ValueError(f"block [{start}, {end}) has no trainable parameters")
        self.optimizer = torch.optim.AdamW(
            self.trainable, lr=train_cfg.lr, betas=(0.9, 0.95), weight_decay=train_cfg.weight_decay
        )
        self.version = 0
        self.metrics = StageMetrics()
        self._pending: dict[int, _InFlight] = {}
        self.kept = KeptWeights(self._named_trainable())
        self.held = StepGradients(self.trainable)  # gradients of later steps that overtook this one's
        self.pending_checkpoint: tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
        self._backwards = 0
        self._quotas: deque[int] | None = None  # a replica: gradients per step, learned from step markers
        self._last_share = train_cfg.micro_batches  # a replica: its share of the last step it took
        self.agreed: AgreedParameters | None = None  # a replica: the parameters its group last agreed on
        self._late = self._applied = 0  # this step's applied gradients and the versions they were late, summed
        self.lr_scale = 1.0  # the last step's staleness_lr_scale; weight prediction assumes it holds

    @property
    def is_first(self) -> bool:
        return self.model.is_first

    @property
    def is_last(self) -> bool:
        return self.model.is_last

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def expected_input(self, batch: int, time_: int) -> tuple[tuple[int, ...], torch.dtype]:
        if self.is_first:
            return (batch, time_), torch.int64
        return (batch, time_, self.model_cfg.d_model), torch.float32

    def _check_input(self, x: torch.Tensor, targets: torch.Tensor | None) -> None:
        if x.dim() < 2 or x.shape[1] > self.model_cfg.context or x.shape[0] == 0:
            raise StageInputError(f"input of shape {list(x.shape)} is not (batch, time <= {self.model_cfg.context})")
        shape, dtype = self.expected_input(x.shape[0], x.shape[1])
        if tuple(x.shape) != shape:
            raise StageInputError(f"input shape {list(x.shape)} does not match the expected {list(shape)}")
        if self.is_first:
            if x.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
                raise StageInputError(f"first stage expects integer token ids, got {x.dtype}")
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.model_cfg.vocab_size):
                raise StageInputError(f"token ids outside [0, {self.model_cfg.vocab_size})")
        elif not x.is_floating_point():
            raise StageInputError(f"hidden states must be floating point, got {x.dtype}")
        elif not bool(torch.isfinite(x).all()):
            raise StageInputError("hidden states contain NaN or Inf")
        elif x.numel() and float(x.abs().max()) > MAX_ABS_ACTIVATION:
            raise StageInputError(f"hidden states beyond ±{MAX_ABS_ACTIVATION:g}: a broken or hostile sender")
        if x.shape[0] > self.train_cfg.micro_batch_size:
            raise StageInputError(
                f"micro-batch of {x.shape[0]} sequences exceeds the run's micro-batch size "
                f"{self.train_cfg.micro_batch_size}"
            )
        if self.is_last:
            if targets is None:
                raise StageInputError("the last stage needs targets with every micro-batch")
            if tuple(targets.shape) != tuple(x.shape[:2]):
                raise StageInputError(f"targets shape {list(targets.shape)} does not match {list(x.shape[:2])}")
            bad = ((targets < 0) & (targets != IGNORE_INDEX)) | (targets >= self.model_cfg.vocab_size)
            if bool(bad.any()):
                raise StageInputError(
                    f"target ids outside [0, {self.model_cfg.vocab_size}) (or {IGNORE_INDEX}: ignored)"
                )

    def forward(
        self,
        mb_id: int,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        train: bool = True,
        step: int | None = None,
    ) -> ForwardResult:
        """Run this block on one micro-batch; the last stage also computes the loss (and its backward).

        ``step``: the data source's step the micro-batch belongs to (None: the next one this stage's count of
        micro-batches implies, which only a stage that sees every micro-batch can tell)."""
        self._check_input(x, targets)
        if train and mb_id in self._pending:
            raise StageInputError(f"micro-batch {mb_id} is already in flight on this stage")
        t0 = time.perf_counter()
        x = x.to(self.device)
        if self.is_first:
            x = x.long()
        else:
            x = x.float()
        try:
            if not train:
                with torch.no_grad():
                    out = self.model(x)
                    if self.is_last:
                        loss = self.model.loss_sum(out, targets.to(self.device).long())
                        return ForwardResult(loss_sum=float(loss), tokens=_count(targets))
                    return ForwardResult(output=out)
            x_in = x if self.is_first else x.detach().requires_grad_(True)
            if self.is_last:
                out = self.model(x_in)
            else:
                ahead = self._updates_before_backward(step)
                weights = self.kept.look_ahead(ahead, self._predicted_weights, known=self._backwards)
                with self.kept.using(weights), self.kept.saving():
                    out = self.model(x_in)
            self.metrics.forward += 1
            if not self.is_last:
                self._pending[mb_id] = _InFlight(x_in, out, self.version, self.kept.track(weights), step)
                self.metrics.in_flight_peak = max(self.metrics.in_flight_peak, len(self._pending))
                return ForwardResult(output=out.detach())
            loss = self.model.loss_sum(out, targets.to(self.device).long())
            if not bool(torch.isfinite(loss)):
                raise StageInputError(
                    f"micro-batch {mb_id} gives a non-finite loss; refused before it reaches the weights"
                )
            tokens = _count(targets)
            # each micro-batch's mean token loss, averaged over the step's K micro-batches
            (loss / max(tokens * self.train_cfg.micro_batches, 1)).backward()
            result = ForwardResult(
                input_grad=None if self.is_first else x_in.grad,
                loss_sum=float(loss.detach()),
                tokens=tokens,
            )
            result.stepped = self._after_backward(0)
            return result
        finally:
            self.metrics.compute_seconds += time.perf_counter() - t0

    def backward(self, mb_id: int, grad_output: torch.Tensor | None) -> BackwardResult:
        """Back-propagate the gradient of this stage's output, unless it is too stale to apply.

        ``grad_output`` None means a later stage dropped this micro-batch: drop it here too. A stale
        gradient goes through the graph its forward built, on the weights that forward saw (kept for it),
        and lands on the current weights: PipeDream-2BW's rule, with no second forward.
        """
        if mb_id not in self._pending:
            raise StageInputError(f"gradient for micro-batch {mb_id}, which is not in flight on this stage")
        entry = self._pending[mb_id]
        if grad_output is not None:
            expected = self.model_output_shape(entry.x_in)
            if tuple(grad_output.shape) != expected:
                raise StageInputError(
                    f"gradient shape {list(grad_output.shape)} does not match output {list(expected)}"
                )
            if not grad_output.is_floating_point() or not bool(torch.isfinite(grad_output).all()):
                raise StageInputError("gradient is not a finite floating-point tensor")
        del self._pending[mb_id]
        ahead = self._steps_before(entry.step)  # > 0: it overtook gradients of earlier steps, held till theirs
        staleness = self.version + ahead - entry.version  # as of the update that applies it
        if grad_output is None or entry.out is None or staleness > self.train_cfg.staleness_bound:
            self.metrics.dropped += 1
            if entry.out is not None:
                self.kept.release(entry.weights)
            if ahead:
                self.held.count(entry.step, None)
                return BackwardResult(dropped=True, staleness=staleness)
            stepped = self.count_lost()  # a drop still belongs to its step: versions must not lag the data
            return BackwardResult(dropped=True, staleness=staleness, stepped=stepped)
        t0 = time.perf_counter()
        grad = grad_output.to(device=self.device, dtype=torch.float32)
        try:
            with self.kept.using(entry.weights), self.held.gathering(entry.step if ahead else None):
                entry.out.backward(grad)
        finally:
            self.kept.release(entry.weights)
        input_grad = None if self.is_first else entry.x_in.grad
        self.metrics.backward += 1
        stepped = self._after_backward(staleness, entry.step if ahead else None)
        self.metrics.compute_seconds += time.perf_counter() - t0
        return BackwardResult(input_grad=input_grad, stepped=stepped, staleness=staleness)

    def _updates_before_backward(self, step: int | None) -> int:
        """Optimizer steps this stage will take before the gradient of a micro-batch of ``step`` comes back.

        Every holder steps once per data step (a replica after its share), so ``step - version`` updates come
        first; at most S (a later gradient is dropped anyway), at least 0, whatever a sender claims. Without
        the step, a stage that sees every micro-batch counts it: it steps after every K gradients, in order."""
        bound = self.train_cfg.staleness_bound
        if bound == 0:
            return 0
        if step is None:
            if self._quotas is not None:
                return 0  # a replica sees part of each step: its count says nothing of the step
            step = self.version + (self._backwards + len(self._pending)) // self.train_cfg.micro_batches
        return max(0, min(bound, step - self.version))

    def _steps_before(self, step: int | None) -> int:
        """Updates here before a gradient of ``step`` applies: 0, or, when micro-batches of earlier steps are
        still in flight here (it overtook them), the steps from the oldest of those to its own."""
        if step is None:
            return 0
        earlier = [e.step for e in self._pending.values() if e.step is not None and e.step < step]
        return step - min(earlier) if earlier else 0

    def _share_in_progress(self) -> int:
        """Micro-batches the step in progress applies here: K, or a replica's share (its last until the marker)."""
        if self._quotas is None:
            return self.train_cfg.micro_batches
        return self._quotas[0] if self._quotas else self._last_share

    def _predicted_weights(self, steps: int, known: int) -> dict[str, torch.Tensor] | None:
        """The trainable weights after ``steps`` more AdamW updates, at the learning rates of those steps,
        the next one including the ``known`` gradients of this step that are already in."""
        cfg, named = self.train_cfg, self._named_trainable()
        lr = sum(cfg.lr_at(self.version + i) for i in range(steps)) * self.lr_scale
        return predict_adamw(
            self.optimizer, named, lr, known, self._share_in_progress(), cfg.micro_batches, cfg.grad_clip
        )

    def model_output_shape(self, x_in: torch.Tensor) -> tuple[int, ...]:
        return (*x_in.shape[:2], self.model_cfg.d_model)

    def drop(self, mb_id: int) -> bool:
        """Forget an in-flight micro-batch whose gradient will never come."""
        entry = self._pending.pop(mb_id, None)
        if entry is not None and entry.out is not None:
            self.kept.release(entry.weights)
        return entry is not None

    def _after_backward(self, staleness: int, held_for: int | None = None) -> bool:
        self.metrics.staleness[staleness] = self.metrics.staleness.get(staleness, 0) + 1
        if held_for is not None:
            self.held.count(held_for, staleness)
            self.metrics.held_gradient_bytes_peak = self.held.peak_bytes
            return False
        self._late += staleness
        self._applied += 1
        return self._micro_batch_done()

    def _micro_batch_done(self) -> bool:
        """One more micro-batch of a step is through this stage (applied or not); step when the step is."""
        self._backwards += 1
        if self._quotas is not None:
            return self._step_by_quota()
        stepped = False
        while self._backwards >= self.train_cfg.micro_batches:  # a held step may come in whole
            self._backwards -= self.train_cfg.micro_batches
            self.step()
            stepped = True
        return stepped

    def _take_held(self) -> None:
        """After a step: the oldest held step is next, unless micro-batches of an earlier one are in flight."""
        step = self.held.oldest()
        if step is not None and self._steps_before(step) == 0:
            held = self.held.install(step)
            self._backwards += held.done
            self._late += held.late
            self._applied += held.applied

    # ---- replicas -------------------------------------------------------------------------------
    def use_quotas(self) -> None:
        """Not every micro-batch passes here (replicas here or upstream): step after this stage's share of
        each step, learned from step markers, not after K."""
        self._quotas = deque()

    def expect(self, count: int) -> bool:
        """The next step's share of this replica is ``count`` gradients (zero included); True if it stepped."""
        if self._quotas is None:
            raise RuntimeError("expect() is for replicas; call use_quotas() first")
        self._quotas.append(count)
        return self._step_by_quota()

    def count_lost(self) -> bool:
        """A micro-batch of this step will apply no gradient here (dropped, or its holder vanished)."""
        return self._micro_batch_done()

    def _step_by_quota(self) -> bool:
        stepped = False
        while self._quotas and self._backwards >= self._quotas[0]:
            share = self._last_share = self._quotas.popleft()
            self._backwards -= share
            k = self.train_cfg.micro_batches
            if 0 < share != k:  # the mean over this replica's share, like data parallelism's local batch:
                for p in self.trainable:  # the gradient keeps its scale when the share changes (a replica
                    if p.grad is not None:  # joins or dies), so Adam's moments and clipping stay calibrated
                        p.grad.mul_(k / share)
            self.step()
            stepped = True
        return stepped

    def _named_trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def start_averaging(self) -> None:
        """Remember the parameters every replica starts from (same seed or same checkpoint)."""
        self.agreed = AgreedParameters(self._named_trainable())

    def apply_average(
        self, average: dict[str, torch.Tensor], own: dict[str, torch.Tensor], outer_lr: float, momentum: float
    ) -> None:
        """Move to the group's agreed parameters (``AgreedParameters.apply``), keeping these weights for the
        graphs in flight first."""
        if self.agreed is None:
            raise RuntimeError("start_averaging() first")
        self._keep_for_graphs()
        self.agreed.apply(average, own, outer_lr, momentum)

    def step(self) -> None:
        """Apply the accumulated gradients; the weight version counts these steps."""
        scheduled = self.train_cfg.lr_at(self.version)
        decayed = scheduled / self.train_cfg.lr if self.train_cfg.lr > 0 else 1.0
        shrink = self.train_cfg.shrinks_late_steps
        self.lr_scale = staleness_lr_scale(self._late, self._applied, decayed) if shrink else 1.0
        self._late = self._applied = 0
        for group in self.optimizer.param_groups:
            group["lr"] = scheduled * self.lr_scale
        grads = [p.grad for p in self.trainable if p.grad is not None]
        if grads and not bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()):
            self.metrics.skipped_steps += 1  # never write NaN into the weights: drop this step's gradients
            self.optimizer.zero_grad(set_to_none=True)
            grads = []
        if self.train_cfg.grad_clip > 0 and grads:
            torch.nn.utils.clip_grad_norm_(self.trainable, self.train_cfg.grad_clip)
        self._let_go_of_graphs_older_than(self.version + 1 - self.train_cfg.staleness_bound)
        self._keep_for_graphs()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self._take_held()
        every = self.train_cfg.checkpoint_every
        if every and self.version % every == 0:  # taken here, so no later step can slip in before it
            self.pending_checkpoint = (self.version, *self.checkpoint_state())

    def _let_go_of_graphs_older_than(self, version: int) -> None:
        """Their gradients will break the staleness bound and be dropped: keep no weights for them.

        So weights are kept only for graphs within S updates, whatever a slow peer does."""
        for entry in self._pending.values():
            if entry.out is not None and entry.version < version:
                entry.out = None
                self.kept.release(entry.weights)

    def _keep_for_graphs(self) -> None:
        """The trainable weights are about to change in place: keep this generation for graphs in flight."""
        self.kept.before_update()
        self.metrics.kept_weights_bytes_peak = max(self.metrics.kept_weights_bytes_peak, self.kept.peak_bytes)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of this block: everything, or only the adapters of a frozen base."""
        if hasattr(self.model, "trainable_state_dict"):
            return self.model.trainable_state_dict()
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Copies of the trainable weights and their AdamW state, under global names."""
        weights = {k: v.clone() for k, v in self.state_dict().items()}
        optim: dict[str, torch.Tensor] = {}
        if not hasattr(self.model, "trainable_state_dict"):  # adapters restart their moments (documented)
            for name, p in self.model.named_parameters():
                state = self.optimizer.state.get(p)
                if state:
                    optim[f"{name}::exp_avg"] = state["exp_avg"].detach().cpu().clone()
                    optim[f"{name}::exp_avg_sq"] = state["exp_avg_sq"].detach().cpu().clone()
                    optim[f"{name}::step"] = torch.as_tensor(state["step"], dtype=torch.float32).detach().cpu().clone()
        return weights, optim

    def parameter_names(self) -> list[str]:
        return list(self.state_dict())

    def restore(self, version: int, weights: dict[str, torch.Tensor], optim: dict[str, torch.Tensor]) -> None:
        """Continue from a checkpoint: weights, optimizer moments and the weight version."""
        if hasattr(self.model, "load_trainable_state_dict"):
            self.model.load_trainable_state_dict(weights)
        else:
            missing = set(self.model.state_dict()) - set(weights)
            if missing:
                raise ValueError(f"checkpoint v{version} lacks {sorted(missing)[:3]}")
            self.model.load_state_dict({k: weights[k] for k in self.model.state_dict()})
            for name, p in self.model.named_parameters():
                if f"{name}::exp_avg" in optim:
                    self.optimizer.state[p] = {
                        "step": optim[f"{name}::step"].clone(),
                        "exp_avg": optim[f"{name}::exp_avg"].to(p.device).clone(),
                        "exp_avg_sq": optim[f"{name}::exp_avg_sq"].to(p.device).clone(),
                    }
        self.version = version
        self._pending.clear()
        self.kept.clear()
        self.held.clear()
        self._backwards = self._late = self._applied = 0
        if self._quotas is not None:
            self._quotas.clear()
        if self.agreed is not None:
            self.start_averaging()


def staleness_lr_scale(late: int, applied: int, decayed: float = 1.0) -> float:
    """The learning rate's factor for a step whose ``applied`` gradients came back ``late`` versions late in all.

    A gradient d versions late tolerates about 1/(1 + d) of the step size a fresh one does (delayed SGD;
    staleness-aware async SGD divides the rate by the staleness), and a step of the first stage under
    S = 1 is mostly one version late, the last stage's never. So a step's lr is at most the peak over
    (1 + the mean lateness): at the peak that is the factor 1/(1 + mean lateness), which on gpt-small at 3e-3
    cut async S = 1's loss cost from +8.4% to +3.0% (2 seeds, docs/BENCHMARKS.md); a schedule that has
    decayed the lr to ``decayed`` of the peak is shrunk only below that cap. A fresh step is never shrunk,
    so S = 0 stays exactly sync. Under the in-flight cap at K at the constant lr the cap cost loss, and a stage
    does not apply it there (``TrainConfig.shrinks_late_steps``).
    """
    if not applied or decayed <= 0:
        return 1.0
    return min(1.0, 1.0 / ((1.0 + late / applied) * decayed))


def _count(targets: torch.Tensor) -> int:
    return int((targets != IGNORE_INDEX).sum())
