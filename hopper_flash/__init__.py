"""hopper_flash: exact attention kernels for NVIDIA Hopper, written in Gluon."""
from . import _triton_support

# Before any Gluon import: an unsupported triton fails here with the version
# found and the range supported, not with a traceback from a renamed builtin.
_triton_support.check_supported()

from .combine import flash_attn_combine  # noqa: E402
from .interface import (  # noqa: E402
    flash_attn_func,
    flash_attn_varlen_func,
    get_scheduler_metadata,
    scaled_dot_product_attention,
)
from .kvcache import flash_attn_with_kvcache  # noqa: E402
from .packed import (  # noqa: E402
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "scaled_dot_product_attention",
           "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_combine", "get_scheduler_metadata", "__version__"]
