"""Structured generation: compile constraints into grammars and match tokens against them."""
from __future__ import annotations

import importlib

__all__ = ["CompiledGrammar", "GrammarCompiler", "Matcher", "TokenVocab"]

_HOMES = {"CompiledGrammar": "compiler", "GrammarCompiler": "compiler", "Matcher": "matcher",
          "TokenVocab": "vocab"}


def __getattr__(name: str):
    # imported on use: a mask shard process (python -m guided.fsm.mask_shard_worker) connects
    # back before it pays for torch and xgrammar, so N shards import side by side
    if name in _HOMES:
        return getattr(importlib.import_module(f"guided.fsm.{_HOMES[name]}"), name)
    raise AttributeError(name)
