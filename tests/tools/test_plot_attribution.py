"""The direct logit attribution heatmap (``plot_attribution``): each attribution in the cell its label names."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest
import torch

from nnterp import StandardizedTransformer
from nnterp.families import BY_MODEL_TYPE
from nnterp.tools.plots import plot_attribution

from ..conftest import build_tiny, tiny_tokenizer

PNG = b"\x89PNG\r\n\x1a\n"
PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def attributed():
    """A tiny Llama's attributions of one logit: per component (``decompose_resid``) and per head."""
    model = StandardizedTransformer(build_tiny(BY_MODEL_TYPE["llama"].tiny_config()), tokenizer=tiny_tokenizer())
    _, cache = model.run_with_cache(PROMPT)
    token = model.tokenizer.convert_tokens_to_ids("mat")
    stack, labels = cache.decompose_resid(pos_slice=-1, return_labels=True)
    by_component, labels = cache.logit_attrs(stack, token, pos_slice=-1, labels=labels)
    heads, head_labels = cache.stack_head_results(pos_slice=-1, return_labels=True)
    by_head = cache.logit_attrs(heads, token, pos_slice=-1, incl_bias=False)
    return model, by_component[:, 0], labels, by_head[:, 0], head_labels


def drawn(figure) -> tuple[torch.Tensor, list[list[str]]]:
    """The heatmap's grid of values (NaN: no cell) and the text written in each cell."""
    axes = figure.axes[0]
    grid = torch.as_tensor(axes.images[0].get_array().filled(float("nan")))
    text = [[""] * grid.shape[1] for _ in range(grid.shape[0])]
    for t in axes.texts:
        x, y = t.get_position()
        text[round(y)][round(x)] = t.get_text()
    return grid, text


def test_each_head_is_in_its_layer_and_head_cell(attributed, tmp_path):
    model, _, _, by_head, head_labels = attributed
    figure = plot_attribution(by_head, head_labels, None)
    grid, text = drawn(figure)
    assert grid.shape == (model.num_layers, model.num_heads)
    for layer in range(model.num_layers):
        for head in range(model.num_heads):
            value = by_head[head_labels.index(f"L{layer}H{head}")]
            assert grid[layer, head] == value and text[layer][head] == f"{value.item():.2f}"
    axes = figure.axes[0]
    assert [t.get_text() for t in axes.get_xticklabels()] == [f"H{h}" for h in range(model.num_heads)]
    assert [t.get_text() for t in axes.get_yticklabels()] == [str(i) for i in range(model.num_layers)]
    assert axes.get_xlabel() == "head"
    image = axes.images[0]  # signed: white at 0, limits symmetric around it
    assert image.cmap.name == "RdBu" and image.norm(0.0) == pytest.approx(0.5)
    top = by_head.abs().max().item()
    assert (image.norm(-top), image.norm(top)) == pytest.approx((0.0, 1.0))
    plt.close(figure)
    assert plot_attribution(by_head, head_labels, tmp_path / "heads.png", html=False).read_bytes()[:8] == PNG


def test_components_are_per_layer_columns_and_embed_a_row_of_its_own(attributed, tmp_path):
    model, by_component, labels, _, _ = attributed
    figure = plot_attribution(by_component, labels, None)
    grid, text = drawn(figure)
    assert grid.shape == (1 + model.num_layers, 2)  # embed, then each block; attention and MLP
    assert grid[0, 0] == by_component[labels.index("embed")] and grid[0, 1].isnan() and text[0][1] == ""
    for layer in range(model.num_layers):
        for column, part in enumerate(("attn_out", "mlp_out")):
            assert grid[1 + layer, column] == by_component[labels.index(f"{layer}_{part}")]
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()] == ["embed"] + [str(i) for i in range(model.num_layers)]
    plt.close(figure)
    path = plot_attribution(by_component, labels, tmp_path / "layers.png", html=False)
    assert path.read_bytes()[:8] == PNG


def test_bad_shapes_and_labels_are_refused(attributed):
    _, by_component, labels, by_head, head_labels = attributed
    with pytest.raises(ValueError, match=r"one prompt and position, e\.g\. attributions\[:, 0\]"):
        plot_attribution(by_head[:, None], head_labels, None)  # [components, batch]
    with pytest.raises(ValueError, match="3 attributions but 2 labels"):
        plot_attribution(by_component[:3], labels[:2], None)
    with pytest.raises(ValueError, match=r"\['L0H0'\] name the same cell more than once"):
        plot_attribution(by_head[:2], ["L0H0", "L0H0"], None)
