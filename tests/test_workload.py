"""The workload: forwards of any shape fed from signatures, through config alone, with one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from torch import nn

from paritylab.cli.app import compose
from paritylab.run.errors import ConfigError
from paritylab.run.inputs import prompt_inputs
from paritylab.run.runner import run
from paritylab.run.workload import infer_call, synthetic_inputs
from paritylab.tracing.tracefile import Trace
from tests.helpers import migrated_store
from tests.pairs import transformer_lens_available

IDS = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "attention_mask": torch.ones(1, 4, dtype=torch.long)}


class Positional(nn.Module):
    def forward(self, input, return_type="logits"):  # TransformerLens-style
        return input


class Idx(nn.Module):
    def forward(self, idx, input_pos=None):  # litgpt-style
        return idx


class Vision(nn.Module):
    def forward(self, x):  # timm / open_clip-style
        return x


class Strict(nn.Module):
    def forward(self, tokens, *, positions):
        return tokens


def test_signatures_decide_how_inputs_reach_a_forward():
    assert infer_call(Positional(), IDS, "candidate").kwargs == {"input": "input_ids"}
    spec = infer_call(Idx(), IDS, "candidate")
    assert spec.kwargs == {"idx": "input_ids"} and spec.dropped == ("attention_mask",)
    pixels = {"pixel_values": torch.zeros(1, 3, 4, 4)}
    assert infer_call(Vision(), pixels, "candidate").kwargs == {"x": "pixel_values"}
    assert torch.equal(infer_call(Idx(), IDS, "candidate").bind(IDS)(Idx()), IDS["input_ids"])


def test_a_mapping_that_does_not_fit_is_one_line_naming_the_parameter_and_the_fix():
    with pytest.raises(ConfigError) as error:
        infer_call(Strict(), IDS, "candidate")
    assert "Strict.forward needs 'positions'" in str(error.value) and "candidate.call.kwargs.positions" in str(
        error.value
    )
    with pytest.raises(ConfigError, match=r"candidate.call.kwargs.tokenz: Idx.forward has no parameter 'tokenz'"):
        infer_call(Idx(), IDS, "candidate", kwargs={"tokenz": "input_ids"})
    with pytest.raises(ConfigError, match=r"names input 'pixels', but the inputs are: input_ids, attention_mask"):
        infer_call(Idx(), IDS, "candidate", args=["pixels"])
    assert "\n" not in str(error.value)


def test_synthetic_inputs_follow_the_forward_text_and_vision_only():
    from paritylab.run.references import clip_vision, llama

    generator = torch.Generator().manual_seed(0)
    vision = synthetic_inputs(clip_vision(), 2, 5, generator)
    assert list(vision) == ["pixel_values"] and vision["pixel_values"].shape == (2, 3, 28, 28)
    text = synthetic_inputs(llama(), 2, 5, generator)
    assert text["input_ids"].shape == (2, 5) and int(text["input_ids"].max()) < 128
    assert torch.equal(text["attention_mask"], torch.ones(2, 5, dtype=torch.long))


def test_synthetic_inputs_for_audio_models_raw_waveform_and_features(tmp_path):
    """Audio: raw audio for a wav2vec2-style forward, log-mel features sized by the config for a Whisper-style
    encoder; read from the forward alone, and a planted bug in the audio pair is named through the pipeline."""
    from transformers import Wav2Vec2Config, Wav2Vec2Model, WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    from paritylab.run.parity import check
    from tests.helpers import planted

    torch.manual_seed(0)
    config = Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
    )  # fmt: skip
    reference, candidate = Wav2Vec2Model(config).eval(), Wav2Vec2Model(config).eval()
    candidate.load_state_dict(reference.state_dict())
    generator = torch.Generator().manual_seed(0)
    waveform = synthetic_inputs(reference, 2, 5, generator)
    assert list(waveform) == ["input_values"] and waveform["input_values"].shape == (2, 2000)
    spec = infer_call(reference, waveform, "model", None, None, [])
    assert spec.describe() == "forward(input_values=input_values)"
    plant = "encoder.layers.1.feed_forward.output_dense"
    with planted(candidate, plant, scale=1.01):
        result = check(reference, candidate, tmp_path, reference_call=spec.bind(waveform))
    assert result.verdict == "fail" and result.report.first_divergence.path == plant
    whisper = WhisperConfig(
        d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, num_mel_bins=8,
        max_source_positions=6, vocab_size=64, decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    )  # fmt: skip
    encoder = WhisperEncoder(whisper).eval()
    features = synthetic_inputs(encoder, 2, 5, generator)
    assert list(features) == ["input_features"] and features["input_features"].shape == (2, 8, 12)
    out = infer_call(encoder, features, "model", None, None, []).bind(features)(encoder)
    assert out.last_hidden_state.shape == (2, 6, 16)


def _run(tmp_path: Path, *overrides: str, candidates: dict[str, str] | None = None):
    """Run in process; ``candidates`` are user candidate configs (name -> ``_target_``) in a --config-dir."""
    uri = migrated_store(tmp_path / "mlflow.db")
    config_dir = None
    if candidates:
        config_dir = tmp_path / "my_conf"
        (config_dir / "candidate").mkdir(parents=True)
        for name, target in candidates.items():
            text = f"name: {name}\nkind: target\nbuild:\n  _target_: {target}\n"
            (config_dir / "candidate" / f"{name}.yaml").write_text(text)
    cfg = compose([f"tracking.uri={uri}", *overrides], str(config_dir) if config_dir else None)
    return run(cfg, tmp_path / "run", echo=lambda _: None), uri


def test_vision_only_pair_through_config_alone(tmp_path):
    result, uri = _run(tmp_path, "model=clip_vision", "candidate=sdpa")
    assert result.exit_code == 0 and result.report.verdict == "pass"
    assert result.report.rows[0].reference.shape == [1, 5, 32]  # last_hidden_state of 4 patches + class token
    run_data = MlflowClient(uri).get_run(result.run_id).data
    assert run_data.tags["paritylab.verdict"] == "pass"


def test_idx_candidate_through_config_alone_keeps_its_own_module_paths(tmp_path):
    result, _ = _run(tmp_path, "model=llama", "candidate=idx", candidates={"idx": "tests.candidates.idx_llama"})
    assert result.exit_code == 0, result.error
    assert any(note == "candidate: forward(idx=input_ids); left out: attention_mask" for note in result.notes)
    keys = {row.candidate.key for row in result.report.rows if row.candidate}
    assert "model.layers.0.self_attn#0" in keys  # no adapter prefix


@pytest.mark.skipif(transformer_lens_available() is not None, reason=transformer_lens_available() or "")
def test_transformer_lens_candidate_with_a_positional_input_through_config_alone(tmp_path):
    result, _ = _run(
        tmp_path,
        "model=llama",
        "+model.build.kv_heads=2",
        "candidate=lens",
        candidates={"lens": "tests.candidates.transformer_lens_llama"},
    )
    assert result.exit_code == 0, (result.error, [row.path for row in result.report.failing])
    assert "candidate: forward(attention_mask=attention_mask, input=input_ids)" in result.notes
    pairs = {p.reference.split("#")[0]: p.candidate.split("#")[0] for p in result.report.alignment.pairs}
    assert pairs["model.layers.1.self_attn"] == "blocks.1.attn" and pairs["lm_head"] == "unembed"


def test_a_candidate_call_that_does_not_fit_fails_before_its_forward(tmp_path):
    result, _ = _run(
        tmp_path,
        "model=llama",
        "candidate=idx",
        "+candidate.call.kwargs.tokens=input_ids",
        candidates={"idx": "tests.candidates.idx_llama"},
    )
    assert result.exit_code == 2
    assert "candidate.call.kwargs.tokens: IdxLlama.forward has no parameter 'tokens'" in result.error
    assert not (result.directory / "candidate" / "trace.json").exists()


def test_the_call_says_which_returned_value_is_the_output(tmp_path):
    """A forward returning ``(aux, logits)`` with logits no module made: without a choice the root compares
    the first tensor (the aux summary) and fails; ``candidate.call.output=1`` with ``model.call.output=logits``
    compares logits with logits and passes; a choice the return value does not hold is one line."""
    aux = {"aux": "tests.candidates.aux_first_llama"}
    common = ["tracking=off", "model=llama", "candidate=aux", "compare.replay=false"]
    unchosen, _ = _run(tmp_path / "a", *common, candidates=aux)
    root = unchosen.report.rows[0]
    assert unchosen.exit_code == 1 and root.path == "" and root.verdict == "fail"
    assert root.reference.slot == "outputs.logits" and root.candidate.slot == "outputs.0"
    chosen, _ = _run(tmp_path / "b", *common, "model.call.output=logits", "candidate.call.output=1", candidates=aux)
    root = chosen.report.rows[0]
    assert chosen.exit_code == 0, [row.path for row in chosen.report.failing]
    assert (root.reference.slot, root.candidate.slot) == ("outputs.logits", "outputs.1") and root.verdict == "pass"
    assert any(note.startswith("candidate: forward(input_ids=input_ids") and "[1]" in note for note in chosen.notes)
    wrong, _ = _run(tmp_path / "c", *common, "candidate.call.output=logits", candidates=aux)
    assert wrong.exit_code == 2
    assert wrong.error == (
        "candidate.call.output='logits': AuxFirstLlama.forward returned a tuple of 2 (indices 0..1); "
        "choose one of those, or null"
    )


def test_select_output_reads_keys_attributes_and_indices():
    from transformers.modeling_outputs import CausalLMOutput

    from paritylab.run.workload import output_choice, select_output

    logits = torch.ones(1, 2, 3)
    assert select_output(CausalLMOutput(logits=logits), "logits") is logits
    assert select_output(CausalLMOutput(logits=logits), 0) is logits
    assert select_output((None, logits), 1) is logits and select_output(logits, None) is logits
    assert output_choice("1", "candidate") == 1 and output_choice("logits", "model") == "logits"
    with pytest.raises(ConfigError, match=r"output 'scores' is not in what the forward returned \(keys logits\)"):
        select_output(CausalLMOutput(logits=logits), "scores")
    with pytest.raises(ConfigError, match=r"candidate\.call\.output=1\.5"):
        output_choice(1.5, "candidate")


def _word_tokenizer(directory: Path) -> str:
    """A real tokenizer saved locally (no hub): a word-level vocabulary through ``tokenizers``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "what", "is", "shown", "in", "this", "image", "a", "cat"]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(directory)
    return str(directory)


