"""Pairs of independently written implementations, with planting sites whose true counterpart is known.

Each pair: a transformers reference, a candidate written by other people (TransformerLens, MONAI,
openai-whisper, torch's own ``nn.TransformerEncoder``, x-transformers, fair-esm) or by us (the LLaVA port), weights
converted by the candidate library's own tools or, where it has none, by a name map kept here as data, and the forward
call of each side (TransformerLens takes token ids positionally). ``sites`` maps a candidate module to the reference
module(s) that compute the same thing: the answer a localisation must give when a bug is planted there.
Used by ``tests/test_pairs.py`` and ``benchmarks/pairs.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from paritylab.run.parity import Floors
    from paritylab.tracing.tracefile import Trace


@dataclass
class PairCase:
    name: str
    reference: nn.Module
    candidate: nn.Module
    reference_call: Callable[[nn.Module], Any]
    candidate_call: Callable[[nn.Module], Any]
    sites: dict[str, tuple[str, ...]] = field(default_factory=dict)
    cast_inputs: Callable[[torch.dtype], Callable[[nn.Module], Any]] | None = None
    unpaired: tuple[str, ...] = ()
    """Sites with no counterpart (the answer is the unmatched reference module in their place)."""
    weight_sites: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """The answer for weight plants (``planted_weight``) where it is not ``sites``': modules only weight plants plant
    in (a table no site's subtree holds: rotary frequencies computed once for every layer), and sites whose own
    weight's counterpart is held by another reference module than their output's (Whisper's position tables)."""


def transformer_lens_available() -> str | None:
    """Why the TransformerLens pairs cannot run here, or None when they can."""
    try:
        from transformer_lens import HookedTransformer  # noqa: F401
    except Exception as error:  # ImportError, or a dependency that fails to import beside this torch
        return f"TransformerLens 3.x is not importable ({type(error).__name__}: {error}); pip install '.[pairs]'"
    return None


def monai_available() -> str | None:
    """Why the MONAI pair cannot run here, or None when it can."""
    try:
        from monai.networks.nets import ViT  # noqa: F401
    except Exception as error:
        return f"MONAI is not importable ({type(error).__name__}: {error}); pip install '.[pairs]'"
    return None


def whisper_available() -> str | None:
    """Why the Whisper pair cannot run here, or None when it can."""
    try:
        from whisper.model import Whisper  # noqa: F401
    except Exception as error:
        return f"openai-whisper is not importable ({type(error).__name__}: {error}); pip install '.[pairs]'"
    return None


def x_transformers_available() -> str | None:
    """Why the x-transformers pair cannot run here, or None when it can."""
    try:
        from x_transformers import Decoder, TransformerWrapper  # noqa: F401
    except Exception as error:
        return f"x-transformers is not importable ({type(error).__name__}: {error}); pip install '.[pairs]'"
    return None


def esm_available() -> str | None:
    """Why the ESM pair cannot run here, or None when it can."""
    try:
        from esm.model.esm2 import ESM2  # noqa: F401
    except Exception as error:
        return f"fair-esm is not importable ({type(error).__name__}: {error}); pip install '.[pairs]'"
    return None


def mambapy_available() -> str | None:
    """Why the SSM pair cannot run here, or None when it can."""
    try:
        from mambapy.mamba import Mamba  # noqa: F401
    except Exception as error:
        return f"mambapy is not importable ({type(error).__name__}: {error}); pip install '.[pairs]'"
    return None


def unavailable(name: str) -> str | None:
    """Why pair ``name`` cannot run here (its third-party package is missing), or None when it can."""
    if name in ("llava", "clip-text", "mixtral", "convnext", "t5"):  # our ports; torch's own nn.TransformerEncoder
        return None
    checks = {
        "vit": monai_available, "whisper": whisper_available, "x-transformers": x_transformers_available,
        "esm": esm_available, "mamba": mambapy_available,
    }  # fmt: skip
    return checks.get(name, transformer_lens_available)()


SEED = [0]
"""The seed of the references' random weights (and, offset by one, of their token ids): 0 by default;
``benchmarks/pairs.py --seeds`` sweeps it to look for false alarms beyond the one set of weights."""


def _ids(vocab: int, length: int = 12, batch: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED[0] + 1)
    return torch.randint(0, vocab, (batch, length), generator=generator)


def _block_sites(layers: int, prefix: str, ln1: str, attn: str, ln2: str, mlp: str) -> dict[str, tuple[str, ...]]:
    """TransformerLens' ``blocks.{i}.ln1/attn/ln2/mlp`` and the reference modules under ``{prefix}.{i}``."""
    parts = {"ln1": ln1, "attn": attn, "ln2": ln2, "mlp": mlp}
    return {f"blocks.{i}.{ours}": (f"{prefix}.{i}.{theirs}",) for i in range(layers) for ours, theirs in parts.items()}


def _hook_sites(layers: int, prefix: str, **points: str) -> dict[str, tuple[str, ...]]:
    """TransformerLens' hook points ``blocks.{i}.<point>`` (identities that hand a value on) and the reference
    module under ``{prefix}.{i}`` whose output that value is: an error planted at a hook point is an error in
    that value, named at the module that computes it."""
    return {f"blocks.{i}.{ours}": (f"{prefix}.{i}.{theirs}",) for i in range(layers) for ours, theirs in points.items()}


def _seeded_reference(cls: Callable[[Any], nn.Module], config: Any) -> nn.Module:
    """The transformers reference, eager attention, seeded without touching the global random state."""
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED[0])
        return cls(config).eval()


def gpt2(dtype: torch.dtype = torch.float32, layers: int = 2) -> PairCase:
    """transformers GPT2LMHeadModel against TransformerLens' HookedTransformer (converted by TransformerLens)."""
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=256, n_positions=64)
    reference = _seeded_reference(GPT2LMHeadModel, config)
    tl_config = HookedTransformerConfig(
        n_layers=layers, d_model=64, d_head=16, n_heads=4, d_mlp=256, d_vocab=256, n_ctx=64,
        act_fn="gelu_new", normalization_type="LN", default_prepend_bos=False, dtype=dtype,
        original_architecture="GPT2LMHeadModel",
    )  # fmt: skip
    candidate = transformer_lens_model(tl_config, convert_gpt2_weights(reference, tl_config))
    ids = _ids(256)
    sites = {
        "embed": ("transformer.wte",),
        "pos_embed": ("transformer.wpe",),
        "ln_final": ("transformer.ln_f",),
        "unembed": ("lm_head",),
    }
    sites |= _block_sites(layers, "transformer.h", "ln_1", "attn", "ln_2", "mlp")
    hooks = _hook_sites(layers, "transformer.h", **{"mlp.hook_pre": "mlp.c_fc", "mlp.hook_post": "mlp.act"})
    return PairCase(
        "gpt2/transformer-lens", reference, candidate, lambda m: m(input_ids=ids), lambda m: m(ids), sites | hooks,
        unpaired=tuple(hooks),  # identities when clean: folded, never paired
    )  # fmt: skip


def llama(dtype: torch.dtype = torch.float32, layers: int = 2) -> PairCase:
    """transformers LlamaForCausalLM (grouped-query attention) against TransformerLens' HookedTransformer."""
    from transformer_lens.pretrained.weight_conversions import convert_llama_weights
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-6,
    )  # fmt: skip
    reference = _seeded_reference(LlamaForCausalLM, config)
    tl_config = transformer_lens_config(config, dtype)
    candidate = transformer_lens_model(tl_config, convert_llama_weights(reference, tl_config))
    ids = _ids(256)
    sites = {"embed": ("model.embed_tokens",), "ln_final": ("model.norm",), "unembed": ("lm_head",)}
    sites |= _block_sites(layers, "model.layers", "input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    hooks = _hook_sites(
        layers, "model.layers", **{"mlp.hook_pre": "mlp.gate_proj", "mlp.hook_pre_linear": "mlp.up_proj",
                                   "mlp.hook_post": "mlp"}  # act(gate) * up: the MLP's own code makes it
    )  # fmt: skip
    return PairCase(
        "llama-gqa/transformer-lens", reference, candidate, lambda m: m(input_ids=ids), lambda m: m(ids),
        sites | hooks, unpaired=tuple(hooks),  # identities when clean: folded, never paired
    )  # fmt: skip


def neox(dtype: torch.dtype = torch.float32, layers: int = 2) -> PairCase:
    """transformers GPTNeoXForCausalLM (parallel attention and MLP, rotary on a quarter of each head, one
    fused qkv projection laid out per head) against TransformerLens' HookedTransformer."""
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_neox_weights
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=256, vocab_size=256,
        max_position_embeddings=64, rotary_pct=0.25, use_parallel_residual=True, layer_norm_eps=1e-5,
        hidden_act="gelu",
    )  # fmt: skip
    reference = _seeded_reference(GPTNeoXForCausalLM, config)
    tl_config = HookedTransformerConfig(
        n_layers=layers, d_model=64, d_head=16, n_heads=4, d_mlp=256, d_vocab=256, n_ctx=64, eps=1e-5,
        act_fn="gelu", normalization_type="LN", positional_embedding_type="rotary", rotary_dim=4,
        rotary_adjacent_pairs=False, parallel_attn_mlp=True, default_prepend_bos=False, dtype=dtype,
        original_architecture="GPTNeoXForCausalLM",
    )  # fmt: skip
    candidate = transformer_lens_model(tl_config, convert_neox_weights(reference, tl_config))
    ids = _ids(256)
    sites = {"embed": ("gpt_neox.embed_in",), "ln_final": ("gpt_neox.final_layer_norm",), "unembed": ("lm_head",)}
    sites |= _block_sites(layers, "gpt_neox.layers", "input_layernorm", "attention", "post_attention_layernorm", "mlp")
    return PairCase("neox/transformer-lens", reference, candidate, lambda m: m(input_ids=ids), lambda m: m(ids), sites)


