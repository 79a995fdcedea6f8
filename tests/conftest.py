import os
import sys

import pytest
import torch

# The suite's models are tiny: one intra-op thread is as fast and does not fight other processes.
torch.set_num_threads(1)

sys.path.insert(0, os.path.dirname(__file__))

import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def model_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_model(model_root):
    def get(variant: str) -> str:
        return tiny_models.build(variant, model_root)
    return get
