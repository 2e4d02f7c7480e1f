"""The validation cache key depends only on what the proof depends on, so it is the same in every process (a key
holding a function's memory address made every process validate, and write a marker, again)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM

from nnterp.families import BY_MODEL_TYPE
from nnterp.proof import validation_key

KEYS = """
import json
from transformers import AutoModelForCausalLM
from nnterp.families import BY_MODEL_TYPE
from nnterp.proof import validation_key
keys = {}
for model_type in sorted(BY_MODEL_TYPE):
    config = BY_MODEL_TYPE[model_type].tiny_config()
    architecture = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if architecture is not None:
        keys[model_type] = [validation_key(config, architecture), validation_key(config, architecture, True)]
print(json.dumps(keys))
"""


def _keys_of_a_new_process() -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "random"}
    result = subprocess.run([sys.executable, "-c", KEYS], capture_output=True, text=True, env=env, check=True,
                            timeout=600)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # outside the fast tier (./run.sh test --fast)
def test_two_processes_share_every_familys_validation_key():
    first, second = _keys_of_a_new_process(), _keys_of_a_new_process()
    assert {"gpt2", "granite", "llama"} <= set(first) and len(first) > 50
    assert first == second


def test_the_key_follows_the_spec():
    family = BY_MODEL_TYPE["gpt2"]
    config = family.tiny_config()
    architecture = AutoModelForCausalLM._model_mapping[type(config)]
    before = validation_key(config, architecture)
    other = dataclasses.replace(family, attention_internals=lambda config: None)  # another function, same place
    BY_MODEL_TYPE["gpt2"] = other
    try:
        assert validation_key(config, architecture) != before
    finally:
        BY_MODEL_TYPE["gpt2"] = family
    assert validation_key(config, architecture) == before
