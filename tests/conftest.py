"""Shared test set-up: deterministic torch on one thread, small models only, and
Hugging Face offline (tests write the configs they need; nothing is downloaded)."""

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch read the variable when it was imported above (before it was set): apply it now,
# or torch runs every small op on all cores (a third slower on a 2-core machine).
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
