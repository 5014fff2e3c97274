"""Shared fixtures: torch global state is restored after every test."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_torch_state():
    dtype = torch.get_default_dtype()
    threads = torch.get_num_threads()
    rng = torch.get_rng_state()
    grad = torch.is_grad_enabled()
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    torch.set_rng_state(rng)
    torch.set_grad_enabled(grad)
