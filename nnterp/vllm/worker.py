"""The worker vLLM's CPU build runs nnsight's interventions in (named by dotted path: vLLM imports it in each of its
spawned processes, so it lives in an importable module of its own).

nnsight's worker subclasses vLLM's GPU worker, whose ``init_device`` refuses a CPU, and accepts only the GPU model
runner. vLLM's ``CPUWorker`` and ``CPUModelRunner`` subclass those same GPU classes, so the two combine: the CPU
worker's device set-up, then its runner's class switched to one that is nnsight's runner over the CPU runner (the
runner adds behaviour and no constructor state, as nnsight's own switch relies on).
"""

from __future__ import annotations

from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner
from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker


class NNsightCPUModelRunner(NNsightGPUModelRunner, CPUModelRunner):
    """nnsight's interleaving runner over vLLM's CPU runner."""


class NNsightCPUWorker(NNsightGPUWorker, CPUWorker):
    """nnsight's worker (its RPCs: collect, register) with vLLM's CPU device set-up."""

    def init_device(self) -> None:
        CPUWorker.init_device(self)
        runner = self.model_runner
        if type(runner) is not CPUModelRunner:
            raise NotImplementedError(
                f"nnterp instruments vLLM's CPUModelRunner, but this worker built {type(runner).__module__}."
                f"{type(runner).__name__} (the V2 runner?). Unset VLLM_USE_V2_MODEL_RUNNER to trace.")
        runner.__class__ = NNsightCPUModelRunner


WORKER = f"{__name__}.{NNsightCPUWorker.__qualname__}"