def test_a_jsonl_of_prompts_feeds_both_sides_as_one_padded_batch(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "what is shown in this image"}\n\n{"input_ids": [8, 9, 3, 2]}\n')
    tokenizer = _word_tokenizer(tmp_path / "tokenizer")
    result, _ = _run(
        tmp_path, "tracking=off", "model=llama", "candidate=sdpa", "inputs=prompts", f"inputs.path={prompts}",
        f"inputs.tokenizer={tokenizer}", "compare.replay=false",
    )  # fmt: skip
    assert result.exit_code == 0, result.error
    ids = Trace.load(result.directory / "reference").call("#0").inputs["items"]["kwargs"]["items"]["input_ids"]
    assert ids["shape"] == [2, 6]  # two prompts, the longer one's 6 words; the other right-padded
    inputs = prompt_inputs(str(prompts), tokenizer, nn.Linear(1, 1))
    assert inputs["input_ids"].tolist() == [[2, 3, 4, 5, 6, 7], [8, 9, 3, 2, 0, 0]]
    assert inputs["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"prompt": "what is this"}\n', "holds text prompts but no tokenizer is known: set inputs.tokenizer="),
        ('{"input_ids": [1, 99999]}\n', "token id 99999 is outside the model's vocabulary"),
        ('{"question": "?"}\n', 'line 1: expected {"prompt": "<text>"} or {"input_ids": [<token ids>]}'),
        ("not json\n", "line 1, is not JSON"),
    ],
)
def test_bad_prompt_files_are_one_line(tmp_path, content, expected):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    overrides = ["tracking=off", "model=llama", "candidate=sdpa", "inputs=prompts", f"inputs.path={prompts}"]
    result, _ = _run(tmp_path, *overrides)
    assert result.exit_code == 2 and expected in result.error and "\n" not in result.error


