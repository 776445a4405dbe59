"""Multi-turn environments: what a rollout talks to between the model's turns.

An `Env` is a small class written in a cell or a module: `reset(row)` gives the first observation (the prompt),
`step(action_text)` answers the model's turn with `(observation or None, reward, done)`. `ToolEnv` is the common
case: the model calls tools (plain Python functions with type hints and a docstring; their JSON schema comes
from the signature) by writing a call between tags, and each call's result, or its error, is the next
observation. `run_step` is how a rollout worker calls an environment: a step that raises or overruns its
time becomes an error, never a dead batch.
"""
from .base import Env, EnvStep, ThreadPerCall, check_env, load_env, run_step, run_steps
from .tools import Tool, ToolEnv, calculator

__all__ = ["Env", "EnvStep", "check_env", "load_env", "Tool", "ToolEnv", "calculator", "run_step", "run_steps",
           "ThreadPerCall"]
