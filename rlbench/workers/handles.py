"""The typed handles a session calls its workers through: one per part, the same object inline and on Ray.

Each method says which worker method it runs (`Policy.forward_backward`, ...) and on which ranks: every rank (rows
split by token count) or the one worker. Tinker-style custom loops use them directly:

    fb = s.policy.forward_backward(batch)       # gradients accumulate over calls
    step = s.policy.optim_step()                # clip, step, schedule; {"grad_norm", "lr", "skipped", ...}
    s.sync_weights()                            # the sampler takes the new weights
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence

import torch

from rlbench import tasks
from rlbench.agents import EnvPool
from rlbench.algorithms import Algorithm
from rlbench.batch import Batch, left_pad
from rlbench.models.vision import Vision, load_image
from rlbench.policy import Critic, Policy, Reference
from rlbench.policy.fsdp import loss_mask, merge_ranks
from rlbench.rewards import TaskScorer
from rlbench.samplers import PartialRollouts, SamplingParams, VLLMSampler
from rlbench.workers.cluster import Pending, WorkerDied, WorkerGroup


class PolicyHandle:
    """The trainable policy's ranks (Tinker's TrainingClient): log-probs, gradient steps, its weights."""

    def __init__(self, workers: WorkerGroup, algorithm: Algorithm, norm_length: int):
        self.workers, self.algorithm, self.norm_length = workers, algorithm, norm_length

    def log_probs(self, batch: Batch) -> torch.Tensor:
        """Log-probs `[B, T]` of the batch's responses under the current weights (rows split across ranks)."""
        return self.log_probs_async(batch).result()

    def log_probs_async(self, batch: Batch, sum_pi2: bool = False) -> Pending:
        """`log_probs` started without waiting for it: `.result()` gives the log-probs (see `WorkerGroup.submit`);
        with `sum_pi2`, `[B, T, 2]`: and `Σ_v π_v²` per response token from the same forward."""
        return self.workers.map_rows("policy", Policy.log_probs, batch, sum_pi2=sum_pi2)

    def columns_async(self, batch: Batch, *, sum_pi2: bool = False) -> Pending:
        """The batch's `old_logp` column (with `sum_pi2`, also `sum_pi2`: `Σ_v π_v²` per token, OTB) under the current
        weights, started without waiting; `.result()` gives them by name."""
        if not sum_pi2:
            return self.log_probs_async(batch).then(lambda logp_B_T: {"old_logp": logp_B_T})
        return self.log_probs_async(batch, sum_pi2=True).then(
            lambda both_B_T_2: dict(zip(("old_logp", "sum_pi2"), (x.contiguous() for x in both_B_T_2.unbind(-1)))))

    def forward_backward(self, batch: Batch, loss_fn: Algorithm | Callable | None = None) -> dict[str, float]:
        """Accumulate the gradient of a loss over `batch` (rows split across ranks) and return its terms.

        `loss_fn`: None for the session's algorithm, another `Algorithm`, or a registered-style loss function
        (`f(logp_B_T, old_logp_B_T, advantages_B_T, mask_B_T, **hparams) -> (loss_B_T, metrics)`) reduced
        the session's algorithm's way. The loss is reduced with the whole batch's token and sequence counts:
        calling this once per mini-batch and then `optim_step()` is the session's `update()` (which calls
        `train_step`, the same two in one call).
        """
        algorithm = self._loss_algorithm(loss_fn)
        counts = batch_counts(batch, algorithm.norm_length or self.norm_length)
        return merge_ranks(self.workers.map_shards("policy", Policy.forward_backward, batch, algorithm=algorithm,
                                                   **counts).result())

    def optim_step(self) -> dict[str, float]:
        """One optimizer step over the gradients accumulated since the last one, on every rank:
        {"grad_norm", "lr", "skipped", "nonfinite_loss", "nonfinite_grad"} (a non-finite loss or gradient
        norm skips it, weights untouched)."""
        return self.workers.call("policy", Policy.optim_step)[0]

    def train_step(self, batch: Batch, loss_fn: Algorithm | Callable | None = None) -> dict[str, float]:
        """`forward_backward(batch, loss_fn) | optim_step()` in one call to each rank (on Ray one round trip
        instead of two): the same numbers. A failing gradient pass raises before any optimizer step."""
        algorithm = self._loss_algorithm(loss_fn)
        counts = batch_counts(batch, algorithm.norm_length or self.norm_length)
        per_rank = self.workers.map_shards("policy", Policy.train_step, batch, algorithm=algorithm, **counts).result()
        return merge_ranks([terms for terms, _ in per_rank]) | per_rank[0][1]

    def _loss_algorithm(self, loss_fn: Algorithm | Callable | None) -> Algorithm:
        """The algorithm whose loss `forward_backward` takes (see there)."""
        return (self.algorithm if loss_fn is None else loss_fn if isinstance(loss_fn, Algorithm)
                else self.algorithm.replace(loss=loss_fn, loss_kwargs={}))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) weights, on CPU (rank 0 gathers them)."""
        return self.workers.call("policy", Policy.state_dict)[0]

    def weights_ref(self):
        """Rank 0's full weights as numpy arrays, left where they are (a Ray object reference, or the
        arrays inline): what the sampler loads, zero-copy."""
        return self.workers.ref("policy", Policy.state_arrays)

    def save_checkpoint(self, path: str) -> None:
        self.workers.call("policy", Policy.save_checkpoint, path)

    def load_checkpoint(self, path: str) -> None:
        self.workers.call("policy", Policy.load_checkpoint, path)

    def export(self, path: str, adapter: bool = False) -> None:
        """The current weights as a Hugging Face model folder (written by rank 0); under LoRA merged into the
        base, or with `adapter=True` the adapter alone as a peft folder."""
        self.workers.call("policy", Policy.export, path, adapter)

    def set_before_backward(self, fn: Callable[[], None] | None) -> None:
        """Inline only: call `fn` before each backward pass (the overlapped rollout starts there)."""
        self.workers.call("policy", Policy.set_before_backward, fn)


class ReferenceHandle:
    """A frozen model's ranks. The reference policy: a `Reference` model of its own, or under LoRA the policy's ranks
    with the adapter off (`Policy.reference_log_probs`; nothing of its own for a checkpoint to keep). Named "teacher":
    the on-policy distillation teacher, a `Reference` over the teacher's weights (never checkpointed: it never
    changes)."""

    def __init__(self, workers: WorkerGroup, name: str = "reference", method: Callable = Reference.log_probs):
        self.workers, self.name, self.method = workers, name, method
        self.own_weights = name == "reference"

    def log_probs(self, batch: Batch, **options) -> torch.Tensor:
        """Log-probs `[B, T]` of the batch's responses (rows split across ranks); a teacher's `topk=k` option gives
        `[B, T, 1 + 2k]`: also its k most likely tokens' log-probs and ids per position (`Reference.log_probs`)."""
        return self.log_probs_async(batch, **options).result()

    def log_probs_async(self, batch: Batch, **options) -> Pending:
        """`log_probs` started without waiting for it: `.result()` gives the log-probs (see `WorkerGroup.submit`)."""
        return self.workers.map_rows(self.name, self.method, batch, **options)

    def columns_async(self, batch: Batch, *, topk: int = 0) -> Pending:
        """The batch's `ref_logp` column (a teacher's: `teacher_logp`, and with `topk=k` also `teacher_topk_logp` and
        `teacher_topk_ids` `[B, T, k]`, k at most the vocabulary), started without waiting; `.result()` gives them by
        name."""
        prefix = "teacher" if self.name == "teacher" else "ref"  # (the reference under LoRA: the policy's ranks)

        def named(logp_B_T_X: torch.Tensor) -> dict[str, torch.Tensor]:
            if not topk:
                return {f"{prefix}_logp": logp_B_T_X}
            k = (logp_B_T_X.shape[-1] - 1) // 2  # [B, T, 1 + 2k]: the log-probs, the top-k log-probs, their ids
            return {f"{prefix}_logp": logp_B_T_X[..., 0].contiguous(),
                    f"{prefix}_topk_logp": logp_B_T_X[..., 1 : 1 + k].contiguous(),
                    f"{prefix}_topk_ids": logp_B_T_X[..., 1 + k :].long()}
        return self.log_probs_async(batch, **({"topk": topk} if topk else {})).then(named)

    def save_checkpoint(self, path: str) -> None:
        self.workers.call("reference", Reference.save_checkpoint, path)

    def load_checkpoint(self, path: str) -> None:
        self.workers.call("reference", Reference.load_checkpoint, path)


