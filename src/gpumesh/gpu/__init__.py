"""The machine's GPUs: what NVIDIA GPUs it has (``inventory``: NVML, ``nvidia-smi``,
or an explicitly simulated inventory for tests) and what runs a CUDA session's
calls on one (``cudabackend``: the real driver through ``cuda-bindings``, or the
host-memory fallback). Below the agent and client."""
