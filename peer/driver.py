"""The data source on the first stage: admits micro-batches under the staleness bound, reports steps.

One loop serves every schedule. Micro-batch ``i`` of the run belongs to step ``i // K``; it is admitted
when ``swarm.train.admission.Admission`` allows (in-flight and staleness bounds). With ``S = 0`` that is the
synchronous GPipe schedule exactly; with ``S > 0`` the next steps' micro-batches stream in while the
current step's gradients are still coming back. Validation drains the pipeline first, so it always sees
one consistent set of weights. The loss of each micro-batch rides back on its gradient packet.

The driver takes the first stage's :class:`peer.stage.Stage` and uses its data path (forward, encode,
route; the one backward path); what it tells the coordinator goes through the ``report`` and ``fail``
callables it is given, so it never reaches into the peer around it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from peer.compute import BACKWARD, FORWARD
from peer.stage import Stage
from swarm.config import HFConfig, ModelConfig, TrainConfig
from swarm.pb import control_pb2 as cpb
from swarm.pb import wire_pb2 as pb
from swarm.train.admission import Admission, PipeWindow
from swarm.train.data import Corpus, epoch_samples

log = logging.getLogger(__name__)
REPORT_FLUSH_TIMEOUT = 15.0  # seconds for the step reports that precede a failure (one report call: 10 s)
_FAILED = object()  # the last item on the report queue when the driver fails
MIN_REPORT_GAP = 0.25  # seconds between step reports; steps that finish meanwhile ride in the next one


Report = Callable[..., Awaitable[None]]  # report(steps=..., evals=..., finished=...)


class Driver:
    """The data source of one first Stage: closed with it (``Stage.source``)."""

    def __init__(
        self,
        stage: Stage,
        train: TrainConfig,
        model: ModelConfig,
        hf: HFConfig | None,
        *,
        report: Report,
        fail: Callable[[str], Awaitable[None]],
        step_timeout: float,
    ) -> None:
        self.stage, self.train, self.model, self.hf = stage, train, model, hf
        self._report, self._fail, self.step_timeout = report, fail, step_timeout
        self.corpus: Corpus | None = None
        self.admission = Admission(train.micro_batches, train.staleness_bound, train.in_flight_limit)
        # async with no fixed --max-in-flight: admit 2+ versions late only what the pipeline needs
        measured = train.staleness_bound >= 2 and not train.max_in_flight  # S = 1 never asks it
        self.window = PipeWindow(floor=train.micro_batches) if measured else None
        self._admitted_at: dict[int, float] = {}
        self._next_id = 1
        self._changed = asyncio.Event()
        self._evals: dict[int, asyncio.Future] = {}
        self._task: asyncio.Task | None = None
        self._stop = False
        self._first_step = 0
        self._step_loss: dict[int, tuple[float, int]] = {}  # step -> its loss and tokens so far
        self._step_t0 = time.perf_counter()
        self._reports: asyncio.Queue[cpb.StepResult | cpb.EvalResult | object | None] = asyncio.Queue()
        self.dropped = 0

    def load_data(self) -> None:
        if self.hf is not None:  # the checkpoint's own tokenizer, from its local directory
            from swarm.train.hf import TokenCorpus

            self.corpus = TokenCorpus.load(self.train.data, self.hf.path)
            log.info("data %s tokenised with %s", self.train.data, self.hf.path)
            return
        self.corpus = Corpus.load(self.train.data)
        log.info(
            "data %s: %d train / %d validation tokens (digest %s)",
            self.train.data,
            len(self.corpus.train),
            len(self.corpus.val),
            self.corpus.digest,
        )

    def stop_after_step(self) -> None:
        """Admit nothing more; finish what is in flight, then report the run finished."""
        self._stop = True
        self._changed.set()

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _mb(self, step: int, index: int, *, eval_: bool = False) -> pb.MicroBatch:
        mb = pb.MicroBatch(
            id=self._next_id, step=step, index=index, eval=eval_, weight_version=self.stage.runner.version
        )
        self._next_id += 1
        return mb

    def _batch(self, split: str, step: int, index: int):
        return self.corpus.batch(
            split=split,
            seed=self.train.data_seed,
            step=step,
            index=index,
            batch_size=self.train.micro_batch_size,
            context=self.model.context,
        )

    def _train_batch(self, mb: pb.MicroBatch):
        """Micro-batch ``mb``'s sequences: fresh windows, or (``--train-samples``) the fixed set's next ones,
        whose indices ``mb`` then carries down the pipeline."""
        t = self.train
        if not t.train_samples:
            return self._batch("train", mb.step, mb.index)
        position = (mb.step * t.micro_batches + mb.index) * t.micro_batch_size
        ids = epoch_samples(t.data_seed, t.train_samples, position, t.micro_batch_size)
        mb.samples.extend(ids)
        return self.corpus.samples(seed=t.data_seed, ids=ids, context=self.model.context)

    def _eval_due(self, step: int) -> bool:
        return bool(self.train.eval_every) and (step + 1) % self.train.eval_every == 0

    async def _until(self, condition, what: str) -> None:
        """Wait for ``condition()``, failing if nothing comes back for a whole step timeout."""
        while not condition():
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), self.step_timeout)
            except TimeoutError:
                raise TimeoutError(
                    f"nothing came back for {self.step_timeout:.0f} s while waiting "
                    f"for {what}; a stage is stuck or gone"
                ) from None

    async def run(self, first_step: int, num_steps: int) -> None:
        self._task = asyncio.current_task()
        self._first_step = first_step
        adm, k = self.admission, self.train.micro_batches
        adm.sync_admissions = max(0, self.train.async_from - first_step) * k
        reporter = asyncio.create_task(self._report_steps())
        self._step_t0 = time.perf_counter()
        try:
            total = num_steps * k
            while adm.admitted < total and not self._stop:
                step, index = first_step + adm.admitted // k, adm.admitted % k
                if index == 0 and step > first_step and self._eval_due(step - 1):
                    await self._until(lambda: adm.in_flight == 0, "the pipeline to drain before validation")
                    await self._put_eval(await self.evaluate(step - 1))
                await self._until(lambda: adm.can_admit() or self._stop, "room under the staleness bound")
                if self._stop:
                    break
                adm.admit()
                mb = self._mb(step, index)
                x, y = self._train_batch(mb)
                if self.window is not None:
                    self._admitted_at[mb.id] = time.monotonic()
                await self._forward(mb, x, y)
            await self._until(lambda: adm.in_flight == 0, "the last gradients")
            last = first_step + adm.steps_done - 1
            await self._put_eval(await self.evaluate(last))
            await self._reports.put(None)
            await reporter
        except TimeoutError as e:
            await self._fail_after_reports(reporter, str(e))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - report, then let the coordinator decide
            log.exception("driver failed")
            await self._fail_after_reports(reporter, f"data source failed: {e}")
        finally:
            reporter.cancel()

    async def _fail_after_reports(self, reporter: asyncio.Task, reason: str) -> None:
        """Report the steps finished before the failure, then the failure: the coordinator counts the steps
        done from these reports, and a step count that depended on when the failure struck within a report
        gap made one deterministic failure look like two different ones."""
        self._reports.put_nowait(_FAILED)
        try:
            await asyncio.wait_for(reporter, REPORT_FLUSH_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - the failure below is what matters; say why steps may be missing
            log.warning("step reports before the failure not all sent: %r", e)
        await self._fail(reason)

    async def _report_steps(self) -> None:
        """Send step and eval results in order, off the gradient path; whatever piled up goes in one report."""
        while True:
            items = [await self._reports.get()]
            while not self._reports.empty():
                items.append(self._reports.get_nowait())
            finished, failed = items[-1] is None, items[-1] is _FAILED
            items = [i for i in items if i is not None and i is not _FAILED]
            steps = [i for i in items if isinstance(i, cpb.StepResult)]
            evals = [i for i in items if isinstance(i, cpb.EvalResult)]
            if steps or evals or finished:
                await self._report(steps=steps, evals=evals, finished=finished)
            if finished or failed:
                return
            await asyncio.sleep(MIN_REPORT_GAP)  # fast steps: one report carries many (the coordinator rate-limits)

    async def _forward(self, mb: pb.MicroBatch, x, y) -> None:
        stage = self.stage
        runner = stage.runner
        train = not mb.eval
        result = await stage.compute(
            lambda: runner.forward(mb.id, x, y if runner.is_last else None, train=train, step=mb.step), priority=FORWARD
        )
        if runner.is_last:  # a single-stage swarm: the loss is already here
            self._account(mb, result.loss_sum, result.tokens, dropped=False)
            return
        packet = await stage.compute(stage.outgoing, mb, result.output, y, priority=FORWARD)
        if not stage.closed:
            await stage.send_down(packet)

    async def on_gradients(self, g: pb.Gradients, sender: str) -> None:
        """A gradient (or an eval loss, or a drop) came back from ``sender``, the holder of stage 1 that ran
        its forward: a refused gradient is charged to that holder (``Stage.backward_job``)."""
        if g.mb.eval:
            self._account(g.mb, g.loss_sum, g.tokens, dropped=g.dropped)
            return
        packet = await self.stage.compute(self.stage.backward_job, g, sender, priority=BACKWARD)
        self._account(g.mb, g.loss_sum, g.tokens, dropped=packet.gradients.dropped)

    def _account(self, mb: pb.MicroBatch, loss_sum: float, tokens: int, *, dropped: bool) -> None:
        if mb.eval:
            fut = self._evals.pop(mb.id, None)
            if fut is not None and not fut.done():
                fut.set_result((loss_sum, tokens, dropped))
            return
        k = self.train.micro_batches
        finished = self.admission.complete((mb.step - self._first_step) * k + mb.index)
        admitted_at = self._admitted_at.pop(mb.id, None)
        if self.window is not None and admitted_at is not None and not dropped:
            now = time.monotonic()
            self.window.completed(now, now - admitted_at)
            size = self.window.size()
            if size != self.admission.window:
                log.debug("pipeline window: %s micro-batches in flight", size)
            self.admission.window = size
        loss, tokens_so_far = self._step_loss.get(mb.step, (0.0, 0))
        if dropped:
            self.dropped += 1
        else:
            self._step_loss[mb.step] = (loss + loss_sum, tokens_so_far + tokens)
        done = self._first_step + self.admission.steps_done
        for step in range(done - finished, done):  # in order, each with its own micro-batches' loss
            now = time.perf_counter()
            loss, tokens_so_far = self._step_loss.pop(step, (0.0, 0))
            self._reports.put_nowait(
                cpb.StepResult(
                    step=step, loss=loss / max(tokens_so_far, 1), tokens=tokens_so_far, seconds=now - self._step_t0
                )
            )
            self._step_t0 = now
        self._changed.set()

    async def _put_eval(self, result: cpb.EvalResult | None) -> None:
        if result is not None:
            await self._reports.put(result)

    async def evaluate(self, step: int) -> cpb.EvalResult | None:
        """Mean validation loss over fixed batches, forward only through the whole pipeline.

        None when a stage dropped one of them (a neighbour's tensors were refused as implausible): a mean
        over fewer batches is not comparable with the others, so that validation is skipped."""
        loop = asyncio.get_running_loop()
        futures = []
        for index in range(self.train.eval_batches):
            x, y = self._batch("val", 0, index)
            mb = self._mb(step, index, eval_=True)
            fut = loop.create_future()
            self._evals[mb.id] = fut
            futures.append(fut)
            await self._forward(mb, x, y)
        results = await asyncio.wait_for(asyncio.gather(*futures), self.step_timeout)
        dropped = sum(1 for r in results if r[2])
        if dropped:
            log.warning("validation at step %d skipped: %d of its micro-batches were dropped", step, dropped)
            return None
        loss = sum(r[0] for r in results)
        tokens = sum(r[1] for r in results)
        return cpb.EvalResult(step=step, loss=loss / max(tokens, 1), tokens=tokens)
