"""Requests, KV blocks, the prefix cache and the pure scheduling decisions."""