def opt(dtype: torch.dtype = torch.float32, layers: int = 2) -> PairCase:
    """transformers OPTForCausalLM (positions embedded with an offset of 2, the MLP's ``fc1``/``fc2`` directly in
    each layer on hidden states flattened to ``[batch * sequence, width]``) against TransformerLens."""
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.opt import convert_opt_weights
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        hidden_size=64, num_hidden_layers=layers, ffn_dim=256, num_attention_heads=4, vocab_size=256,
        max_position_embeddings=64, word_embed_proj_dim=64, do_layer_norm_before=True, activation_function="relu",
    )  # fmt: skip
    reference = _seeded_reference(OPTForCausalLM, config)
    tl_config = HookedTransformerConfig(
        n_layers=layers, d_model=64, d_head=16, n_heads=4, d_mlp=256, d_vocab=256, n_ctx=64, act_fn="relu",
        normalization_type="LN", default_prepend_bos=False, dtype=dtype, original_architecture="OPTForCausalLM",
        eps=1e-5,
    )  # fmt: skip
    candidate = transformer_lens_model(tl_config, convert_opt_weights(reference, tl_config))
    ids = _ids(256)
    sites = {
        "embed": ("model.decoder.embed_tokens",),
        "pos_embed": ("model.decoder.embed_positions",),  # the table without its 2 offset rows: a cut table
        "ln_final": ("model.decoder.final_layer_norm",),
        "unembed": ("lm_head",),
    }
    for i in range(layers):  # TransformerLens' mlp holds the weights of fc1 and fc2, which sit in the layer
        theirs = f"model.decoder.layers.{i}"
        sites |= {
            f"blocks.{i}.ln1": (f"{theirs}.self_attn_layer_norm",),
            f"blocks.{i}.attn": (f"{theirs}.self_attn",),
            f"blocks.{i}.ln2": (f"{theirs}.final_layer_norm",),
            f"blocks.{i}.mlp": (f"{theirs}.fc2",),
        }
    return PairCase("opt/transformer-lens", reference, candidate, lambda m: m(input_ids=ids), lambda m: m(ids), sites)


def gptj(dtype: torch.dtype = torch.float32, layers: int = 2) -> PairCase:
    """transformers GPTJForCausalLM (attention and MLP in parallel from one norm, rotary on interleaved pairs of
    a part of each head) against TransformerLens."""
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.gptj import convert_gptj_weights
    from transformers import GPTJConfig, GPTJForCausalLM

    config = GPTJConfig(
        n_embd=64, n_layer=layers, n_head=4, vocab_size=256, n_positions=64, rotary_dim=8, n_inner=256,
        activation_function="gelu_new",
    )  # fmt: skip
    reference = _seeded_reference(GPTJForCausalLM, config)
    tl_config = HookedTransformerConfig(
        n_layers=layers, d_model=64, d_head=16, n_heads=4, d_mlp=256, d_vocab=256, n_ctx=64, act_fn="gelu_new",
        normalization_type="LN", positional_embedding_type="rotary", rotary_dim=8, rotary_adjacent_pairs=True,
        parallel_attn_mlp=True, default_prepend_bos=False, dtype=dtype, original_architecture="GPTJForCausalLM",
        eps=1e-5,
    )  # fmt: skip
    candidate = transformer_lens_model(tl_config, convert_gptj_weights(reference, tl_config))
    ids = _ids(256)
    sites = {"embed": ("transformer.wte",), "ln_final": ("transformer.ln_f",), "unembed": ("lm_head",)}
    for i in range(layers):
        theirs = f"transformer.h.{i}"
        sites |= {f"blocks.{i}.ln1": (f"{theirs}.ln_1",), f"blocks.{i}.attn": (f"{theirs}.attn",)}
        sites |= {f"blocks.{i}.mlp": (f"{theirs}.mlp",)}
    return PairCase("gptj/transformer-lens", reference, candidate, lambda m: m(input_ids=ids), lambda m: m(ids), sites)


def bert(dtype: torch.dtype = torch.float32, layers: int = 2) -> PairCase:
    """transformers BertForPreTraining (an encoder: bidirectional, norms after the residual additions, its
    attention's output projection and norm in a module beside the attention proper) against TransformerLens'
    ``HookedEncoder``, whose ``attn`` holds the weights of BERT's query, key, value and output projection."""
    from transformer_lens import HookedEncoder, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.bert import convert_bert_weights
    from transformers import BertConfig, BertForPreTraining

    config = BertConfig(
        hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=256, vocab_size=256,
        max_position_embeddings=64, hidden_act="gelu",
    )  # fmt: skip
    reference = _seeded_reference(BertForPreTraining, config)
    tl_config = HookedTransformerConfig(
        n_layers=layers, d_model=64, d_head=16, n_heads=4, d_mlp=256, d_vocab=256, n_ctx=64, act_fn="gelu",
        normalization_type="LN", attention_dir="bidirectional", original_architecture="BertForMaskedLM",
        dtype=dtype, eps=1e-12,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        candidate = HookedEncoder(tl_config, move_to_device=False)
    candidate.load_state_dict(convert_bert_weights(reference, tl_config), strict=False)
    candidate = candidate.eval().to(dtype)
    ids = _ids(256)
    sites = {
        "embed.embed": ("bert.embeddings.word_embeddings",),
        "embed.ln": ("bert.embeddings.LayerNorm",),
        "mlm_head.ln": ("cls.predictions.transform.LayerNorm",),
        "unembed": ("cls.predictions.decoder",),
    }
    for i in range(layers):
        theirs = f"bert.encoder.layer.{i}"
        sites |= {
            f"blocks.{i}.attn": (f"{theirs}.attention.output.dense",),  # its output, before BERT's norm
            f"blocks.{i}.ln1": (f"{theirs}.attention.output.LayerNorm",),
            f"blocks.{i}.mlp": (f"{theirs}.output.dense",),
            f"blocks.{i}.ln2": (f"{theirs}.output.LayerNorm",),
        }
    return PairCase("bert/transformer-lens", reference, candidate, lambda m: m(input_ids=ids), lambda m: m(ids), sites)


def llava_port(dtype: torch.dtype = torch.float32) -> PairCase:
    """transformers LlavaForConditionalGeneration against our from-scratch port (positional forward)."""
    from experiments.llava_port import from_reference
    from paritylab.run.references import llava
    from tests.helpers import llava_inputs

    reference = llava()
    candidate = from_reference(reference).to(dtype)
    inputs = llava_inputs(reference)
    ids, pixels = inputs["input_ids"], inputs["pixel_values"]

    def cast(to: torch.dtype) -> Callable[[nn.Module], Any]:
        return lambda m: m(input_ids=ids, pixel_values=pixels.to(to))

    sites = {
        "vit.patch_embed": ("model.vision_tower.embeddings.patch_embedding",),
        "vit.ln_pre": ("model.vision_tower.pre_layrnorm",),
        "vit.blocks.0.ln1": ("model.vision_tower.encoder.layers.0.layer_norm1",),
        "vit.blocks.0.attn.wq": ("model.vision_tower.encoder.layers.0.self_attn.q_proj",),
        "vit.blocks.0.attn.wo": ("model.vision_tower.encoder.layers.0.self_attn.out_proj",),
        "vit.blocks.0.mlp.1": ("model.vision_tower.encoder.layers.0.mlp.activation_fn",),
        "vit.blocks.0.mlp.2": ("model.vision_tower.encoder.layers.0.mlp.fc2",),
        "mm_projector.0": ("model.multi_modal_projector.linear_1",),
        "llm.tok_embeddings": ("model.language_model.embed_tokens",),
        "llm.layers.0.attention_norm": ("model.language_model.layers.0.input_layernorm",),
        "llm.layers.0.attention.wo": ("model.language_model.layers.0.self_attn.o_proj",),
        "llm.layers.1.ffn_norm": ("model.language_model.layers.1.post_attention_layernorm",),
        "llm.layers.1.feed_forward.w2": ("model.language_model.layers.1.mlp.down_proj",),
        "llm.norm": ("model.language_model.norm",),
        "llm.output": ("lm_head",),
    }
    return PairCase(
        "llava/port", reference, candidate, cast(torch.float32), lambda m: m(ids, pixels.to(dtype)), sites, cast,
        weight_sites={"llm.rotary": ("model.language_model.rotary_emb",)},  # its inverse frequencies
    )  # fmt: skip


def vit_monai(dtype: torch.dtype = torch.float32, layers: int = 2) -> PairCase:
    """transformers ViTModel against MONAI's ViT: a fused qkv projection, no class token in the patch
    embedding (the class token is concatenated after it, so its position embedding is folded into it), a
    pooled head returned first and hidden states before the final norm. MONAI has no converter from
    transformers, so the mapping below is the whole conversion."""
    from monai.networks.nets import ViT
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(
        hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128, image_size=32,
        patch_size=8, layer_norm_eps=1e-5, hidden_act="gelu", qkv_bias=True,
    )  # fmt: skip
    reference = _seeded_reference(ViTModel, config)
    with torch.random.fork_rng(devices=[]):  # its initial weights are all replaced below (unused norms aside)
        candidate = ViT(
            in_channels=3, img_size=(32, 32), patch_size=(8, 8), hidden_size=64, mlp_dim=128, num_layers=layers,
            num_heads=4, proj_type="conv", classification=True, num_classes=64, spatial_dims=2, qkv_bias=True,
        ).eval()  # fmt: skip
    weights = reference.state_dict()
    position = weights["embeddings.position_embeddings"]
    converted = {
        "cls_token": weights["embeddings.cls_token"] + position[:, :1],
        "patch_embedding.position_embeddings": position[:, 1:],
        "patch_embedding.patch_embeddings.weight": weights["embeddings.patch_embeddings.projection.weight"],
        "patch_embedding.patch_embeddings.bias": weights["embeddings.patch_embeddings.projection.bias"],
        "norm.weight": weights["layernorm.weight"],
        "norm.bias": weights["layernorm.bias"],
        "classification_head.0.weight": weights["pooler.dense.weight"],
        "classification_head.0.bias": weights["pooler.dense.bias"],
    }
    for i in range(layers):
        ours, theirs = f"blocks.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            qkv = [weights[f"{theirs}attention.{name}_proj.{kind}"] for name in "qkv"]
            converted[f"{ours}attn.qkv.{kind}"] = torch.cat(qkv)
            for mine, source in (
                ("attn.out_proj", "attention.o_proj"), ("mlp.linear1", "mlp.fc1"), ("mlp.linear2", "mlp.fc2"),
                ("norm1", "layernorm_before"), ("norm2", "layernorm_after"),
            ):  # fmt: skip
                converted[f"{ours}{mine}.{kind}"] = weights[f"{theirs}{source}.{kind}"]
    candidate.load_state_dict(converted, strict=False)  # cross-attention norms: unused without cross-attention
    candidate = candidate.to(dtype)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))

    def cast(to: torch.dtype) -> Callable[[nn.Module], Any]:
        return lambda m: m(pixel_values=pixels.to(to))

    sites = {
        "patch_embedding.patch_embeddings": ("embeddings.patch_embeddings.projection",),
        "patch_embedding": ("embeddings",),  # adds position embeddings, as transformers' embeddings do
        "norm": ("layernorm",),
        "classification_head.0": ("pooler.dense",),
        "classification_head.1": ("pooler.activation",),
    }
    for i in range(layers):
        theirs = f"layers.{i}"
        sites |= {
            f"blocks.{i}.norm1": (f"{theirs}.layernorm_before",),
            f"blocks.{i}.attn.qkv": tuple(f"{theirs}.attention.{name}_proj" for name in "qkv"),
            f"blocks.{i}.attn.out_proj": (f"{theirs}.attention.o_proj",),
            f"blocks.{i}.norm2": (f"{theirs}.layernorm_after",),
            f"blocks.{i}.mlp.linear1": (f"{theirs}.mlp.fc1",),
            f"blocks.{i}.mlp.fn": (f"{theirs}.mlp.activation_fn",),
            f"blocks.{i}.mlp.linear2": (f"{theirs}.mlp.fc2",),
        }
    return PairCase(
        "vit/monai", reference, candidate, cast(torch.float32), lambda m: m(pixels.to(dtype)), sites, cast,
        unpaired=("patch_embedding",),
    )  # fmt: skip


