"""nnterp 1.x's ``nnterp.display``: a top-tokens plot and a prompts table, on their optional libraries."""

from __future__ import annotations

import torch

from .legacy import deprecated


def _require(module: str, extra: str):
    try:
        return __import__(module)
    except ImportError:
        raise ModuleNotFoundError(f"This 1.x display helper needs {module}: pip install {extra}") from None


def plot_topk_tokens(next_token_probs: torch.Tensor, tokenizer, k: int = 4, title: str | None = None,
                     use_token_ids: bool = False, file: str | None = None, **kwargs):
    """A heatmap of the top ``k`` tokens per layer of ``[layers, vocab]`` (or ``[prompts, layers, vocab]``)
    probabilities, as a plotly figure (1.x's plot)."""
    deprecated("nnterp.display.plot_topk_tokens", "nnterp.tools.plots.plot_logit_lens")
    go = _require("plotly.graph_objects", "plotly")
    probs = next_token_probs if next_token_probs.dim() == 3 else next_token_probs.unsqueeze(0)
    top = probs.float().topk(k, dim=-1)
    figures = []
    for indices, values in zip(top.indices, top.values):
        text = [[str(int(t)) if use_token_ids else tokenizer.decode(int(t)) for t in row] for row in indices]
        figure = go.Figure(go.Heatmap(z=values.numpy(), text=text, texttemplate="%{text}", colorscale="Blues"))
        figure.update_layout(title=title, xaxis_title="rank", yaxis_title="layer")
        if file:
            figure.write_html(file) if str(file).endswith(".html") else figure.write_image(file)
        figures.append(figure)
    return figures[0] if len(figures) == 1 else figures


def prompts_to_df(prompts, tokenizer=None):
    """A pandas table of prompts and their targets (1.x)."""
    deprecated("nnterp.display.prompts_to_df", "the prompts' fields (prompt.text, prompt.targets)")
    pandas = _require("pandas", "pandas")
    rows = []
    for prompt in prompts:
        row = {"prompt": prompt.text}
        for target, ids in prompt.targets.items():
            row[target] = prompt.target_words.get(target) or ids
            if tokenizer is not None:
                row[f"{target}_tokens"] = tokenizer.convert_ids_to_tokens(ids)
        rows.append(row)
    return pandas.DataFrame(rows)
