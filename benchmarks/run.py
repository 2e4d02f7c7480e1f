"""Benchmarks: what the standard values cost against the floor and the alternatives.

Prints ratios measured in one run (absolute times vary between machines):

- per-trace cost, batch 8 x seq 128, saving the same 11 values per block, for a GPT-2-small-shaped
  model, a Llama-shaped model of similar size (random weights) and the embedded SmolLM2:
  (a) a plain forward with PyTorch hooks that keep the values (the floor), (b) a raw nnsight trace
  saving the same module boundaries, (c) nnterp's standard values, (d) TransformerLens
  ``run_with_cache`` on GPT-2's architecture (when transformer_lens is installed);
- load time: HF load alone, nnsight wrapping, nnterp wrapping with validation (cold and cached);
- activation collection over 2,000 prompts: prompts/s and peak memory against a plain batched
  forward with hooks;
- collection throughput: ``collect`` (shards written to disk) against a plain batched forward whose
  hooks copy the same rows to the host, last token and all positions, as a ratio of prompts/s.

- the shapes table: raw nnsight and nnterp reading the 4 stream values, and nnterp reading 11, against
  the hooks floor, at latency-bound and compute-bound sizes, with nnterp's cost per value over raw
  nnsight's (a 16-layer tiny Llama on the CPU; Llama-1B and Llama-7B shapes in bf16 with ``--device cuda``).

Every timing gives the median and minimum wall time, the CPU time and the minor page faults per call.
Usage: ``python benchmarks/run.py [--rounds 5] [--quick] [--grad] [--tune-allocator] [--device cuda]
[--shapes-only | --collection-only]``. CPU, one thread, no_grad (``--grad``: autograd on, as a plain trace runs).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import nnsight  # noqa: E402
import torch  # noqa: E402
import transformers as T  # noqa: E402
from nnsight.modeling.transformers import TransformersModel  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import tiny_tokenizer  # noqa: E402

from nnterp import StandardizedTransformer, tune_allocator  # noqa: E402

torch.set_num_threads(1)
BATCH, SEQ = 8, 128


def gpt2_small():
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config()).eval()


def llama_small():
    torch.manual_seed(0)
    config = T.LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                           num_key_value_heads=12, vocab_size=50257, max_position_embeddings=1024)
    return T.LlamaForCausalLM(config).eval()


def smollm2():
    from nnterp.tools.embedded import embedded_model_path

    return T.AutoModelForCausalLM.from_pretrained(embedded_model_path()).eval()


# -- the 11 values per block, read four ways ------------------------------------------------------

def locations(std: StandardizedTransformer):
    """Per block: (key, At) of the available values in forward order (the same boundaries for every variant)."""
    return [[(key, location) for _, key, location in std.timeline(i) if not key.startswith("extra.")]
            for i in range(std.num_layers)]


def hooked_floor(model, where):
    """(a): PyTorch hooks that keep a reference to each value, the cheapest way to get them."""
    kept = []
    blocks = model.get_submodule(where["layers"])
    for i, block_locations in enumerate(where["values"]):
        for _, location in block_locations:
            module = location.module(blocks[i])
            if location.side == "input":
                module.register_forward_pre_hook(
                    lambda m, args, kwargs, loc=location: kept.append(args[loc.arg] if len(args) > loc.arg
                                                                      else kwargs[loc.kwarg]), with_kwargs=True)
            else:
                module.register_forward_hook(
                    lambda m, args, out, loc=location: kept.append(out[loc.index] if isinstance(out, tuple) else out))

    def run(ids):
        model(input_ids=ids, attention_mask=torch.ones_like(ids))  # as nnsight calls it
        count = len(kept)
        kept.clear()  # freed at the end of the call, as a trace frees its values: the same heap for every variant
        return count
    return run


def raw_nnsight(model, where, tok):
    """(b): a plain nnsight trace saving the same module boundaries, by their native paths."""
    lm = TransformersModel(model, tokenizer=tok)
    blocks = lm
    for part in where["layers"].split("."):
        blocks = getattr(blocks, part)

    def run(ids):
        with lm.trace(ids):
            saved = nnsight.save([])
            for i, block_locations in enumerate(where["values"]):
                for _, location in block_locations:
                    envoy = blocks[i]
                    for part in filter(None, location.path.split(".")):
                        envoy = getattr(envoy, part)
                    if location.side == "input":
                        args, kwargs = envoy.inputs
                        saved.append(args[location.arg] if len(args) > location.arg else kwargs[location.kwarg])
                    else:
                        out = envoy.output
                        saved.append(out[location.index] if isinstance(out, tuple) else out)
        return len(saved)
    return run


def nnterp_values(std, keys=None):
    """(c): nnterp's standard values, by name, in order(i) (or the ``keys`` given per block, in forward order)."""
    keys = keys or [list(std.order(i)) for i in range(std.num_layers)]

    def run(ids):
        with std.trace(ids):
            saved = nnsight.save([])
            for i, block_keys in enumerate(keys):
                block = std.layers[i]
                for key in block_keys:
                    owner, _, name = key.rpartition(".")
                    saved.append(getattr(getattr(block, owner) if owner else block, name))
        return len(saved)
    return run


