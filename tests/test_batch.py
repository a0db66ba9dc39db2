import pytest
import torch

from rlbench.batch import Batch, left_pad


def make(n=4, width=3):
    return Batch(
        {"reward": torch.arange(n, dtype=torch.float32),
         "response_ids": torch.arange(n * width).view(n, width),
         "response_mask": torch.ones(n, width, dtype=torch.long)},
        {"completion": [f"c{i}" for i in range(n)]},
    )


def test_columns_rows_and_slices():
    b = make()
    assert len(b) == 4 and b.columns == ["reward", "response_ids", "response_mask", "completion"]
    assert b[1]["completion"] == "c1" and b[1]["reward"] == 1.0
    assert b[-1]["completion"] == "c3"
    sub = b[[3, 0]]
    assert sub["completion"] == ["c3", "c0"] and sub["reward"].tolist() == [3.0, 0.0]
    assert b[b["reward"] > 1.5]["completion"] == ["c2", "c3"]
    assert b[1:3]["response_ids"].tolist() == [[3, 4, 5], [6, 7, 8]]


def test_errors_name_the_problem():
    b = make()
    with pytest.raises(KeyError, match="no column 'nope'.*completion"):
        b["nope"]
    with pytest.raises(IndexError, match="row 9 out of range for a Batch of 4 rows"):
        b[9]
    with pytest.raises(ValueError, match="different lengths"):
        Batch({"a": torch.zeros(2)}, {"b": [1, 2, 3]})
    with pytest.raises(ValueError, match="batch 1 has columns"):
        Batch.concat([make(), make().select("reward")])


def test_select_split_chunk_concat():
    b = make(5)
    assert b.select("completion", "reward").columns == ["reward", "completion"]
    assert [len(c) for c in b.split(2)] == [2, 2, 1]
    assert [len(c) for c in b.chunk(3)] == [2, 2, 1]
    again = Batch.concat(b.split(2))
    assert again["completion"] == b["completion"] and torch.equal(again["response_ids"], b["response_ids"])


def test_concat_pads_prompts_left_and_responses_right():
    ids_a, mask_a = left_pad([[7, 8]], pad_id=0)
    ids_b, mask_b = left_pad([[5, 6, 7]], pad_id=0)
    a = Batch({"prompt_ids": ids_a, "prompt_mask": mask_a, "response_ids": torch.tensor([[1, 2, 3]])})
    b = Batch({"prompt_ids": ids_b, "prompt_mask": mask_b, "response_ids": torch.tensor([[4]])})
    both = Batch.concat([a, b])
    assert both["prompt_ids"].tolist() == [[0, 7, 8], [5, 6, 7]]
    assert both["prompt_mask"].tolist() == [[0, 1, 1], [1, 1, 1]]
    assert both["response_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]


def test_trimmed_drops_unused_padding_only():
    ids, mask = left_pad([[1, 2], [3]], pad_id=0)
    wide_ids = torch.cat([torch.zeros(2, 2, dtype=torch.long), ids], 1)
    wide_mask = torch.cat([torch.zeros(2, 2, dtype=torch.long), mask], 1)
    b = Batch({"prompt_ids": wide_ids, "prompt_mask": wide_mask,
               "response_ids": torch.tensor([[5, 6, 0, 0], [7, 0, 0, 0]]),
               "response_mask": torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]]),
               "reward": torch.tensor([1.0, 0.0])})
    t = b.trimmed()
    assert t["prompt_ids"].tolist() == [[1, 2], [0, 3]]
    assert t["response_ids"].tolist() == [[5, 6], [7, 0]]
    assert t["reward"].tolist() == [1.0, 0.0]


def test_views_pandas_repr_html():
    b = make().with_columns(completion=["x" * 500, "b", "c", "d"])
    df = b.to_pandas()
    assert list(df.columns) == b.columns and df["reward"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert df["response_ids"][1] == [3, 4, 5]
    assert "Batch(4 rows" in repr(b) and "response_ids: int64[4, 3]" in repr(b)
    page = b._repr_html_(max_rows=2, max_chars=20)
    assert "… 2 more rows" in page and "x" * 500 not in page and "response_ids int64[4, 3]" in page


def test_pickling_sends_tensors_as_arrays_and_gives_back_the_same_batch():
    """A Batch crosses to a Ray worker or a process pickled: numpy buffers out of band, the same columns back
    (dtypes numpy lacks, bfloat16, stay tensors), writable even when the received buffer is read-only."""
    import pickle

    batch = Batch({"ids": torch.arange(6).view(2, 3), "mask": torch.tensor([[True, False], [True, True]]),
                   "logp": torch.randn(2, 4), "half": torch.randn(2, 2).to(torch.bfloat16),
                   "view": torch.arange(10.0).view(2, 5)[:, 1:4]},
                  {"completion": ["a", "b"]}, {"step": 3})
    buffers = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) >= 3  # ids, mask, logp travel as raw buffers, not through torch.save
    read_only = [pickle.PickleBuffer(bytes(b.raw())) for b in buffers]  # as Ray hands them: immutable memory
    back = pickle.loads(data, buffers=read_only)
    assert back.columns == batch.columns and back.meta == {"step": 3} and back["completion"] == ["a", "b"]
    for name, column in batch.tensors.items():
        assert back[name].dtype == column.dtype and torch.equal(back[name], column), name
    back["ids"][0, 0] = 7  # writable, and not the sender's memory
    assert batch["ids"][0, 0] == 0