class CriticHandle:
    """The value model's ranks (PPO)."""

    def __init__(self, workers: WorkerGroup, algorithm: Algorithm, norm_length: int):
        self.workers, self.algorithm, self.norm_length = workers, algorithm, norm_length

    def values(self, batch: Batch) -> torch.Tensor:
        """Values `[B, T]` of the batch's response positions (rows split across ranks)."""
        return self.columns_async(batch).result()["values"]

    def columns_async(self, batch: Batch) -> Pending:
        """The batch's `values` column, started without waiting; `.result()` gives it by name."""
        return self.workers.map_rows("critic", Critic.values, batch).then(lambda values_B_T: {"values": values_B_T})

    def train_mini_batch(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of the clipped value loss on the batch's `returns` (needs `values`)."""
        counts = batch_counts(batch, self.algorithm.norm_length or self.norm_length)
        return merge_ranks(self.workers.map_shards("critic", Critic.train_mini_batch, batch,
                                                   mode=self.algorithm.reduction, **counts).result())

    def save_checkpoint(self, path: str) -> None:
        self.workers.call("critic", Critic.save_checkpoint, path)

    def load_checkpoint(self, path: str) -> None:
        self.workers.call("critic", Critic.load_checkpoint, path)


class SamplerHandle:
    """The sampler worker, with the tokenizer that turns examples into its prompts and its tokens into text.

    A rollout worker's handle (`restart` given) outlives its worker: a call that finds the worker dead has a new one
    started in its place (`replace`), which takes the newest weights pushed before anything else; calls through the
    handle meanwhile wait for it and run on it (and fail with its reason if it cannot be started)."""

    def __init__(self, workers: WorkerGroup, tokenizer, choice: str, why: str, sleeps: bool = False,
                 restart: Callable[[WorkerGroup], WorkerGroup] | None = None, vision: Vision | None = None):
        self._workers, self.tokenizer = workers, tokenizer
        self.vision = vision
        """A vision-language model's image tokens and processor (None: a text model): examples' `images` are
        encoded into their prompts (`rl.models.vision.Vision.encode`) and passed to the sampler."""
        self.choice = choice
        """Which sampler runs: "hf", "vllm", or a given Sampler's class name."""
        self.why = why
        """Why that one (e.g. "on CPU the hf sampler is faster (benchmarks/vllm_sampler.py)")."""
        self.sleeps = sleeps
        """Whether it frees its GPU during each update (vLLM with `vllm_sleep`: a GPU shared with the policy)."""
        self.restarts = 0
        """New workers started in place of dead ones."""
        self._restart = restart  # a new worker's group, given the dead one's
        self._swap = threading.Condition()  # guards the worker's group and the fields below
        self._dead: WorkerGroup | None = None  # the group a call found dead, until replaced
        self._replacing = False
        self._failed: BaseException | None = None  # why a new worker could not be started
        self._weights: tuple | None = None  # the newest (weights, version) pushed: a new worker starts from them

    @property
    def workers(self) -> WorkerGroup:
        """The worker's group; while a dead worker is replaced, the new one's once it has started (RuntimeError if it
        could not be)."""
        with self._swap:
            self._swap.wait_for(lambda: not self._replacing)
            if self._failed is not None:
                raise RuntimeError(f"the '{self._workers.name}' worker died and no new one could be started: "
                                   f"{self._failed}") from self._failed
            return self._workers

    def replace(self) -> None:
        """Start a new worker in place of the one a call found dead (nothing to do if it was replaced already; wait
        for it if another thread is replacing it), and give it the newest weights pushed before any call runs on it."""
        with self._swap:
            self._swap.wait_for(lambda: not self._replacing)
            if self._failed is not None or self._dead is not self._workers:
                return
            self._replacing, dead = True, self._workers
        try:
            workers = self._restart(dead)
            while True:  # the newest weights, also when a push came meanwhile
                with self._swap:
                    weights = self._weights
                if weights is not None:
                    workers.call("sampler", PartialRollouts.push_weights, *weights)
                with self._swap:
                    if self._weights is weights:
                        self._workers, self._replacing = workers, False
                        self.restarts += 1
                        self._swap.notify_all()
                        return
        except BaseException as error:
            with self._swap:
                self._failed, self._replacing = error, False
                self._swap.notify_all()
            raise

    def _call(self, method: Callable, *args, again: bool = True):
        """`method(sampler, *args)` on the worker. A rollout worker found dead is replaced and the call runs again on
        the new one; with `again=False` the WorkerDied is raised instead (the worker stays marked dead for `replace`)."""
        workers = self.workers
        try:
            return workers.call("sampler", method, *args)[0]
        except WorkerDied:
            if self._restart is None:
                raise
            with self._swap:
                if self._workers is workers:
                    self._dead = workers
            if not again:
                raise
        self.replace()
        return self.workers.call("sampler", method, *args)[0]

    def generate(self, examples_or_prompts: Sequence[dict | str | list], params: SamplingParams) -> Batch:
        """Sample `params.n` completions of each example (a dict with a "prompt") or prompt (text, or a list of
        chat messages): the rollout table, prompt-major, before any score."""
        examples = [e if isinstance(e, dict) else {"prompt": e} for e in examples_or_prompts]
        if not examples:
            raise ValueError("generate: no examples or prompts given")
        encoded = [self.encode_example(i, e) for i, e in enumerate(examples)]
        prompt_ids, inputs = [ids for ids, _, _ in encoded], [pixels for _, pixels, _ in encoded]
        out = self._call(_sampler_generate, prompt_ids, params, inputs if any(inputs) else None)
        return self._table(examples, prompt_ids, out, params.n, [(images, pixels) for _, pixels, images in encoded])

    def encode_example(self, i: int, example: dict) -> tuple[list[int], dict, list]:
        """(prompt ids, its images' pixels and grids ({} without), its images as PIL images) of the i-th example of a
        call; ValueError naming it when its images cannot be read or do not pair up with its `<image>` marks, or the
        model takes none."""
        images = example.get("images") or []
        if self.vision is None:
            if images:
                raise ValueError(f"example {i}: it has {len(images)} image(s) and the model is text-only")
            return self.encode_prompt(example["prompt"]), {}, []
        try:
            loaded = [load_image(image) for image in images]
            text = tasks.render_prompt(self.tokenizer, example["prompt"])
            return (*self.vision.encode(self.tokenizer, text, loaded), loaded)
        except (OSError, TypeError, ValueError) as error:
            raise ValueError(f"example {i} ({str(example['prompt'])[:60]!r}): {error}") from error

    def rollout(self, examples: list[dict], params: SamplingParams, min_version: int,
                trained_by: int | None = None) -> Batch:
        """An asynchronous run's rollout (`rl.samplers.PartialRollouts.rollout`): `generate`'s table plus
        `token_version [B, T]`, the weights version that drew each token (new weights are taken mid-generation).
        A dead worker raises WorkerDied: the caller draws the examples again, after `replace()`."""
        encoded = [self.encode_example(i, e) for i, e in enumerate(examples)]
        prompt_ids, inputs = [ids for ids, _, _ in encoded], [pixels for _, pixels, _ in encoded]
        out = self._call(PartialRollouts.rollout, prompt_ids, params, min_version, inputs if any(inputs) else None,
                         trained_by, again=False)
        return self._table(examples, prompt_ids, out, params.n, [(images, pixels) for _, pixels, images in encoded])

    def push_weights(self, weights, version: int) -> None:
        """Asynchronous runs: hand new weights (of this version) to the rollout worker, which takes them at its next
        token (`rl.samplers.PartialRollouts.push_weights`); a worker being replaced, or found dead (WorkerDied), has its
        replacement take them first."""
        with self._swap:
            self._weights = (weights, version)
            if self._replacing:
                return
        self._call(PartialRollouts.push_weights, weights, version, again=False)

    def release(self) -> None:
        """Asynchronous runs, closing: a rollout waiting for weights (paced by the trainer) goes on without them
        (`rl.samplers.PartialRollouts.release`)."""
        with self._swap:
            if self._replacing:
                return
        self._call(PartialRollouts.release, again=False)

    def _table(self, examples: list[dict], prompt_ids: list[list[int]], out: Batch, n: int,
               images: list[tuple[list, dict]] | None = None) -> Batch:
        """The sampler's output with the prompts, the completions' text and the group ids; with `images` (per
        example, its PIL images and their pixels), each row's prompt images (`images`, shown as thumbnails) and
        their pixels and grids (`image_inputs`, what the trainer's forward takes)."""
        rows = [i for i in range(len(examples)) for _ in range(n)]
        ids_B_P, mask_B_P = left_pad([prompt_ids[i] for i in rows], self.tokenizer.pad_token_id)
        completions = self.tokenizer.batch_decode(
            [ids[: k - int(done)] for ids, k, done in
             zip(out["response_ids"].tolist(), out["response_mask"].sum(-1).tolist(), out["finished"].tolist())])
        more = {}
        if images and any(pixels for _, pixels in images):
            more = {"images": [images[i][0] for i in rows], "image_inputs": [images[i][1] for i in rows]}
        return out.with_columns(
            prompt=[examples[i]["prompt"] for i in rows], completion=completions,
            group_ids=torch.tensor(rows), prompt_ids=ids_B_P, prompt_mask=mask_B_P,
            example=[examples[i] for i in rows], **more)

    def generate_ids(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams,
                     images: Sequence[dict] | None = None) -> Batch:
        """The sampler's own output for token-id prompts (`rl.samplers.Sampler.generate`): `response_ids`,
        `response_mask`, `sampler_logp`, `finished`, prompt-major; `images`: per prompt, the pixels and grids of the
        pictures its ids hold (None: none has any)."""
        return self._call(_sampler_generate, prompt_ids, params, images)

    def encode_prompt(self, prompt) -> list[int]:
        """Token ids of a prompt (`rl.tasks.encode_prompt`): chat template if the tokenizer has one, else plain text."""
        return tasks.encode_prompt(self.tokenizer, prompt)

    def load_weights(self, weights) -> None:
        """Replace the sampler's weights with a full state dict (tensors, numpy arrays or a Ray reference to them)."""
        self._call(_sampler_load_weights, weights)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights the sampler holds (a sampler without `state_dict()` raises AttributeError)."""
        return self._call(_sampler_state_dict)

    def sleep(self) -> None:
        """vLLM on a GPU shared with the policy: free the KV cache and move the weights off the GPU."""
        self._call(VLLMSampler.sleep)

    def before_update(self) -> None:
        """Called before each update: a sampler that `sleeps` frees the GPU for it (the next weights wake it)."""
        if self.sleeps:
            self.sleep()


class EnvHandle:
    """The environment worker of an agentic task (`rl.agents.EnvPool`): environments of running episodes, their
    tools in threads. Inline it lives in this process; on Ray in an actor of its own, off the driver."""

    def __init__(self, workers: WorkerGroup):
        self.workers = workers

    def open(self, keys: list[int], examples: list[dict]):
        return self.workers.call("envs", EnvPool.open, keys, examples)[0]

    def info(self) -> dict:
        return self.workers.call("envs", EnvPool.info)[0]

    def submit(self, key: int, calls=None, action: str | None = None) -> None:
        self.workers.call("envs", EnvPool.submit, key, calls, action)

    def poll(self, wait_s: float = 0.0) -> dict:
        return self.workers.call("envs", EnvPool.poll, wait_s)[0]

    def score(self, key: int, episode):
        return self.workers.call("envs", EnvPool.score, key, episode)[0]

    def close(self, keys: list[int]) -> None:
        self.workers.call("envs", EnvPool.close, keys)


class ScorerHandle:
    """The reward worker: the task's reward over completions, in parallel, with a timeout per sample."""

    def __init__(self, workers: WorkerGroup):
        self.workers = workers

    def score(self, completions: list[str], examples: list[dict], finished_B: torch.Tensor):
        """(score [B], components {name: [B]}, per-sample errors) of completions."""
        return self.workers.call("rewards", TaskScorer.score, completions, examples, finished_B)[0]


# A sampler is any object following the Sampler protocol (HFSampler, VLLMSampler, a user's): these call its
# methods whatever its class.
def _sampler_generate(sampler, prompt_ids, params, images=None):
    if images is None:
        return sampler.generate(prompt_ids, params)
    if "images" not in inspect.signature(sampler.generate).parameters:
        raise ValueError(f"the prompts have images and the {type(sampler).__name__} sampler does not take them "
                         f"(its generate() has no images=)")
    return sampler.generate(prompt_ids, params, images=images)


def _sampler_load_weights(sampler, weights):
    return sampler.load_weights(weights)


def _sampler_state_dict(sampler):
    return sampler.state_dict()


def batch_counts(batch: Batch, norm_length: int) -> dict[str, int]:
    """The whole batch's loss-token and sequence counts (every rank's share is reduced with them), and `T_norm`."""
    return dict(num_tokens=int(loss_mask(batch).sum()), num_seqs=len(batch), norm_length=norm_length)


