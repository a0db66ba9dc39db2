"""rlbench.models' start-up checks: vocabulary and context against the session's lengths, tokenizer and weights
files, dropout. Each failure is a ValueError naming the folder or file, the numbers and the fix."""

from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from transformers import (AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlavaConfig, PretrainedConfig,
                          Qwen2Config)

import rlbench.models as models

TOKENIZER_SIZE = 259  # the built-in tokenizer: <pad>, <eos>, <unk>, then one id per byte


def gpt2_folder(folder: Path, *, vocab_size: int = TOKENIZER_SIZE, n_positions: int = 32, **kwargs) -> Path:
    """A tiny random GPT-2 (learned positions: a longer sequence is an IndexError) and the built-in tokenizer."""
    config = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=32, n_layer=1, n_head=2,
                        bos_token_id=1, eos_token_id=1, pad_token_id=0)
    with models.quiet_transformers():
        GPT2LMHeadModel(config).save_pretrained(folder, **kwargs)
    models.build_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def tokenizer():
    tokenizer = models.build_tokenizer()
    assert len(tokenizer) == TOKENIZER_SIZE
    return tokenizer


# --- vocabulary and context ----------------------------------------------------------------------------


def test_vocabulary_smaller_than_the_tokenizer_is_named(tmp_path, tokenizer):
    folder = gpt2_folder(tmp_path, vocab_size=100)
    model = models.load(folder)[0]
    with pytest.raises(IndexError):  # what the check prevents: the first rollout's forward on a high id
        model(torch.tensor([[TOKENIZER_SIZE - 1]]))
    with pytest.raises(ValueError, match=r"vocabulary of 100 ids .* tokenizer has 259") as error:
        models.check_fits(folder, tokenizer, max_prompt_tokens=8, max_new_tokens=8)
    assert str(folder) in str(error.value) and "resize_token_embeddings" in str(error.value)


def test_context_shorter_than_prompt_plus_completion_is_named(tmp_path, tokenizer):
    folder = gpt2_folder(tmp_path, n_positions=32)
    model = models.load(folder)[0]
    with pytest.raises(IndexError):  # what the check prevents: position 32 does not exist
        model(torch.zeros(1, 33, dtype=torch.long))

    with pytest.raises(ValueError, match=r"max_prompt_tokens=20 \+ max_new_tokens=16 = 36 tokens is over the 32 "
                                         r"positions") as error:
        models.check_fits(folder, tokenizer, max_prompt_tokens=20, max_new_tokens=16)
    message = str(error.value)
    assert str(folder) in message and "n_positions" in message
    assert "lower max_new_tokens to 12 or lower max_prompt_tokens" in message


def test_context_check_uses_the_measured_prompt_without_max_prompt_tokens(tmp_path, tokenizer):
    folder = gpt2_folder(tmp_path, n_positions=32)
    with pytest.raises(ValueError, match=r"the longest prompt \(20 tokens\) \+ max_new_tokens=16") as error:
        models.check_fits(folder, tokenizer, max_prompt_tokens=None, max_new_tokens=16, longest_prompt_tokens=20)
    assert "lower max_new_tokens to 12" in str(error.value) and "long_prompts='drop'" in str(error.value)

    with pytest.raises(ValueError, match="the longest prompt") as error:  # the prompt alone is too long
        models.check_fits(folder, tokenizer, max_prompt_tokens=None, max_new_tokens=1, longest_prompt_tokens=40)
    assert "lower max_new_tokens" not in str(error.value)

    with pytest.raises(ValueError, match="max_new_tokens=33 is over the 32 positions"):  # prompt length unknown
        models.check_fits(folder, tokenizer, max_prompt_tokens=None, max_new_tokens=33)


def test_what_fits_passes(tmp_path, tokenizer, tiny_dir):
    folder = gpt2_folder(tmp_path, n_positions=32)
    models.check_fits(folder, tokenizer, max_prompt_tokens=16, max_new_tokens=16)  # exactly 32
    models.check_fits(folder, tokenizer, max_prompt_tokens=None, max_new_tokens=20, longest_prompt_tokens=12)
    models.check_fits(folder, tokenizer, max_prompt_tokens=None, max_new_tokens=32)
    models.check_fits(folder, tokenizer, max_prompt_tokens=8, max_new_tokens=8, longest_prompt_tokens=100)
    models.check_fits(tiny_dir, tokenizer, max_prompt_tokens=None, max_new_tokens=16, longest_prompt_tokens=6)


