"""The mqds command line without a cluster: every option is explained, times parse, usage errors are clear."""

from __future__ import annotations

import argparse
import datetime
import io

import pytest

from mqds.cli import build_parser, main, plugins
from mqds.cli.console import ProgressLine, format_time_us, parse_time, table

NOW_S = 1_750_000_000.0


def parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser of the command tree, with the words that reach it."""
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found += parsers(child, (*path, name))
    return found


COMMANDS = [path for path, _ in parsers(build_parser())]


def test_the_command_tree_has_every_command() -> None:
    assert {" ".join(p) for p in COMMANDS} >= {
        "status",
        "pub",
        "replay",
        "generations list",
        "generations add",
        "generations drop",
        "backup",
        "restore",
        "admin join",
        "admin leave",
        "admin forget",
        "admin rebalance",
        "cluster up",
        "cluster down",
        "cluster kill",
        "cluster start",
        "bench",
    }


def _command_help(command: str | None) -> dict[str, str]:
    """Each command's one-line help in ``mqds --help``, with only ``command``'s package loaded (None: all)."""
    sub = next(a for a in build_parser(command)._actions if isinstance(a, argparse._SubParsersAction))
    return {choice.dest: str(choice.help) for choice in sub._choices_actions}


def test_the_other_packages_commands_are_listed_alike_loaded_or_not() -> None:
    """``mqds.cli.plugins.KNOWN`` repeats each plugin command's one-line help, so ``mqds status`` can list them
    without importing them: it must say what the command itself says."""
    loaded = _command_help(None)
    assert {name: loaded[name] for name in plugins.KNOWN} == {name: what for name, (_, what) in plugins.KNOWN.items()}
    assert _command_help("status") == loaded


def test_the_chaos_runner_is_not_an_mqds_command(capsys: pytest.CaptureFixture[str]) -> None:
    """The fault-injection runner is a test tool with an entry point of its own (python -m mqds.chaos)."""
    assert "chaos" not in {path[0] for path in COMMANDS if path}
    with pytest.raises(SystemExit) as exit_info:
        main(["chaos", "--help"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'chaos'" in capsys.readouterr().err


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "mqds")
def test_help_explains_every_option(path: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    parser = dict(parsers(build_parser()))[path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        assert action.help and action.help != argparse.SUPPRESS, f"{' '.join(path)}: {action.dest} has no help"
    if path:
        assert parser.description, f"{' '.join(path)} has no description"
    with pytest.raises(SystemExit) as exit_info:
        main([*path, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: mqds {' '.join(path)}".rstrip())
    for action in parser._actions:
        for option in action.option_strings:
            assert option in out


@pytest.mark.parametrize(
    ("text", "expected_s"),
    [
        ("10m", NOW_S - 600),
        ("2h", NOW_S - 7200),
        ("1h30m", NOW_S - 5400),
        ("90s", NOW_S - 90),
        ("1.5d", NOW_S - 1.5 * 86400),
        ("250ms", NOW_S - 0.25),
        ("1w", NOW_S - 7 * 86400),
        ("now", NOW_S),
        ("2025-05-01T12:00:00Z", datetime.datetime(2025, 5, 1, 12, tzinfo=datetime.UTC).timestamp()),
        ("2025-05-01T14:00:00+02:00", datetime.datetime(2025, 5, 1, 12, tzinfo=datetime.UTC).timestamp()),
        ("2025-05-01T12:00:00.250000Z", datetime.datetime(2025, 5, 1, 12, tzinfo=datetime.UTC).timestamp() + 0.25),
    ],
)
def test_parse_time(text: str, expected_s: float) -> None:
    assert parse_time(text, now_s=NOW_S) == int(expected_s * 1_000_000)


def test_a_time_without_zone_is_local_time() -> None:
    local = datetime.datetime(2025, 5, 1, 12, 0).astimezone()
    assert parse_time("2025-05-01 12:00", now_s=NOW_S) == int(local.timestamp() * 1_000_000)


@pytest.mark.parametrize("text", ["", "10x", "m10", "yesterday", "10 parsecs", "2025-13-01", "-5m"])
def test_parse_time_rejects_what_it_cannot_read(text: str) -> None:
    with pytest.raises(ValueError, match="is not a time: use ISO-8601"):
        parse_time(text, now_s=NOW_S)


def test_printed_times_parse_back() -> None:
    us = 1_746_100_800_123_456
    assert format_time_us(us) == "2025-05-01T12:00:00.123456Z"
    assert parse_time(format_time_us(us)) == us


def test_table_aligns_columns() -> None:
    assert table(["A", "NUM"], [["x", 1], ["long", 100]], right=(1,)).splitlines() == [
        "A     NUM",
        "x       1",
        "long  100",
    ]


def test_a_progress_line_on_a_pipe_prints_whole_lines_at_a_steady_pace() -> None:
    out = io.StringIO()
    line = ProgressLine(out, every_s=3600)
    for i in range(5):
        line.show(f"{i} of 4")
    line.show("4 of 4 [done]", final=True)
    assert out.getvalue() == "0 of 4\n4 of 4 [done]\n"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_progress_line_on_a_terminal_is_redrawn_in_place_and_ends_its_line() -> None:
    out = _Terminal()
    line = ProgressLine(out)
    line.show("1 of 2 [a]")
    line.show("2 of 2 [b]", final=True)
    print("next", file=out)
    text = out.getvalue()
    assert "1 of 2 [a]\r" in text  # brackets shown as they are; the line is redrawn, not added to
    screen = [part.split("\r")[-1].replace("\x1b[2K", "") for part in text.split("\n")]
    assert screen[-3:] == ["2 of 2 [b]", "\x1b[?25hnext", ""]  # the last state stays, on a line of its own


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--endpoints", "nonsense", "status"], "endpoint 'nonsense' is not host:port"),
        (["replay", "#", "--since", "later"], "--since: 'later' is not a time"),
        (["replay", "a/#/b"], "filter 'a/#/b'"),
        (["pub", "a/+", "-m", "x"], "topic 'a/+'"),
        (["pub", "a", "-m", "x", "--count", "0"], "--count and --batch must be at least 1"),
        (["bench", "--publishers", "0"], "--publishers must be at least 1"),
        (["bench", "--in-flight", "0"], "--in-flight must be at least 1"),
        (["bench", "--in-flight", "4", "--rate", "100"], "give --rate or --in-flight, not both"),
        (["bench", "--small-writes", "--kill-leader"], "--small-writes runs its own scenarios"),
        (["bench", "--small-writes", "--rounds", "0"], "--rounds must be at least 1"),
        (["bench", "--peer-anchors", "anchors"], "--peer-anchors sets the peer beside the figures of --small-writes"),
        (["bench", "--small-writes", "--peer-python", "python3"], "go with --peer-anchors DIR"),
        (["bench", "--reconnect-storm", "--sessions", "0"], "--sessions must be at least 1"),
        (["bench", "--reconnect-storm", "--backlog", "0"], "--backlog must be at least 1"),
        (["bench", "--reconnect-storm", "--sessions", "2", "--filters", "3"], "--filters must be at most --sessions"),
        (["bench", "--reconnect-storm", "--window", "-1"], "--window must be 0 or more"),
        (["bench", "--reconnect-storm", "--kill-leader"], "--reconnect-storm runs its own scenario"),
        (["bench", "--session-soak", "--soak-clients", "0"], "--soak-clients and --soak-in-flight must be at least 1"),
        (["bench", "--session-soak", "--soak-expiry", "-1"], "--soak-expiry 0 or more"),
        (["bench", "--session-soak"], "--session-soak measures the nodes: give --start-cluster or --data-dir"),
        (["generations", "drop", "-1", "1"], "SHARD and GENERATION must be 0 or more"),
    ],
)
def test_usage_mistakes_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The endpoint is never dialled: each mistake is caught before any call.
    assert main(["--endpoints", "127.0.0.1:9", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_a_missing_argument_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generations", "drop", "1"])
    assert exit_info.value.code == 2
    assert "the following arguments are required: GENERATION" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["backup"], "--to PLACE is required (or --verify PLACE)"),
        (["backup", "--to", "a", "--verify", "b"], "give either --to PLACE or --verify PLACE"),
    ],
)
def test_backup_usage_mistakes_are_named(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert says in capsys.readouterr().err
