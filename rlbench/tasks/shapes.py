"""The "shapes" task: questions about a small picture of coloured shapes, answerable only by looking at it.

Each example is one `image_size` x `image_size` RGB picture (a PIL image) of 1 to `max_shapes` shapes (square, circle,
triangle in one of five colours), each in its own cell of a 2 x 2 grid, with a question of one of three kinds, about
as likely each. Answered blind (each question by its commonest answer in training, `shapes_data.blind_accuracy`), 0.145
of the held-out split is right:

    count    "<image>how many?="          -> "3"            (1 to max_shapes, as likely each)
    colour   "<image>colour of circle?="  -> "blue"         (asked only of a kind drawn exactly once)
    cell     "<image>top left?="          -> "red square"   (asked only of a cell that holds a shape)

`<image>` marks where the picture goes in the prompt (verl's convention: the model's own image tokens replace it).
A completion scores 1.0 only if it is exactly the answer, then EOS; one cut at max_new_tokens scores 0.0. The
problems are drawn from a seeded generator (`seed`); `max_shapes` is the difficulty knob (more shapes: more to count and
more cells filled). The examples carry the shapes drawn (`shapes`: kind, colour, cell, size) beside `images`. Pictures
and questions come from `rlbench.models.shapes_data`, which the tiny-vl model was warm-started on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, final

from rlbench.models import shapes_data as data


@final
@dataclass(frozen=True, eq=False)
class Shapes:
    """`train_size` training and `test_size` held-out pictures with a question each, drawn with `seed`."""

    max_shapes: int = data.MAX_SHAPES
    image_size: int = 64
    train_size: int = data.TRAIN_SIZE
    test_size: int = data.TEST_SIZE
    seed: int = 0
    name: str = "shapes"
    truncated_reward: float | None = 0.0
    train: tuple[dict, ...] = field(init=False, repr=False)
    test: tuple[dict, ...] = field(init=False, repr=False)

    settings: ClassVar[dict] = {"lr": 3e-4}
    """The Session settings it needs (`rl.tasks.settings_of`): GRPO at the default lr 1e-4 learns it more slowly."""

    def __post_init__(self) -> None:
        train, test = data.split(max_shapes=self.max_shapes, image_size=self.image_size, seed=self.seed,
                                 train_size=self.train_size, test_size=self.test_size)
        object.__setattr__(self, "train", tuple(train))
        object.__setattr__(self, "test", tuple(test))

    def reward(self, completion: str, example: dict) -> float:
        return 1.0 if completion == example["answer"] else 0.0
