"""Grammar backends behind the one Matcher interface."""
