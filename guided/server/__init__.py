"""The OpenAI-compatible HTTP server (`guided serve`): app, wire protocol, tool calls, CLI."""
