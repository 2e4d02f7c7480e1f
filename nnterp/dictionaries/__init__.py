"""Dictionaries (sparse autoencoders, transcoders) read from their producers' files, keyed by standard value.

``load_dictionary(folder)`` reads the three common formats with nnterp's own reader (the producer
library is not needed): SAELens (``cfg.json`` + ``sae_weights.safetensors``), EleutherAI's sparsify
(``cfg.json`` + ``sae.safetensors``, one folder per hookpoint) and dictionary_learning (``ae.pt`` +
``config.json``). Every architecture is brought to one form: features are
``activation((x - center) @ W_enc + b_enc)`` (after the input's normalization, where the format has one),
the reconstruction is ``features @ W_dec + b_dec`` (normalization undone), plus ``x @ W_skip.T`` for a
transcoder with a skip connection. Producers' rescalings that do not change what a dictionary computes
(SAELens's top-k decoder-norm rescaling, its finetuning scale, a folded norm scaling factor) are folded
into the weights, as the producers do themselves. A ``Dictionary`` is a ``torch.nn.Module`` with the names of
SAELens's ``SAE`` (``W_enc``, ``b_dec``, ``cfg.d_sae``, ``cfg.metadata.hook_name``), and the model's
``run_with_saes`` and ``run_with_cache_with_saes`` (``nnterp.compat.transformer_lens.saes``) splice it as SAELens does.

``dictionary.site`` is ``(layer, standard value)``, translated from the producer's name by one table
(``SITE_TABLE``, printed by ``site_table()``): TransformerLens hook names (SAELens) through the catalog's
``TRANSFORMERLENS_NAMES``, sparsify's module paths, dictionary_learning's submodule names. A name whose
meaning is not a standard value's, or not on every family, says why when the dictionary is spliced in.

The package's modules: ``dictionary`` (the ``Dictionary`` class), ``sites`` (the site table), ``formats`` (reading
the producers' files), ``splicing`` (splicing a dictionary into a trace).
"""

from __future__ import annotations

from .dictionary import (  # noqa: F401  (the package's names, from before its modules)
    ACTIVATIONS,
    NORMALIZATIONS,
    TENSORS,
    Dictionary,
    DictionaryConfig,
    DictionaryError,
    DictionaryMetadata,
    _checked_site,
)
from .formats import FOLDER_KINDS, from_saelens, load_dictionary  # noqa: F401
from .sites import (  # noqa: F401
    DICTIONARY_LEARNING_NAMES,
    SITE_TABLE,
    SPARSIFY_SUBMODULES,
    TL_REFUSED,
    TL_SITES,
    Site,
    dictionary_learning_site,
    site_table,
    sparsify_site,
    transformerlens_hook,
    transformerlens_site,
)

__all__ = ["Dictionary", "DictionaryConfig", "DictionaryError", "DictionaryMetadata", "SITE_TABLE", "from_saelens",
           "load_dictionary", "site_table"]
