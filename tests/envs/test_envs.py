"""Environments and tools (rlbench_nb/envs): the interface a cell implements, tool schemas from signatures,
tool calls whose failures become observations, and environment steps that fail without failing the batch."""
import concurrent.futures
import threading
import time

import pytest

from rlbench_nb.envs import Env, Tool, ToolEnv, calculator, run_step
from rlbench_nb.errors import UsageError


class Arith(ToolEnv):
    tools = [calculator]
    max_turns = 2


def test_a_tool_is_described_by_its_signature_and_docstring():
    schema = Tool(calculator).schema["function"]
    assert schema["name"] == "calculator" and schema["parameters"]["required"] == ["expr"]
    assert schema["parameters"]["properties"]["expr"]["type"] == "string"
    assert "+, - and *" in schema["description"]

    def lookup(key):  # no type hint, no docstring: the model could not be told how to call it
        return key
    with pytest.raises(UsageError, match="tool 'lookup' cannot be described to the model .*type hint"):
        Tool(lookup)


def test_the_calculator_does_integer_arithmetic_and_nothing_else():
    assert [calculator(e) for e in ("1234+5678", "12*(3-5)", " -7 + 2 ", "99999999*99999999")] == \
           ["6912", "-24", "-5", str(99999999 * 99999999)]
    for bad in ("__import__('os').system('true')", "2**64", "7/2", "a+1", "1+", "1" * 65, "9" * 30 + "*" + "9" * 30):
        with pytest.raises(ValueError):
            calculator(bad)


def test_a_tool_episode_calls_reads_the_result_and_answers():
    env = Arith()
    assert env.reset({"prompt": "1234+5678=", "answer": "6912"}) == "1234+5678="
    assert env.step("<call>1234+5678</call>") == ("<result>6912</result>", 0.0, False)
    assert env.step(" 6912") == (None, 1.0, True)  # no call: the answer, scored against the row
    assert (env.calls, env.errors) == (1, 0)
    assert Arith().step('<call>{"name": "calculator", "arguments": {"expr": "2*3"}}</call>')[0] == "<result>6</result>"


def test_a_failing_tool_costs_a_turn_not_the_episode():
    def boom(x: str) -> str:
        """Always fails.

        Args:
            x: anything
        """
        raise RuntimeError("no network here")

    def slow(x: str) -> str:
        """Sleeps.

        Args:
            x: anything
        """
        time.sleep(3.0)
        return x

    class Tools(ToolEnv):
        tools = [boom, slow]
        tool_timeout_s = 0.2

    env = Tools()
    env.reset({"prompt": "p", "answer": "a"})
    calls = {'{"name": "boom", "arguments": {"x": "1"}}': "error: boom raised RuntimeError: no network here",
             '{"name": "slow", "arguments": {"x": "1"}}': "error: slow took longer than 0.2 s",
             '{"name": "nope", "arguments": {}}': "error: no tool 'nope'; tools: ['boom', 'slow']",
             '{"name": "slow", "arguments": {"y": 1}}': "error: slow takes ['x']; unknown ['y']; missing ['x']",
             '{"name": "slow"': "error: cannot read the call",
             "plain text": 'error: write the call as {"name": ..., "arguments": {...}}'}
    for call, want in calls.items():
        t0 = time.perf_counter()
        observation, reward, done = env.step(f"<call>{call}</call>")
        assert observation.startswith(f"<result>{want}") and (reward, done) == (0.0, False), observation
        assert time.perf_counter() - t0 < 2.0  # the hung tool (3 s) is not waited for
    assert (env.calls, env.errors) == (6, 6)


def test_hung_tool_calls_do_not_hold_up_the_calls_after_them():
    """Each call has a thread of its own: 40 calls still hanging (more than a 16-thread pool) leave the next
    call to run at once, where a pool would queue it behind them until its own timeout ran out."""
    release = threading.Event()

    def stuck(expr: str) -> str:
        """Hangs until released.

        Args:
            expr: anything
        """
        release.wait(30)
        return expr

    class Stuck(ToolEnv):
        tools = [stuck]
        tool_timeout_s = 0.05

    class Quick(ToolEnv):
        tools = [calculator]
        tool_timeout_s = 1.0

    try:
        with concurrent.futures.ThreadPoolExecutor(40) as pool:  # 40 episodes' steps at once, all hanging
            hung = list(pool.map(lambda _: Stuck().step("<call>1</call>")[0], range(40)))
        assert hung == ["<result>error: stuck took longer than 0.05 s</result>"] * 40
        assert Quick().step("<call>2+3</call>")[0] == "<result>5</result>"
    finally:
        release.set()


def test_a_call_that_cannot_get_a_thread_fails_alone(monkeypatch):
    """Past ThreadPerCall.MAX_THREADS (hung calls piling up), or when the OS refuses a thread, the call's future
    holds the error: the tool call becomes an error result, the environment step an episode's error."""
    from rlbench_nb.envs import ThreadPerCall
    monkeypatch.setattr(ThreadPerCall, "MAX_THREADS", 1)
    env = Arith()
    env.reset({"prompt": "p", "answer": "a"})
    observation, _, done = env.step("<call>1+2</call>")
    assert observation.startswith("<result>error: calculator raised RuntimeError: ") and "threads are running" \
        in observation and not done
    monkeypatch.setattr(ThreadPerCall, "MAX_THREADS", 10**6)

    def refuse(self):
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(threading.Thread, "start", refuse)
    step = run_step(Arith(), "<call>1+2</call>", ThreadPerCall(), timeout_s=1.0)
    assert step.error == "Arith.step raised RuntimeError: can't start new thread" and step.done


def test_an_environment_that_raises_hangs_or_answers_wrongly_ends_its_episode_only():
    class Raises(Env):
        def step(self, action_text):
            return {}["missing"]

    class Hangs(Env):
        def step(self, action_text):
            threading.Event().wait(3.0)

    class Wrong(Env):
        def step(self, action_text):
            return "obs", 1.0  # two values, not three

    class Fine(Env):
        def step(self, action_text):
            return f"[{action_text}]", 0.5, False

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        out = {cls.__name__: run_step(cls(), "x", pool, timeout_s=0.2) for cls in (Raises, Hangs, Wrong, Fine)}
    assert out["Raises"].done and out["Raises"].error == "Raises.step raised KeyError: 'missing'"
    assert out["Hangs"].done and out["Hangs"].error == "Hangs.step took longer than 0.2 s"
    assert out["Wrong"].done and out["Wrong"].error.startswith("Wrong.step must return (observation: str | None")
    assert (out["Fine"].observation, out["Fine"].reward, out["Fine"].done, out["Fine"].error) == ("[x]", 0.5, False,
                                                                                                  None)
    for step in out.values():  # a failed step scores nothing and says nothing more
        assert step.error is None or (step.observation, step.reward) == (None, 0.0)


def test_an_environment_written_in_a_cell_ships_to_workers():
    """Defined inside a function (as in a notebook cell): cloudpickle carries the class by value."""
    import cloudpickle

    class Countdown(ToolEnv):
        tools = [calculator]

        def score(self, row, answer_text):
            return float(answer_text.strip() == "0")

    env = cloudpickle.loads(cloudpickle.dumps(Countdown))()
    env.reset({"prompt": "3-3="})
    assert env.step("<call>3-3</call>")[0] == "<result>0</result>" and env.step("0") == (None, 1.0, True)