# openai-whisper's module -> transformers' (``{}``: the layer number), the whole weight conversion of the
# Whisper pair: each module's ``weight`` and ``bias`` are copied from its counterpart's. openai-whisper has no
# converter from transformers (its checkpoints are its own), so this map is it.
WHISPER_MODULES = {
    "encoder.conv1": "model.encoder.conv1",
    "encoder.conv2": "model.encoder.conv2",
    "encoder.ln_post": "model.encoder.layer_norm",
    "decoder.token_embedding": "model.decoder.embed_tokens",  # also the unembedding (read, not called)
    "decoder.ln": "model.decoder.layer_norm",
}
WHISPER_BLOCK = {  # under encoder.blocks.{} / model.encoder.layers.{} and decoder.blocks.{} / model.decoder.layers.{}
    "attn.query": "self_attn.q_proj",
    "attn.key": "self_attn.k_proj",  # no bias on either side
    "attn.value": "self_attn.v_proj",
    "attn.out": "self_attn.out_proj",
    "attn_ln": "self_attn_layer_norm",
    "mlp.0": "fc1",
    "mlp.2": "fc2",
    "mlp_ln": "final_layer_norm",
}
WHISPER_CROSS = {  # the decoder's blocks only
    "cross_attn.query": "encoder_attn.q_proj",
    "cross_attn.key": "encoder_attn.k_proj",
    "cross_attn.value": "encoder_attn.v_proj",
    "cross_attn.out": "encoder_attn.out_proj",
    "cross_attn_ln": "encoder_attn_layer_norm",
}
WHISPER_TABLES = {  # tensors that are no module's weight: the encoder's fixed sinusoids (a buffer there, the
    # frozen weight of an nn.Embedding called on every position here) and the decoder's learned positions
    "encoder.positional_embedding": "model.encoder.embed_positions.weight",
    "decoder.positional_embedding": "model.decoder.embed_positions.weight",
}


def _whisper_modules(layers: int) -> dict[str, str]:
    """WHISPER_MODULES with every block's modules, layer numbers filled in."""
    modules = dict(WHISPER_MODULES)
    for side, parts in (("encoder", WHISPER_BLOCK), ("decoder", WHISPER_BLOCK | WHISPER_CROSS)):
        for i in range(layers):
            ours, theirs = f"{side}.blocks.{i}", f"model.{side}.layers.{i}"
            modules |= {f"{ours}.{mine}": f"{theirs}.{source}" for mine, source in parts.items()}
    return modules


