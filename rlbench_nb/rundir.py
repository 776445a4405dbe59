"""The run directory: where everything a run writes goes (nothing else is written outside it but caches).

    runs/<run.name>/
      config.yaml               the resolved config
      metrics.jsonl, tb/        one row per step (and per evaluation), TensorBoard events
      controller_state.json     step, data position, KL controller, evals, trainers' optimizer steps:
                                rewritten in place after every step
      rollouts/step_N.jsonl     samples every run.save_rollouts_every steps
      rollouts/eval_step_N.jsonl  every evaluation's greedy responses and scores (sess.evaluate())
      checkpoints/<name>/       + checkpoints/latest
      summary.json              what the last run() ended with
      owner.json                the lease: which controller writes this run (see `Lease`)
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from pathlib import Path

from .config import Config
from .data.batch import SHOWN_FIELDS, Batch
from .errors import RLBenchError, RunDirError, SessionStateError, write_failure

LEASE_TTL_S = 900.0  # a holder on another machine that has not renewed for this long is taken as gone
RENEW_EVERY_S = LEASE_TTL_S / 15  # how often a holder rewrites its lease (Lease.renew)
_RELEASED: set[str] = set()  # tokens of leases this process gave up, whether or not their file could go


class RunInUseError(RLBenchError, RuntimeError):
    """Another live controller holds the run directory's lease."""




def fresh_run_dir(cfg: Config) -> Path:
    """<run.dir>/<run.name>, with a -2, -3, ... suffix when that exists: a new run never writes into an old one."""
    base = Path(cfg.run.dir) / cfg.run.name
    path, i = base, 1
    while path.exists():
        i += 1
        path = base.with_name(f"{base.name}-{i}")
    return path


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path).absolute()  # recorded absolute: a later cwd (a notebook's folder) changes nothing
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunDirError(e.errno, write_failure(self.path, e)) from None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def write_config(self, cfg: Config) -> None:
        write_text(self.path / "config.yaml", cfg.to_yaml())

    def write_state(self, state: dict) -> None:
        """controller_state.json, what `Session.attach` reads after a controller dies: rewritten in place after
        every step (`overwrite_json`)."""
        overwrite_json(self.path / "controller_state.json", state)

    def read_state(self) -> dict:
        path = self.path / "controller_state.json"
        try:
            return json.loads(path.read_text())
        except ValueError:  # half a file: a controller taken over this instant is writing it (one write)
            time.sleep(0.05)
            return json.loads(path.read_text())

    def write_summary(self, summary: dict) -> None:
        write_json(self.path / "summary.json", summary, indent=2)

    def write_rollouts(self, batch: Batch, step: int, kind: str = "step") -> Path:
        """rollouts/step_N.jsonl (see `rollout_rows`); kind="eval_step": an evaluation's greedy responses."""
        d = self.path / "rollouts"
        d.mkdir(exist_ok=True)
        path = d / f"{kind}_{step:06d}.jsonl"
        try:
            with path.open("w", encoding="utf-8") as f:
                for row in rollout_rows(batch):
                    f.write(json.dumps(row, default=str) + "\n")
        except OSError as e:  # no half file left to be read as the step's samples
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            raise RunDirError(e.errno, write_failure(path, e)) from None
        return path


def write_json(path: Path, data: dict, indent: int | None = None) -> None:
    """Replace a small JSON file atomically (write a sibling, then rename)."""
    write_text(path, json.dumps(data, indent=indent))


