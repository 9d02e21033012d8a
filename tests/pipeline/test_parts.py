"""The rules of a plan run one part of a model at a time (qtransform.pipeline.parts), on plain plans."""

import torch

import qtransform as qt
from qtransform.pipeline import block_by_block_refusal, tensor_by_tensor
from qtransform.rotation import ResidualLayout
from qtransform.rotation.residual import NormReaders

W4 = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))
TREE = {"emb.weight": torch.empty(16, 64), "layers.0.norm.weight": torch.empty(64),
        "layers.0.fc.weight": torch.empty(64, 64), "layers.1.norm.weight": torch.empty(64),
        "layers.1.fc.weight": torch.empty(64, 64), "head.weight": torch.empty(16, 64)}
TYPES = {p: "Linear" for p in TREE if p.endswith("fc.weight") or p == "head.weight"}
BLOCKS = ["layers.0", "layers.1"]


def _plan(*steps, **recipe):
    return qt.Recipe(default=W4, steps=list(steps), **recipe).plan(TREE, types=TYPES)


def test_local_steps_without_data_go_tensor_by_tensor_and_data_steps_do_not():
    assert tensor_by_tensor(_plan()) and tensor_by_tensor(_plan(qt.Step("hqq")))
    assert not tensor_by_tensor(_plan(qt.Step("gptq")))
    assert block_by_block_refusal(_plan(qt.Step("gptq")), BLOCKS) is None


def test_a_step_on_the_whole_models_loss_is_refused_by_name():
    why = block_by_block_refusal(_plan(qt.Step("spinquant")), BLOCKS)
    assert why.startswith("recipe.steps[0] (spinquant): learns on the whole model's loss")


def test_a_static_activation_quantizer_outside_the_blocks_is_refused_and_inside_is_not():
    static = qt.QuantSpec(format="int8")
    linears = qt.Recipe(default=None, type_rules={"Linear": W4}, input=static)
    assert "head (input)" in block_by_block_refusal(linears.plan(TREE, types=TYPES), BLOCKS)
    blocks_only = qt.Recipe(default=None, type_rules={"Linear": W4}, rules={"head.weight": None}, input=static)
    assert block_by_block_refusal(blocks_only.plan(TREE, types=TYPES), BLOCKS) is None
    dynamic = qt.Recipe(default=None, type_rules={"Linear": W4}, input=qt.QuantSpec(format="int8", dynamic=True))
    assert block_by_block_refusal(dynamic.plan(TREE, types=TYPES), BLOCKS) is None


def test_a_rotation_whose_norm_feeds_another_block_is_refused():
    layout = ResidualLayout(embeddings=("emb.weight",), norms=(NormReaders("layers.0.norm.weight",
                                                                           ("layers.1.fc.weight",)),), writers=())
    why = block_by_block_refusal(_plan(qt.Step("rotate")).replace(layout=layout), BLOCKS)
    assert why == "rotations: norm 'layers.0.norm.weight' feeds linears in another decoder block"
    ok = layout._replace(norms=(NormReaders("layers.0.norm.weight", ("layers.0.fc.weight",)),))
    assert block_by_block_refusal(_plan(qt.Step("rotate")).replace(layout=ok), BLOCKS) is None


def test_restricting_a_layout_keeps_every_field_of_the_part_transposed_included():
    layout = ResidualLayout(embeddings=("emb.weight",),
                            norms=(NormReaders("layers.0.norm.weight", ("layers.0.fc.weight",)),
                                   NormReaders("layers.1.norm.weight", ("layers.1.fc.weight",))),
                            writers=("layers.0.fc.weight", "layers.1.fc.weight"), down=("layers.1.fc.weight",),
                            transposed=("layers.0.fc.weight", "layers.1.fc.weight"))
    part = layout.restrict({"layers.1.norm.weight", "layers.1.fc.weight"})
    assert part == ResidualLayout(embeddings=(), norms=(layout.norms[1],), writers=("layers.1.fc.weight",),
                                  down=("layers.1.fc.weight",), transposed=("layers.1.fc.weight",))
