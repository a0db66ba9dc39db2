"""Images in prompts: the "shapes" task's pictures and answers, a prompt's image tokens and pixels (`Vision`), and the
tiny-vl model, warm-started so that it answers by looking."""

import copy
import io

import numpy as np
import pytest
import torch
from floats import assert_close
from PIL import Image
from transformers import AutoModelForImageTextToText

import rlbench as rl
from rlbench.batch import left_pad
from rlbench.algorithms import token_logp
from rlbench.models import tiny_vl
from rlbench.policy.forward import packing_pays, response_outputs
from rlbench.models.vision import Vision, forward_inputs, load_image
from rlbench.models.shapes_data import CELLS, COLOURS, GRID, blind_accuracy
from rlbench.tasks.shapes import Shapes


@pytest.fixture(scope="module")
def task():
    return Shapes()


@pytest.fixture(scope="module")
def vl():
    """(model, tokenizer, Vision) of the built tiny-vl."""
    folder = tiny_vl.ensure_built(0)
    tokenizer = rl.models.load_tokenizer(folder)
    return AutoModelForImageTextToText.from_pretrained(folder).eval(), tokenizer, Vision.of(folder, tokenizer)


# ------------------------------------------------------------------------------------- the task
def test_each_answer_is_what_the_picture_shows(task):
    for example in task.train[:300] + task.test:
        shapes, answer, prompt = example["shapes"], example["answer"], example["prompt"]
        image = example["images"][0]
        assert image.size == (64, 64) and prompt.startswith("<image>")
        for s in shapes:  # the shape's colour is at its cell's centre (every kind covers it)
            row, column = divmod(s["cell"], GRID)
            assert image.getpixel((int((column + 0.5) * 32), int((row + 0.5) * 32))) == COLOURS[s["colour"]]
        if prompt == "<image>how many?=":
            assert answer == str(len(shapes))
        elif prompt.startswith("<image>colour of "):
            kind = prompt.removeprefix("<image>colour of ").removesuffix("?=")
            assert [s["colour"] for s in shapes if s["kind"] == kind] == [answer]
        else:
            cell = CELLS.index(prompt.removeprefix("<image>").removesuffix("?="))
            assert [f"{s['colour']} {s['kind']}" for s in shapes if s["cell"] == cell] == [answer]


def test_a_text_model_refuses_images_it_would_train_as_text(task, tmp_path):
    """Images given to a text-only model (a built-in task, or verl's parquet with its `images` column of {bytes, path}
    records) are refused naming the row, never trained as the prompt's text alone."""
    with pytest.raises(ValueError, match="train example 0 of task 'shapes': it has 1 image.s. .* text-only"):
        rl.Session(model="tiny-arith", task=task, cluster="inline", log_dir=None)
    buffer = io.BytesIO()
    task.test[0]["images"][0].save(buffer, format="PNG")
    row = {"data_source": "shapes", "prompt": [{"role": "user", "content": "<image>how many?="}],
           "images": [{"bytes": buffer.getvalue(), "path": None}], "reward_model": {"ground_truth": "1"}}
    path = rl.tasks.write_rows([row, dict(row, images=[])], tmp_path / "vl.parquet")
    data = rl.tasks.from_parquet(path, test=path, reward=lambda completion, example: 0.0)
    with pytest.raises(ValueError, match="example .* of task .*: it has 1 image.s. .* text-only"):
        rl.Session(model="tiny-arith", task=data, cluster="inline", log_dir=None)


def test_the_task_is_seeded_and_needs_the_picture(task):
    again, other = Shapes(), Shapes(seed=1)
    assert [e["answer"] for e in again.test] == [e["answer"] for e in task.test]
    assert again.test[7]["images"][0].tobytes() == task.test[7]["images"][0].tobytes()
    assert [e["shapes"] for e in other.test] != [e["shapes"] for e in task.test]
    assert blind_accuracy(task.train, task.test) == 0.145  # the docstring's figure
    assert max(len(e["shapes"]) for e in Shapes(max_shapes=2).train) == 2
    with pytest.raises(ValueError, match="max_shapes must be in 1..4"):
        Shapes(max_shapes=5)


