"""The rows one decode forward computes when a PagedCache leaves its finished rows out.

A row that finished (its input was EOS) gets zero logits from then on, as generate expects of a
finished row; computing it would waste its share of every linear layer. So the forward runs on the
active rows only: :meth:`ActiveRows.select` narrows the decoder's batch inputs, and
:meth:`ActiveRows.expand` scatters its hidden states back into the full batch (zeros for finished
rows), so the caller sees the shapes it passed.
"""
from __future__ import annotations

import torch

# Decoder keyword inputs with one entry per batch row.
ROW_INPUTS = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "token_type_ids")


class ActiveRows:
    """``index``: int64 [A] the computed rows, in order, of a batch of ``batch`` rows (0 < A < batch)."""

    def __init__(self, rows: list[int], batch: int):
        self.index = torch.tensor(rows, dtype=torch.int64)
        self.batch = batch

    def select(self, kwargs: dict) -> dict:
        """The decoder's keyword inputs for the active rows only."""
        out = dict(kwargs)
        for name in ROW_INPUTS:
            value = kwargs.get(name)
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == self.batch:
                out[name] = value.index_select(0, self.index.to(value.device))
        return out

    def expand(self, output):
        """The decoder's output with ``last_hidden_state`` [A, ...] put back into [batch, ...]."""
        hidden = output.last_hidden_state
        full = hidden.new_zeros((self.batch, *hidden.shape[1:]))
        full[self.index.to(hidden.device)] = hidden
        output.last_hidden_state = full
        return output
