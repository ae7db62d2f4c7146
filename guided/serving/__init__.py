"""The engine in its own process for the server: the process, its client, the messages between."""