def transformer_lens(model):
    """(d): TransformerLens ``run_with_cache`` (its TransformerBridge over the same HF model), caching the
    comparable hooks. TransformerLens switches the model to eager attention to serve its hooks."""
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError:
        return None
    folder = tempfile.mkdtemp(prefix="nnterp-bench-tl-")
    model.config.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    bridge = TransformerBridge.boot_transformers(folder, hf_model=model, tokenizer=T.AutoTokenizer.from_pretrained(folder),
                                                 device="cpu")
    wanted = ("hook_resid_pre", "ln1.hook_out", "attn.hook_z", "hook_attn_out", "hook_resid_mid", "ln2.hook_out",
              "mlp.hook_in", "mlp.hook_pre", "mlp.hook_post", "hook_mlp_out", "hook_resid_post")

    def run(ids):
        _, cache = bridge.run_with_cache(ids, names_filter=lambda name: name.endswith(wanted))
        return len(cache)
    return run


GRAD = False  # --grad: run every variant with autograd on, as a plain model.trace does
DEVICE = "cpu"  # --device cuda: the shapes table on the GPU


def _sync() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


class Timing:
    """One variant's calls: wall and CPU seconds, minor page faults."""

    def __init__(self):
        self.wall, self.cpu, self.faults = [], [], []

    @property
    def median(self) -> float:
        return statistics.median(self.wall)

    @property
    def best(self) -> float:
        return min(self.wall)

    def summary(self, floor: Timing | None = None) -> str:
        ratio = f"   x{self.median / floor.median:5.2f} of (a)" if floor else ""
        return (f"{self.median * 1000:9.1f} ms median {self.best * 1000:9.1f} min   cpu {statistics.median(self.cpu) * 1000:8.1f} ms"
                f"   faults {int(statistics.median(self.faults)):7d}{ratio}")


def timed(variants: dict, ids, rounds: int) -> dict[str, Timing]:
    """Per variant: every call's wall and CPU time and page faults; variants run in a random order within each
    round, after one warm-up call each."""
    times = {name: Timing() for name in variants}
    with torch.set_grad_enabled(GRAD):
        for fn in variants.values():
            fn(ids)  # warm up
        for _ in range(rounds):
            order = list(variants.items())
            random.shuffle(order)
            for name, fn in order:
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                _sync()
                start, cpu = time.perf_counter(), time.process_time()
                fn(ids)
                _sync()
                times[name].wall.append(time.perf_counter() - start)
                times[name].cpu.append(time.process_time() - cpu)
                times[name].faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
    return times


def trace_costs(name, build, rounds, with_tl=False):
    base = build()
    tok = tiny_tokenizer()
    std = StandardizedTransformer(copy.deepcopy(base), tokenizer=tok)
    where = {"layers": std.family.layers, "values": locations(std)}
    per_block = len(where["values"][0])
    variants = {
        "(a) hooks floor": hooked_floor(copy.deepcopy(base), where),
        "(b) raw nnsight": raw_nnsight(copy.deepcopy(base), where, tok),
        "(c) nnterp": nnterp_values(std),
    }
    if with_tl:
        eager = StandardizedTransformer(copy.deepcopy(base), tokenizer=tok, attention_values=True)
        variants["(c) nnterp, attention values on"] = nnterp_values(eager)
        tl = transformer_lens(copy.deepcopy(base))
        if tl:
            variants["(d) TransformerLens"] = tl
    ids = torch.randint(0, 30000, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    timings = timed(variants, ids, rounds)
    medians = {variant: timing.median for variant, timing in timings.items()}
    floor = timings["(a) hooks floor"]
    print(f"\n{name}: batch {BATCH} x seq {SEQ}, {per_block} values per block, {rounds} rounds, grad {'on' if GRAD else 'off'}; "
          "(a)-(c) run the model's own attention (sdpa), TransformerLens and 'attention values on' run eager")
    for variant, timing in timings.items():
        print(f"  {variant:32} {timing.summary(floor)}")
    c, b = medians["(c) nnterp"], medians["(b) raw nnsight"]
    print(f"  (c)/(b) = {c / b:.3f}   (c)/(a) = {c / floor.median:.3f}"
          + (f"   (c)/(d) = {c / medians['(d) TransformerLens']:.3f}   (c, eager)/(d) = "
             f"{medians['(c) nnterp, attention values on'] / medians['(d) TransformerLens']:.3f}"
             if "(d) TransformerLens" in medians else ""))
    return medians


# -- the shapes table: latency- and compute-bound sizes, 4 and 11 values per block --------------------

SHAPES = {  # name: config, built on the device from the config (random weights, no download)
    "Llama-7B": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000),
    "Llama-1B (GQA)": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=128256),
    "Llama-tiny (16 x 64)": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=16, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=128),
}
STREAM = ("layer_input", "self_attn.attention_output", "mlp.mlp_output", "layer_output")


