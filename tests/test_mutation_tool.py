"""tools/mutation_tape.py stays runnable: every mutant names text the current code holds once.

The tool refuses to run when one does not (a stale mutant would "survive" silently), so a
refactor of the TAPE code that leaves tools/mutants_tape.yaml behind fails here, not the next
time someone measures the tests with it (docs/mutation.md).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_tool():
    spec = importlib.util.spec_from_file_location("mutation_tape",
                                                  ROOT / "tools" / "mutation_tape.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module      # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_every_mutant_names_text_of_the_current_code(capsys):
    tool = load_tool()
    assert tool.main(["--list"]) == 0, capsys.readouterr().err
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == len(tool.load_mutants()) > 0


def test_a_stale_mutant_stops_the_tool(monkeypatch, capsys):
    tool = load_tool()
    stale = tool.Mutant("M99", "tape_train/model/pe/tape.py", "text the code does not hold",
                        "x", "stale")
    monkeypatch.setattr(tool, "load_mutants", lambda: [stale])
    assert tool.main(["--list"]) == 2
    assert "M99" in capsys.readouterr().err
