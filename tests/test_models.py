"""rlbench.models: the offline tokenizer, the tiny-arith build and cache, resolve() and load()."""

import concurrent.futures
import json
import threading
import time
import unicodedata
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoTokenizer

import rlbench.models as models
from rlbench.models import build, tiny_arith, warm_start
from rlbench.models.arithmetic_data import answer, arithmetic_split, prompt
from rlbench.models.warm_start import SHIPPED

ASCII_TEXT = st.text(alphabet=[chr(i) for i in range(32, 127)] + ["\n"])  # printable ASCII, newline


@pytest.fixture(scope="session")
def tokenizer():
    return models.build_tokenizer()


@pytest.fixture
def shipped(tiny_dir):
    """tiny-arith (seed 0) as it ships with rlbench (conftest's `tiny_dir`)."""
    path = Path(tiny_dir)
    assert path == SHIPPED / tiny_arith.cache_dir(seed=0).name
    return path


@pytest.fixture
def no_builds(monkeypatch):
    """Any build fails the test (every builder goes through `build_cached`, which holds the build lock to build)."""
    monkeypatch.setattr(warm_start, "_building", lambda final: pytest.fail(f"{final.name} was built"))


# --- tokenizer ---------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None, database=None)
@given(text=ASCII_TEXT)
def test_ascii_text_is_one_token_per_character_and_round_trips(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


@settings(max_examples=100, deadline=None, database=None)
@given(text=st.text())
def test_any_nfc_text_round_trips(tokenizer, text):
    text = unicodedata.normalize("NFC", text)
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens(tokenizer):
    assert tokenizer.encode("12+34=") == [tokenizer.convert_tokens_to_ids(c) for c in "12+34="]
    assert len({tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id}) == 3
    assert tokenizer.bos_token_id is None
    assert tokenizer.chat_template is None
    assert len(tokenizer.encode("a<eos>")) == 6  # text never becomes a special token
    ids = tokenizer.encode("46") + [tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "46"


def test_readable_decode_names_the_bytes_that_form_no_character(tokenizer):
    stray = tokenizer.convert_tokens_to_ids("·")  # the byte 0xB7 (byte-level BPE's symbol for it): no character alone
    ids = tokenizer.encode("10") + [stray] + tokenizer.encode("9")
    assert tokenizer.decode(ids) == "10\ufffd9"
    assert models.readable_decode(tokenizer, ids) == "10<0xB7>9"
    e_acute = tokenizer.encode("é")  # the bytes C3 A9: together the character, one by one two bytes
    assert models.readable_decode(tokenizer, e_acute) == "é"
    assert [models.readable_decode(tokenizer, [i]) for i in e_acute] == ["<0xC3>", "<0xA9>"]
    assert models.readable_decode(tokenizer, tokenizer.encode("12+34=") + [tokenizer.eos_token_id]) == "12+34=<eos>"


def test_left_padding_survives_save_and_load(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded.padding_side == "left"
    batch = loaded(["1+1=", "10+10="], padding=True)["input_ids"]
    pad = loaded.pad_token_id
    assert batch[0][:2] == [pad, pad] and pad not in batch[1]
    text = "x = 12 + 34\n  <eos>!"
    assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.decode(loaded.encode(text)) == text


# --- tiny-arith ----------------------------------------------------------------------------------


def test_builtin_names():
    assert models.names() == ["tiny-arith", "tiny-arith-small", "tiny-mix", "tiny-moe", "tiny-tools", "tiny-vl",
                             "tiny-arith-grpo"]


def test_every_built_in_ships_and_resolves_without_a_build(tmp_path, monkeypatch, no_builds):
    """With an empty cache, each built-in name (seed 0) is the folder that ships with rlbench: nothing trains, and
    the cache stays empty. Another seed is still built on demand (its cache folder)."""
    monkeypatch.setenv("RLBENCH_CACHE", str(tmp_path))
    for name in models.names():
        path = models.resolve(name)
        assert path.parent == SHIPPED and (path / "config.json").is_file() and (path / "model.safetensors").is_file()
        assert models.load_tokenizer(name).eos_token_id is not None
    assert sorted(p.name for p in SHIPPED.iterdir()) == sorted(models.resolve(name).name for name in models.names())
    assert not list(tmp_path.iterdir())
    with pytest.raises(pytest.fail.Exception, match="tiny-arith-v1-seed1 was built"):
        models.resolve("tiny-arith", seed=1)


def test_build_writes_an_ordinary_hf_directory(shipped):
    assert models.resolve("tiny-arith") == shipped
    assert shipped.name == f"tiny-arith-v{tiny_arith.VERSION}-seed0"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (shipped / name).is_file()
    config = json.loads((shipped / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"]


def test_load_builtin(shipped):
    model, tok = models.load("tiny-arith")
    assert not model.training
    assert 0.5e6 <= sum(p.numel() for p in model.parameters()) <= 2e6
    assert next(model.parameters()).dtype == torch.float32
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert (model.config.eos_token_id, model.config.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert tok.padding_side == "left"


@torch.no_grad()
def greedy_heldout_accuracy(folder: Path) -> float:
    """Plain greedy loop (no KV cache, no generate): the answer then EOS, within 8 new tokens."""
    model, tok = models.load(folder)
    heldout = arithmetic_split()[1]
    ids_N_L = tok([prompt(a, b) for a, b in heldout], return_tensors="pt")["input_ids"]  # all 6 long
    prompt_len = ids_N_L.shape[1]
    for _ in range(8):
        next_N = model(ids_N_L).logits[:, -1].argmax(-1)
        ids_N_L = torch.cat([ids_N_L, next_N[:, None]], dim=1)
    targets = [tok.encode(answer(a, b)) + [tok.eos_token_id] for a, b in heldout]
    completions = ids_N_L[:, prompt_len:].tolist()
    return sum(c[: len(t)] == t for c, t in zip(completions, targets)) / len(heldout)


def test_greedy_heldout_accuracy_is_in_band(shipped):
    assert 0.2 <= greedy_heldout_accuracy(shipped) <= 0.4


def test_a_rebuild_by_its_recipe_lands_in_the_band_of_the_shipped_model(shipped, tmp_path, monkeypatch, capsys):
    """`python -m rlbench.models.build tiny-arith` trains the recipe on this machine into the cache: an ordinary
    folder of the shipped one's name and tensors, in the same accuracy band (its bytes are this CPU's own); no temp
    folder is left."""
    monkeypatch.setenv("RLBENCH_CACHE", str(tmp_path))
    build.main(["tiny-arith"])
    again = Path(capsys.readouterr().out.strip())
    assert again == tiny_arith.cache_dir(seed=0) and again.name == shipped.name and again.is_relative_to(tmp_path)
    assert [p.name for p in again.parent.iterdir()] == [again.name]
    first, second = load_file(shipped / "model.safetensors"), load_file(again / "model.safetensors")
    assert {k: v.shape for k, v in first.items()} == {k: v.shape for k, v in second.items()}
    assert 0.2 <= greedy_heldout_accuracy(again) <= 0.4


def test_resolve_reuses_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLBENCH_CACHE", str(tmp_path))
    built = tiny_arith.cache_dir(seed=3)
    built.mkdir(parents=True)
    (built / "config.json").write_text("{}")
    monkeypatch.setattr(tiny_arith, "train_tiny_arith", pytest.fail)
    assert models.resolve("tiny-arith", seed=3) == built


def test_a_second_builder_waits_for_the_first_instead_of_training_again(tmp_path, monkeypatch, capfd):
    """Two resolves of a missing model at once (two test workers, two notebooks): one trains, the other waits on the
    build lock (saying so) and returns the first's directory."""
    monkeypatch.setenv("RLBENCH_CACHE", str(tmp_path))
    started, release, trained = threading.Event(), threading.Event(), []

    def train(seed):
        trained.append(seed)
        started.set()
        assert release.wait(60)
        return models.build_tiny_model(seed), models.build_tokenizer()

    monkeypatch.setattr(tiny_arith, "train_tiny_arith", train)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(models.resolve, "tiny-arith", seed=1)
        assert started.wait(60)
        second = pool.submit(models.resolve, "tiny-arith", seed=1)
        deadline = time.monotonic() + 60
        while "waiting for another process building" not in capfd.readouterr().err:
            assert time.monotonic() < deadline and not second.done(), "the second resolve did not wait on the lock"
            time.sleep(0.05)
        release.set()
        assert first.result() == second.result() == tiny_arith.cache_dir(seed=1)
    assert trained == [1]


def test_builder_that_loses_the_race_uses_the_winners_directory(shipped, tmp_path, monkeypatch):
    monkeypatch.setenv("RLBENCH_CACHE", str(tmp_path))
    final = tiny_arith.cache_dir(seed=1)

    def train_while_another_process_finishes_first(seed):
        final.mkdir(parents=True)
        (final / "config.json").write_text((shipped / "config.json").read_text())
        return models.build_tiny_model(seed), models.build_tokenizer()

    monkeypatch.setattr(tiny_arith, "train_tiny_arith", train_while_another_process_finishes_first)
    assert models.resolve("tiny-arith", seed=1) == final
    assert [p.name for p in final.iterdir()] == ["config.json"]  # the winner's, untouched
    assert [p.name for p in final.parent.iterdir()] == [final.name]


def test_warm_start_rolls_back_a_check_that_overshoots(monkeypatch):
    tok, model = models.build_tokenizer(), models.build_tiny_model(0)
    scripted = iter([0.1, 0.5, 0.1, 0.3])  # checks at steps 2, 4 (overshoot: back to step 2), 5, 6
    monkeypatch.setattr(tiny_arith, "greedy_accuracy", lambda *args: next(scripted))
    monkeypatch.setattr(tiny_arith, "EVAL_EVERY", 2)
    assert tiny_arith.warm_start(model, tok, seed=0) == (6, 0.3)

    monkeypatch.setattr(tiny_arith, "EVAL_EVERY", 1)
    monkeypatch.setattr(tiny_arith, "greedy_accuracy", lambda *args: 0.5)
    with pytest.raises(RuntimeError, match="did not stop"):
        tiny_arith.warm_start(model, tok, seed=0)


def test_untrained_model_depends_only_on_the_seed():
    rng_before = torch.get_rng_state()
    first, second, other = (models.build_tiny_model(s).state_dict() for s in (3, 3, 4))
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


# --- resolve / load of local directories and errors --------------------------------------------------


def test_load_local_hf_directory(tmp_path):
    models.build_tiny_model(0).save_pretrained(tmp_path)
    models.build_tokenizer().save_pretrained(tmp_path)
    assert models.resolve(str(tmp_path)) == tmp_path
    model, tok = models.load(tmp_path)
    assert not model.training and tok.eos_token_id is not None


def test_unknown_name_lists_builtins():
    with pytest.raises(ValueError, match="tiny-arith") as error:
        models.load("tiny-arithmetic")
    assert "does not exist" in str(error.value)


def test_directory_without_config_is_named(tmp_path):
    with pytest.raises(ValueError, match="config.json") as error:
        models.resolve(tmp_path)
    assert str(tmp_path) in str(error.value)


def test_tokenizer_without_pad_token_is_rejected(tmp_path):
    models.build_tiny_model(0).save_pretrained(tmp_path)
    tok = models.build_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="pad") as error:
        models.load(tmp_path)
    assert str(tmp_path) in str(error.value)
