"""Files: packing a local folder for upload and unpacking it safely on a provider.

Used by both the client (packing) and the agent (unpacking), so it sits below
both; it knows nothing about the network.
"""
