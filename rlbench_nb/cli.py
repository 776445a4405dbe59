"""The `rlbench-nb` command.

    rlbench-nb train configs/arith_grpo.yaml                 # a GRPO run with a progress bar and a summary
    rlbench-nb train configs/arith_ppo.yaml algo.kl_coef=0.01 --steps 20
    rlbench-nb train --resume runs/arith-grpo                # continue from the run's latest checkpoint
    rlbench-nb train --help                                  # every config field, its default and meaning
    rlbench-nb export notebooks/01_quickstart.ipynb -o train.py   # the notebook as a batch script (or --format marimo)
    rlbench-nb report runs/arith-grpo -o report.html         # a run as one HTML file (curves, samples, config)
    rlbench-nb weights runs/arith-grpo -o my-model           # a checkpoint's policy as a from_pretrained folder
    rlbench-nb kernel install [--ray-address HOST:PORT]      # the Jupyter kernel, extension loaded
    rlbench-nb data gsm8k Downloads/gsm8k -o data/gsm8k       # a published dataset -> prompt files (or: math)
    rlbench-nb doctor configs/arith_grpo.yaml                # certify a session before a long run (exit 1: a failure)
    rlbench-nb serve configs/arith_grpo.yaml --port 8000     # the Tinker API over a session (docs/tinker.md)
    rlbench-nb up                                            # a warm cluster that outlives kernels (docs/ray.md)
    rlbench-nb down                                          # stops it
"""
from __future__ import annotations

import argparse
import logging
import sys