# ----------------------------------------------------------------------------- image prompts
def test_an_image_mark_becomes_the_models_image_tokens(vl, task):
    _, tokenizer, vision = vl
    ids, pixels = vision.encode(tokenizer, "<image>how many?=", task.test[0]["images"])
    start, pad, end = (vision.start_id, vision.image_id, vision.end_id)
    assert ids == [start] + [pad] * 16 + [end] + tokenizer.encode("how many?=")  # 64x64 px: 8x8 patches, merged 2x2
    assert pixels["image_grid_thw"].tolist() == [[1, 8, 8]] and pixels["pixel_values"].shape == (64, 3 * 2 * 8 * 8)
    # without a mark the image goes first; typed as text, the image tokens stay text
    assert vision.encode(tokenizer, "how many?=", task.test[0]["images"])[0] == ids
    typed, _ = vision.encode(tokenizer, "<|image_pad|>", [])
    assert pad not in typed and tokenizer.decode(typed) == "<|image_pad|>"
    # a tokenizer that reads special tokens in text (Qwen's own does) would make typed markup an image slot: refused
    parsing = copy.deepcopy(tokenizer)
    parsing.split_special_tokens = False
    with pytest.raises(ValueError, match=r"holds <\|image_pad\|> as typed text.*mark an image's place with <image>"):
        vision.encode(parsing, "<image>what is <|image_pad|>?=", task.test[0]["images"])


@pytest.mark.parametrize("text, images, message", [
    ("<image><image>how many?=", 1, "the prompt has 2 <image> mark.s. and 1 image"),
    ("<image>how many?=", 2, "the prompt has 1 <image> mark.s. and 2 image"),
    ("<image>how many?=", 0, "the prompt has 1 <image> mark.s. and 0 image")])
def test_marks_and_images_must_pair_up(vl, task, text, images, message):
    _, tokenizer, vision = vl
    with pytest.raises(ValueError, match=message):
        vision.encode(tokenizer, text, [task.test[0]["images"][0]] * images)


def test_images_load_from_paths_and_parquet_records(tmp_path, task):
    image = task.test[0]["images"][0]
    image.save(tmp_path / "a.png")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    for source in (tmp_path / "a.png", str(tmp_path / "a.png"), {"bytes": buffer.getvalue(), "path": None},
                   {"bytes": None, "path": str(tmp_path / "a.png")}):
        assert load_image(source).tobytes() == image.tobytes()
    with pytest.raises(FileNotFoundError, match="missing.png"):
        load_image(tmp_path / "missing.png")
    (tmp_path / "bad.png").write_bytes(b"not a picture")
    with pytest.raises(OSError, match="bad.png"):
        load_image(tmp_path / "bad.png")
    with pytest.raises(TypeError, match="not ndarray"):
        load_image(torch.zeros(3, 4, 4).numpy())


def test_a_text_model_has_no_vision(tiny_dir):
    assert Vision.of(tiny_dir, rl.models.load_tokenizer(tiny_dir)) is None


def test_a_padded_batch_gives_each_rows_own_logits(vl, task):
    """Rows of different lengths, left-padded, with the 3-D positions of `forward_inputs`: each row's logits are
    those of the row alone."""
    model, tokenizer, vision = vl
    examples = [task.test[0], task.test[3], task.test[5]]
    encoded = [vision.encode(tokenizer, e["prompt"] + e["answer"], e["images"]) for e in examples]
    assert len({len(ids) for ids, _ in encoded}) > 1
    ids_B_T, mask_B_T = left_pad([ids for ids, _ in encoded], tokenizer.pad_token_id)
    with torch.no_grad():
        batch_B_T_V = model(input_ids=ids_B_T, attention_mask=mask_B_T,
                            **forward_inputs(model, ids_B_T, mask_B_T, [p for _, p in encoded])).logits
        for b, (ids, pixels) in enumerate(encoded):
            one_1_T = torch.tensor([ids])
            alone = model(input_ids=one_1_T, attention_mask=torch.ones_like(one_1_T),
                          **forward_inputs(model, one_1_T, torch.ones_like(one_1_T), [pixels])).logits[0]
            assert_close(batch_B_T_V[b, -len(ids):], alone, atol=1e-5)  # float32 sums in another order


