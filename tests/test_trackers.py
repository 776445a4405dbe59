"""W&B (offline) and MLflow (a local file store) behind the metrics fan-out: every step's row, the config,
rollout sample tables; the same tracker run continued by a session loaded into the run directory; a
failing tracker never stops training."""
import json
import logging
import struct

import pytest

import rlbench_nb as rl
from rlbench_nb.metrics import read_jsonl
from rlbench_nb.metrics.log import MetricsLog

wandb = pytest.importorskip("wandb")
pytest.importorskip("mlflow")


def _wandb_history(run_file) -> dict[int, dict]:
    """step -> logged values, read from an offline run's .wandb file: LevelDB-style log records (32 KiB
    blocks; each record a 7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last) after a
    7-byte W&B header, each holding a protobuf Record. wandb has no reader of its own since 0.19."""
    from wandb.proto import wandb_internal_pb2 as pb
    raw, pos, buf, out = run_file.read_bytes(), 7, b"", {}
    assert raw[:4] == b":W&B"
    while pos + 7 <= len(raw):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        pos += 7
        buf += raw[pos:pos + n]
        pos += n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                out.setdefault(rec.history.step.num, {}).update(items)
    return out


def test_wandb_offline_and_mlflow_file_store_get_every_row_and_sample_tables(small_cfg, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the default a user gets: offline
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    sess = rl.Session(small_cfg("run.trackers=[wandb,mlflow]", "run.save_rollouts_every=2", "run.tracker_samples=4",
                                "run.tensorboard=false"))
    run_dir = sess.run_dir
    rows = [sess.step() for _ in range(2)]
    path = sess.save("two")
    sess.close()
    again = rl.Session.load(path)  # the same run directory: the same W&B and MLflow runs continue
    assert again.run_dir == run_dir
    rows.append(again.step())
    again.close()
    written = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in written] == [1, 2, 3]

    # MLflow: one run, every step's numbers, the config as parameters, the samples table
    from mlflow import MlflowClient
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    run_id = (run_dir / "mlflow_id").read_text()
    history = client.get_metric_history(run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["reward/mean"]) for r in written]
    run = client.get_run(run_id)
    assert run.data.params["algo.kl_coef"] == str(sess.cfg.algo.kl_coef)
    assert run.info.status == "FINISHED"
    table = json.loads((run_dir / "mlruns").joinpath(run.info.experiment_id, run_id, "artifacts", "samples",
                                                     "step_000002.json").read_text())
    assert table["columns"][:4] == ["step", "prompt", "response", "reward"] and len(table["data"]) == 4
    prompts = {r[1] for r in table["data"]}
    assert len(prompts) == 4  # spread over the batch: one sample from each of 4 groups, not 4 of one prompt

    # W&B offline: the run's files hold each step (both sessions under one id) and the table
    wid = (run_dir / "wandb_id").read_text()
    logged = {}
    for f in sorted((run_dir / "wandb").glob(f"offline-run-*-{wid}/run-{wid}.wandb")):
        logged.update(_wandb_history(f))
    assert {s: v["reward/mean"] for s, v in logged.items() if "reward/mean" in v} == \
           {r["step"]: r["reward/mean"] for r in written}
    assert logged[2]["samples/nrows"] == 4  # a logged table is recorded under nested keys
    assert list((run_dir / "wandb").glob(f"offline-run-*-{wid}/files/media/table/samples_2_*.table.json"))


class _Broken:
    def write(self, step, row):
        raise ConnectionError("tracking server gone")

    def close(self):
        pass


def test_a_failing_tracker_is_dropped_and_the_rows_still_written(tmp_path, caplog):
    log = MetricsLog(tmp_path, tensorboard=False, trackers=[_Broken()])
    with caplog.at_level(logging.WARNING):
        log.log_step(1, {"reward/mean": 0.5})
        log.log_step(2, {"reward/mean": 0.6})
    log.close()
    assert [r["reward/mean"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0.5, 0.6]
    warnings = [r.message for r in caplog.records if "_Broken failed in write" in r.message]
    assert len(warnings) == 1 and "tracking server gone" in warnings[0]  # said once, then dropped


def test_a_tracker_that_is_not_installed_is_a_config_error(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(rl.ConfigError, match=r"wandb is not installed: pip install 'rlbench-nb\[wandb\]'"):
        rl.Config.load(None, ["run.trackers=[wandb]"])
