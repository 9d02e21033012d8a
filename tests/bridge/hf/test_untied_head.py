"""A tied output head that the recipe quantizes is untied, and the saved config says so (``tie_word_embeddings``
false), so that transformers does not tie it again on reload; the other tensors the checkpoint stores once for two
names (BERT's head bias, stored as ``cls.predictions.bias``) are still tied on reload. The expected values are the
float model's own tensors and the quantized model's logits."""

import json

import torch
import transformers

import bridge
import qtransform as qt

SPEC = qt.get_preset("int4-g32").recipe.type_rules[0][1]


def test_a_quantized_tied_head_is_untied_in_the_config_and_its_bias_stays_tied(tmp_path):
    config = transformers.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64, is_decoder=True)
    torch.manual_seed(0)
    model = transformers.BertLMHeadModel(config).eval()
    with torch.no_grad():
        model.cls.predictions.bias.normal_()  # tied to cls.predictions.decoder.bias: not zeros
    assert model.config.tie_word_embeddings
    q = bridge.quantize(model, qt.Recipe(type_rules={"Linear": SPEC}), kernel="dequant")
    assert isinstance(bridge.extract(q)["cls.predictions.decoder.weight"], qt.QTensor)  # the head: quantized
    bridge.save(q, tmp_path / "q")
    assert json.loads((tmp_path / "q" / "config.json").read_text())["tie_word_embeddings"] is False
    back = transformers.BertLMHeadModel.from_pretrained(tmp_path / "q").eval()
    for m in back.modules():  # the kernel the quantized model computes with (the packed CPU ones: bf16 below 32 rows)
        if "dequant" in getattr(m, "available_kernels", lambda: ())():
            m.kernel = "dequant"
    assert torch.equal(back.cls.predictions.decoder.bias, model.cls.predictions.bias)
    assert torch.equal(back.bert.embeddings.word_embeddings.weight, model.bert.embeddings.word_embeddings.weight)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, q(ids).logits, rtol=1e-4, atol=1e-4)
