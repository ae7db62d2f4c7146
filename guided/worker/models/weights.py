"""Filling a (sharded) model's parameters from checkpoint slices: a parameter is a list of
pieces, each one slice of one checkpoint tensor, read by a WeightReader straight into the
parameter's rows, so a rank never holds more of a checkpoint than its own slices."""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

SYNTHETIC_STD = 0.02  # N(0, 0.02) weights: real shapes for speed and memory, not quality


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows [start, stop) of dim `dim` of checkpoint tensor `name`; dim None: all of it."""
    name: str
    shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    stop: int = 0

    @property
    def slice_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.dim] = self.stop - self.start
        return tuple(shape)


class WeightReader(Protocol):
    def read_into(self, piece: Piece, out: torch.Tensor) -> None:
        """Copy the piece into out (its slice_shape; any dtype and device)."""


class RandomWeights:
    """Synthetic weights generated where they live: unit norms, zero biases, N(0, 0.02)
    elsewhere, seeded per piece, so ranks holding the same slice hold the same numbers."""

    def __init__(self, seed: int = 0):
        self.seed = seed

    def read_into(self, piece: Piece, out: torch.Tensor) -> None:
        if piece.name.endswith("norm.weight"):
            out.fill_(1.0)
        elif piece.name.endswith("bias"):
            out.zero_()
        else:
            key = f"{self.seed}:{piece.name}:{piece.dim}:{piece.start}".encode()
            gen = torch.Generator(device=out.device).manual_seed(zlib.crc32(key))
            out.normal_(0.0, SYNTHETIC_STD, generator=gen)


class MissingWeight(KeyError):
    """A checkpoint tensor the model needs is not there."""


def check_shape(piece: Piece, shape: tuple[int, ...]) -> None:
    if shape != piece.shape:
        raise ValueError(f"checkpoint tensor {piece.name} has shape {list(shape)}; the model's "
                         f"config says {list(piece.shape)}")


@torch.no_grad()
def load_pieces(module: nn.Module, pieces: dict[str, list[Piece]], reader: WeightReader) -> None:
    """Each parameter = its pieces stacked along dim 0 (a dim-1 piece is the parameter whole);
    rows past them (the last rank's vocab padding) are zeros."""
    params = dict(module.named_parameters())
    missing = [name for name in params if name not in pieces]
    for name, parts in pieces.items():
        param = params[name]
        row = 0
        try:
            for piece in parts:
                shape = piece.slice_shape
                if piece.dim == 1 or piece.dim is None:
                    reader.read_into(piece, param.view(shape))
                    row = param.shape[0]
                elif shape[0]:  # an empty slice: a rank past the end of the vocab
                    reader.read_into(piece, param.narrow(0, row, shape[0]))
                    row += shape[0]
        except MissingWeight as e:
            missing.append(f"{name} ({e.args[0]})")
            continue
        if row < param.shape[0]:
            param[row:].zero_()
    if missing:
        raise ValueError(f"checkpoint lacks {missing[:5]}{'...' if len(missing) > 5 else ''}")
