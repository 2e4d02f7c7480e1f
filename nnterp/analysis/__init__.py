"""Decomposition and direct logit attribution over one pass's cache, by TransformerLens's names.

``decompose_resid`` splits the stream into what each block adds, ``accumulated_resid`` stacks the stream
as each block receives it, ``stack_head_results`` and ``stack_neuron_results`` split the attention's and
the MLP's outputs per head and per neuron, ``apply_ln_to_stack`` passes a stack through a norm frozen as
it was in the pass, and ``logit_attrs`` projects a stack on the head's rows of some tokens (direct logit
attribution). ``ActivationCache``'s methods of the same names call these; they read the cache, the
family spec and the model's modules (``model.block_spec``, ``model.location``, ``model.timeline``, the
modules' weights), none of the engine's private state, and never run the model.

Exactness. A block's identity is the addition tree its spec declares (``nnterp.spec.identity.Sum``, in the
code's own order of addition): its addends are the contributions (each as it reaches the stream: Granite's
times ``residual_multiplier``) and the stream the block received. The decomposition is those addends, and
``recompose`` adds them back along the trees, which is the stream bit for bit. A block whose identity is not
such a sum (a scalar or gate on the stream, a norm after the add, mixed or parallel streams) is refused with
the reason, as is a model that changes the stream between blocks.

Norms. A norm is frozen as the affine map it applied in the pass (``norms``), so a stack whose rows sum to
the stream sums, through the frozen norm, to the normed stream the model saw less the norm's bias (within
rounding); the bias, and the head's in an attribution, are rows of their own with ``incl_bias=True``. The decomposition keeps the model's dtype, in which its sums are exact; everything
computed from it (norms, heads, neurons, attributions) is float32.

The modules, by concern: ``blocks`` (a block's identity as a sum), ``decomposition`` (the stream's rows),
``norms`` (frozen norms), ``stacks`` (heads and neurons), ``experts`` (routed experts' neurons),
``attribution`` (logit attributions), ``served`` (what each family serves), ``checks`` and ``reading``
(refusals, tolerances and the cache's slices).
"""

from __future__ import annotations

from .attribution import logit_attrs
from .blocks import BlockSum, block_sum
from .checks import AnalysisUnavailable, NonFiniteValues
from .decomposition import MODES, SHORT, accumulated_resid, decompose_resid, recompose
from .experts import ROUTING, expert_neuron_results, experts_of
from .norms import FrozenNorm, apply_ln_to_stack, frozen_norm
from .reading import stream_at
from .served import SERVED, refusal
from .stacks import head_results, neuron_results, stack_head_results, stack_neuron_results

__all__ = ["MODES", "ROUTING", "SERVED", "SHORT", "AnalysisUnavailable", "BlockSum", "FrozenNorm", "NonFiniteValues",
           "accumulated_resid", "apply_ln_to_stack", "block_sum", "decompose_resid", "expert_neuron_results",
           "experts_of", "frozen_norm", "head_results", "logit_attrs", "neuron_results", "recompose", "refusal",
           "stack_head_results", "stack_neuron_results", "stream_at"]
