"""`Batch`: what the controller sees at every stage of a step.

A Batch is a table with one row per sample. Its columns are either tensors whose first dimension is
the row (`response_ids [B, T]`, `reward [B]`) or Python lists with one entry per row (`prompt`,
`completion`, the task's `example` dicts). Every stage of the loop takes a Batch and returns a new one
with more columns, so each intermediate result can be printed, indexed, plotted and edited.

Padding conventions: columns named in `LEFT_PADDED` (the prompt) are left-padded, every other
`[B, T, ...]` tensor is right-padded; `concat` pads with zeros on the matching side.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

LEFT_PADDED = frozenset({"prompt_ids", "prompt_mask"})
"""Tensor columns padded on the left (prompts, so that generation continues at the right edge)."""

_NUMPY_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                           torch.float32, torch.float64})


class Batch:
    """Named columns with a shared leading batch dimension.

    `batch["reward"]` is a column; `batch[3]` is one row as a dict; `batch[2:5]`, `batch[[0, 4]]` or
    `batch[mask_B]` is a smaller Batch. `meta` holds values about the whole batch (not per row), such as
    the step number or the stage timings.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        lists: Mapping[str, Sequence[Any]] | None = None,
        meta: Mapping[str, Any] | None = None,
    ):
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self.lists: dict[str, list] = {k: list(v) for k, v in (lists or {}).items()}
        self.meta: dict[str, Any] = dict(meta or {})
        sizes = {k: len(v) for k, v in self.tensors.items()} | {k: len(v) for k, v in self.lists.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch columns have different lengths: {sizes}")

    def __getstate__(self) -> dict:
        """Pickled (to a Ray worker, a process, a file) with its tensors as numpy arrays: pickle-5 sends those as
        raw buffers, where a pickled tensor goes through `torch.save` storage by storage (a 128-row step's
        batch: ~9 ms to a Ray actor and back as tensors, ~2 ms as arrays). Dtypes numpy lacks stay tensors."""
        return {"tensors": {k: v.numpy() if v.dtype in _NUMPY_DTYPES and v.device.type == "cpu" and not v.requires_grad
                            else v for k, v in self.tensors.items()}, "lists": self.lists, "meta": self.meta}

    def __setstate__(self, state: dict) -> None:
        # a received array may be a read-only view of the message: the copy makes the tensor safely writable
        self.tensors = {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(v if v.flags.writeable else v.copy())
                        for k, v in state["tensors"].items()}
        self.lists, self.meta = state["lists"], state["meta"]

    # ----------------------------------------------------------------------------------- basics
    def __len__(self) -> int:
        for column in (*self.tensors.values(), *self.lists.values()):
            return len(column)
        return 0

    @property
    def columns(self) -> list[str]:
        return [*self.tensors, *self.lists]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or name in self.lists

    def __getitem__(self, key):
        if isinstance(key, str):
            if key in self.tensors:
                return self.tensors[key]
            if key in self.lists:
                return self.lists[key]
            raise KeyError(f"no column {key!r}; columns: {', '.join(self.columns)}")
        if isinstance(key, int):
            if not -len(self) <= key < len(self):
                raise IndexError(f"row {key} out of range for a Batch of {len(self)} rows")
            return {name: self[name][key] for name in self.columns}
        return self._take(key)

    def _take(self, rows) -> Batch:
        """Rows by slice, list of indices, or boolean / index tensor."""
        if isinstance(rows, slice):
            index = list(range(len(self)))[rows]
        elif isinstance(rows, torch.Tensor) and rows.dtype == torch.bool:
            if rows.shape != (len(self),):
                raise IndexError(f"boolean mask of shape {tuple(rows.shape)} for a Batch of {len(self)} rows")
            index = rows.nonzero().flatten().tolist()
        else:
            index = [int(i) for i in rows]
        index_t = torch.tensor(index, dtype=torch.long)
        return Batch(
            {k: v.index_select(0, index_t) for k, v in self.tensors.items()},
            {k: [v[i] for i in index] for k, v in self.lists.items()},
            self.meta,
        )

    def with_columns(self, **columns) -> Batch:
        """A new Batch with these columns added or replaced (tensors and lists are told apart by type)."""
        tensors, lists = dict(self.tensors), dict(self.lists)
        for name, value in columns.items():
            if isinstance(value, torch.Tensor):
                lists.pop(name, None)
                tensors[name] = value  # a replaced column keeps its place
            else:
                tensors.pop(name, None)
                lists[name] = value
        return Batch(tensors, lists, self.meta)

    def trimmed(self) -> Batch:
        """The same rows without padding columns that no row uses (keyed on prompt_mask / response_mask)."""
        tensors = dict(self.tensors)
        if "prompt_mask" in tensors:
            width = int(tensors["prompt_mask"].sum(-1).max()) if len(self) else 0
            for k in LEFT_PADDED & tensors.keys():
                tensors[k] = tensors[k][:, tensors[k].shape[1] - width :]
        if "response_mask" in tensors:
            full = tensors["response_mask"].shape[1]
            width = int(tensors["response_mask"].sum(-1).max()) if len(self) else 0
            for k, v in tensors.items():
                if k not in LEFT_PADDED and v.dim() >= 2 and v.shape[1] == full:
                    tensors[k] = v[:, :width]
        return Batch(tensors, self.lists, self.meta)

    def to(self, device) -> Batch:
        """The same rows with every tensor column on `device`."""
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.lists, self.meta)

    def with_meta(self, **values) -> Batch:
        """The same rows with these whole-batch values added to `meta`."""
        return Batch(self.tensors, self.lists, self.meta | values)

    def select(self, *names: str) -> Batch:
        """A Batch with only these columns (in this order)."""
        missing = [n for n in names if n not in self]
        if missing:
            raise KeyError(f"no column(s) {missing}; columns: {', '.join(self.columns)}")
        return Batch(
            {n: self.tensors[n] for n in names if n in self.tensors},
            {n: self.lists[n] for n in names if n in self.lists},
            self.meta,
        )

    def split(self, rows_per_chunk: int) -> list[Batch]:
        """Consecutive chunks of at most `rows_per_chunk` rows."""
        if rows_per_chunk <= 0:
            raise ValueError(f"rows_per_chunk must be positive, got {rows_per_chunk}")
        return [self[i : i + rows_per_chunk] for i in range(0, len(self), rows_per_chunk)]

    def chunk(self, n: int) -> list[Batch]:
        """`n` chunks of near-equal row counts (the first ones one row longer), e.g. one per rank."""
        sizes = [len(self) // n + (1 if i < len(self) % n else 0) for i in range(n)]
        starts = [sum(sizes[:i]) for i in range(n)]
        return [self[s : s + size] for s, size in zip(starts, sizes)]

    def __iter__(self) -> Iterator[dict]:
        return (self[i] for i in range(len(self)))

    @staticmethod
    def concat(batches: Iterable[Batch]) -> Batch:
        """Rows of several Batches with the same columns; tensors are zero-padded to the widest."""
        batches = [b for b in batches]
        if not batches:
            return Batch()
        names = batches[0].columns
        for i, b in enumerate(batches[1:], start=1):
            if sorted(b.columns) != sorted(names) or set(b.tensors) != set(batches[0].tensors):
                raise ValueError(f"cannot concat: batch {i} has columns {b.columns}, batch 0 has {names}")
        tensors = {k: _cat_padded([b.tensors[k] for b in batches], left=k in LEFT_PADDED) for k in batches[0].tensors}
        lists = {k: [x for b in batches for x in b.lists[k]] for k in batches[0].lists}
        return Batch(tensors, lists, batches[0].meta)

    # ------------------------------------------------------------------------------------ views
    def to_pandas(self):
        """One DataFrame row per sample; `[B]` tensors become scalars, wider tensors become lists."""
        import pandas as pd

        data: dict[str, list] = {}
        for name in self.columns:
            column = self[name]
            if isinstance(column, torch.Tensor):
                data[name] = column.tolist()
            else:
                data[name] = list(column)
        return pd.DataFrame(data)

    def __repr__(self) -> str:
        parts = [f"{k}: {_describe(v)}" for k, v in self.tensors.items()]
        parts += [f"{k}: list" for k in self.lists]
        return f"Batch({len(self)} rows; " + ", ".join(parts) + ")"

    def _repr_html_(self, max_rows: int = 16, max_chars: int = 80) -> str:
        """A notebook table: scalar columns and text, long cells and long batches truncated."""
        shown = [n for n in self.columns if not (isinstance(self[n], torch.Tensor) and self[n].dim() > 1)]
        wide = [n for n in self.columns if n not in shown]
        head = "".join(f"<th>{html.escape(n)}</th>" for n in shown)
        body = []
        for i in range(min(len(self), max_rows)):
            cells = "".join(f"<td>{thumbnails(self[n][i]) or html.escape(_cell(self[n][i], max_chars))}</td>"
                            for n in shown)
            body.append(f"<tr>{cells}</tr>")
        more = f"<p>… {len(self) - max_rows} more rows</p>" if len(self) > max_rows else ""
        note = f"<p>tensor columns: {html.escape(', '.join(f'{n} {_describe(self[n])}' for n in wide))}</p>" if wide else ""
        return f"<p><b>Batch</b>: {len(self)} rows</p><table><tr>{head}</tr>{''.join(body)}</table>{more}{note}"


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def thumbnails(value, size: int = 48) -> str | None:
    """A cell holding a list of images (PIL, as a vision-language batch's `images`) as inline thumbnails; None for
    any other value."""
    if not (isinstance(value, (list, tuple)) and value and all(hasattr(v, "save") and hasattr(v, "size")
                                                                for v in value)):
        return None
    import base64
    import io

    tags = []
    for image in value:
        thumb = image.copy()
        thumb.thumbnail((size, size))
        buffer = io.BytesIO()
        thumb.save(buffer, format="PNG")
        tags.append(f'<img src="data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}" '
                    f'title="{image.size[0]}x{image.size[1]}">')
    return "".join(tags)


def _cell(value, max_chars: int) -> str:
    if isinstance(value, torch.Tensor):
        value = value.item() if value.dim() == 0 else value.tolist()
    if isinstance(value, float):
        text = f"{value:.4g}"
    else:
        text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"


def _cat_padded(tensors: list[torch.Tensor], *, left: bool) -> torch.Tensor:
    if tensors[0].dim() == 1:
        return torch.cat(tensors)
    width = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        pad = width - t.shape[1]
        fill = t.new_zeros((t.shape[0], pad, *t.shape[2:]))
        padded.append(torch.cat([fill, t] if left else [t, fill], dim=1))
    return torch.cat(padded)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token-id lists -> (`ids [B, L]` left-padded with pad_id, `mask [B, L]` 1 on real tokens)."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return ids.view(len(rows), width), mask.view(len(rows), width)  # view: 0 rows give [0, 0]
