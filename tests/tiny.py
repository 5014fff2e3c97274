"""Tiny random-init transformers models built from configs (no hub, no network)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama_config(**overrides) -> LlamaConfig:
    values = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).eval()


def token_ids(batch: int = 1, length: int = 6, vocab: int = 64, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=generator)


def save_tiny_llava_checkpoint(directory) -> None:
    """A tiny LLaVA checkpoint with a real (word-level) tokenizer and image processor, saved offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    from paritylab.run.references import llava

    model = llava(seed=11)
    config = model.config
    words = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(config.text_config.vocab_size - 5)]
    vocab = {word: index for index, word in enumerate([*words, "<image>"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=r"<image>|\s+|[^\s<]+", behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    size = config.vision_config.image_size
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}),
        tokenizer=fast,
        patch_size=config.vision_config.patch_size,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=1,
        image_token="<image>",
    )
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
