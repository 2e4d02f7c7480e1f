"""A decoder no family serves: plain PyTorch modules in a transformers model, for the registry's tests."""

from __future__ import annotations

from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class CustomConfig(PretrainedConfig):
    model_type = "nnterp_test_decoder"

    def __init__(self, vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        super().__init__(**kwargs)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.heads = config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x):
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        mixed = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(mixed.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.up, self.act = nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU()
        self.down = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(config.hidden_size), Attention(config)
        self.norm2, self.ffn = nn.LayerNorm(config.hidden_size), MLP(config)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class Backbone(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size)


class CustomForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = CustomConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, **kwargs):
        x = self.model.embed_tokens(input_ids)
        for block in self.model.layers:
            x = block(x)
        return CausalLMOutput(logits=self.lm_head(self.model.norm(x)))
