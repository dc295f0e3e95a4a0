"""`p2pdiloco`: a thin click shell. Heavy imports (torch, hivemind) happen inside commands, so --help is fast."""

from __future__ import annotations

import dataclasses
import os
import sys
import tomllib
import types
import typing
from pathlib import Path

import click

from p2pdiloco.config import ConfigError, InnerConfig, OuterConfig, PeerConfig, SwarmConfig
from p2pdiloco.sim.params import MODES as SIM_MODES, SimParams

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


PROFILE = click.option("--profile", type=click.Path(exists=True, dir_okay=False), callback=load_profile,
                       is_eager=True, expose_value=False, help="TOML file of option defaults (see peers/).")
SECTIONS = (("", PeerConfig), ("inner", InnerConfig), ("outer", OuterConfig), ("swarm", SwarmConfig))


# `join --help` lists its options under these titles, by the config section (and group) each comes from
RUN = "Model, data and the run"
HELP_SECTIONS = (((PeerConfig, "train"), RUN), ((PeerConfig, "connect"), RUN), ((InnerConfig, "train"), "Inner steps"),
                 ((OuterConfig, "train"), "Outer step"), ((SwarmConfig, "connect"), "Meeting the swarm"),
                 ((SwarmConfig, "train"), "Rounds, islands and the wire"))


def help_section_of() -> dict[str, str]:
    """Option name → its --help section."""
    titles = dict(HELP_SECTIONS)
    return {_param_name(f): titles[(cls, f.metadata["group"])] for _, cls in SECTIONS
            for f in dataclasses.fields(cls) if (cls, f.metadata.get("group")) in titles}


class Sectioned(click.Command):
    """--help lists the options by the config section each comes from (60 in one list were hard to read)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        section_of, records = help_section_of(), {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record:
                records.setdefault(section_of.get(param.name, "Other options"), []).append(record)
        for title in dict.fromkeys([t for _, t in HELP_SECTIONS] + ["Other options"]):
            if title in records:
                with formatter.section(title):
                    formatter.write_dl(records[title])


def config_options(group: str, classes=tuple(cls for _, cls in SECTIONS)) -> list:
    """The click options of every config field tagged with `group`, derived from the field: one default, type
    and help, written once in p2pdiloco.config (and p2pdiloco.sim.params)."""
    return [_click_option(f, hints[f.name]) for cls in classes
            for hints in [typing.get_type_hints(cls)] for f in dataclasses.fields(cls)
            if f.metadata.get("group") == group]


def _param_name(f: dataclasses.Field) -> str:
    return (f.metadata.get("flag") or f.name).replace("-", "_")


def _click_option(f: dataclasses.Field, hint):
    meta = f.metadata
    flag = "--" + _param_name(f).replace("_", "-")
    names = [flag, meta["short"]] if meta.get("short") else [flag]
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    base = _unoptional(hint)
    kwargs = dict(help=meta["help"], hidden=meta["hidden"], show_default=default not in (None, (), ""),
                  metavar=meta.get("metavar"))
    if meta.get("envvar"):
        kwargs["envvar"] = meta["envvar"]
    if base is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", default=default, **kwargs)
    if typing.get_origin(base) is tuple:
        return click.option(*names, multiple=True, default=list(default), **kwargs)
    kind = click.Choice(meta["choices"]) if meta.get("choices") else \
        click.Path(path_type=Path) if base is Path else base
    return click.option(*names, type=kind, default=default, **kwargs)


def _unoptional(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1 else hint


def _with(options: list):
    def decorate(f):
        for option in reversed(options):
            f = option(f)
        return f
    return decorate


def swarm_options(f):
    """How a process meets the swarm: shared by every command that joins the DHT."""
    return _with([PROFILE, *config_options("connect")])(f)


def train_options(f):
    return _with(config_options("train"))(f)


def sim_options(f):
    return _with(config_options("sim", (SimParams,)))(f)


def build_config(o: dict) -> PeerConfig:
    """Options back into the typed config: every field whose option was given (a command may offer a subset)."""
    def section(cls):
        return {f.name: _value(o[_param_name(f)]) for f in dataclasses.fields(cls)
                if "help" in f.metadata and _param_name(f) in o}

    top = section(PeerConfig)
    return PeerConfig(inner=InnerConfig(**section(InnerConfig)), outer=OuterConfig(**section(OuterConfig)),
                      swarm=SwarmConfig(**section(SwarmConfig)), **top)


def _value(v):
    return tuple(v) if isinstance(v, list) else v


def config_or_usage_error(options: dict) -> PeerConfig:
    from p2pdiloco.faults import FaultPlan, FaultPlanError

    try:
        cfg = build_config(options)
        FaultPlan.parse(cfg.swarm.fault_plan)
        return cfg
    except (ConfigError, FaultPlanError) as e:
        raise click.UsageError(str(e)) from None


def launch_ranks(nproc: int) -> typing.NoReturn:
    """This process becomes torchrun, which starts `nproc` ranks of this same command (less --nproc): the same pid,
    so a signal to it reaches the ranks as torchrun's would."""
    from p2pdiloco.ops.launcher import ranks_command, without_option

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise click.UsageError("--nproc: this process is already one of torchrun's ranks (leave --nproc out)")
    command = ranks_command(nproc, without_option(sys.argv[1:], "--nproc"))
    sys.stdout.flush()
    os.execv(command[0], command)


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="p2pdiloco")
def cli():
    """Peer-to-peer Decoupled DiLoCo: train one model with whoever is online."""


