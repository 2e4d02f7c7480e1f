"""The residual identity, checked per block on the values the family spec places."""

from __future__ import annotations

from dataclasses import dataclass

import nnsight
import torch


IDENTITY_TERMS = ("layer_input", "attention_output", "mlp_output", "layer_output")


@dataclass(frozen=True)
class IdentityResult:
    layer: int
    formula: str
    exact: bool  # the family's formula, in the code's order of addition, gives layer_output bit for bit
    max_abs_diff: float

    def __str__(self) -> str:
        status = "exact" if self.exact else f"MISMATCH (max |diff| {self.max_abs_diff:.3g})"
        return f"layer {self.layer}: {self.formula}: {status}"


def check_identity(model, inputs=None) -> list[IdentityResult]:
    """Read every block's values in forward order in one trace and recompute ``layer_output``."""
    if inputs is None:
        inputs = torch.arange(1, 9).remainder(model.vocab_size).unsqueeze(0)
    with torch.no_grad(), model.trace(inputs):
        terms = nnsight.save([{} for _ in range(model.num_layers)])
        for i in range(model.num_layers):
            for _, key, location in model._timeline(i):
                name = key.rpartition(".")[2]
                if key.startswith("extra.") or name in IDENTITY_TERMS:
                    terms[i][name] = location.read(model.layers[i], model.num_heads)
    results = []
    for i, values in enumerate(terms):
        block = model.block_spec(i)
        recomputed = block.combine(values, model.layers[i]._module)
        diff = (recomputed.float() - values["layer_output"].float()).abs().max().item()
        results.append(IdentityResult(i, block.formula, torch.equal(recomputed, values["layer_output"]), diff))
    return results
