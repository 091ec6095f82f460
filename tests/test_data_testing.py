"""The real text the tests train and read on (tape_train/data/testing.py) is the same modules'
on every Python, whether a module is a file or, in a newer Python, a package."""

from __future__ import annotations

from tape_train.data import testing


def test_a_module_made_a_package_is_read_from_its_files(tmp_path):
    """Python 3.13 made pathlib and zipfile packages: `pathlib.py` was not found there and
    the text of both modules was silently left out."""
    (tmp_path / "argparse.py").write_text("argparse")
    (tmp_path / "pathlib").mkdir()
    (tmp_path / "pathlib" / "__init__.py").write_text("pathlib init")
    (tmp_path / "pathlib" / "_local.py").write_text("pathlib local")
    (tmp_path / "pathlib" / "__pycache__").mkdir()
    (tmp_path / "pathlib" / "__pycache__" / "stale.py").write_text("not read")
    (tmp_path / "zipfile" / "_path").mkdir(parents=True)
    (tmp_path / "zipfile" / "__init__.py").write_text("zipfile init")
    (tmp_path / "zipfile" / "_path" / "glob.py").write_text("zipfile glob")
    files = [p.relative_to(tmp_path).as_posix() for p in testing.real_text_files(tmp_path)
             if p.is_relative_to(tmp_path)]
    assert files == ["argparse.py", "pathlib/__init__.py", "pathlib/_local.py",
                     "zipfile/__init__.py", "zipfile/_path/glob.py"]


def test_the_running_pythons_modules_are_all_found():
    for name in testing._STDLIB_MODULES:
        assert testing._module_files(testing._STDLIB, name), name
