"""The held-out loss of the chunked engine: a forward-only pass between steps by a plan of its
own (pstar_jax.plan.forward.plan_forward, made through the engine's ``Replanner``): the pending
update applied first, no gradients, no optimizer work, and the slots put back where the training
plan starts a step. The same pass with the model's ``logps_stage`` as its head gives each
position's target log-probs (``reference_logps``: full-fine-tuning DPO's stored reference).

``Evaluation`` is a part of ``ChunkedEngine`` (pstar_jax.engine.executor); it uses the engine's
store, plan, stage functions and moment actions (``_act``, ``_place_slots``, ``_put_batch``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pstar_jax.data.batch import Batch, as_batch, check_batches
from pstar_jax.engine.memory import Space
from pstar_jax.engine.pacing import Pacer
from pstar_jax.engine.stages import BoundStage
from pstar_jax.engine.zero import replicated_value
from pstar_jax.plan.planned import Plan
from pstar_jax.plan.predict import issued_during, window_capacity
from pstar_jax.plan.replay import PlanMoment


class Evaluation:
    """The forward-only held-out loss (a part of ``ChunkedEngine``)."""

    def eval_plan_for(self, batch_shape: tuple[int, int], micro_batches: int) -> Plan:
        """The forward-only plan of an evaluation over ``micro_batches`` micro-batches of the global
        ``batch_shape``, starting and ending where the current training plan starts a step
        (cached). Raises ConfigError when it does not fit."""
        key = (tuple(batch_shape), micro_batches)
        cached = self._eval_plans.get(key)
        if cached is None or cached[0] is not self.plan:
            self._eval_plans[key] = cached = (self.plan, self.replanner.for_evaluation(self.plan, key[0], micro_batches))
        return cached[1]

    def evaluate(self, micro_batches: Sequence[Batch | tuple[np.ndarray, np.ndarray]]) -> float:
        """The mean loss over the trained tokens of all micro-batches (this process's rows of each):
        forward only, no gradients, no optimizer work, the current params (a pending update is
        applied first). Chunks move as the forward-only plan says, and afterwards sit where the
        training plan starts a step; the store's traffic counts the evaluation's copies alone."""
        micro_batches = [as_batch(b) for b in micro_batches]
        check_batches(micro_batches, self.model)
        _, scale = self.fns.count(self._put_counts(micro_batches))
        losses = self._forward_only(micro_batches, self.fns.loss)
        return replicated_value(jnp.sum(sum(losses) * scale))  # sync

    def reference_logps(self, micro_batches: Sequence[Batch]) -> list[np.ndarray]:
        """Each micro-batch's per-position target log-probs [B, L] (this process's rows; 0 off the
        loss mask) under the current params: the forward-only pass of ``evaluate`` with the model's
        ``logps_stage`` as its last stage (under a preference objective the base model's: the
        head's tensors, so its chunks and plan are the evaluation's). Before step 0 this is the
        stored reference of full-fine-tuning DPO (pstar_jax.data.ref_logps)."""
        check_batches(micro_batches, self.model)
        head = getattr(self.model, "base", self.model).logps_stage()

        def logps(bound: BoundStage):
            if tuple(head.param_names) != tuple(bound.stage.param_names):
                raise ValueError(f"the model's logps_stage reads {head.param_names}, its last stage "
                                 f"{bound.stage.param_names}; they must read the same tensors")
            return self.fns.forward(dataclasses.replace(bound, stage=head))
        return [_local_rows(x) for x in self._forward_only(micro_batches, logps)]  # sync

    def _forward_only(self, micro_batches: list[Batch], last: Callable[[BoundStage], Callable]) -> list[jax.Array]:
        """The last stage's outputs (``last(bound)`` the compiled function that gives them) for each
        micro-batch, over the forward-only plan."""
        self.flush()
        rows, seq_len = micro_batches[0].shape
        plan = self.eval_plan_for((rows * jax.process_count(), seq_len), len(micro_batches))
        self._begin_reads(plan)
        self.store.traffic.reset()
        self.store.peak_device_bytes = self.store.bytes[Space.DEVICE]
        moments, outs, x, batch = plan.moments, [], None, None
        issued = issued_during(moments)
        pacer = Pacer()
        for t, moment in enumerate(moments):
            if not moment.prefetch:
                self._act(self._in_slots(moment), moment.capacity_bytes)
            i = moment.index
            if moment.phase in ("fwd", "loss"):
                params = tuple(self.store.get(self._params_key(c), Space.DEVICE) for c in self.bound[i].chunks)
                if i == 0:
                    batch = self._put_batch(micro_batches[moment.micro])
                    x = batch.tokens
                if moment.phase == "fwd":
                    x = self.fns.forward(self.bound[i])(params, self._offsets[i], x, batch)
                    pacer.mark(x)
                else:
                    outs.append(last(self.bound[i])(params, self._offsets[i], x, batch))
                    pacer.mark(outs[-1])
            for u in issued.get(t, ()):
                self._act(self._in_slots(moments[u]), window_capacity(moments, u))
        self._place_slots(self.plan)  # moves nothing: the restore moment put every slot back
        return outs

    def _in_slots(self, moment: PlanMoment) -> PlanMoment:
        """A forward-only moment with its items ("param", c) named as the store holds them between
        steps (``_params_key``: the slot ("slot", c) of a trainable chunk)."""
        def slot(item):
            return self._params_key(item[1])
        return dataclasses.replace(moment, evict=tuple(map(slot, moment.evict)), fetch=tuple(map(slot, moment.fetch)))


def _local_rows(x_BxL: jax.Array) -> np.ndarray:
    """This process's rows of a row-sharded array, in order (host numpy)."""
    shards = sorted(x_BxL.addressable_shards, key=lambda s: s.index[0].start or 0)
    seen, out = set(), []
    for s in shards:  # a row block held by several devices (replicated over another axis) once
        if (start := s.index[0].start or 0) not in seen:
            seen.add(start)
            out.append(np.asarray(s.data))
    return np.concatenate(out)
