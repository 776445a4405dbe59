"""LoRA RL (model.lora): only adapters train, the reference is the base with adapters off, the rollout engine
holds the merged weights, checkpoints hold the adapter and resume exactly."""
import shutil

import pytest
import torch

import rlbench_nb as rl
from rlbench_nb import checkpoint
from rlbench_nb.roles import lora as lora_util
from rlbench_nb.roles.policy import PolicyWorker, ReferenceWorker

from ..conftest import assert_rollout_holds_policy_weights

peft = pytest.importorskip("peft")

LORA = ["model.lora.r=4", "model.lora.alpha=8", "algo.kl_coef=0.05", "train.lr=1e-2", "run.tensorboard=false"]


def _tiny_peft_model(r=4, alpha=8, targets="all-linear"):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    lora = rl.Config.from_dict({}, [f"model.lora.r={r}", f"model.lora.alpha={alpha}",
                                    f"model.lora.target_modules={targets}"]).model.lora
    model = lora_util.add_adapters(model, lora)
    with torch.no_grad():  # peft starts B at 0 (a no-op adapter): give it values so that merging shows
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model, lora


def test_merged_weights_equal_peft_merge_and_the_adapted_forward():
    """merged_state (ours, from the gathered state) against peft's own merge_and_unload, and the merged
    model's logits against the adapted model's. fp32 with a different order of operations (x@W + s*(x@A)@B
    vs x@(W + s*B@A)): 1e-5 is ~100x the rounding seen, and an adapter merged with the wrong scale or a
    transposed product is off by >1e-2."""
    model, lora = _tiny_peft_model()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 32, (2, 7))
    with torch.no_grad():
        adapted_logits = model(input_ids=ids).logits
    ours = lora_util.merged_state(state, lora_util.scaling(lora))
    theirs = model.merge_and_unload().state_dict()
    assert ours.keys() == theirs.keys()
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=0, atol=1e-5, msg=k)
    from transformers import LlamaConfig, LlamaForCausalLM
    plain = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    plain.load_state_dict(ours)
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, adapted_logits, rtol=0, atol=1e-5)


def test_adapter_files_use_peft_names_and_round_trip():
    """adapter_state writes what peft's own save writes (PeftModel.from_pretrained reads it); the names go
    back to the live model's exactly."""
    from peft import get_peft_model_state_dict
    model, _ = _tiny_peft_model(targets="[q_proj,v_proj]")
    ours = lora_util.adapter_state(model.state_dict())
    assert set(ours) == set(get_peft_model_state_dict(model))
    assert len(ours) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    back = lora_util.adapter_to_model_names(ours)
    assert set(back) <= set(model.state_dict()) and len(back) == len(ours)


