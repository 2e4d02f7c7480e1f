"""Reading dictionaries from their producers' files: SAELens (``cfg.json`` + ``sae_weights.safetensors``, or its
``SAE`` object), sparsify (``cfg.json`` + ``sae.safetensors``) and dictionary_learning (``ae.pt`` + ``config.json``),
each brought to one ``Dictionary``, from a local folder or a Hugging Face repository."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from .dictionary import Dictionary, DictionaryError, _checked_site
from .sites import Site, dictionary_learning_site, sparsify_site, transformerlens_site

# readers of dictionary folders of kinds another module defines, which that module adds here when it is imported
# (nnterp.tools.tuned_lens, imported by the package: its lens is read by its own code, and imports this module)
FOLDER_KINDS: dict[str, Callable] = {}


def load_dictionary(name: str | os.PathLike, *, folder: str | None = None, site: Site | None = None,
                    out_site: Site | None = None, scaling_factor: float | None = None, device=None,
                    dtype: torch.dtype | None = None) -> Dictionary:
    """A dictionary from a local folder in SAELens's, sparsify's or dictionary_learning's format, or from a
    Hugging Face repository (``name`` is ``org/repo``, ``folder`` the dictionary's folder in it). A tuned lens's
    folder (tuned-lens's ``config.json`` + ``params.pt``) holds one translator per layer: ``site`` picks one,
    as ``load_tuned_lens(name).dictionary(layer, value)`` gives it.

    ``site`` (and a transcoder's ``out_site``), ``(layer, standard value)``, say where it reads where the
    producer's name does not (or overrides it). ``scaling_factor`` is SAELens's norm scaling factor of a
    dictionary saved with ``normalize_activations="expected_average_only_in"`` before it was folded (a
    checkpoint folder's ``activation_scaler.json`` gives it too). ``device`` and ``dtype`` move the tensors.
    """
    path = _local_folder(name, folder)
    if (path / "cfg.json").is_file() and (path / "sae_weights.safetensors").is_file():
        dictionary = _read_saelens(path, scaling_factor)
    elif (path / "cfg.json").is_file() and (path / "sae.safetensors").is_file():
        dictionary = _read_sparsify(path)
    elif (path / "ae.pt").is_file():
        dictionary = _read_dictionary_learning(path)
    elif (path / "params.pt").is_file() and (path / "config.json").is_file():
        return FOLDER_KINDS["tuned_lens"](path, site, out_site, device, dtype)
    else:
        inside = sorted(p.name for p in path.iterdir())[:12]
        several = [p for p in inside if (path / p / "cfg.json").is_file() or (path / p / "ae.pt").is_file()]
        hint = (f" It holds dictionaries in {', '.join(several)}: load one of them (folder=...)." if several else "")
        raise DictionaryError(
            f"{str(path)!r} holds no dictionary nnterp reads: SAELens's cfg.json + sae_weights.safetensors, "
            f"sparsify's cfg.json + sae.safetensors, dictionary_learning's ae.pt + config.json, or a tuned lens's "
            f"config.json + params.pt (it has: "
            f"{', '.join(inside) or 'nothing'}).{hint}")
    if site is not None:
        dictionary.site, dictionary.site_reason, dictionary.module_paths = _checked_site(site), None, {}
    if out_site is not None:
        dictionary.out_site, dictionary.transcoder = _checked_site(out_site), True
        dictionary.module_paths = {}
    moved = {key: value for key, value in (("device", device), ("dtype", dtype)) if value is not None}
    return dictionary.to(**moved) if moved else dictionary


def _local_folder(name, folder: str | None) -> Path:
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / folder if folder else path
        if not path.is_dir():
            raise DictionaryError(f"No folder {folder!r} in {str(name)!r}.")
        return path
    text = str(name)
    if text.startswith(("/", "./", "../", "~")) or text.count("/") != 1 or os.path.exists(text):
        raise DictionaryError(f"No dictionary folder at {text!r}: {'not a folder' if os.path.exists(text) else 'no such path'}"
                              ". Pass a local folder, or a Hugging Face repository as org/repo (folder=... inside it).")
    from huggingface_hub import constants, snapshot_download

    patterns = [f"{folder}/*"] if folder else None
    offline = constants.HF_HUB_OFFLINE
    if not offline:  # said at once, where the hub client would retry for half a minute
        import socket

        try:
            socket.create_connection((constants.ENDPOINT.split("://")[-1].split("/")[0], 443), timeout=5).close()
        except OSError as error:
            raise OSError(f"Could not load the dictionary {text!r}: it is not a local folder, and the hub cannot be "
                          f"reached ({error}). Set HF_HUB_OFFLINE=1 to read dictionaries already in the Hugging Face "
                          "cache, or pass a local folder.") from None
    try:
        root = snapshot_download(text, allow_patterns=patterns, local_files_only=offline)
    except Exception as error:  # noqa: BLE001 - the hub client's errors vary by cause; each is reported as it is
        cause = ("HF_HUB_OFFLINE is set and the Hugging Face cache does not hold it" if offline else
                 "the hub could not provide it (no network, or no such repository)")
        raise OSError(f"Could not load the dictionary {text!r}: it is not a local folder, and {cause}. Pass a local "
                      f"folder, or a hub name with network access. Cause: {type(error).__name__}: {error}") from None
    return _local_folder(root, folder)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _read_saelens(path: Path, scaling_factor: float | None) -> Dictionary:
    """SAELens 6 (``metadata.hook_name``, ``architecture``) and earlier (``hook_name`` or ``hook_point`` at the top,
    ``activation_fn_str``), as ``handle_pre_6_0_config`` reads them."""
    cfg = json.loads((path / "cfg.json").read_text())
    scaler = path / "activation_scaler.json"
    if scaling_factor is None and scaler.is_file():  # a training checkpoint's
        scaling_factor = json.loads(scaler.read_text()).get("scaling_factor")
    return _saelens_dictionary(cfg, _tensors(path / "sae_weights.safetensors"), scaling_factor, str(path),
                               "that its folder does not hold: pass it, load_dictionary(path, scaling_factor=...)")


def from_saelens(sae, scaling_factor: float | None = None) -> Dictionary:
    """The ``Dictionary`` of a SAELens ``SAE`` object (``SAE.from_pretrained(...)``, a trained one), read as
    ``load_dictionary`` reads the folder its ``save_model`` writes; its tensors are the SAE's own, not copies.
    ``scaling_factor``: as ``load_dictionary``'s, for an SAE whose norm scaling factor is not folded yet."""
    cfg, weights = sae.cfg.to_dict(), sae.state_dict()
    dictionary = _saelens_dictionary(cfg, weights, scaling_factor, f"the SAELens SAE {type(sae).__name__}",
                                     "that the SAE does not hold: pass it, from_saelens(sae, scaling_factor=...)")
    dictionary.use_error_term = bool(getattr(sae, "use_error_term", False))
    return dictionary


def _saelens_dictionary(cfg: dict, weights: dict, scaling_factor: float | None, where: str, missing: str
                        ) -> Dictionary:
    """A SAELens config and state dict as a ``Dictionary`` (``where`` names them in errors; ``missing`` says how to
    give a norm scaling factor they lack)."""
    meta = {**cfg, **(cfg.get("metadata") or {})}
    dtype = _dtype(cfg.get("dtype", "float32"))
    weights = {name: tensor.to(dtype) for name, tensor in weights.items()}
    activation_fn = meta.get("activation_fn", meta.get("activation_fn_str", "relu"))
    architecture = cfg.get("architecture") or ("topk" if activation_fn == "topk" else "standard")
    known = ("standard", "gated", "jumprelu", "topk", "transcoder", "skip_transcoder", "jumprelu_transcoder",
             "jumprelu_skip_transcoder")
    if architecture not in known:
        raise DictionaryError(f"{where}: SAELens architecture {architecture!r} is not one nnterp reads "
                              f"({', '.join(known)}).")
    if architecture in ("standard", "transcoder", "skip_transcoder") and activation_fn not in ("relu", None):
        raise DictionaryError(f"{where}: SAELens activation function {activation_fn!r} is not one nnterp reads (relu).")
    if meta.get("hook_head_index") is not None:
        raise DictionaryError(f"{where}: the dictionary reads one head (hook_head_index={meta['hook_head_index']}) "
                              "of its hook, which nnterp does not splice.")
    W_enc, W_dec, b_dec = weights["W_enc"], weights["W_dec"], weights["b_dec"]
    b_enc = weights.get("b_enc", weights.get("b_gate"))
    transcoder = "transcoder" in architecture
    normalize = cfg.get("normalize_activations", "none")
    normalize = {True: "expected_average_only_in", False: "none", None: "none"}.get(normalize, normalize)
    if normalize == "expected_average_only_in":
        if scaling_factor is None:
            raise DictionaryError(
                f"{where}: the dictionary was trained on activations scaled by a norm scaling factor "
                f"(normalize_activations='expected_average_only_in') {missing}, as SAELens folds it (W_enc * s, "
                "W_dec / s, b_dec / s).")
        W_enc, W_dec, b_dec, normalize = W_enc * scaling_factor, W_dec / scaling_factor, b_dec / scaling_factor, "none"
    scale = weights.get("scaling_factor", weights.get("finetuning_scaling_factor"))
    if scale is not None and not torch.equal(scale, torch.ones_like(scale)):
        W_dec = W_dec * scale[:, None]  # (features * s) @ W_dec, SAELens 5's finetuning scale
    k = cfg.get("k", (meta.get("activation_fn_kwargs") or {}).get("k"))
    if architecture == "topk" and cfg.get("rescale_acts_by_decoder_norm"):
        norms = W_dec.norm(dim=-1)  # topk of pre * |W_dec|, decoded divided by it: folded, as SAELens saves it
        W_enc, b_enc, W_dec = W_enc * norms, b_enc * norms, W_dec / norms[:, None]
    activation = {"gated": "gated", "jumprelu": "jumprelu", "topk": "topk", "jumprelu_transcoder": "jumprelu",
                  "jumprelu_skip_transcoder": "jumprelu"}.get(architecture, "relu")
    hook, out_hook = meta.get("hook_name", meta.get("hook_point")), meta.get("hook_name_out")
    site, reason = transformerlens_site(hook)
    out_site, out_reason = transformerlens_site(out_hook) if transcoder else (None, None)
    if transcoder and out_site is None:
        reason = reason or out_reason
    return Dictionary(
        W_enc, b_enc, W_dec, b_dec, activation=activation, k=k, threshold=weights.get("threshold"),
        r_mag=weights.get("r_mag"), b_mag=weights.get("b_mag"), normalize=normalize,
        center=b_dec if cfg.get("apply_b_dec_to_input", True) and not transcoder else None,
        W_skip=weights.get("W_skip"), site=site, out_site=out_site, transcoder=transcoder, hook=hook,
        out_hook=out_hook, site_reason=reason, format="saelens", architecture=architecture, config=cfg)


def _read_sparsify(path: Path) -> Dictionary:
    """sparsify's ``SparseCoder.save_to_disk``: ``cfg.json`` (its config and ``d_in``) and ``sae.safetensors``
    (``encoder.weight`` ``[d_sae, d_in]``, ``encoder.bias``, ``W_dec`` ``[d_sae, d_out]``, ``b_dec``, ``W_skip``);
    the folder is named after the hookpoint, its parent holds the run's ``config.json``."""
    cfg = json.loads((path / "cfg.json").read_text())
    weights = _tensors(path / "sae.safetensors")
    transcode = bool(cfg.get("transcode", False))
    activation = cfg.get("activation", "topk")
    if activation not in ("topk", "groupmax"):
        raise DictionaryError(f"{path}: sparsify activation {activation!r} is not one nnterp reads (topk, groupmax).")
    b_dec = weights["b_dec"]
    hookpoint = path.name
    site, out_site, reason = sparsify_site(hookpoint, transcode)
    modules = {}
    if site is not None:
        modules = {"site": (hookpoint, "input" if transcode else "output")}
        if transcode:
            modules["out_site"] = (hookpoint, "output")
    return Dictionary(
        weights["encoder.weight"].T, weights["encoder.bias"], weights["W_dec"], b_dec, activation=activation,
        k=cfg["k"], center=None if transcode else b_dec, W_skip=weights.get("W_skip"), site=site, out_site=out_site,
        transcoder=transcode, hook=hookpoint, out_hook=hookpoint if transcode else None, site_reason=reason,
        modules=modules, format="sparsify", architecture="transcoder" if transcode else activation, config=cfg)


def _read_dictionary_learning(path: Path) -> Dictionary:
    """dictionary_learning's ``ae.pt`` (a state dict; a training backup holds it under ``"ae"``) and
    ``config.json`` (``trainer.dict_class``, ``layer``, ``submodule_name``; ``buffer.io``), read as its
    ``utils.load_dictionary`` reads them."""
    state = torch.load(path / "ae.pt", map_location="cpu", weights_only=True)
    state = state["ae"] if isinstance(state.get("ae"), dict) else state
    config_file = path / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    trainer = config.get("trainer", {})
    kind = trainer.get("dict_class") or ("AutoEncoder" if {"bias", "encoder.weight", "decoder.weight"} <= set(state)
                                         else None)
    float_state = {name: t.float() if t.is_floating_point() else t for name, t in state.items()}
    if kind == "AutoEncoder":  # from_pretrained normalizes the decoder's columns, scaling the encoder to match
        encoder, bias, decoder = float_state["encoder.weight"], float_state["encoder.bias"], float_state["decoder.weight"]
        norms = decoder.norm(dim=0)
        if not torch.allclose(norms, torch.ones_like(norms)):
            decoder, encoder, bias = decoder / norms, encoder * norms[:, None], bias * norms
        parts = dict(W_enc=encoder.T, b_enc=bias, W_dec=decoder.T, b_dec=float_state["bias"],
                     center=float_state["bias"], activation="relu")
    elif kind == "AutoEncoderNew":
        parts = dict(W_enc=float_state["encoder.weight"].T, b_enc=float_state["encoder.bias"],
                     W_dec=float_state["decoder.weight"].T, b_dec=float_state["decoder.bias"], activation="relu")
    elif kind == "GatedAutoEncoder":
        bias = float_state["decoder_bias"]
        parts = dict(W_enc=float_state["encoder.weight"].T, b_enc=float_state["gate_bias"],
                     W_dec=float_state["decoder.weight"].T, b_dec=bias, center=bias, activation="gated",
                     r_mag=float_state["r_mag"], b_mag=float_state["mag_bias"])
    elif kind == "JumpReluAutoEncoder":  # apply_b_dec_to_input is False unless set after loading
        parts = dict(W_enc=float_state["W_enc"], b_enc=float_state["b_enc"], W_dec=float_state["W_dec"],
                     b_dec=float_state["b_dec"], threshold=float_state["threshold"], activation="jumprelu")
    elif kind in ("AutoEncoderTopK", "BatchTopKSAE", "MatryoshkaBatchTopKSAE"):
        linear = "encoder.weight" in float_state
        W_enc = float_state["encoder.weight"].T if linear else float_state["W_enc"]
        b_enc = float_state["encoder.bias"] if linear else float_state["b_enc"]
        W_dec = float_state["decoder.weight"].T if linear else float_state["W_dec"]
        b_dec = float_state["b_dec"]
        if kind == "AutoEncoderTopK":  # encode's default: each token's top k
            k = int(trainer.get("k", state["k"]))
            parts = dict(W_enc=W_enc, b_enc=b_enc, W_dec=W_dec, b_dec=b_dec, center=b_dec, activation="topk", k=k)
        else:  # encode's default (use_threshold=True): relu(pre) where it exceeds the learned threshold
            threshold = float_state["threshold"].expand(W_enc.shape[1])
            parts = dict(W_enc=W_enc, b_enc=b_enc, W_dec=W_dec, b_dec=b_dec, center=b_dec, activation="jumprelu",
                         threshold=threshold)
    else:
        raise DictionaryError(f"{path}: dictionary_learning class {kind!r} is not one nnterp reads (AutoEncoder, "
                              "AutoEncoderNew, GatedAutoEncoder, JumpReluAutoEncoder, AutoEncoderTopK, BatchTopKSAE, "
                              "MatryoshkaBatchTopKSAE).")
    names = [trainer.get("submodule_name"), *(part for part in reversed(path.parts[-3:]))]
    site, reason = dictionary_learning_site(names, trainer.get("layer"), config.get("buffer", {}).get("io", "out"))
    return Dictionary(**parts, site=site, hook=trainer.get("submodule_name"), site_reason=reason,
                      format="dictionary_learning", architecture=kind, config=config)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise DictionaryError(f"Unknown dtype {name!r} in the dictionary's config.")
    return dtype