def shape_costs(names: list[str], sizes: list[tuple[int, int]], rounds: int) -> None:
    """raw nnsight (4 values), nnterp (4 values) and nnterp (11 values) against the hooks floor (4 values), with
    nnterp's cost per value over raw nnsight's in microseconds, per shape and size."""
    dtype = torch.bfloat16 if DEVICE.startswith("cuda") else torch.float32
    print(f"\nshapes on {DEVICE} ({dtype}), {rounds} rounds, grad {'on' if GRAD else 'off'}, ratios of minimum times to "
          "the hooks floor keeping the 4 stream values")
    print(f"  {'shape':22} {'batch x seq':>12} {'raw 4':>7} {'nnterp 4':>9} {'nnterp 11':>10} {'us/value over raw':>18}")
    for name in names:
        with torch.device(DEVICE):
            torch.manual_seed(0)
            model = T.LlamaForCausalLM(T.LlamaConfig(max_position_embeddings=4096, **SHAPES[name])).to(dtype).eval()
        tok = tiny_tokenizer()
        std = StandardizedTransformer(model, tokenizer=tok)
        every = locations(std)
        four = [[(key, at) for key, at in block if key in STREAM] for block in every]
        four_where = {"layers": std.family.layers, "values": four}
        four_keys = [[key for key, _ in block] for block in four]
        variants = {"floor": hooked_floor(model, four_where), "raw 4": raw_nnsight(model, four_where, tok),
                    "nnterp 4": nnterp_values(std, four_keys), "nnterp 11": nnterp_values(std)}
        for batch, seq in sizes:
            ids = torch.randint(0, SHAPES[name]["vocab_size"], (batch, seq), device=DEVICE,
                                generator=torch.Generator(DEVICE).manual_seed(0))
            timings = timed(variants, ids, rounds)
            # minimums: on a shared machine the least disturbed call of each variant is the fairest comparison
            best = {variant: timing.best for variant, timing in timings.items()}
            extra = (best["nnterp 4"] - best["raw 4"]) / sum(map(len, four)) * 1e6
            print(f"  {name:22} {f'{batch} x {seq}':>12} {best['raw 4'] / best['floor']:7.3f} "
                  f"{best['nnterp 4'] / best['floor']:9.3f} {best['nnterp 11'] / best['floor']:10.3f} {extra:18.1f}")
        for hook in [h for m in model.modules() for h in (m._forward_hooks, m._forward_pre_hooks)]:
            hook.clear()  # the floor's hooks
        del model, std, variants
        if DEVICE.startswith("cuda"):
            torch.cuda.empty_cache()


def attention_costs(rounds: int):
    """The cost of turning the attention values on: the model's eager attention against the default sdpa."""
    std = StandardizedTransformer(gpt2_small(), tokenizer=tiny_tokenizer())
    ids = torch.randint(0, 30000, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))

    def run(layers_read):
        def trace(ids):
            with std.trace(ids):
                saved = nnsight.save([])
                for i in range(std.num_layers):
                    for name in layers_read:
                        saved.append(getattr(std.layers[i].self_attn, name))
        return trace

    def switched(enable, fn):
        def call(ids):
            (std.enable_attention_values if enable else std.disable_attention_values)()
            return fn(ids)
        return call

    medians = {variant: timing.median for variant, timing in timed({
        "sdpa, premix only": switched(False, run(["attention_premix"])),
        "eager, premix only": switched(True, run(["attention_premix"])),
        "eager, q k v scores probs": switched(True, run(["queries", "keys", "values", "attention_scores",
                                                               "attention_probabilities"])),
    }, ids, rounds).items()}
    base = medians["sdpa, premix only"]
    print(f"\nattention values, GPT-2-small shape, batch {BATCH} x seq {SEQ}, median of {rounds}")
    for variant, seconds in medians.items():
        print(f"  {variant:34} {seconds * 1000:9.1f} ms   x{seconds / base:5.2f} of sdpa")


