"""Checks every sampler's output must pass, whatever produced it (the HF decode loop, vLLM)."""


def assert_rollout_layout(out, tokenizer) -> None:
    """Each row: a prefix of real tokens, then padding; finished iff it ended on EOS, nothing after the first
    EOS; zero log-probs on padding."""
    ids, mask, eos = out["response_ids"], out["response_mask"], tokenizer.eos_token_id
    for row_ids, row_mask, finished in zip(ids.tolist(), mask.tolist(), out["finished"].tolist()):
        n = sum(row_mask)
        assert row_mask == [1] * n + [0] * (len(row_mask) - n)
        assert all(t == tokenizer.pad_token_id for t in row_ids[n:])
        assert finished == (row_ids[n - 1] == eos)
        assert eos not in row_ids[: n - 1]
    assert (out["sampler_logp"] * (1 - mask)).abs().sum() == 0
