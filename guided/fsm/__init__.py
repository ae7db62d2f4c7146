"""Structured generation: compile constraints into grammars and match tokens against them."""
from __future__ import annotations

from guided.fsm.compiler import CompiledGrammar, GrammarCompiler
from guided.fsm.matcher import Matcher
from guided.fsm.vocab import TokenVocab

__all__ = ["CompiledGrammar", "GrammarCompiler", "Matcher", "TokenVocab"]
