"""The pictures and questions of the "shapes" task (`rlbench.tasks.shapes`), which tiny-vl was warm-started on.

`split(...)` gives the task's train and held-out examples; `problems(n, ...)` draws `n` seeded examples (a picture
of coloured shapes, a question about it and its answer: the task's docstring lists the kinds of question); `draw`
renders shapes, `describe` says them; `blind_accuracy` is what answering without looking reaches.
"""

from __future__ import annotations

import random
from collections import Counter

KINDS = ("square", "circle", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220), "yellow": (230, 200, 20),
           "purple": (140, 40, 170)}
GRID = 2
"""Cells per side: each shape has a cell of its own, so shapes never overlap."""
CELLS = ("top left", "top right", "bottom left", "bottom right")
IMAGE = "<image>"
TRAIN_SIZE, TEST_SIZE = 4000, 200
MAX_SHAPES = 4
"""Shapes per picture at most, by default (the difficulty knob)."""


def split(*, max_shapes: int = MAX_SHAPES, image_size: int = 64, seed: int = 0, train_size: int = TRAIN_SIZE,
          test_size: int = TEST_SIZE) -> tuple[list[dict], list[dict]]:
    """(train, held-out) examples: the first `train_size` of `problems(...)`, then `test_size` more."""
    examples = problems(train_size + test_size, max_shapes=max_shapes, image_size=image_size, seed=seed)
    return examples[:train_size], examples[train_size:]


def problems(n: int, *, max_shapes: int, image_size: int, seed: int) -> list[dict]:
    """`n` examples ({"prompt", "images", "answer", "shapes"}) drawn with `seed`."""
    if not 1 <= max_shapes <= len(CELLS):
        raise ValueError(f"max_shapes must be in 1..{len(CELLS)} (one shape per cell of a {GRID}x{GRID} grid), "
                         f"got {max_shapes}")
    if image_size < 16:
        raise ValueError(f"image_size must be at least 16 pixels, got {image_size}")
    rng = random.Random(seed)
    return [_example(rng, max_shapes, image_size) for _ in range(n)]


def _example(rng: random.Random, max_shapes: int, image_size: int) -> dict:
    cells = rng.sample(range(GRID * GRID), rng.randint(1, max_shapes))
    shapes = [{"kind": rng.choice(KINDS), "colour": rng.choice(list(COLOURS)), "cell": cell,
               "size": rng.uniform(0.55, 0.9)} for cell in cells]
    once = [kind for kind in KINDS if sum(s["kind"] == kind for s in shapes) == 1]
    kind = rng.choice(["count", "colour", "cell"] if once else ["count", "cell"])
    if kind == "count":
        question, answer = "how many?=", str(len(shapes))
    elif kind == "colour":
        shape = rng.choice(once)
        question, answer = f"colour of {shape}?=", next(s["colour"] for s in shapes if s["kind"] == shape)
    else:
        shape = rng.choice(shapes)
        question, answer = f"{CELLS[shape['cell']]}?=", f"{shape['colour']} {shape['kind']}"
    return {"prompt": IMAGE + question, "images": [draw(shapes, image_size)], "answer": answer, "shapes": shapes}


def describe(shapes: list[dict]) -> str:
    """What each cell of the picture holds, in reading order ("-" for an empty one): "red square,-,-,blue circle".
    (tiny-vl's first warm-start phase learns to say this of a picture: to see, before it is taught the questions.)"""
    held = {s["cell"]: f"{s['colour']} {s['kind']}" for s in shapes}
    return ",".join(held.get(cell, "-") for cell in range(GRID * GRID))


def draw(shapes: list[dict], size: int):
    """The picture of `shapes` (each a dict of kind, colour, cell, size as a share of its cell), white ground."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), "white")
    pen = ImageDraw.Draw(image)
    cell = size / GRID
    for s in shapes:
        row, column = divmod(s["cell"], GRID)
        half = s["size"] * cell / 2
        cx, cy = (column + 0.5) * cell, (row + 0.5) * cell
        box = [cx - half, cy - half, cx + half, cy + half]
        fill = COLOURS[s["colour"]]
        if s["kind"] == "square":
            pen.rectangle(box, fill=fill)
        elif s["kind"] == "circle":
            pen.ellipse(box, fill=fill)
        else:
            pen.polygon([(cx, cy - half), (cx - half, cy + half), (cx + half, cy + half)], fill=fill)
    return image


def blind_accuracy(train: list[dict], test: list[dict]) -> float:
    """The share of `test` answered right by the commonest answer to the same question text in `train`: what a
    model that never looks at the picture can reach."""
    answers: dict[str, Counter] = {}
    for example in train:
        answers.setdefault(example["prompt"], Counter())[example["answer"]] += 1
    best = {prompt: counts.most_common(1)[0][0] for prompt, counts in answers.items()}
    return sum(best.get(e["prompt"]) == e["answer"] for e in test) / len(test)
