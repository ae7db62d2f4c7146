"""The one per-request grammar interface the engine sees, whatever backend serves the request."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Matcher(ABC):
    """A grammar's state for one request. Bitmask (as xgrammar's and the kernel's): int32
    [num_rows, ceil(vocab_size / 32)] on the CPU, bit id % 32 of word id // 32 set iff token id
    is allowed; EOS only where the grammar may end, padded ids and special tokens never."""

    # tokens never allowed whatever the grammar says, ANDed into every row (a JSON grammar's
    # TokenBan); None where there are none
    ban = None

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row]."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once EOS was accepted: nothing more may follow."""

    def ended_with(self, token_id: int) -> bool:
        """Right after accept_token(token_id): did it end the grammar?"""
        return self.is_terminated()

    def allows_a_token(self, vocab_size: int) -> bool:
        """Whether any token of the vocabulary may follow here, bans applied. False: a dead end
        (the grammar needs bytes no token spells), which no sampling can leave."""
        row = torch.zeros(1, -(-vocab_size // 32), dtype=torch.int32)
        self.fill_bitmask(row, 0)
        if self.ban is not None:
            row.numpy()[0, self.ban.columns] &= self.ban.column_words
        return bool(row.any())

    @abstractmethod
    def forced_string(self) -> bytes:
        """Bytes the grammar forces from here (b"" if none or terminated); never raises."""

    @abstractmethod
    def accept_bytes(self, data: bytes) -> bool:
        """Advance by raw bytes (tests); False: rejected, unchanged. Not undone by rollback."""