def whisper(dtype: torch.dtype = torch.float32, layers: int = 2) -> PairCase:
    """transformers WhisperForConditionalGeneration against OpenAI's ``openai-whisper`` (an encoder-decoder): a
    conv stem whose GELUs are functions, the encoder's sinusoidal positions a buffer added in the encoder's own
    code (transformers calls a frozen ``nn.Embedding`` for them), the decoder's learned positions a bare
    parameter, attention whose scale is split as d^-1/4 on q and k (transformers scales q by d^-1/2) and runs
    through ``scaled_dot_product_attention`` with ``is_causal``, cross-attention on the encoder's output, norms
    computed in float32 whatever the model's dtype, the MLP an ``nn.Sequential`` holding what transformers
    keeps as ``fc1`` and ``fc2`` directly in the layer, and logits read off the token embedding's weight inside
    the decoder's forward (transformers: a ``proj_out`` module tied to that weight)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    from whisper.model import ModelDimensions, Whisper

    width, heads, vocab, mels, audio, text = 64, 4, 128, 16, 16, 32
    config = WhisperConfig(
        vocab_size=vocab, num_mel_bins=mels, d_model=width, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=4 * width,
        decoder_ffn_dim=4 * width, max_source_positions=audio, max_target_positions=text, activation_function="gelu",
        pad_token_id=1, bos_token_id=2, eos_token_id=1, decoder_start_token_id=2,  # the defaults exceed this vocab
    )  # fmt: skip
    reference = _seeded_reference(WhisperForConditionalGeneration, config)
    dimensions = ModelDimensions(
        n_mels=mels, n_audio_ctx=audio, n_audio_state=width, n_audio_head=heads, n_audio_layer=layers,
        n_vocab=vocab, n_text_ctx=text, n_text_state=width, n_text_head=heads, n_text_layer=layers,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):  # every initial weight is replaced below
        candidate = Whisper(dimensions).eval()
    weights = reference.state_dict()
    converted = {ours: weights[theirs] for ours, theirs in WHISPER_TABLES.items()}
    for ours, theirs in _whisper_modules(layers).items():
        for kind in ("weight", "bias"):
            if f"{theirs}.{kind}" in weights:
                converted[f"{ours}.{kind}"] = weights[f"{theirs}.{kind}"]
    candidate.load_state_dict(converted)  # strict: every weight and buffer it keeps has its source
    candidate = candidate.to(dtype)
    for module in candidate.modules():  # its norms compute in float32 on float32 weights whatever the model's
        if isinstance(module, nn.LayerNorm):  # dtype (on CPU, layer_norm refuses float32 input with bf16 weights)
            module.float()
    generator = torch.Generator().manual_seed(SEED[0] + 1)
    mel = torch.randn(2, mels, 2 * audio, generator=generator)  # the conv stem halves it to the encoder's context
    ids = _ids(vocab)

    def cast(to: torch.dtype) -> Callable[[nn.Module], Any]:
        return lambda m: m(input_features=mel.to(to), decoder_input_ids=ids)

    sites = {ours: (theirs,) for ours, theirs in _whisper_modules(layers).items()}
    for side in ("encoder", "decoder"):
        for i in range(layers):
            ours, theirs = f"{side}.blocks.{i}", f"model.{side}.layers.{i}"
            sites |= {
                f"{ours}.attn": (f"{theirs}.self_attn",),
                f"{ours}.mlp.1": (f"{theirs}.activation_fn",),
                f"{ours}.mlp": (f"{theirs}.fc2",),  # holds fc1's and fc2's weights: a run ending at fc2
            }
            if side == "decoder":
                sites[f"{ours}.cross_attn"] = (f"{theirs}.encoder_attn",)
    sites |= {"encoder": ("model.encoder",), "decoder": ("proj_out",)}  # the decoder returns the logits
    # Left unpaired by the alignment when clean: the MLP containers (their last child, paired with fc2, makes
    # their output), the encoder (transformers' also holds the position table as a parameter) and the decoder
    # (its output is the logits, transformers' decoder's the normed hidden states).
    unpaired = ("encoder", "decoder", *(s for s in sites if s.endswith(".mlp")))
    # A weight plant in the encoder or the decoder changes the position table each holds itself (the encoder's
    # sinusoids, the decoder's learned positions): transformers holds it in an embed_positions module, which is the
    # answer, as is the site's own (the module whose output the table's error reaches first, paired or not)
    tables = {side: (f"model.{side}.embed_positions", *sites[side]) for side in ("encoder", "decoder")}
    return PairCase(
        "whisper/openai-whisper", reference, candidate, cast(torch.float32), lambda m: m(mel.to(dtype), ids), sites,
        cast, unpaired, weight_sites=tables,
    )  # fmt: skip


class ChannelsFirstNorm(nn.Module):
    """The original ConvNeXt's channels-first LayerNorm, written out: mean and variance over dimension 1."""

    def __init__(self, channels: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(channels)), nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(1, keepdim=True)
        variance = (x - mean).pow(2).mean(1, keepdim=True)
        x = (x - mean) / torch.sqrt(variance + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class ChannelsFirstBlock(nn.Module):
    """A ConvNeXt block kept in ``[N, C, H, W]`` throughout: 1x1 convolutions where transformers permutes to
    channels-last for its norm and linear layers; the layer scale held as ``[C, 1, 1]``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = ChannelsFirstNorm(channels)
        self.fc1, self.act = nn.Conv2d(channels, 4 * channels, 1), nn.GELU()
        self.fc2 = nn.Conv2d(4 * channels, channels, 1)
        self.gamma = nn.Parameter(torch.ones(channels, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * self.fc2(self.act(self.fc1(self.norm(self.dwconv(x)))))


class ChannelsFirstConvNeXt(nn.Module):
    """ConvNeXt written channels-first (the original repository's ``conv_mlp`` form): returns the last feature map
    and the pooled, normed features."""

    def __init__(self, widths: tuple[int, ...], depths: tuple[int, ...], patch: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], patch, stride=patch), ChannelsFirstNorm(widths[0]))
        self.stages = nn.ModuleList()
        for i, (width, depth) in enumerate(zip(widths, depths, strict=True)):
            stage = nn.Module()
            if i:
                stage.down = nn.Sequential(ChannelsFirstNorm(widths[i - 1]), nn.Conv2d(widths[i - 1], width, 2, 2))
            stage.blocks = nn.Sequential(*(ChannelsFirstBlock(width) for _ in range(depth)))
            self.stages.append(stage)
        self.norm = nn.LayerNorm(widths[-1], eps=1e-12)

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.stem(pixels)
        for stage in self.stages:
            x = stage.blocks(stage.down(x) if hasattr(stage, "down") else x)
        return x, self.norm(x.mean((-2, -1)))


CONVNEXT_BLOCK = {"dwconv": "dwconv", "norm": "layernorm", "fc1": "pwconv1", "act": "act", "fc2": "pwconv2"}


def convnext(dtype: torch.dtype = torch.float32, layers: int = 2) -> PairCase:
    """transformers ConvNextModel (each block permutes to channels-last for its norm and its two linear layers)
    against a channels-first port: 1x1 convolutions, a written-out norm over channels, the layer scale held as
    ``[C, 1, 1]``. The conversion below adds the 1x1 kernels' two dimensions and reshapes the layer scale."""
    from transformers import ConvNextConfig, ConvNextModel

    widths, depths = (16, 32), (layers, layers)
    config = ConvNextConfig(
        hidden_sizes=list(widths), depths=list(depths), num_stages=len(widths), num_channels=3, patch_size=4,
        image_size=32, layer_scale_init_value=0.5, layer_norm_eps=1e-12, hidden_act="gelu",
    )  # fmt: skip
    reference = _seeded_reference(ConvNextModel, config)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):  # norms and layer scales away from their constants
        torch.manual_seed(SEED[0] + 2)
        for name, tensor in reference.named_parameters():
            if "layernorm" in name or "downsampling_layer.0" in name or "layer_scale" in name:
                tensor.copy_((1.0 if name.endswith(("weight", "parameter")) else 0.0) + 0.2 * torch.randn_like(tensor))
    with torch.random.fork_rng(devices=[]):
        candidate = ChannelsFirstConvNeXt(widths, depths).eval()
    weights = reference.state_dict()
    converted = {f"stem.0.{kind}": weights[f"embeddings.patch_embeddings.{kind}"] for kind in ("weight", "bias")} | {
        f"stem.1.{kind}": weights[f"embeddings.layernorm.{kind}"] for kind in ("weight", "bias")
    }
    converted |= {f"norm.{kind}": weights[f"layernorm.{kind}"] for kind in ("weight", "bias")}
    sites: dict[str, tuple[str, ...]] = {
        "stem.0": ("embeddings.patch_embeddings",), "stem.1": ("embeddings.layernorm",), "norm": ("layernorm",),
    }  # fmt: skip
    for i in range(len(widths)):
        ours, theirs = f"stages.{i}.", f"encoder.stages.{i}."
        if i:
            for step in ("0", "1"):
                sites[f"{ours}down.{step}"] = (f"{theirs}downsampling_layer.{step}",)
                for kind in ("weight", "bias"):
                    converted[f"{ours}down.{step}.{kind}"] = weights[f"{theirs}downsampling_layer.{step}.{kind}"]
        for j in range(depths[i]):
            mine, source = f"{ours}blocks.{j}.", f"{theirs}layers.{j}."
            sites |= {f"{mine}{a}": (f"{source}{b}",) for a, b in CONVNEXT_BLOCK.items()}
            for a, b in CONVNEXT_BLOCK.items():
                for kind in ("weight", "bias"):
                    if f"{source}{b}.{kind}" in weights:
                        value = weights[f"{source}{b}.{kind}"]
                        kernel = a.startswith("fc") and kind == "weight"  # a linear map as a 1x1 convolution
                        converted[f"{mine}{a}.{kind}"] = value[:, :, None, None] if kernel else value
            converted[f"{mine}gamma"] = weights[f"{source}layer_scale_parameter"][:, None, None]
    candidate.load_state_dict(converted)
    candidate = candidate.to(dtype)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(SEED[0] + 1))

    def cast(to: torch.dtype) -> Callable[[nn.Module], Any]:
        return lambda m: m(pixel_values=pixels.to(to))

    return PairCase(
        "convnext/channels-first", reference, candidate, cast(torch.float32), lambda m: m(pixels.to(dtype)), sites,
        cast,
    )  # fmt: skip


class TorchTextTransformer(nn.Module):
    """open_clip's ``TextTransformer`` layout (a token embedding, a bare positional parameter, a causal stack, a
    final norm, the end-of-text token pooled and projected) around torch's own ``nn.TransformerEncoder``: each
    layer's attention is ``nn.MultiheadAttention``, whose query, key and value weights are one parameter of the
    attention itself and whose ``out_proj`` child is never called (the parent reads its weight)."""

    def __init__(self, vocab: int, width: int, heads: int, layers: int, context: int, mlp: int, output: int) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, width)
        self.positional_embedding = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(
            width, heads, mlp, dropout=0.0, activation=nn.GELU(), layer_norm_eps=1e-5, batch_first=True,
            norm_first=True,
        )  # fmt: skip
        self.transformer = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln_final = nn.LayerNorm(width, eps=1e-5)
        self.text_projection = nn.Linear(width, output, bias=False)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        length = ids.shape[1]
        x = self.token_embedding(ids) + self.positional_embedding[:length]
        mask = nn.Transformer.generate_square_subsequent_mask(length, dtype=x.dtype)  # -inf above the diagonal
        x = self.ln_final(self.transformer(x, mask=mask, is_causal=True))
        pooled = x[torch.arange(x.shape[0]), ids.argmax(dim=-1)]  # the highest id: end of text, as CLIP's
        return self.text_projection(pooled), x


# TorchTextTransformer's module -> transformers CLIPTextModelWithProjection's, the whole weight conversion of the
# pair: each module's ``weight`` and ``bias`` are copied from its counterpart's.
CLIP_TEXT_MODULES = {
    "token_embedding": "text_model.embeddings.token_embedding",
    "ln_final": "text_model.final_layer_norm",
    "text_projection": "text_projection",
}
CLIP_TEXT_LAYER = {  # under transformer.layers.{} / text_model.encoder.layers.{}
    "norm1": "layer_norm1",
    "self_attn.out_proj": "self_attn.out_proj",  # read by its parent, never called
    "norm2": "layer_norm2",
    "linear1": "mlp.fc1",
    "linear2": "mlp.fc2",
}
CLIP_TEXT_FUSED = {  # nn.MultiheadAttention's own parameters (``{}``: weight or bias): q, k, v concatenated
    "self_attn.in_proj_{}": ("self_attn.q_proj.{}", "self_attn.k_proj.{}", "self_attn.v_proj.{}"),
}
CLIP_TEXT_TABLES = {"positional_embedding": "text_model.embeddings.position_embedding.weight"}


