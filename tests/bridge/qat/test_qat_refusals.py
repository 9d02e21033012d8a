"""bridge.qat refuses at the door, naming the argument, before anything is copied or run: recipes of another type
or that select nothing, dynamic weight specs, key/value cache specs, static activations without calibration or
whose range differs per token, steps that leave outputs beside the tensors, models quantized or prepared already,
and converting a model that prepare did not make (or whose quantizers a wrapper renamed)."""

import pytest
import torch

import qtransform as qt
import bridge
from bridge import qat
from bridge_util import tiny_causal_lm

INT4 = qt.QuantSpec(format="int4", granularity=qt.PerGroup(32))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_causal_lm("llama").eval()


def linear(spec=INT4, **kw):
    return qt.Recipe(type_rules={"Linear": spec}, exclude=["lm_head*"], **kw)


@pytest.mark.parametrize("recipe", [{"default": "int4"}, 4, None])
def test_recipe_of_another_type(model, recipe):
    with pytest.raises(TypeError, match="^recipe must be a qtransform Recipe, QuantSpec, Plan or a preset name"):
        qat.prepare(model, recipe)


def test_unknown_preset_and_recipe_selecting_nothing(model):
    with pytest.raises(ValueError, match="^recipe: unknown recipe 'int5-g7'"):
        qat.prepare(model, "int5-g7")
    with pytest.raises(ValueError, match="^recipe: .*selects no tensor"):
        qat.prepare(model, qt.Recipe(type_rules={"Conv2d": INT4}))


def test_dynamic_weight_spec(model):
    dynamic = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0), dynamic=True)
    q_proj = r"model\.layers\.0\.self_attn\.q_proj"
    with pytest.raises(ValueError, match=rf"^recipe: {q_proj}\.weight: .*dynamic weight spec"):
        qat.prepare(model, linear(dynamic))


def test_kv_cache_spec(model):
    with pytest.raises(ValueError, match="^recipe.kv_cache: bridge.qat does not train"):
        qat.prepare(model, linear(kv_cache=qt.QuantSpec(format="fp8_e4m3")), calibration=[torch.zeros(1, 4).long()])


def test_static_activations(model):
    static = qt.QuantSpec(format="int8")
    with pytest.raises(ValueError, match=r"^calibration: the recipe's static activation specs .* need a calibrated "):
        qat.prepare(model, linear(input=static))
    per_group = qt.QuantSpec(format="int8", granularity=qt.PerGroup(32))
    with pytest.raises(ValueError, match=r"^recipe: the static activation spec of .* not one range per tensor or per "
                                         "feature"):
        qat.prepare(model, linear(input=per_group), calibration=[torch.zeros(1, 4).long()])


def test_steps_need_their_data_and_outputs_are_refused(model):
    with pytest.raises(ValueError, match="gptq"):
        qat.prepare(model, "gptq4-g64")  # no calibration: the step's own check names it
    recipe = linear(steps=[qt.Step("lowrank", rank=4)])
    with pytest.raises(ValueError, match=r"^recipe.steps: \['lowrank \(lowrank\)'\] make step outputs"):
        qat.prepare(model, recipe, calibration=[torch.randint(0, 128, (1, 8))])


def test_zero_point_option(model):
    with pytest.raises(ValueError, match="^zero_point must be one of"):
        qat.prepare(model, linear(), zero_point="floor")


def test_model_already_quantized_or_prepared(model):
    with pytest.raises(TypeError, match="^model must be a torch.nn.Module"):
        qat.prepare({"w": torch.ones(2)}, linear())
    with pytest.raises(ValueError, match=r"^model: already quantized \(model\.layers\.0\.self_attn\.q_proj is a "
                                         r"QLinear\)"):
        qat.prepare(bridge.quantize(model, linear(), kernel="dequant"), linear())
    fake = qat.prepare(model, linear())
    with pytest.raises(ValueError, match="^model: already prepared by bridge.qat.prepare"):
        qat.prepare(fake, linear())
    fake.model.layers[0].mlp.up_proj.parametrizations.weight  # untouched by the refusals
    assert qat.prepared_plan(fake) is not None


def test_convert_of_a_model_prepare_did_not_make(model):
    with pytest.raises(ValueError, match="^model: this LlamaForCausalLM was not prepared by bridge.qat.prepare"):
        qat.convert(model)
    with pytest.raises(TypeError, match="^model must be a torch.nn.Module"):
        qat.convert("model")
    fake = qat.prepare(model, linear())
    torch.nn.utils.parametrize.remove_parametrizations(fake.model.layers[1].mlp.down_proj, "weight")
    with pytest.raises(ValueError, match=r"^model: its weight fake quantizers are not those prepare put there "
                                         r"\(missing "
                                         r"\['model\.layers\.1\.mlp\.down_proj\.weight'\]"):
        qat.convert(fake)


def test_tied_weights_with_two_specs():
    net = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64, bias=False))
    net[1].weight = net[0].weight
    int8 = qt.QuantSpec(format="int8", granularity=qt.PerChannel(0))
    recipe = qt.Recipe(type_rules={"Embedding": INT4, "Linear": int8})
    with pytest.raises(ValueError, match=r"^recipe: the tied weights \['0.weight', '1.weight'\] get different specs"):
        qat.prepare(net, recipe, inplace=True)
    assert not torch.nn.utils.parametrize.is_parametrized(net[0])  # nothing done half-way