def overwrite_json(path: Path, data: dict) -> None:
    """`write_json` for a file rewritten every step: while the new text fits in the file, one write over it from
    its start, padded with spaces to its length (JSON ignores them). A process killed cannot tear one write into
    blocks the file already has, and it costs microseconds where a rename over the file costs ~0.15-0.6 ms of a
    busy step (ext4 starts the write-back of a file renamed over another). A text that does not fit replaces the
    file by rename, padded to a multiple of 4 KiB so that the next ones fit."""
    text = json.dumps(data)
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        fd = None
    except OSError as e:
        raise RunDirError(e.errno, write_failure(path, e)) from None
    if fd is not None:
        try:
            size = os.fstat(fd).st_size
            if len(text) <= size:  # json.dumps writes ASCII: one byte a character
                if os.pwrite(fd, text.ljust(size).encode(), 0) != size:
                    raise OSError(5, "short write")
                return
        except OSError as e:
            raise RunDirError(e.errno, write_failure(path, e)) from None
        finally:
            os.close(fd)
    write_text(path, text.ljust(-(-len(text) // 4096) * 4096))


def write_text(path: Path, text: str) -> None:
    """Replace a small text file atomically; a failure is a RunDirError that says why (errors.write_failure)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as e:
        with contextlib.suppress(OSError):  # a read-only file system refuses even removing nothing
            tmp.unlink(missing_ok=True)
        raise RunDirError(e.errno, write_failure(path, e)) from None


# ---- one owner per run -----------------------------------------------------------------------------
def _process_start(pid: int) -> str | None:
    """The process's start time (Linux /proc): tells a live holder from a new process that reused its pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class Lease:
    """Which controller writes a run directory: RUN_DIR/owner.json names it (token, host, pid, process
    start time); every step checks that it is still this controller's (`renew`). A second controller — a
    re-run notebook cell, another kernel attaching the same detached run, `Session.load` of a run that is still
    training — is refused while the holder lives, unless it takes over (`take_over=True`); the old holder then
    finds the lease gone at its next step and stops writing. A holder on this machine is alive while its process
    is; one elsewhere, while it renewed within LEASE_TTL_S."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "owner.json"
        self.token = uuid.uuid4().hex
        self.me = {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                   "start": _process_start(os.getpid()), "dir": str(run_dir)}
        self.since: float | None = None  # when this controller took the run
        self._mine: tuple | None = None  # the lease file as this controller last wrote it (_signature)
        self._written: float | None = None  # when this controller last wrote it (monotonic)

    def holder(self) -> dict | None:
        """The recorded holder, or None (no lease, an unreadable one, or one copied along with the run
        from another directory: it holds that directory, not this one)."""
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return holder if holder.get("dir") == self.me["dir"] else None

    @staticmethod
    def alive(holder: dict) -> bool:
        if holder.get("token") in _RELEASED:
            return False
        if holder.get("host") == socket.gethostname():
            return _process_start(holder.get("pid", -1)) == holder.get("start") is not None
        return time.time() - holder.get("renewed", 0) < LEASE_TTL_S

    @staticmethod
    def describe(holder: dict) -> str:
        here = holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()
        who = "another session in this process" if here else f"process {holder.get('pid')} on {holder.get('host')}"
        return f"{who} (since {time.strftime('%H:%M:%S', time.localtime(holder.get('since', 0)))})"

    def acquire(self, take_over: bool = False) -> None:
        holder = self.holder()
        if holder and holder.get("token") != self.token and self.alive(holder) and not take_over:
            raise RunInUseError(f"run directory {self.path.parent} is in use by {self.describe(holder)}: close "
                                "that session first (sess.close()), or pass take_over=True to take the run over "
                                "(the other session then stops writing it)")
        self.renew(since=time.time())

    def renew(self, since: float | None = None) -> None:
        """The step's fence: a plain renew (no `since`: not `acquire`) first rereads the file and raises if the
        lease is no longer ours, so a session taken over mid-step never takes it back; it rewrites the file with a
        fresh time only once its last write is RENEW_EVERY_S old. That time only tells a holder on another machine
        from a dead one, over LEASE_TTL_S: a write every step bought nothing and cost ~0.2-0.8 ms of a busy tiny
        step (on ext4 a rename over a file starts its write-back)."""
        if since is None:
            self.check("renew the run's lease", reread=True)
            if self._written is not None and time.monotonic() - self._written < RENEW_EVERY_S:
                return
        self.since = since or self.since or time.time()
        write_json(self.path, {**self.me, "since": self.since, "renewed": time.time()})
        self._mine = self._signature()
        self._written = time.monotonic()

    def _signature(self) -> tuple | None:
        """(inode, modification ns, size) of the lease file: every write replaces the file (a new inode), so an
        unchanged signature is the file this controller wrote, found with no read (each phase checks)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def holds(self, reread: bool = False) -> bool:
        """Whether this controller still holds the run (gone counts as not: the taker may have closed since).
        `reread`: read the file even when its signature is this controller's own write (before writing the
        run: a network file system may show a stale signature for a few seconds)."""
        if not reread and self._mine is not None and self._signature() == self._mine:
            return True
        holder = self.holder()
        return holder is not None and holder.get("token") == self.token

    def check(self, what: str, reread: bool = False) -> None:
        """Raise if another controller took the run over: this one must not write it any more."""
        if not self.holds(reread):
            holder = self.holder()
            who = self.describe(holder) if holder else "another session, which has released it since"
            raise SessionStateError(f"cannot {what}: run directory {self.path.parent} was taken over by "
                                    f"{who}; this session no longer writes it — close it")

    def release(self) -> None:
        """Give the run up. A lease file that cannot be removed (a read-only disk) is still released for this
        process: `alive` no longer counts its token, so the next session here may take the run."""
        _RELEASED.add(self.token)
        if self.holds(reread=True):  # never another controller's file
            with contextlib.suppress(OSError):
                self.path.unlink(missing_ok=True)


# ---- rollout files: what people read, and what a replay needs --------------------------------------
TOKENS = "tokens"  # the per-row field holding token ids; the inspector leaves it out of its table


def rollout_rows(batch: Batch) -> list[dict]:
    """One dict per sample: the names people see (`Batch.shown_fields`), the group, and under "tokens"
    what `load_rollouts` needs to rebuild the batch exactly: prompt and response token ids, the sampled
    log-probs, and the padded widths of the batch they came from (the same shapes give the same numbers)."""
    fields = batch.shown_fields() | ({"group": "group"} if "group" in batch else {})
    rows = batch.rows(fields)
    if "prompt_ids_BP" not in batch or "response_ids_BR" not in batch:
        return rows
    p_ids, p_mask = batch["prompt_ids_BP"], batch["prompt_mask_BP"].bool()
    r_ids, r_mask = batch["response_ids_BR"], batch["response_mask_BR"].bool()
    logprobs = batch.get("rollout_logprobs_BR")
    loss_mask = batch.get("loss_mask_BR")  # episodes: which response tokens the model wrote
    widths = [p_ids.shape[1], r_ids.shape[1]]
    pad = int(p_ids[~p_mask][0]) if (~p_mask).any() else None
    for i, row in enumerate(rows):
        tokens = {"prompt": p_ids[i][p_mask[i]].tolist(), "response": r_ids[i][r_mask[i]].tolist(),
                  "widths": widths, "pad": pad}
        if logprobs is not None:
            tokens["logprobs"] = logprobs[i][r_mask[i]].tolist()  # float32 -> JSON -> float32 is exact
        if loss_mask is not None:
            tokens["loss_mask"] = loss_mask[i][r_mask[i]].tolist()
        row[TOKENS] = tokens
    return rows


def load_rollouts(path: str | Path, pad_id: int | None = None) -> Batch:
    """A batch rebuilt from a rollouts/step_N.jsonl file: tokens, masks, sampled log-probs, scores, groups
    and the dataset row's fields, padded to the widths they were generated with. `sess.score(batch)`
    re-scores it (the file's rewards stay beside as `reward_before`); `sess.replay(batch)` trains on it."""
    import torch
    path = Path(path)
    try:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RLBenchError(f"cannot read rollouts from {path}: {e}") from None
    if not rows:
        raise RLBenchError(f"{path} holds no rollouts")
    if any(TOKENS not in r for r in rows):
        raise RLBenchError(f"{path} holds text only (written before rollout files kept token ids): it can be "
                           "inspected and re-scored from text, but not replayed")
    P = max(r[TOKENS]["widths"][0] for r in rows)
    R = max(r[TOKENS]["widths"][1] for r in rows)
    pad = rows[0][TOKENS].get("pad")
    pad = pad if pad is not None else (pad_id if pad_id is not None else 0)
    B = len(rows)
    tensors = {"prompt_ids_BP": torch.full((B, P), pad, dtype=torch.long),
               "prompt_mask_BP": torch.zeros(B, P, dtype=torch.long),
               "response_ids_BR": torch.full((B, R), pad, dtype=torch.long),
               "response_mask_BR": torch.zeros(B, R, dtype=torch.long)}
    has_logprobs = all("logprobs" in r[TOKENS] for r in rows)
    if has_logprobs:
        tensors["rollout_logprobs_BR"] = torch.zeros(B, R, dtype=torch.float32)
    has_loss_mask = any("loss_mask" in r[TOKENS] for r in rows)
    if has_loss_mask:
        tensors["loss_mask_BR"] = torch.zeros(B, R, dtype=torch.long)
    for i, r in enumerate(rows):
        t = r[TOKENS]
        n, m = len(t["prompt"]), len(t["response"])
        tensors["prompt_ids_BP"][i, P - n:] = torch.tensor(t["prompt"], dtype=torch.long)
        tensors["prompt_mask_BP"][i, P - n:] = 1
        tensors["response_ids_BR"][i, :m] = torch.tensor(t["response"], dtype=torch.long)
        tensors["response_mask_BR"][i, :m] = 1
        if has_logprobs:
            tensors["rollout_logprobs_BR"][i, :m] = torch.tensor(t["logprobs"], dtype=torch.float32)
        if has_loss_mask:
            tensors["loss_mask_BR"][i, :m] = torch.tensor(t.get("loss_mask", [1] * m), dtype=torch.long)
    tensors["response_len_B"] = tensors["response_mask_BR"].sum(-1)
    known = set(SHOWN_FIELDS) | {"group", TOKENS}
    row_fields = sorted({k for r in rows for k in r} - known)
    meta = {"prompt": [r["prompt"] for r in rows], "response": [r["response"] for r in rows],
            "group": [r.get("group", f"row-{i}") for i, r in enumerate(rows)],
            **{k: [r.get(k) for r in rows] for k in row_fields}}
    for shown, field in (("turns", "num_turns_B"), ("tool_calls", "tool_calls_B")):  # episodes
        if all(r.get(shown) is not None for r in rows):
            tensors[field] = torch.tensor([int(r[shown]) for r in rows])
    if any("env_error" in r for r in rows):
        meta["env_error"] = [r.get("env_error") or "" for r in rows]
    if all("reward" in r for r in rows):
        tensors["scores_B"] = torch.tensor([float(r["reward"]) for r in rows], dtype=torch.float32)
        meta["reward_error"] = [r.get("reward_error") for r in rows]
        if any(r.get("reward_parts") for r in rows):
            meta["reward_parts"] = [r.get("reward_parts") for r in rows]
    return Batch(tensors, meta, {"row_fields": row_fields, "source": str(path)})
