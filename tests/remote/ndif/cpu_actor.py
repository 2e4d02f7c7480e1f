"""NDIF's model actor on a machine without a GPU: imported by the server (Ray) side only.

NDIF's ``BaseModelDeployment`` touches CUDA in exactly ``load_from_disk``, ``cleanup`` and the cache moves
(``set_device``, ``synchronize``, a check that every tensor is on a GPU); this subclass overrides those and nothing
else. It loads the model the same way (``HuggingFaceModel.from_model_key`` with the deployment's dtype), so the
request path (queue, deserialization against the server's module tree, execution, results) is NDIF's own code.
"""

import gc

import ray
from ndif.services.ray.deployments.modeling.base import BaseModelDeployment
from nnsight.modeling.huggingface import HuggingFaceModel


@ray.remote(num_cpus=1, max_restarts=-1)
class CPUModelActor(BaseModelDeployment):
    CACHEABLE = False  # no GPU to free: the controller evicts instead of parking weights on the CPU

    def load_from_disk(self) -> HuggingFaceModel:
        model = HuggingFaceModel.from_model_key(self.model_key, dispatch=True, dtype=self.dtype_name, **self.kwargs)
        model._module.requires_grad_(False)
        return model

    def cleanup(self) -> None:
        self.kill_switch.clear()
        self.kill_reason = None
        self.execution_ident = None
        self.model.interleaver.cancel()
        gc.collect()

    async def to_cache(self) -> None:
        raise RuntimeError("CPUModelActor is not cacheable")

    def from_cache(self, gpu_mem_bytes_by_id) -> None:
        raise RuntimeError("CPUModelActor is not cacheable")
