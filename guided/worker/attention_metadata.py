"""Per-step attention inputs shared by every layer (built once by the model runner)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64: cache slot (block * block_size + offset) per new token
    block_tables: torch.Tensor  # (B, max_blocks) int32
    query_start_loc: torch.Tensor  # (B + 1,) int32: packed query offsets
    seq_lens: torch.Tensor  # (B,) int32: kv length per request, new tokens included
    max_query_len: int
    max_seq_len: int
    use_triton: bool  # False on the CPU: the torch reference serves
