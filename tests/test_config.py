import pytest

from rlbench_nb.config import Config, ConfigError, all_keys, help_text

from .conftest import REPO


def test_shipped_configs_load():
    for name in ("arith_grpo", "arith_ppo", "arith_rloo", "arith_ppo_rm"):
        cfg = Config.load(REPO / "configs" / f"{name}.yaml")
        assert cfg.run.name == name.replace("_", "-")
    assert Config.load(REPO / "configs/arith_ppo.yaml").uses_critic
    rm = Config.load(REPO / "configs/arith_ppo_rm.yaml")  # the learned reward alone: the verifier only measures
    assert rm.uses_critic and rm.reward.model.path == "task" and rm.reward.rule_weight == 0
    assert not Config.load(REPO / "configs/arith_grpo.yaml").uses_critic
    for path in sorted((REPO / "configs").glob("*.yaml")):  # every shipped file, as a user would load it
        assert Config.load(path).run.name == path.stem.replace("_", "-"), path.name
    real = Config.load(REPO / "configs/gsm8k_smollm2_cpu.yaml")  # its system prompt keeps the example's lines
    assert real.data.system_prompt.endswith("So he paid 20*5.5=$110\n#### 110") and real.data.test_size == 32


def test_overrides_are_typed_and_applied():
    cfg = Config.load(REPO / "configs/arith_grpo.yaml", ["algo.kl_coef=0.01", "rollout.n=4", "algo.dual_clip=3"])
    assert cfg.algo.kl_coef == 0.01 and cfg.rollout.n == 4 and cfg.algo.dual_clip == 3.0
    assert cfg.uses_reference
    assert cfg.override("algo.kl_coef=0").algo.kl_coef == 0.0


def test_off_is_the_word_off_and_still_a_false_bool(tmp_path):
    """YAML 1.1 reads off/no/on/yes as booleans: `algo.rollout_is=off` (one of 'off', 'tis', 'mis') was refused as
    False. As YAML 1.2 does, only true/false are booleans, in overrides and files; a bool setting reads the words."""
    cfg = Config.load(None, ["algo.rollout_is=off", "run.tensorboard=off", "data.shuffle=no", "run.deterministic=yes"])
    assert cfg.algo.rollout_is == "off" and cfg.run.tensorboard is False and cfg.data.shuffle is False
    assert cfg.run.deterministic is True
    path = tmp_path / "c.yaml"
    path.write_text("algo:\n  rollout_is: off\nrun:\n  tensorboard: off\n")
    cfg = Config.load(path)
    assert cfg.algo.rollout_is == "off" and cfg.run.tensorboard is False
    again = tmp_path / "again.yaml"
    again.write_text(cfg.to_yaml())
    assert Config.load(again) == cfg


@pytest.mark.parametrize("override, message", [
    ("algo.kl_coeff=0.1", "unknown config key 'algo.kl_coeff' (did you mean 'algo.kl_coef'?)"),
    ("algo.klcoef=0.1", "did you mean 'algo.kl_coef'?"),
    ("rollout.temprature=0.5", "did you mean 'rollout.temperature'?"),
    ("algos.kl_coef=0.1", "did you mean 'algo.kl_coef'?"),
    ("algo.kl_coef=abc", "invalid value for 'algo.kl_coef': 'abc'"),
    ("rollout.top_p=1.5", "invalid value for 'rollout.top_p': 1.5 — Input should be less than or equal to 1"),
    ("algo.advantage=ppo", "invalid value for 'algo.advantage': 'ppo'"),
    ("task.ops=+/", "unknown operator(s) ['/']"),
    ("rollout.n=1", "algo.advantage=grpo compares samples of one prompt: set rollout.n to 2 or more"),
    ("algo.kl_coef", "override 'algo.kl_coef' must look like key=value"),
    # bounds that follow the math: a ratio clipped below at 1 - 2 < 0 clips nothing; an infinite step size
    ("algo.clip_low=2", "invalid value for 'algo.clip_low': 2 — Input should be less than 1"),
    ("train.lr=inf", "invalid value for 'train.lr': 'inf' — Input should be a finite number"),
    ("algo.kl_coef=nan", "invalid value for 'algo.kl_coef': 'nan' — Input should be a finite number"),
    ("run.name=../../evil", "a plain folder name is needed"),
])
def test_bad_overrides_give_one_clear_line(override, message):
    with pytest.raises(ConfigError) as e:
        Config.load(REPO / "configs/arith_grpo.yaml", [override])
    text = str(e.value)
    assert message in text
    assert "\n" not in text


def test_typo_inside_yaml_file_is_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("algo:\n  advantage: grpo\n  clip_hihg: 0.3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'algo.clip_hihg' \(did you mean 'algo.clip_high'\?\)"):
        Config.load(p)
    p.write_text("algo: [1, 2]\n")
    with pytest.raises(ConfigError, match="'algo'"):
        Config.load(p)
    with pytest.raises(ConfigError, match="config file not found"):
        Config.load(tmp_path / "missing.yaml")


def test_yaml_round_trip_and_help(tmp_path):
    cfg = Config.load(REPO / "configs/arith_ppo.yaml", ["train.betas=[0.8, 0.95]"])
    cfg.save(tmp_path / "c.yaml")
    again = Config.load(tmp_path / "c.yaml")
    assert again == cfg and again.train.betas == (0.8, 0.95)
    text = help_text()
    for key in all_keys():
        assert key in text
    assert "Dr. GRPO" in text  # field help carries the science



