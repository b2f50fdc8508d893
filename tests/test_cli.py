"""The graphgrad command line, run in-process."""

import re

import pytest

from graphgrad import _cli


def test_help_lists_the_commands(capsys):
  with pytest.raises(SystemExit) as exit_info:
    _cli.main(["--help"])
  assert exit_info.value.code == 0
  assert "demo" in capsys.readouterr().out


def test_no_command_prints_help_and_fails(capsys):
  assert _cli.main([]) == 2
  assert "usage: graphgrad" in capsys.readouterr().out


def test_demo_trains_both_runs(capsys):
  assert _cli.main(["demo", "--steps", "40", "--seed", "1"]) == 0
  out = capsys.readouterr()
  assert "l1_dense -> l2_dense" in out.out  # the layer table
  rows = {}
  for line in out.out.splitlines():
    m = re.match(r"(plain backprop|graphgrad plan)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
                 line)
    if m:
      rows[m.group(1)] = [float(v) for v in m.groups()[1:]]
  assert set(rows) == {"plain backprop", "graphgrad plan"}
  for train_loss, test_loss, acc in rows.values():
    assert 0 < train_loss < 0.6931 and 0 < test_loss  # better than chance
    assert 0.5 < acc <= 1.0
  assert "40/40" in out.err  # the progress output


def test_demo_rejects_bad_steps(capsys):
  with pytest.raises(SystemExit) as exit_info:
    _cli.main(["demo", "--steps", "0"])
  assert exit_info.value.code == 2
  assert "--steps must be at least 1" in capsys.readouterr().err
