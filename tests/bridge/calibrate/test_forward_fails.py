"""A model whose forward cannot run on the calibration batches (it needs images, audio, a decoder's inputs...) is
refused by a ValueError naming the model, the batch and the model's own error, for every calibrated step; errors
the library's own code raises during the forward (its hooks) pass unchanged."""

import pytest
import torch
from torch import nn

import bridge
import qtransform as qt
from bridge.calibrate.sites import run_batch


class NeedsImages(nn.Module):
    """Blocks of linears whose forward needs ``pixel_values`` beside the token ids."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(2))

    def forward(self, input_ids, pixel_values):
        h = self.embed(input_ids) + pixel_values.mean()
        for layer in self.layers:
            h = layer(h)
        return h


RECIPES = {"gptq": qt.get_preset("gptq4-g64").recipe, "static scales": qt.get_preset("w8a8-int8").recipe}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_forward_that_needs_other_inputs_is_refused_naming_the_model(recipe):
    torch.manual_seed(0)
    model = NeedsImages().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 32, (1, 8))
    with pytest.raises(ValueError) as info:
        bridge.quantize(model, RECIPES[recipe], calibration=[ids])
    message = str(info.value)
    assert "NeedsImages's forward fails on a calibration batch (a tensor of shape [1, 8])" in message, message
    causes, e = [], info.value
    while e is not None:
        causes.append(type(e))
        e = e.__cause__
    assert "missing 1 required positional argument: 'pixel_values'" in message and TypeError in causes
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model is untouched


def test_the_libraries_own_errors_in_a_hook_pass_unchanged(monkeypatch):
    from pathlib import Path

    from bridge.calibrate import sites

    monkeypatch.setattr(sites, "_OURS", (str(Path(__file__).resolve().parent),))  # this file's hook is the library's
    model = nn.Sequential(nn.Linear(4, 4)).eval()

    class Ours(Exception):
        pass

    def hook(m, args):
        raise Ours("from the library's hook")

    handle = model[0].register_forward_pre_hook(hook)
    try:
        with pytest.raises(Ours):
            run_batch(model, dict(model.named_parameters()), torch.ones(1, 4))
    finally:
        handle.remove()
