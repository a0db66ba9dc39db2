import math
import resource
import signal
import sys
import types
from contextlib import contextmanager

import pytest
from floats import approx

import rlbench as rl
from rlbench.runs.sinks import JsonlSink, TensorBoardSink, WandbSink, make_sinks, read_jsonl

ROWS = [{"step": 0, "reward_mean": 0.25, "loss": 1.5, "skipped": 0.0},
        {"step": 1, "reward_mean": 0.5, "loss": float("nan"), "skipped": 1.0}]


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} of the TensorBoard event files in a folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_jsonl_sink_appends_one_line_per_row(tmp_path):
    sink = JsonlSink(tmp_path / "run" / "metrics.jsonl")
    for row in ROWS:
        sink.write(row)
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2  # flushed per row
    sink.close()
    logged = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert logged["reward_mean"].tolist() == [0.25, 0.5] and math.isnan(logged["loss"][1])


@contextmanager
def file_size_limit(path):
    """Writes past `path`'s present size fail as on a full disk: the kernel writes what fits, then write(2) fails
    (RLIMIT_FSIZE, with SIGXFSZ ignored so that the failure is an OSError, EFBIG, rather than the end of the
    process). Filling a real disk is not possible here; the short write and the error are the same."""
    limit = path.stat().st_size + 10  # room for part of the next line, not all of it
    previous = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, previous[0][1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous[0])
        signal.signal(signal.SIGXFSZ, previous[1])


def test_a_step_whose_log_write_fails_stays_recorded_and_the_log_gets_no_hole(tiny_dir, tmp_path):
    # the attack: a disk that filled while the metrics log was written made step() raise a bare OSError after the
    # step was trained and counted, and once there was room again the log had a silent hole (steps != log lines)
    with rl.Session(model=tiny_dir, cluster="inline", prompts_per_step=2, samples_per_prompt=2, max_new_tokens=4,
                    threads=1, log_dir=str(tmp_path), run_name="full") as s:
        log = tmp_path / "full" / "metrics.jsonl"
        s.step()
        with file_size_limit(log), pytest.raises(OSError, match=r"step 1 is trained and recorded \(session.metrics\), "
                                                                r"but its log is behind: .*metrics.jsonl: the metrics "
                                                                r"row\(s\) of step 1 could not be written \(File too "
                                                                r"large\); they are kept"):
            s.step()
        assert s.step_count == 2 and len(s.metrics) == 2
        assert log.read_text().count("\n") == 1 and log.read_text().endswith("\n")  # no half line
        s.step()  # room again: the kept row goes first
        assert read_jsonl(log)["step"].tolist() == [0, 1, 2]
        with file_size_limit(log), pytest.raises(OSError):
            s.step()
    assert read_jsonl(log)["step"].tolist() == [0, 1, 2, 3]  # written when the session closed


def test_tensorboard_sink_writes_every_number_at_its_step(tmp_path):
    pytest.importorskip("tensorboard")
    jsonl, sink = make_sinks(tmp_path, "tb", tensorboard=True)
    assert isinstance(sink, TensorBoardSink) and sink.log_dir == jsonl.path.parent  # one folder per run
    for row in ROWS:
        sink.write(row)
    scalars = _scalars(tmp_path / "tb")  # readable before close(): flushed per row
    sink.close()
    assert set(scalars) == {"reward_mean", "loss", "skipped"}  # the step is the x axis, not a tag
    assert scalars["reward_mean"] == [(0, 0.25), (1, 0.5)]
    assert scalars["loss"][0] == (0, 1.5) and math.isnan(scalars["loss"][1][1])  # a NaN loss must show


def test_session_rows_reach_a_tensorboard_sink(tiny_dir, tmp_path):
    pytest.importorskip("tensorboard")
    s = rl.Session(model="tiny-arith", prompts_per_step=2, samples_per_prompt=4, max_new_tokens=8, threads=1,
                   log_dir=None)
    s.sinks.append(TensorBoardSink(tmp_path / "tb"))
    s.run(steps=2, progress=False)
    scalars = _scalars(tmp_path / "tb")
    assert set(scalars) == set(s.metrics.columns) - {"step"}
    assert [v for _, v in scalars["reward_mean"]] == approx(s.metrics["reward_mean"].tolist())
    assert [step for step, _ in scalars["time_update"]] == [0, 1]


class FakeWandb(types.ModuleType):
    """Records what the sink asks of `wandb` (the real one needs an account or a slow offline service)."""

    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return types.SimpleNamespace(log=lambda data, step: self.calls.append(("log", data, step)),
                                     finish=lambda: self.calls.append(("finish",)))


def test_wandb_sink_logs_rows_with_their_step(tmp_path, monkeypatch):
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    config = rl.Config(algorithm=rl.algorithms.get("dapo")).to_dict()
    sink = WandbSink("proj", "run-1", config=config, directory=tmp_path / "run-1")
    for row in ROWS:
        sink.write(row)
    sink.close()
    (_, init), log0, log1, finish = wandb.calls
    assert init["project"] == "proj" and init["name"] == "run-1" and init["dir"] == str(tmp_path / "run-1")
    assert (tmp_path / "run-1").is_dir()
    assert init["config"]["algorithm"] == "dapo" and init["config"]["betas"] == [0.9, 0.999]  # plain values
    assert init["config"]["lr"] == config["lr"]
    assert log0 == ("log", {"reward_mean": 0.25, "loss": 1.5, "skipped": 0.0}, 0)
    assert log1[2] == 1 and math.isnan(log1[1]["loss"]) and finish == ("finish",)


def test_make_sinks_jsonl_by_default_others_on_request(tmp_path, monkeypatch):
    assert make_sinks(None, "r") == []
    (jsonl,) = make_sinks(tmp_path, "r")
    assert isinstance(jsonl, JsonlSink) and jsonl.path == (tmp_path / "r" / "metrics.jsonl").resolve()
    with pytest.raises(ValueError, match="log_dir"):
        make_sinks(None, "r", tensorboard=True)

    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    kinds = [type(s) for s in make_sinks(None, "r", wandb_project="proj")]
    assert kinds == [WandbSink] and wandb.calls[0][1]["dir"] is None
    kinds = [type(s) for s in make_sinks(tmp_path, "r", wandb_project="proj")]
    assert kinds == [JsonlSink, WandbSink] and wandb.calls[1][1]["dir"] == str(tmp_path / "r")

    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(ImportError, match=r"pip install 'rlbench\[wandb\]'"):
        make_sinks(tmp_path, "r", wandb_project="proj")
