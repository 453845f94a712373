"""Rewrites one script-owned section of docs/benchmarks.md, leaving the others."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER = ("# jaxroll benchmarks\n\nEvery section is written by the script it names; "
          "do not edit numbers by hand.\n")


def write_section(name: str, section_body: str) -> None:
  """Replaces the text between `<!-- name:begin -->` and `<!-- name:end -->`."""
  begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
  path = os.path.join(ROOT, "docs", "benchmarks.md")
  text = open(path).read() if os.path.exists(path) else HEADER
  section = f"{begin}\n{section_body}\n{end}"
  if begin in text:
    head, rest = text.split(begin, 1)
    text = head + section + rest.split(end, 1)[1]
  else:
    text = text.rstrip("\n") + "\n\n" + section + "\n"
  with open(path, "w") as f:
    f.write(text)


def emit_section(name: str, lines: list[str], write_docs: bool) -> None:
  """Prints a benchmark's section and, with --write-docs, writes it into the docs."""
  section = "\n".join(lines)
  print(section)
  if write_docs:
    write_section(name, section)
