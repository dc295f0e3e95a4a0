"""Each option's default, type and help are written once, in p2pdiloco.config; the CLI is derived from them."""

import dataclasses

from click.testing import CliRunner

from p2pdiloco.cli import SECTIONS, _param_name, build_config, cli
from p2pdiloco.config import PeerConfig


def config_fields():
    return {_param_name(f): f for _, cls in SECTIONS for f in dataclasses.fields(cls) if "help" in f.metadata}


def test_every_join_option_is_a_config_field_with_the_same_default_and_help():
    fields = config_fields()
    # --profile, --nproc (which starts torchrun) and --restarts (the supervisor) act around the peer: the launch's
    params = {p.name: p for p in cli.commands["join"].params if p.name not in ("profile", "nproc", "restarts", "help")}
    assert params.keys() == fields.keys()
    for name, param in params.items():
        f = fields[name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        given = tuple(param.default) if param.multiple else param.default
        assert given == default, name
        assert param.help == f.metadata["help"] and param.hidden == f.metadata["hidden"]


def join_defaults() -> dict:
    """`join`'s options at their defaults, by parameter name (the ones that act around the peer left out)."""
    return {p.name: (tuple(p.default) if p.multiple else p.default) for p in cli.commands["join"].params
            if p.name not in ("profile", "nproc", "restarts", "help")}


def test_the_options_defaults_build_the_config_defaults():
    assert build_config(join_defaults()) == PeerConfig()


def test_the_hidden_fault_plan_is_validated_and_not_listed():
    runner = CliRunner()
    assert "--fault-plan" not in runner.invoke(cli, ["join", "--help"]).output
    result = runner.invoke(cli, ["join", "--fault-plan", "explode@1"])
    assert result.exit_code == 2 and "bad fault 'explode@1'" in result.output


def test_the_fault_plan_reaches_join_through_its_environment_variable(monkeypatch):
    from p2pdiloco import cli as cli_module

    seen = {}
    monkeypatch.setattr(cli_module, "config_or_usage_error", lambda options: seen.update(options) or 1 / 0)
    CliRunner().invoke(cli, ["join"], env={"P2PDILOCO_FAULT_PLAN": "die_in_allreduce@1"})
    assert seen["fault_plan"] == "die_in_allreduce@1"


def test_adams_betas_reach_the_inner_optimizer_and_a_bad_one_is_one_line():
    import torch

    from p2pdiloco.training.inner import make_optimizer

    weights = [torch.nn.Parameter(torch.zeros(3))]
    cfg = build_config(dict(join_defaults(), adam_beta2=0.95))
    assert make_optimizer(weights, cfg.inner).param_groups[0]["betas"] == (0.9, 0.95)
    cfg = build_config(dict(join_defaults(), adam_beta1=0.8))
    assert make_optimizer(weights, cfg.inner).param_groups[0]["betas"] == (0.8, 0.999)
    assert make_optimizer(weights, PeerConfig().inner).param_groups[0]["betas"] == (0.9, 0.999)  # docs/parity.md
    for flag, value in (("--adam-beta2", "1"), ("--adam-beta1", "-0.1")):
        result = CliRunner().invoke(cli, ["join", flag, value])
        assert result.exit_code != 0 and f"{flag} must be in [0, 1) (got {float(value)})" in result.output