def test_a_missing_input_file_fails_before_any_model_is_built(tmp_path):
    said: list[str] = []
    result = run(compose(["tracking=off", "inputs=prompts", "inputs.path=nowhere.jsonl"]), tmp_path, echo=said.append)
    expected = 'inputs=prompts needs inputs.path=<a JSONL file of {"prompt": ...} lines>; got ' + repr("nowhere.jsonl")
    assert result.exit_code == 2 and said == [f"paritylab: {expected}"]


def _encoder_decoders():
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        T5Config,
        T5ForConditionalGeneration,
        WhisperConfig,
        WhisperForConditionalGeneration,
    )

    tokens = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "decoder_start_token_id": 3}
    layers = {"encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2, "decoder_attention_heads": 2,
              "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "d_model": 16, "vocab_size": 64}  # fmt: skip
    return {
        "whisper": (WhisperForConditionalGeneration, WhisperConfig(num_mel_bins=8, max_source_positions=8,
                                                                   max_target_positions=16, **layers, **tokens), 3),
        "t5": (T5ForConditionalGeneration, T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                                    num_heads=2), 0),
        "bart": (BartForConditionalGeneration, BartConfig(max_position_embeddings=32, **layers, **tokens), 3),
    }  # fmt: skip


@pytest.mark.parametrize("family", ["whisper", "t5", "bart"])
def test_encoder_decoders_get_decoder_inputs_from_their_config(family, tmp_path):
    """An encoder-decoder's synthetic workload feeds its decoder too: ids that start with the config's decoder
    start token, and a mask; the model and a copy of it then agree through paritylab's own call."""
    import copy

    import paritylab
    from paritylab.run.workload import infer_call, synthetic_inputs

    model_class, config, start = _encoder_decoders()[family]
    torch.manual_seed(0)
    model = model_class(config).eval()
    inputs = synthetic_inputs(model, 1, 8, torch.Generator().manual_seed(0))
    decoder = inputs["decoder_input_ids"]
    assert decoder.shape == (1, 4) and int(decoder[0, 0]) == start and int(decoder.max()) < 64
    assert torch.equal(inputs["decoder_attention_mask"], torch.ones_like(decoder))
    call = infer_call(model, inputs, "model").bind(inputs)
    result = paritylab.check(model, copy.deepcopy(model), tmp_path, reference_call=call, noise_floor="off")
    assert result.verdict == "pass", result.report.summary()
    assert any(row.path.startswith(("model.decoder", "decoder")) and row.status == "compared"
               for row in result.report.rows)  # fmt: skip