@cli.command(cls=Sectioned)
@swarm_options
@train_options
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="Train as one member of this many local processes (torchrun's ranks: one per GPU of a box, or "
              "CPU processes), as `torchrun --standalone --nproc-per-node N -m p2pdiloco.cli join ...` does.")
@click.option("--restarts", type=click.IntRange(min=0), default=5, show_default=True,
              help="Restart the peer at once after a crash (a signal such as SIGKILL or the out-of-memory killer, "
              "or an unhandled error), forked from a process that has imported its code already: it resumes from "
              "its checkpoint in about a second. This many failed starts in a row (lives that never trained) "
              "end it. 0: no supervisor.")
def join(nproc: int, restarts: int, **options):
    """Join a swarm (or start one, without --initial-peers) and train."""
    cfg = config_or_usage_error(options)
    if nproc > 1:
        launch_ranks(nproc)
    from p2pdiloco.runtime import supervise

    supervisor = None
    if restarts > 0 and supervise.supported() and "WORLD_SIZE" not in os.environ:  # torchrun restarts its ranks
        supervisor = supervise.Supervisor(supervise.RestartRule(failed_starts=restarts))
    from p2pdiloco.peer import log_file, preload, run_peer
    from p2pdiloco.runtime.logs import configure_logging

    configure_logging(log_file(cfg))
    life = supervisor.fork_lives(preload=lambda: preload(cfg)) if supervisor is not None else None
    _run_peer_or_exit(cfg, run_peer, life)


def _run_peer_or_exit(cfg: PeerConfig, run_peer, life) -> None:
    """One-line errors that need the user exit 1 (click's way); any other error is a crash, which a supervisor
    restarts."""
    from p2pdiloco.runtime.supervise import EXIT_CRASH
    from p2pdiloco.swarm.node import SwarmConnectError
    from p2pdiloco.training.checkpoint import CheckpointWriteError
    from p2pdiloco.training.data import DataError
    from p2pdiloco.training.tokenizer import TokenizerError

    try:
        run_peer(cfg, life)
    except (SwarmConnectError, DataError, TokenizerError, CheckpointWriteError, ConfigError) as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:
        import traceback

        traceback.print_exc()
        sys.exit(EXIT_CRASH)


@cli.command()
@swarm_options
@click.option("--name", default="bootstrap", show_default=True, help="Label for the address file.")
@click.option("--reduce", is_flag=True, help="Also reduce parts of the swarm's rounds (needs no model): peers that "
              "nobody can dial (--client-mode, behind a NAT) merge only through a public peer or such a node.")
def bootstrap(reduce, **options):
    """Run a DHT-only node that others join through (trains nothing). Stop it with Ctrl-C."""
    from p2pdiloco.swarm.bootstrap import run_bootstrap
    from p2pdiloco.swarm.node import SwarmConnectError

    try:
        swarm = build_config(options).swarm
        run_bootstrap(swarm, options["log_dir"], options["name"], reduce=reduce)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    except SwarmConnectError as e:
        raise click.ClickException(str(e)) from None


