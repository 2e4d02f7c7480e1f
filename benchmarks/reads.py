"""What one standard value read costs over the same read in raw nnsight.

Prints, for ``model.layers[i].mlp.mlp_output`` (a module boundary: raw nnsight reads ``layers[i].mlp.output``):

- the Python calls nnterp's own code makes for one read, the first read of a wrapped model (which resolves where
  the value is) and a cached one (every later trace), counted with ``sys.setprofile`` over nnterp's files;
- the time per value over raw nnsight's, as a ratio and in microseconds: a 16-block tiny Llama, batch 1 x 8
  (latency-bound, where the cost of a read shows), three values of every block (``attention_output``,
  ``mlp_output``, ``layer_output``: 48 values) saved in one trace, against a trace that saves only the first of
  them. A value's time is what one more value adds to a trace: (48 values - 1 value) / 47, so what a trace pays
  once (its checks, its first value) is not counted per value. Each round times every variant once, in turn; the
  medians over rounds are compared, each trace paired with the others of its round, which takes the machine's
  drift off.

Usage: ``python benchmarks/reads.py [--rounds 30]``. CPU, one thread, no_grad.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import nnsight  # noqa: E402
import torch  # noqa: E402
import transformers as T  # noqa: E402
from nnsight.modeling.transformers import TransformersModel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import tiny_tokenizer  # noqa: E402
from timing import timed  # noqa: E402

import nnterp  # noqa: E402
from nnterp import StandardizedTransformer  # noqa: E402

torch.set_num_threads(1)
NNTERP_FILES = str(Path(nnterp.__file__).parent)


def llama_tiny(layers: int = 16) -> T.PreTrainedModel:
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return T.LlamaForCausalLM(config).eval()


def nnterp_calls(std: StandardizedTransformer, ids: torch.Tensor) -> int:
    """The calls into nnterp's own functions while ``model.layers[1].mlp.mlp_output`` is read in a trace."""
    calls = []

    def profile(frame, event, _):
        if event == "call" and frame.f_code.co_filename.startswith(NNTERP_FILES):
            calls.append(frame.f_code.co_name)

    with std.trace(ids):
        std.layers[0].mlp.mlp_output  # noqa: B018 - the pass's first value: what a pass prepares once is done
        sys.setprofile(profile)
        std.layers[1].mlp.mlp_output  # noqa: B018
        sys.setprofile(None)
    return len(calls)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=60)
    rounds = parser.parse_args().rounds
    model, tok = llama_tiny(), tiny_tokenizer()
    ids = torch.randint(0, 1000, (1, 8))
    std = StandardizedTransformer(model, tokenizer=tok)
    first_calls = nnterp_calls(std, ids)
    cached = nnterp_calls(std, ids)
    raw = TransformersModel(copy.deepcopy(model), tokenizer=tok)  # its own copy: a module is wrapped by one model

    def raw_reads():
        with raw.trace(ids):
            saved = nnsight.save([value for layer in raw.model.layers
                                  for value in (layer.self_attn.output[0], layer.mlp.output, layer.output)])
        return saved

    def nnterp_reads():
        with std.trace(ids):
            saved = nnsight.save([value for layer in std.layers for value in (
                layer.self_attn.attention_output, layer.mlp.mlp_output, layer.layer_output)])
        return saved

    def raw_one():
        with raw.trace(ids):
            saved = nnsight.save(raw.model.layers[0].self_attn.output[0])
        return saved

    def nnterp_one():
        with std.trace(ids):
            saved = nnsight.save(std.layers[0].self_attn.attention_output)
        return saved

    def raw_empty():
        with raw.trace(ids):
            pass

    def nnterp_empty():
        with std.trace(ids):
            pass

    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(raw_reads(), nnterp_reads()))
        # the variants in turn, one call each per round, and the minimum of each: what the machine's load adds to a
        # call is not the variant's
        variants = {"raw": raw_reads, "nnterp": nnterp_reads, "raw one": raw_one, "nnterp one": nnterp_one,
                    "raw empty": raw_empty, "nnterp empty": nnterp_empty}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, run in variants.items():
                times[name].append(timed(run, 1)[0])
        best = {name: statistics.median(values) for name, values in times.items()}
    count = 3 * std.num_layers
    raw_value, nnterp_value = (statistics.median((t - one) / (count - 1) for t, one in zip(times[name], times[f"{name} one"]))
                               for name in ("raw", "nnterp"))
    first = {name: statistics.median(one - e for one, e in zip(times[f"{name} one"], times[f"{name} empty"]))
             for name in ("raw", "nnterp")}
    print(f"3 values of each block of a {std.num_layers}-block tiny Llama, batch 1 x 8, median of {rounds} rounds")
    print(f"  nnterp's Python calls per read: first read {first_calls}, cached {cached}")
    print(f"  per trace of {count} values: raw nnsight {best['raw'] * 1e3:.2f} ms, nnterp {best['nnterp'] * 1e3:.2f} ms "
          f"= {best['nnterp'] / best['raw']:.3f}x; an empty trace: raw {best['raw empty'] * 1e3:.2f} ms, nnterp "
          f"{best['nnterp empty'] * 1e3:.2f} ms; the first value: raw {first['raw'] * 1e6:.0f} us, nnterp "
          f"{first['nnterp'] * 1e6:.0f} us")
    print(f"  per value (one more value in a trace): raw {raw_value * 1e6:.1f} us, nnterp {nnterp_value * 1e6:.1f} us "
          f"= {nnterp_value / raw_value:.3f}x")

if __name__ == "__main__":
    main()
