"""Model architectures in plain torch."""
