"""`p2pdiloco`: a thin click shell. Heavy imports (torch, hivemind) happen inside commands, so --help is fast."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import click

from p2pdiloco.config import (APPLICATIONS, MODEL_SIZES, MODES, WEIGHTINGS, ConfigError, InnerConfig, OuterConfig,
                              PeerConfig, SwarmConfig)

CONTEXT = dict(help_option_names=["-h", "--help"], auto_envvar_prefix="P2PDILOCO", max_content_width=110)


def load_profile(ctx: click.Context, _param, path):
    """Profile values become option defaults; flags given on the command line still win."""
    if path is None:
        return None
    try:
        values = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise click.BadParameter(f"cannot read profile {path}: {e}") from None
    known = {p.name for p in ctx.command.params}
    unknown = sorted(set(values) - known)
    if unknown:
        raise click.BadParameter(f"profile {path} has unknown keys: {', '.join(unknown)}")
    ctx.default_map = {**(ctx.default_map or {}), **values}
    return path


def swarm_options(f):
    options = [
        click.option("--profile", type=click.Path(exists=True, dir_okay=False), callback=load_profile,
                     is_eager=True, expose_value=False, help="TOML file of option defaults (see peers/)."),
        click.option("--initial-peers", multiple=True, metavar="MADDR",
                     help="Multiaddr of any live peer; repeat for several. None: start a new swarm."),
        click.option("--listen", multiple=True, default=["/ip4/127.0.0.1/tcp/0"], show_default=True,
                     metavar="MADDR", help="Address to listen on; use /ip4/0.0.0.0/tcp/PORT to accept remote peers."),
        click.option("--announce", multiple=True, metavar="MADDR",
                     help="Public address others should dial (explicit port), e.g. /ip4/PUBLIC_IP/tcp/PORT."),
        click.option("--identity", type=click.Path(dir_okay=False, path_type=Path),
                     help="Private key file: keeps this peer's id stable across restarts (created if missing)."),
        click.option("--nat-traversal/--no-nat-traversal", default=False, show_default=True,
                     help="hivemind NAT port mapping, autonat and relays (they probe the real network)."),
        click.option("--run-id", default="p2pdiloco", show_default=True, help="Swarm name; peers of a run share it."),
        click.option("--connect-timeout", type=float, default=20.0, show_default=True,
                     help="Seconds to wait for the initial peers before giving up."),
        click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/logs"),
                     show_default=True, help="Where logs, metrics (JSONL) and address files go."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def train_options(f):
    options = [
        click.option("--model", type=click.Choice(list(MODEL_SIZES)), default="small", show_default=True),
        click.option("--data", type=click.Path(exists=True, path_type=Path),
                     help="Text file or folder of text files. Default: the built-in Shakespeare corpus."),
        click.option("--inner-steps", "-H", type=int, default=50, show_default=True, help="Inner steps per round."),
        click.option("--inner-lr", type=float, default=1e-3, show_default=True),
        click.option("--batch-size", type=int, default=16, show_default=True),
        click.option("--seq-len", type=int, default=128, show_default=True),
        click.option("--outer-lr", type=float, default=0.7, show_default=True),
        click.option("--outer-momentum", type=float, default=0.9, show_default=True),
        click.option("--weighting", type=click.Choice(WEIGHTINGS), default="tokens2", show_default=True,
                     help="Merge weights: tokens²/steps (Decoupled DiLoCo), tokens, or uniform."),
        click.option("--rda/--no-rda", default=False, show_default=True,
                     help="Radial-directional averaging of non-embedding tensors."),
        click.option("--application", type=click.Choice(APPLICATIONS), default="delayed", show_default=True,
                     help="While a round is in flight, train on from the local model and rebase onto the merge when "
                          "it lands (delayed), or from an estimate of the next global model (eager)."),
        click.option("--round-seconds", type=float,
                     help="Time-budgeted H: contribute every this many seconds instead of every H steps."),
        click.option("--mode", type=click.Choice(MODES), default="decoupled", show_default=True,
                     help="decoupled: rounds run in the background; sync: everyone waits for everyone."),
        click.option("--quorum", type=int, default=1, show_default=True,
                     help="Fewest members for a round to merge (1: a lone peer applies its own update)."),
        click.option("--max-island", type=int, default=16, show_default=True, help="Largest all-reduce group."),
        click.option("--grace-gamma", type=float, default=0.5, show_default=True,
                     help="γ of the adaptive grace window: γ·(τ·step − quorum − sync), from measured averages."),
        click.option("--overlap-steps", type=int, help="τ: inner steps a round may run in flight (default H: the next contribution is due then)."),
        click.option("--max-staleness", type=int, default=2, show_default=True,
                     help="Contribute from up to this many versions behind; further behind, catch up first."),
        click.option("--sync-wait", type=float, default=60.0, show_default=True,
                     help="Sync mode: longest wait at a round for peers still training, in seconds."),
        click.option("--bandwidth-mbps", type=float, default=100.0, show_default=True,
                     help="Assumed link speed until the first round measures it (all-reduce deadlines)."),
        click.option("--eval-every", type=int, default=1, show_default=True,
                     help="Evaluate after every N merged rounds (0: only at start and end)."),
        click.option("--max-rounds", type=int, help="Leave after this many rounds."),
        click.option("--max-time", type=float, help="Leave after this many seconds of training."),
        click.option("--checkpoint-dir", type=click.Path(file_okay=False, path_type=Path),
                     default=Path("runs/checkpoints"), show_default=True,
                     help="Checkpoints go to CHECKPOINT_DIR/NAME; a restarted peer resumes from there."),
        click.option("--checkpoint-every", type=int, default=5, show_default=True,
                     help="Merged rounds between checkpoints (one is always written on leaving; 0: never)."),
        click.option("--keep-checkpoints", type=int, default=3, show_default=True),
        click.option("--threads", type=int, default=0, show_default=True, help="torch threads (0: torch's default)."),
        click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N."),
        click.option("--throttle", type=float, default=1.0, show_default=True,
                     help="Slow each inner step by this factor (emulates a slower machine)."),
        click.option("--seed", type=int, default=0, show_default=True, help="Initial weights (same for the run)."),
        click.option("--name", help="Label for logs and metrics (default: end of the peer id)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def build_config(o: dict) -> PeerConfig:
    swarm = SwarmConfig(run_id=o["run_id"], initial_peers=tuple(o["initial_peers"]), listen=tuple(o["listen"]),
                        announce=tuple(o["announce"]), identity=o["identity"], nat_traversal=o["nat_traversal"],
                        mode=o["mode"], quorum=o["quorum"], max_island=o["max_island"],
                        grace_gamma=o["grace_gamma"], overlap_steps=o["overlap_steps"],
                        max_staleness=o["max_staleness"], sync_wait=o["sync_wait"],
                        bandwidth_mbps=o["bandwidth_mbps"], connect_timeout=o["connect_timeout"])
    inner = InnerConfig(steps=o["inner_steps"], lr=o["inner_lr"], batch_size=o["batch_size"], seq_len=o["seq_len"],
                        round_seconds=o["round_seconds"])
    outer = OuterConfig(lr=o["outer_lr"], momentum=o["outer_momentum"], weighting=o["weighting"], rda=o["rda"],
                        application=o["application"])
    return PeerConfig(model=o["model"], data=o["data"], seed=o["seed"], inner=inner, outer=outer, swarm=swarm,
                      max_rounds=o["max_rounds"], max_time=o["max_time"], throttle=o["throttle"],
                      eval_every=o["eval_every"],
                      threads=o["threads"], device=o["device"], log_dir=o["log_dir"],
                      checkpoint_dir=o["checkpoint_dir"], checkpoint_every=o["checkpoint_every"],
                      keep_checkpoints=o["keep_checkpoints"], name=o["name"])


def config_or_usage_error(options: dict) -> PeerConfig:
    try:
        return build_config(options)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="p2pdiloco")
def cli():
    """Peer-to-peer Decoupled DiLoCo: train one model with whoever is online."""


@cli.command()
@swarm_options
@train_options
def join(**options):
    """Join a swarm (or start one, without --initial-peers) and train."""
    cfg = config_or_usage_error(options)
    from p2pdiloco.training.data import DataError
    from p2pdiloco.peer import configure_logging, run_peer
    from p2pdiloco.swarm.node import SwarmConnectError

    configure_logging(cfg.log_dir / f"{cfg.name}.log" if cfg.name else None)
    try:
        run_peer(cfg)
    except (SwarmConnectError, DataError) as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        sys.exit(130)


@cli.command()
@swarm_options
@click.option("--name", default="bootstrap", show_default=True, help="Label for the address file.")
def bootstrap(**options):
    """Run a DHT-only node that others join through (trains nothing). Stop it with Ctrl-C."""
    from p2pdiloco.swarm.bootstrap import run_bootstrap
    from p2pdiloco.swarm.node import SwarmConnectError

    try:
        swarm = SwarmConfig(run_id=options["run_id"], initial_peers=tuple(options["initial_peers"]),
                            listen=tuple(options["listen"]), announce=tuple(options["announce"]),
                            identity=options["identity"], nat_traversal=options["nat_traversal"],
                            connect_timeout=options["connect_timeout"])
        run_bootstrap(swarm, options["log_dir"], options["name"])
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    except SwarmConnectError as e:
        raise click.ClickException(str(e)) from None


@cli.command(context_settings=dict(ignore_unknown_options=True))
@click.option("--peers", "-n", type=int, default=3, show_default=True, help="Training peers to start.")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/swarm"),
              show_default=True)
@click.option("--stagger", type=float, default=1.0, show_default=True, help="Seconds between peer starts.")
@click.option("--resume/--fresh", default=False, show_default=True,
              help="Resume from the checkpoints of the previous local swarm in LOG_DIR, or start afresh.")
@click.argument("join_args", nargs=-1, type=click.UNPROCESSED)
def swarm(peers, log_dir, stagger, resume, join_args):
    """Start a local swarm: a bootstrap node plus N training peers, each logging to a file.

    Extra arguments go to every `p2pdiloco join` (e.g. --model tiny --max-rounds 5).
    Ctrl-C stops exactly the processes started here.
    """
    from p2pdiloco.ops.launcher import LaunchError, run_local_swarm

    if peers < 1:
        raise click.UsageError("--peers must be at least 1")
    try:
        summaries = run_local_swarm(peers, log_dir, list(join_args), stagger=stagger, resume=resume)
    except LaunchError as e:
        raise click.ClickException(str(e)) from None
    if not summaries or any(s is None for s in summaries.values()):
        raise click.ClickException(f"some peers did not finish; see the logs in {log_dir}")


def main():
    cli(prog_name="p2pdiloco")


if __name__ == "__main__":
    main()
