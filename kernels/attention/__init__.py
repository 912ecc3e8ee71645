"""Attention over the paged KV cache, and the step layouts it reads (PagedKeys, AttentionLayout).

    reference.py   the layouts and the torch forms (gather, then sdpa): the `torch` backend's ops;
                   `naive_paged_attention`, per sequence in float32, is the reference of all
    cpu.py         the native decode/verify form (paged_attention.cpp), reading K and V in place
    triton.py      the triton forms
"""

from .reference import (AttentionLayout, PagedKeys, QueryGroup, attend_paged, attention_layout, layout_of,
                        naive_paged_attention, paged_attention, paged_keys, reads_no_keys, write_kv_cache)

__all__ = ["AttentionLayout", "PagedKeys", "QueryGroup", "attend_paged", "attention_layout", "layout_of",
           "naive_paged_attention", "paged_attention", "paged_keys", "reads_no_keys", "write_kv_cache"]
