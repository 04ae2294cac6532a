"""hopper_flash: exact attention kernels for NVIDIA Hopper, written in Gluon."""
from .interface import flash_attn_func

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "__version__"]
