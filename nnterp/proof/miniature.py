"""A miniature of a config: the same classes and options, tiny sizes; ``build_miniature`` builds its model.

Validation proves a family spec on it instead of on the real weights. Every option that
shapes a block (parallel flags, norms, biases, layer types, which layers are mixtures of
experts, GQA ratio, per-block lists) is kept; only sizes shrink. The layer count is kept too,
so each block type of the model is there.

Heterogeneous configs are shrunk too: a config whose layers override some attributes
(``per_layer_config``) keeps its overrides, each scaled as its global value was (a layer with
twice the global head size keeps twice the miniature's); per-layer lists of head counts and
secondary attention shapes (``swa_num_attention_heads``, ...) keep their ratios; nested
sub-configs (DBRX's ``attn_config`` / ``ffn_config``) follow their model's sizes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import PretrainedConfig
from transformers.utils import logging as transformers_logging

HEADS = 4
HEAD_DIM = 8
# size attribute -> the miniature's value (only where the config has the attribute set)
SIZES = {
    "intermediate_size": 64, "ffn_dim": 64, "n_inner": 64, "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 32, "shared_experts_intermediate_size": 32, "vocab_size": 256, "q_lora_rank": 16, "kv_lora_rank": 16,
    "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": HEAD_DIM, "global_head_dim": HEAD_DIM,
    "o_lora_rank": 8, "index_head_dim": 8, "index_n_heads": 2, "router_hidden_size": 8, "rotary_dim": 4,
    "hidden_size_per_layer_input": 4, "vocab_size_per_layer_input": 256,
    # the other token mixers of hybrids: Mamba's state and step rank, linear attention's heads
    "mamba_d_state": 8, "mamba_dt_rank": 4, "linear_key_head_dim": HEAD_DIM, "linear_value_head_dim": HEAD_DIM,
    "linear_head_dim": HEAD_DIM, "linear_num_heads": HEADS, "ffn_hidden_size": 64,
    # widened streams' mixing rank, per-layer n-gram embeddings and the token selector's heads (Qwen4-Exp)
    "hc_lowrank": 8, "ngram_vocab_size_base": 1000, "ple_embed_dim": 16, "indexer_head_dim": HEAD_DIM,
    "indexer_n_heads": 2,
    "lru_width": HEADS * HEAD_DIM,  # Griffin's recurrence width, split in blocks between the heads
    "moe_shared_expert_intermediate_size": 32,  # Nemotron-H's shared experts
    "dim_ff": 64, "dim_head": HEAD_DIM,  # CPM-Ant's MLP and heads
    "feed_forward_size": 64, "attention_head_size": HEAD_DIM,  # Reformer's MLP and heads,
    "lsh_attn_chunk_length": 4, "local_attn_chunk_length": 2,  # and chunks the proof's tokens span (it pads them)
}
# a recurrent model (no attention heads): its stream shrinks alone, and so do its mixers' own sizes
RECURRENT_SIZES = {"state_size": 8, "time_step_rank": 4, "chunk_size": 16, "attention_hidden_size": HEADS * HEAD_DIM}
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "kv_n_heads")
# experts per token (DBRX's moe_top_k in its ffn_config) and routing groups, at most
TOP_K_LIMITS = (("num_experts_per_tok", 2), ("top_k_experts", 2), ("moe_top_k", 2), ("n_group", 2), ("topk_group", 1))
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


def miniature_config(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of ``config`` (the full config: text, vision and audio parts) with every size shrunk."""
    mini = copy.deepcopy(config)
    parts = (mini, mini.get_text_config(), getattr(mini, "vision_config", None), getattr(mini, "audio_config", None))
    for part in {id(c): c for c in parts if c}.values():
        _shrink_heterogeneous(part, language_model=part is mini.get_text_config())
    return mini


def _shrink_heterogeneous(config: PretrainedConfig, language_model: bool = True) -> None:
    """Shrink ``config``; a heterogeneous one is shrunk as a homogeneous one, then given back its per-layer
    overrides, scaled as their global values were."""
    spec = config.__dict__.get("_heterogeneity_spec")
    if spec is None:
        return _shrink(config, language_model)
    overrides = copy.deepcopy(spec.per_layer_overrides)
    config.per_layer_config = None
    before = {name: getattr(config, name, None) for layer in overrides.values() for name in (*layer, "num_attention_heads")}
    _shrink(config, language_model)
    config.per_layer_config = {i: _scaled(layer, before, config) for i, layer in overrides.items()}