# ---------------------------------------------------------------------------------- the model
def test_tiny_vl_answers_by_looking(vl, task):
    """Warm-started into [STOP_AT, OVERSHOOT] on held-out questions, above answering blind (0.145); with the
    pictures blanked it does worse: what it gets right, it gets by looking."""
    model, tokenizer, vision = vl
    accuracy = tiny_vl.greedy_accuracy(model, tokenizer, vision, task.test)
    assert tiny_vl.STOP_AT <= accuracy <= tiny_vl.OVERSHOOT
    blank = [dict(e, images=[Image.new("RGB", (64, 64), "white")]) for e in task.test]
    assert tiny_vl.greedy_accuracy(model, tokenizer, vision, blank) < accuracy - 0.1


# ------------------------------------------------------------------------------- in a session
SMALL = dict(model="tiny-vl", cluster="inline", prompts_per_step=4, samples_per_prompt=4, threads=1, seed=0, log_dir=None)


def test_a_step_on_image_prompts_trains_on_what_the_sampler_saw(task, tmp_path):
    """The rollout's table keeps each row's pictures (shown as thumbnails) and their pixels; the trainer's forward on
    them gives the sampler's log-probs (the text bound, 1e-5), so the on-policy ratio is 1; `export` writes a folder
    that takes images."""
    with rl.Session(task=task, **SMALL) as s:
        batch = s.rollout()
        assert [len(images) for images in batch["images"]] == [1] * 16
        assert batch["images"][0][0].tobytes() == batch["example"][0]["images"][0].tobytes()
        assert batch["image_inputs"][0]["image_grid_thw"].tolist() == [[1, 8, 8]]
        assert batch._repr_html_().count('<img src="data:image/png;base64,') == 16
        mask = batch["response_mask"].bool()
        assert_close(s.workers.policy.log_probs(batch)[mask], batch["sampler_logp"][mask], atol=1e-5)
        row = s.step()
        assert abs(row["sampler_kl"]) < 1e-5 and row["clip_frac"] == 0.0
        exported = s.export(tmp_path / "exported")  # a model folder that takes images, as the one it came from
        weights = s.policy.state_dict()
    assert Vision.of(exported, rl.models.load_tokenizer(exported)) is not None
    again = AutoModelForImageTextToText.from_pretrained(exported).state_dict()
    assert all(torch.equal(again[name], tensor) for name, tensor in weights.items())


def test_the_packed_layout_runs_each_picture_once_and_gives_the_per_sample_numbers(vl, task):
    """The trainer's packed layout on image prompts (each group's prompt and pictures once, 3-D positions for its
    responses) gives the per-sample layout's log-probs within 1e-5, also where two groups ask the same question of
    different pictures (the same prompt tokens: the pictures tell them apart) and beside prompts without a picture;
    "auto" packs such batches."""
    model, tokenizer, vision = vl
    same_question = [dict(e, prompt="<image>how many?=") for e in task.train[:3]]
    data = rl.tasks.DataTask(train=same_question, test=same_question, name="vl",
                             reward=lambda completion, example: 0.0)
    with_and_without = [task.train[0], {"prompt": "how many?=", "answer": "1"}, task.train[1]]  # text rows too
    mixed = rl.tasks.DataTask(train=with_and_without, test=with_and_without, name="mixed",
                              reward=lambda completion, example: 0.0)
    for source in (task, data, mixed):
        with rl.Session(task=source, **SMALL | {"prompts_per_step": 3}) as s:
            batch = s.rollout()
        mask = batch["response_mask"].bool()
        logp = {layout: token_logp(response_outputs(model, batch, layout), batch["response_ids"])[mask]
                for layout in ("per_sample", "packed")}
        assert_close(logp["packed"], logp["per_sample"], atol=1e-5)
        assert_close(logp["packed"], batch["sampler_logp"][mask], atol=1e-5)
        assert packing_pays(model, batch)


