"""The heatmaps and the attention views: what they show, against hooks, a plain forward and the math."""

from __future__ import annotations

import json
import re

import matplotlib.pyplot as plt
import pytest
import torch
from transformers import AutoTokenizer, GPT2Config

from nnterp import StandardizedTransformer
from nnterp.families import BY_MODEL_TYPE
from nnterp.tools.plots import attention_html, plot_attention, plot_logit_lens, plot_patching

from ..conftest import build_tiny, tiny_tokenizer

PNG = b"\x89PNG\r\n\x1a\n"
PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def llama():
    config = BY_MODEL_TYPE["llama"].tiny_config()
    config._attn_implementation = "eager"  # transformers' own weights are the ground truth of the patterns
    return StandardizedTransformer(build_tiny(config), tokenizer=tiny_tokenizer())


def cell_texts(figure):
    return [t for t in figure.axes[0].texts]


def test_patching_colours_diverge_from_zero(tmp_path):
    effects = torch.tensor([[-2.0, 0.5, 0.0], [1.0, 0.25, -0.5]])
    figure = plot_patching(effects, ["a", "b", "c"], None)
    image = figure.axes[0].images[0]
    assert image.cmap.name == "RdBu"
    assert image.norm(0.0) == pytest.approx(0.5)  # white at 0
    assert (image.norm(-2.0), image.norm(2.0)) == pytest.approx((0.0, 1.0))  # limits symmetric around 0
    assert all(t.get_fontsize() >= 8 for t in cell_texts(figure)) and len(cell_texts(figure)) == 6
    plt.close(figure)
    one_sided = plot_patching(torch.tensor([[0.1, 0.3]]), ["a", "b"], None)
    assert one_sided.axes[0].images[0].norm(0.0) == pytest.approx(0.5)  # still centred when every effect is positive
    plt.close(one_sided)
    assert plot_patching(effects, ["a", "b", "c"], tmp_path / "p.png", html=False).read_bytes()[:8] == PNG


def lens_truth(model, prompt):
    """``[layers, seq]`` top token ids of every block's output through the final norm and head, from hooks."""
    outs = {}
    handles = [b.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o[0] if isinstance(o, tuple) else o))
               for i, b in enumerate(model.layers._module)]
    ids = model.tokenizer(prompt, return_tensors="pt").input_ids
    try:
        with torch.no_grad():
            model._module(ids)
            hf = model._module
            top = [hf.lm_head(hf.model.norm(outs[i]))[0].argmax(-1) for i in range(model.num_layers)]
    finally:
        for h in handles:
            h.remove()
    return torch.stack(top)


def test_the_lens_target_is_outlined_where_it_is_the_top_token(llama, tmp_path):
    truth = lens_truth(llama, PROMPT)
    target = int(truth[-1, -1])
    figure = plot_logit_lens(llama, PROMPT, None, target=target)
    axes = figure.axes[0]
    outlined = {(round(p.get_y() + 0.5), round(p.get_x() + 0.5)) for p in axes.patches if p.get_gid() == "target"}
    assert outlined == {tuple(cell) for cell in (truth == target).nonzero().tolist()} and outlined
    assert llama.tokenizer.decode([target]) in axes.get_title()
    plt.close(figure)
    with pytest.raises(ValueError, match="is 2 tokens"):
        plot_logit_lens(llama, PROMPT, None, target="cat sat")
    assert plot_logit_lens(llama, PROMPT, tmp_path / "l.png", html=False, target=target).read_bytes()[:8] == PNG


def test_whitespace_top_tokens_are_visible_cells(gpt2_tokenizer_dir):
    model = build_tiny(GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=64))
    with torch.no_grad():  # the final norm outputs one vector that the space token's row matches best
        direction = torch.randn(64, generator=torch.Generator().manual_seed(0))
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(direction)
        model.lm_head.weight[220] = 4 * direction  # tied with the embedding: token 220 is " "
    gpt2 = StandardizedTransformer(model, tokenizer=AutoTokenizer.from_pretrained(gpt2_tokenizer_dir))
    prompt = "The cat sat"
    with torch.no_grad():
        top = model(gpt2.tokenizer(prompt, return_tensors="pt").input_ids).logits.argmax(-1)
    assert gpt2.tokenizer.decode([220]) == " " and (top == 220).all()  # the model's own top token is a space
    figure = plot_logit_lens(gpt2, prompt, None)
    texts = cell_texts(figure)
    assert len(texts) == 2 * 3 and all(t.get_text().strip() for t in texts)
    assert all(t.get_fontsize() >= 8 for t in texts)
    assert all(label.get_text().strip() for label in figure.axes[0].get_xticklabels())
    plt.close(figure)


def eager_patterns(model, prompt):
    ids = model.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        return model._module(ids, output_attentions=True).attentions  # per layer [1, heads, q, k]


def test_attention_html_holds_each_heads_numbers(llama, tmp_path):
    llama.enable_attention_values()
    try:
        _, cache = llama.run_with_cache(PROMPT, names="attention_probabilities")
    finally:
        llama.disable_attention_values()
    truth = eager_patterns(llama, PROMPT)[1][0]
    tokens = llama.to_str_tokens(PROMPT)
    tokens[2] = "</script> <b>"  # any text: nothing in a token can end the data or become markup
    path = attention_html(cache["attention_probabilities", 1][0], tokens, tmp_path / "a.html", heads=[2, 0],
                          title="layer 1")
    page = path.read_text()
    data = json.loads(re.search(r'<script type="application/json" id="nnterp-attention">(.*?)</script>', page,
                                re.S).group(1))
    assert data["tokens"] == tokens and data["heads"] == [2, 0]
    assert torch.allclose(torch.tensor(data["patterns"]), truth[[2, 0]], atol=1e-6)
    assert "http" not in page.lower() and "src=" not in page  # self-contained: nothing fetched
    assert "<b>" not in page.split("<script")[0]
    with pytest.raises(ValueError, match="tokens"):
        attention_html(truth, tokens[:-1])
    with pytest.raises(IndexError, match="out of range"):
        attention_html(truth, tokens, heads=[truth.shape[0]])


def test_plot_attention_draws_each_head(llama, tmp_path):
    truth = eager_patterns(llama, PROMPT)[0]  # [1, heads, q, k]
    tokens = llama.to_str_tokens(PROMPT)
    figure = plot_attention(truth, tokens, None, heads=[1, 3])
    drawn = [ax for ax in figure.axes if ax.images]
    assert [ax.get_title() for ax in drawn] == ["head 1", "head 3"]
    for ax, head in zip(drawn, (1, 3)):
        assert torch.allclose(torch.as_tensor(ax.images[0].get_array().data), truth[0, head])
    plt.close(figure)
    path = plot_attention(truth, tokens, tmp_path / "a.png")
    assert path.read_bytes()[:8] == PNG
