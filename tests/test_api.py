"""The public API: one screen, every name resolves."""

import graphgrad as gg


def test_every_public_name_resolves():
  for name in gg.__all__:
    assert getattr(gg, name) is not None, name
  for name in gg.transforms.__all__:
    assert getattr(gg.transforms, name) is not None, name
  for name in gg.backward.__all__:
    assert getattr(gg.backward, name) is not None, name


def test_error_hierarchy():
  assert issubclass(gg.LayerNotFoundError, gg.GraphGradError)
  assert issubclass(gg.LayerNotFoundError, KeyError)
  for cls in (gg.NotConnectedError, gg.IncompatibleGradientError,
              gg.UnsupportedGraphError):
    assert issubclass(cls, gg.GraphGradError) and issubclass(cls, ValueError)
  # KeyError's repr-quoting is undone so the message reads plainly.
  assert str(gg.LayerNotFoundError("no layer named 'x'")) == "no layer named 'x'"
