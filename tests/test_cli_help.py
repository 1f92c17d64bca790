"""`diloco COMMAND --help`: every option is described, and its default is stated once (by the
help text, or appended when the text does not state it), never as "default: None"."""

import argparse

import pytest

from pipelines.commands.cli import build_parser


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _options(command: argparse.ArgumentParser):
    return [a for a in command._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_option_is_described_and_its_default_stated_once(name):
    command = _commands()[name]
    formatter = command.formatter_class(prog=f"diloco {name}")
    for action in _options(command):
        assert action.help, f"diloco {name} {action.option_strings[0]} has no help"
        text = formatter._get_help_string(action) % {"default": action.default}
        assert "default: None" not in text, (name, action.option_strings, text)
        assert text.lower().count("default") <= max(1, action.help.lower().count("default")), \
            (name, action.option_strings, text)
    assert "(default: None)" not in command.format_help()


def test_chaos_says_it_kills_the_syncer_too():
    assert "syncer" in _commands()["demo"]._option_string_actions["--chaos"].help
