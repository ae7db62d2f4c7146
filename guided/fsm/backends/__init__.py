"""Grammar backends behind the one Matcher interface: xgrammar (JSON, EBNF, regex) and
outlines-core (choice, and regex where chosen)."""
