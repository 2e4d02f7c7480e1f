"""The workers vLLM runs nnsight's interventions in (named by dotted path: vLLM imports them in each of its spawned
processes, so they live in an importable module of their own), with nnterp's steering RPCs.

nnsight's worker subclasses vLLM's GPU worker, whose ``init_device`` refuses a CPU, and accepts only the GPU model
runner. vLLM's ``CPUWorker`` and ``CPUModelRunner`` subclass those same GPU classes, so the two combine: the CPU
worker's device set-up, then its runner's class switched to one that is nnsight's runner over the CPU runner (the
runner adds behaviour and no constructor state, as nnsight's own switch relies on).

``nnterp_steer`` / ``nnterp_unsteer`` (called by name through vLLM's ``collective_rpc``, on every worker) put a vector
on module boundaries of the engine's model for the length of one ``generate`` call: one addition to the step's whole
flat slab per module, where a trace adds it once per request (``StandardizedVLLM.steered_generate``).
"""

from __future__ import annotations

import functools

import torch
from nnsight.modeling.vllm.batching import VLLMBatcher
from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner
from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker


def _added(vector: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    # as `value[:] += vector` computes it: in the promoted dtype, rounded once to the tensor's
    return torch.add(tensor, vector).to(tensor.dtype)


def _steer_output(element: int | None, vector: torch.Tensor, module, args, output):
    if element is None or not isinstance(output, (tuple, list)):
        return _added(vector, output)
    return type(output)((*output[:element], _added(vector, output[element]), *output[element + 1:]))


def _steer_input(element: int, vector: torch.Tensor, module, args, kwargs):
    if len(args) > element:
        return (*args[:element], _added(vector, args[element]), *args[element + 1:]), kwargs
    return args, {**kwargs, "hidden_states": _added(vector, kwargs["hidden_states"])}


class SpanBatcher(VLLMBatcher):
    """nnsight's batcher over vLLM's flat slab, but a request's value handed back as the very view of the slab it
    was served (edited in place, or not at all) is left where it is: nnsight splices a swapped value back by
    concatenating the whole step's slab around it, once per request and swap, which grows with the square of the
    requests in a step (a trace's standard stream read hands its stream back at every read)."""

    def _widen_tensor(self, full: torch.Tensor, group: list, edited: torch.Tensor) -> torch.Tensor:
        dim = self._token_dim(full)
        if dim is not None and isinstance(edited, torch.Tensor):
            span = full.narrow(dim, *group)
            if edited.data_ptr() == span.data_ptr() and edited.shape == span.shape and \
                    edited.stride() == span.stride():
                return full  # the concatenation would give `full` itself
        return super()._widen_tensor(full, group, edited)


def _span_batcher(runner) -> None:
    interleaver = runner.nnsight_model.interleaver
    if type(interleaver.batcher) is VLLMBatcher:  # the class nnsight's runner made it with (no state of its own)
        interleaver.batcher.__class__ = SpanBatcher


class SteeringRPC:
    """Worker RPCs adding vectors at module boundaries of the model, for the requests of one generate call."""

    def nnterp_steer(self, edits: list[tuple[str, str, int | None, torch.Tensor]]) -> None:
        """``edits``: ``(module path from the model's root, "output" | "input", element or None, vector)``; an
        ``"output"`` edit adds to the output (its element ``element`` where it is a tuple), an ``"input"`` edit to
        positional input ``element``."""
        self.nnterp_unsteer()
        model = self.model_runner.get_model()
        handles = []
        for path, side, element, vector in edits:
            module = model.get_submodule(path)
            weight = next(module.parameters(), None)
            vector = vector.to(weight.device) if weight is not None else vector
            handles.append(module.register_forward_hook(functools.partial(_steer_output, element, vector))
                           if side == "output" else
                           module.register_forward_pre_hook(functools.partial(_steer_input, element, vector),
                                                            with_kwargs=True))
        self._nnterp_steering = handles

    def nnterp_unsteer(self) -> None:
        for handle in getattr(self, "_nnterp_steering", ()):
            handle.remove()
        self._nnterp_steering = []


class NNsightSteeringWorker(SteeringRPC, NNsightGPUWorker):
    """nnsight's worker (CUDA), with nnterp's steering RPCs and its batcher's splice of unchanged views skipped."""

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        _span_batcher(self.model_runner)


class NNsightCPUModelRunner(NNsightGPUModelRunner, CPUModelRunner):
    """nnsight's interleaving runner over vLLM's CPU runner."""


class NNsightCPUWorker(SteeringRPC, NNsightGPUWorker, CPUWorker):
    """nnsight's worker (its RPCs: collect, register) with vLLM's CPU device set-up, and nnterp's steering RPCs."""

    def init_device(self) -> None:
        CPUWorker.init_device(self)
        runner = self.model_runner
        if type(runner) is not CPUModelRunner:
            raise NotImplementedError(
                f"nnterp instruments vLLM's CPUModelRunner, but this worker built {type(runner).__module__}."
                f"{type(runner).__name__} (the V2 runner?). Unset VLLM_USE_V2_MODEL_RUNNER to trace.")
        runner.__class__ = NNsightCPUModelRunner

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        _span_batcher(self.model_runner)


WORKER = f"{__name__}.{NNsightCPUWorker.__qualname__}"