def test_lora_adapts_the_language_model_and_the_sampler_merges_it(task):
    """Under LoRA only the language model's layers get adapters (the vision tower none), and after steps that moved
    the adapter the HF sampler (a vision-language model decodes through transformers' forward, its adapter merged
    into the weights) still draws what the trainer computes, within the text bound."""
    with rl.Session(task=task, **SMALL | {"lora": rl.LoRA(rank=4, alpha=8), "lr": 1e-2}) as s:
        adapter = {name: tensor.clone() for name, tensor in s.policy.state_dict().items()}
        assert adapter and all(".language_model.layers." in name for name in adapter), sorted(adapter)[:4]
        s.run(2, progress=False)
        assert any(not torch.equal(s.policy.state_dict()[n], adapter[n]) for n in adapter)  # it moved
        batch = s.rollout()
        mask = batch["response_mask"].bool()
        assert_close(s.workers.policy.log_probs(batch)[mask], batch["sampler_logp"][mask], atol=1e-5)


def test_freeze_vision_trains_the_language_model_only(task, tiny_dir):
    """`freeze_vision=True`: the vision tower's weights (its merger too) are as loaded after steps, the language
    model's moved, and the sampler draws from the trained weights; on a text model it is refused, naming it."""
    with rl.Session(task=task, **SMALL | {"freeze_vision": True, "lr": 1e-2}) as s:
        before = {name: tensor.clone() for name, tensor in s.policy.state_dict().items()}
        s.run(2, progress=False)
        after = s.policy.state_dict()
        moved = {name for name in before if not torch.equal(before[name], after[name])}
        assert moved and all(".visual." not in name for name in moved), sorted(moved)[:4]
        assert any(name.startswith("model.language_model.") for name in moved)
        batch = s.rollout()
        mask = batch["response_mask"].bool()
        assert_close(s.workers.policy.log_probs(batch)[mask], batch["sampler_logp"][mask], atol=1e-5)
    with pytest.raises(ValueError, match="freeze_vision=True, but model .* has no vision tower"):
        rl.Session(**SMALL | {"model": tiny_dir, "freeze_vision": True})


def test_bad_images_are_named_before_or_when_they_are_used(task, tmp_path, tiny_dir):
    """A text-only model given images, more images than marks, a missing file, a file that is no picture: refused at
    the start naming the row; a file spoilt after the start: at the rollout that reads it, naming the example."""
    picture = tmp_path / "a.png"
    task.test[0]["images"][0].save(picture)
    (tmp_path / "bad.png").write_bytes(b"not a picture")
    row = {"prompt": "<image>how many?=", "answer": "1", "images": [str(picture)]}
    cases = [(dict(row, images=[str(picture)] * 2, prompt="<image>how many?="), "train example 1 .* has 1 <image> "
              "mark.s. and 2 image"),
             (dict(row, images=[str(tmp_path / "gone.png")]), "train example 1 .* its image '.*gone.png' is not a file"),
             (dict(row, images=[str(tmp_path / "bad.png")]), "train example 1 .* its image '.*bad.png' cannot be read")]
    for bad, message in cases:
        data = rl.tasks.DataTask(train=[row, bad], test=[row], reward=lambda completion, example: 0.0, name="vl")
        with pytest.raises(ValueError, match=message):
            rl.Session(task=data, **SMALL)
    with pytest.raises(ValueError, match="train example 0 of task 'shapes': it has 1 image.s. .* text-only"):
        rl.Session(task=task, **SMALL | {"model": tiny_dir})
    spoilt = tmp_path / "spoilt.png"
    task.test[1]["images"][0].save(spoilt)
    data = rl.tasks.DataTask(train=[dict(row, images=[str(spoilt)])], test=[row], name="vl",
                             reward=lambda completion, example: 0.0)
    with rl.Session(task=data, **SMALL) as s:
        spoilt.write_bytes(b"not a picture any more")
        with pytest.raises(ValueError, match="example 0 .*how many.*spoilt.png"):
            s.rollout()