from .config import help_text
from .errors import RLBenchError


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlbench-nb train", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train with the phases rollout -> score -> prepare -> update, then print a summary.",
        epilog="config fields (override any with key=value):\n" + help_text())
    p.add_argument("config", nargs="?", help="YAML config file (e.g. configs/arith_grpo.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.kl_coef=0.01 run.seed=3")
    p.add_argument("--steps", type=int, help="training steps (default: run.steps)")
    p.add_argument("--run-dir", help="run directory (default: run.dir/run.name, made unique)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def summary_table(summary: dict) -> str:
    from .report import held_out_name
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    rows = [
        ("held-out accuracy",
         f"{before:.3f} -> {after:.3f}  ({after - before:+.3f}, {summary['eval_prompts']} prompts, greedy)"),
        *[(f"held-out {held_out_name(k)}", f"{b:.3f} -> {a:.3f}  ({a - b:+.3f})")
          for k, (b, a) in summary.get("eval_before_after", {}).items()],
        ("train reward", f"{summary['reward_first']:.3f} (first steps) -> {summary['reward_last']:.3f} (last steps)"
         if summary["reward_first"] is not None else "-"),
        ("steps", f"{summary['steps']} ({summary['steps_this_run']} this run)"),
        ("wall time", f"{summary['wall_s']:.1f} s"),
        ("run directory", summary["run_dir"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def train(argv: list[str]) -> int:
    args = _train_parser().parse_intermixed_args(argv)  # flags may sit between the config and overrides
    import transformers

    from .session import Session
    transformers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    if args.resume:
        sess = Session.load(args.resume, overrides=([args.config] if args.config else []) + args.overrides)
        steps = args.steps if args.steps is not None else max(sess.cfg.run.steps - sess.step_count, 0)
    else:
        if not args.config:
            print("rlbench-nb train: give a config file (or --resume RUN_DIR)", file=sys.stderr)
            return 2
        sess = Session(args.config, overrides=args.overrides, run_dir=args.run_dir)
        steps = args.steps
    print(f"run directory: {sess.run_dir}", flush=True)
    with sess:
        try:
            summary = sess.run(steps, progress=not args.quiet)
        except KeyboardInterrupt:
            print(save_on_interrupt(sess, f"rlbench-nb train --resume {sess.run_dir}"), file=sys.stderr)
            return 130
    print("\n" + summary_table(summary))
    return 0


def save_on_interrupt(sess, resume_command: str) -> str:
    """Ctrl-C in a batch run: checkpoint where it stands (the interrupted step either completed or never
    started: phases hold Ctrl-C until they end) and say how to continue."""
    try:
        path = sess.save(f"step_{sess.step_count}")
    except Exception as e:  # noqa: BLE001 - the message says what is left
        return f"\ninterrupted at step {sess.step_count}; the checkpoint could not be written ({e})"
    return f"\ninterrupted at step {sess.step_count}: checkpoint saved in {path}\ncontinue with: {resume_command}"


def save_live_sessions(resume_command: str) -> None:
    """What an exported script does on Ctrl-C: save every open session (`{run_dir}` in the command is
    replaced by each one's run directory), then exit 130."""
    from .session import live_sessions
    for sess in live_sessions():
        print(save_on_interrupt(sess, resume_command.format(run_dir=sess.run_dir)), file=sys.stderr)
    raise SystemExit(130)


def export(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rlbench-nb export", description="Notebook -> batch script (never executes it).")
    p.add_argument("notebook")
    p.add_argument("-o", "--output", help="output file (default: the notebook's name with .py, in this folder)")
    p.add_argument("--force", action="store_true", help="replace an existing output that is not an earlier export")
    p.add_argument("--format", default="script", choices=["script", "py:percent", "marimo"],
                   help="'script': runnable with flags; 'py:percent': jupytext round trip, tags kept; 'marimo': a "
                        "marimo notebook, also runnable with flags (python NB.py --steps 500)")
    args = p.parse_args(argv)
    from pathlib import Path

    from .export import export as do_export
    out = do_export(args.notebook, args.output or Path(args.notebook).with_suffix(".py").name, args.format, args.force)
    print(f"wrote {out}")
    return 0


def report(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="rlbench-nb report", description="A run directory as one standalone HTML file: the dashboard's curves, "
        "the summary, rollout samples and the config; opens in any browser without a kernel or network.")
    p.add_argument("run_dir", help="a run directory (e.g. runs/arith-grpo)")
    p.add_argument("-o", "--output", help="output file (default: RUN_DIR/report.html)")
    p.add_argument("--smoothing", type=float, default=0.0, help="EMA weight for noisy curves, 0 to 0.99 (default 0)")
    args = p.parse_args(argv)
    if not 0.0 <= args.smoothing < 1.0:
        p.error(f"--smoothing must be in [0, 1): got {args.smoothing}")
    from .report import report_from_run_dir
    print(f"wrote {report_from_run_dir(args.run_dir, args.output, args.smoothing)}")
    return 0


def weights(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="rlbench-nb weights", description="A checkpoint's policy as a Hugging Face model folder (whole "
        "model.safetensors, config, tokenizer) that from_pretrained and vLLM load, however many ranks saved it.")
    p.add_argument("checkpoint", help="a checkpoint folder, or a run directory (its latest checkpoint)")
    p.add_argument("-o", "--output", required=True, help="folder to write (must not exist or be empty)")
    args = p.parse_args(argv)
    from .checkpoint import export_weights
    print(f"wrote {export_weights(args.checkpoint, args.output)}")
    return 0


def kernel(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rlbench-nb kernel",
                                description="Install the Jupyter kernel for this environment.")
    p.add_argument("action", choices=["install"])
    p.add_argument("--name", default="rlbench-nb")
    p.add_argument("--display-name", default="Python (rlbench-nb)")
    p.add_argument("--ray-address", help="Ray cluster every session in this kernel attaches to (sets RAY_ADDRESS)")
    p.add_argument("--prefix", help="install under PREFIX/share/jupyter/kernels instead of the user's folder")
    args = p.parse_args(argv)
    from .kernelspec import install
    path = install(args.name, args.display_name, args.ray_address, prefix=args.prefix)
    print(f"installed kernel '{args.name}' in {path}")
    return 0


def data(argv: list[str]) -> int:
    from .data.prepare import INSTRUCTIONS, prepare
    p = argparse.ArgumentParser(prog="rlbench-nb data", description="A math dataset you downloaded, in its "
                                "published schema (Parquet or JSONL), as prompt files: DIR/train.jsonl, "
                                "DIR/test.jsonl with 'prompt' and 'answer'. Nothing is downloaded.")
    p.add_argument("dataset", choices=sorted(INSTRUCTIONS))
    p.add_argument("src", help="the dataset's file, or the folder holding its files")
    p.add_argument("-o", "--output", required=True, help="folder to write train.jsonl / test.jsonl into")
    args = p.parse_args(argv)
    done = prepare(args.dataset, args.src, args.output)
    for split, path in done.files.items():
        print(f"{split}: {done.rows[split]} rows -> {path}")
    if done.skipped:
        print(f"skipped {len(done.skipped)} row(s) without a usable answer; first: "
              + "; ".join(done.skipped[:3]), file=sys.stderr)
    reward = "gsm8k" if args.dataset == "gsm8k" else "boxed_math"
    train, test = done.files.get("train"), done.files.get("test")
    print("use with: " + " ".join(x for x in (f"data.train_path={train}" if train else "",
                                             f"data.test_path={test}" if test else "",
                                             f"reward.fn=rlbench_nb.rewards:{reward}") if x))
    return 0


def doctor(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rlbench-nb doctor", description="Start a session on CONFIG in a temporary "
                                "run directory, run sess.doctor() (one line per check: the engine against the "
                                "trainer, an update at learning rate 0, the samples, the reward, settings that do "
                                "nothing) and close it. Exit 1 when a check fails.")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="config overrides, section.key=value")
    p.add_argument("--rows", type=int, default=4, help="training prompts to roll out (default 4)")
    args = p.parse_args(argv)
    import tempfile
    from pathlib import Path

    from .session import Session
    with tempfile.TemporaryDirectory(prefix="rlbench-nb-doctor-") as tmp:
        with Session(args.config, args.overrides, run_dir=Path(tmp) / "run") as sess:
            report = sess.doctor(args.rows)
    print(report)
    return 0 if report.ok else 1


def _port(text: str) -> int:
    """--port's value, checked before the session starts (uvicorn would wrap 99999999 to 57599)."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port: 1-65535, or 0 for a free one")
    return int(text)


def serve(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rlbench-nb serve", description="Start a session on CONFIG and serve it over the "
                                "Tinker API (the tinker SDK and tinker-cookbook recipes train its policy and sample "
                                "from its engines) until Ctrl-C. Prints the base URL and the API key a client needs.")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="config overrides, section.key=value")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="port (0: a free one; default 8000)")
    p.add_argument("--api-key", help="the key clients must send (tml-...); default: a new random one")
    args = p.parse_args(argv)
    import time

    from .session import Session
    with Session(args.config, args.overrides) as sess:
        srv = sess.serve_tinker(args.host, args.port, args.api_key)
        print(f"serving run {sess.run_dir} over the Tinker API\n  export TINKER_BASE_URL={srv.url}\n"
              f"  export TINKER_API_KEY={srv.api_key}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("stopping: the run directory keeps every checkpoint and metrics row", flush=True)
        finally:
            srv.close()
    return 0


def up(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rlbench-nb up", description="Start a warm cluster on this machine: a Ray head "
                                "and role processes with torch and transformers imported, which outlive kernels. A "
                                "Session() with cluster.backend=ray and no address joins it and takes warm processes "
                                "(docs/ray.md). Already up: says what it holds.")
    p.add_argument("--cpus", type=int, default=0, help="CPUs the cluster may use (default: all of this machine's)")
    p.add_argument("--warm", type=int, default=4, help="warm processes kept spare (default 4: policy, rollout, "
                   "reward, reference)")
    p.add_argument("--idle-timeout", type=float, default=30.0, metavar="MIN",
                   help="stop after this many minutes with no session connected (0: never; default 30)")
    p.add_argument("--refill-after", type=float, default=30.0, metavar="S",
                   help="seconds after a session takes warm processes before replacements start (default 30)")
    p.add_argument("--no-kernels", action="store_true", help="no warm kernel server (by default kernels of the "
                   "rlbench-nb kernelspec fork from a process with torch, transformers, Ray and the session imported)")
    args = p.parse_args(argv)
    from .cluster import warm
    st = warm.up(args.cpus, args.warm, args.idle_timeout * 60, args.refill_after, kernels=not args.no_kernels)
    rss = [w["rss_gb"] for w in st["warm"] if "rss_gb" in w]
    each = f", {sum(rss) / len(rss):.2f} GB resident each" if rss else ""
    stops = (f"stops after {st['idle_timeout_s'] / 60:g} minutes with no session connected, or `rlbench-nb down`"
             if st["idle_timeout_s"] else "stops with `rlbench-nb down`")
    pids = f" (pids {', '.join(str(w['pid']) for w in st['warm'])})" if st["warm"] else ""
    kernels = (f"warm kernels: the rlbench-nb kernelspec's kernels fork from pid {st['kernel_server']} "
               "(`rlbench-nb kernel install`)" if st["kernel_server"] else "warm kernels: off")
    print(f"warm cluster at {st['address']} (head pid {st['head_pid']})\n  spare processes: {st['spare']} of "
          f"{st['spare_target']}{pids}{each}\n  runs on it: {', '.join(st['runs']) or 'none'}\n  {kernels}\n  {stops}",
          flush=True)
    return 0


def down(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rlbench-nb down", description="Stop the warm cluster of `rlbench-nb up`: its "
                                "head, its warm processes and every run's actors on it (run directories stay).")
    p.parse_args(argv)
    from .cluster import warm
    stopped = warm.down()
    print(f"stopped the warm cluster at {stopped['address']}" if stopped else "no warm cluster is up", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    commands = {"train": train, "export": export, "report": report, "weights": weights, "kernel": kernel, "data": data,
                "doctor": doctor, "serve": serve, "up": up, "down": down}
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if argv[0] not in commands:
        import difflib
        near = difflib.get_close_matches(argv[0], commands, n=1)
        print(f"rlbench-nb: unknown command '{argv[0]}'" + (f" (did you mean '{near[0]}'?)" if near else "")
              + f"; the commands: {', '.join(commands)} (rlbench-nb --help shows each)", file=sys.stderr)
        return 2
    try:
        return commands[argv[0]](argv[1:])
    except RLBenchError as e:  # explained problems: one line; anything else is a bug and keeps its traceback
        print(f"rlbench-nb {argv[0]}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