@cli.command()
@swarm_options
@click.option("--watch", is_flag=True, help="Refresh in place every --interval seconds until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.5), default=2.0, show_default=True,
              help="Seconds between refreshes with --watch.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one line per refresh with --watch).")
@click.option("--fragments", type=click.IntRange(min=1), default=1, show_default=True,
              help="The swarm's --fragments: each fragment's swarm is read, and each peer's fragments' versions shown.")
def status(watch, interval, as_json, fragments, **options):
    """Show the live swarm: each peer's version, speed, loss, island, traffic; the swarm's totals.

    Joins the DHT as a client through --initial-peers and trains nothing.
    """
    from p2pdiloco.ops.status import run_status
    from p2pdiloco.swarm.node import SwarmConnectError

    try:
        swarm = dataclasses.replace(build_config(options).swarm, fragments=fragments)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    if not swarm.initial_peers:
        raise click.UsageError("status needs --initial-peers: the address of any live peer of the swarm")
    try:
        run_status(swarm, as_json=as_json, watch=watch, interval=interval, echo=click.echo)
    except SwarmConnectError as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        sys.exit(130)


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


@cli.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Where the PNGs and report.html go (default: FIRST_RUN_DIR/report).")
def report(run_dirs, out):
    """Plots and a self-contained report.html from the peers' metrics (the JSONL in each RUN_DIR, a --log-dir).

    Several RUN_DIRs are drawn side by side (e.g. a clean run and one with a hostile peer).
    """
    from p2pdiloco.ops.report import ReportError, write_report

    try:
        made = write_report(run_dirs, out or run_dirs[0] / "report")
    except ReportError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{len(made.pngs)} charts in {made.html.parent}")
    click.echo(f"report: {made.html}")


@cli.command()
@click.option("--mode", type=click.Choice(["all", *SIM_MODES]), default="all",
              show_default=True, help="Which mode to simulate; all: every mode side by side.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: goodput and uptime (per mode with --mode all).")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write a PNG of goodput against M and against the chip MTBI.")
@sim_options
def simulate(mode, as_json, plot, **options):
    """Simulate goodput of N chips in M learners under chip failures (dp, elastic, sync-diloco, decoupled).

    The decoupled mode runs the peers' own round protocol on a simulated clock. Every assumption is an option.
    """
    import json

    from p2pdiloco.sim.report import params_dict, plot as plot_png, table
    from p2pdiloco.sim.run import simulate as run

    try:
        params = SimParams(**{_param_name(f): options[_param_name(f)] for f in dataclasses.fields(SimParams)})
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    modes = list(SIM_MODES) if mode == "all" else [mode]
    results = [run(params, m) for m in modes]
    if as_json:
        body = results[0].as_dict() if mode != "all" else {"modes": {r.mode: r.as_dict() for r in results}}
        click.echo(json.dumps(dict(body, params=params_dict(params))))
    else:
        click.echo(table([(f"M={params.learners}", r) for r in results]))
    if plot:
        click.echo(f"plot: {plot_png(params, modes, plot)}", err=as_json)


@cli.group()
def tokenizer():
    """Tokenizers: train a BPE on your own text (offline)."""


@tokenizer.command("train")
@click.argument("sources", nargs=-1, required=True, metavar="SOURCES...")
@click.option("--vocab-size", type=int, default=8192, show_default=True, help="Ids in all, the end-of-text mark "
              "and the 256 bytes included.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Folder for the tokenizer's files (what --tokenizer and AutoTokenizer load).")
@click.option("--text-field", default="text", show_default=True, help="The text's field in JSONL and Parquet.")
@click.option("--max-documents", type=click.IntRange(min=1), help="Train on at most this many documents.")
def tokenizer_train(sources, vocab_size, out, text_field, max_documents):
    """Train a byte-level BPE tokenizer on SOURCES (text files or folders, JSONL, Parquet, a hub dataset id, or
    builtin:shakespeare)."""
    import itertools

    from p2pdiloco.training.prepare import iter_texts
    from p2pdiloco.training.shards import DataError
    from p2pdiloco.training.tokenizer import TokenizerError, train_bpe

    if (out / "tokenizer.json").exists():
        raise click.ClickException(f"{out} already holds a tokenizer; choose another --out")
    try:
        texts = itertools.islice(iter_texts(sources, text_field), max_documents)
        tok = train_bpe(texts, vocab_size, show_progress=sys.stderr.isatty())
    except (DataError, TokenizerError) as e:
        raise click.ClickException(str(e)) from None
    tok.save_pretrained(str(out))
    click.echo(f"tokenizer of {len(tok)} ids in {out}")


