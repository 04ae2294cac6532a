"""The kernels are compiled with multiply-add fusion on, whatever triton's
default: triton 3.9 warns that its default turns to off in 3.10 unless a
launch asks (``TRITON_DEFAULT_FP_FUSION`` sets the default), and the kernels
were tuned and judged with fused multiply-adds (the softmax's scale and
subtract is one FFMA per element). Compile-only, for sm_90a, no GPU."""
import pytest

from hopper_flash import compile_check, compile_check_backward, plan, plan_backward

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def fusion_off_by_default(monkeypatch):
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")


def test_the_forward_is_compiled_with_fusion(fusion_off_by_default):
    compiled = compile_check.compile_forward(plan.CONFIGS[64], "bfloat16", True, False)
    assert compiled.metadata.enable_fp_fusion is True
    assert plan.compile_options(plan.CONFIGS[128])["enable_fp_fusion"] is True  # what the launch passes


def test_the_backward_is_compiled_with_fusion(fusion_off_by_default):
    cfg = plan_backward.BACKWARD_CONFIGS[64]
    compiled = compile_check_backward.compile_backward(cfg, "bfloat16", True)
    assert compiled.metadata.enable_fp_fusion is True
    assert plan.compile_options(cfg)["enable_fp_fusion"] is True  # what the launch passes
