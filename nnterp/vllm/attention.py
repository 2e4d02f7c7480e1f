"""The attention's scores and probabilities on vLLM, which its paged-attention kernel never materializes: recomputed
inside the trace from the queries and keys entering the kernel (``Attention(q, k, v)``, the queries and keys already
rotated), with the kernel's own scale, softcap, sliding window or chunks, ALiBi slopes, sinks and causal mask, as
transformers' eager attention computes them (the masked scores at the dtype's minimum, the softmax in float32).

They exist for the prompt's own pass: a later step (a generated token, or a prompt longer than one step's token
budget) reads the earlier keys from the paged KV cache, which no module boundary holds.
"""

from __future__ import annotations

import torch
from nnsight.intervention.interleaver import Mediator

from ..spec.errors import BadAssignment, NNterpError


class NotAtThisStep(NNterpError, ValueError):
    """A value that exists on the prompt's pass only, read at a later step."""


def kernel_facts(kernel: torch.nn.Module) -> dict:
    """What the recomputation needs of one block's attention kernel (vLLM's ``Attention`` module), as plain numbers
    that travel with the trace: heads, key-value heads, head sizes, scale, softcap, sliding window, ALiBi slopes."""
    impl = getattr(kernel, "impl", None)
    slopes = getattr(impl, "alibi_slopes", None)
    if slopes is not None and slopes.is_meta:  # the client's tree is built on the meta device: BLOOM's own slopes
        from vllm.model_executor.models.bloom import _get_alibi_slopes

        slopes = _get_alibi_slopes(kernel.num_heads)
    softcap = getattr(impl, "logits_soft_cap", None)
    return {"heads": kernel.num_heads, "kv_heads": kernel.num_kv_heads, "head_dim": kernel.head_size,
            "sinks": getattr(impl, "sinks", None) is not None,  # GPT-OSS's: one logit per head joins the softmax
            "value_dim": getattr(kernel, "head_size_v", kernel.head_size), "scale": float(impl.scale),
            "softcap": float(softcap) if softcap else None, "window": getattr(kernel, "sliding_window", None),
            "chunk": getattr(kernel, "attention_chunk_size", None),  # Llama 4's chunked local attention
            "slopes": None if slopes is None else [float(s) for s in torch.as_tensor(slopes).flatten()]}


def scores(queries: torch.Tensor, keys: torch.Tensor, facts: dict) -> torch.Tensor:
    """``[1, heads, tokens, tokens]`` scores of one prompt's pass from its flat queries ``[tokens, heads * dim]`` and
    keys ``[tokens, kv_heads * dim]``: scaled, softcapped, ALiBi added, the keys after each query (and those beyond
    the sliding window) at the dtype's minimum, as transformers' eager attention leaves them before the softmax."""
    tokens, heads, kv_heads = queries.shape[0], facts["heads"], facts["kv_heads"]
    q = queries.reshape(tokens, heads, -1).transpose(0, 1).float()
    k = keys.reshape(tokens, kv_heads, -1).transpose(0, 1).float().repeat_interleave(heads // kv_heads, dim=0)
    out = (q @ k.transpose(-1, -2)) * facts["scale"]
    if facts["softcap"]:
        out = torch.tanh(out / facts["softcap"]) * facts["softcap"]
    position = torch.arange(tokens, device=out.device)
    if facts["slopes"] is not None:  # BLOOM's: the slope times the key's position
        out = out + torch.tensor(facts["slopes"], device=out.device).view(-1, 1, 1) * position.view(1, 1, -1)
    later = position.view(1, -1) > position.view(-1, 1)
    if facts["window"]:
        later = later | (position.view(-1, 1) - position.view(1, -1) >= facts["window"])
    if facts.get("chunk"):  # a query attends to the keys of its own chunk only
        later = later | (position.view(-1, 1) // facts["chunk"] != position.view(1, -1) // facts["chunk"])
    return out.masked_fill(later, torch.finfo(queries.dtype).min).to(queries.dtype).unsqueeze(0)


def recomputed(envoy, name: str, location: str, mediator) -> torch.Tensor:
    """Inside a trace: ``attention_scores`` or ``attention_probabilities`` of the block ``envoy`` belongs to, from
    the kernel's inputs at ``location`` (``mediator``: this invoke's)."""
    args, _ = Mediator.value(location)
    if mediator.occurrence(location) != 0:  # visits before this one: 0 on the prompt's pass
        # not ValueUnavailable (an AttributeError: a property raising it would read as "no such attribute")
        raise NotAtThisStep(
            f"'self_attn.{name}' on {envoy._nnterp_family.name} (vLLM): it is recomputed from the queries and keys "
            "of the prompt's own pass; at a later step (a generated token, or a prompt longer than one step's token "
            "budget) the attention reads the earlier keys from the paged KV cache, which no module boundary holds. "
            "Read it on the prompt's pass (step 0).")
    out = scores(args[0], args[1], envoy._nnterp_kernel)
    if name == "attention_probabilities" and envoy._nnterp_kernel.get("sinks"):
        # the softmax over the scores and the head's sink logit, the sink's column then dropped (transformers' eager
        # attention of GPT-OSS): a row sums to less than 1 by what the sink took
        sinks = envoy._module.sinks.float().view(1, -1, 1, 1).expand(*out.shape[:-1], 1)
        out = torch.cat([out.float(), sinks], dim=-1).softmax(dim=-1)[..., :-1].to(args[0].dtype)
    elif name == "attention_probabilities":
        out = out.float().softmax(dim=-1).to(args[0].dtype)
    return out


def refuse_write(name: str) -> None:
    raise BadAssignment(f"'{name}' is recomputed on vLLM from the queries and keys (its kernel never materializes "
                        "it): assigning it would change nothing the model computes. Edit the queries or keys instead.")
