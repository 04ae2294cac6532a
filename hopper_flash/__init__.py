"""hopper_flash: exact attention kernels for NVIDIA Hopper, written in Gluon."""
from .interface import flash_attn_func, scaled_dot_product_attention
from .kvcache import flash_attn_with_kvcache

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "flash_attn_with_kvcache", "scaled_dot_product_attention", "__version__"]