def load_costs(rounds: int):
    from nnterp.core.validation import validate

    with tempfile.TemporaryDirectory() as folder:
        gpt2_small().save_pretrained(folder)
        tiny_tokenizer().save_pretrained(folder)
        hf, nnsight_wrap, cold, cached, by_folder = [], [], [], [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            models = [T.AutoModelForCausalLM.from_pretrained(folder) for _ in range(3)]
            hf.append((time.perf_counter() - t0) / 3)
            t0 = time.perf_counter()
            TransformersModel(models[0], tokenizer=tiny_tokenizer())
            nnsight_wrap.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            validate(models[1].config, type(models[1]), tiny_tokenizer(), use_cache=False)
            StandardizedTransformer(models[1], tokenizer=tiny_tokenizer())  # validation now cached
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            StandardizedTransformer(models[2], tokenizer=tiny_tokenizer())
            cached.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            StandardizedTransformer(folder)
            by_folder.append(time.perf_counter() - t0)
    med = statistics.median
    print(f"\nload, GPT-2-small shape (124M) from a local folder, median of {rounds}")
    print(f"  HF from_pretrained                      {med(hf) * 1000:7.0f} ms")
    print(f"  nnsight wrapping (TransformersModel)    {med(nnsight_wrap) * 1000:7.0f} ms")
    print(f"  nnterp wrapping + validation, cold      {med(cold) * 1000:7.0f} ms")
    print(f"  nnterp wrapping, validation cached      {med(cached) * 1000:7.0f} ms")
    print(f"  StandardizedTransformer(folder), cached {med(by_folder) * 1000:7.0f} ms (HF load included)")
    print(f"  wrapping with validation above the HF load: {med(cold):.2f} s cold, {med(cached):.2f} s cached")


def collection_child(kind: str, n: int) -> None:
    """Runs in a fresh process: collect n prompts one way, print 'seconds peak_mib'."""
    model = gpt2_small()
    tok = tiny_tokenizer()
    words = "the a cat dog sat on mat Eiffel Tower is in city of Paris Rome".split()
    prompts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(4 + i % 8)) for i in range(n)]
    start = time.perf_counter()
    if kind == "nnterp":
        from nnterp import collect

        std = StandardizedTransformer(model, tokenizer=tok)
        with tempfile.TemporaryDirectory() as folder:
            collect(std, prompts, folder, batch_size=32, progress=False)
    else:  # the floor: a plain batched forward, hooks keeping each block's last-token output in memory
        tok.padding_side = "left"
        kept = []
        for block in model.transformer.h:
            block.register_forward_hook(lambda m, a, out: kept.append(out[:, -1].clone()))
        with torch.no_grad():
            for start_row in range(0, n, 32):
                batch = tok(prompts[start_row:start_row + 32], return_tensors="pt", padding=True)
                model(**batch)
    seconds = time.perf_counter() - start
    peak_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
    print(f"{seconds} {peak_kib / 1024}")  # the process's own peak RSS (ru_maxrss would include the parent's)


