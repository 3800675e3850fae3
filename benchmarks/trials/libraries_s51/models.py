"""Trial s51 model builders: torchvision, timm and Hugging Face models in tiny configurations.

Needs the s51 trial venv (torch 2.14.1, torchvision 0.29.1, timm 1.0.31, transformers 5.25.0; see
benchmarks/results/user_trial_libraries-s51.md), run from this folder with PYTHONPATH at the
repository root; no test runs it.
"""

import torch
from torch import nn

IMG = (3, 32, 32)


class Logits(nn.Module):
    """What a user writes around a HF model: ids in, logits out, the mask from the ids."""

    def __init__(self, model, pad=0):
        super().__init__()
        self.model, self.pad = model, pad

    def forward(self, ids):
        return self.model(input_ids=ids, attention_mask=(ids != self.pad).long()).logits


def tv_resnet18():
    import torchvision

    return torchvision.models.resnet18(num_classes=3), "img"


def tv_mobilenet_v3_small():
    import torchvision

    return torchvision.models.mobilenet_v3_small(num_classes=3), "img"


def tv_convnext_small():
    # torchvision's ConvNeXt classes: CNBlock with a raw layer_scale parameter, LayerNorm2d,
    # StochasticDepth; a tiny configuration.
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    cfg = [CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)]
    return ConvNeXt(cfg, stochastic_depth_prob=0.1, num_classes=3), "img"


def tv_vit():
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        num_classes=3,
    ), "img"


# timm's tiny vision transformers at 32x32: patches of 8, 2 blocks of width 32.
TIMM_VIT = {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2}


def timm_vit():
    import timm

    return timm.create_model("vit_tiny_patch16_224", num_classes=3, **TIMM_VIT), "img"


def timm_resnet18():
    import timm

    return timm.create_model("resnet18", pretrained=False, num_classes=3), "img"


def timm_convnext_atto():
    import timm

    return timm.create_model(
        "convnext_atto",
        pretrained=False,
        num_classes=3,
        depths=(1, 1, 1, 1),
        dims=(8, 16, 24, 32),
        ls_init_value=0.5,
    ), "img"


def timm_mixer():
    from timm.models.mlp_mixer import MlpMixer

    return MlpMixer(num_classes=3, img_size=32, patch_size=8, num_blocks=2, embed_dim=32), "img"


def timm_deit():
    import timm

    return timm.create_model("deit_tiny_distilled_patch16_224", num_classes=3, **TIMM_VIT), "img"


VOCAB, SEQ = 30, 8


def bert_config(num_labels=3, dropout=0.0, attn="sdpa"):
    """The tiny BERT's configuration; ``dropout=None`` keeps transformers' 0.1."""
    from transformers import BertConfig

    drop = (
        {}
        if dropout is None
        else {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    )
    sizes = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2}
    return BertConfig(
        vocab_size=VOCAB,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=num_labels,
        pad_token_id=0,
        attn_implementation=attn,
        **sizes,
        **drop,
    )


def hf_bert(attn="sdpa"):
    from transformers import BertForSequenceClassification

    return Logits(BertForSequenceClassification(bert_config(attn=attn))), "ids"


def _hf(config, model, attn, sizes, drop):
    """A tiny sequence classifier of transformers, wrapped: 3 labels, pad id 0."""
    cfg = config(
        vocab_size=VOCAB,
        num_labels=3,
        pad_token_id=0,
        attn_implementation=attn,
        **sizes,
        **dict.fromkeys(drop, 0.0),
    )
    return Logits(model(cfg)), "ids"


def hf_distilbert(attn="sdpa"):
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    sizes = {"dim": 16, "n_layers": 2, "n_heads": 2, "hidden_dim": 32}
    return _hf(
        DistilBertConfig,
        DistilBertForSequenceClassification,
        attn,
        {**sizes, "max_position_embeddings": 16},
        ("dropout", "attention_dropout", "seq_classif_dropout"),
    )


def hf_gpt2(attn="sdpa"):
    from transformers import GPT2Config, GPT2ForSequenceClassification

    sizes = {"n_embd": 16, "n_layer": 2, "n_head": 2, "n_positions": 16}
    return _hf(
        GPT2Config,
        GPT2ForSequenceClassification,
        attn,
        sizes,
        ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    )


MODELS = {
    f.__name__: f
    for f in [
        tv_resnet18,
        tv_mobilenet_v3_small,
        tv_convnext_small,
        tv_vit,
        timm_vit,
        timm_resnet18,
        timm_convnext_atto,
        timm_mixer,
        timm_deit,
        hf_bert,
        hf_distilbert,
        hf_gpt2,
    ]
}


def data(kind, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "img":
        return torch.randn(n, *IMG, generator=g, dtype=torch.float64)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (n,), generator=g)
    ids[torch.arange(SEQ) >= lengths[:, None]] = 0  # right padding
    return ids


def build(name, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    module, kind = MODELS[name]()
    return module.to(dtype).eval(), kind


class LogitsPos(Logits):
    """The wrapper with per-sample position ids (the inputs guide's advice)."""

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return self.model(
            input_ids=ids, attention_mask=(ids != self.pad).long(), position_ids=pos
        ).logits


def hf_bert_pos():
    return LogitsPos(hf_bert()[0].model), "ids"


def hf_distilbert_pos():
    return LogitsPos(hf_distilbert()[0].model), "ids"


def hf_gpt2_pos():
    return LogitsPos(hf_gpt2()[0].model), "ids"


MODELS.update({f.__name__: f for f in [hf_bert_pos, hf_distilbert_pos, hf_gpt2_pos]})