def _scaled(layer: dict, before: dict, config: PretrainedConfig) -> dict:
    """One layer's overrides shrunk as the globals were: sizes in proportion, key-value heads by the layer's
    own GQA ratio."""
    scaled = {}
    for name, value in layer.items():
        old, new = before.get(name), getattr(config, name, None)
        if _is_int(value) and _is_int(old) and _is_int(new) and old and new != old and name not in KV_HEADS:
            value = max(1, round(value * new / old))
        scaled[name] = value
    for name in KV_HEADS:
        heads = layer.get("num_attention_heads", before["num_attention_heads"])
        if layer.get(name) and heads:
            shrunk = scaled.get("num_attention_heads", config.num_attention_heads)
            scaled[name] = max(1, shrunk // max(1, heads // layer[name]))
    return scaled


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _set(config: PretrainedConfig, name: str, value) -> None:
    try:
        setattr(config, name, value)
    except AttributeError:  # a derived property (Falcon's head_dim): it follows the sizes it derives from
        pass


def _shrink(config: PretrainedConfig, language_model: bool = True) -> None:
    heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
    if heads:
        config.num_attention_heads = HEADS
        _shrink_kv_heads(config, heads, config)  # Falcon says num_kv_heads
        if getattr(config, "head_dim", None):
            _set(config, "head_dim", HEAD_DIM)
        config.hidden_size = HEADS * HEAD_DIM
        per_layer = getattr(config, "num_attention_heads_per_layer", None)
        if isinstance(per_layer, (list, tuple)):  # per-layer head counts, in proportion to the global one
            config.num_attention_heads_per_layer = [max(1, round(n * HEADS / heads)) for n in per_layer]
    for name in [key for key in vars(config) if key.endswith("_num_attention_heads")]:
        # a secondary attention shape (inkling's sliding-window layers: swa_num_attention_heads, ...)
        prefix, secondary = name[: -len("num_attention_heads")], getattr(config, name)
        if _is_int(secondary) and secondary:
            setattr(config, name, max(1, round(secondary * HEADS / (heads or secondary))))
            kv = getattr(config, prefix + "num_key_value_heads", None)
            if _is_int(kv) and kv:
                setattr(config, prefix + "num_key_value_heads", max(1, getattr(config, name) // max(1, secondary // kv)))
            if getattr(config, prefix + "head_dim", None):
                setattr(config, prefix + "head_dim", HEAD_DIM)
    width = getattr(config, "attention_hidden_size", None)
    if heads and hidden and width:  # Zamba's shared transformer reads the stream and the embeddings side by side
        config.attention_hidden_size = width // hidden * config.hidden_size
        _set(config, "attention_head_dim", config.attention_hidden_size // HEADS)
    embedded = getattr(config, "word_embed_proj_dim", None)
    if heads and hidden and _is_int(embedded) and embedded:  # OPT's embedding width: in proportion, so the miniature
        config.word_embed_proj_dim = max(1, embedded * config.hidden_size // hidden)  # projects to the stream iff the model does
    axial = getattr(config, "axial_pos_embds_dim", None)
    if heads and hidden and axial:  # Reformer's axial position embeddings split the stream's width: in proportion
        dims = [max(1, d * config.hidden_size // hidden) for d in axial[:-1]]
        config.axial_pos_embds_dim = (*dims, config.hidden_size - sum(dims))
    for name in ("chunk_size_feed_forward", "chunk_size_lm_head"):  # chunked along the sequence: by one position, so
        if getattr(config, name, None):  # that every length divides (the model refuses the others)
            setattr(config, name, 1)
    if getattr(config, "mamba_headdim", None) and getattr(config, "n_mamba_heads", None):  # Zamba2's Mamba-2 heads
        config.mamba_headdim = config.mamba_expand * config.hidden_size // config.n_mamba_heads
    if getattr(config, "mamba_n_heads", None):  # Mamba-2 heads split mamba_expand * hidden_size between them
        config.mamba_n_heads = HEADS
        if isinstance(getattr(config, "mamba_d_head", None), int):
            config.mamba_d_head = config.mamba_expand * config.hidden_size // HEADS
        if getattr(config, "mamba_d_ssm", None):  # Falcon-H1 gives the Mamba width itself: heads times their size
            config.mamba_d_ssm = HEADS * config.mamba_d_head
    recurrent = language_model and not heads and getattr(config, "hidden_size", None)  # a language model without attention
    if recurrent:
        config.hidden_size = HEADS * HEAD_DIM
    if getattr(config, "mamba_num_heads", None) and getattr(config, "mamba_head_dim", None):  # Nemotron-H's Mamba-2
        _shrink_mamba2_heads(config, "mamba_num_heads", "mamba_head_dim")
        for name, size in (("ssm_state_size", 8), ("chunk_size", 16)):
            if getattr(config, name, None):
                setattr(config, name, size)
    keys, values = getattr(config, "linear_num_key_heads", None), getattr(config, "linear_num_value_heads", None)
    if keys and values:  # linear attention's heads, keeping the value heads per key head
        config.linear_num_key_heads, config.linear_num_value_heads = 2, 2 * max(1, values // keys)
    _shrink_sizes(config)
    if recurrent:
        _shrink_recurrent(config)
    if getattr(config, "qk_rope_head_dim", None) and getattr(config, "qk_nope_head_dim", None):  # MLA
        _set(config, "qk_head_dim", config.qk_nope_head_dim + config.qk_rope_head_dim)
        _set(config, "head_dim", config.qk_rope_head_dim)
    for name, sub in list(vars(config).items()) if heads else ():  # a model's own sub-configs (DBRX's attn_config)
        if isinstance(sub, PretrainedConfig) and not name.endswith(("text_config", "vision_config", "audio_config")):
            _shrink_sub(sub, config, heads)
    vocab = getattr(config, "vocab_size", None)
    for name in TOKEN_IDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and vocab and value >= vocab:
            setattr(config, name, vocab - 1)


def _shrink_kv_heads(config: PretrainedConfig, heads: int, model: PretrainedConfig) -> None:
    """Key-value head counts of ``config`` shrunk with the model's query heads, keeping the number of query heads
    per key-value head (GQA / MQA)."""
    for name in KV_HEADS:
        kv = getattr(config, name, None)
        if _is_int(kv) and kv:
            setattr(config, name, max(1, model.num_attention_heads // max(1, heads // kv)))


def _shrink_sub(sub: PretrainedConfig, model: PretrainedConfig, heads: int | None) -> None:
    """A sub-config of a model's blocks: its sizes shrunk, its width the model's, its key-value heads in the
    model's ratio."""
    if getattr(sub, "hidden_size", None):
        sub.hidden_size = model.hidden_size
    if heads:
        _shrink_kv_heads(sub, heads, model)
    _shrink_sizes(sub)


def _shrink_sizes(config: PretrainedConfig) -> None:
    """The sizes that shrink to fixed values, the expert counts and how many experts a token takes."""
    for name, size in SIZES.items():
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)):  # one size per layer (Gemma-3n's intermediate_size): one list kept
            _set(config, name, type(value)(max(1, round(v * size / max(value))) if v else v for v in value))
        elif value:  # 0 or None mean "off" or "derived": leave them
            _set(config, name, size)  # (xLSTM's v_head_dim is derived from its sizes)
    for name in EXPERT_COUNTS:
        if getattr(config, name, None):
            setattr(config, name, min(getattr(config, name), 4))
    for name, limit in TOP_K_LIMITS:
        if getattr(config, name, None):
            setattr(config, name, min(getattr(config, name), limit))


def _shrink_recurrent(config: PretrainedConfig) -> None:
    """The mixers of a recurrent model, after its stream: Mamba's inner width, Mamba-2's heads."""
    for name, size in RECURRENT_SIZES.items():
        if getattr(config, name, None):
            setattr(config, name, size)
    expand = getattr(config, "expand", None)
    if expand and getattr(config, "intermediate_size", None):  # Mamba's inner width is expand * hidden_size
        config.intermediate_size = expand * config.hidden_size
    qk, v = getattr(config, "qk_dim_factor", None), getattr(config, "v_dim_factor", None)
    if qk and v:  # xLSTM: its state's cache rounds hidden_size * factor up to a multiple of 64, its layers do not
        config.hidden_size = next(width for width in range(64, 64 * 65, 64)
                                  if (width * qk) % 64 == 0 and (width * v) % 64 == 0)
        config.embedding_dim, config.num_heads = config.hidden_size, min(config.num_heads, HEADS)
    if expand and getattr(config, "num_heads", None) and getattr(config, "head_dim", None):
        _shrink_mamba2_heads(config, "num_heads", "head_dim")


def _shrink_mamba2_heads(config: PretrainedConfig, heads: str, head_dim: str) -> None:
    """Mamba-2's heads split expand * hidden_size between them, in n_groups groups: keep the heads per group."""
    per_group = max(1, getattr(config, heads) // max(1, getattr(config, "n_groups", 1)))
    setattr(config, heads, HEADS)
    setattr(config, head_dim, config.expand * config.hidden_size // HEADS)
    config.n_groups = max(1, HEADS // per_group)


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings and progress bars silenced for a while: what they say of a miniature's shrunk
    sizes or of a small file converted once concerns no model of the user's. Restored after."""
    verbosity, bars = transformers_logging.get_verbosity(), transformers_logging.is_progress_bar_enabled()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)
        if bars:
            transformers_logging.enable_progress_bar()


def build_miniature(config, architecture: type):
    """The same model class on a miniature of ``config``, random weights moved off 0 and 1."""
    with quiet_transformers():
        mini_config = miniature_config(config)
    config_class = getattr(architecture, "config_class", None)
    if config_class and not isinstance(mini_config, config_class):  # an image-text config's causal LM (Qwen3.5)
        mini_config = mini_config.get_text_config()
    mini_config._attn_implementation = getattr(config, "_attn_implementation", None)
    generator = torch.Generator().manual_seed(0)
    # the model's own initialization draws from the global generator: leave the user's random state as it was
    with torch.random.fork_rng(devices=[]), torch.device("cpu"), quiet_transformers():
        mini = architecture._from_config(mini_config, dtype=torch.float32)
    with torch.no_grad():
        for parameter in mini.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
        for name, buffer in mini.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.fill_(0.7)
    return mini.eval()