def test_a_cut_softmax_on_vllm_is_refused_where_its_log_probs_would_be_compared():
    # vLLM records log-probs after top-k / top-p (renormalised): the monitor and IS would measure the cut
    base = ["rollout.engine=vllm", "rollout.top_p=0.9"]
    with pytest.raises(ConfigError, match="rollout.engine=vllm with rollout.top_p=0.9 / top_k=0: vLLM returns"):
        Config.load(None, base)
    with pytest.raises(ConfigError, match="algo.mismatch_alarm=null, algo.rollout_is=off"):
        Config.load(None, [*base, "algo.mismatch_alarm=null", "algo.rollout_is=tis"])
    assert Config.load(None, [*base, "algo.mismatch_alarm=null"]).rollout.truncates
    assert not Config.load(None, [*base, "rollout.temperature=0"]).rollout.truncates  # greedy cuts nothing
    assert Config.load(None, ["rollout.top_k=5"]).rollout.truncates  # the HF engine records the whole softmax
    assert not Config.load(None, ["rollout.engine=vllm"]).rollout.truncates


def test_async_steps_refuse_a_second_correction_and_vllms_cut_log_probs():
    from rlbench_nb.errors import UsageError
    from rlbench_nb.runner import check_run_args
    with pytest.raises(UsageError, match="async_rollout with algo.rollout_is=tis: an async step's PPO ratio"):
        check_run_args(Config.load(None, ["algo.rollout_is=tis"]), True, 1, "raise")
    check_run_args(Config.load(None, ["algo.rollout_is=tis"]), False, 1, "raise")
    cut = Config.load(None, ["rollout.engine=vllm", "rollout.top_k=20", "algo.mismatch_alarm=null"])
    with pytest.raises(UsageError, match="old log-probs are the engine's, which vLLM gives after the cut"):
        check_run_args(cut, True, 1, "raise")
    check_run_args(Config.load(None, ["rollout.top_k=20"]), True, 1, "raise")


def test_colocated_rollout_needs_one_engine_per_policy_rank():
    with pytest.raises(ConfigError, match=r"rollout.colocate runs one rollout engine in each policy process: "
                                          r"set cluster.rollout_ranks=2 \(= cluster.train_ranks\), not 1"):
        Config.load(None, ["cluster.backend=ray", "rollout.colocate=true", "cluster.train_ranks=2"])
    cfg = Config.load(None, ["cluster.backend=ray", "rollout.colocate=true", "cluster.train_ranks=2",
                             "cluster.rollout_ranks=2"])
    assert cfg.rollout.colocate


def test_files_that_would_lose_a_section_or_cannot_be_read_are_one_line_errors(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("algo:\n  kl_coef: 0.1\nrollout:\n  n: 4\nalgo:\n  clip_high: 0.3\n")  # a section pasted twice
    with pytest.raises(ConfigError, match=r"c.yaml is not valid YAML: 'algo' appears twice \(lines 1 and 5\); merge"):
        Config.load(p)
    p.write_bytes("algo:\n  advantage: grpo  # caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"c.yaml is not UTF-8 text \(byte 30: .*\): save it as UTF-8"):
        Config.load(p)
    p.write_text("\n")  # a failed copy, not a wish for every default
    with pytest.raises(ConfigError, match="c.yaml is empty"):
        Config.load(p)


def test_nested_sections_take_dotted_overrides_and_name_typos():
    """model.lora is a section inside a section: its keys override like any other, typos get the nearest
    key, and a whole section set to a scalar says which keys it has."""
    cfg = Config.load(None, ["model.lora.r=8", "model.lora.target_modules=[q_proj,v_proj]"])
    assert cfg.model.lora.r == 8 and cfg.model.lora.target_modules == ["q_proj", "v_proj"]
    assert Config.from_dict({"model": {"lora": {"alpha": 4}}}).model.lora.alpha == 4
    with pytest.raises(ConfigError, match=r"unknown config key 'model.lora.rank' \(did you mean 'model.lora.r'\?\)"):
        Config.load(None, ["model.lora.rank=8"])
    with pytest.raises(ConfigError, match=r"'model.lora' is a section: set one of its keys \(e.g. model.lora.r=...\)"):
        Config.load(None, ["model.lora=8"])
    with pytest.raises(ConfigError, match="model.lora.r"):
        Config.load(None, ["model.lora.r=-1"])
    assert "model.lora.target_modules" in help_text()


def test_run_refuses_a_step_count_that_is_not_a_whole_number_before_anything_runs():
    """sess.run(steps=-1) evaluated twice and saved a checkpoint for no step; run(steps="5") failed deep inside."""
    from rlbench_nb.errors import UsageError
    from rlbench_nb.runner import check_run_args
    cfg = Config.load(None, [])
    for steps in (-1, "5", 2.5, True):
        with pytest.raises(UsageError, match=rf"steps={steps!r}: a whole number of steps.*0 or more \(None: run.steps"):
            check_run_args(cfg, False, 1, "raise", steps)
    for steps in (None, 0, 3):
        check_run_args(cfg, False, 1, "raise", steps)


def test_one_override_given_as_a_string_is_one_override():
    """rl.Session(path, "algo.kl_coef=0.1") read the string's characters as overrides: "override 'a' must look like
    key=value"."""
    assert Config.load(None, "algo.kl_coef=0.25").algo.kl_coef == 0.25
    assert Config.of(Config.load(None), "train.lr=0.5").train.lr == 0.5
    assert Config.of(Config.load(None), ["train.lr=0.5", "algo.kl_coef=0.25"]).algo.kl_coef == 0.25
