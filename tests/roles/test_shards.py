"""Sharded trainer state on disk (roles/shards.py), with real FSDP2 over gloo process groups: saved by 2 ranks,
each writing its own pieces, it loads onto 3 ranks and onto one unsharded process with the same weights and
the same optimizer state; nothing in the files is pickled."""
import faulthandler
import json
import os
import shutil
import signal
import socket
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlbench_nb.checkpoint import CheckpointError
from rlbench_nb.roles import distributed as dist_util
from rlbench_nb.roles import shards


def _model(seed: int, tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)  # hidden 24 over 3 ranks, vocab 37: uneven shards on 2 and on 3 ranks
    return LlamaForCausalLM(LlamaConfig(vocab_size=37, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                                        tie_word_embeddings=tied))


def _trained_or_fresh(seed: int, sharded: bool, steps: int, lr: float = 1e-2, tied: bool = False):
    model = _model(seed, tied)
    if sharded:
        dist_util.shard(model, torch.device("cpu"))
    # as roles/common.make_adamw: the fused kernel for plain tensors, torch's default for DTensors
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.8, 0.95), weight_decay=0.1,
                            fused=None if sharded else True)
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):  # every rank the same batch: the sharded run is the unsharded one split up
        ids = torch.randint(0, 37, (4, 10), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _full(model, opt, sharded: bool) -> dict:
    weights = dist_util.full_model_state(model, sharded)
    optim = dist_util.full_optimizer_state(model, opt, sharded) if sharded else None
    if not sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        optim = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {"weights": weights, "state": optim.get("state"), "groups": optim.get("param_groups")}  # {} off rank 0


def _worker(rank: int, world: int, port: int, job: str, folder: str, out: str) -> None:
    faulthandler.enable(all_threads=True)  # a native abort prints every thread's Python stack to stderr
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if job == "save":
            model, opt = _trained_or_fresh(0, True, steps=3)
            shards.save_tensors(Path(folder), shards.model_state(model), sharded=True)
            shards.save_optimizer(model, opt, Path(folder), sharded=True)
        else:
            model, opt = _trained_or_fresh(1, True, steps=0)  # other weights, an untouched optimizer
            shards.load_model(model, Path(folder))
            shards.load_optimizer(model, opt, Path(folder))
        full = _full(model, opt, True)
        if rank == 0:
            torch.save(full, out)
    finally:
        dist.destroy_process_group()


def _spawn(world: int, job: str, folder: Path, out: Path) -> dict:
    """Runs `job` on `world` gloo ranks. A rank that aborts natively (SIGABRT, "terminate called without an
    active exception": seen once in ~180 runs on a 2-core machine, raised in torch/gloo's C++, not by any Python
    here) gets one more run from scratch, with every thread's stack on stderr (faulthandler) and a warning in the
    run's summary, so a rerun shows even when the test passes; a Python error, a wrong result or a second abort
    fails the test."""
    try:
        return _run(world, job, folder, out)
    except mp.ProcessExitedException as e:
        if e.exit_code != -signal.SIGABRT:
            raise
        warnings.warn(f"rank {e.error_index} of the {job!r} job aborted natively (SIGABRT); running it once more",
                      stacklevel=2)
        if job == "save":  # what the aborted run wrote; a load job reads `folder`
            shutil.rmtree(folder, ignore_errors=True)
        return _run(world, job, folder, out)


def _run(world: int, job: str, folder: Path, out: Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(world, port, job, str(folder), str(out)), nprocs=world, start_method="spawn")
    return torch.load(out, weights_only=True)


def _assert_same(a: dict, b: dict) -> None:
    # exact: loading copies the saved numbers, nothing is recomputed
    assert a["weights"].keys() == b["weights"].keys()
    for k in a["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), k
    assert a["state"].keys() == b["state"].keys() and a["state"]
    for k in a["state"]:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a["state"][k][field].cpu(), b["state"][k][field].cpu()), (k, field)
    assert len(a["groups"]) == len(b["groups"])
    for ga, gb in zip(a["groups"], b["groups"]):
        assert (ga["lr"], tuple(ga["betas"]), ga["weight_decay"]) == (gb["lr"], tuple(gb["betas"]), gb["weight_decay"])


@pytest.mark.slow
def test_saved_by_two_ranks_loads_on_three_and_on_one(tmp_path):
    saved = _spawn(2, "save", tmp_path / "ckpt", tmp_path / "saved.pt")
    files = sorted(p.name for p in (tmp_path / "ckpt").rglob("*") if p.is_file())
    # each rank wrote its own weight and optimizer pieces; no pickled DCP .metadata
    assert sum(f.startswith("shard-") for f in files) == 4 and not any(f.endswith(".metadata") for f in files), files
    assert saved["state"] and all(int(v["step"]) == 3 for v in saved["state"].values())

    _assert_same(saved, _spawn(3, "load", tmp_path / "ckpt", tmp_path / "three.pt"))

    model, opt = _trained_or_fresh(1, False, steps=0)  # one process, no process group, plain tensors
    shards.load_model(model, tmp_path / "ckpt")
    shards.load_optimizer(model, opt, tmp_path / "ckpt")
    _assert_same(saved, _full(model, opt, False))
    assert opt.param_groups[0]["fused"] is True  # how it runs stays its own: DTensors saved it with fused=None

    (tmp_path / "ckpt" / "shard-00002-model-00001-of-00001.safetensors").unlink()  # a rank's file never arrived
    with pytest.raises(CheckpointError, match="saved by 2 ranks but holds 1 shard files: a rank's shard file is"):
        shards.load_model(model, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "shards.json").unlink()  # without the layout: the pieces do not cover every tensor
    with pytest.raises(CheckpointError, match="values of .*: a rank's shard file is missing|do not fit this model"):
        shards.load_model(model, tmp_path / "ckpt")


def test_whole_files_round_trip_and_refuse_another_model(tmp_path):
    """One rank (the local backend): whole files, read back through the same sharded loader; another model's
    optimizer state is refused by name before anything is copied."""
    model, opt = _trained_or_fresh(0, False, steps=2)
    shards.save_tensors(tmp_path, shards.model_state(model), sharded=False)
    shards.save_optimizer(model, opt, tmp_path, sharded=False)
    groups = json.loads((tmp_path / "optimizer" / "param_groups.json").read_text())
    assert groups[0]["lr"] == 1e-2 and groups[0]["betas"] == [0.8, 0.95] and "lm_head.weight" in groups[0]["params"]
    other, other_opt = _trained_or_fresh(1, False, steps=0, lr=5e-3)  # the saved learning rate comes back
    for p in other.parameters():  # left-over gradients (an update abandoned before its step) change nothing
        p.grad = torch.ones_like(p)
    shards.load_model(other, tmp_path)
    shards.load_optimizer(other, other_opt, tmp_path)
    _assert_same(_full(model, opt, False), _full(other, other_opt, False))
    assert other_opt.param_groups[0]["lr"] == 1e-2 and other_opt.param_groups[0]["fused"] is True

    from transformers import LlamaConfig, LlamaForCausalLM
    smaller = LlamaForCausalLM(LlamaConfig(vocab_size=37, hidden_size=24, intermediate_size=40, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(CheckpointError, match="other weights than this model trains"):
        shards.load_optimizer(smaller, torch.optim.AdamW(smaller.parameters()), tmp_path)
    wider = _model(0).__class__(LlamaConfig(vocab_size=37, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(CheckpointError, match=r"do not fit this model \(.* shape \[37, 24\], this model's is \[37, 32"):
        shards.load_model(wider, tmp_path)


def test_a_tied_embedding_is_saved_once_and_loads_back(tmp_path):
    """HF ties lm_head to the embedding: one parameter under two names, written once (as save_pretrained does)."""
    model, opt = _trained_or_fresh(0, False, steps=1, tied=True)
    state = shards.model_state(model)
    assert "lm_head.weight" not in state and "model.embed_tokens.weight" in state
    shards.save_tensors(tmp_path, shards.model_state(model), sharded=False)
    other, _ = _trained_or_fresh(1, False, steps=0, tied=True)
    shards.load_model(other, tmp_path)
    assert torch.equal(other.lm_head.weight, model.lm_head.weight)
    assert other.lm_head.weight is other.model.embed_tokens.weight
