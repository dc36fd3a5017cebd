"""The runtime's tests build States, which set torch's process-wide determinism flag and thread count: each test
gets them back as they were."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_torch_globals() -> Iterator[None]:
    det = torch.are_deterministic_algorithms_enabled()
    threads = torch.get_num_threads()
    yield
    torch.use_deterministic_algorithms(det)
    torch.set_num_threads(threads)