def collection_costs(n: int):
    results = {}
    for kind in ("floor", "nnterp"):
        for count in (n // 10, n):
            out = subprocess.run([sys.executable, __file__, "--collection-child", kind, str(count)],
                                 capture_output=True, text=True, check=True).stdout.split()
            results[(kind, count)] = (float(out[-2]), float(out[-1]))
    print(f"\nactivation collection, GPT-2-small shape, batch 32, last token of every block, {n} prompts")
    for kind in ("floor", "nnterp"):
        seconds, peak = results[(kind, n)]
        _, small_peak = results[(kind, n // 10)]
        print(f"  {kind:7} {n / seconds:8.1f} prompts/s   peak RSS {peak:6.0f} MiB ({n // 10} prompts: {small_peak:.0f} MiB)")
    ratio = results[("nnterp", n)][0] / results[("floor", n)][0]
    print(f"  nnterp time / floor time = {ratio:.3f}")


def collection_throughput(n: int, rounds: int):
    """collect against a plain batched forward whose hooks copy the same rows to the host, in one process."""
    from nnterp import collect

    base = gpt2_small()
    tok = tiny_tokenizer()
    tok.padding_side = "left"
    std = StandardizedTransformer(copy.deepcopy(base), tokenizer=tok)
    words = "the a cat dog sat on mat Eiffel Tower is in city of Paris Rome".split()
    prompts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(4 + i % 8)) for i in range(n)]
    blocks = base.transformer.h

    def floor(positions, layers, model=base):
        """``model=base.transformer``: the blocks without the LM head (a plain forward computes logits)."""
        def run():
            rows, mask = [], {}
            hooks = [blocks[i].register_forward_hook(
                lambda m, a, out: rows.append((out[0] if isinstance(out, tuple) else out)[
                    mask["select"]].to("cpu", copy=True))) for i in layers]
            try:
                with torch.no_grad():
                    for start in range(0, n, 32):
                        batch = tok(prompts[start:start + 32], return_tensors="pt", padding=True)
                        select = batch.attention_mask.bool()
                        if positions == "last":
                            select = torch.zeros_like(select)
                            select[:, -1] = True  # left padding: every prompt's last token is the last column
                        mask["select"] = select
                        model(**batch)
                        rows.clear()  # the rows of a batch are dropped once copied, as collect writes them
            finally:
                for hook in hooks:
                    hook.remove()
        return run

    def nnterp(positions, layers):
        def run():
            with tempfile.TemporaryDirectory() as folder:
                collect(std, prompts, folder, layers=layers, positions=positions, batch_size=32, progress=False)
        return run

    every, half = list(range(12)), list(range(6))
    cases = [("last token, every block", "last", every), ("all positions, every block", "all", every),
             ("last token, blocks 0-5 (collect stops after block 5)", "last", half)]
    print(f"\ncollection throughput, GPT-2-small shape, batch 32, {n} prompts, layer_output, median of {rounds}")
    for label, positions, layers in cases:
        variants = {"floor": floor(positions, layers), "floor, no head": floor(positions, layers, base.transformer),
                    "collect": nnterp(positions, layers)}
        times = {name: [] for name in variants}
        for fn in variants.values():
            fn()  # warm up
        for _ in range(rounds):
            order = list(variants.items())
            random.shuffle(order)
            for name, fn in order:
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(t) for name, t in times.items()}
        print(f"  {label}\n    " + ", ".join(f"{name} {n / seconds:.1f} prompts/s" for name, seconds in medians.items())
              + f"\n    collect/floor throughput = {medians['floor'] / medians['collect']:.3f}, collect/floor without "
              f"the head = {medians['floor, no head'] / medians['collect']:.3f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and prompts, for a smoke run")
    parser.add_argument("--collection-child", nargs=2)
    parser.add_argument("--grad", action="store_true", help="autograd on, as a plain trace runs (default: no_grad)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the shapes table at 1B and 7B on the GPU")
    parser.add_argument("--tune-allocator", action="store_true",
                        help="nnterp.tune_allocator() first: glibc keeps freed memory (stable CPU figures)")
    parser.add_argument("--shapes-only", action="store_true", help="only the shapes table")
    parser.add_argument("--collection-only", action="store_true", help="only the collection sections")
    args = parser.parse_args()
    if args.collection_child:
        collection_child(args.collection_child[0], int(args.collection_child[1]))
        return
    global GRAD, DEVICE
    GRAD, DEVICE = args.grad, args.device
    if args.tune_allocator:
        tune_allocator()
    rounds = 2 if args.quick else args.rounds
    print(f"nnterp benchmarks, {time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__} ({torch.get_num_threads()} thread), transformers {T.__version__}, "
          f"nnsight {nnsight.__version__}, allocator {'tuned' if args.tune_allocator else 'default'}"
          + (f", {torch.cuda.get_device_name()}" if DEVICE.startswith("cuda") else ""))
    if DEVICE.startswith("cuda"):
        shape_costs(["Llama-7B", "Llama-1B (GQA)"], [(8, 512), (1, 32), (16, 256)], max(rounds, 10))
        return
    if not args.collection_only:
        shape_costs(["Llama-tiny (16 x 64)"], [(1, 8), (8, 128)], max(rounds * 6, 12))
        if args.shapes_only:
            return
        trace_costs("GPT-2-small shape (124M, random weights)", gpt2_small, rounds, with_tl=True)
        trace_costs("Llama shape (12 x 768, random weights)", llama_small, rounds)
        trace_costs("embedded SmolLM2-135M", smollm2, rounds)
        attention_costs(rounds)
        load_costs(rounds)
    collection_costs(200 if args.quick else 2000)
    collection_throughput(64 if args.quick else 320, rounds)


if __name__ == "__main__":
    main()
