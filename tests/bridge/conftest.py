"""Fixtures of the bridge tests."""

import pytest
import torch

from bridge_util import ConvNet, EmbedNet


@pytest.fixture
def convnet():
    torch.manual_seed(0)
    return ConvNet().eval()


@pytest.fixture
def embednet():
    torch.manual_seed(0)
    return EmbedNet().eval()
