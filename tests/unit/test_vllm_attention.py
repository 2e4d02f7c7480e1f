"""The recomputation of vLLM's attention scores (nnterp/vllm/attention.py) against the definition of the mask, for
what the vLLM tests cannot reach on the CPU build: Llama 4's chunked attention (vLLM's chunks are whole KV blocks,
128 tokens there, longer than the tests' prompts)."""

import torch

from nnterp.vllm.attention import scores


def test_a_chunked_attention_masks_the_keys_outside_the_querys_chunk():
    tokens, heads, dim, chunk = 10, 2, 8, 4
    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(tokens, heads * dim, generator=generator)
    keys = torch.randn(tokens, heads * dim, generator=generator)
    facts = {"heads": heads, "kv_heads": heads, "scale": 0.5, "softcap": None, "slopes": None, "window": None,
             "chunk": chunk}
    got = scores(queries, keys, facts)[0]  # [heads, query, key]
    minimum = torch.finfo(queries.dtype).min
    for q in range(tokens):
        for k in range(tokens):
            allowed = k <= q and k // chunk == q // chunk
            for h in range(heads):
                want = queries[q, h * dim:(h + 1) * dim] @ keys[k, h * dim:(h + 1) * dim] * 0.5
                if allowed:
                    assert torch.allclose(got[h, q, k], want, atol=1e-6), (h, q, k)
                else:
                    assert got[h, q, k] == minimum, (h, q, k)
