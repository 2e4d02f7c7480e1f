"""Tiny GPT-2 and Llama models, each as transformers builds it, as nnterp's HookedTransformer wraps it, and as
TransformerLens 3.9 holds the same weights (its own conversion functions, no weight processing: the numbers of
its from_pretrained_no_processing)."""

from __future__ import annotations

import torch
import transformers

from ..conftest import perturb


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=50257, n_positions=64)
    return perturb(transformers.AutoModelForCausalLM.from_config(config), seed=0).eval()


def tiny_llama():
    torch.manual_seed(1)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=50257,
                                      max_position_embeddings=64, bos_token_id=50256, eos_token_id=50256)
    return perturb(transformers.AutoModelForCausalLM.from_config(config), seed=1).eval()


# the hook points the tests compare, which TransformerLens runs only when asked (its notebooks ask themselves)
TEST_FLAGS = dict(use_attn_result=True, use_hook_mlp_in=True)


def transformer_lens_model(hf, tokenizer, model_class=None, flags: dict | None = None, **processing):
    """TransformerLens's HookedTransformer (or ``model_class``, e.g. SAELens's HookedSAETransformer) with ``hf``'s
    weights, from a config written by hand, with the config's ``flags`` (``TEST_FLAGS`` unless given); ``processing``:
    TransformerLens's weight processing (``fold_ln``, ``center_writing_weights``, ...), none unless asked."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights, convert_llama_weights

    c = hf.config
    common = dict(TEST_FLAGS if flags is None else flags, default_prepend_bos=True)
    if c.model_type == "gpt2":
        cfg = HookedTransformerConfig(
            n_layers=c.n_layer, d_model=c.n_embd, n_heads=c.n_head, d_head=c.n_embd // c.n_head, d_mlp=4 * c.n_embd,
            n_ctx=c.n_positions, d_vocab=c.vocab_size, act_fn="gelu_new", normalization_type="LN",
            eps=c.layer_norm_epsilon, positional_embedding_type="standard", original_architecture="GPT2LMHeadModel",
            **common)
        weights = convert_gpt2_weights(hf, cfg)
    else:
        head_dim = c.hidden_size // c.num_attention_heads
        cfg = HookedTransformerConfig(
            n_layers=c.num_hidden_layers, d_model=c.hidden_size, n_heads=c.num_attention_heads, d_head=head_dim,
            d_mlp=c.intermediate_size, n_ctx=c.max_position_embeddings, d_vocab=c.vocab_size, act_fn="silu",
            normalization_type="RMS", eps=c.rms_norm_eps, positional_embedding_type="rotary", rotary_dim=head_dim,
            rotary_base=c.rope_parameters["rope_theta"], rotary_adjacent_pairs=False, final_rms=True, gated_mlp=True,
            n_key_value_heads=c.num_key_value_heads, original_architecture="LlamaForCausalLM", **common)
        weights = convert_llama_weights(hf, cfg)
    model = (model_class or HookedTransformer)(cfg, tokenizer=tokenizer)
    model.load_and_process_state_dict(weights, **{
        step: processing.pop(step, False) for step in ("fold_ln", "center_writing_weights", "center_unembed",
                                                       "fold_value_biases", "refactor_factored_attn_matrices")})
    if processing:
        raise TypeError(f"transformer_lens_model: no weight processing named {sorted(processing)}")
    return model.eval()


def pair(kind: str, tokenizer_dir, model_class=None):
    """(transformers model, nnterp HookedTransformer of it, TransformerLens's model of the same weights, of
    ``model_class`` where given: SAELens's HookedSAETransformer); each with its own tokenizer, from GPT-2's files."""
    hf = tiny_gpt2() if kind == "gpt2" else tiny_llama()
    import nnterp

    ours = nnterp.HookedTransformer.from_pretrained(
        kind, hf_model=hf, tokenizer=transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    theirs = transformer_lens_model(hf, transformers.AutoTokenizer.from_pretrained(tokenizer_dir),
                                    model_class=model_class)
    return hf, ours, theirs
