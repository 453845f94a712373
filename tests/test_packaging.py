"""The package list setup.py installs covers every source folder of the tree."""

import os
import runpy

import setuptools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_source_folder_is_an_installed_package(monkeypatch):
  captured = {}
  monkeypatch.setattr(setuptools, "setup", lambda **kw: captured.update(kw))
  monkeypatch.chdir(ROOT)
  runpy.run_path(os.path.join(ROOT, "setup.py"))
  installed = set(captured["packages"])
  # Every folder holding Python sources, named as it installs.
  expected = set()
  for top, name in (("jaxroll", "jaxroll"), ("kernels", "jaxroll.kernels")):
    for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
      dirs[:] = [d for d in dirs if d != "__pycache__"]
      if any(f.endswith(".py") for f in files):
        rel = os.path.relpath(folder, os.path.join(ROOT, top))
        expected.add(name if rel == "." else name + "." + rel.replace(os.sep, "."))
  assert expected - installed == set(), "folders a wheel would leave out (add an __init__.py)"
  assert captured["package_dir"] == {"jaxroll.kernels": "kernels"}
  assert "jaxroll.pipeline" in installed  # the one a hand-written list once missed
