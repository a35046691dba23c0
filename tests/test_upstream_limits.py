"""Repros of upstream limits ddp_fusion works around or reports (run with -m slow).

Each is ``xfail(strict=True)``: when upstream fixes one, the test starts passing, fails
the strict xfail, and tells us to lift the matching restriction in ddp_fusion."""

import pytest

from ddp_fusion.launch import run_ranks

from _workers import upstream_dtensor_post_acc_grad_hook


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="compiled autograd: post-acc-grad hook on DTensor uses as_strided")
def test_compiled_autograd_post_accumulate_grad_hook_on_dtensor():
    """ddp_fusion works around this one (``_torch.allow_dtensor_post_accumulate_grad_hooks``);
    when it passes, the work-around can go."""
    run_ranks(upstream_dtensor_post_acc_grad_hook, world_size=2, timeout=300)
