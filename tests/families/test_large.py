"""Big-model loading: built without weights and dispatched on first use, or offloaded to disk by accelerate.

Ground truth is the plain HF model loaded from the same folder, read with forward hooks; the lazy
and the offloaded models must give the same values, logits and tool results bit for bit.
"""

from __future__ import annotations

import nnsight
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from nnterp import StandardizedTransformer, collect, logit_lens
from nnterp.families import BY_MODEL_TYPE
from nnterp.spec.locations import Unavailable

from ..conftest import build_tiny, tiny_tokenizer
from ..families.test_families import CASES, IDS, hook_capture, read_all

LARGE_CASES = ["llama", "gpt2", "opt", "falcon_7b_parallel", "gpt_oss", "gemma2", "qwen2_moe"]


def checkpoint(case, root) -> str:
    folder = root / case
    build_tiny(CASES[case][0]()).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def family_of_case(case):
    return BY_MODEL_TYPE[CASES[case][0]().model_type]


def has_internals(case) -> bool:
    config = CASES[case][0]()
    return not isinstance(family_of_case(case).attention_of(config.get_text_config()), Unavailable)


def expected_values(case, folder):
    """Hooks on the plain HF model loaded from the folder (eager attention, as the standardized models run)."""
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    hf.base_model_blocks = hf.get_submodule(family_of_case(case).layers)
    truth = CASES[case][1]
    truth = truth if callable(truth) else (lambda i, truth=truth: truth)
    return hook_capture(hf, truth, IDS), truth


def assert_values_match(model, case, folder):
    (expected, expected_logits), truth = expected_values(case, folder)
    saved, logits = read_all(model, IDS)
    assert torch.equal(logits, expected_logits)
    for i in range(model.num_layers):
        for name, where in truth(i).items():
            if where is None or (i, name) not in expected or (i, name) not in saved:
                continue
            got, want = saved[(i, name)], expected[(i, name)]
            assert torch.equal(got, want.reshape(got.shape)), f"layer {i} {name}"


def offload_map(folder, layers_path: str) -> dict[str, str]:
    """Block 0 and everything outside the blocks on the CPU, every other block offloaded to disk."""
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    device_map = {}

    def walk(prefix, module):
        for name, child in module.named_children():
            path = prefix + name
            if path == layers_path:
                device_map.update({f"{path}.{i}": "cpu" if i == 0 else "disk" for i in range(len(child))})
            elif layers_path.startswith(path + "."):
                walk(path + ".", child)
            else:
                device_map[path] = "cpu"
    walk("", skeleton)
    return device_map


@pytest.mark.parametrize("case", LARGE_CASES)
def test_lazy_model_is_built_without_weights_and_dispatched_on_first_use(case, tmp_path):
    folder = checkpoint(case, tmp_path)
    model = StandardizedTransformer(folder, dispatch=False, attention_values=has_internals(case))
    assert not model.dispatched
    assert all(p.device.type == "meta" for p in model._module.parameters())
    assert model.order(1)  # names, order and availability work before any weight exists
    assert_values_match(model, case, folder)
    assert model.dispatched and all(p.device.type == "cpu" for p in model._module.parameters())
    if has_internals(case):  # read inside eager attention, and the model left with its own implementation
        assert model.attn_implementation == AutoModelForCausalLM.from_pretrained(folder).config._attn_implementation


@pytest.mark.parametrize("case", LARGE_CASES)
def test_offloaded_model_gives_the_single_device_values_and_tool_results(case, tmp_path):
    folder = checkpoint(case, tmp_path)
    device_map = offload_map(folder, family_of_case(case).layers)
    offloaded = StandardizedTransformer(folder, device_map=device_map, offload_folder=str(tmp_path / "offload"),
                                        attention_values=has_internals(case))
    assert "disk" in set(offloaded._module.hf_device_map.values())
    assert_values_match(offloaded, case, folder)
    single = StandardizedTransformer(folder, attention_values=has_internals(case))
    prompts = ["the cat sat on the mat", "Paris is in"]
    assert torch.equal(logit_lens(offloaded, prompts), logit_lens(single, prompts))
    here = collect(offloaded, prompts, tmp_path / "offloaded", ["layer_output", "mlp_output"], positions="all",
                   progress=False)
    there = collect(single, prompts, tmp_path / "single", ["layer_output", "mlp_output"], positions="all",
                    progress=False)
    assert torch.equal(here["layer_output"], there["layer_output"]) and torch.equal(here["mlp_output"], there["mlp_output"])
    if has_internals(case) and case != "opt":
        # head_outputs reads the (offloaded) output projection's weight as its forward uses it
        layer = offloaded.num_layers - 1
        with torch.no_grad(), offloaded.trace(IDS):
            heads = nnsight.save(offloaded.head_outputs(layer))
        with torch.no_grad(), single.trace(IDS):
            expected = nnsight.save(single.head_outputs(layer))
        assert heads.device.type == "cpu" and torch.equal(heads, expected)


def test_a_weightless_model_object_is_refused_with_what_to_do():
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(CASES["llama"][0]())
    with pytest.raises(ValueError, match="dispatch=False"):
        StandardizedTransformer(hf, tokenizer=tiny_tokenizer())
