"""CLI: renders the client layer for people. The only layer that prints,
configures logging, and turns errors into exit codes."""
