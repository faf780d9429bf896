"""Agent: the provider side, serving allowed peers over authenticated QUIC.

Above transport and store; below the CLI. Every request is checked against
the allowlist when it arrives, and open links of a peer that gets denied are
closed within a second.
"""
