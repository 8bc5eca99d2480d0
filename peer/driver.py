"""The data source on the first stage: admits micro-batches and closes each optimizer step.

Sync schedule (GPipe): all micro-batches of a step go forward, their gradients come back, every stage
steps once, and only then does the next step begin. This is the exact reference every faster
schedule is measured against. The loss of each micro-batch rides back on its gradient packet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from swarm.config import ModelConfig, TrainConfig
from swarm.data import Corpus
from swarm.pb import control_pb2 as cpb
from swarm.pb import wire_pb2 as pb

if TYPE_CHECKING:
    from peer.daemon import PeerDaemon

log = logging.getLogger(__name__)


class SyncDriver:
    def __init__(self, daemon: PeerDaemon, train: TrainConfig, model: ModelConfig) -> None:
        self.d, self.train, self.model = daemon, train, model
        self.corpus: Corpus | None = None
        self._next_id = 1
        self._step_loss = 0.0
        self._step_tokens = 0
        self._step_done: asyncio.Event = asyncio.Event()
        self._evals: dict[int, asyncio.Future] = {}
        self._task: asyncio.Task | None = None
        self._stop = False

    def load_data(self) -> None:
        self.corpus = Corpus.load(self.train.data)
        log.info("data %s: %d train / %d validation tokens (digest %s)",
                 self.train.data, len(self.corpus.train), len(self.corpus.val), self.corpus.digest)

    def stop_after_step(self) -> None:
        """Finish the step in progress, then report the run finished."""
        self._stop = True

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _mb(self, step: int, index: int, *, eval_: bool = False) -> pb.MicroBatch:
        mb = pb.MicroBatch(id=self._next_id, step=step, index=index, eval=eval_,
                           weight_version=self.d.runner.version)
        self._next_id += 1
        return mb

    def _batch(self, split: str, step: int, index: int):
        return self.corpus.batch(split=split, seed=self.train.data_seed, step=step, index=index,
                                 batch_size=self.train.micro_batch_size, context=self.model.context)

    async def run(self, first_step: int, num_steps: int) -> None:
        self._task = asyncio.current_task()
        d = self.d
        try:
            for step in range(first_step, first_step + num_steps):
                t0 = time.perf_counter()
                self._step_loss, self._step_tokens = 0.0, 0
                self._step_done = asyncio.Event()
                for index in range(self.train.micro_batches):
                    x, y = self._batch("train", step, index)
                    await self._forward(self._mb(step, index), x, y)
                await asyncio.wait_for(self._step_done.wait(), d.settings.step_timeout)
                result = cpb.StepResult(step=step, loss=self._step_loss / max(self._step_tokens, 1),
                                        tokens=self._step_tokens, seconds=time.perf_counter() - t0)
                evals = []
                last = step == first_step + num_steps - 1 or self._stop
                if last or (self.train.eval_every and (step + 1) % self.train.eval_every == 0):
                    evals.append(await self.evaluate(step))
                await d.report(steps=[result], evals=evals, finished=last)
                if last:
                    return
        except TimeoutError:
            await d.fail(f"no gradients came back within {d.settings.step_timeout:.0f} s; a stage is stuck or gone")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - report, then let the coordinator decide
            log.exception("driver failed")
            await d.fail(f"data source failed: {e}")

    async def _forward(self, mb: pb.MicroBatch, x, y) -> None:
        d = self.d
        runner = d.runner
        train = not mb.eval
        result = await d.run_compute(lambda: runner.forward(mb.id, x, y if runner.is_last else None, train=train))
        if runner.is_last:  # a single-stage swarm: the loss is already here
            await self._account(mb, result.loss_sum, result.tokens, stepped=result.stepped)
            return
        packet = await d.run_compute(d.policy.activations, mb, result.output, y)
        await d.downstream.send(packet)

    async def on_gradients(self, g: pb.Gradients) -> None:
        """A gradient (or an eval loss) came back from stage 1."""
        d = self.d
        if g.mb.eval:
            fut = self._evals.pop(g.mb.id, None)
            if fut is not None and not fut.done():
                fut.set_result((g.loss_sum, g.tokens))
            return

        def job():
            grad = d.policy.decode(g.grad)
            return d.runner.backward(g.mb.id, grad)

        _, stepped = await d.run_compute(job)
        await self._account(g.mb, g.loss_sum, g.tokens, stepped=stepped)

    async def _account(self, mb: pb.MicroBatch, loss_sum: float, tokens: int, *, stepped: bool) -> None:
        if mb.eval:
            fut = self._evals.pop(mb.id, None)
            if fut is not None and not fut.done():
                fut.set_result((loss_sum, tokens))
            return
        self._step_loss += loss_sum
        self._step_tokens += tokens
        if stepped:
            self._step_done.set()

    async def evaluate(self, step: int) -> cpb.EvalResult:
        """Mean validation loss over fixed batches, forward only through the whole pipeline."""
        loop = asyncio.get_running_loop()
        futures = []
        for index in range(self.train.eval_batches):
            x, y = self._batch("val", 0, index)
            mb = self._mb(step, index, eval_=True)
            fut = loop.create_future()
            self._evals[mb.id] = fut
            futures.append(fut)
            await self._forward(mb, x, y)
        results = await asyncio.wait_for(asyncio.gather(*futures), self.d.settings.step_timeout)
        loss = sum(r[0] for r in results)
        tokens = sum(r[1] for r in results)
        return cpb.EvalResult(step=step, loss=loss / max(tokens, 1), tokens=tokens)
