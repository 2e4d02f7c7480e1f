"""Remote execution (NDIF): requests keyed as the plain ``TransformersModel`` of the checkpoint, which is what
servers host, with nnterp's code shipped by value (a mixin of ``StandardizedTransformer``)."""

from __future__ import annotations

from nnsight.modeling.transformers import TransformersModel

from ..spec import attention
from .engine import WrappedModel


class RemoteExecution:
    """What a ``remote=True`` trace sends: the model key, the code, the environment."""

    def _remoteable_class(self) -> type:
        """Requests name the plain ``TransformersModel`` of the checkpoint: what remote servers host."""
        return TransformersModel

    def _remote_backend(self, remote, blocking, job_id, verbose):
        """Ship nnterp's code with the request (by value): the server has only torch, transformers and nnsight; a
        request the server's Python could not run is refused before it is sent (``nnterp.core.remote_env``)."""
        import nnsight

        from .remote_env import CheckedRemoteBackend

        nnsight.register(__name__.partition(".")[0])
        return CheckedRemoteBackend.of(TransformersModel._remote_backend(self, remote, blocking, job_id, verbose))

    def _remoteable_get_env(self: WrappedModel) -> dict:
        """The environment a remote request carries: eager attention while the attention values are on."""
        env = TransformersModel._remoteable_get_env(self)
        if self._nnterp_attention_on:
            # the server switches through transformers, which refuses a class with an attention of its own code
            # (a multimodal model's vision tower): say so before sending a request bound to fail
            can_switch = getattr(type(self._module), "_can_set_attn_implementation", lambda: True)
            # a model that runs its own eager code already (BLOOM, MPT, GPT-Neo) needs no switch
            if attention.implementation_of(self._module) != attention.IMPLEMENTATION and not can_switch():
                raise ValueError(
                    f"The attention values cannot run remotely on {type(self._module).__name__}: the server switches "
                    "a model to eager attention through transformers, which refuses this class (part of it computes "
                    "attention in its own code). Call model.disable_attention_values() for remote traces; every "
                    "other value runs remotely."
                )
            env["attn_implementation"] = attention.IMPLEMENTATION
        return env