def test_lora_trains_adapters_only_against_the_base_as_reference(small_cfg, tmp_path):
    """Only adapters move and live in the optimizer; no reference worker exists, its log-probs are the
    base model's; the rollout engine holds the merged weights (verified at every sync); a checkpoint holds
    the adapter alone and resumes to the same next step."""
    sess = rl.Session(small_cfg(*LORA))
    assert "reference" not in sess.groups  # the policy with adapters off is the reference
    policy: PolicyWorker = sess.groups["policy"].workers[0]
    base = {k: v.clone() for k, v in policy.model.state_dict().items() if not lora_util.is_adapter(k)}
    trained = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trained and all(lora_util.is_adapter(n) for n in trained)
    in_optimizer = {id(p) for g in policy.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in policy.model.parameters() if p.requires_grad}

    rows = [sess.step() for _ in range(2)]
    assert rows[-1]["sync/verified"] == 1.0
    assert rows[-1]["kl/ref"] > 0  # the adapters moved the policy away from its reference
    after = policy.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())  # the base never moved
    assert_rollout_holds_policy_weights(sess)  # merged: base + (alpha/r) B @ A
    merged = sess.groups["policy"].call("get_weights")[0]
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           base["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])

    # the reference log-probs are the base model's, computed by a plain reference worker
    batch = sess.score(sess.rollout())
    plain = ReferenceWorker(sess.cfg.override("model.lora.r=0"), str(sess.task.model_dir))
    ref = policy.reference_logprobs(batch)["ref_logprobs_BR"]
    torch.testing.assert_close(ref, plain.compute_logprobs(batch)["ref_logprobs_BR"], rtol=0, atol=1e-6)
    assert not torch.allclose(ref, policy.compute_logprobs(batch)["old_logprobs_BR"], atol=1e-4)

    path = sess.save("adapter")
    files = {f.name for f in (path / "policy").iterdir()}
    assert files == {"adapter_model.safetensors", "adapter_config.json", "trainer_state.pt", "optimizer"}
    assert {f.name for f in (path / "policy" / "optimizer").iterdir()} == {"optimizer.safetensors",
                                                                          "param_groups.json"}
    # `rlbench-nb weights` merges the adapter into its base: the engine's weights, as a from_pretrained folder
    from transformers import AutoModelForCausalLM

    from rlbench_nb.checkpoint import export_weights
    exported = AutoModelForCausalLM.from_pretrained(str(export_weights(path, tmp_path / "merged"))).state_dict()
    engine = sess.groups["rollout"].call("get_weights")[0]
    assert exported.keys() == engine.keys() and all(torch.equal(exported[k], engine[k]) for k in engine)
    nxt = sess.step()
    sess.close()
    again = rl.Session.load(path, run_dir=tmp_path / "resumed")
    resumed = again.step()
    again.close()
    drop = ("time/", "throughput/", "memory/", "sync/s", "sync/verify_s")
    assert {k: v for k, v in resumed.items() if not k.startswith(drop)} == \
           {k: v for k, v in nxt.items() if not k.startswith(drop)}


def test_an_adapter_is_refused_on_another_base(small_cfg, tmp_path):
    """An adapter saved on one base model and loaded onto another would silently be another model."""
    sess = rl.Session(small_cfg(*LORA))
    path = sess.save("a")
    policy = sess.groups["policy"].workers[0]
    copy = tmp_path / "copy"
    shutil.copytree(path / "policy", copy)
    with torch.no_grad():  # the same config, but the base's weights are not those the adapter was trained on
        next(p for n, p in policy.model.named_parameters() if "base_layer" in n).add_(1.0)
    policy.base_fingerprint = lora_util.base_fingerprint(policy.model)
    with pytest.raises(ValueError, match="another base model"):
        policy.load(str(copy))
    (copy / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="holds no adapter"):
        policy.load(str(copy))
    sess.close()
    # loaded with LoRA turned off: refused naming the setting, before a run directory is made or claimed
    with pytest.raises(rl.CheckpointError, match=r"model\.lora\.r is 4 there, 0 here.*Set them as the "):
        rl.Session.load(path, run_dir=tmp_path / "plain", overrides=["model.lora.r=0"])
    assert not (tmp_path / "plain").exists()
    with pytest.raises(rl.CheckpointError, match=r"model\.lora\.r is 4 there, 0 here"):  # what sess.load(path) checks
        checkpoint.check_config(path, small_cfg())
    with rl.Session.load(path) as again:  # the refused loads claimed nothing: the run loads as it was
        assert again.run_dir == sess.run_dir


def test_lora_config_errors_name_the_fix(small_cfg):
    with pytest.raises(rl.ConfigError, match="model.lora.r"):
        small_cfg("model.lora.rank=4")
    with pytest.raises(ValueError, match="does not fit this model.*linear layers are .*q_proj"):
        _tiny_peft_model(targets="[qkv]")  # what the policy worker calls (a WorkerError carries it to the cell)


def test_a_session_whose_workers_fail_to_start_leaves_its_run_directory_free(small_cfg, tmp_path):
    """The constructor raised, so there is no session to close: it must not keep the run directory's lease
    (a corrected retry on the same folder was refused as 'in use by another session in this process')."""
    with pytest.raises(rl.RLBenchError, match="does not fit this model"):
        rl.Session(small_cfg(*LORA, "model.lora.target_modules=[qkv]"), run_dir=tmp_path / "run")
    rl.Session(small_cfg(*LORA), run_dir=tmp_path / "run").close()