def clip_text_mha(dtype: torch.dtype = torch.float32, layers: int = 2) -> PairCase:
    """transformers CLIPTextModelWithProjection against torch's ``nn.TransformerEncoder`` in open_clip's text
    tower layout (``TorchTextTransformer``): fused query/key/value weights held by the attention module itself,
    an output projection read by its parent, dropout and GELU modules inside each layer, a float causal mask."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    width, heads, vocab, context, mlp, output = 64, 4, 128, 32, 256, 32
    config = CLIPTextConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=heads, max_position_embeddings=context, hidden_act="gelu", projection_dim=output,
        layer_norm_eps=1e-5, pad_token_id=1, bos_token_id=0, eos_token_id=2,  # 2: pool at the highest id
    )  # fmt: skip
    reference = _seeded_reference(CLIPTextModelWithProjection, config)
    with torch.random.fork_rng(devices=[]):  # every initial weight is replaced below
        candidate = TorchTextTransformer(vocab, width, heads, layers, context, mlp, output).eval()
    weights = reference.state_dict()
    converted = {ours: weights[theirs] for ours, theirs in CLIP_TEXT_TABLES.items()}
    modules = dict(CLIP_TEXT_MODULES)
    for i in range(layers):
        ours, theirs = f"transformer.layers.{i}", f"text_model.encoder.layers.{i}"
        modules |= {f"{ours}.{mine}": f"{theirs}.{source}" for mine, source in CLIP_TEXT_LAYER.items()}
        for kind in ("weight", "bias"):
            for mine, parts in CLIP_TEXT_FUSED.items():
                converted[f"{ours}.{mine.format(kind)}"] = torch.cat(
                    [weights[f"{theirs}.{p.format(kind)}"] for p in parts]
                )
    for ours, theirs in modules.items():
        for kind in ("weight", "bias"):
            if f"{theirs}.{kind}" in weights:
                converted[f"{ours}.{kind}"] = weights[f"{theirs}.{kind}"]
    candidate.load_state_dict(converted)  # strict: every parameter has its source
    candidate = candidate.to(dtype)
    ids = _ids(vocab)
    sites = {
        "token_embedding": ("text_model.embeddings.token_embedding",),
        "ln_final": ("text_model.final_layer_norm",),
        "text_projection": ("text_projection",),
    }
    for i in range(layers):
        ours, theirs = f"transformer.layers.{i}", f"text_model.encoder.layers.{i}"
        sites |= {
            f"{ours}.norm1": (f"{theirs}.layer_norm1",),
            f"{ours}.self_attn": (f"{theirs}.self_attn",),  # out_proj inside, never called
            f"{ours}.norm2": (f"{theirs}.layer_norm2",),
            f"{ours}.linear1": (f"{theirs}.mlp.fc1",),
            f"{ours}.activation": (f"{theirs}.mlp.activation_fn",),
            f"{ours}.linear2": (f"{theirs}.mlp.fc2",),
            ours: (theirs,),
        }
    return PairCase("clip-text/torch.nn", reference, candidate, lambda m: m(input_ids=ids), lambda m: m(ids), sites)


# x-transformers' module (under attn_layers.layers) -> transformers Llama's (under model.layers.{i}), per layer i:
# x-transformers lays attention and feed-forward out as alternate entries of one flat list, each
# [norms, block, residual], with no module for a decoder layer.
XT_ATTENTION = {
    "0.0": "input_layernorm",
    "1.to_q": "self_attn.q_proj",
    "1.to_k": "self_attn.k_proj",
    "1.to_v": "self_attn.v_proj",
    "1.to_out": "self_attn.o_proj",
}
XT_FEEDFORWARD = {"0.0": "post_attention_layernorm", "1.ff.2": "mlp.down_proj"}


def xtransformers_llama(dtype: torch.dtype = torch.float32, layers: int = 2) -> PairCase:
    """transformers LlamaForCausalLM against lucidrains' x-transformers ``TransformerWrapper(Decoder(...))``:
    attention and feed-forward as alternate entries of one flat list with no module per decoder layer, an RMSNorm
    computed as ``F.normalize(x) * sqrt(d) * g``, the gate and up projections fused in one biased ``GLU.proj`` (up
    first), rotary frequencies computed once by a module of the decoder and passed to every attention."""
    from loguru import logger
    from transformers import LlamaConfig, LlamaForCausalLM
    from x_transformers import Decoder, TransformerWrapper

    logger.disable("x_transformers")  # its advice on rotary widths for training: not this tiny model's concern

    width, heads, kv_heads, head, mlp, vocab = 64, 4, 2, 16, 176, 256
    config = LlamaConfig(
        hidden_size=width, intermediate_size=mlp, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=64, rms_norm_eps=1e-12,
    )  # fmt: skip
    reference = _seeded_reference(LlamaForCausalLM, config)
    generator = torch.Generator().manual_seed(SEED[0])
    with torch.no_grad():
        reference.model.embed_tokens.weight.mul_(50)  # unit-sized activations: F.normalize has no eps to match
        for name, parameter in reference.named_parameters():
            if name.endswith("norm.weight"):  # trained norms differ from 1 and from each other
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    with torch.random.fork_rng(devices=[]):  # every initial weight is replaced below
        candidate = TransformerWrapper(
            num_tokens=vocab, max_seq_len=64, use_abs_pos_emb=False,
            attn_layers=Decoder(
                dim=width, depth=layers, heads=heads, attn_kv_heads=kv_heads, attn_dim_head=head,
                rotary_pos_emb=True, rotary_emb_dim=head, use_rmsnorm=True, ff_glu=True, ff_swish=True,
                ff_mult=mlp / width, ff_no_bias=True,
            ),
        ).eval()  # fmt: skip
    weights = reference.state_dict()
    converted = {
        "token_emb.emb.weight": weights["model.embed_tokens.weight"],
        "attn_layers.final_norm.g": weights["model.norm.weight"] - 1,
        "to_logits.weight": weights["lm_head.weight"],
    }
    sites = {  # token_emb wraps its nn.Embedding (the Embedding is paired with transformers', leaf with leaf)
        "token_emb": ("model.embed_tokens",), "token_emb.emb": ("model.embed_tokens",),
        "attn_layers.final_norm": ("model.norm",), "to_logits": ("lm_head",),
    }  # fmt: skip
    for i in range(layers):
        theirs = f"model.layers.{i}"
        for j, table in ((2 * i, XT_ATTENTION), (2 * i + 1, XT_FEEDFORWARD)):
            ours = f"attn_layers.layers.{j}"
            for mine, source in table.items():
                if mine.startswith("0."):  # x-transformers' norms hold gamma - 1 (``unit_offset``)
                    converted[f"{ours}.{mine}.g"] = weights[f"{theirs}.{source}.weight"] - 1
                else:
                    converted[f"{ours}.{mine}.weight"] = weights[f"{theirs}.{source}.weight"]
                sites[f"{ours}.{mine}"] = (f"{theirs}.{source}",)
        attention, feedforward = f"attn_layers.layers.{2 * i}.1", f"attn_layers.layers.{2 * i + 1}.1"
        # x-transformers repeats grouped key/value heads as (repeat, group), transformers as (group, repeat): its
        # query head r * kv_heads + g is transformers' g * (heads // kv_heads) + r (and the output's columns follow);
        # its rotary turns interleaved pairs, transformers' the two halves of each head: the rows move to match
        order = [g * (heads // kv_heads) + r for r in range(heads // kv_heads) for g in range(kv_heads)]
        for mine, count, heads_order in (("to_q", heads, order), ("to_k", kv_heads, list(range(kv_heads)))):
            rows = weights[f"{theirs}.self_attn.{mine[-1]}_proj.weight"].view(count, 2, head // 2, width)
            converted[f"{attention}.{mine}.weight"] = rows[heads_order].transpose(1, 2).reshape(-1, width)
        columns = weights[f"{theirs}.self_attn.o_proj.weight"].view(width, heads, head)
        converted[f"{attention}.to_out.weight"] = columns[:, order].reshape(width, width)
        up, gate = weights[f"{theirs}.mlp.up_proj.weight"], weights[f"{theirs}.mlp.gate_proj.weight"]
        converted[f"{feedforward}.ff.0.proj.weight"] = torch.cat([up, gate])
        converted[f"{feedforward}.ff.0.proj.bias"] = torch.zeros(2 * mlp)
        sites |= {  # the FeedForward and its ff Sequential hold the same weights and return the same value: either
            # may be paired with the MLP, and a plant in the other is named downstream: not sites (a known miss)
            attention: (f"{theirs}.self_attn",),
            f"{feedforward}.ff.0.proj": (f"{theirs}.mlp.gate_proj", f"{theirs}.mlp.up_proj"),  # fused: both halves
            f"{feedforward}.ff.0": (f"{theirs}.mlp",),  # up * act(gate): the MLP's own code makes it
        }
    missing, unexpected = candidate.load_state_dict(converted, strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], missing
    candidate = candidate.to(dtype)
    ids = _ids(vocab)
    return PairCase(
        "llama/x-transformers", reference, candidate, lambda m: m(input_ids=ids), lambda m: m(ids), sites,
        unpaired=("token_emb", *(f"attn_layers.layers.{2 * i + 1}.1.ff.0" for i in range(layers))),
        weight_sites={"attn_layers.rotary_pos_emb": ("model.rotary_emb",)},  # its inverse frequencies
    )  # fmt: skip


# fair-esm's module -> transformers EsmForMaskedLM's (transformers' own ``convert_esm.py`` map), per layer under
# layers.{i} / esm.encoder.layer.{i}: the weight conversion of the pair.
ESM_MODULES = {
    "embed_tokens": "esm.embeddings.word_embeddings",  # also the language-model head's weight (read, not called)
    "emb_layer_norm_after": "esm.encoder.emb_layer_norm_after",
    "lm_head.dense": "lm_head.dense",
    "lm_head.layer_norm": "lm_head.layer_norm",
    "contact_head.regression": "esm.contact_head.regression",  # never called by a plain forward
}
ESM_LAYER = {
    "self_attn_layer_norm": "attention.LayerNorm",
    "self_attn.q_proj": "attention.self.query",
    "self_attn.k_proj": "attention.self.key",
    "self_attn.v_proj": "attention.self.value",
    "self_attn.out_proj": "attention.output.dense",
    "final_layer_norm": "LayerNorm",
    "fc1": "intermediate.dense",
    "fc2": "output.dense",
}


def esm_fair(dtype: torch.dtype = torch.float32, layers: int = 2) -> PairCase:
    """transformers EsmForMaskedLM against the original it was ported from, Meta's ``fair-esm`` ESM-2: a
    bidirectional encoder with rotary attention whose layers run sequence-first (``[T, B, E]``, transposed from
    transformers' ``[B, T, E]``), a fairseq attention module returning ``(output, weights)``, GELU as a function
    (no module), a language-model head that reads the token embedding's weight, the masked-token rescaling of the
    embeddings in the model's own code, and a dict of outputs."""
    from esm.model.esm2 import ESM2
    from transformers import EsmConfig, EsmForMaskedLM

    width, heads, mlp = 64, 4, 256
    with torch.random.fork_rng(devices=[]):  # every initial weight is replaced below
        candidate = ESM2(num_layers=layers, embed_dim=width, attention_heads=heads, token_dropout=True).eval()
    alphabet = candidate.alphabet
    config = EsmConfig(
        vocab_size=len(alphabet.all_toks), hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=mlp, position_embedding_type="rotary", token_dropout=True, layer_norm_eps=1e-5,
        mask_token_id=alphabet.mask_idx, pad_token_id=alphabet.padding_idx, emb_layer_norm_before=False,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    reference = _seeded_reference(EsmForMaskedLM, config)
    weights = reference.state_dict()
    modules = dict(ESM_MODULES)
    for i in range(layers):
        modules |= {f"layers.{i}.{ours}": f"esm.encoder.layer.{i}.{theirs}" for ours, theirs in ESM_LAYER.items()}
    converted = {"lm_head.bias": weights["lm_head.bias"]}
    for ours, theirs in modules.items():
        for kind in ("weight", "bias"):
            if f"{theirs}.{kind}" in weights:
                converted[f"{ours}.{kind}"] = weights[f"{theirs}.{kind}"]
    missing, unexpected = candidate.load_state_dict(converted, strict=False)
    # the head's weight is the token embedding's (tied); each rotary's inverse frequencies, its own buffer
    assert not unexpected and not [k for k in missing if k != "lm_head.weight" and "rot_emb" not in k], missing
    candidate = candidate.to(dtype)
    generator = torch.Generator().manual_seed(SEED[0] + 1)
    residues = torch.randint(4, 24, (2, 10), generator=generator)  # the twenty standard amino acids
    residues[0, 3] = alphabet.mask_idx  # one masked token: the embeddings are rescaled by the masked share
    column = torch.ones(2, 1, dtype=torch.long)
    ids = torch.cat([column * alphabet.cls_idx, residues, column * alphabet.eos_idx], dim=1)
    sites = {ours: (theirs,) for ours, theirs in modules.items() if not ours.startswith("contact_head")}
    for i in range(layers):
        sites[f"layers.{i}"] = (f"esm.encoder.layer.{i}",)
    sites["lm_head"] = ("lm_head",)
    return PairCase("esm/fair-esm", reference, candidate, lambda m: m(input_ids=ids), lambda m: m(ids), sites)


def mixtral_moe(dtype: torch.dtype = torch.float32, layers: int = 2) -> PairCase:
    """transformers MixtralForCausalLM, whose experts are one 3-D parameter per projection (``gate_up_proj``,
    ``down_proj``) run by one module, against our per-expert port (``tests/moe_port.py``): one module per expert,
    the top-k taken on the router's logits (transformers' on its float32 probabilities), the weights converted by
    cutting each expert's rows out of the fused parameters. The two sides' routing decisions are discrete: a token
    whose second and third router logits nearly tie may pick another expert at low precision."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from tests.moe_port import LAYER, MODULES, from_mixtral

    config = MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, sliding_window=None, router_jitter_noise=0.0,
    )  # fmt: skip
    config._experts_implementation = "eager"
    reference = _seeded_reference(MixtralForCausalLM, config)
    candidate = from_mixtral(reference).to(dtype)
    ids = _ids(256)
    sites = {ours: (theirs,) for ours, theirs in MODULES.items()}
    for i in range(layers):
        theirs = f"model.layers.{i}"
        sites |= {f"layers.{i}.{ours}": (f"{theirs}.{source}",) for ours, source in LAYER.items()}
        sites |= {
            f"layers.{i}.attention": (f"{theirs}.self_attn",),
            f"layers.{i}.feed_forward": (f"{theirs}.mlp",),
        }
    return PairCase("mixtral/per-expert", reference, candidate, lambda m: m(input_ids=ids), lambda m: m(ids), sites)


def t5_port(dtype: torch.dtype = torch.float32, layers: int = 2) -> PairCase:
    """transformers T5ForConditionalGeneration (T5 v1.1: gated-GELU, the head tied to the embedding) against our
    port (``tests/t5_port.py``): each stack computes its relative position bias once from a table it holds (the
    reference's first attention of each stack holds it), fused ``qkv`` and ``kv`` projections, the decoder reads the
    encoder's embedding, and the logits are a function of the embedding's weight with no module of their own."""
    from transformers import T5Config, T5ForConditionalGeneration

    from tests.t5_port import FUSED, LAYERS, from_t5

    config = T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_decoder_layers=layers, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, feed_forward_proj="gated-gelu",
        dropout_rate=0.0, tie_word_embeddings=True, decoder_start_token_id=0,
    )  # fmt: skip
    reference = _seeded_reference(T5ForConditionalGeneration, config)
    candidate = from_t5(reference).to(dtype)
    ids = _ids(128)
    decoder_ids = _ids(128, length=7)
    table = "block.0.layer.0.SelfAttention.relative_attention_bias"
    sites: dict[str, tuple[str, ...]] = {"encoder.tok": ("encoder.embed_tokens",)}  # ``shared``, called there first
    for stack in ("encoder", "decoder"):
        sites |= {f"{stack}.position_bias": (f"{stack}.{table}",), f"{stack}.norm": (f"{stack}.final_layer_norm",)}
        for i in range(layers):
            ours, theirs = f"{stack}.layers.{i}", f"{stack}.block.{i}"
            sites |= {f"{ours}.{mine}": (f"{theirs}.{source}",) for mine, source in LAYERS[stack].items()}
            sites |= {f"{ours}.attn": (f"{theirs}.layer.0.SelfAttention",)}
            feed_forward = "layer.1.DenseReluDense" if stack == "encoder" else "layer.2.DenseReluDense"
            sites |= {f"{ours}.ff": (f"{theirs}.{feed_forward}",)}
            if stack == "decoder":
                sites |= {f"{ours}.cross": (f"{theirs}.layer.1.EncDecAttention",)}
            sites |= {
                f"{ours}.{mine}": tuple(f"{theirs}.{source}" for source in sources)
                for mine, sources in FUSED[stack].items()
            }
    return PairCase(
        "t5/port", reference, candidate,
        lambda m: m(input_ids=ids, decoder_input_ids=decoder_ids, use_cache=False), lambda m: m(ids, decoder_ids),
        sites, weight_sites={"encoder.tok": ("encoder.embed_tokens", "shared")},  # its weight's own name: shared
    )  # fmt: skip


def folded_resnet_reference(layer_type: str = "basic", layers: int = 2) -> nn.Module:
    """A transformers ResNetModel whose batch norms hold statistics as a trained model's do (random ``γ``, ``β``,
    means and variances: a fresh norm is the identity, and folding it changes nothing)."""
    from transformers import ResNetConfig, ResNetModel

    config = ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[layers, layers], layer_type=layer_type, num_channels=3,
    )  # fmt: skip
    reference = _seeded_reference(ResNetModel, config)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED[0] + 2)
        for module in reference.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.normal_(0.0, 0.2)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.2)
    return reference


def folded_resnet(dtype: torch.dtype = torch.float32, layers: int = 2, layer_type: str = "basic") -> PairCase:
    """transformers ResNetModel against an inference port with every batch norm folded into the convolution before
    it (``tests/folded_port.py``): one module computes what a convolution and its norm compute, with weights equal to
    none of the reference's."""
    from tests.folded_port import from_resnet, sites

    reference = folded_resnet_reference(layer_type, layers)
    candidate = from_resnet(reference).to(dtype)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(SEED[0] + 1))

    def cast(to: torch.dtype) -> Callable[[nn.Module], Any]:
        return lambda m: m(pixel_values=pixels.to(to))

    return PairCase(
        "resnet/folded-bn", reference, candidate, cast(torch.float32), lambda m: m(pixels.to(dtype)),
        sites(reference), cast,
    )  # fmt: skip


def bloom_reference(layers: int = 2) -> nn.Module:
    """A tiny transformers BloomForCausalLM, eager attention, no dropout."""
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(
        vocab_size=128, hidden_size=64, n_layer=layers, n_head=4, hidden_dropout=0.0, attention_dropout=0.0,
        use_cache=False,
    )  # fmt: skip
    return _seeded_reference(BloomForCausalLM, config)


def bloom(dtype: torch.dtype = torch.float32, layers: int = 2) -> PairCase:
    """transformers BloomForCausalLM against a port whose blocks add the residual that BLOOM's attention and MLP add
    themselves (``tests/bloom_port.py``): modules holding the same weights whose outputs differ by an input."""
    from tests.bloom_port import from_bloom, sites

    reference = bloom_reference(layers)
    candidate = from_bloom(reference).to(dtype)
    ids = _ids(128)
    found, unpaired = sites(layers)
    return PairCase(
        "bloom/port", reference, candidate, lambda m: m(input_ids=ids), lambda m: m(ids), found, unpaired=unpaired
    )


class MambapyLM(nn.Module):
    """mambapy's language model around its ``Mamba`` backbone, as ``mambapy.lm.LM`` builds it (an embedding, the
    residual blocks, a final RMSNorm, an untied head), with ``LM.forward``'s computation line for line. ``LM``
    itself cannot be imported without ``mamba_ssm``, a CUDA package its Mamba-2 module imports at import time.
    mambapy computes the selective scan's ``A`` and ``D`` in float32 and runs in low precision under autocast
    (as its training does), so the forward autocasts to ``compute_dtype`` (float32: no autocast): a precision the
    model names, which the lifted replay widens like TransformerLens' ``cfg.dtype``."""

    def __init__(self, config: Any, vocab: int, compute_dtype: torch.dtype = torch.float32) -> None:
        from mambapy.mamba import Mamba, RMSNorm

        super().__init__()
        self.compute_dtype = compute_dtype
        self.embedding = nn.Embedding(vocab, config.d_model)
        self.mamba = Mamba(config)
        self.norm_f = RMSNorm(config.d_model, config.rms_norm_eps, config.mup)
        self.lm_head = nn.Linear(config.d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        low = self.compute_dtype != torch.float32
        with torch.autocast(tokens.device.type, dtype=self.compute_dtype, enabled=low):
            return self.lm_head(self.norm_f(self.mamba(self.embedding(tokens))))


MAMBA_MODULES = {"embedding": "backbone.embeddings", "norm_f": "backbone.norm_f", "lm_head": "lm_head"}
"""mambapy's modules outside the blocks and transformers' ``MambaForCausalLM`` counterparts."""
MAMBA_LAYER = {
    "": "",
    "norm": "norm",
    "mixer": "mixer",
    "mixer.in_proj": "mixer.in_proj",
    "mixer.conv1d": "mixer.conv1d",
    "mixer.x_proj": "mixer.x_proj",
    "mixer.dt_proj": "mixer.dt_proj",
    "mixer.out_proj": "mixer.out_proj",
}
"""mambapy's ``mamba.layers.{i}.<key>`` and transformers' ``backbone.layers.{i}.<value>``: the same layout under
other roots (the mixer holds ``A_log`` and ``D`` itself on both sides)."""


def mamba_weights(reference: nn.Module, layers: int) -> dict[str, torch.Tensor]:
    """transformers ``MambaForCausalLM``'s state dict in mambapy's names: each block's norm and mixer (``A_log``,
    ``D``, ``in_proj``, the depthwise ``conv1d`` with its bias, ``x_proj``, ``dt_proj`` with its bias, ``out_proj``),
    the final norm, the embedding, and the head, which transformers ties to the embedding and mambapy keeps apart
    (the same values, copied)."""
    weights = reference.state_dict()
    modules = dict(MAMBA_MODULES)
    for i in range(layers):
        modules |= {
            f"mamba.layers.{i}.{ours}".rstrip("."): f"backbone.layers.{i}.{theirs}".rstrip(".")
            for ours, theirs in MAMBA_LAYER.items()
            if ours
        }
    converted = {}
    for ours, theirs in modules.items():
        for kind in ("weight", "bias"):
            if f"{theirs}.{kind}" in weights:
                converted[f"{ours}.{kind}"] = weights[f"{theirs}.{kind}"].clone()
    for i in range(layers):
        for kind in ("A_log", "D"):
            converted[f"mamba.layers.{i}.mixer.{kind}"] = weights[f"backbone.layers.{i}.mixer.{kind}"].clone()
    converted["lm_head.weight"] = weights.get("lm_head.weight", weights["backbone.embeddings.weight"]).clone()
    return converted


def _called_modules(model: nn.Module, call: Callable[[nn.Module], Any]) -> set[str]:
    """The names of the modules one forward of ``model`` calls (which ones a library's code path calls can change
    between releases: transformers' Mamba calls its conv1d and dt_proj modules in 5.14, later reads their weights)."""
    called: set[str] = set()
    handles = [
        module.register_forward_pre_hook(lambda module, args, name=name: called.add(name))
        for name, module in model.named_modules()
    ]
    try:
        with torch.no_grad():
            call(model)
    finally:
        for handle in handles:
            handle.remove()
    return called


def mamba_mambapy(dtype: torch.dtype = torch.float32, layers: int = 2) -> PairCase:
    """transformers ``MambaForCausalLM`` (the selective scan's reference path: a causal ``F.conv1d`` on the conv
    module's weight, ``dt_proj``'s weight read by a matrix product, a sequential scan in float32, the residual and the
    final norm kept in float32 in a low-precision model: ``residual_in_fp32``) against mambapy's pure-PyTorch Mamba
    (``nn.Conv1d`` called as a module, a parallel scan, every norm and the residual in the model's dtype under
    autocast, an untied head). The converted weights are transformers' own, renamed (:func:`mamba_weights`)."""
    from mambapy.mamba import MambaConfig as MambapyConfig
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(
        vocab_size=256, hidden_size=64, state_size=8, num_hidden_layers=layers, expand=2, conv_kernel=4,
        layer_norm_epsilon=1e-5, use_cache=False,
    )  # fmt: skip
    reference = _seeded_reference(MambaForCausalLM, config)
    mambapy_config = MambapyConfig(
        d_model=64, n_layers=layers, d_state=8, expand_factor=2, d_conv=4, dt_rank=config.time_step_rank,
        rms_norm_eps=1e-5,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):  # every initial weight is replaced below
        candidate = MambapyLM(mambapy_config, config.vocab_size, compute_dtype=dtype).eval()
    missing, unexpected = candidate.load_state_dict(mamba_weights(reference, layers), strict=True)
    assert not missing and not unexpected, (missing, unexpected)
    candidate = candidate.to(dtype)
    ids = _ids(256)
    called = _called_modules(reference, lambda m: m(input_ids=ids))
    sites = {ours: (theirs,) for ours, theirs in MAMBA_MODULES.items()}
    weight_sites, unpaired = {}, []
    for i in range(layers):
        mixer = f"backbone.layers.{i}.mixer"
        for ours, theirs in MAMBA_LAYER.items():
            site, counterpart = f"mamba.layers.{i}.{ours}".rstrip("."), f"backbone.layers.{i}.{theirs}".rstrip(".")
            if ours in ("mixer.conv1d", "mixer.dt_proj"):
                # Newer transformers never call either module: the mixer's own code runs F.conv1d on the conv's weight
                # and multiplies by dt_proj's (mambapy calls its conv1d, and reads dt_proj's weight likewise; 5.14's
                # slow path calls both modules). A wrong weight is named at the module holding its counterpart (when
                # no paired call judges it, the weight ledger names it: Report.weight_origin) or the mixer reading it
                weight_sites[site] = (counterpart, mixer)
                if ours == "mixer.conv1d":  # called on mambapy's side: its output's counterpart, or the mixer's code
                    if counterpart in called:
                        sites[site] = (counterpart,)
                    else:
                        sites[site], unpaired = (mixer,), [*unpaired, site]
            else:
                sites[site] = (counterpart,)
    return PairCase(
        "mamba/mambapy", reference, candidate, lambda m: m(input_ids=ids), lambda m: m(ids), sites,
        unpaired=tuple(unpaired), weight_sites=weight_sites,
    )  # fmt: skip


def transformer_lens_model(config: Any, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    """A HookedTransformer holding weights converted by TransformerLens' own converter, unprocessed (no
    folded norms or centred weights: the same computation as the original)."""
    from transformer_lens import HookedTransformer

    model = HookedTransformer(config)
    model.load_and_process_state_dict(
        state_dict, fold_ln=False, center_writing_weights=False, center_unembed=False, fold_value_biases=False
    )
    return model.eval()


def transformer_lens_config(config: Any, dtype: torch.dtype = torch.float32) -> Any:
    """TransformerLens' configuration of a transformers ``LlamaConfig`` (rotary, RMS norms, gated MLP, GQA)."""
    from transformer_lens import HookedTransformerConfig

    head = config.hidden_size // config.num_attention_heads
    return HookedTransformerConfig(
        n_layers=config.num_hidden_layers, d_model=config.hidden_size, d_head=head,
        n_heads=config.num_attention_heads, n_key_value_heads=config.num_key_value_heads,
        d_mlp=config.intermediate_size, d_vocab=config.vocab_size, n_ctx=64, act_fn="silu",
        normalization_type="RMS", positional_embedding_type="rotary", rotary_dim=head, rotary_adjacent_pairs=False,
        gated_mlp=True, final_rms=True, eps=config.rms_norm_eps, rotary_base=10000, default_prepend_bos=False,
        dtype=dtype, original_architecture="LlamaForCausalLM",
    )  # fmt: skip


PAIRS: dict[str, Callable[..., PairCase]] = {
    "gpt2": gpt2,
    "llama": llama,
    "neox": neox,
    "opt": opt,
    "gptj": gptj,
    "bert": bert,
    "vit": vit_monai,
    "llava": llava_port,
    "whisper": whisper,
    "clip-text": clip_text_mha,
    "x-transformers": xtransformers_llama,
    "esm": esm_fair,
    "mixtral": mixtral_moe,
    "mamba": mamba_mambapy,
    "convnext": convnext,
    "t5": t5_port,
    "resnet-folded": folded_resnet,
    "bloom": bloom,
}
KINDS = ("scale", "offset", "noise")


def seeded(name: str, dtype: torch.dtype, seed: int) -> PairCase:
    """Pair ``name`` built with weights (and token ids) seeded ``seed`` instead of the table's."""
    SEED[0] = seed
    try:
        return PAIRS[name](dtype)
    finally:
        SEED[0] = 0


def reference_side(case: PairCase, base: Path) -> tuple[Trace, Floors | None]:
    """The reference traced into ``base / "reference"``, and its noise floors (estimated into ``base``) when the
    candidate is in low precision."""
    from paritylab.run.parity import estimate_floors, low_precision, trace_model

    reference_trace = trace_model(case.reference, case.reference_call, base / "reference")
    low = low_precision(case.reference, case.candidate)
    floors = None
    if low is not None:
        floors = estimate_floors(case.reference, case.reference_call, reference_trace, low, base, case.cast_inputs)
    return reference_trace, floors


def named_origin(report: Any) -> str | None:
    """The module a run names as where divergence starts, as its headline and ``report.json`` name it: a weight
    no call runs is named at the module holding it (``Report.weight_origin``: a position table, a conv weight its
    mixer's own code reads), else the first divergence's row; None when nothing diverges."""
    return report.origin


@contextmanager
def planted(model: nn.Module, path: str, kind: str, size: float, seed: int = 0) -> Iterator[dict[str, bool]]:
    """An error of relative ``size`` in the output of one module: ``scale`` (×(1+size)), ``offset`` (+size·std)
    or ``noise`` (+size·std·N(0,1), seeded). Yields ``{"changed": ...}``: whether the error changed any value
    at all (in bfloat16, ×1.001 rounds back to every value: such a plant is no error)."""
    effect = {"changed": False}
    target = model.get_submodule(path)
    first = next(model.parameters(), None)  # in the model's own runs; converted or stood in for when lifted

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        value = output[0] if isinstance(output, tuple) else output
        if kind == "scale":
            changed = value * (1 + size)
        else:
            std = value.detach().float().std().to(value.dtype)
            if kind == "offset":
                changed = value + size * std
            else:
                generator = torch.Generator(device=value.device).manual_seed(seed)
                noise = torch.randn(value.shape, generator=generator, device=value.device).to(value.dtype)
                changed = value + size * std * noise
        if module is target and next(model.parameters(), None) is first:  # the model's own run, not a lifted one
            effect["changed"] = effect["changed"] or bool((changed != value).any())
        return (changed, *output[1:]) if isinstance(output, tuple) else changed

    handle = target.register_forward_hook(hook)
    try:
        yield effect
    finally:
        handle.remove()


WEIGHT_KINDS = ("w-scale", "w-element", "w-transpose", "w-halves", "w-rows", "w-bias", "table")
"""Bugs planted in a candidate module's weights (a conversion's bugs), not its output: the largest weight of two or
more dimensions scaled ×1.01, its largest element ×1.01, a square weight transposed, the two halves of its rows
swapped (a fused gate/up or qkv conversion in the wrong order), its first quarter of rows overwritten with the
second (a wrong block), the bias or a norm's scale ×1.01, a floating buffer of the module's subtree ×1.01 (a
table: rotary frequencies, sinusoids)."""
WEIGHT_FACTOR = 1.01


def _bias_like(name: str) -> bool:
    return name in ("bias", "b") or name.startswith("b_")


def tied_sites(case: PairCase, tensor: str, expected: tuple[str, ...]) -> tuple[str, ...]:
    """What a plant in ``tensor`` (a dotted name in the candidate) may be named at: ``expected``, and where the tensor
    is tied (one parameter held by several modules: fair-esm's head reads its token embedding's), the counterparts
    of every other site holding it too; divergence starts at whichever of them runs first on values it changed."""
    owner, _, name = tensor.rpartition(".")
    value = getattr(case.candidate.get_submodule(owner), name, None)
    if not isinstance(value, nn.Parameter):
        return expected
    found = list(expected)
    for site, theirs in (case.sites | case.weight_sites).items():
        module = case.candidate.get_submodule(site)
        if any(held is value for held in module.parameters(recurse=False)):
            found += [path for path in theirs if path not in found]
    return tuple(found)


def weight_target(model: nn.Module, site: str, kind: str) -> str | None:
    """The tensor (its dotted name in ``model``) a weight plant of ``kind`` at module ``site`` changes, or None when
    the module holds nothing that kind changes (that combination is skipped, not counted). ``w-*`` kinds take the
    module's own parameters only; ``table`` any floating buffer in its subtree that ×1.01 changes (the largest)."""
    module = model.get_submodule(site)
    prefix = f"{site}." if site else ""
    if kind == "table":
        tables = [
            (name, buffer)
            for name, buffer in module.named_buffers()
            if buffer.is_floating_point() and not torch.equal(buffer * WEIGHT_FACTOR, buffer)  # -inf, zeros: no
        ]
        best = max(tables, key=lambda item: item[1].numel(), default=None)  # the first of the largest
        return prefix + best[0] if best else None
    own = [(name, p) for name, p in module.named_parameters(recurse=False) if p.is_floating_point()]
    if kind == "w-bias":  # a bias first, else a 1-D weight (a norm's scale); zeros (fresh biases) change nothing
        vectors = [(name, p) for name, p in own if p.dim() == 1 and bool(p.any())]
        vectors.sort(key=lambda item: (not _bias_like(item[0]), -item[1].numel()))
        return prefix + vectors[0][0] if vectors else None
    matrices = [(name, p) for name, p in own if p.dim() >= 2]
    if kind == "w-transpose":
        matrices = [(name, p) for name, p in matrices if p.dim() == 2 and p.shape[0] == p.shape[1]]
    elif kind == "w-halves":
        matrices = [(name, p) for name, p in matrices if p.shape[0] % 2 == 0]
    elif kind == "w-rows":
        matrices = [(name, p) for name, p in matrices if p.shape[0] >= 2]
    elif kind not in ("w-scale", "w-element"):
        raise ValueError(f"unknown weight kind {kind!r}: one of {', '.join(WEIGHT_KINDS)}")
    best = max(matrices, key=lambda item: item[1].numel(), default=None)
    return prefix + best[0] if best else None


def _changed(tensor: torch.Tensor, kind: str, seed: int) -> torch.Tensor:
    """``tensor`` with the plant of ``kind`` applied, in its own dtype (so rounded as the candidate holds it)."""
    if kind in ("w-scale", "w-bias", "table"):
        return tensor * WEIGHT_FACTOR
    changed = tensor.clone()
    if kind == "w-element":  # the seed-th largest magnitude: large enough that ×1.01 survives bf16 rounding
        flat = changed.view(-1)
        at = flat.abs().float().argsort(descending=True, stable=True)[seed % flat.numel()]
        flat[at] = flat[at] * WEIGHT_FACTOR
    elif kind == "w-transpose":
        changed.copy_(tensor.T)
    elif kind == "w-halves":
        half = tensor.shape[0] // 2
        changed = torch.cat([tensor[half:], tensor[:half]])
    elif kind == "w-rows":
        block = max(1, tensor.shape[0] // 4)
        changed[:block] = tensor[block : 2 * block]
    return changed


def _leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in a model's output (tensors, tuples, lists, dicts and ModelOutputs of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in _leaves(item)]
    if isinstance(value, list | tuple):
        return [leaf for item in value for leaf in _leaves(item)]
    return []


@contextmanager
def planted_weight(
    model: nn.Module, site: str, kind: str, seed: int = 0, probe: Callable[[nn.Module], Any] | None = None
) -> Iterator[dict[str, Any]]:
    """A bug of ``kind`` (``WEIGHT_KINDS``) in a weight of module ``site``, changed in place and restored exactly
    afterwards (also when the body raises). Yields ``{"changed": ..., "tensor": ...}``: whether the candidate's
    values change (the tensor's values in its own dtype, and, given ``probe`` (the candidate's call), the model's
    outputs: an embedding row no token reads changes nothing), and the tensor's dotted name. Raises ValueError
    where the module holds nothing ``kind`` changes (``weight_target`` is None: skip the combination)."""
    name = weight_target(model, site, kind)
    if name is None:
        raise ValueError(f"{site} holds no tensor a {kind!r} plant changes; skip it (weight_target is None)")
    owner, _, attribute = name.rpartition(".")
    tensor = getattr(model.get_submodule(owner), attribute)
    original = tensor.detach().clone()
    effect: dict[str, Any] = {"changed": False, "tensor": name}
    try:
        with torch.no_grad():
            before = [leaf.clone() for leaf in _leaves(probe(model))] if probe is not None else None
            tensor.copy_(_changed(original, kind, seed))
            effect["changed"] = not torch.equal(tensor, original)
            if before is not None and effect["changed"]:
                after = _leaves(probe(model))
                effect["changed"] = len(after) != len(before) or any(
                    not torch.equal(a, b) for a, b in zip(after, before, strict=False)
                )
        yield effect
    finally:
        with torch.no_grad():
            tensor.copy_(original)
