"""GPU inventory: what NVIDIA GPUs this machine has, from NVML, ``nvidia-smi``,
or an explicitly simulated inventory for tests. Below the agent and client."""

from gpumesh.gpu.inventory import GpuInfo, GpuInventory, detect_inventory

__all__ = ["GpuInfo", "GpuInventory", "detect_inventory"]