def test_multimodal_config_is_checked_on_its_text_config(tmp_path, tokenizer):
    text = Qwen2Config(vocab_size=200, max_position_embeddings=48, hidden_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    LlavaConfig(text_config=text).save_pretrained(tmp_path)  # config.json only: all check_fits reads
    with pytest.raises(ValueError, match="vocabulary of 200 ids"):
        models.check_fits(tmp_path, tokenizer, max_prompt_tokens=8, max_new_tokens=8)
    text.vocab_size = TOKENIZER_SIZE
    LlavaConfig(text_config=text).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="over the 48 positions .* max_position_embeddings"):
        models.check_fits(tmp_path, tokenizer, max_prompt_tokens=40, max_new_tokens=16)


def test_context_length_is_the_tightest_field_or_none():
    assert models.checks.context_length(GPT2Config(n_positions=32)) == ("n_positions", 32)
    assert models.checks.context_length(GPT2Config(n_positions=32, n_ctx=16)) == ("n_ctx", 16)
    assert models.checks.context_length(Qwen2Config(max_position_embeddings=64)) == ("max_position_embeddings", 64)
    assert models.checks.context_length(PretrainedConfig()) is None  # no field: no limit


# --- files ----------------------------------------------------------------------------------------------


def test_folder_without_tokenizer_files_is_named(tmp_path):
    with models.quiet_transformers():
        models.build_tiny_model(0).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no tokenizer files") as error:
        models.load_tokenizer(tmp_path)
    assert str(tmp_path) in str(error.value) and "tokenizer.json" in str(error.value)


def test_truncated_safetensors_is_named(tmp_path):
    weights = gpt2_folder(tmp_path) / "model.safetensors"
    whole = weights.read_bytes()
    for kept in (len(whole) // 2, 4):  # cut in the tensors, then in the header's length
        weights.write_bytes(whole[:kept])
        with pytest.raises(ValueError, match="truncated or corrupt") as error:
            models.load(tmp_path)
        assert str(weights) in str(error.value) and f"{kept} bytes" in str(error.value)
        assert isinstance(error.value.__cause__, SafetensorError)


def test_folder_without_weights_is_named(tmp_path):
    (gpt2_folder(tmp_path) / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weights file") as error:
        models.from_pretrained(AutoModelForCausalLM, tmp_path)
    assert str(tmp_path) in str(error.value) and "model.safetensors" in str(error.value)


def test_sharded_weights_name_the_bad_shard(tmp_path):
    gpt2_folder(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    models.load(tmp_path)  # whole: loads

    shards[-1].write_bytes(shards[-1].read_bytes()[:100])
    with pytest.raises(ValueError, match="truncated or corrupt") as error:
        models.load(tmp_path)
    assert str(shards[-1]) in str(error.value)

    shards[-1].unlink()
    with pytest.raises(ValueError, match="is missing") as error:
        models.load(tmp_path)
    assert str(shards[-1]) in str(error.value) and "model.safetensors.index.json" in str(error.value)


# --- dropout --------------------------------------------------------------------------------------------


def test_dropout_fields_of_gpt2():
    # GPT-2's defaults: 0.1 in attention, embeddings, residuals, and in the (unused by the LM) summary head
    assert models.dropout_fields(GPT2Config()) == {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
                                                   "summary_first_dropout": 0.1}
    off = GPT2Config(resid_pdrop=0.0, embd_pdrop=0, attn_pdrop=0.0, summary_first_dropout=0.0)
    assert models.dropout_fields(off) == {}


def test_dropout_fields_of_the_builtin_and_of_a_sub_config(tiny_dir):
    assert models.dropout_fields(AutoConfig.from_pretrained(tiny_dir, local_files_only=True)) == {}
    text = Qwen2Config(attention_dropout=0.2)
    assert models.dropout_fields(LlavaConfig(text_config=text)) == {"text_config.attention_dropout": 0.2}
