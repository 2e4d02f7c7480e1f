"""A norm's facts declared once (nnterp.core.norms): the kind and epsilon it declares reproduce the module's own
output, by the math of each kind (LayerNorm: centred, then scaled; RMSNorm: scaled only)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from nnterp.core.norms import declared_offset, is_norm, norm_epsilon, norm_form, norm_kind


def by_the_math(x, centred, eps, weight, offset, bias):
    x = x.float()
    x = x - x.mean(-1, keepdim=True) if centred else x
    y = x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * (weight.float() + offset)
    return y if bias is None else y + bias


NORMS = {
    "torch LayerNorm": (lambda: nn.LayerNorm(16, eps=1e-3), 0.0),
    "torch RMSNorm": (lambda: nn.RMSNorm(16, eps=1e-4), 0.0),
    "Llama's RMSNorm": (lambda: LlamaRMSNorm(16, eps=1e-4), 0.0),
    "Gemma's RMSNorm (1 + weight, from its source)": (lambda: GemmaRMSNorm(16, eps=1e-4), 1.0),
}


@pytest.mark.parametrize("case", NORMS)
def test_the_declared_kind_and_epsilon_reproduce_the_modules_output(case):
    build, offset = NORMS[case]
    torch.manual_seed(0)
    module = build()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.5)
    x = torch.randn(2, 5, 16) * 3 + 1
    centred, eps = norm_form(module)
    assert is_norm(module) and eps == norm_epsilon(module)
    with torch.no_grad():
        expected = by_the_math(x, centred, eps, module.weight, offset, getattr(module, "bias", None))
        torch.testing.assert_close(module(x).float(), expected, atol=1e-5, rtol=1e-5)
        # the other kind does not: the declaration is not a guess that happens to fit
        assert not torch.allclose(by_the_math(x, not centred, eps, module.weight, offset,
                                              getattr(module, "bias", None)), expected, atol=1e-3)


def test_vllms_norms_are_read_by_their_class_without_being_called():
    class RMSNorm(nn.Module):  # vLLM's names and attributes (its fused kernels are not called)
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = nn.Parameter(torch.ones(4)), 1e-6

    class GemmaRMSNorm(RMSNorm):
        pass

    assert (norm_kind(RMSNorm()), norm_epsilon(RMSNorm()), declared_offset(RMSNorm())) == ("rms_norm", 1e-6, 0.0)
    assert (norm_kind(GemmaRMSNorm()), declared_offset(GemmaRMSNorm())) == ("rms_norm", 1.0)


def test_another_module_is_no_layernorm_or_rmsnorm():
    assert norm_kind(nn.Linear(2, 2)) is None and not is_norm(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not a LayerNorm or an RMSNorm"):
        norm_form(nn.GroupNorm(2, 4))
