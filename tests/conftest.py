import os
import sys

import pytest
import torch

# The suite's models are tiny: one intra-op thread is as fast and does not fight other processes.
torch.set_num_threads(1)

sys.path.insert(0, os.path.dirname(__file__))
# LLM() adds a stderr handler to the "longflash" logger when nothing configured logging (as vLLM's LLM);
# in the suite, records go to pytest's capture instead (caplog needs them to reach the root logger).
os.environ.setdefault("LONGFLASH_CONFIGURE_LOGGING", "0")

import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def model_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_model(model_root):
    def get(variant: str) -> str:
        return tiny_models.build(variant, model_root)
    return get
