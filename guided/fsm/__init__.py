"""Structured generation: compile constraints into grammars and match tokens against them."""
