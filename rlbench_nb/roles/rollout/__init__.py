"""Rollout engines, one interface: `generate(batch, params) -> Batch` of right-padded responses with the
sampled tokens' log-probs, `set_weights(state, version)`, `sleep()`/`wake_up()` (colocated mode),
`get_state()`/`set_state()` (exact resume), `memory()`, `close()`.

    hf_engine.py    transformers generate with KV cache (the CPU default; no extra install); on a CPU its decode
                    steps of Llama-style models are decode_step.py's, its linears skinny_linear.py's
    vllm_engine.py  one vllm.LLM per rollout worker (`rollout.engine: vllm`; `pip install rlbench-nb[vllm]`)
"""
from .hf_engine import HFRolloutWorker
from .vllm_engine import VLLMRolloutWorker

ENGINES = {"hf": HFRolloutWorker, "vllm": VLLMRolloutWorker}


def rollout_worker_class(engine: str):
    return ENGINES[engine]


__all__ = ["ENGINES", "HFRolloutWorker", "VLLMRolloutWorker", "rollout_worker_class"]
