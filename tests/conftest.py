import logging
import signal

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _process_state_restored():
    """What a CLI command sets for the rest of its process (Ctrl-C and SIGTERM handlers, study's INFO logging) is put
    back after each test: left, it would change what later tests in the same process see."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    logger = logging.getLogger("study")
    level, kept = logger.level, list(logger.handlers)
    yield
    for s, handler in handlers.items():
        if handler is not None:
            signal.signal(s, handler)
    logger.setLevel(level)
    logger.handlers[:] = kept


@pytest.fixture
def offline_hub(monkeypatch):
    """The Hugging Face hub is never tried: a missing file is reported, not fetched."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