@cli.group()
def data():
    """Token datasets: prepare shards that peers read a window at a time."""


@data.command("prepare")
@click.argument("sources", nargs=-1, required=True, metavar="SOURCES...")
@click.option("--tokenizer", "tokenizer_spec", default="bytes", show_default=True,
              help="bytes, a tokenizer folder, or a hub id.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The dataset's folder (an interrupted prepare into it resumes).")
@click.option("--shard-tokens", type=click.IntRange(min=1024), default=1 << 26, show_default=True,
              help="Tokens per training shard (whole documents: a shard ends after the one that fills it).")
@click.option("--val-tokens", type=click.IntRange(min=1), default=1 << 20, show_default=True,
              help="Tokens held out for the fixed validation shard (every 20th document, until it holds this).")
@click.option("--text-field", default="text", show_default=True, help="The text's field in JSONL and Parquet.")
@click.option("--subset", help="A hub dataset's configuration (e.g. sample-10BT).")
def data_prepare(sources, tokenizer_spec, out, shard_tokens, val_tokens, text_field, subset):
    """Tokenize SOURCES (text files or folders, JSONL, Parquet, a hub dataset id, or builtin:shakespeare) into
    token shards in OUT."""
    import time

    from tqdm import tqdm

    from p2pdiloco.training.prepare import Plan, prepare, source_bytes
    from p2pdiloco.training.shards import DataError
    from p2pdiloco.training.tokenizer import TokenizerError

    plan = Plan(sources=tuple(sources), tokenizer=tokenizer_spec, out=out, shard_tokens=shard_tokens,
                val_tokens=val_tokens, text_field=text_field, subset=subset)
    started = time.monotonic()
    try:
        with tqdm(total=source_bytes(sources), unit="B", unit_scale=True, desc="prepare", mininterval=1,
                  disable=None) as bar:
            manifest = prepare(plan, on_bytes=bar.update)
    except (DataError, TokenizerError) as e:
        raise click.ClickException(str(e)) from None
    seconds = time.monotonic() - started
    click.echo(f"{manifest['train_tokens']:,} training tokens in {len(manifest['shards'])} shards, "
               f"{manifest['val']['tokens']:,} validation tokens, from {manifest['text_bytes'] / 1e6:.1f} MB of "
               f"text in {seconds:.1f} s ({manifest['text_bytes'] / 1e6 / max(seconds, 1e-9):.2f} MB/s): {out}")


@cli.command("export")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The Hugging Face folder to write (config.json, model.safetensors, the tokenizer).")
def export_command(checkpoint, out):
    """Write the global model of CHECKPOINT (a checkpoint, a peer's or a run's folder: the newest) for transformers."""
    from p2pdiloco.training.export import ExportError, export

    try:
        exported = export(checkpoint, out)
    except ExportError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"version {exported.version} of {exported.checkpoint} written to {out}: load it with "
               f"AutoModelForCausalLM.from_pretrained({str(out)!r})")


@cli.command("sample")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--prompt", default="", help="Text to continue.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.8, show_default=True,
              help="0: the likeliest token each time.")
@click.option("--seed", type=int, default=0, show_default=True)
def sample_command(checkpoint, prompt, max_new_tokens, temperature, seed):
    """Print a continuation of --prompt by the global model of CHECKPOINT (as `export` finds it), or by a folder
    `export` wrote."""
    from p2pdiloco.training.export import ExportError, load_exported, sample

    try:
        exported = load_exported(checkpoint)
    except ExportError as e:
        raise click.ClickException(str(e)) from None
    click.echo(prompt + sample(exported, prompt, max_new_tokens, temperature, seed=seed))


def main():
    cli(prog_name="p2pdiloco")


if __name__ == "__main__":
    main()