def test_prompt_lengths_count_each_pictures_tokens(vl, task):
    """`max_prompt_tokens` counts what the model reads: a 64 x 64 picture is 18 tokens (16 image tokens between
    its start and end), not the 7 characters of its `<image>` mark; counted without processing a pixel, as
    `Vision.encode` makes them, for pictures of other sizes too."""
    _, tokenizer, vision = vl
    for example in task.test[:5]:
        for size in [(64, 64), (40, 120), (200, 96)]:
            images = [example["images"][0].resize(size)]
            assert vision.prompt_tokens(tokenizer, example["prompt"], images) == len(
                vision.encode(tokenizer, example["prompt"], images)[0])
    longest = rl.tasks.longest_prompt_tokens(tokenizer, task.test, fits=lambda n: True, vision=vision)
    assert longest == max(len(vision.encode(tokenizer, e["prompt"], e["images"])[0]) for e in task.test)
    text_only = len(tokenizer.encode(max((e["prompt"] for e in task.test), key=len)))
    assert longest == text_only - len(tokenizer.encode("<image>")) + 18
    with pytest.raises(ValueError, match=f"has a {longest}-token prompt, over max_prompt_tokens={longest - 1}"):
        rl.Session(task=task, **SMALL | {"max_prompt_tokens": longest - 1})
    with pytest.warns(UserWarning, match="dropped .* longer than"):
        with rl.Session(task=task, **SMALL | {"max_prompt_tokens": longest - 1, "long_prompts": "drop"}) as s:
            assert 0 < len(s.task.train) < len(task.train)


def test_the_vllm_sampler_says_it_does_not_take_images_yet(task):
    with pytest.raises(ValueError, match="the vllm sampler does not take them yet|sampler='vllm' cannot run here"):
        rl.Session(task=task, **SMALL | {"sampler": "vllm"})


def test_a_partial_rollout_goes_on_with_its_prompts_pictures(vl, task):
    """An asynchronous rollout worker's rows, continued from their context piece by piece (a sampler interrupted
    every 3 tokens), keep their pictures: greedy, the pieces draw exactly the one-call rollout's tokens and log-probs
    (without the pictures the continuations would answer blind). Then an async session trains on image prompts."""
    model, tokenizer, vision = vl
    sampler = rl.samplers.HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    chunked = rl.samplers.PartialRollouts(Chunked(sampler), chunk_tokens=3)
    encoded = [vision.encode(tokenizer, e["prompt"], e["images"]) for e in task.test[:6]]
    prompts, images = [ids for ids, _ in encoded], [pixels for _, pixels in encoded]
    greedy = rl.samplers.SamplingParams(temperature=0.0, max_new_tokens=16)
    whole, pieces = sampler.generate(prompts, greedy, images=images), chunked.rollout(prompts, greedy, images=images)
    assert not chunked.interruptible and pieces["response_ids"].shape[1] > 3  # it did go on past the first piece
    assert torch.equal(pieces["response_ids"], whole["response_ids"])
    assert_close(pieces["sampler_logp"], whole["sampler_logp"], atol=1e-5)
    with rl.Session(task=task, **SMALL | {"rollout_mode": "async"}) as s:
        rows = s.run(3, progress=False)
    assert rows["staleness_max"].max() <= 1 and np.isfinite(rows["loss"]).all()


class Chunked:
    """The HF sampler without its interrupt (as vLLM's): `PartialRollouts` then generates in pieces of
    `chunk_tokens`, each row going on from its prompt and what it drew."""

    def __init__(self, sampler):
        self.sampler = sampler

    def generate(self, prompt_ids, params, *, images=None):
        return self.sampler.generate(prompt_ids, params, images=images)


@pytest.mark.parametrize("temperature", [5.0, 0.7])
def test_the_policy_never_draws_image_markup(vl, task, temperature):
    """The image tokens have probability 0 in the sampler and in the trainer (never sampled, even at temperature 5;
    a response holding one would be taken for more image slots), and entropies stay finite, also at a temperature
    below 1 (the lowest float as their logit, divided by 0.7, was -inf: every entropy NaN, every update skipped)."""
    model, tokenizer, vision = vl
    never = rl.models.vision.never_sampled(model)
    assert never == [vision.start_id, vision.image_id, vision.end_id]
    assert rl.models.vision.never_sampled(rl.models.load("tiny-arith")[0]) == []
    with rl.Session(task=task, **SMALL | {"temperature": temperature, "samples_per_prompt": 16}) as s:
        batch = s.rollout()
        mask = batch["response_mask"].bool()
        assert not torch.isin(batch["response_ids"][mask], torch.tensor(never)).any()
        row = s.step()
        assert torch.isfinite(torch.tensor([row["entropy"], row["loss"]])).all()
