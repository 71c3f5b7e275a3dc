"""The ``triton`` attention backend: new K/V written by ``reshape_and_cache``, attention by the
kernels in ``stage5_server/kernels/``, both reading stage 2's KV layout through the block tables.

vLLM: ``vllm/v1/attention/backends/triton_attn.py``.
"""

from __future__ import annotations

from stage2_paged.attention import PagedAttentionMetadata


class TritonAttentionBackend:
    def __init__(self, kv_cache):
        from stage5_server import kernels  # imported here: Triton reads TRITON_INTERPRET at import

        self.kernels = kernels
        self.kv_cache = kv_cache

    def forward(self, layer_idx, query, key, value, meta: PagedAttentionMetadata, scale):
        key_cache, value_cache = self.kv_cache.key[layer_idx], self.kv_cache.value[layer_idx]
        self.kernels.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        return self.kernels.triton_paged_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                                   meta.query_start_loc, scale, max_query_len=meta.max_query_len,
                                                   max_seq_len=meta.max_seq_len)
