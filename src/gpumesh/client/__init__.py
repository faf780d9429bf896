"""Client: the operations users run, shared by the CLI, the dashboard and the API.

Functions here return data (dataclasses, records) and raise
:class:`gpumesh.errors.GPUMeshError`; they never print. Nothing here imports
the CLI.
"""
